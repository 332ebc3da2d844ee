// rows_smem (sm_90): rows past 1024 elements whose slices are bulk-copied (cp.async.bulk, the TMA
// engine) into shared memory, so global memory is read once and a whole slice per CTA is in flight.
//
// Table rows: inner == 1, sm_90, every tensor 16-byte aligned, frame > 1024 (forward: 16-bit, and
// fp32 past 8192; backward: past rows_packs), when a shape below holds the row's slices.
// Bytes: forward 1 read + 1 write an element, backward 2 + 1: bf16 (4096, 16384) forward moves 268
// MB, 64 us at 4.2 TB/s; H200 91-101% of copy on the issue's 4K-256K rows.
// Algorithm: thread 0 starts the CTA's bulk copies, counted on mbarriers (a lone CTA a row in 4
//   pieces, its first pass starting on the first), and asks L2 for the next wave's slices; passes
//   read shared memory: forward the exact max, the sum of exp (kept in place of x: fp32, bf16 as
//   fp16), the write pass; backward the two sums, then dx. Shapes: rows_smem_warp (forward rows of
//   up to 8 KB, a warp a row, 4 a CTA), rows_smem_cta (K CTAs of <= 32 KB a row, clusters with a
//   DSMEM exchange; up to 112 KB, or 224 KB for unmasked forwards, where 32 KB ones cannot hold the
//   row), rows_smem_dyreg (backward: x in shared memory, dy in registers, up to 128 KB of x a CTA).
// Why: against the register kernels, H100 % of copy, fwd / bwd: bf16 (4096, 50257) 78 / 78 -> 98 / 99,
// fp32 (1024, 65543) 61 / 56 -> 97 / 100; H200 fp32 (300, 300000) forward 56 -> 90 (D-28, D-48).
#include "softmax.cuh"

