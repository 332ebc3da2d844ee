// Softmax / log-softmax on the GPU, reduced along the middle axis of an (outer, n, inner) array.
//
// Napkin math. Forward moves 1 read + 1 write per element, backward 2 reads (x, dy) + 1 write: the
// bytes for (16384, 4096) bf16 are 268 MB forward, i.e. 64 us at the H200's 4.2 TB/s copy rate,
// and the aim is >= 90% of that. At 4.2 TB/s an SM must retire ~4 bf16 elements per clock, which
// leaves ~30 instructions per element: one expf (FFMA + MUFU.EX2 range reduction), one max, one add
// and a multiply by 1 / sum fit; a second expf per element would not, hence rows held in registers.
// Little's law: 4.2 TB/s x ~1 us latency = ~32 KB in flight per SM, so every thread issues several
// 16-byte loads before it uses the first one.
//
// Strategies for inner == 1 (rows contiguous), by row length n:
//   n <= 1024            a warp (or a 1..16-lane group for very short rows) per row, 1..4 rows per
//                        group so each lane has >= 64 bytes in flight; row in registers, read once.
//   n <= 512 * 16        a CTA of up to 512 threads per row, 16 elements per thread in registers
//   (bwd: 512 * 8)       (bwd: 8 of y and 8 of dy; more spills under the 64-register cap that two
//                        CTAs of 512 per SM need), CTA reductions through shared memory, read once.
//   longer               K CTAs per row (K <= 16, a thread-block cluster on sm_90 exchanging its
//                        partial max / sum through distributed shared memory), each CTA holding its
//                        slice in registers: (256, 262144) is 4096 CTAs instead of 256 CTAs of 1 MB
//                        on 132 SMs (2 waves, and no CTA could hold 1 MB on chip). Slices larger
//                        than one CTA's registers (rows > 131072 forward, > 65536 backward, or any
//                        long row without clusters) are read twice: an online max / rescaled-sum
//                        pass, then the write pass, whose re-read of the slice (<= 64 KB per CTA
//                        for the shapes above) mostly hits L2.
// inner > 1: a thread per (outer, inner) column, 32 columns per warp so loads stay coalesced, 8..32
// threads splitting n, online max / sum down n, then a write pass (x read twice).
//
// Numerics: fp32 arithmetic, accurate expf / logf. x * scale is rounded on its own (__fmul_rn, never
// contracted into an FMA) so a value re-read in a second pass equals the one the max was taken of.
// y = exp(v - max) / sum, so the output error is that of torch. Masked keys become -inf, so fully
// masked or all -inf rows give 0 / 0 = NaN and rows with +inf / NaN give NaN, exactly as
// torch.softmax after masked_fill(-inf). Backward recomputes y' = exp(fma(x, scale, -lse)) and
// divides by z = sum y': lse is stored in fp32, and its rounding error of ulp(lse) would otherwise
// scale every y of the row.
#include <cooperative_groups.h>

#include <type_traits>

#include "common.cuh"

