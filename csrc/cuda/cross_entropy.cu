// Cross-entropy forward and backward on the GPU, fused over the log-softmax (fastkern.h: formulas).
//
// Table (one strategy, two group widths; first matching row wins):
//   classes <= kWarpMaxClasses   a warp a row, 8 rows a CTA      short rows fill the CTA
//   otherwise                    a 256-thread CTA a row          GPT-2's 50257: ~25 packs a thread
// Napkin math: bf16 (16384, 50257), the GPT-2 LM head at 16 x 1024 tokens: the forward reads 1.65 GB
// once (0.39 ms at the H200's 4.25 TB/s copy rate, 0.55 ms on an H100), the backward reads and
// writes it once (0.78 / 1.1 ms): 1.17 ms fwd+bwd on an H200 against ~10 GB of traffic (~2.4 ms) for
// torch's eager log_softmax + nll_loss and their backwards, and no fp32 (N, C) temporaries at all.
// ~8 elements of 16-bit data a thread per 16-byte pack leave ~30 instructions an element in the budget.
// Algorithm:
//   forward: each thread walks its packs of the row (16-byte loads, kUnroll in flight; the row's
//     unaligned head and its tail element by element), keeping an online (max, sum of exp relative to
//     it) pair — one read of the row — and, with label smoothing, the plain sum; the pairs merge over
//     the group (shuffles, then shared memory in a fixed order); lane 0 writes lse and the row's loss
//     (reduction none: into the loss tensor; else into the fp32 workspace); the saved statistic is
//     the pair (max, log sum), not their sum (fastkern.h says why).
//   reduce (one CTA): sums the workspace in fp64 in a fixed order and counts the rows not ignored:
//     the mean is the same bits on every run (no atomics).
//   backward: one read and one write of the row: dx = g * (exp((x - max) - log sum) - eps / C),
//     minus g * (1 - eps) at the target; the pack read is the pack written, so dx may be x (the eager in-place backward).
//     Rows have their own strides (a padded dlogits keeps the LM head's GEMMs aligned); the walk
//     follows dx's 16-byte frame, and where x is out of that phase its packs load element by element.
// exp: fp32 data uses accurate expf (its errors meet torch's fp32 ones); 16-bit data one MUFU.EX2
// (exp_ftz), which is far inside the rounding of the 16-bit output.
// Targets out of range give the row a NaN loss and gradient (no host sync to report them).
#include "common.cuh"

namespace {

constexpr int kThreads = 256;          // threads a CTA, either group width
constexpr int kUnroll = 4;             // packs a thread has in flight (64 bytes)
constexpr int64_t kWarpMaxClasses = 4096;  // rows up to 8 KB of bf16 a warp each: a first guess, not yet A/B'd

template <typename T> __device__ __forceinline__ float exp_of(float t) {
    if constexpr (std::is_same_v<T, float>) return expf(t);
    else return fk::exp_ftz(t);
}

// exp is taken relative to the max, or to 0 while the max is -inf, so -inf - -inf never makes NaN.
__device__ __forceinline__ float exp_ref(float m) { return m == -INFINITY ? 0.f : m; }

// The loss (or its gradient) of row `i`, stored as T or, under autocast, as fp32.
template <typename T> __device__ __forceinline__ void store_loss(void *loss, int64_t i, float v, bool fp32) {
    if (fp32) static_cast<float *>(loss)[i] = v;
    else static_cast<T *>(loss)[i] = fk::from_f32<T>(v);
}
template <typename T> __device__ __forceinline__ float load_loss(const void *grad, int64_t i, bool fp32) {
    return fp32 ? static_cast<const float *>(grad)[i] : fk::to_f32(static_cast<const T *>(grad)[i]);
}

// A thread's running statistics of its elements of a row.
struct RowStats {
    float m = -INFINITY, s = 0.f, sx = 0.f;

