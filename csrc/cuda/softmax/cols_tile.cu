// cols_tile: softmax along a non-last dim (inner > 1) where a CTA, or a cluster of up to 16, holds
// whole columns in registers (cols_tile_chunked: longer columns in chunks of rows).
//
// Table rows: inner > 1, columns that the largest cluster holds (chunked: that it does not, where
// 16-byte columns, or one-column-a-thread grids that do not cover the SMs).
// Bytes: forward 1 read + 1 write, backward 2 + 1; x (and dy) read once (chunked: forward 3 times,
// backward twice, the re-reads mostly from L2): bf16 (4096, 8192) dim 0 forward 134 MB, 32 us at 4.2 TB/s.
// Algorithm: a CTA of TX x TY threads takes TX x 16 bytes of adjacent columns (at least 64 bytes of
//   a row), its cluster all n rows of them, kTileRows accesses a thread loaded at once; the exact
//   column max, one exp an element and the (fp64 for fp32) sum, or the backward's two sums, each
//   reduced by shuffles, a slot per warp in shared memory, and with a cluster the peers' totals
//   through distributed shared memory (col_tile_reduce).
// Why: against the looped kernels (cols_loop.cu), H100, % of copy: forward 17-60 -> 50-94,
// backward 33-84 -> 56-100 (D-51).
#include "softmax.cuh"