namespace fk::softmax {
namespace {

// ---- sm_90, rows over 1024 elements: row slices in shared memory, loaded by the copy engine ----

// Threads of a CTA-per-row kernel: 256 forward, 128 backward (D-36).
template <bool kBackward> constexpr int kSmemThreads = kBackward ? kSmemBwdThreads : kSmemFwdThreads;
// Kept exps: the forward keeps each exp in place of its x, fp32 as is, bf16 as fp16 (2^-11 relative,
// far below bf16's 2^-8); fp16 and the backward's 16-bit take it again (D-39).
template <typename T> constexpr bool kKeepExp = !std::is_same_v<T, __half>;
template <typename T> __device__ __forceinline__ void keep_exp(fk::Pack<T> &v, int k, float e) {
    if constexpr (std::is_same_v<T, float>) v.v[k] = e;
    else reinterpret_cast<__half *>(&v)[k] = __float2half_rn(e);
}
template <typename T> __device__ __forceinline__ float kept_exp(const fk::Pack<T> &v, int k) {
    if constexpr (std::is_same_v<T, float>) return v.v[k];
    else return __half2float(reinterpret_cast<const __half *>(&v)[k]);
}
// Slices start on 128-byte lines, not just the 16 bytes the copy engine needs (D-33).
constexpr int kSliceAlign = 128;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

// Copies [src, src + bytes) to shared dst, counted on `bar`; bytes is a multiple of 16.
__device__ __forceinline__ void bulk_load(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}

#endif

// Bytes to copy for elements [0, len) of a slice: whole 16-byte packs, never past `cap` elements.
template <typename T> __device__ __forceinline__ uint32_t slice_bytes(int64_t len, int64_t cap) {
    constexpr int64_t per = 16 / sizeof(T);
    if (len > cap) len = cap;
    if (len < 0) len = 0;
    return (uint32_t)((len + per - 1) / per * 16);
}

// One CTA's part of the work: slice `w` of its rows (w: the warp with kWarpRows, else 0) is
// elements [begin, begin + len) of row `row`'s frame (len <= 0: nothing), from start(t, n) in a
// tensor t; keys are its elements [lo, keys). Masked instances (kCausal) take ragged rows too
// (causal_sq 1): their frame starts `lead` elements before the row (row_lead), and lo is the lead
// in the first slice (lead < VEC <= seg); unmasked, lead and lo are 0 and the frame is the row.
struct Slice {
    int64_t row, begin, len, keys;
    int lo, lead;
    bool valid;
    template <typename P> __device__ __forceinline__ P *start(P *t, int64_t n) const { return t + row * n + begin - lead; }
};
template <typename T, bool kCausal, bool kWarps, bool kDiv = false>
__device__ __forceinline__ Slice slice_of(int w, int64_t rows, int64_t n, int64_t seg, int cluster_k,
                                          int64_t causal_sq, int64_t block = blockIdx.x) {
    Slice sl;
    // K is a power of two: a mask and a shift, not 64-bit divisions; the backward keeps the divisions
    // (kDiv), which measured faster there (D-35).
    const int rank = kWarps ? 0 : kDiv ? (int)(block % cluster_k) : (int)(block & (cluster_k - 1));
    sl.row = kWarps ? block * kWarpRows + w : kDiv ? block / cluster_k : block >> (__ffs(cluster_k) - 1);
    sl.valid = sl.row < rows;
    const int lead = kCausal ? row_lead<fk::Pack<T>::N>(sl.row, n) : 0;
    sl.begin = rank * seg;
    sl.lead = lead;
    sl.lo = sl.begin < lead ? lead - (int)sl.begin : 0;
    const int64_t end = min(lead + n, sl.begin + seg);
    sl.len = sl.valid ? end - sl.begin : 0;
    sl.keys = sl.valid ? (kCausal ? min(end, lead + causal_len(sl.row, n, causal_sq)) : end) - sl.begin : 0;
    return sl;
}

// Packs of a slice the write pass stores: a ragged row's last one in part (store_in).
template <typename T, bool kCausal> __device__ __forceinline__ int out_packs(const Slice &sl) {
    return (int)(kCausal ? slice_bytes<T>(sl.len, sl.len) / 16 : sl.len > 0 ? sl.len / fk::Pack<T>::N : 0);
}

// Copy pieces: 4 for a lone CTA a row, so its passes start on the first quarter while the rest is
// in flight; 1 in a cluster and in the warp-per-row kernel (D-31).
constexpr int kMaxPieces = 4;
struct Pieces {
    int count;      // barriers per slice
    uint32_t bytes; // bytes of each piece but the last: a multiple of 16, count * bytes >= a slice
};
template <typename T, bool kWarps, bool kDiv = false> __device__ __forceinline__ Pieces pieces_of(int64_t seg, int cluster_k) {
    const int count = kWarps || cluster_k > 1 ? 1 : kMaxPieces;
    if constexpr (kDiv) return {count, (uint32_t)(((seg * (int64_t)sizeof(T) + count - 1) / count + 15) / 16 * 16)};
    const uint32_t bytes = (uint32_t)seg * (uint32_t)sizeof(T);  // a slice is at most kSmemCtaBigMax
    return {count, ((count == 1 ? bytes : (bytes + kMaxPieces - 1) / kMaxPieces) + 15) / 16 * 16};
}

// Bytes of [src, src + bytes) before `end` (the tensor's end), in whole 16-byte packs: the copies of
// the tensor's last slice stop there, and start_copies copies its partial last pack element-wise.
template <typename T> __device__ __forceinline__ uint32_t bulk_bytes(const T *src, uint32_t bytes, const T *end) {
    const int64_t left = (int64_t)(end - src) * (int64_t)sizeof(T);
    return left >= (int64_t)bytes ? bytes : (uint32_t)(left > 0 ? left / 16 * 16 : 0);
}

// Thread 0's L2 prefetch of the slices of the CTA one SM count ahead, which starts while this one
// runs, so its bulk copies hit L2 (D-34).
template <typename T, bool kCausal, bool kDiv = false, typename Copies>
__device__ __forceinline__ void prefetch_next_cta(int64_t rows, int64_t n, int64_t seg, int cluster_k,
                                                  int64_t causal_sq, Copies copies) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint32_t sms;
    asm("mov.u32 %0, %%nsmid;" : "=r"(sms));
    const int64_t next = (int64_t)blockIdx.x + sms;
    if (next >= gridDim.x) return;
    copies(0, slice_of<T, kCausal, false, kDiv>(0, rows, n, seg, cluster_k, causal_sq, next),
           [&](int64_t, const T *src, uint32_t bytes, const T *end) {
               const uint32_t whole = bulk_bytes(src, bytes, end);
               if (whole)
                   asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(whole) : "memory");
           });
#endif
}