    template <typename T> __device__ __forceinline__ void add(const float *v, int count, bool smooth) {
        float pm = m;
        for (int k = 0; k < count; k++) pm = fmaxf(pm, v[k]);  // NaN is skipped; its exp poisons s
        if (pm > m) {
            s *= exp_of<T>(m - pm);
            m = pm;
        }
        const float r = exp_ref(m);
        for (int k = 0; k < count; k++) {
            s += exp_of<T>(v[k] - r);
            if (smooth) sx += v[k];
        }
    }
};

// The group's statistics merged in a fixed order (warp shuffles, then shared memory across warps
// for a CTA-wide group); every thread of the group gets the result.
template <typename T, int kGroup> __device__ __forceinline__ RowStats merge(RowStats a) {
    float m = fk::warp_max(a.m);
    if constexpr (kGroup > 32) {
        __shared__ float red_m[kGroup / 32];
        if (threadIdx.x % 32 == 0) red_m[threadIdx.x / 32] = m;
        __syncthreads();
        m = red_m[0];
        for (int w = 1; w < kGroup / 32; w++) m = fmaxf(m, red_m[w]);
    }
    float s = a.s == 0.f ? 0.f : a.s * exp_of<T>(a.m - exp_ref(m));
    float sx = a.sx;
    s = fk::warp_sum(s);
    sx = fk::warp_sum(sx);
    if constexpr (kGroup > 32) {
        __shared__ float red_s[kGroup / 32], red_x[kGroup / 32];
        if (threadIdx.x % 32 == 0) red_s[threadIdx.x / 32] = s, red_x[threadIdx.x / 32] = sx;
        __syncthreads();
        s = 0.f, sx = 0.f;
        for (int w = 0; w < kGroup / 32; w++) s += red_s[w], sx += red_x[w];
    }
    return RowStats{m, s, sx};
}

// Where a row's 16-byte packs start: `head` leading elements (to the first 16-byte boundary of p),
// then `packs` packs, then the tail up to n.
template <typename T> struct RowFrame {
    int64_t head, packs, tail_start;
    __device__ __forceinline__ RowFrame(const T *p, int64_t n, bool vector_ok) {
        constexpr int N = fk::Pack<T>::N;
        head = vector_ok ? ((16 - (int64_t)(reinterpret_cast<uintptr_t>(p) & 15)) & 15) / (int64_t)sizeof(T) : n;
        if (head > n) head = n;
        packs = (n - head) / N;
        tail_start = head + packs * N;
    }
};

// A pack's N elements from p, one by one (p not 16-byte aligned).
template <typename T> __device__ __forceinline__ fk::Pack<T> load_elements(const T *p) {
    fk::Pack<T> r;
#pragma unroll
    for (int k = 0; k < fk::Pack<T>::N; k++) r.v[k] = p[k];
    return r;
}

// Calls f(col, values, count) over the lane's elements of a row of n: single elements of the head
// and tail, packs (kUnroll loads issued before the first is used) in between. The frame may be
// another row's (the backward's dx): kVector false loads each pack element by element.
template <typename T, int kGroup, bool kVector = true, typename F>
__device__ __forceinline__ void for_each_pack(const T *xr, int64_t n, int lane, const RowFrame<T> &fr, F &&f) {
    constexpr int N = fk::Pack<T>::N;
    for (int64_t i = lane; i < fr.head; i += kGroup) {
        float v = fk::to_f32(xr[i]);
        f(i, &v, 1);
    }
    const T *xa = xr + fr.head;
    for (int64_t p0 = lane; p0 < fr.packs; p0 += (int64_t)kGroup * kUnroll) {
        fk::Pack<T> raw[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; u++)
            if (p0 + u * kGroup < fr.packs) {
                const T *at = xa + (p0 + u * kGroup) * N;
                raw[u] = kVector ? fk::load_pack(at) : load_elements(at);
            }
#pragma unroll
        for (int u = 0; u < kUnroll; u++) {
            const int64_t p = p0 + u * kGroup;
            if (p < fr.packs) {
                float v[N];
#pragma unroll
                for (int k = 0; k < N; k++) v[k] = fk::pack_f32(raw[u], k);
                f(fr.head + p * N, v, N);
            }
        }
    }
    for (int64_t i = fr.tail_start + lane; i < n; i += kGroup) {
        float v = fk::to_f32(xr[i]);
        f(i, &v, 1);
    }
}

template <typename T, int kGroup>
__global__ void __launch_bounds__(kThreads)
cross_entropy_fwd_rows(const T *__restrict__ x, const int64_t *__restrict__ target, void *__restrict__ loss,
                       float *__restrict__ lse, float *__restrict__ row_loss, int64_t rows, int64_t classes,
                       int64_t x_ld, int64_t ignore_index, float eps, bool loss_fp32) {
    fk::grid_dependency_sync();
    const int lane = threadIdx.x % kGroup;
    const int64_t row = (int64_t)blockIdx.x * (kThreads / kGroup) + threadIdx.x / kGroup;
    if (row >= rows) return;  // whole groups: a CTA-wide group's row always exists
    const int64_t t = target[row];
    auto write = [&](float l, float row_m, float log_s) {
        if (lane != 0) return;
        lse[2 * row] = row_m, lse[2 * row + 1] = log_s;
        if (row_loss) row_loss[row] = l;
        else store_loss<T>(loss, row, l, loss_fp32);
    };
    if (t == ignore_index) return write(0.f, 0.f, 0.f);
    const T *xr = x + row * x_ld;
    const bool smooth = eps != 0.f;
    RowStats st;
    for_each_pack<T, kGroup>(xr, classes, lane, RowFrame<T>(xr, classes, true),
                             [&](int64_t, const float *v, int count) { st.template add<T>(v, count, smooth); });
    st = merge<T, kGroup>(st);
    const float log_s = logf(st.s), row_lse = st.m + log_s;
    const float xt = t >= 0 && t < classes ? fk::to_f32(xr[t]) : NAN;
    float l = row_lse - (1.f - eps) * xt;
    if (smooth) l -= eps / (float)classes * st.sx;
    write(l, st.m, log_s);
}

// One CTA: the reduction of the per-row losses (fp64, fixed order) and the count of rows not ignored.
template <typename T>
__global__ void __launch_bounds__(1024)
cross_entropy_fwd_reduce(const float *__restrict__ row_loss, const int64_t *__restrict__ target, void *__restrict__ loss,
                         float *__restrict__ valid, int64_t rows, int64_t ignore_index, int reduction, bool loss_fp32) {
    fk::grid_dependency_sync();
    double total = 0.0;
    double count = 0.0;
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
        if (row_loss) total += row_loss[r];
        count += target[r] != ignore_index;
    }
    __shared__ double red_total[32], red_count[32];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        total += __shfl_xor_sync(0xffffffffu, total, offset);
        count += __shfl_xor_sync(0xffffffffu, count, offset);
    }
    if (threadIdx.x % 32 == 0) red_total[threadIdx.x / 32] = total, red_count[threadIdx.x / 32] = count;
    __syncthreads();
    if (threadIdx.x != 0) return;
    total = 0.0, count = 0.0;
    for (int w = 0; w < (int)(blockDim.x / 32); w++) total += red_total[w], count += red_count[w];
    *valid = (float)count;
    if (reduction == FK_REDUCE_MEAN) store_loss<T>(loss, 0, (float)(total / count), loss_fp32);
    else if (reduction == FK_REDUCE_SUM) store_loss<T>(loss, 0, (float)total, loss_fp32);
}