namespace {

namespace cg = cooperative_groups;

constexpr int kWarpMaxN = 1024;       // longest row the warp kernel holds (32 lanes x 32 elements)
constexpr int kWarpBlock = 128;       // threads per CTA of the warp kernels
constexpr int kBlockThreads = 512;    // most threads per CTA of the row-block kernels: 2 CTAs / SM
constexpr int kBlockElemsFwd = 16;    // elements per thread per chunk, forward (within 64 registers)
constexpr int kBlockElemsBwd = 8;     // per tensor: backward holds y and dy
constexpr int kMaxCluster = 16;

// Keys of row `row` at or beyond the returned length are masked (causal_sq == 0: none are).
__device__ __forceinline__ int64_t causal_len(int64_t row, int64_t n, int64_t causal_sq) {
    if (causal_sq == 0) return n;
    int64_t len = row % causal_sq + 1 + n - causal_sq;
    return len < 0 ? 0 : (len > n ? n : len);
}

// exp is taken relative to the max, or to 0 while the max is -inf, so that -inf - -inf never
// turns a partial sum into NaN before a finite value arrives.
__device__ __forceinline__ float exp_ref(float m) { return m == -INFINITY ? 0.f : m; }

// s was accumulated against exp_ref(from); re-express it against to >= from.
__device__ __forceinline__ float rescale(float s, float from, float to) {
    return from == -INFINITY ? s : s * expf(from - to);
}

// fp32 output divides (the rounding torch has); 16-bit output rounds far coarser than 1 / s does.
template <typename T> __device__ __forceinline__ float normalize(float e, float s, float inv_s) {
    if constexpr (std::is_same<T, float>::value) return e / s;
    else return e * inv_s;
}

// VEC == Pack<T>::N: one 16-byte access; VEC == 1: the scalar path for misaligned or odd rows.
template <typename T, int VEC>
using Raw = typename std::conditional<VEC == 1, T, fk::Pack<T>>::type;

template <typename T, int VEC> __device__ __forceinline__ Raw<T, VEC> load_raw(const T *p) {
    if constexpr (VEC == 1) return __ldg(p);
    else return fk::load_pack(p);
}

template <typename T, int VEC> __device__ __forceinline__ float raw_at(const Raw<T, VEC> &r, int k) {
    if constexpr (VEC == 1) return fk::to_f32(r);
    else return fk::to_f32(r.v[k]);
}

template <typename T, int VEC> __device__ __forceinline__ void store_vec(T *p, const float *v) {
    if constexpr (VEC == 1) {
        *p = fk::from_f32<T>(v[0]);
    } else {
        fk::Pack<T> out;
#pragma unroll
        for (int k = 0; k < VEC; k++) out.v[k] = fk::from_f32<T>(v[k]);
        fk::store_pack(p, out);
    }
}

struct OpMax {
    static __device__ __forceinline__ float identity() { return -INFINITY; }
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct OpSum {
    static __device__ __forceinline__ float identity() { return 0.f; }
    __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

// Reduction over the `group` lanes (a power of two <= 32) that share a row.
template <typename Op> __device__ __forceinline__ float group_reduce(float v, int group) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
        if (offset < group) v = Op()(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// Reduction over the CTA, then over the K CTAs of the row's cluster. red: 33 floats, slot: 1 float
// of shared memory. The trailing cluster barrier keeps every CTA alive until the others have read
// its slot, so consecutive calls (and kernel exit) are safe.
template <typename Op>
__device__ __forceinline__ float row_reduce(float v, float *red, float *slot, int cluster_k) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = group_reduce<Op>(v, 32);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? red[lane] : Op::identity();
        v = group_reduce<Op>(v, 32);
        if (lane == 0) red[32] = v;
    }
    __syncthreads();
    v = red[32];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (cluster_k > 1) {
        cg::cluster_group cluster = cg::this_cluster();
        if (threadIdx.x == 0) *slot = v;
        cluster.sync();
        if (warp == 0) {
            float other = lane < cluster_k ? *cluster.map_shared_rank(slot, lane) : Op::identity();
            other = group_reduce<Op>(other, 32);
            if (lane == 0) red[32] = other;
        }
        cluster.sync();
        v = red[32];
    }
#else
    (void)slot;
    (void)cluster_k;
#endif
    return v;
}

// ---- rows of up to 1024 elements: a lane group per row ---------------------------------------

// Rows per lane group: enough that each lane has >= 64 bytes of loads in flight.
template <typename T, int C> __host__ __device__ constexpr int warp_rows() {
    constexpr int rows = 64 / (C * (int)sizeof(T));
    return rows < 1 ? 1 : (rows > 4 ? 4 : rows);
}

// C elements per lane (C / VEC accesses); `group` lanes per row, group * C >= n.
template <typename T, int VEC, int C>
__global__ void __launch_bounds__(kWarpBlock)
softmax_fwd_rows_warp(const T *__restrict__ x, T *__restrict__ y, float *__restrict__ lse,
                      int64_t rows, int n, int group, float scale, int64_t causal_sq, int is_log) {
    constexpr int ROWS = warp_rows<T, C>(), P = C / VEC;
    const int lane = threadIdx.x & 31, li = lane & (group - 1);
    const int64_t warp = (int64_t)blockIdx.x * (kWarpBlock / 32) + (threadIdx.x >> 5);
    const int64_t first = (warp * (32 / group) + lane / group) * ROWS;

    Raw<T, VEC> raw[ROWS][P];
    int valid[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int64_t row = first + r;
        valid[r] = row < rows ? (int)causal_len(row, n, causal_sq) : 0;
#pragma unroll
        for (int p = 0; p < P; p++) {
            const int col = (p * group + li) * VEC;
            if (col < valid[r]) raw[r][p] = load_raw<T, VEC>(x + row * n + col);
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int64_t row = first + r;
        float v[C];
        float m = -INFINITY;
#pragma unroll
        for (int p = 0; p < P; p++) {
            const int col = (p * group + li) * VEC;
#pragma unroll
            for (int k = 0; k < VEC; k++) {
                v[p * VEC + k] = col + k < valid[r] ? __fmul_rn(raw_at<T, VEC>(raw[r][p], k), scale) : -INFINITY;
                m = fmaxf(m, v[p * VEC + k]);
            }
        }
        m = group_reduce<OpMax>(m, group);
        const float ref = exp_ref(m);
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < C; k++) {
            const float e = expf(v[k] - ref);
            s += e;
            if (!is_log) v[k] = e;
        }
        s = group_reduce<OpSum>(s, group);
        const float inv_s = 1.f / s, log_s = logf(s);
        if (row < rows) {
            if (li == 0) lse[row] = m + log_s;
#pragma unroll
            for (int p = 0; p < P; p++) {
                const int col = (p * group + li) * VEC;
                if (col < n) {
                    float o[VEC];
#pragma unroll
                    for (int k = 0; k < VEC; k++)
                        o[k] = is_log ? (v[p * VEC + k] - ref) - log_s : normalize<T>(v[p * VEC + k], s, inv_s);
                    store_vec<T, VEC>(y + row * n + col, o);
                }
            }
        }
    }
}

template <typename T, int VEC, int C>
__global__ void __launch_bounds__(kWarpBlock)
softmax_bwd_rows_warp(const T *__restrict__ dy, const T *__restrict__ x, const float *__restrict__ lse,
                      T *__restrict__ dx, int64_t rows, int n, int group, float scale,
                      int64_t causal_sq, int is_log) {
    constexpr int ROWS = warp_rows<T, 2 * C>(), P = C / VEC;  // x and dy: 64 bytes between them
    const int lane = threadIdx.x & 31, li = lane & (group - 1);
    const int64_t warp = (int64_t)blockIdx.x * (kWarpBlock / 32) + (threadIdx.x >> 5);
    const int64_t first = (warp * (32 / group) + lane / group) * ROWS;

    Raw<T, VEC> raw_x[ROWS][P], raw_dy[ROWS][P];
    int valid[ROWS];
    float row_lse[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int64_t row = first + r;
        valid[r] = row < rows ? (int)causal_len(row, n, causal_sq) : 0;
        // log_softmax sums dy over masked keys too (their y is 0, not their dy)
        const int dy_len = row < rows ? (is_log ? n : valid[r]) : 0;
        row_lse[r] = row < rows ? lse[row] : 0.f;
#pragma unroll
        for (int p = 0; p < P; p++) {
            const int col = (p * group + li) * VEC;
            if (col < valid[r]) raw_x[r][p] = load_raw<T, VEC>(x + row * n + col);
            if (col < dy_len) raw_dy[r][p] = load_raw<T, VEC>(dy + row * n + col);
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int64_t row = first + r;
        const int dy_len = row < rows ? (is_log ? n : valid[r]) : 0;
        float yv[C], g[C];
        float z = 0.f, a = 0.f;
#pragma unroll
        for (int p = 0; p < P; p++) {
            const int col = (p * group + li) * VEC;
#pragma unroll
            for (int k = 0; k < VEC; k++) {
                const int i = p * VEC + k;
                yv[i] = col + k < valid[r] ? expf(fmaf(raw_at<T, VEC>(raw_x[r][p], k), scale, -row_lse[r])) : 0.f;
                g[i] = col + k < dy_len ? raw_at<T, VEC>(raw_dy[r][p], k) : 0.f;
                z += yv[i];
                a += is_log ? g[i] : g[i] * yv[i];
            }
        }
        z = group_reduce<OpSum>(z, group);
        a = group_reduce<OpSum>(a, group);
        const float inv_z = 1.f / z, a_z = is_log ? a : a * inv_z;
        if (row < rows) {
#pragma unroll
            for (int p = 0; p < P; p++) {
                const int col = (p * group + li) * VEC;
                if (col < n) {
                    float o[VEC];
#pragma unroll
                    for (int k = 0; k < VEC; k++) {
                        const float yk = yv[p * VEC + k] * inv_z, gk = g[p * VEC + k];
                        o[k] = col + k >= valid[r] ? 0.f : scale * (is_log ? gk - yk * a_z : yk * (gk - a_z));
                    }
                    store_vec<T, VEC>(dx + row * n + col, o);
                }
            }
        }
    }
}

// Elements left from a thread's first access, as an int in [-1, chunk].
__device__ __forceinline__ int clamp_offset(int64_t left, int64_t chunk) {
    return (int)(left < 0 ? -1 : (left > chunk ? chunk : left));
}

// ---- longer rows: K CTAs per row, each owning the slice [rank * seg, rank * seg + seg) ---------

template <typename T, int VEC>
__global__ void __launch_bounds__(kBlockThreads, 2)
softmax_fwd_rows_block(int64_t n, int64_t seg, int cluster_k, const T *__restrict__ x, T *__restrict__ y,
                       float *__restrict__ lse, float scale, int64_t causal_sq, int is_log) {
    constexpr int C = kBlockElemsFwd, P = C / VEC;
    __shared__ float red[33], slot;
    const int64_t row = blockIdx.x / cluster_k;
    const int rank = blockIdx.x % cluster_k;
    const int64_t begin = rank * seg, end = min(n, begin + seg);
    const int64_t valid = causal_len(row, n, causal_sq), load_end = min(end, valid);
    const int64_t chunk = (int64_t)blockDim.x * C;
    const int64_t chunks = end > begin ? (end - begin + chunk - 1) / chunk : 1;
    // Each warp owns 32 * C consecutive elements of a chunk, so a thread's accesses sit at constant
    // offsets (p * 32 * VEC) from one pointer: no per-access 64-bit address arithmetic.
    const int64_t lane_off = (int64_t)(threadIdx.x >> 5) * 32 * C + (threadIdx.x & 31) * VEC;
    const T *xr = x + row * n + lane_off;
    T *yr = y + row * n + lane_off;
    float v[C];

    auto load_chunk = [&](int64_t start) {
        const int avail = clamp_offset(load_end - start - lane_off, chunk);
        Raw<T, VEC> raw[P];
#pragma unroll
        for (int p = 0; p < P; p++)
            if (p * 32 * VEC < avail) raw[p] = load_raw<T, VEC>(xr + start + p * 32 * VEC);
#pragma unroll
        for (int p = 0; p < P; p++)
#pragma unroll
            for (int k = 0; k < VEC; k++)
                v[p * VEC + k] = p * 32 * VEC + k < avail ? __fmul_rn(raw_at<T, VEC>(raw[p], k), scale) : -INFINITY;
    };

    float m = -INFINITY, s = 0.f;
    bool v_is_exp = false;
    if (chunks == 1) {  // the slice stays in registers: max, then exp once per element
        load_chunk(begin);
#pragma unroll
        for (int k = 0; k < C; k++) m = fmaxf(m, v[k]);
        m = row_reduce<OpMax>(m, red, &slot, cluster_k);
        const float ref = exp_ref(m);
#pragma unroll
        for (int k = 0; k < C; k++) {
            const float e = expf(v[k] - ref);
            s += e;
            if (!is_log) v[k] = e;
        }
        v_is_exp = !is_log;
    } else {  // online: rescale the running sum once per chunk when the max grows
        for (int64_t c = 0; c < chunks; c++) {
            load_chunk(begin + c * chunk);
            float cm = -INFINITY;
#pragma unroll
            for (int k = 0; k < C; k++) cm = fmaxf(cm, v[k]);
            const float m_new = fmaxf(m, cm), ref = exp_ref(m_new);
            s = rescale(s, m, m_new);
#pragma unroll
            for (int k = 0; k < C; k++) s += expf(v[k] - ref);
            m = m_new;
        }
        const float row_max = row_reduce<OpMax>(m, red, &slot, cluster_k);
        s = rescale(s, m, row_max);
        m = row_max;
    }
    s = row_reduce<OpSum>(s, red, &slot, cluster_k);
    const float ref = exp_ref(m), inv_s = 1.f / s, log_s = logf(s);
    if (rank == 0 && threadIdx.x == 0) lse[row] = m + log_s;

    for (int64_t c = 0; c < chunks; c++) {
        const int64_t start = begin + c * chunk;
        if (chunks > 1) load_chunk(start);
        const int avail = clamp_offset(end - start - lane_off, chunk);
#pragma unroll
        for (int p = 0; p < P; p++) {
            if (p * 32 * VEC < avail) {
                float o[VEC];
#pragma unroll
                for (int k = 0; k < VEC; k++) {
                    const float t = v[p * VEC + k];
                    o[k] = is_log ? (t - ref) - log_s : normalize<T>(v_is_exp ? t : expf(t - ref), s, inv_s);
                }
                store_vec<T, VEC>(yr + start + p * 32 * VEC, o);
            }
        }
    }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kBlockThreads, 2)
softmax_bwd_rows_block(int64_t n, int64_t seg, int cluster_k, const T *__restrict__ dy,
                       const T *__restrict__ x, const float *__restrict__ lse, T *__restrict__ dx,
                       float scale, int64_t causal_sq, int is_log) {
    constexpr int C = kBlockElemsBwd, P = C / VEC;
    __shared__ float red[33], slot;
    const int64_t row = blockIdx.x / cluster_k;
    const int rank = blockIdx.x % cluster_k;
    const int64_t begin = rank * seg, end = min(n, begin + seg);
    const int64_t valid = causal_len(row, n, causal_sq);
    const int64_t x_end = min(end, valid), dy_end = is_log ? end : x_end;
    const int64_t chunk = (int64_t)blockDim.x * C;
    const int64_t chunks = end > begin ? (end - begin + chunk - 1) / chunk : 1;
    const float row_lse = lse[row];
    const int64_t lane_off = (int64_t)(threadIdx.x >> 5) * 32 * C + (threadIdx.x & 31) * VEC;
    const T *xr = x + row * n + lane_off, *dyr = dy + row * n + lane_off;
    T *dxr = dx + row * n + lane_off;
    float yv[C], g[C];

    auto load_chunk = [&](int64_t start) {
        const int x_avail = clamp_offset(x_end - start - lane_off, chunk);
        const int dy_avail = clamp_offset(dy_end - start - lane_off, chunk);
        Raw<T, VEC> raw_x[P], raw_dy[P];
#pragma unroll
        for (int p = 0; p < P; p++) {
            if (p * 32 * VEC < x_avail) raw_x[p] = load_raw<T, VEC>(xr + start + p * 32 * VEC);
            if (p * 32 * VEC < dy_avail) raw_dy[p] = load_raw<T, VEC>(dyr + start + p * 32 * VEC);
        }
#pragma unroll
        for (int p = 0; p < P; p++)
#pragma unroll
            for (int k = 0; k < VEC; k++) {
                const int i = p * 32 * VEC + k;
                yv[p * VEC + k] = i < x_avail ? expf(fmaf(raw_at<T, VEC>(raw_x[p], k), scale, -row_lse)) : 0.f;
                g[p * VEC + k] = i < dy_avail ? raw_at<T, VEC>(raw_dy[p], k) : 0.f;
            }
    };

    float z = 0.f, a = 0.f;
    for (int64_t c = 0; c < chunks; c++) {
        load_chunk(begin + c * chunk);
#pragma unroll
        for (int k = 0; k < C; k++) {
            z += yv[k];
            a += is_log ? g[k] : g[k] * yv[k];
        }
    }
    z = row_reduce<OpSum>(z, red, &slot, cluster_k);
    a = row_reduce<OpSum>(a, red, &slot, cluster_k);
    const float inv_z = 1.f / z, a_z = is_log ? a : a * inv_z;

    for (int64_t c = 0; c < chunks; c++) {
        const int64_t start = begin + c * chunk;
        if (chunks > 1) load_chunk(start);
        const int avail = clamp_offset(end - start - lane_off, chunk);
        const int x_avail = clamp_offset(x_end - start - lane_off, chunk);
#pragma unroll
        for (int p = 0; p < P; p++) {
            if (p * 32 * VEC < avail) {
                float o[VEC];
#pragma unroll
                for (int k = 0; k < VEC; k++) {
                    const float yk = yv[p * VEC + k] * inv_z, gk = g[p * VEC + k];
                    o[k] = p * 32 * VEC + k < x_avail ? scale * (is_log ? gk - yk * a_z : yk * (gk - a_z)) : 0.f;
                }
                store_vec<T, VEC>(dxr + start + p * 32 * VEC, o);
            }
        }
    }
}

// ---- inner > 1: columns x[o, :, i] ------------------------------------------------------------

constexpr int kColsX = 32;  // columns per CTA: one warp reads 32 adjacent inner elements
constexpr int kColsUnroll = 4;

template <typename T>
__global__ void __launch_bounds__(1024)
softmax_fwd_cols(const T *__restrict__ x, T *__restrict__ y, float *__restrict__ lse, int64_t columns,
                 int64_t n, int64_t inner, float scale, int is_log) {
    __shared__ float part_m[32][kColsX], part_s[32][kColsX];
    const int tx = threadIdx.x, ty = threadIdx.y, ny = blockDim.y;
    const int64_t column = (int64_t)blockIdx.x * kColsX + tx;
    const bool active = column < columns;
    const int64_t o = column / inner, base = o * n * inner + (column - o * inner);

    float m = -INFINITY, s = 0.f;
    if (active) {
        for (int64_t j0 = (int64_t)ty * kColsUnroll; j0 < n; j0 += (int64_t)ny * kColsUnroll) {
            float v[kColsUnroll];
#pragma unroll
            for (int u = 0; u < kColsUnroll; u++)
                v[u] = j0 + u < n ? __fmul_rn(fk::to_f32(x[base + (j0 + u) * inner]), scale) : -INFINITY;
            float cm = v[0];
#pragma unroll
            for (int u = 1; u < kColsUnroll; u++) cm = fmaxf(cm, v[u]);
            const float m_new = fmaxf(m, cm), ref = exp_ref(m_new);
            s = rescale(s, m, m_new);
#pragma unroll
            for (int u = 0; u < kColsUnroll; u++) s += expf(v[u] - ref);
            m = m_new;
        }
    }
    part_m[ty][tx] = m;
    part_s[ty][tx] = s;
    __syncthreads();
    m = -INFINITY;
    for (int t = 0; t < ny; t++) m = fmaxf(m, part_m[t][tx]);
    s = 0.f;
    for (int t = 0; t < ny; t++) s += rescale(part_s[t][tx], part_m[t][tx], m);
    if (!active) return;
    const float ref = exp_ref(m), inv_s = 1.f / s, log_s = logf(s);
    if (ty == 0) lse[column] = m + log_s;
    for (int64_t j = ty; j < n; j += ny) {
        const float v = __fmul_rn(fk::to_f32(x[base + j * inner]), scale);
        const float out = is_log ? (v - ref) - log_s : normalize<T>(expf(v - ref), s, inv_s);
        y[base + j * inner] = fk::from_f32<T>(out);
    }
}

template <typename T>
__global__ void __launch_bounds__(1024)
softmax_bwd_cols(const T *__restrict__ dy, const T *__restrict__ x, const float *__restrict__ lse,
                 T *__restrict__ dx, int64_t columns, int64_t n, int64_t inner, float scale,
                 int is_log) {
    __shared__ float part_z[32][kColsX], part_a[32][kColsX];
    const int tx = threadIdx.x, ty = threadIdx.y, ny = blockDim.y;
    const int64_t column = (int64_t)blockIdx.x * kColsX + tx;
    const bool active = column < columns;
    const int64_t o = column / inner, base = o * n * inner + (column - o * inner);
    const float row_lse = active ? lse[column] : 0.f;

    float z = 0.f, a = 0.f;
    if (active) {
        for (int64_t j = ty; j < n; j += ny) {
            const float yv = expf(fmaf(fk::to_f32(x[base + j * inner]), scale, -row_lse));
            const float g = fk::to_f32(dy[base + j * inner]);
            z += yv;
            a += is_log ? g : g * yv;
        }
    }
    part_z[ty][tx] = z;
    part_a[ty][tx] = a;
    __syncthreads();
    z = 0.f;
    a = 0.f;
    for (int t = 0; t < ny; t++) z += part_z[t][tx], a += part_a[t][tx];
    if (!active) return;
    const float inv_z = 1.f / z, a_z = is_log ? a : a * inv_z;
    for (int64_t j = ty; j < n; j += ny) {
        const float yv = expf(fmaf(fk::to_f32(x[base + j * inner]), scale, -row_lse)) * inv_z;
        const float g = fk::to_f32(dy[base + j * inner]);
        dx[base + j * inner] = fk::from_f32<T>(scale * (is_log ? g - yv * a_z : yv * (g - a_z)));
    }
}

// ---- host side ---------------------------------------------------------------------------------

int compute_major(int device) {
    static int majors[64];
    if (device < 0 || device >= 64) return 0;
    if (majors[device] == 0) {
        int major = 0;
        if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
            cudaGetLastError();
            return 0;
        }
        majors[device] = major;
    }
    return majors[device];
}

// The largest cluster (16, else 8) that `kernel` with kBlockThreads threads can be resident with on
// `device`; 1 where clusters do not exist. Asked once per kernel and device.
template <auto kernel> int cluster_limit(int device) {
    static int limits[64];
    if (compute_major(device) < 9 || device < 0 || device >= 64) return 1;
    if (limits[device] == 0) {
        int limit = 1;
        if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess) {
            for (int k = kMaxCluster; k > 1 && limit == 1; k /= 2) {
                cudaLaunchConfig_t config = {};
                cudaLaunchAttribute attr;
                attr.id = cudaLaunchAttributeClusterDimension;
                attr.val.clusterDim.x = (unsigned)k;
                attr.val.clusterDim.y = 1;
                attr.val.clusterDim.z = 1;
                config.gridDim = dim3((unsigned)k);
                config.blockDim = dim3(kBlockThreads);
                config.attrs = &attr;
                config.numAttrs = 1;
                int clusters = 0;
                if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) == cudaSuccess && clusters > 0)
                    limit = k;
            }
        }
        cudaGetLastError();
        limits[device] = limit;
    }
    return limits[device];
}

