// rows_block: rows longer than a warp holds, K CTAs a row (a cluster on sm_90 when K > 1), each
// thread holding a chunk of its CTA's slice in registers.
//
// Table rows: forward fp32 1025-8192 (all sm), forward / backward past 1024 where rows_smem_* do not
// run (sm_80, tensors not 16-byte aligned, scalar rows, rows no shared-memory shape holds).
// Bytes: forward 1 read + 1 write an element (fp32 (16384, 4096): 537 MB, 128 us at 4.2 TB/s),
// backward 2 reads + 1 write; a slice of more than one chunk re-reads its chunks from L2.
// Algorithm: a thread holds 64 bytes (backward 32 of x and 32 of dy) of each chunk; K is the smallest
//   power of two leaving a CTA at most kCtaChunks chunks of kBlockThreads threads. One combined
//   reduction of (max, sum) pairs (backward: the two sums) a row: shuffles, one __syncthreads, and
//   for clusters one exchange through distributed shared memory (row_reduce). Looped slices take an
//   online max / rescaled sum, then the write pass re-reads them last chunk first (the last is
//   still in registers). fp32 forward slices of one chunk take the exact max first and keep each
//   exp for the write pass.
// Why: the fp32 1025-8192 forward against the shared-memory kernels, H100, % of copy: packed 1100 /
// 2048 / 4096 / 8192 97.2 / 98.9 / 98.6 / 94.2 -> 100.1 / 99.9 / 99.3 / 96.5; and the fallback
// everywhere else (re-reading a second chunk from L2 measured cheaper than a larger cluster) (D-16,
// D-19).
#include "softmax.cuh"