template <typename T, int kGroup>
__global__ void __launch_bounds__(kThreads)
cross_entropy_bwd_rows(const void *__restrict__ grad, const T *x, const int64_t *__restrict__ target,
                       const float *__restrict__ lse, const float *__restrict__ valid, T *dx, int64_t rows,
                       int64_t classes, int64_t x_ld, int64_t dx_ld, int64_t ignore_index, float eps, int reduction,
                       bool loss_fp32) {
    // x and dx may be one buffer (no __restrict__ on them): each pack is read, then written, by one thread
    fk::grid_dependency_sync();
    constexpr int N = fk::Pack<T>::N;
    const int lane = threadIdx.x % kGroup;
    const int64_t row = (int64_t)blockIdx.x * (kThreads / kGroup) + threadIdx.x / kGroup;
    if (row >= rows) return;
    const int64_t t = target[row];
    const T *xr = x + row * x_ld;
    T *dr = dx + row * dx_ld;
    const bool same_phase = ((reinterpret_cast<uintptr_t>(xr) ^ reinterpret_cast<uintptr_t>(dr)) & 15) == 0;
    const RowFrame<T> fr(dr, classes, true);  // the stores' frame; x's loads follow it (packs where in phase)
    if (t == ignore_index) {
        fk::Pack<T> zero;
#pragma unroll
        for (int k = 0; k < N; k++) zero.v[k] = fk::from_f32<T>(0.f);
        for (int64_t i = lane; i < fr.head; i += kGroup) dr[i] = zero.v[0];
        for (int64_t p = lane; p < fr.packs; p += kGroup) fk::store_pack(dr + fr.head + p * N, zero);
        for (int64_t i = fr.tail_start + lane; i < classes; i += kGroup) dr[i] = zero.v[0];
        return;
    }
    float g = load_loss<T>(grad, reduction == FK_REDUCE_NONE ? row : 0, loss_fp32);
    if (reduction == FK_REDUCE_MEAN) g /= *valid;
    if (t < 0 || t >= classes) g = NAN;
    const float m = lse[2 * row], log_s = lse[2 * row + 1], off = eps / (float)classes, hit = 1.f - eps;
    auto write = [&](int64_t col, const float *v, int count) {
        if (count == 1) {
            dr[col] = fk::from_f32<T>(g * (exp_of<T>((v[0] - m) - log_s) - off - (col == t ? hit : 0.f)));
            return;
        }
        fk::Pack<T> out;
#pragma unroll
        for (int k = 0; k < N; k++)
            out.v[k] = fk::from_f32<T>(g * (exp_of<T>((v[k] - m) - log_s) - off - (col + k == t ? hit : 0.f)));
        fk::store_pack(dr + col, out);
    };
    if (same_phase) for_each_pack<T, kGroup, true>(xr, classes, lane, fr, write);
    else for_each_pack<T, kGroup, false>(xr, classes, lane, fr, write);
}

