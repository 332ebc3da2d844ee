// rows_warp backward: the softmax gradient of rows of up to 1024 elements, a lane group a row.
//
// Table rows: inner == 1, frame <= kWarpMaxN (every dtype, masked or not, packed, ragged or scalar).
// Bytes: 2 reads (x, dy) + 1 write an element: fp32 (32768, 1024) moves 403 MB, 96 us at 4.2 TB/s.
// Algorithm: as the forward (rows_warp_fwd.cu) at 32 bytes of each of x and dy a lane; y' =
//   exp(x * scale - row_max) from the forward's saved row max, the two sums z = sum y' and
//   a = sum dy y' (fp64 for fp32 data) over the lane group, then dx = y' (c dy - c a) (BwdRow), one
//   pass, x and dy read once.
// fp32 with 32 elements a lane is capped at 80 registers, 6 CTAs an SM (H200 1024-wide rows 78 ->
// 82% of copy).
// Why: torch.compile's shape for short rows, with y recomputed instead of saved (D-06, D-12).
#include "softmax.cuh"

namespace fk::softmax {
namespace {

// The exp of the fp32 16-byte instances is expf: a gradient's cancellation puts the exp's error
// whole into a small dx, and ex2.approx crossed the 2x-torch bound on single rows (D-65); the
// scalar instances keep exp_ftz (expf lost 9% at 257).
template <typename T, int VEC> __device__ __forceinline__ float exp_warp_bwd(float t) {
    if constexpr (std::is_same_v<T, float> && VEC > 1) return expf(t);
    else return exp_ftz(t);
}

// fp32 with 32 elements a lane: capped at 80 registers, 6 CTAs an SM (D-10). Without a mask a
// non-key access takes its exps against +inf: one select an access, not one an element (D-12).
template <typename T, int VEC, int C, int G, bool kCausal, bool kLog, int kThreads, bool kRagged = false>
__global__ void __launch_bounds__(kThreads, !std::is_same_v<T, float> || C != 32 ? 1 : 6)
softmax_bwd_rows_warp(int64_t rows, int n, int group_arg, const T *__restrict__ dy, const T *__restrict__ x,
                      const float *__restrict__ row_max, T *__restrict__ dx, float scale, int64_t causal_sq) {
    fk::grid_dependency_sync();
    constexpr int ROWS = warp_rows(sizeof(T), C, 2), P = C / VEC;  // x and dy: 64 bytes between them
    const auto lg = LaneGroup<VEC>::template of<kThreads, ROWS>(G ? G : group_arg);

    Raw<T, VEC> raw_x[ROWS][P], raw_dy[ROWS][P];
    int lead[ROWS], valid[ROWS], dy_len[ROWS];  // the row's frame (row_lead): keys [lead, valid)
    float m_saved[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int64_t row = lg.first + r;
        LaneGroup<VEC>::template frame<kRagged, kCausal>(row, rows, n, causal_sq, lead[r], valid[r]);
        // log_softmax sums dy over masked keys too (their y is 0, not their dy)
        dy_len[r] = row >= rows ? 0 : kLog ? lead[r] + n : valid[r];
        m_saved[r] = row < rows ? row_max[row] : 0.f;
        const T *xr = x + row * n - lead[r], *dyr = dy + row * n - lead[r];
        // rows whose last access may reach past the tensor's end (more than one when n < VEC) stop there
        if (kRagged && (rows - 1 - row) * (int64_t)n < VEC) {
#pragma unroll
            for (int p = 0; p < P; p++) {
                const int col = lg.col(p);
                raw_x[r][p] = load_or_zero_until<T, VEC>(xr + col, col < valid[r], x + rows * n);
                raw_dy[r][p] = load_or_zero_until<T, VEC>(dyr + col, col < dy_len[r], dy + rows * n);
            }
        } else {
#pragma unroll
            for (int p = 0; p < P; p++) {
                const int col = lg.col(p);
                raw_x[r][p] = load_or_zero<T, VEC>(xr + col, col < valid[r]);
                raw_dy[r][p] = load_or_zero<T, VEC>(dyr + col, col < dy_len[r]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int64_t row = lg.first + r;
        auto in = [&](int p, int k, int len) {
            const int col = lg.col(p);
            return kCausal ? col + k < len : col < len;
        };
        float yv[C], g[C];
        BwdSums<T, kLog> sums;  // (z, a): sum of y', sum of dy * y' (log: of dy)
        const float ref = exp_ref(m_saved[r]);
#pragma unroll
        for (int p = 0; p < P; p++) {
            const float ref_p = kCausal || in(p, 0, valid[r]) ? ref : INFINITY;
#pragma unroll
            for (int k = 0; k < VEC; k++) {
                const int i = p * VEC + k;
                const float yk = exp_warp_bwd<T, VEC>(fmaf(raw_at<T, VEC>(raw_x[r][p], k), scale, -ref_p));
                yv[i] = kCausal && !in(p, k, valid[r]) ? 0.f : yk;
                g[i] = !kCausal || in(p, k, dy_len[r]) ? raw_at<T, VEC>(raw_dy[r][p], k) : 0.f;
            }
            if (kRagged)
                unragged<VEC>(lg.col(p), lead[r], valid[r], [&](int k) { yv[p * VEC + k] = g[p * VEC + k] = 0.f; });
#pragma unroll
            for (int k = 0; k < VEC; k++) sums.add(yv[p * VEC + k], g[p * VEC + k]);
        }
        const Acc2<T> za = group_reduce<SumSum<Acc2<T>>>(sums.value(), lg.group);
        const BwdRow<T> br(za.x, za.y, kLog, scale);
        if (row < rows) {
            lg.template store<T, P, kRagged>(dx + row * n - lead[r], lead[r], n, [&](int p, int k) {
                const float d = br.template dx<kLog>(yv[p * VEC + k], g[p * VEC + k]);
                return kCausal && !in(p, k, valid[r]) ? 0.f : d;
            });
        }
    }
}

template <typename T> fk_status launch(const Plan &p, const BwdArgs &a, const void *kernel) {
    using Kernel = void (*)(int64_t, int, int, const T *, const T *, const float *, T *, float, int64_t);
    const fk::Launch launch(dim3((unsigned)p.grid), dim3(p.block_x), one_wave_smem(kernel, p.block_x, p.grid, a.device),
                            a.stream, a.device);
    return launch(a.op, (Kernel)kernel, p.rows, (int)p.n, p.group, (const T *)a.dy, (const T *)a.x, a.row_max,
                  (T *)a.dx, a.scale, p.mask_sq);
}

// The instances: dtype, VEC, C (elements a lane), G (lanes a row, 0: run time), causal, log, CTA
// threads, ragged; the shapes plan_softmax picks for frames of 0-1024 elements.
#define BWD(T, VEC, C, G, CAUSAL, LOG, THREADS, RAGGED)                                                  \
    {instance_key(dtype_of<T>, VEC, C, G, CAUSAL, LOG, RAGGED, THREADS),                                  \
     (const void *)softmax_bwd_rows_warp<T, VEC, C, G, (bool)CAUSAL, (bool)LOG, THREADS, (bool)RAGGED>}
const Instance kInstances[] = {
    BWD(__half, 1, 1, 0, 0, 0, 128, 0),
    BWD(__half, 1, 1, 0, 0, 1, 128, 0),
    BWD(__half, 1, 1, 0, 1, 0, 128, 0),
    BWD(__half, 1, 1, 0, 1, 1, 128, 0),
    BWD(__half, 1, 2, 32, 0, 0, 128, 0),
    BWD(__half, 1, 2, 32, 0, 1, 128, 0),
    BWD(__half, 1, 2, 32, 1, 0, 128, 0),
    BWD(__half, 1, 2, 32, 1, 1, 128, 0),
    BWD(__half, 1, 4, 32, 0, 0, 128, 0),
    BWD(__half, 1, 4, 32, 0, 1, 128, 0),
    BWD(__half, 1, 4, 32, 1, 0, 128, 0),
    BWD(__half, 1, 4, 32, 1, 1, 128, 0),
    BWD(__half, 1, 8, 32, 0, 0, 128, 0),
    BWD(__half, 1, 8, 32, 0, 1, 128, 0),
    BWD(__half, 1, 8, 32, 1, 0, 128, 0),
    BWD(__half, 1, 8, 32, 1, 1, 128, 0),
    BWD(__half, 1, 16, 32, 0, 0, 128, 0),
    BWD(__half, 1, 16, 32, 0, 1, 128, 0),
    BWD(__half, 1, 16, 32, 1, 0, 128, 0),
    BWD(__half, 1, 16, 32, 1, 1, 128, 0),
    BWD(__half, 1, 32, 32, 0, 0, 128, 0),
    BWD(__half, 1, 32, 32, 0, 1, 128, 0),
    BWD(__half, 1, 32, 32, 1, 0, 128, 0),
    BWD(__half, 1, 32, 32, 1, 1, 128, 0),
    BWD(__half, 8, 16, 0, 0, 0, 128, 0),
    BWD(__half, 8, 16, 0, 0, 0, 128, 1),
    BWD(__half, 8, 16, 0, 0, 1, 128, 0),
    BWD(__half, 8, 16, 0, 0, 1, 128, 1),
    BWD(__half, 8, 16, 0, 1, 0, 128, 0),
    BWD(__half, 8, 16, 0, 1, 1, 128, 0),
    BWD(__half, 8, 16, 4, 0, 0, 128, 0),
    BWD(__half, 8, 16, 4, 0, 0, 128, 1),
    BWD(__half, 8, 16, 4, 0, 1, 128, 0),
    BWD(__half, 8, 16, 4, 0, 1, 128, 1),
    BWD(__half, 8, 16, 4, 1, 0, 128, 0),
    BWD(__half, 8, 16, 4, 1, 1, 128, 0),
    BWD(__half, 8, 16, 8, 0, 0, 128, 0),
    BWD(__half, 8, 16, 8, 0, 0, 128, 1),
    BWD(__half, 8, 16, 8, 0, 1, 128, 0),
    BWD(__half, 8, 16, 8, 0, 1, 128, 1),
    BWD(__half, 8, 16, 8, 1, 0, 128, 0),
    BWD(__half, 8, 16, 8, 1, 1, 128, 0),
    BWD(__half, 8, 16, 16, 0, 0, 128, 0),
    BWD(__half, 8, 16, 16, 0, 0, 128, 1),
    BWD(__half, 8, 16, 16, 0, 1, 128, 0),
    BWD(__half, 8, 16, 16, 0, 1, 128, 1),
    BWD(__half, 8, 16, 16, 1, 0, 128, 0),
    BWD(__half, 8, 16, 16, 1, 1, 128, 0),
    BWD(__half, 8, 16, 32, 0, 0, 128, 0),
    BWD(__half, 8, 16, 32, 0, 0, 128, 1),
    BWD(__half, 8, 16, 32, 0, 1, 128, 0),
    BWD(__half, 8, 16, 32, 0, 1, 128, 1),
    BWD(__half, 8, 16, 32, 1, 0, 128, 0),
    BWD(__half, 8, 16, 32, 1, 1, 128, 0),
    BWD(__half, 8, 24, 8, 0, 0, 128, 0),
    BWD(__half, 8, 24, 8, 0, 0, 128, 1),
    BWD(__half, 8, 24, 8, 0, 1, 128, 0),
    BWD(__half, 8, 24, 8, 0, 1, 128, 1),
    BWD(__half, 8, 24, 8, 1, 0, 128, 0),
    BWD(__half, 8, 24, 8, 1, 1, 128, 0),
    BWD(__half, 8, 24, 16, 0, 0, 128, 0),
    BWD(__half, 8, 24, 16, 0, 0, 128, 1),
    BWD(__half, 8, 24, 16, 0, 1, 128, 0),
    BWD(__half, 8, 24, 16, 0, 1, 128, 1),
    BWD(__half, 8, 24, 16, 1, 0, 128, 0),
    BWD(__half, 8, 24, 16, 1, 1, 128, 0),
    BWD(__half, 8, 32, 32, 0, 0, 128, 0),
    BWD(__half, 8, 32, 32, 0, 0, 128, 1),
    BWD(__half, 8, 32, 32, 0, 1, 128, 0),
    BWD(__half, 8, 32, 32, 0, 1, 128, 1),
    BWD(__half, 8, 32, 32, 1, 0, 128, 0),
    BWD(__half, 8, 32, 32, 1, 1, 128, 0),
    BWD(__nv_bfloat16, 1, 1, 0, 0, 0, 128, 0),
    BWD(__nv_bfloat16, 1, 1, 0, 0, 1, 128, 0),
    BWD(__nv_bfloat16, 1, 1, 0, 1, 0, 128, 0),
    BWD(__nv_bfloat16, 1, 1, 0, 1, 1, 128, 0),
    BWD(__nv_bfloat16, 1, 2, 32, 0, 0, 128, 0),
    BWD(__nv_bfloat16, 1, 2, 32, 0, 1, 128, 0),
    BWD(__nv_bfloat16, 1, 2, 32, 1, 0, 128, 0),
    BWD(__nv_bfloat16, 1, 2, 32, 1, 1, 128, 0),
    BWD(__nv_bfloat16, 1, 4, 32, 0, 0, 128, 0),
    BWD(__nv_bfloat16, 1, 4, 32, 0, 1, 128, 0),
    BWD(__nv_bfloat16, 1, 4, 32, 1, 0, 128, 0),
    BWD(__nv_bfloat16, 1, 4, 32, 1, 1, 128, 0),
    BWD(__nv_bfloat16, 1, 8, 32, 0, 0, 128, 0),
    BWD(__nv_bfloat16, 1, 8, 32, 0, 1, 128, 0),
    BWD(__nv_bfloat16, 1, 8, 32, 1, 0, 128, 0),
    BWD(__nv_bfloat16, 1, 8, 32, 1, 1, 128, 0),
    BWD(__nv_bfloat16, 1, 16, 32, 0, 0, 128, 0),
    BWD(__nv_bfloat16, 1, 16, 32, 0, 1, 128, 0),
    BWD(__nv_bfloat16, 1, 16, 32, 1, 0, 128, 0),
    BWD(__nv_bfloat16, 1, 16, 32, 1, 1, 128, 0),
    BWD(__nv_bfloat16, 1, 32, 32, 0, 0, 128, 0),
    BWD(__nv_bfloat16, 1, 32, 32, 0, 1, 128, 0),
    BWD(__nv_bfloat16, 1, 32, 32, 1, 0, 128, 0),
    BWD(__nv_bfloat16, 1, 32, 32, 1, 1, 128, 0),
    BWD(__nv_bfloat16, 8, 16, 0, 0, 0, 128, 0),
    BWD(__nv_bfloat16, 8, 16, 0, 0, 0, 128, 1),
    BWD(__nv_bfloat16, 8, 16, 0, 0, 1, 128, 0),
    BWD(__nv_bfloat16, 8, 16, 0, 0, 1, 128, 1),
    BWD(__nv_bfloat16, 8, 16, 0, 1, 0, 128, 0),
    BWD(__nv_bfloat16, 8, 16, 0, 1, 1, 128, 0),
    BWD(__nv_bfloat16, 8, 16, 4, 0, 0, 128, 0),
    BWD(__nv_bfloat16, 8, 16, 4, 0, 0, 128, 1),
    BWD(__nv_bfloat16, 8, 16, 4, 0, 1, 128, 0),
    BWD(__nv_bfloat16, 8, 16, 4, 0, 1, 128, 1),
    BWD(__nv_bfloat16, 8, 16, 4, 1, 0, 128, 0),
    BWD(__nv_bfloat16, 8, 16, 4, 1, 1, 128, 0),
    BWD(__nv_bfloat16, 8, 16, 8, 0, 0, 128, 0),
    BWD(__nv_bfloat16, 8, 16, 8, 0, 0, 128, 1),
    BWD(__nv_bfloat16, 8, 16, 8, 0, 1, 128, 0),
    BWD(__nv_bfloat16, 8, 16, 8, 0, 1, 128, 1),
    BWD(__nv_bfloat16, 8, 16, 8, 1, 0, 128, 0),
    BWD(__nv_bfloat16, 8, 16, 8, 1, 1, 128, 0),
    BWD(__nv_bfloat16, 8, 16, 16, 0, 0, 128, 0),
    BWD(__nv_bfloat16, 8, 16, 16, 0, 0, 128, 1),
    BWD(__nv_bfloat16, 8, 16, 16, 0, 1, 128, 0),
    BWD(__nv_bfloat16, 8, 16, 16, 0, 1, 128, 1),
    BWD(__nv_bfloat16, 8, 16, 16, 1, 0, 128, 0),
    BWD(__nv_bfloat16, 8, 16, 16, 1, 1, 128, 0),
    BWD(__nv_bfloat16, 8, 16, 32, 0, 0, 128, 0),
    BWD(__nv_bfloat16, 8, 16, 32, 0, 0, 128, 1),
    BWD(__nv_bfloat16, 8, 16, 32, 0, 1, 128, 0),
    BWD(__nv_bfloat16, 8, 16, 32, 0, 1, 128, 1),
    BWD(__nv_bfloat16, 8, 16, 32, 1, 0, 128, 0),
    BWD(__nv_bfloat16, 8, 16, 32, 1, 1, 128, 0),
    BWD(__nv_bfloat16, 8, 24, 8, 0, 0, 128, 0),
    BWD(__nv_bfloat16, 8, 24, 8, 0, 0, 128, 1),
    BWD(__nv_bfloat16, 8, 24, 8, 0, 1, 128, 0),
    BWD(__nv_bfloat16, 8, 24, 8, 0, 1, 128, 1),
    BWD(__nv_bfloat16, 8, 24, 8, 1, 0, 128, 0),
    BWD(__nv_bfloat16, 8, 24, 8, 1, 1, 128, 0),
    BWD(__nv_bfloat16, 8, 24, 16, 0, 0, 128, 0),
    BWD(__nv_bfloat16, 8, 24, 16, 0, 0, 128, 1),
    BWD(__nv_bfloat16, 8, 24, 16, 0, 1, 128, 0),
    BWD(__nv_bfloat16, 8, 24, 16, 0, 1, 128, 1),
    BWD(__nv_bfloat16, 8, 24, 16, 1, 0, 128, 0),
    BWD(__nv_bfloat16, 8, 24, 16, 1, 1, 128, 0),
    BWD(__nv_bfloat16, 8, 32, 32, 0, 0, 128, 0),
    BWD(__nv_bfloat16, 8, 32, 32, 0, 0, 128, 1),
    BWD(__nv_bfloat16, 8, 32, 32, 0, 1, 128, 0),
    BWD(__nv_bfloat16, 8, 32, 32, 0, 1, 128, 1),
    BWD(__nv_bfloat16, 8, 32, 32, 1, 0, 128, 0),
    BWD(__nv_bfloat16, 8, 32, 32, 1, 1, 128, 0),
    BWD(float, 1, 1, 0, 0, 0, 128, 0),
    BWD(float, 1, 1, 0, 0, 1, 128, 0),
    BWD(float, 1, 1, 0, 1, 0, 128, 0),
    BWD(float, 1, 1, 0, 1, 1, 128, 0),
    BWD(float, 1, 2, 32, 0, 0, 128, 0),
    BWD(float, 1, 2, 32, 0, 1, 128, 0),
    BWD(float, 1, 2, 32, 1, 0, 128, 0),
    BWD(float, 1, 2, 32, 1, 1, 128, 0),
    BWD(float, 1, 4, 32, 0, 0, 128, 0),
    BWD(float, 1, 4, 32, 0, 1, 128, 0),
    BWD(float, 1, 4, 32, 1, 0, 128, 0),
    BWD(float, 1, 4, 32, 1, 1, 128, 0),
    BWD(float, 1, 8, 32, 0, 0, 128, 0),
    BWD(float, 1, 8, 32, 0, 1, 128, 0),
    BWD(float, 1, 8, 32, 1, 0, 128, 0),
    BWD(float, 1, 8, 32, 1, 1, 128, 0),
    BWD(float, 1, 16, 32, 0, 0, 128, 0),
    BWD(float, 1, 16, 32, 0, 1, 128, 0),
    BWD(float, 1, 16, 32, 1, 0, 128, 0),
    BWD(float, 1, 16, 32, 1, 1, 128, 0),
    BWD(float, 1, 32, 32, 0, 0, 128, 0),
    BWD(float, 1, 32, 32, 0, 1, 128, 0),
    BWD(float, 1, 32, 32, 1, 0, 128, 0),
    BWD(float, 1, 32, 32, 1, 1, 128, 0),
    BWD(float, 4, 8, 0, 0, 0, 128, 0),
    BWD(float, 4, 8, 0, 0, 0, 128, 1),
    BWD(float, 4, 8, 0, 0, 1, 128, 0),
    BWD(float, 4, 8, 0, 0, 1, 128, 1),
    BWD(float, 4, 8, 0, 1, 0, 128, 0),
    BWD(float, 4, 8, 0, 1, 1, 128, 0),
    BWD(float, 4, 8, 4, 0, 0, 128, 0),
    BWD(float, 4, 8, 4, 0, 0, 128, 1),
    BWD(float, 4, 8, 4, 0, 1, 128, 0),
    BWD(float, 4, 8, 4, 0, 1, 128, 1),
    BWD(float, 4, 8, 4, 1, 0, 128, 0),
    BWD(float, 4, 8, 4, 1, 1, 128, 0),
    BWD(float, 4, 8, 8, 0, 0, 128, 0),
    BWD(float, 4, 8, 8, 0, 0, 128, 1),
    BWD(float, 4, 8, 8, 0, 1, 128, 0),
    BWD(float, 4, 8, 8, 0, 1, 128, 1),
    BWD(float, 4, 8, 8, 1, 0, 128, 0),
    BWD(float, 4, 8, 8, 1, 1, 128, 0),
    BWD(float, 4, 8, 16, 0, 0, 128, 0),
    BWD(float, 4, 8, 16, 0, 1, 128, 0),
    BWD(float, 4, 8, 16, 1, 0, 128, 0),
    BWD(float, 4, 8, 16, 1, 1, 128, 0),
    BWD(float, 4, 8, 32, 0, 0, 128, 0),
    BWD(float, 4, 8, 32, 0, 1, 128, 0),
    BWD(float, 4, 8, 32, 1, 0, 128, 0),
    BWD(float, 4, 8, 32, 1, 1, 128, 0),
    BWD(float, 4, 12, 8, 0, 0, 128, 0),
    BWD(float, 4, 12, 8, 0, 0, 128, 1),
    BWD(float, 4, 12, 8, 0, 1, 128, 0),
    BWD(float, 4, 12, 8, 0, 1, 128, 1),
    BWD(float, 4, 12, 8, 1, 0, 128, 0),
    BWD(float, 4, 12, 8, 1, 1, 128, 0),
    BWD(float, 4, 12, 16, 0, 0, 128, 0),
    BWD(float, 4, 12, 16, 0, 1, 128, 0),
    BWD(float, 4, 12, 16, 1, 0, 128, 0),
    BWD(float, 4, 12, 16, 1, 1, 128, 0),
    BWD(float, 4, 16, 32, 0, 0, 128, 0),
    BWD(float, 4, 16, 32, 0, 1, 128, 0),
    BWD(float, 4, 16, 32, 1, 0, 128, 0),
    BWD(float, 4, 16, 32, 1, 1, 128, 0),
    BWD(float, 4, 32, 32, 0, 0, 128, 0),
    BWD(float, 4, 32, 32, 0, 1, 128, 0),
    BWD(float, 4, 32, 32, 1, 0, 128, 0),
    BWD(float, 4, 32, 32, 1, 1, 128, 0),
};
#undef BWD
}  // namespace

const void *rows_warp_bwd_kernel(const Plan &p) {
    return find_instance(kInstances, instance_key(p.dtype, p.vec, p.elems, p.lanes, p.masked, p.log, p.ragged, p.block_x));
}

fk_status launch_rows_warp(const Plan &p, const BwdArgs &a) {
    const void *kernel = rows_warp_bwd_kernel(p);
    if (!kernel) return no_instance(p, a.op);
    FK_DISPATCH_CUDA_DTYPE(p.dtype, a.op, return launch<T>(p, a, kernel));
    return FK_OK;
}

}  // namespace fk::softmax