// Thread 0 starts the CTA's copies: copies(i, slice, copy) names, for slice i of the CTA, each
// tensor's copy as copy(shared offset, source, bytes, the tensor's end). Each tensor's copy is cut into pieces.count
// pieces of pieces.bytes at the same offsets, piece c of slice i counted on
// bar[i * pieces.count + c], so a warp starts on its own row and the passes on the first piece
// while the rest are in flight. One arrival per barrier announces all its bytes, so no phase completes before
// its last copy is counted.
template <typename T, bool kCausal, bool kWarps, bool kDiv = false, typename Copies>
__device__ __forceinline__ void start_copies(uint64_t *bar, Pieces pieces, unsigned char *smem, int64_t rows,
                                             int64_t n, int64_t seg, int cluster_k, int64_t causal_sq,
                                             bool prefetch, Copies copies) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (threadIdx.x != 0) return;
    for (int i = 0; i < (kWarps ? kWarpRows : 1); i++) {
        const Slice sl = slice_of<T, kCausal, kWarps, kDiv>(i, rows, n, seg, cluster_k, causal_sq);
        for (int c = 0; c < pieces.count; c++) {
            uint64_t *b = &bar[i * pieces.count + c];
            auto lo = [&](uint32_t bytes) { return min((uint32_t)c * pieces.bytes, bytes); };
            auto len = [&](uint32_t bytes) { return min(lo(bytes) + pieces.bytes, bytes) - lo(bytes); };
            uint32_t total = 0;
            copies(i, sl, [&](int64_t offset, const T *src, uint32_t bytes, const T *end) {
                const uint32_t whole = bulk_bytes(src, bytes, end);
                total += len(whole);
                // a partial pack at the tensor's end, in this piece: plain loads and shared stores,
                // which this thread's arrival below releases to the passes waiting on the barrier
                if (whole < bytes && whole >= lo(bytes) && whole < lo(bytes) + len(bytes)) {
                    T *dst = reinterpret_cast<T *>(smem + offset + whole);
                    const T *from = src + whole / sizeof(T);
                    for (int k = 0; k < 16 / (int)sizeof(T) && from + k < end; k++) dst[k] = from[k];
                }
            });
            mbar_expect(b, total);
            copies(i, sl, [&](int64_t offset, const T *src, uint32_t bytes, const T *end) {
                const uint32_t whole = bulk_bytes(src, bytes, end);
                if (len(whole))
                    bulk_load(smem + offset + lo(whole), reinterpret_cast<const unsigned char *>(src) + lo(whole),
                              len(whole), b);
            });
        }
    }
    if (!kWarps && prefetch) prefetch_next_cta<T, kCausal, kDiv>(rows, n, seg, cluster_k, causal_sq, copies);
#endif
}

// The first pass over a slice's packs (16-byte units from its start): body(p) for p = first,
// first + stride, ... < packs, piece by piece, every thread waiting for piece c's barrier before
// the packs of piece c (so every barrier is waited for and no copy is in flight at exit). The
// inner loop holds no wait, so its shared-memory loads stay free to be scheduled early (a wait
// inside the loop cost clustered rows 2-5 points).
template <int kUnroll, typename Body>
__device__ __forceinline__ void over_pieces(uint64_t *bar, Pieces pieces, int packs, int first, int stride,
                                            Body body) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const int per = (int)(pieces.bytes / 16);  // 32-bit loop bounds: faster (decision id pending)
    int p = first, end = 0;
    for (int c = 0; c < pieces.count; c++) {
        mbar_wait(&bar[c]);
        end = min(packs, end + per);
#pragma unroll kUnroll
        for (; p < end; p += stride) body(p);
    }
#endif
}

// Reduction over the lanes that share a slice's row: the warp (kWarps), else the CTA and cluster.
template <bool kWarps, typename Op, typename V>
__device__ __forceinline__ V slice_reduce(V v, RowReduceSmem<V> &smem, int cluster_k, bool first = true) {
    if constexpr (kWarps) return group_reduce<Op>(v, 32);
    else return row_reduce<Op>(v, smem, cluster_k, first);
}