namespace fk::softmax {
namespace {

// Elements per thread per chunk: 64 bytes forward, 32 bytes of each of x and dy backward (the
// scalar path keeps 8 of each: a register apiece), within the 64 registers of 2 x 512 threads.
template <typename T, int VEC> __host__ __device__ constexpr int block_elems_fwd() { return block_elems(sizeof(T), VEC, false); }
template <typename T, int VEC> __host__ __device__ constexpr int block_elems_bwd() { return block_elems(sizeof(T), VEC, true); }

// Elements left from a thread's first access, as an int in [-1, chunk].
__device__ __forceinline__ int clamp_offset(int64_t left, int64_t chunk) {
    return (int)(left < 0 ? -1 : (left > chunk ? chunk : left));
}

// Elements of a thread's chunk that a pass takes: offsets [lo, hi) from its first access (lo is
// above -1 only in the chunk holding a ragged row's lead).
struct Span {
    int lo, hi;
    // element k of access p; without a mask (kCausal false) whole accesses are in or out (slices
    // and n are multiples of VEC, lo is -1) and k is not looked at
    template <bool kCausal, int VEC> __device__ __forceinline__ bool has(int p, int k) const {
        const int j = p * 32 * VEC + (kCausal ? k : 0);
        return (!kCausal || j >= lo) && j < hi;
    }
    // the elements below `stop` of the chunk whose first access (this thread's) is at `first`, in a
    // frame whose row starts at `lead`
    template <bool kCausal>
    static __device__ __forceinline__ Span of(int lead, int64_t first, int64_t stop, int64_t chunk) {
        return Span{kCausal ? clamp_offset(lead - first, chunk) : -1, clamp_offset(stop - first, chunk)};
    }
};

// Stores a row-block thread's chunk (P accesses of VEC elements, 32 * VEC apart, from `out`): element
// (p, k) is value(p, k); accesses from outs.hi on hold none of the row's outputs.
template <typename T, int VEC, int P, bool kCausal, typename Value>
__device__ __forceinline__ void store_chunk(T *out, Span outs, Value value) {
#pragma unroll
    for (int p = 0; p < P; p++) {
        if (p * 32 * VEC < outs.hi) {
            float o[VEC];
#pragma unroll
            for (int k = 0; k < VEC; k++) o[k] = value(p, k);
            store_in<T, VEC, kCausal>(out + p * 32 * VEC, o, p * 32 * VEC, outs.lo, outs.hi);
        }
    }
}

template <typename T, int VEC, bool kCausal, bool kLog>
__global__ void __launch_bounds__(kBlockThreads, 2)
softmax_fwd_rows_block(int64_t n, int64_t seg, int cluster_k, const T *__restrict__ x, T *__restrict__ y,
                       float *__restrict__ row_max, float scale, int64_t causal_sq) {
    constexpr int C = block_elems_fwd<T, VEC>(), P = C / VEC;
    __shared__ RowReduceSmem<float2> smem;       // the in-register path's max
    __shared__ RowReduceSmem<Acc2<T>> sum_smem;  // its sum; the looped path's (max, sum) pairs
    kernel_start(nullptr, 0, cluster_k, smem, sum_smem);
    const int64_t row = blockIdx.x / cluster_k;
    const int rank = blockIdx.x % cluster_k;
    // the tensor's last row (ragged rows, masked instances): its last access stops at the tensor's end
    const bool last = kCausal && row == gridDim.x / cluster_k - 1;
    // slices of the row's frame (row_lead): its keys are [lead, lead + causal_len)
    const int lead = kCausal ? row_lead<VEC>(row, n) : 0;
    const int64_t begin = rank * seg, end = min(lead + n, begin + seg);
    const int64_t load_end = kCausal ? min(end, lead + causal_len(row, n, causal_sq)) : end;
    const int64_t chunk = (int64_t)blockDim.x * C;
    const int64_t chunks = end > begin ? (end - begin + chunk - 1) / chunk : 1;
    // Each warp owns 32 * C consecutive elements of a chunk, so a thread's accesses sit at constant
    // offsets (p * 32 * VEC) from one pointer: no per-access 64-bit address arithmetic.
    const int64_t lane_off = (int64_t)(threadIdx.x >> 5) * 32 * C + (threadIdx.x & 31) * VEC;
    const T *xr = x + row * n - lead + lane_off;
    T *yr = y + row * n - lead + lane_off;
    Raw<T, VEC> raw[P];

    // this thread's elements of the chunk at `start` below `stop`, from the lead on
    auto span = [&](int64_t start, int64_t stop) { return Span::of<kCausal>(lead, start + lane_off, stop, chunk); };
    auto is_key = [](int p, int k, Span keys) { return keys.has<kCausal, VEC>(p, k); };
    // an access is read when it holds a key (lo < VEC: every access overlaps [lo, chunk])
    auto load_chunk = [&](int64_t start) {
        const Span keys = span(start, load_end);
#pragma unroll
        for (int p = 0; p < P; p++)
            if (p * 32 * VEC < keys.hi) {
                if constexpr (VEC == 1) raw[p] = load_raw<T, VEC>(xr + start + p * 32 * VEC);
                else if (kCausal && last) raw[p] = load_until<T, VEC>(xr + start + p * 32 * VEC, x + (row + 1) * n);
                else raw[p] = fk::load_pack(xr + start + p * 32 * VEC);
            }
    };

    // One chunk for every CTA of the row (decided by seg, which all ranks share: the last rank's
    // shorter slice must not pick a different reduction than its cluster peers).
    const bool in_registers = kExpOnce<T> && seg <= chunk;
    float m, s, e[C];
    if (in_registers) {
        // The slice sits in registers: the exact row max first, then one exp per element, kept
        // for the output (a second reduction, but half the MUFU work of recomputing the exp).
        load_chunk(begin);
        const Span keys = span(begin, load_end);
        m = -INFINITY;
#pragma unroll
        for (int p = 0; p < P; p++)
#pragma unroll
            for (int k = 0; k < VEC; k++)
                if (is_key(p, k, keys)) m = fmaxf(m, __fmul_rn(raw_at<T, VEC>(raw[p], k), scale));
        m = row_reduce<MaxOnly>(make_float2(m, 0.f), smem, cluster_k).x;
        RowSum<T> sum;
#pragma unroll
        for (int p = 0; p < P; p++)
#pragma unroll
            for (int k = 0; k < VEC; k++) {
                const int i = p * VEC + k;
                e[i] = is_key(p, k, keys) ? exp_ftz(fmaf(raw_at<T, VEC>(raw[p], k), scale, -exp_ref(m))) : 0.f;
                sum.add(e[i]);
            }
        s = row_sum(sum, [&](Acc2<T> v) { return row_reduce<SumSum<Acc2<T>>>(v, sum_smem, cluster_k, false); });
    } else {
        // (max, sum of exp relative to it) of this thread's elements, online across chunks (the sum
        // in fp64 for fp32 data, as RowSum: fp32 partial sums left single rows of 65543 at up to 11x
        // torch's error); the write pass re-reads each chunk (mostly from L2) and takes its exp again
        float lm = -INFINITY;
        Acc<T> ls = 0;
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t start = begin + c * chunk;
            load_chunk(start);
            const Span keys = span(start, load_end);
            float cm = lm;
#pragma unroll
            for (int p = 0; p < P; p++)
#pragma unroll
                for (int k = 0; k < VEC; k++)
                    if (is_key(p, k, keys)) cm = fmaxf(cm, __fmul_rn(raw_at<T, VEC>(raw[p], k), scale));
            const float ref = exp_ref(cm);
            ls = rescale(ls, lm, ref);
#pragma unroll
            for (int p = 0; p < P; p++)
#pragma unroll
                for (int k = 0; k < VEC; k++)
                    if (is_key(p, k, keys)) ls += (Acc<T>)exp_ftz(fmaf(raw_at<T, VEC>(raw[p], k), scale, -ref));
            lm = cm;
        }
        const Acc2<T> ms = row_reduce<MaxSum<Acc2<T>>>(Acc2<T>{lm, ls}, sum_smem, cluster_k);
        m = (float)ms.x;
        s = (float)ms.y;
    }
    const float ref = exp_ref(m), inv_s = 1.f / s, log_s = logf(s);
    if (rank == 0 && threadIdx.x == 0 && row_max) row_max[row] = m;