namespace fk::softmax {
namespace {

// ---- inner > 1: the column tile in registers (and its chunks) -----------------------------------

template <typename V> __device__ __forceinline__ V shfl_xor(V v, int offset) {
    if constexpr (std::is_same_v<V, float2> || std::is_same_v<V, double2>)
        return V{__shfl_xor_sync(0xffffffffu, v.x, offset), __shfl_xor_sync(0xffffffffu, v.y, offset)};
    else return __shfl_xor_sync(0xffffffffu, v, offset);
}

// Combines v[k] (column tx * VEC + k of the CTA's tile) over every thread of the cluster that
// holds rows of that column: every thread gets the totals. `smem`: (warps + 2) x W values of V.
template <typename V, int VEC, typename Combine>
__device__ __forceinline__ void col_tile_reduce(V (&v)[VEC], unsigned char *smem, int cluster_k, Combine combine) {
    const int tx = threadIdx.x, tid = threadIdx.y * blockDim.x + tx, threads = blockDim.x * blockDim.y;
    const int w = blockDim.x * VEC, warps = threads >> 5;
    V *slot = reinterpret_cast<V *>(smem), *cta = slot + warps * w, *total = cluster_k > 1 ? cta + w : cta;
    // a reduction before this one may still be reading its totals, and where its V is narrower
    // (the forward's float max, then its fp64 sum) they lie where this one's slots go
    __syncthreads();
#pragma unroll
    for (int k = 0; k < VEC; k++)
        for (int offset = blockDim.x; offset < 32; offset <<= 1) v[k] = combine(v[k], shfl_xor(v[k], offset));
    if ((tid & 31) < (int)blockDim.x)
#pragma unroll
        for (int k = 0; k < VEC; k++) slot[(tid >> 5) * w + tx * VEC + k] = v[k];
    __syncthreads();
    for (int c = tid; c < w; c += threads) {
        V t = slot[c];
        for (int i = 1; i < warps; i++) t = combine(t, slot[i * w + c]);
        cta[c] = t;
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (cluster_k > 1) {
        cg::cluster_group cluster = cg::this_cluster();
        cluster.sync();  // every CTA's totals are in
        for (int c = tid; c < w; c += threads) {
            V t = cluster.map_shared_rank(cta, 0)[c];
            for (int r = 1; r < cluster_k; r++) t = combine(t, cluster.map_shared_rank(cta, r)[c]);
            total[c] = t;
        }
        cluster.sync();  // no peer reads this CTA's totals any more (it may exit, or reduce again)
    } else
#endif
        __syncthreads();
#pragma unroll
    for (int k = 0; k < VEC; k++) v[k] = total[tx * VEC + k];
}

// The thread's rows of its column tile: access i reads row first + i * step; in(i): that row is one of
// the n and the thread's columns exist.
struct TileRows {
    int first, step, n;
    bool active;
    __device__ __forceinline__ TileRows(int cluster_k, int n_, bool active_)
        : first((int)(blockIdx.x % cluster_k) * blockDim.y + threadIdx.y), step(cluster_k * blockDim.y), n(n_),
          active(active_) {}
    __device__ __forceinline__ bool in(int i) const { return active && first + i * step < n; }
};

// p + stride, computed where it is used: the compiler cannot keep the accesses' 64-bit offsets
// live from the loads to the stores (16 registers for 8 accesses).
template <typename T> __device__ __forceinline__ T *advance(T *p, int64_t stride) {
    p += stride;
    asm volatile("" : "+l"(p));
    return p;
}

// The column block's base offset (o n inner + i) of the VEC columns from `column`.
__device__ __forceinline__ int64_t column_base(int64_t column, int64_t n, int64_t inner) {
    const int64_t o = column / inner;
    return o * n * inner + (column - o * inner);
}

// kChunked: columns longer than the cluster's threads hold kRows accesses of take chunks of them:
// the max over every chunk, the sum from the last chunk (still held) back to the first, the writes
// from the first (still held) on, so x is read three times, the chunks read again most recently
// first (from L2 where they still are). One chunk (the tile) reads x once.
template <typename T, int VEC, bool kLog, int kThreads, int kRows = kTileRows, bool kChunked = false>
__global__ void __launch_bounds__(kThreads, 1)
softmax_fwd_col_tile(const T *__restrict__ x, T *__restrict__ y, float *__restrict__ row_max, int64_t columns,
                     int n, int64_t inner, int cluster_k, float scale) {
    extern __shared__ __align__(16) unsigned char tile_smem[];
    fk::grid_dependency_sync();
    const int64_t column = ((int64_t)(blockIdx.x / cluster_k) * blockDim.x + threadIdx.x) * VEC;
    const TileRows rows(cluster_k, n, column < columns);
    const int64_t base = rows.active ? column_base(column, n, inner) : 0, stride = rows.step * inner,
                  offset = base + rows.first * inner;
    const int chunks = kChunked ? (n + rows.step * kRows - 1) / (rows.step * kRows) : 1;
    Raw<T, VEC> raw[kRows];
    auto load = [&](int c) {
        const T *xp = x + offset + (int64_t)c * kRows * stride;
#pragma unroll
        for (int i = 0; i < kRows; i++, xp = advance(xp, stride)) raw[i] = load_or_zero<T, VEC>(xp, rows.in(c * kRows + i));
    };
    float m[VEC];
#pragma unroll
    for (int k = 0; k < VEC; k++) m[k] = -INFINITY;
    auto max_of = [&](int c) {
#pragma unroll
        for (int k = 0; k < VEC; k++)
#pragma unroll
            for (int i = 0; i < kRows; i++)
                if (rows.in(c * kRows + i)) m[k] = fmaxf(m[k], __fmul_rn(raw_at<T, VEC>(raw[i], k), scale));
    };
    if constexpr (!kChunked) load(0), max_of(0);
    else
        for (int c = 0; c < chunks; c++) load(c), max_of(c);
    col_tile_reduce(m, tile_smem, cluster_k, [](float a, float b) { return fmaxf(a, b); });
    auto e_of = [&](int i, int k) { return exp_ftz(fmaf(raw_at<T, VEC>(raw[i], k), scale, -exp_ref(m[k]))); };
    float e[kExpOnce<T> && !kChunked ? kRows * VEC : 1];  // a lone chunk's exps (fp32), for the writes
    RowSum<T> sums[VEC];
    auto sum_of = [&](int c) {
#pragma unroll
        for (int k = 0; k < VEC; k++)
#pragma unroll
            for (int i = 0; i < kRows; i++) {
                const float ek = rows.in(c * kRows + i) ? e_of(i, k) : 0.f;
                if constexpr (kExpOnce<T> && !kChunked) e[i * VEC + k] = ek;
                sums[k].add(ek);
            }
    };
    if constexpr (!kChunked) sum_of(0);
    else
        for (int c = chunks - 1; c >= 0; c--) {
            if (c < chunks - 1) load(c);
            sum_of(c);
        }
    Acc<T> s[VEC];
#pragma unroll
    for (int k = 0; k < VEC; k++) s[k] = sums[k].value();
    col_tile_reduce(s, tile_smem, cluster_k, [](Acc<T> a, Acc<T> b) { return a + b; });
    if (rows.active && rows.first == 0 && row_max)
#pragma unroll
        for (int k = 0; k < VEC; k++) row_max[column + k] = m[k];
    float sf[VEC], inv_s[VEC], log_s[VEC];
#pragma unroll
    for (int k = 0; k < VEC; k++) sf[k] = (float)s[k], inv_s[k] = 1.f / sf[k], log_s[k] = logf(sf[k]);
    auto write = [&](int c) {
        T *yp = y + offset + (int64_t)c * kRows * stride;
#pragma unroll
        for (int i = 0; i < kRows; i++, yp = advance(yp, stride)) {
            if (!rows.in(c * kRows + i)) continue;
            float out[VEC];
#pragma unroll
            for (int k = 0; k < VEC; k++)
                out[k] = kLog ? fmaf(raw_at<T, VEC>(raw[i], k), scale, -exp_ref(m[k])) - log_s[k]
                              : normalize<T>(kExpOnce<T> && !kChunked ? e[i * VEC + k] : e_of(i, k), sf[k], inv_s[k]);
            store_vec<T, VEC>(yp, out);
        }
    };
    if constexpr (!kChunked) write(0);
    else
        for (int c = 0; c < chunks; c++) {
            if (c > 0) load(c);
            write(c);
        }
}

template <typename T, int VEC, bool kLog, int kRows = kTileRows, int kThreads = kTileBwdThreads, int kMinCtas = 1,
          bool kChunked = false>
__global__ void __launch_bounds__(kThreads, kMinCtas)
softmax_bwd_col_tile(const T *__restrict__ dy, const T *__restrict__ x, const float *__restrict__ row_max,
                     T *__restrict__ dx, int64_t columns, int n, int64_t inner, int cluster_k, float scale) {
    extern __shared__ __align__(16) unsigned char tile_smem[];
    fk::grid_dependency_sync();
    const int64_t column = ((int64_t)(blockIdx.x / cluster_k) * blockDim.x + threadIdx.x) * VEC;
    const TileRows rows(cluster_k, n, column < columns);
    const int64_t base = rows.active ? column_base(column, n, inner) : 0, stride = rows.step * inner,
                  offset = base + rows.first * inner;
    // kChunked: columns longer than the cluster's threads hold kRows accesses of take chunks of them,
    // the sums over every chunk, then the writes from the last chunk (still held) back to the first
    // (loaded again). One chunk (the tile) reads x and dy once.
    const int chunks = kChunked ? (n + rows.step * kRows - 1) / (rows.step * kRows) : 1;
    Raw<T, VEC> raw_x[kRows], raw_dy[kRows];
    auto load = [&](int c) {
#pragma unroll
        for (int i = 0; i < kRows; i++) {
            const int r = c * kRows + i;
            raw_x[i] = load_or_zero<T, VEC>(x + offset + r * stride, rows.in(r));
            raw_dy[i] = load_or_zero<T, VEC>(dy + offset + r * stride, rows.in(r));
        }
    };
    float ref[VEC];
#pragma unroll
    for (int k = 0; k < VEC; k++) ref[k] = rows.active ? exp_ref(row_max[column + k]) : 0.f;
    // y' = exp(x * scale - row_max): unnormalised, z = sum y' renormalises it
    auto y_of = [&](int c, int i, int k) {
        return rows.in(c * kRows + i) ? exp_ftz(fmaf(raw_at<T, VEC>(raw_x[i], k), scale, -ref[k])) : 0.f;
    };
    float yv[kExpOnce<T> ? kRows * VEC : 1];  // the exps of a lone chunk (fp32), for the writes
    BwdSums<T, kLog> sums[VEC];
    auto accumulate = [&](int c, auto keep) {
#pragma unroll
        for (int k = 0; k < VEC; k++)
#pragma unroll
            for (int i = 0; i < kRows; i++) {
                const float yk = y_of(c, i, k);
                if constexpr (decltype(keep)::value) yv[i * VEC + k] = yk;
                sums[k].add(yk, raw_at<T, VEC>(raw_dy[i], k));
            }
    };
    if constexpr (!kChunked) load(0), accumulate(0, std::bool_constant<kExpOnce<T>>());
    else
        for (int c = 0; c < chunks; c++) load(c), accumulate(c, std::false_type());
    Acc2<T> za[VEC];
#pragma unroll
    for (int k = 0; k < VEC; k++) za[k] = sums[k].value();
    col_tile_reduce(za, tile_smem, cluster_k, [](Acc2<T> a, Acc2<T> b) { return SumSum<Acc2<T>>::combine(a, b); });
    BwdRow<T> br[VEC];
#pragma unroll
    for (int k = 0; k < VEC; k++) br[k] = BwdRow<T>(za[k].x, za[k].y, kLog, scale);
    auto write = [&](int c, auto kept) {
#pragma unroll
        for (int i = 0; i < kRows; i++) {
            const int r = c * kRows + i;
            if (!rows.in(r)) continue;
            float out[VEC];
#pragma unroll
            for (int k = 0; k < VEC; k++)
                out[k] = br[k].template dx<kLog>(decltype(kept)::value ? yv[i * VEC + k] : y_of(c, i, k),
                                                 raw_at<T, VEC>(raw_dy[i], k));
            store_vec<T, VEC>(dx + offset + r * stride, out);
        }
    };
    if constexpr (!kChunked) write(0, std::bool_constant<kExpOnce<T>>());
    else
        for (int c = chunks - 1; c >= 0; c--) {
            if (c < chunks - 1) load(c);
            write(c, std::false_type());
        }
}


template <typename T> fk_status launch_fwd(const Plan &p, const FwdArgs &a, const void *kernel) {
    using Kernel = void (*)(const T *, T *, float *, int64_t, int, int64_t, int, float);
    const fk::Launch launch(dim3((unsigned)p.grid), dim3(p.block_x, p.block_y), p.smem, a.stream, a.device, p.cluster);
    return launch(a.op, (Kernel)kernel, (const T *)a.x, (T *)a.y, a.row_max, p.rows * p.inner, (int)p.n, p.inner,
                  p.cluster, a.scale);
}
template <typename T> fk_status launch_bwd(const Plan &p, const BwdArgs &a, const void *kernel) {
    using Kernel = void (*)(const T *, const T *, const float *, T *, int64_t, int, int64_t, int, float);
    const fk::Launch launch(dim3((unsigned)p.grid), dim3(p.block_x, p.block_y), p.smem, a.stream, a.device, p.cluster);
    return launch(a.op, (Kernel)kernel, (const T *)a.dy, (const T *)a.x, a.row_max, (T *)a.dx, p.rows * p.inner,
                  (int)p.n, p.inner, p.cluster, a.scale);
}

// The instances: dtype, VEC, log, the kernel's thread bound, accesses a thread (rows), chunked;
// backward also the CTAs an SM it is compiled for.
#define KEY(T, VEC, LOG, THREADS, ROWS, MIN_CTAS, CHUNKED, BACKWARD) \
    instance_key(dtype_of<T>, VEC, ROWS, THREADS, false, LOG, false, MIN_CTAS + 8 * CHUNKED + 16 * BACKWARD)
#define FWD(T, VEC, LOG, THREADS, ROWS, CHUNKED) \
    {KEY(T, VEC, LOG, THREADS, ROWS, 1, CHUNKED, 0), (const void *)softmax_fwd_col_tile<T, VEC, (bool)LOG, THREADS, ROWS, (bool)CHUNKED>}
#define BWD(T, VEC, LOG, THREADS, ROWS, MIN_CTAS, CHUNKED)                                   \
    {KEY(T, VEC, LOG, THREADS, ROWS, MIN_CTAS, CHUNKED, 1),                                    \
     (const void *)softmax_bwd_col_tile<T, VEC, (bool)LOG, ROWS, THREADS, MIN_CTAS, (bool)CHUNKED>}
const Instance kInstances[] = {
    FWD(float, 1, 0, 1024, 4, 0),
    FWD(float, 1, 0, 512, 16, 0),
    FWD(float, 1, 0, 512, 16, 1),
    FWD(float, 1, 1, 1024, 4, 0),
    FWD(float, 1, 1, 512, 16, 0),
    FWD(float, 1, 1, 512, 16, 1),
    FWD(float, 4, 0, 1024, 4, 0),
    FWD(float, 4, 0, 512, 16, 0),
    FWD(float, 4, 0, 512, 16, 1),
    FWD(float, 4, 1, 1024, 4, 0),
    FWD(float, 4, 1, 512, 16, 0),
    FWD(float, 4, 1, 512, 16, 1),
    FWD(__half, 1, 0, 1024, 8, 0),
    FWD(__half, 1, 0, 512, 8, 1),
    FWD(__half, 1, 1, 1024, 8, 0),
    FWD(__half, 1, 1, 512, 8, 1),
    FWD(__half, 8, 0, 1024, 8, 0),
    FWD(__half, 8, 0, 512, 8, 1),
    FWD(__half, 8, 1, 1024, 8, 0),
    FWD(__half, 8, 1, 512, 8, 1),
    FWD(__nv_bfloat16, 1, 0, 1024, 8, 0),
    FWD(__nv_bfloat16, 1, 0, 512, 8, 1),
    FWD(__nv_bfloat16, 1, 1, 1024, 8, 0),
    FWD(__nv_bfloat16, 1, 1, 512, 8, 1),
    FWD(__nv_bfloat16, 8, 0, 1024, 8, 0),
    FWD(__nv_bfloat16, 8, 0, 512, 8, 1),
    FWD(__nv_bfloat16, 8, 1, 1024, 8, 0),
    FWD(__nv_bfloat16, 8, 1, 512, 8, 1),
    BWD(float, 1, 0, 256, 4, 3, 0),
    BWD(float, 1, 0, 512, 8, 1, 0),
    BWD(float, 1, 0, 512, 8, 1, 1),
    BWD(float, 1, 1, 256, 4, 3, 0),
    BWD(float, 1, 1, 512, 8, 1, 0),
    BWD(float, 1, 1, 512, 8, 1, 1),
    BWD(float, 4, 0, 256, 4, 3, 0),
    BWD(float, 4, 0, 512, 8, 1, 0),
    BWD(float, 4, 0, 512, 8, 1, 1),
    BWD(float, 4, 1, 256, 4, 3, 0),
    BWD(float, 4, 1, 512, 8, 1, 0),
    BWD(float, 4, 1, 512, 8, 1, 1),
    BWD(__half, 1, 0, 512, 8, 1, 0),
    BWD(__half, 1, 0, 512, 8, 1, 1),
    BWD(__half, 1, 1, 512, 8, 1, 0),
    BWD(__half, 1, 1, 512, 8, 1, 1),
    BWD(__half, 8, 0, 512, 8, 1, 0),
    BWD(__half, 8, 0, 512, 8, 1, 1),
    BWD(__half, 8, 1, 512, 8, 1, 0),
    BWD(__half, 8, 1, 512, 8, 1, 1),
    BWD(__nv_bfloat16, 1, 0, 512, 8, 1, 0),
    BWD(__nv_bfloat16, 1, 0, 512, 8, 1, 1),
    BWD(__nv_bfloat16, 1, 1, 512, 8, 1, 0),
    BWD(__nv_bfloat16, 1, 1, 512, 8, 1, 1),
    BWD(__nv_bfloat16, 8, 0, 512, 8, 1, 0),
    BWD(__nv_bfloat16, 8, 0, 512, 8, 1, 1),
    BWD(__nv_bfloat16, 8, 1, 512, 8, 1, 0),
    BWD(__nv_bfloat16, 8, 1, 512, 8, 1, 1),
};
#undef KEY
#undef FWD
#undef BWD
}  // namespace

const void *cols_tile_kernel(const Plan &p) {
    return find_instance(kInstances, instance_key(p.dtype, p.vec, p.elems, p.lanes, false, p.log, false,
                                                  p.min_ctas + 8 * (p.strategy == Strategy::kColsTileChunked) +
                                                      16 * p.backward));
}

fk_status launch_cols_tile(const Plan &p, const FwdArgs &a) {
    const void *kernel = cols_tile_kernel(p);
    if (!kernel) return no_instance(p, a.op);
    FK_DISPATCH_CUDA_DTYPE(p.dtype, a.op, return launch_fwd<T>(p, a, kernel));
    return FK_OK;
}

fk_status launch_cols_tile(const Plan &p, const BwdArgs &a) {
    const void *kernel = cols_tile_kernel(p);
    if (!kernel) return no_instance(p, a.op);
    FK_DISPATCH_CUDA_DTYPE(p.dtype, a.op, return launch_bwd<T>(p, a, kernel));
    return FK_OK;
}

}  // namespace fk::softmax