template <typename T, bool kCausal, bool kLog, bool kWarps>
__global__ void __launch_bounds__(kSmemThreads<false>)
softmax_fwd_rows_smem(int64_t n, int64_t seg, int cluster_k, int64_t rows, const T *__restrict__ x,
                      T *__restrict__ y, float *__restrict__ row_max, float scale, int64_t causal_sq) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr int VEC = fk::Pack<T>::N;
    constexpr bool kExpInPlace = kKeepExp<T> && !kLog;  // log_softmax writes t - log(s), no exp
    extern __shared__ __align__(kSliceAlign) unsigned char smem_raw[];
    __shared__ uint64_t bar[kWarps ? kWarpRows : kMaxPieces];
    __shared__ RowReduceSmem<float2> red;
    __shared__ RowReduceSmem<Acc2<T>> sum_red;
    const Pieces pieces = pieces_of<T, kWarps>(seg, cluster_k);
    kernel_start(bar, kWarps ? kWarpRows : pieces.count, kWarps ? 1 : cluster_k, red, sum_red);
    const int w = kWarps ? threadIdx.x / 32 : 0;
    const int lane = kWarps ? threadIdx.x % 32 : threadIdx.x;
    const int lanes = kWarps ? 32 : kCausal ? (int)blockDim.x : kSmemThreads<false>;  // kMaskedWarpPacks
    const int64_t slice_bytes_max = seg * (int64_t)sizeof(T);
    // No L2 policy on the forward's copies: the cards disagreed (D-44).
    start_copies<T, kCausal, kWarps>(bar, pieces, smem_raw, rows, n, seg, cluster_k, causal_sq,
                                     slice_bytes_max <= kSmemCtaBigMax,
                                     [&](int i, const Slice &s, auto copy) {
                                         copy(i * slice_bytes_max, s.start(x, n), slice_bytes<T>(s.keys, s.len), x + rows * n);
                                     });
    const Slice sl = slice_of<T, kCausal, kWarps>(w, rows, n, seg, cluster_k, causal_sq);
    const int packs = (int)(slice_bytes<T>(sl.keys, sl.len) / 16), outs = out_packs<T, kCausal>(sl);
    fk::Pack<T> *sx = reinterpret_cast<fk::Pack<T> *>(smem_raw + w * slice_bytes_max);
    // masked (kCausal): packs reaching outside the keys [lo, keys) are zeroed outside them
    // (zero_outside; packs past the copied ones hold stale values, all zeroed); others go whole
    const int keys = (int)sl.keys;

    // the exact max first, then each exp once (kept in place of x for the write pass, kKeepExp;
    // fp16 takes ex2.approx again there), then the write pass
    float m = -INFINITY;
    over_pieces<4>(bar + w, pieces, packs, lane, lanes, [&](int p) {
        const fk::Pack<T> v = sx[p];
        if (!kCausal || !reaches_out<VEC>(p * VEC, sl.lo, keys)) {
            m = fmaxf(m, pack_max_scaled<T>(v, scale));
        } else {
#pragma unroll
            for (int k = 0; k < VEC; k++)
                if (p * VEC + k >= sl.lo && p * VEC + k < keys) m = fmaxf(m, __fmul_rn(fk::pack_f32<T>(v, k), scale));
        }
    });
    m = slice_reduce<kWarps, MaxOnly>(make_float2(m, 0.f), red, cluster_k).x;
    float s;
    {
        const float ref = exp_ref(m);
        RowSum<T> sum;
#pragma unroll 4
        for (int p = lane; p < packs; p += lanes) {
            fk::Pack<T> v = sx[p];
            float e[VEC];
#pragma unroll
            for (int k = 0; k < VEC; k++) {
                e[k] = exp_ftz(fmaf(fk::pack_f32<T>(v, k), scale, -ref));
                if constexpr (!kCausal) sum.add(e[k]);  // unmasked: summed as taken, as measured
            }
            if constexpr (kCausal) {
                zero_outside<VEC>(p * VEC, sl.lo, keys, [&](int k) { e[k] = 0.f; });
#pragma unroll
                for (int k = 0; k < VEC; k++) sum.add(e[k]);
            }
            if constexpr (kExpInPlace) {
#pragma unroll
                for (int k = 0; k < VEC; k++) keep_exp<T>(v, k, e[k]);
                sx[p] = v;
            }
        }
        s = row_sum(sum, [&](Acc2<T> v) { return slice_reduce<kWarps, SumSum<Acc2<T>>>(v, sum_red, cluster_k, false); });
    }
    const float ref = exp_ref(m), inv_s = 1.f / s, log_s = logf(s);
    if (!sl.valid) return;
    if (lane == 0 && sl.begin == 0 && row_max) row_max[sl.row] = m;
    T *yr = sl.start(y, n);