int pow2_ceil(int64_t v) {
    int p = 1;
    while (p < v) p *= 2;
    return p;
}

// Picks the CTA and cluster size of a row-block kernel (C elements per thread) and launches it:
// one CTA of just enough warps when the row fits, else K CTAs of kBlockThreads per row.
template <auto kernel, int VEC, int C, typename... Args>
fk_status launch_rows_block(const char *op, int64_t rows, int64_t n, int device, cudaStream_t stream,
                            Args... args) {
    const int64_t per_cta = (int64_t)kBlockThreads * C;
    int threads = kBlockThreads, k = 1;
    if (n <= per_cta) {
        threads = (int)(((n + C - 1) / C + 31) / 32 * 32);
    } else {
        const int64_t want = (n + per_cta - 1) / per_cta;
        const int limit = cluster_limit<kernel>(device);
        k = want >= limit ? limit : pow2_ceil(want);
    }
    const int64_t seg = ((n + k - 1) / k + VEC - 1) / VEC * VEC;
    if (rows * k > 0x7fffffff)
        return fk_fail(FK_ERR_VALUE, "%s: %lld rows of %lld elements exceed the CUDA grid", op,
                       (long long)rows, (long long)n);
    cudaLaunchConfig_t config = {};
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = (unsigned)k;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    config.gridDim = dim3((unsigned)(rows * k));
    config.blockDim = dim3((unsigned)threads);
    config.stream = stream;
    config.attrs = &attr;
    config.numAttrs = k > 1 ? 1 : 0;
    return fk::cuda_status(cudaLaunchKernelEx(&config, kernel, n, seg, k, args...), op);
}