template <typename T> fk_status launch_fwd(const T *x, const int64_t *target, void *loss, float *lse, float *valid,
                                           float *workspace, int64_t rows, int64_t classes, int64_t x_ld,
                                           int64_t ignore_index, float eps, int reduction, bool loss_fp32, int device,
                                           cudaStream_t stream) {
    const char *op = "cross_entropy";
    float *row_loss = reduction == FK_REDUCE_NONE ? nullptr : workspace;
    if (rows > 0) {
        const bool warp = classes <= kWarpMaxClasses;
        const int64_t per_cta = warp ? kThreads / 32 : 1;
        const dim3 grid((unsigned)((rows + per_cta - 1) / per_cta));
        fk_status status = warp
            ? fk::Launch(grid, dim3(kThreads), 0, stream, device)(op, cross_entropy_fwd_rows<T, 32>, x, target, loss,
                                                                   lse, row_loss, rows, classes, x_ld, ignore_index,
                                                                   eps, loss_fp32)
            : fk::Launch(grid, dim3(kThreads), 0, stream, device)(op, cross_entropy_fwd_rows<T, kThreads>, x, target,
                                                                   loss, lse, row_loss, rows, classes, x_ld,
                                                                   ignore_index, eps, loss_fp32);
        if (status != FK_OK) return status;
    }
    return fk::Launch(dim3(1), dim3(1024), 0, stream, device)(op, cross_entropy_fwd_reduce<T>, (const float *)row_loss,
                                                              target, loss, valid, rows, ignore_index, reduction,
                                                              loss_fp32);
}

template <typename T> fk_status launch_bwd(const void *grad, const T *x, const int64_t *target, const float *lse,
                                           const float *valid, T *dx, int64_t rows, int64_t classes, int64_t x_ld,
                                           int64_t dx_ld, int64_t ignore_index, float eps, int reduction,
                                           bool loss_fp32, int device, cudaStream_t stream) {
    if (rows == 0 || classes == 0) return FK_OK;
    const char *op = "cross_entropy_backward";
    const bool warp = classes <= kWarpMaxClasses;
    const int64_t per_cta = warp ? kThreads / 32 : 1;
    const dim3 grid((unsigned)((rows + per_cta - 1) / per_cta));
    return warp ? fk::Launch(grid, dim3(kThreads), 0, stream, device)(op, cross_entropy_bwd_rows<T, 32>, grad, x,
                                                                      target, lse, valid, dx, rows, classes, x_ld,
                                                                      dx_ld, ignore_index, eps, reduction, loss_fp32)
                : fk::Launch(grid, dim3(kThreads), 0, stream, device)(op, cross_entropy_bwd_rows<T, kThreads>, grad,
                                                                      x, target, lse, valid, dx, rows, classes, x_ld,
                                                                      dx_ld, ignore_index, eps, reduction, loss_fp32);
}