#pragma unroll 4
    for (int p = lane; p < outs; p += lanes) {
        const fk::Pack<T> v = sx[p];
        float o[VEC];
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            const float t = fmaf(fk::pack_f32<T>(v, k), scale, -ref);
            const float e = kExpInPlace ? kept_exp<T>(v, k) : exp_ftz(t);
            o[k] = kLog ? t - log_s : normalize<T>(e, s, inv_s);
        }
        if constexpr (kCausal)  // a masked key's output, as for exp 0 (NaN in an all-masked row)
            zero_outside<VEC>(p * VEC, sl.lo, keys, [&](int k) { o[k] = kLog ? -INFINITY - log_s : normalize<T>(0.f, s, inv_s); });
        store_in<T, VEC, kCausal, true>(yr + p * VEC, o, p * VEC, sl.lo, (int)sl.len);
    }
#endif
}

// Backward rows whose x and dy outgrow a full cluster of kSmemCtaBigMax CTAs: x in shared memory,
// dy in registers (kDyRegPacks packs a thread), so both are still read once (D-42).

template <typename T, bool kCausal, bool kLog, int kDyRegLanes = 0>
__global__ void __launch_bounds__(kDyRegLanes ? kDyRegLanes : kSmemThreads<true>, kDyRegLanes == kDyRegThreads ? 2 : 1)
softmax_bwd_rows_smem(int64_t n, int64_t seg, int cluster_k, int64_t rows, const T *__restrict__ dy,
                      const T *__restrict__ x, const float *__restrict__ row_max, T *__restrict__ dx,
                      float scale, int64_t causal_sq) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr int VEC = fk::Pack<T>::N;
    extern __shared__ __align__(kSliceAlign) unsigned char smem_raw[];
    __shared__ uint64_t bar[kMaxPieces];
    __shared__ RowReduceSmem<Acc2<T>> red;
    const Pieces pieces = pieces_of<T, false, true>(seg, cluster_k);
    constexpr bool kDyRegs = kDyRegLanes > 0;
    constexpr int kLanes = kDyRegs ? kDyRegLanes : kSmemThreads<true>;
    const int lane = threadIdx.x, lanes = kLanes;
    const int64_t slice = seg * (int64_t)sizeof(T);  // x slices, then dy slices (unless in registers)
    const int64_t dy_base = slice;
    // bytes of x and dy for a slice (log_softmax sums dy over masked keys too)
    auto x_bytes = [](const Slice &s) { return slice_bytes<T>(s.keys, s.len); };
    auto dy_bytes = [](const Slice &s) { return slice_bytes<T>(kLog ? s.len : s.keys, s.len); };
    // the L2 prefetch only where a CTA's x and dy pass kSmemCtaMax, never with dy in registers (D-34)
    const bool prefetch = !kDyRegs && 2 * slice > kSmemCtaMax;
    kernel_start(bar, pieces.count, cluster_k, red);
    start_copies<T, kCausal, false, true>(bar, pieces, smem_raw, rows, n, seg, cluster_k, causal_sq, prefetch,
                                           [&](int i, const Slice &s, auto copy) {
                                               copy(i * slice, s.start(x, n), x_bytes(s), x + rows * n);
                                               if (!kDyRegs)
                                                   copy(dy_base + i * slice, s.start(dy, n), dy_bytes(s), dy + rows * n);
                                           });
    const Slice sl = slice_of<T, kCausal, false, true>(0, rows, n, seg, cluster_k, causal_sq);
    const int x_packs = (int)(x_bytes(sl) / 16), dy_packs = (int)(dy_bytes(sl) / 16);
    const int outs = out_packs<T, kCausal>(sl);
    // masked (kCausal): packs reaching outside x's keys [lo, keys) (dy's: [lo, dy_keys), log_softmax
    // sums dy over masked keys too) are zeroed outside them (zero_outside; packs past the copied
    // ones hold stale values, all zeroed); the others are taken whole
    const int keys = (int)sl.keys, dy_keys = kLog ? (int)sl.len : keys;
    fk::Pack<T> *sx = reinterpret_cast<fk::Pack<T> *>(smem_raw);
    const fk::Pack<T> *sdy = reinterpret_cast<const fk::Pack<T> *>(smem_raw + dy_base);
    fk::Pack<T> dy_reg[kDyRegs ? kDyRegPacks : 1];  // kDyRegs: pack lane + i * kLanes in dy_reg[i]
    if constexpr (kDyRegs) {
        const T *dyr = sl.start(dy, n);
#pragma unroll
        for (int i = 0; i < kDyRegPacks; i++)
            if (lane + i * kLanes < dy_packs)  // the tensor's last row: its last pack stops at the end
                dy_reg[i] = kCausal && sl.row == rows - 1 ? load_until<T, VEC>(dyr + (lane + i * kLanes) * VEC, dy + rows * n)
                                                          : fk::load_pack(dyr + (lane + i * kLanes) * VEC);
    }
    const float ref = sl.valid ? exp_ref(row_max[sl.row]) : 0.f;
    // y' = exp(x * scale - row_max) of element k of a pack v of x: unnormalised, z = sum y'
    // renormalises it
    auto y_unnorm = [&](int k, const fk::Pack<T> &v) { return exp_ftz(fmaf(fk::pack_f32<T>(v, k), scale, -ref)); };

    // fp32 keeps each y' in place of its x for the write pass (kExpOnce): one exp per element
    BwdSums<T, kLog> sums;  // (z, a): sum of y', sum of dy * y' (log: of dy)
    const int packs = x_packs > dy_packs ? x_packs : dy_packs;
    auto sum_pack = [&](int p, const fk::Pack<T> &g) {
        fk::Pack<T> v = sx[p];
        float yk[VEC], gk[VEC];
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            yk[k] = y_unnorm(k, v);
            gk[k] = fk::pack_f32<T>(g, k);
        }
        if constexpr (kCausal) {
            zero_outside<VEC>(p * VEC, sl.lo, keys, [&](int k) { yk[k] = 0.f; });
            zero_outside<VEC>(p * VEC, sl.lo, dy_keys, [&](int k) { gk[k] = 0.f; });
        }
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            if constexpr (kExpOnce<T>) keep_exp<T>(v, k, yk[k]);
            sums.add(yk[k], gk[k]);
        }
        if constexpr (kExpOnce<T>) sx[p] = v;
    };
    if constexpr (kDyRegs) {
        for (int c = 0; c < pieces.count; c++) mbar_wait(&bar[c]);
#pragma unroll
        for (int i = 0; i < kDyRegPacks; i++) {
            if (lane + i * kLanes < packs) sum_pack(lane + i * kLanes, dy_reg[i]);
            // the packs look rewritten here, so the write pass converts them again rather than
            // keeping both passes' fp32 values live (bf16: 128 registers and spills, 46% of copy
            // at (256, 400000) against fp16's 80%)
            uint4 &raw = *reinterpret_cast<uint4 *>(&dy_reg[i]);
            asm volatile("" : "+r"(raw.x), "+r"(raw.y), "+r"(raw.z), "+r"(raw.w));
        }
    } else {
        over_pieces<2>(bar, pieces, packs, lane, lanes, [&](int p) { sum_pack(p, sdy[p]); });
    }
    const Acc2<T> za = slice_reduce<false, SumSum<Acc2<T>>>(sums.value(), red, cluster_k);
    if (!sl.valid) return;
    const BwdRow<T> br(za.x, za.y, kLog, scale);
    T *dxr = sl.start(dx, n);
    auto write_pack = [&](int p, const fk::Pack<T> &g) {
        const fk::Pack<T> v = sx[p];
        float o[VEC];
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            const float yk = kExpOnce<T> ? kept_exp<T>(v, k) : y_unnorm(k, v);
            o[k] = br.template dx<kLog>(yk, fk::pack_f32<T>(g, k));
        }
        if constexpr (kCausal) zero_outside<VEC>(p * VEC, sl.lo, keys, [&](int k) { o[k] = 0.f; });
        store_in<T, VEC, kCausal, true>(dxr + p * VEC, o, p * VEC, sl.lo, (int)sl.len);
    };
    if constexpr (kDyRegs) {
#pragma unroll
        for (int i = 0; i < kDyRegPacks; i++)
            if (lane + i * kLanes < outs) write_pack(lane + i * kLanes, dy_reg[i]);
    } else {
#pragma unroll 2
        for (int p = lane; p < outs; p += lanes) write_pack(p, sdy[p]);
    }
