// rows_warp forward: softmax of rows of up to 1024 elements (their 16-byte frame), a lane group a row.
//
// Table rows: inner == 1, frame <= kWarpMaxN (every dtype, masked or not, packed, ragged or scalar).
// Bytes: 1 read + 1 write an element: bf16 (65536, 1024) moves 268 MB, 64 us at the H200's 4.2
// TB/s copy rate (~30 instructions an element fit that budget; this kernel spends ~12 on 16-bit).
// Algorithm: the fewest lanes of a warp that hold the row at 64 bytes a lane (G, a power of two;
//   rows just past a power of two take half the lanes with 3/2 the elements), 1-4 rows a lane group
//   so a lane has >= 64 bytes of loads in flight; every load issued before the first is used,
//   zero-filled past the row (no branch around an access); the exact max (shuffles over the group),
//   one exp an element kept in registers, the fp64 (fp32 data) or fp32 sum, then the stores (a
//   ragged row's edge accesses element by element, store_in).
// One-wave grids reserve shared memory so that no SM takes more than ceil(CTAs / SMs) of them
// (one_wave_smem: H200 (3000, 1000) bf16 forward 63-65 -> 71-74% of copy).
// Why: torch.compile's shape for short rows, the row read once (D-06, D-07, D-08); one-wave cap D-13.
#include "softmax.cuh"

