// cols_loop: softmax along a non-last dim for the columns cols_tile does not take, a thread a column.
//
// Table rows: inner > 1, one column a thread (inner not a multiple of a pack, or tensors not 16-byte
// aligned) whose columns outgrow the largest cluster, where this grid covers the SMs.
// Bytes: forward 1 read + 1 write, x read twice (the second time from L2 where the CTAs' column
// blocks fit); backward 2 reads + 1 write, x and dy read twice.
// Algorithm: a thread per (outer, inner) column, 32 of them a warp along inner so loads stay
//   coalesced, and the CTA's ny threads (8, or 32 on grids of under 8 CTAs an SM) splitting n,
//   kColsUnroll loads in flight each: an online max / fp64 sum down each part, a merge of the ny
//   partials through shared memory, then the write pass.
// Why: the fallback; the tile in chunks lost to it where its grid covers the SMs (H200 bf16 (4096,
// 8191) dim 0 backward 0.525 -> 0.423x torch.compile) (D-56).
#include "softmax.cuh"

namespace fk::softmax {
namespace {

// ---- inner > 1, columns the tile does not take (see launch_col_tile): looped kernels -----------

template <typename T>
__global__ void __launch_bounds__(1024)
softmax_fwd_cols(const T *__restrict__ x, T *__restrict__ y, float *__restrict__ row_max, int64_t columns,
                 int64_t n, int64_t inner, float scale, int is_log) {
    fk::grid_dependency_sync();
    // the sum is kept in fp64: in fp32, its rescalings and the merge of up to 32 partial sums
    // left the output at 3.5x torch's error (torch takes the exact max first, then one sum)
    __shared__ float part_m[32][kColsX];
    __shared__ double part_s[32][kColsX];
    const int tx = threadIdx.x, ty = threadIdx.y, ny = blockDim.y;
    const int64_t column = (int64_t)blockIdx.x * kColsX + tx;
    const bool active = column < columns;
    const int64_t o = column / inner, base = o * n * inner + (column - o * inner);
    auto scaled = [&](int64_t j) { return __fmul_rn(fk::to_f32(__ldg(x + base + j * inner)), scale); };

    float m = -INFINITY;
    double s = 0.0;
    if (active) {
        for (int64_t j0 = (int64_t)ty * kColsUnroll; j0 < n; j0 += (int64_t)ny * kColsUnroll) {
            float v[kColsUnroll];
#pragma unroll
            for (int u = 0; u < kColsUnroll; u++) v[u] = j0 + u < n ? scaled(j0 + u) : -INFINITY;
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
    s = 0.0;
    for (int t = 0; t < ny; t++) s += rescale(part_s[t][tx], part_m[t][tx], m);
    if (!active) return;
    const float ref = exp_ref(m), inv_s = (float)(1.0 / s), log_s = (float)log(s);
    if (ty == 0 && row_max) row_max[column] = m;
#pragma unroll kColsUnroll
    for (int64_t j = ty; j < n; j += ny) {
        const float v = scaled(j);
        y[base + j * inner] =
            fk::from_f32<T>(is_log ? (v - ref) - log_s : normalize<T>(expf(v - ref), (float)s, inv_s));
    }
}

template <typename T>
__global__ void __launch_bounds__(1024)
softmax_bwd_cols(const T *__restrict__ dy, const T *__restrict__ x, const float *__restrict__ row_max,
                 T *__restrict__ dx, int64_t columns, int64_t n, int64_t inner, float scale,
                 int is_log) {
    fk::grid_dependency_sync();
    __shared__ Acc<T> part_z[32][kColsX], part_a[32][kColsX];
    const int tx = threadIdx.x, ty = threadIdx.y, ny = blockDim.y;
    const int64_t column = (int64_t)blockIdx.x * kColsX + tx;
    const bool active = column < columns;
    const int64_t o = column / inner, base = o * n * inner + (column - o * inner);
    const float ref = active ? exp_ref(row_max[column]) : 0.f;
    auto y_of = [&](int64_t j) { return expf(fmaf(fk::to_f32(__ldg(x + base + j * inner)), scale, -ref)); };
    auto g_of = [&](int64_t j) { return fk::to_f32(__ldg(dy + base + j * inner)); };

    Acc<T> z = 0, a = 0;
    if (active) {
#pragma unroll kColsUnroll
        for (int64_t j = ty; j < n; j += ny) {
            const float yv = y_of(j), g = g_of(j);
            z += yv;
            a += is_log ? (Acc<T>)g : (Acc<T>)g * yv;
        }
    }
    part_z[ty][tx] = z;
    part_a[ty][tx] = a;
    __syncthreads();
    z = 0;
    a = 0;
    for (int t = 0; t < ny; t++) z += part_z[t][tx], a += part_a[t][tx];
    if (!active) return;
    const BwdRow<T> br(z, a, is_log, scale);
#pragma unroll kColsUnroll
    for (int64_t j = ty; j < n; j += ny) {
        const float yv = y_of(j), g = g_of(j);
        dx[base + j * inner] = fk::from_f32<T>(is_log ? br.template dx<true>(yv, g) : br.template dx<false>(yv, g));
    }
}


template <typename T> fk_status launch_fwd(const Plan &p, const FwdArgs &a) {
    const fk::Launch launch(dim3((unsigned)p.grid), dim3(p.block_x, p.block_y), 0, a.stream, a.device);
    return launch(a.op, softmax_fwd_cols<T>, (const T *)a.x, (T *)a.y, a.row_max, p.rows * p.inner, p.n, p.inner,
                  a.scale, (int)p.log);
}
template <typename T> fk_status launch_bwd(const Plan &p, const BwdArgs &a) {
    const fk::Launch launch(dim3((unsigned)p.grid), dim3(p.block_x, p.block_y), 0, a.stream, a.device);
    return launch(a.op, softmax_bwd_cols<T>, (const T *)a.dy, (const T *)a.x, a.row_max, (T *)a.dx, p.rows * p.inner,
                  p.n, p.inner, a.scale, (int)p.log);
}
}  // namespace

// The instances: one a dtype and direction, named by the launchers above (log is a run-time flag).
fk_status launch_cols_loop(const Plan &p, const FwdArgs &a) {
    FK_DISPATCH_CUDA_DTYPE(p.dtype, a.op, return launch_fwd<T>(p, a));
    return FK_OK;
}

fk_status launch_cols_loop(const Plan &p, const BwdArgs &a) {
    FK_DISPATCH_CUDA_DTYPE(p.dtype, a.op, return launch_bwd<T>(p, a));
    return FK_OK;
}

}  // namespace fk::softmax