#endif
}


template <typename T> fk_status launch_fwd(const Plan &p, const FwdArgs &a, const void *kernel) {
    using Kernel = void (*)(int64_t, int64_t, int, int64_t, const T *, T *, float *, float, int64_t);
    const fk::Launch launch(dim3((unsigned)p.grid), dim3(p.block_x), p.smem, a.stream, a.device, p.cluster);
    return launch(a.op, (Kernel)kernel, p.n, p.seg, p.cluster, p.rows, (const T *)a.x, (T *)a.y, a.row_max, a.scale,
                  p.mask_sq);
}
template <typename T> fk_status launch_bwd(const Plan &p, const BwdArgs &a, const void *kernel) {
    using Kernel = void (*)(int64_t, int64_t, int, int64_t, const T *, const T *, const float *, T *, float, int64_t);
    const fk::Launch launch(dim3((unsigned)p.grid), dim3(p.block_x), p.smem, a.stream, a.device, p.cluster);
    return launch(a.op, (Kernel)kernel, p.n, p.seg, p.cluster, p.rows, (const T *)a.dy, (const T *)a.x, a.row_max,
                  (T *)a.dx, a.scale, p.mask_sq);
}

// The instances: dtype, masked (causal or ragged), log; forward a warp a row (WARPS) or CTAs of 256
// threads; backward CTAs of 128 (or 256) threads with x and dy in shared memory, or of 256 / 512
// threads with dy in registers (DYREG).
#define KEY(T, STRATEGY, LANES, MASKED, LOG, BACKWARD) \
    instance_key(dtype_of<T>, fk::Pack<T>::N, 0, LANES, MASKED, LOG, false, (int)Strategy::STRATEGY + 16 * BACKWARD)