    // writes the chunk at `start`; exp_of(i, t) is element i's exp(t), t = x * scale - m
    auto write_chunk = [&](int64_t start, auto exp_of) {
        const Span keys = span(start, load_end), outs = span(start, end);
        store_chunk<T, VEC, P, kCausal>(yr + start, outs, [&](int p, int k) {
            const float t = fmaf(raw_at<T, VEC>(raw[p], k), scale, -ref);
            if (kLog) return is_key(p, k, keys) ? t - log_s : -INFINITY - log_s;
            return normalize<T>(is_key(p, k, keys) ? exp_of(p * VEC + k, t) : 0.f, s, inv_s);
        });
    };
    if (in_registers) {
        write_chunk(begin, [&](int i, float) { return e[i]; });
    } else {
        // Last chunk first: it is still in registers, and the chunks read last are likeliest in L2 (D-18).
        for (int64_t c = chunks - 1; c >= 0; c--) {
            if (c < chunks - 1) load_chunk(begin + c * chunk);
            write_chunk(begin + c * chunk, [](int, float t) { return exp_ftz(t); });
        }
    }
}

template <typename T, int VEC, bool kCausal, bool kLog>
__global__ void __launch_bounds__(kBlockThreads, 2)
softmax_bwd_rows_block(int64_t n, int64_t seg, int cluster_k, const T *__restrict__ dy,
                       const T *__restrict__ x, const float *__restrict__ row_max, T *__restrict__ dx,
                       float scale, int64_t causal_sq) {
    constexpr int C = block_elems_bwd<T, VEC>(), P = C / VEC;
    __shared__ RowReduceSmem<Acc2<T>> smem;
    kernel_start(nullptr, 0, cluster_k, smem);
    const int64_t row = blockIdx.x / cluster_k;
    const int rank = blockIdx.x % cluster_k;
    // the tensor's last row (ragged rows, masked instances): its last access stops at the tensor's end
    const bool last = kCausal && row == gridDim.x / cluster_k - 1;
    // slices of the row's frame (row_lead): its keys are [lead, lead + causal_len)
    const int lead = kCausal ? row_lead<VEC>(row, n) : 0;
    const int64_t begin = rank * seg, end = min(lead + n, begin + seg);
    const int64_t x_end = kCausal ? min(end, lead + causal_len(row, n, causal_sq)) : end;
    const int64_t dy_end = kLog ? end : x_end;  // log_softmax sums dy over masked keys too
    const int64_t chunk = (int64_t)blockDim.x * C;
    const int64_t chunks = end > begin ? (end - begin + chunk - 1) / chunk : 1;
    const float m_saved = row_max[row];
    const int64_t lane_off = (int64_t)(threadIdx.x >> 5) * 32 * C + (threadIdx.x & 31) * VEC;
    const T *xr = x + row * n - lead + lane_off, *dyr = dy + row * n - lead + lane_off;
    T *dxr = dx + row * n - lead + lane_off;
    Raw<T, VEC> raw_x[P], raw_dy[P];

    auto span = [&](int64_t start, int64_t stop) { return Span::of<kCausal>(lead, start + lane_off, stop, chunk); };
    auto in = [](int p, int k, Span s) { return s.has<kCausal, VEC>(p, k); };
    auto load_chunk = [&](int64_t start) {
        const Span xs = span(start, x_end), dys = span(start, dy_end);
#pragma unroll
        for (int p = 0; p < P; p++) {
            if (kCausal && last) {
                if (p * 32 * VEC < xs.hi) raw_x[p] = load_until<T, VEC>(xr + start + p * 32 * VEC, x + (row + 1) * n);
                if (p * 32 * VEC < dys.hi) raw_dy[p] = load_until<T, VEC>(dyr + start + p * 32 * VEC, dy + (row + 1) * n);
            } else {
                if (p * 32 * VEC < xs.hi) raw_x[p] = load_raw<T, VEC>(xr + start + p * 32 * VEC);
                if (p * 32 * VEC < dys.hi) raw_dy[p] = load_raw<T, VEC>(dyr + start + p * 32 * VEC);
            }
        }
    };
    // y' = exp(x * scale - row_max): unnormalised, z = sum y' renormalises it
    auto y_unnorm = [&](int p, int k, Span xs) {
        return in(p, k, xs) ? exp_ftz(fmaf(raw_at<T, VEC>(raw_x[p], k), scale, -exp_ref(m_saved))) : 0.f;
    };

    BwdSums<T, kLog> sums;  // (z, a): sum of y', sum of dy * y' (log: of dy)
    float yv[C];  // the last chunk's y': with one chunk, the write pass takes no second exp
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t start = begin + c * chunk;
        load_chunk(start);
        const Span xs = span(start, x_end), dys = span(start, dy_end);
#pragma unroll
        for (int p = 0; p < P; p++)
#pragma unroll
            for (int k = 0; k < VEC; k++) {
                const float yk = y_unnorm(p, k, xs), gk = in(p, k, dys) ? raw_at<T, VEC>(raw_dy[p], k) : 0.f;
                if (kExpOnce<T>) yv[p * VEC + k] = yk;
                sums.add(yk, gk);
            }
    }
    const Acc2<T> za = row_reduce<SumSum<Acc2<T>>>(sums.value(), smem, cluster_k);
    const BwdRow<T> br(za.x, za.y, kLog, scale);