// Lanes per row and elements per lane for the warp kernels: the smallest C (a multiple of VEC)
// with 32 * C >= n; rows shorter than 32 * VEC share a warp between 32 / group rows.
template <typename T, int VEC, int C>
fk_status launch_fwd_rows_warp(const T *x, T *y, float *lse, int64_t rows, int64_t n, float scale,
                               int64_t causal_sq, int is_log, cudaStream_t stream, const char *op) {
    if constexpr (C < 32) {
        if (32 * C < n) return launch_fwd_rows_warp<T, VEC, 2 * C>(x, y, lse, rows, n, scale, causal_sq, is_log, stream, op);
    }
    const int group = C == VEC ? pow2_ceil((n + VEC - 1) / VEC) : 32;
    const int64_t rows_per_cta = (int64_t)warp_rows<T, C>() * (32 / group) * (kWarpBlock / 32);
    const int64_t ctas = (rows + rows_per_cta - 1) / rows_per_cta;
    if (ctas > 0x7fffffff) return fk_fail(FK_ERR_VALUE, "%s: %lld rows exceed the CUDA grid", op, (long long)rows);
    softmax_fwd_rows_warp<T, VEC, C><<<(unsigned)ctas, kWarpBlock, 0, stream>>>(
        x, y, lse, rows, (int)n, group, scale, causal_sq, is_log);
    return fk::launch_status(op);
}