#define FWD_WARPS(T, MASKED, LOG) \
    {KEY(T, kRowsSmemWarp, 32 * kWarpRows, MASKED, LOG, 0), (const void *)softmax_fwd_rows_smem<T, (bool)MASKED, (bool)LOG, true>}
#define FWD_CTA(T, MASKED, LOG) \
    {KEY(T, kRowsSmemCta, kSmemFwdThreads, MASKED, LOG, 0), (const void *)softmax_fwd_rows_smem<T, (bool)MASKED, (bool)LOG, false>}
#define BWD_CTA(T, THREADS, MASKED, LOG) \
    {KEY(T, kRowsSmemCta, THREADS, MASKED, LOG, 1), (const void *)softmax_bwd_rows_smem<T, (bool)MASKED, (bool)LOG>}
#define BWD_DYREG(T, THREADS, MASKED, LOG) \
    {KEY(T, kRowsSmemDyReg, THREADS, MASKED, LOG, 1), (const void *)softmax_bwd_rows_smem<T, (bool)MASKED, (bool)LOG, THREADS>}
const Instance kInstances[] = {
    FWD_WARPS(__half, 0, 0),
    FWD_WARPS(__half, 0, 1),
    FWD_WARPS(__half, 1, 0),
    FWD_WARPS(__half, 1, 1),
    FWD_WARPS(__nv_bfloat16, 0, 0),
    FWD_WARPS(__nv_bfloat16, 0, 1),
    FWD_WARPS(__nv_bfloat16, 1, 0),
    FWD_WARPS(__nv_bfloat16, 1, 1),
    FWD_CTA(float, 0, 0),
    FWD_CTA(float, 0, 1),
    FWD_CTA(float, 1, 0),
    FWD_CTA(float, 1, 1),
    FWD_CTA(__half, 0, 0),
    FWD_CTA(__half, 0, 1),
    FWD_CTA(__half, 1, 0),
    FWD_CTA(__half, 1, 1),
    FWD_CTA(__nv_bfloat16, 0, 0),
    FWD_CTA(__nv_bfloat16, 0, 1),
    FWD_CTA(__nv_bfloat16, 1, 0),
    FWD_CTA(__nv_bfloat16, 1, 1),
    BWD_CTA(float, kSmemBwdThreads, 0, 0),
    BWD_CTA(float, kSmemBwdThreads, 0, 1),
    BWD_CTA(float, kSmemBwdThreads, 1, 0),
    BWD_CTA(float, kSmemBwdThreads, 1, 1),
    BWD_DYREG(float, kDyRegThreads, 0, 0),
    BWD_DYREG(float, kDyRegThreads, 0, 1),
    BWD_DYREG(float, kDyRegThreads, 1, 0),
    BWD_DYREG(float, kDyRegThreads, 1, 1),
    BWD_DYREG(float, kDyRegWideThreads, 0, 0),
    BWD_DYREG(float, kDyRegWideThreads, 0, 1),
    BWD_DYREG(float, kDyRegWideThreads, 1, 0),
    BWD_DYREG(float, kDyRegWideThreads, 1, 1),
    BWD_CTA(__half, kSmemBwdThreads, 0, 0),
    BWD_CTA(__half, kSmemBwdThreads, 0, 1),
    BWD_CTA(__half, kSmemBwdThreads, 1, 0),
    BWD_CTA(__half, kSmemBwdThreads, 1, 1),
    BWD_DYREG(__half, kDyRegThreads, 0, 0),
    BWD_DYREG(__half, kDyRegThreads, 0, 1),
    BWD_DYREG(__half, kDyRegThreads, 1, 0),
    BWD_DYREG(__half, kDyRegThreads, 1, 1),
    BWD_DYREG(__half, kDyRegWideThreads, 0, 0),
    BWD_DYREG(__half, kDyRegWideThreads, 0, 1),
    BWD_DYREG(__half, kDyRegWideThreads, 1, 0),
    BWD_DYREG(__half, kDyRegWideThreads, 1, 1),
    BWD_CTA(__nv_bfloat16, kSmemBwdThreads, 0, 0),
    BWD_CTA(__nv_bfloat16, kSmemBwdThreads, 0, 1),
    BWD_CTA(__nv_bfloat16, kSmemBwdThreads, 1, 0),
    BWD_CTA(__nv_bfloat16, kSmemBwdThreads, 1, 1),
    BWD_DYREG(__nv_bfloat16, kDyRegThreads, 0, 0),
    BWD_DYREG(__nv_bfloat16, kDyRegThreads, 0, 1),
    BWD_DYREG(__nv_bfloat16, kDyRegThreads, 1, 0),
    BWD_DYREG(__nv_bfloat16, kDyRegThreads, 1, 1),
    BWD_DYREG(__nv_bfloat16, kDyRegWideThreads, 0, 0),
    BWD_DYREG(__nv_bfloat16, kDyRegWideThreads, 0, 1),
    BWD_DYREG(__nv_bfloat16, kDyRegWideThreads, 1, 0),
    BWD_DYREG(__nv_bfloat16, kDyRegWideThreads, 1, 1),
};
#undef KEY
#undef FWD_WARPS
#undef FWD_CTA
#undef BWD_CTA
#undef BWD_DYREG
}  // namespace

const void *rows_smem_kernel(const Plan &p) {
    return find_instance(kInstances, instance_key(p.dtype, p.vec, 0, p.lanes, p.masked, p.log, false,
                                                  (int)p.strategy + 16 * p.backward));
}

fk_status launch_rows_smem(const Plan &p, const FwdArgs &a) {
    const void *kernel = rows_smem_kernel(p);
    if (!kernel) return no_instance(p, a.op);
    FK_DISPATCH_CUDA_DTYPE(p.dtype, a.op, return launch_fwd<T>(p, a, kernel));
    return FK_OK;
}

fk_status launch_rows_smem(const Plan &p, const BwdArgs &a) {
    const void *kernel = rows_smem_kernel(p);
    if (!kernel) return no_instance(p, a.op);
    FK_DISPATCH_CUDA_DTYPE(p.dtype, a.op, return launch_bwd<T>(p, a, kernel));
    return FK_OK;
}

}  // namespace fk::softmax