    // writes the chunk at `start` from y_of(p, k, xs), element (p, k)'s y'
    auto write_chunk = [&](int64_t start, auto y_of) {
        const Span xs = span(start, x_end), outs = span(start, end);
        store_chunk<T, VEC, P, kCausal>(dxr + start, outs, [&](int p, int k) {
            const float d = br.template dx<kLog>(y_of(p, k, xs), raw_at<T, VEC>(raw_dy[p], k));
            return in(p, k, xs) ? d : 0.f;
        });
    };
    if (kExpOnce<T> && chunks == 1) {
        write_chunk(begin, [&](int p, int k, Span) { return yv[p * VEC + k]; });
    } else {
        for (int64_t c = chunks - 1; c >= 0; c--) {  // last chunk first, as the forward
            if (c < chunks - 1) load_chunk(begin + c * chunk);
            write_chunk(begin + c * chunk, y_unnorm);
        }
    }
}


template <typename T> fk_status launch_fwd(const Plan &p, const FwdArgs &a, const void *kernel) {
    using Kernel = void (*)(int64_t, int64_t, int, const T *, T *, float *, float, int64_t);
    const fk::Launch launch(dim3((unsigned)p.grid), dim3(p.block_x), 0, a.stream, a.device, p.cluster);
    return launch(a.op, (Kernel)kernel, p.n, p.seg, p.cluster, (const T *)a.x, (T *)a.y, a.row_max, a.scale, p.mask_sq);
}
template <typename T> fk_status launch_bwd(const Plan &p, const BwdArgs &a, const void *kernel) {
    using Kernel = void (*)(int64_t, int64_t, int, const T *, const T *, const float *, T *, float, int64_t);
    const fk::Launch launch(dim3((unsigned)p.grid), dim3(p.block_x), 0, a.stream, a.device, p.cluster);
    return launch(a.op, (Kernel)kernel, p.n, p.seg, p.cluster, (const T *)a.dy, (const T *)a.x, a.row_max, (T *)a.dx,
                  a.scale, p.mask_sq);
}