template <typename T, int VEC, int C>
fk_status launch_bwd_rows_warp(const T *dy, const T *x, const float *lse, T *dx, int64_t rows, int64_t n,
                               float scale, int64_t causal_sq, int is_log, cudaStream_t stream,
                               const char *op) {
    if constexpr (C < 32) {
        if (32 * C < n) return launch_bwd_rows_warp<T, VEC, 2 * C>(dy, x, lse, dx, rows, n, scale, causal_sq, is_log, stream, op);
    }
    const int group = C == VEC ? pow2_ceil((n + VEC - 1) / VEC) : 32;
    const int64_t rows_per_cta = (int64_t)warp_rows<T, 2 * C>() * (32 / group) * (kWarpBlock / 32);
    const int64_t ctas = (rows + rows_per_cta - 1) / rows_per_cta;
    if (ctas > 0x7fffffff) return fk_fail(FK_ERR_VALUE, "%s: %lld rows exceed the CUDA grid", op, (long long)rows);
    softmax_bwd_rows_warp<T, VEC, C><<<(unsigned)ctas, kWarpBlock, 0, stream>>>(
        dy, x, lse, dx, rows, (int)n, group, scale, causal_sq, is_log);
    return fk::launch_status(op);
}

// Columns per CTA are fixed at 32; the threads splitting n grow to 32 when there are too few
// columns to fill the GPU.
dim3 cols_block(int64_t columns, int device) {
    const int64_t ctas = (columns + kColsX - 1) / kColsX;
    return dim3(kColsX, ctas >= 8 * fk::sm_count(device) ? 8 : 32);
}