fk_status check(const char *op, int64_t rows, int64_t classes, int64_t x_ld, int64_t dx_ld, double eps,
                int reduction, fk_dtype dtype, fk_dtype loss_dtype) {
    if (loss_dtype != dtype && loss_dtype != FK_FLOAT32)
        return fk_fail(FK_ERR_TYPE, "%s: the loss dtype code %d must be the logits' (%d) or float32", op,
                       (int)loss_dtype, (int)dtype);
    if (rows < 0 || classes < 0) return fk_fail(FK_ERR_VALUE, "%s: negative size", op);
    if (x_ld < classes || dx_ld < classes)
        return fk_fail(FK_ERR_VALUE, "%s: row strides %lld / %lld < %lld classes", op, (long long)x_ld,
                       (long long)dx_ld, (long long)classes);
    if (rows > (int64_t)0x7fffffff) return fk_fail(FK_ERR_VALUE, "%s: more than 2^31 - 1 rows", op);
    if (reduction != FK_REDUCE_NONE && reduction != FK_REDUCE_MEAN && reduction != FK_REDUCE_SUM)
        return fk_fail(FK_ERR_VALUE, "%s: unknown reduction code %d", op, reduction);
    if (!(eps >= 0.0 && eps <= 1.0)) return fk_fail(FK_ERR_VALUE, "%s: label_smoothing must be in [0, 1]", op);
    return FK_OK;
}

}  // namespace

extern "C" fk_status fk_cuda_cross_entropy_fwd(const void *x, const int64_t *target, void *loss, float *lse,
                                               float *valid, float *workspace, int64_t rows, int64_t classes,
                                               int64_t x_ld, int64_t ignore_index, double label_smoothing,
                                               int reduction, fk_dtype dtype, fk_dtype loss_dtype, int device,
                                               void *stream) {
    fk_status status = check("cross_entropy", rows, classes, x_ld, x_ld, label_smoothing, reduction, dtype, loss_dtype);
    if (status != FK_OK) return status;
    if (reduction != FK_REDUCE_NONE && rows > 0 && workspace == nullptr)
        return fk_fail(FK_ERR_VALUE, "cross_entropy: a reduction needs the per-row workspace");
    FK_CUDA_ENTER("cross_entropy", device);
    FK_DISPATCH_CUDA_DTYPE(dtype, "cross_entropy",
        return launch_fwd<T>((const T *)x, target, loss, lse, valid, workspace, rows, classes, x_ld, ignore_index,
                             (float)label_smoothing, reduction, loss_dtype != dtype, device, (cudaStream_t)stream));
}

extern "C" fk_status fk_cuda_cross_entropy_bwd(const void *grad, const void *x, const int64_t *target,
                                               const float *lse, const float *valid, void *dx, int64_t rows,
                                               int64_t classes, int64_t x_ld, int64_t dx_ld, int64_t ignore_index,
                                               double label_smoothing, int reduction, fk_dtype dtype,
                                               fk_dtype loss_dtype, int device, void *stream) {
    fk_status status = check("cross_entropy_backward", rows, classes, x_ld, dx_ld, label_smoothing, reduction, dtype,
                             loss_dtype);
    if (status != FK_OK) return status;
    FK_CUDA_ENTER("cross_entropy_backward", device);
    FK_DISPATCH_CUDA_DTYPE(dtype, "cross_entropy_backward",
        return launch_bwd<T>(grad, (const T *)x, target, lse, valid, (T *)dx, rows, classes, x_ld, dx_ld, ignore_index,
                             (float)label_smoothing, reduction, loss_dtype != dtype, device, (cudaStream_t)stream));
}