// The instances: dtype, VEC, elements a thread a chunk, masked (causal or ragged), log.
#define FWD(T, VEC, C, MASKED, LOG) \
    {instance_key(dtype_of<T>, VEC, C, 0, MASKED, LOG, false), (const void *)softmax_fwd_rows_block<T, VEC, (bool)MASKED, (bool)LOG>}
#define BWD(T, VEC, C, MASKED, LOG) \
    {instance_key(dtype_of<T>, VEC, C, 0, MASKED, LOG, false, 1), (const void *)softmax_bwd_rows_block<T, VEC, (bool)MASKED, (bool)LOG>}
const Instance kInstances[] = {
    FWD(float, 1, 8, 0, 0),
    FWD(float, 1, 8, 0, 1),
    FWD(float, 1, 8, 1, 0),
    FWD(float, 1, 8, 1, 1),
    FWD(float, 4, 16, 0, 0),
    FWD(float, 4, 16, 0, 1),
    FWD(float, 4, 16, 1, 0),
    FWD(float, 4, 16, 1, 1),
    FWD(__half, 1, 8, 0, 0),
    FWD(__half, 1, 8, 0, 1),
    FWD(__half, 1, 8, 1, 0),
    FWD(__half, 1, 8, 1, 1),
    FWD(__half, 8, 32, 0, 0),
    FWD(__half, 8, 32, 0, 1),
    FWD(__half, 8, 32, 1, 0),
    FWD(__half, 8, 32, 1, 1),
    FWD(__nv_bfloat16, 1, 8, 0, 0),
    FWD(__nv_bfloat16, 1, 8, 0, 1),
    FWD(__nv_bfloat16, 1, 8, 1, 0),
    FWD(__nv_bfloat16, 1, 8, 1, 1),
    FWD(__nv_bfloat16, 8, 32, 0, 0),
    FWD(__nv_bfloat16, 8, 32, 0, 1),
    FWD(__nv_bfloat16, 8, 32, 1, 0),
    FWD(__nv_bfloat16, 8, 32, 1, 1),
    BWD(float, 1, 8, 0, 0),
    BWD(float, 1, 8, 0, 1),
    BWD(float, 1, 8, 1, 0),
    BWD(float, 1, 8, 1, 1),
    BWD(float, 4, 8, 0, 0),
    BWD(float, 4, 8, 0, 1),
    BWD(float, 4, 8, 1, 0),
    BWD(float, 4, 8, 1, 1),
    BWD(__half, 1, 8, 0, 0),
    BWD(__half, 1, 8, 0, 1),
    BWD(__half, 1, 8, 1, 0),
    BWD(__half, 1, 8, 1, 1),
    BWD(__half, 8, 16, 0, 0),
    BWD(__half, 8, 16, 0, 1),
    BWD(__half, 8, 16, 1, 0),
    BWD(__half, 8, 16, 1, 1),
    BWD(__nv_bfloat16, 1, 8, 0, 0),
    BWD(__nv_bfloat16, 1, 8, 0, 1),
    BWD(__nv_bfloat16, 1, 8, 1, 0),
    BWD(__nv_bfloat16, 1, 8, 1, 1),
    BWD(__nv_bfloat16, 8, 16, 0, 0),
    BWD(__nv_bfloat16, 8, 16, 0, 1),
    BWD(__nv_bfloat16, 8, 16, 1, 0),
    BWD(__nv_bfloat16, 8, 16, 1, 1),
};
#undef FWD
#undef BWD
}  // namespace

const void *rows_block_kernel(const Plan &p) {
    return find_instance(kInstances, instance_key(p.dtype, p.vec, p.elems, 0, p.masked, p.log, false, p.backward));
}

fk_status launch_rows_block(const Plan &p, const FwdArgs &a) {
    const void *kernel = rows_block_kernel(p);
    if (!kernel) return no_instance(p, a.op);
    FK_DISPATCH_CUDA_DTYPE(p.dtype, a.op, return launch_fwd<T>(p, a, kernel));
    return FK_OK;
}

fk_status launch_rows_block(const Plan &p, const BwdArgs &a) {
    const void *kernel = rows_block_kernel(p);
    if (!kernel) return no_instance(p, a.op);
    FK_DISPATCH_CUDA_DTYPE(p.dtype, a.op, return launch_bwd<T>(p, a, kernel));
    return FK_OK;
}

}  // namespace fk::softmax