template <typename T, int VEC>
fk_status launch_fwd_rows(const T *x, T *y, float *lse, int64_t rows, int64_t n, float scale,
                          int64_t causal_sq, int is_log, int device, cudaStream_t stream, const char *op) {
    if (n <= kWarpMaxN)
        return launch_fwd_rows_warp<T, VEC, VEC>(x, y, lse, rows, n, scale, causal_sq, is_log, stream, op);
    return launch_rows_block<softmax_fwd_rows_block<T, VEC>, VEC, kBlockElemsFwd>(
        op, rows, n, device, stream, x, y, lse, scale, causal_sq, is_log);
}

template <typename T, int VEC>
fk_status launch_bwd_rows(const T *dy, const T *x, const float *lse, T *dx, int64_t rows, int64_t n,
                          float scale, int64_t causal_sq, int is_log, int device, cudaStream_t stream,
                          const char *op) {
    if (n <= kWarpMaxN)
        return launch_bwd_rows_warp<T, VEC, VEC>(dy, x, lse, dx, rows, n, scale, causal_sq, is_log, stream, op);
    return launch_rows_block<softmax_bwd_rows_block<T, VEC>, VEC, kBlockElemsBwd>(
        op, rows, n, device, stream, dy, x, lse, dx, scale, causal_sq, is_log);
}