namespace fk::softmax {
namespace {

// C elements per lane (C / VEC accesses); G lanes per row (0: `group_arg`, known at run time),
// group * C >= n. A compile-time G folds the reductions' level tests away.
template <typename T, int VEC, int C, int G, bool kCausal, bool kLog, int kThreads, bool kRagged = false>
__global__ void __launch_bounds__(kThreads)
softmax_fwd_rows_warp(int64_t rows, int n, int group_arg, const T *__restrict__ x, T *__restrict__ y,
                      float *__restrict__ row_max, float scale, int64_t causal_sq) {
    fk::grid_dependency_sync();
    constexpr int ROWS = warp_rows(sizeof(T), C, 1), P = C / VEC;
    const auto lg = LaneGroup<VEC>::template of<kThreads, ROWS>(G ? G : group_arg);

    Raw<T, VEC> raw[ROWS][P];
    int lead[ROWS], valid[ROWS];  // the row's frame (row_lead): keys are [lead, valid)
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int64_t row = lg.first + r;
        LaneGroup<VEC>::template frame<kRagged, kCausal>(row, rows, n, causal_sq, lead[r], valid[r]);
        const T *xr = x + row * n - lead[r];
        // rows whose last access may reach past the tensor's end (more than one when n < VEC) stop there
        if (kRagged && (rows - 1 - row) * (int64_t)n < VEC) {
#pragma unroll
            for (int p = 0; p < P; p++)
                raw[r][p] = load_or_zero_until<T, VEC>(xr + lg.col(p), lg.col(p) < valid[r], x + rows * n);
        } else {
#pragma unroll
            for (int p = 0; p < P; p++) raw[r][p] = load_or_zero<T, VEC>(xr + lg.col(p), lg.col(p) < valid[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int64_t row = lg.first + r;
        // element k of access p is a key: without a mask whole accesses are in or out (n % VEC == 0)
        auto is_key = [&](int p, int k) {
            const int col = lg.col(p);
            return kCausal ? col + k < valid[r] : col < valid[r];
        };
        float m = -INFINITY;
#pragma unroll
        for (int p = 0; p < P; p++) {
            if constexpr (VEC > 1 && !kCausal) {
                const int col = lg.col(p);
                float pm = is_key(p, 0) ? pack_max_scaled<T>(raw[r][p], scale) : -INFINITY;
                if (kRagged && straddles<VEC>(col, lead[r], valid[r])) {  // the row's elements only
                    pm = -INFINITY;
#pragma unroll
                    for (int k = 0; k < VEC; k++)
                        if (col + k >= lead[r] && col + k < valid[r]) pm = fmaxf(pm, __fmul_rn(raw_at<T, VEC>(raw[r][p], k), scale));
                }
                m = fmaxf(m, pm);
            } else {
#pragma unroll
                for (int k = 0; k < VEC; k++) {
                    const float v = __fmul_rn(raw_at<T, VEC>(raw[r][p], k), scale);
                    m = fmaxf(m, is_key(p, k) ? v : -INFINITY);
                }
            }
        }
        m = group_reduce<MaxOnly>(make_float2(m, 0.f), lg.group).x;
        const float ref = exp_ref(m);
        float e[C];  // one exp per element, kept for the output
        RowSum<T> sum;
#pragma unroll
        for (int p = 0; p < P; p++) {
#pragma unroll
            for (int k = 0; k < VEC; k++) {
                const float ek = exp_ftz(fmaf(raw_at<T, VEC>(raw[r][p], k), scale, -ref));
                e[p * VEC + k] = is_key(p, k) ? ek : 0.f;
            }
            if (kRagged) unragged<VEC>(lg.col(p), lead[r], valid[r], [&](int k) { e[p * VEC + k] = 0.f; });
#pragma unroll
            for (int k = 0; k < VEC; k++) sum.add(e[p * VEC + k]);
        }
        const float s = row_sum(sum, [&](Acc2<T> v) { return group_reduce<SumSum<Acc2<T>>>(v, lg.group); });
        const float inv_s = 1.f / s, log_s = logf(s);
        if (row < rows) {
            if (lg.li == 0 && row_max) row_max[row] = m;
            lg.template store<T, P, kRagged>(y + row * n - lead[r], lead[r], n, [&](int p, int k) {
                if (kLog) return is_key(p, k) ? fmaf(raw_at<T, VEC>(raw[r][p], k), scale, -ref) - log_s : -INFINITY - log_s;
                return normalize<T>(e[p * VEC + k], s, inv_s);
            });
        }
    }
}

template <typename T> fk_status launch(const Plan &p, const FwdArgs &a, const void *kernel) {
    using Kernel = void (*)(int64_t, int, int, const T *, T *, float *, float, int64_t);
    const fk::Launch launch(dim3((unsigned)p.grid), dim3(p.block_x), one_wave_smem(kernel, p.block_x, p.grid, a.device),
                            a.stream, a.device);
    return launch(a.op, (Kernel)kernel, p.rows, (int)p.n, p.group, (const T *)a.x, (T *)a.y, a.row_max, a.scale,
                  p.mask_sq);
}

// The instances: dtype, VEC, C (elements a lane), G (lanes a row, 0: run time), causal, log, CTA
// threads, ragged; the shapes plan_softmax picks for frames of 0-1024 elements.
#define FWD(T, VEC, C, G, CAUSAL, LOG, THREADS, RAGGED)                                                  \
    {instance_key(dtype_of<T>, VEC, C, G, CAUSAL, LOG, RAGGED, THREADS),                                  \
     (const void *)softmax_fwd_rows_warp<T, VEC, C, G, (bool)CAUSAL, (bool)LOG, THREADS, (bool)RAGGED>}
const Instance kInstances[] = {
    FWD(__half, 1, 1, 0, 0, 0, 128, 0),
    FWD(__half, 1, 1, 0, 0, 1, 128, 0),
    FWD(__half, 1, 1, 0, 1, 0, 128, 0),
    FWD(__half, 1, 1, 0, 1, 1, 128, 0),
    FWD(__half, 1, 2, 32, 0, 0, 128, 0),
    FWD(__half, 1, 2, 32, 0, 1, 128, 0),
    FWD(__half, 1, 2, 32, 1, 0, 128, 0),
    FWD(__half, 1, 2, 32, 1, 1, 128, 0),
    FWD(__half, 1, 4, 32, 0, 0, 128, 0),
    FWD(__half, 1, 4, 32, 0, 1, 128, 0),
    FWD(__half, 1, 4, 32, 1, 0, 128, 0),
    FWD(__half, 1, 4, 32, 1, 1, 128, 0),
    FWD(__half, 1, 8, 32, 0, 0, 128, 0),
    FWD(__half, 1, 8, 32, 0, 1, 128, 0),
    FWD(__half, 1, 8, 32, 1, 0, 128, 0),
    FWD(__half, 1, 8, 32, 1, 1, 128, 0),
    FWD(__half, 1, 16, 32, 0, 0, 128, 0),
    FWD(__half, 1, 16, 32, 0, 1, 128, 0),
    FWD(__half, 1, 16, 32, 1, 0, 128, 0),
    FWD(__half, 1, 16, 32, 1, 1, 128, 0),
    FWD(__half, 1, 32, 32, 0, 0, 128, 0),
    FWD(__half, 1, 32, 32, 0, 1, 128, 0),
    FWD(__half, 1, 32, 32, 1, 0, 128, 0),
    FWD(__half, 1, 32, 32, 1, 1, 128, 0),
    FWD(__half, 8, 32, 0, 0, 0, 128, 0),
    FWD(__half, 8, 32, 0, 0, 0, 128, 1),
    FWD(__half, 8, 32, 0, 0, 1, 128, 0),
    FWD(__half, 8, 32, 0, 0, 1, 128, 1),
    FWD(__half, 8, 32, 0, 1, 0, 128, 0),
    FWD(__half, 8, 32, 0, 1, 1, 128, 0),
    FWD(__half, 8, 32, 4, 0, 0, 128, 0),
    FWD(__half, 8, 32, 4, 0, 0, 128, 1),
    FWD(__half, 8, 32, 4, 0, 1, 128, 0),
    FWD(__half, 8, 32, 4, 0, 1, 128, 1),
    FWD(__half, 8, 32, 4, 1, 0, 128, 0),
    FWD(__half, 8, 32, 4, 1, 1, 128, 0),
    FWD(__half, 8, 32, 8, 0, 0, 128, 0),
    FWD(__half, 8, 32, 8, 0, 0, 128, 1),
    FWD(__half, 8, 32, 8, 0, 1, 128, 0),
    FWD(__half, 8, 32, 8, 0, 1, 128, 1),
    FWD(__half, 8, 32, 8, 1, 0, 128, 0),
    FWD(__half, 8, 32, 8, 1, 1, 128, 0),
    FWD(__half, 8, 32, 16, 0, 0, 128, 0),
    FWD(__half, 8, 32, 16, 0, 0, 128, 1),
    FWD(__half, 8, 32, 16, 0, 1, 128, 0),
    FWD(__half, 8, 32, 16, 0, 1, 128, 1),
    FWD(__half, 8, 32, 16, 1, 0, 128, 0),
    FWD(__half, 8, 32, 16, 1, 1, 128, 0),
    FWD(__half, 8, 32, 32, 0, 0, 128, 0),
    FWD(__half, 8, 32, 32, 0, 0, 128, 1),
    FWD(__half, 8, 32, 32, 0, 1, 128, 0),
    FWD(__half, 8, 32, 32, 0, 1, 128, 1),
    FWD(__half, 8, 32, 32, 1, 0, 128, 0),
    FWD(__half, 8, 32, 32, 1, 1, 128, 0),
    FWD(__half, 8, 48, 8, 0, 0, 128, 0),
    FWD(__half, 8, 48, 8, 0, 0, 128, 1),
    FWD(__half, 8, 48, 8, 0, 1, 128, 0),
    FWD(__half, 8, 48, 8, 0, 1, 128, 1),
    FWD(__half, 8, 48, 8, 1, 0, 128, 0),
    FWD(__half, 8, 48, 8, 1, 1, 128, 0),
    FWD(__half, 8, 48, 16, 0, 0, 128, 0),
    FWD(__half, 8, 48, 16, 0, 0, 128, 1),
    FWD(__half, 8, 48, 16, 0, 1, 128, 0),
    FWD(__half, 8, 48, 16, 0, 1, 128, 1),
    FWD(__half, 8, 48, 16, 1, 0, 128, 0),
    FWD(__half, 8, 48, 16, 1, 1, 128, 0),
    FWD(__nv_bfloat16, 1, 1, 0, 0, 0, 128, 0),
    FWD(__nv_bfloat16, 1, 1, 0, 0, 1, 128, 0),
    FWD(__nv_bfloat16, 1, 1, 0, 1, 0, 128, 0),
    FWD(__nv_bfloat16, 1, 1, 0, 1, 1, 128, 0),
    FWD(__nv_bfloat16, 1, 2, 32, 0, 0, 128, 0),
    FWD(__nv_bfloat16, 1, 2, 32, 0, 1, 128, 0),
    FWD(__nv_bfloat16, 1, 2, 32, 1, 0, 128, 0),
    FWD(__nv_bfloat16, 1, 2, 32, 1, 1, 128, 0),
    FWD(__nv_bfloat16, 1, 4, 32, 0, 0, 128, 0),
    FWD(__nv_bfloat16, 1, 4, 32, 0, 1, 128, 0),
    FWD(__nv_bfloat16, 1, 4, 32, 1, 0, 128, 0),
    FWD(__nv_bfloat16, 1, 4, 32, 1, 1, 128, 0),
    FWD(__nv_bfloat16, 1, 8, 32, 0, 0, 128, 0),
    FWD(__nv_bfloat16, 1, 8, 32, 0, 1, 128, 0),
    FWD(__nv_bfloat16, 1, 8, 32, 1, 0, 128, 0),
    FWD(__nv_bfloat16, 1, 8, 32, 1, 1, 128, 0),
    FWD(__nv_bfloat16, 1, 16, 32, 0, 0, 128, 0),
    FWD(__nv_bfloat16, 1, 16, 32, 0, 1, 128, 0),
    FWD(__nv_bfloat16, 1, 16, 32, 1, 0, 128, 0),
    FWD(__nv_bfloat16, 1, 16, 32, 1, 1, 128, 0),
    FWD(__nv_bfloat16, 1, 32, 32, 0, 0, 128, 0),
    FWD(__nv_bfloat16, 1, 32, 32, 0, 1, 128, 0),
    FWD(__nv_bfloat16, 1, 32, 32, 1, 0, 128, 0),
    FWD(__nv_bfloat16, 1, 32, 32, 1, 1, 128, 0),
    FWD(__nv_bfloat16, 8, 32, 0, 0, 0, 128, 0),
    FWD(__nv_bfloat16, 8, 32, 0, 0, 0, 128, 1),
    FWD(__nv_bfloat16, 8, 32, 0, 0, 1, 128, 0),
    FWD(__nv_bfloat16, 8, 32, 0, 0, 1, 128, 1),
    FWD(__nv_bfloat16, 8, 32, 0, 1, 0, 128, 0),
    FWD(__nv_bfloat16, 8, 32, 0, 1, 1, 128, 0),
    FWD(__nv_bfloat16, 8, 32, 4, 0, 0, 128, 0),
    FWD(__nv_bfloat16, 8, 32, 4, 0, 0, 128, 1),
    FWD(__nv_bfloat16, 8, 32, 4, 0, 1, 128, 0),
    FWD(__nv_bfloat16, 8, 32, 4, 0, 1, 128, 1),
    FWD(__nv_bfloat16, 8, 32, 4, 1, 0, 128, 0),
    FWD(__nv_bfloat16, 8, 32, 4, 1, 1, 128, 0),
    FWD(__nv_bfloat16, 8, 32, 8, 0, 0, 128, 0),
    FWD(__nv_bfloat16, 8, 32, 8, 0, 0, 128, 1),
    FWD(__nv_bfloat16, 8, 32, 8, 0, 1, 128, 0),
    FWD(__nv_bfloat16, 8, 32, 8, 0, 1, 128, 1),
    FWD(__nv_bfloat16, 8, 32, 8, 1, 0, 128, 0),
    FWD(__nv_bfloat16, 8, 32, 8, 1, 1, 128, 0),
    FWD(__nv_bfloat16, 8, 32, 16, 0, 0, 128, 0),
    FWD(__nv_bfloat16, 8, 32, 16, 0, 0, 128, 1),
    FWD(__nv_bfloat16, 8, 32, 16, 0, 1, 128, 0),
    FWD(__nv_bfloat16, 8, 32, 16, 0, 1, 128, 1),
    FWD(__nv_bfloat16, 8, 32, 16, 1, 0, 128, 0),
    FWD(__nv_bfloat16, 8, 32, 16, 1, 1, 128, 0),
    FWD(__nv_bfloat16, 8, 32, 32, 0, 0, 128, 0),
    FWD(__nv_bfloat16, 8, 32, 32, 0, 0, 128, 1),
    FWD(__nv_bfloat16, 8, 32, 32, 0, 1, 128, 0),
    FWD(__nv_bfloat16, 8, 32, 32, 0, 1, 128, 1),
    FWD(__nv_bfloat16, 8, 32, 32, 1, 0, 128, 0),
    FWD(__nv_bfloat16, 8, 32, 32, 1, 1, 128, 0),
    FWD(__nv_bfloat16, 8, 48, 8, 0, 0, 128, 0),
    FWD(__nv_bfloat16, 8, 48, 8, 0, 0, 128, 1),
    FWD(__nv_bfloat16, 8, 48, 8, 0, 1, 128, 0),
    FWD(__nv_bfloat16, 8, 48, 8, 0, 1, 128, 1),
    FWD(__nv_bfloat16, 8, 48, 8, 1, 0, 128, 0),
    FWD(__nv_bfloat16, 8, 48, 8, 1, 1, 128, 0),
    FWD(__nv_bfloat16, 8, 48, 16, 0, 0, 128, 0),
    FWD(__nv_bfloat16, 8, 48, 16, 0, 0, 128, 1),
    FWD(__nv_bfloat16, 8, 48, 16, 0, 1, 128, 0),
    FWD(__nv_bfloat16, 8, 48, 16, 0, 1, 128, 1),
    FWD(__nv_bfloat16, 8, 48, 16, 1, 0, 128, 0),
    FWD(__nv_bfloat16, 8, 48, 16, 1, 1, 128, 0),
    FWD(float, 1, 1, 0, 0, 0, 128, 0),
    FWD(float, 1, 1, 0, 0, 1, 128, 0),
    FWD(float, 1, 1, 0, 1, 0, 128, 0),
    FWD(float, 1, 1, 0, 1, 1, 128, 0),
    FWD(float, 1, 2, 32, 0, 0, 128, 0),
    FWD(float, 1, 2, 32, 0, 1, 128, 0),
    FWD(float, 1, 2, 32, 1, 0, 128, 0),
    FWD(float, 1, 2, 32, 1, 1, 128, 0),
    FWD(float, 1, 4, 32, 0, 0, 128, 0),
    FWD(float, 1, 4, 32, 0, 1, 128, 0),
    FWD(float, 1, 4, 32, 1, 0, 128, 0),
    FWD(float, 1, 4, 32, 1, 1, 128, 0),
    FWD(float, 1, 8, 32, 0, 0, 128, 0),
    FWD(float, 1, 8, 32, 0, 1, 128, 0),
    FWD(float, 1, 8, 32, 1, 0, 128, 0),
    FWD(float, 1, 8, 32, 1, 1, 128, 0),
    FWD(float, 1, 16, 32, 0, 0, 128, 0),
    FWD(float, 1, 16, 32, 0, 1, 128, 0),
    FWD(float, 1, 16, 32, 1, 0, 128, 0),
    FWD(float, 1, 16, 32, 1, 1, 128, 0),
    FWD(float, 1, 32, 32, 0, 0, 128, 0),
    FWD(float, 1, 32, 32, 0, 1, 128, 0),
    FWD(float, 1, 32, 32, 1, 0, 128, 0),
    FWD(float, 1, 32, 32, 1, 1, 128, 0),
    FWD(float, 4, 16, 0, 0, 0, 128, 0),
    FWD(float, 4, 16, 0, 0, 0, 128, 1),
    FWD(float, 4, 16, 0, 0, 1, 128, 0),
    FWD(float, 4, 16, 0, 0, 1, 128, 1),
    FWD(float, 4, 16, 0, 1, 0, 128, 0),
    FWD(float, 4, 16, 0, 1, 1, 128, 0),
    FWD(float, 4, 16, 4, 0, 0, 128, 0),
    FWD(float, 4, 16, 4, 0, 0, 128, 1),
    FWD(float, 4, 16, 4, 0, 1, 128, 0),
    FWD(float, 4, 16, 4, 0, 1, 128, 1),
    FWD(float, 4, 16, 4, 1, 0, 128, 0),
    FWD(float, 4, 16, 4, 1, 1, 128, 0),
    FWD(float, 4, 16, 8, 0, 0, 128, 0),
    FWD(float, 4, 16, 8, 0, 0, 128, 1),
    FWD(float, 4, 16, 8, 0, 1, 128, 0),
    FWD(float, 4, 16, 8, 0, 1, 128, 1),
    FWD(float, 4, 16, 8, 1, 0, 128, 0),
    FWD(float, 4, 16, 8, 1, 1, 128, 0),
    FWD(float, 4, 16, 16, 0, 0, 128, 0),
    FWD(float, 4, 16, 16, 0, 0, 128, 1),
    FWD(float, 4, 16, 16, 0, 1, 128, 0),
    FWD(float, 4, 16, 16, 0, 1, 128, 1),
    FWD(float, 4, 16, 16, 1, 0, 128, 0),
    FWD(float, 4, 16, 16, 1, 1, 128, 0),
    FWD(float, 4, 16, 32, 0, 0, 128, 0),
    FWD(float, 4, 16, 32, 0, 0, 128, 1),
    FWD(float, 4, 16, 32, 0, 1, 128, 0),
    FWD(float, 4, 16, 32, 0, 1, 128, 1),
    FWD(float, 4, 16, 32, 1, 0, 128, 0),
    FWD(float, 4, 16, 32, 1, 1, 128, 0),
    FWD(float, 4, 24, 8, 0, 0, 128, 0),
    FWD(float, 4, 24, 8, 0, 0, 128, 1),
    FWD(float, 4, 24, 8, 0, 1, 128, 0),
    FWD(float, 4, 24, 8, 0, 1, 128, 1),
    FWD(float, 4, 24, 8, 1, 0, 128, 0),
    FWD(float, 4, 24, 8, 1, 1, 128, 0),
    FWD(float, 4, 24, 16, 0, 0, 128, 0),
    FWD(float, 4, 24, 16, 0, 0, 128, 1),
    FWD(float, 4, 24, 16, 0, 1, 128, 0),
    FWD(float, 4, 24, 16, 0, 1, 128, 1),
    FWD(float, 4, 24, 16, 1, 0, 128, 0),
    FWD(float, 4, 24, 16, 1, 1, 128, 0),
    FWD(float, 4, 32, 32, 0, 0, 128, 0),
    FWD(float, 4, 32, 32, 0, 0, 128, 1),
    FWD(float, 4, 32, 32, 0, 1, 128, 0),
    FWD(float, 4, 32, 32, 0, 1, 128, 1),
    FWD(float, 4, 32, 32, 1, 0, 128, 0),
    FWD(float, 4, 32, 32, 1, 1, 128, 0),
};
#undef FWD
}  // namespace

const void *rows_warp_fwd_kernel(const Plan &p) {
    return find_instance(kInstances, instance_key(p.dtype, p.vec, p.elems, p.lanes, p.masked, p.log, p.ragged, p.block_x));
}

fk_status launch_rows_warp(const Plan &p, const FwdArgs &a) {
    const void *kernel = rows_warp_fwd_kernel(p);
    if (!kernel) return no_instance(p, a.op);
    FK_DISPATCH_CUDA_DTYPE(p.dtype, a.op, return launch<T>(p, a, kernel));
    return FK_OK;
}

}  // namespace fk::softmax