fk_status check_args(const char *op, int64_t outer, int64_t n, int64_t inner, int64_t causal_sq) {
    if (outer < 0 || n < 0 || inner < 0)
        return fk_fail(FK_ERR_VALUE, "%s: sizes must be >= 0, got outer=%lld n=%lld inner=%lld", op,
                       (long long)outer, (long long)n, (long long)inner);
    if (causal_sq < 0 || (causal_sq > 0 && inner != 1))
        return fk_fail(FK_ERR_VALUE, "%s: causal_sq must be >= 0 and needs inner == 1, got "
                       "causal_sq=%lld inner=%lld", op, (long long)causal_sq, (long long)inner);
    return FK_OK;
}

}  // namespace

extern "C" fk_status fk_cuda_softmax_fwd(const void *x, void *y, float *lse, int64_t outer, int64_t n,
                                         int64_t inner, double scale, int64_t causal_sq, int log,
                                         fk_dtype dtype, int device, void *stream) {
    const char *op = "softmax_fwd";
    fk_status st = check_args(op, outer, n, inner, causal_sq);
    if (st != FK_OK || outer == 0 || inner == 0) return st;
    FK_CUDA_ENTER(op, device);
    cudaStream_t s = (cudaStream_t)stream;
    FK_DISPATCH_CUDA_DTYPE(dtype, op, {
        const T *xt = (const T *)x;
        T *yt = (T *)y;
        if (inner > 1) {
            const int64_t columns = outer * inner;
            const dim3 block = cols_block(columns, device);
            softmax_fwd_cols<T><<<(unsigned)((columns + kColsX - 1) / kColsX), block, 0, s>>>(
                xt, yt, lse, columns, n, inner, (float)scale, log);
            return fk::launch_status(op);
        }
        constexpr int N = fk::Pack<T>::N;
        if (fk::aligned16(x) && fk::aligned16(y) && n % N == 0)
            return launch_fwd_rows<T, N>(xt, yt, lse, outer, n, (float)scale, causal_sq, log, device, s, op);
        return launch_fwd_rows<T, 1>(xt, yt, lse, outer, n, (float)scale, causal_sq, log, device, s, op);
    });
    return FK_OK;
}

extern "C" fk_status fk_cuda_softmax_bwd(const void *dy, const void *x, const float *lse, void *dx,
                                         int64_t outer, int64_t n, int64_t inner, double scale,
                                         int64_t causal_sq, int log, fk_dtype dtype, int device,
                                         void *stream) {
    const char *op = "softmax_bwd";
    fk_status st = check_args(op, outer, n, inner, causal_sq);
    if (st != FK_OK || outer == 0 || inner == 0 || n == 0) return st;
    FK_CUDA_ENTER(op, device);
    cudaStream_t s = (cudaStream_t)stream;
    FK_DISPATCH_CUDA_DTYPE(dtype, op, {
        const T *dyt = (const T *)dy, *xt = (const T *)x;
        T *dxt = (T *)dx;
        if (inner > 1) {
            const int64_t columns = outer * inner;
            const dim3 block = cols_block(columns, device);
            softmax_bwd_cols<T><<<(unsigned)((columns + kColsX - 1) / kColsX), block, 0, s>>>(
                dyt, xt, lse, dxt, columns, n, inner, (float)scale, log);
            return fk::launch_status(op);
        }
        constexpr int N = fk::Pack<T>::N;
        if (fk::aligned16(dy) && fk::aligned16(x) && fk::aligned16(dx) && n % N == 0)
            return launch_bwd_rows<T, N>(dyt, xt, lse, dxt, outer, n, (float)scale, causal_sq, log, device, s, op);
        return launch_bwd_rows<T, 1>(dyt, xt, lse, dxt, outer, n, (float)scale, causal_sq, log, device, s, op);
    });
    return FK_OK;
}
