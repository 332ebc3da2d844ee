/* fastkern: the narrow waist between the CPython module and the kernels.
 *
 * Everything below this header works on raw pointers, element counts and a dtype code; it knows
 * nothing of torch or Python. Each op has one CPU entry point (csrc/cpu/<op>.c) and one CUDA entry
 * point (csrc/cuda/<op>.cu). Entry points never abort, print or allocate: they return a status and,
 * on failure, leave a message for fk_error_message(). CUDA entry points launch on the given stream
 * (a cudaStream_t passed as void *) on the given device and never synchronise with the host. CPU
 * entry points run on up to `threads` threads, the caller's among them (csrc/cpu/parallel.c).
 *
 * Conventions shared by every op:
 *   - tensors are dense and row-major; sizes and indices are int64_t (tensors over 2^31 elements);
 *   - fp16 / bf16 / fp32 are computed in fp32; fp64 (CPU only) is computed in fp64;
 *   - per-row statistics (softmax log-sum-exp, partial bias sums) are fp32, or fp64 for fp64 input.
 */
#ifndef FASTKERN_H
#define FASTKERN_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FK_VERSION "0.1.0"

typedef enum {
    FK_FLOAT32 = 0,
    FK_FLOAT16 = 1,
    FK_BFLOAT16 = 2,
    FK_FLOAT64 = 3,
} fk_dtype;

/* Each non-OK status maps to one Python exception type in module.c. */
typedef enum {
    FK_OK = 0,
    FK_ERR_VALUE = 1,   /* ValueError: a size, shape or option out of range  */
    FK_ERR_TYPE = 2,    /* TypeError: a dtype the op does not support here   */
    FK_ERR_RUNTIME = 3, /* RuntimeError: CUDA failures, missing CUDA support */
} fk_status;

/* Records a message for the calling thread and returns `status`. */
fk_status fk_fail(fk_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
/* The message of the last failure on this thread. */
const char *fk_error_message(void);

/* Bytes of one element of `dtype`, or 0 for an unknown code. */
int fk_dtype_size(fk_dtype dtype);

/* ---- GELU ------------------------------------------------------------------------------------
 * x, y, dy, dx: `rows * cols` elements of `dtype`, row-major. bias: `cols` elements of `dtype`, or
 * NULL. approximate: 0 = erf ("none"), 1 = tanh.
 * forward:  y = gelu(x + bias)
 * backward: dx = dy * gelu'(x + bias); when dbias is not NULL it receives sum over rows of dx
 *           (`cols` elements of `dtype`); when y is not NULL (`rows * cols` elements of `dtype`)
 *           it receives gelu(x + bias) in the same pass, the values the forward gives bit for bit
 *           (FusedMLP's backward: dW2 needs gelu(h) and dh needs gelu'(h), one read of h, D-131).
 * The CUDA backward reduces dbias deterministically through `workspace`, fp32, of
 * fk_cuda_gelu_bwd_workspace(...) elements, asked with the same pointers (y included) and sizes as
 * the call. */
fk_status fk_cpu_gelu_fwd(const void *x, const void *bias, void *y, int64_t rows, int64_t cols,
                          int approximate, fk_dtype dtype, int threads);
fk_status fk_cpu_gelu_bwd(const void *dy, const void *x, const void *bias, void *dx, void *dbias,
                          void *y, int64_t rows, int64_t cols, int approximate, fk_dtype dtype, int threads);
fk_status fk_cuda_gelu_fwd(const void *x, const void *bias, void *y, int64_t rows, int64_t cols,
                           int approximate, fk_dtype dtype, int device, void *stream);
int64_t fk_cuda_gelu_bwd_workspace(const void *dy, const void *x, const void *bias, const void *dx,
                                   const void *y, int64_t rows, int64_t cols, int approximate, fk_dtype dtype,
                                   int device);
fk_status fk_cuda_gelu_bwd(const void *dy, const void *x, const void *bias, void *dx, void *dbias,
                           void *y, float *workspace, int64_t rows, int64_t cols, int approximate,
                           fk_dtype dtype, int device, void *stream);

/* ---- Softmax / log-softmax --------------------------------------------------------------------
 * x, y, dy, dx: `outer * n * inner` elements of `dtype`, row-major, reduced along the middle axis
 * (length n, stride inner): one "row" is x[o, :, i]. The op is softmax(x * scale) (log: log_softmax).
 * causal_sq > 0 (only with inner == 1): rows are the query rows of (causal_sq, n) score blocks; row
 * r is query q = r % causal_sq and key j is masked (-inf) when j > q + (n - causal_sq).
 * row_max: `outer * inner` per-row maxima of the scaled, masked rows; fp64 when dtype is FK_FLOAT64,
 * fp32 otherwise. forward writes y and row_max (NULL: not wanted). Backward writes
 *   softmax:     dx = scale * y * (dy - sum_j dy_j * y_j)
 *   log_softmax: dx = scale * (dy - exp(y) * sum_j dy_j)
 * with dx = 0 at masked positions (where y is 0, log: -inf). The two backends read different saved
 * tensors: the CUDA backward reads x and row_max (never y) and recomputes
 * y = exp(x * scale - row_max) / sum(exp(x * scale - row_max)), free in a memory-bound kernel (the
 * max, not the log-sum-exp, is saved: its exponents are exact near the max, so the recomputed y is
 * as accurate as the forward's); the CPU backward reads the forward's output y and takes no exp for
 * softmax (one for log), normalising by sum_j y_j (log: sum_j exp(y_j)) so that only y's rounding
 * relative to its row is left. Rows that are all -inf, fully masked, or hold +inf / NaN produce
 * NaN, as torch.softmax does.
 * The CPU calls keep a 16-bit row's exps for their second pass (forward softmax, backward log): on
 * the stack up to 16384 keys, else in one malloc'ed row buffer per thread (freed before returning;
 * without it they recompute). */
fk_status fk_cpu_softmax_fwd(const void *x, void *y, void *row_max, int64_t outer, int64_t n,
                             int64_t inner, double scale, int64_t causal_sq, int log,
                             fk_dtype dtype, int threads);
fk_status fk_cpu_softmax_bwd_from_output(const void *dy, const void *y, void *dx, int64_t outer,
                                         int64_t n, int64_t inner, double scale, int64_t causal_sq,
                                         int log, fk_dtype dtype, int threads);
fk_status fk_cuda_softmax_fwd(const void *x, void *y, float *row_max, int64_t outer, int64_t n,
                              int64_t inner, double scale, int64_t causal_sq, int log,
                              fk_dtype dtype, int device, void *stream);
fk_status fk_cuda_softmax_bwd(const void *dy, const void *x, const float *row_max, void *dx,
                              int64_t outer, int64_t n, int64_t inner, double scale,
                              int64_t causal_sq, int log, fk_dtype dtype, int device,
                              void *stream);
/* The strategy fk_cuda_softmax_fwd (backward = 0) or _bwd (1) would run for these sizes on `device`,
 * with every tensor 16-byte aligned or not (`aligned`), as a static name ("rows_warp", "rows_smem_cta",
 * ... or "empty" where nothing is launched; csrc/cuda/softmax/dispatch.cu lists them), or NULL on bad
 * arguments (message in fk_error_message()). `shape` (may be NULL) receives the launch shape as text. */
const char *fk_cuda_softmax_plan(int backward, int64_t outer, int64_t n, int64_t inner, int64_t causal_sq,
                                 int log, fk_dtype dtype, int aligned, int device, char *shape,
                                 int shape_size);

/* ---- Cross-entropy ------------------------------------------------------------------------------
 * F.cross_entropy on (rows, classes) logits with int64 class targets, fused over the log-softmax:
 *   lse_i  = log sum_j exp(x_ij)
 *   loss_i = lse_i - (1 - eps) x_i,t - eps / classes * sum_j x_ij     (eps: label_smoothing)
 *   loss_i = 0 where t_i == ignore_index (whatever the row holds); `valid` counts the other rows.
 * reduction: FK_REDUCE_NONE writes `rows` losses of `loss_dtype` to loss; FK_REDUCE_SUM /
 * FK_REDUCE_MEAN write one element of `loss_dtype`: sum_i loss_i, or that over valid (0 / 0 = NaN,
 * as torch). loss_dtype is `dtype` or FK_FLOAT32 (what torch returns under autocast); the backward's
 * grad has loss_dtype too.
 * lse: `rows` pairs (m_i, log s_i), fp32 (fp64 for fp64): the row's max and the log of its sum of
 * exp(x - m), so lse_i = m_i + log s_i. Two numbers, not their fp32 sum: the backward's
 * exp((x - m) - log s) then rounds as torch's log_softmax does, where exp(x - fl(lse)) carried an
 * error of |lse| ulps into every probability of the row (3x torch's in fp32 gradients).
 * valid: one element of the lse type. The forward writes both; the backward reads them (never the
 * loss). Ignored rows get (0, 0).
 * workspace: with a reduction, `rows` elements of the lse type for the per-row losses, summed
 * afterwards in row order (deterministic: the same bits for any thread count or grid); NULL without.
 * backward: dx_ij = g_i * (exp(x_ij - lse_i) - eps / classes - (1 - eps) [j == t_i]), 0 on ignored
 * rows, where g_i = grad[i] (none: `rows` elements of loss_dtype), grad[0] (sum) or grad[0] / valid (mean).
 * dx may be x itself: each element is read once and then written by the same thread.
 * x_ld / dx_ld: the row strides of x and dx in elements (>= classes; rows need not be contiguous
 * with each other: a padded dlogits, row stride a multiple of 16 bytes, keeps the LM head's
 * backward GEMMs on their aligned kernels).
 * Targets outside [0, classes) other than ignore_index: the CPU refuses them (FK_ERR_VALUE); the GPU
 * cannot report without a host sync, so such a row's loss (and its gradient) is NaN.
 * NaN / inf logits make the row's loss NaN, as in torch (ignored rows stay 0). */
typedef enum { FK_REDUCE_NONE = 0, FK_REDUCE_MEAN = 1, FK_REDUCE_SUM = 2 } fk_reduction;
fk_status fk_cpu_cross_entropy_fwd(const void *x, const int64_t *target, void *loss, void *lse,
                                   void *valid, void *workspace, int64_t rows, int64_t classes,
                                   int64_t x_ld, int64_t ignore_index, double label_smoothing, int reduction,
                                   fk_dtype dtype, fk_dtype loss_dtype, int threads);
fk_status fk_cpu_cross_entropy_bwd(const void *grad, const void *x, const int64_t *target,
                                   const void *lse, const void *valid, void *dx, int64_t rows,
                                   int64_t classes, int64_t x_ld, int64_t dx_ld, int64_t ignore_index,
                                   double label_smoothing, int reduction, fk_dtype dtype,
                                   fk_dtype loss_dtype, int threads);
fk_status fk_cuda_cross_entropy_fwd(const void *x, const int64_t *target, void *loss, float *lse,
                                    float *valid, float *workspace, int64_t rows, int64_t classes,
                                    int64_t x_ld, int64_t ignore_index, double label_smoothing, int reduction,
                                    fk_dtype dtype, fk_dtype loss_dtype, int device, void *stream);
fk_status fk_cuda_cross_entropy_bwd(const void *grad, const void *x, const int64_t *target,
                                    const float *lse, const float *valid, void *dx, int64_t rows,
                                    int64_t classes, int64_t x_ld, int64_t dx_ld, int64_t ignore_index,
                                    double label_smoothing, int reduction, fk_dtype dtype,
                                    fk_dtype loss_dtype, int device, void *stream);

/* ---- Matmul / linear -------------------------------------------------------------------------
 * For b < batch: C[b] = act(A[b] @ B[b] + bias), fp32 accumulation (fp64 for fp64, CPU only).
 *   A[b] is (m, k): element (i, p) at a + b * a_batch + i * a_row + p * a_col, and B[b] is (k, n):
 *   element (p, j) at b + b * b_batch + p * b_row + j * b_col (strides in elements). Each operand is
 *   row-major (col stride 1) or column-major (row stride 1), e.g. w.t(); a batch stride of 0
 *   broadcasts the operand. C[b] is (m, n) row-major: c + b * c_batch + i * c_row + j.
 *   bias: n elements of `dtype`, or NULL. activation: FK_ACT_NONE / FK_ACT_GELU (erf) /
 *   FK_ACT_GELU_TANH. pre: NULL, or laid out as C: receives A @ B + bias before the activation
 *   (what the activation's backward recomputes from).
 *   flags: FK_MM_TF32 lets fp32 inputs use TF32 tensor cores (torch's allow_tf32); FK_MM_FORCE_GENERAL
 *   makes CUDA take the general sm_80 kernel (tests, A/Bs) even on Hopper.
 * All pointers are of `dtype`; c / pre never alias a / b / bias. m, n or k may be 0 (k == 0: C = act(bias)).
 * fk_cpu_matmul is the one CPU entry point that allocates: each thread mallocs its packing buffers
 * (~k x 400 + 37K floats) and frees them before returning (FK_ERR_RUNTIME if malloc fails). */
typedef enum { FK_ACT_NONE = 0, FK_ACT_GELU = 1, FK_ACT_GELU_TANH = 2 } fk_activation;
enum { FK_MM_TF32 = 1, FK_MM_FORCE_GENERAL = 2 };
typedef struct {
    const void *a, *b, *bias;
    void *c, *pre;
    int64_t batch, m, n, k;
    int64_t a_batch, a_row, a_col;
    int64_t b_batch, b_row, b_col;
    int64_t c_batch, c_row;
    fk_dtype dtype;
    int activation;
    int flags;
} fk_matmul_args;
fk_status fk_cpu_matmul(const fk_matmul_args *args, int threads);
fk_status fk_cuda_matmul(const fk_matmul_args *args, int device, void *stream);
/* The strategy fk_cuda_matmul would take for `args` on `device` ("wgmma_sm90", "mma_sm80", ...). */
const char *fk_cuda_matmul_plan(const fk_matmul_args *args, int device);

/* ---- Attention (flash) -----------------------------------------------------------------------
 * Per sequence b and head h: out = softmax(scale * Q Kᵀ + mask) V, never materialising Q Kᵀ.
 * Layout is flash-attn's, generalised by strides (elements; the head dim d is always contiguous):
 *   q[b, i, h, :] at q + b * q_batch + i * q_row + h * q_head        (sq rows, `heads` heads)
 *   k[b, j, g, :] at k + b * k_batch + j * k_row + g * k_head        (sk rows, `kv_heads` heads)
 *   v, out, dout: the same with v_*, o_*, do_* strides (out and dout have q's shape).
 *   torch's (B, H, S, D) is the same data with q_row = D and q_head = S * D: no copy.
 * GQA / MQA: heads % kv_heads == 0; head h reads kv head h / (heads / kv_heads).
 * Varlen: cu_seqlens_q / cu_seqlens_k (int32, batch + 1 entries, on the tensors' device) non-NULL:
 *   sequence b's query rows are rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1 of q (x_batch strides
 *   ignored), likewise keys; sq / sk are then the maximum lengths (bounds for the grid only).
 * Mask, for a sequence with sq_b queries and sk_b keys, query i sees key j iff
 *   j - i - shift in [-window_left, window_right]   (-1: unbounded on that side)
 *   shift = sk_b - sq_b (bottom-right aligned, flash-attn >= 2.1), or 0 with FK_ATTN_TOP_LEFT
 *   (torch SDPA's is_causal). causal is window_right = 0. Tiles wholly outside it are skipped.
 * lse: fp32 (fp64 for fp64 input), dense (batch, heads, sq) — varlen: (heads, total_q) — natural-log
 *   log-sum-exp of the scaled, masked scores. A row that sees no key gets out = 0 and lse = +inf
 *   (so its recomputed probabilities are 0 and its gradients 0).
 * Backward: reads q, k, v, out, dout, lse; writes dq, dk, dv laid out densely like the inputs would be
 *   in flash layout, (batch, s, heads|kv_heads, d) contiguous (varlen: (total, heads|kv_heads, d)),
 *   all of `dtype`. For GQA dk / dv are summed over the heads sharing a kv head.
 * workspace: `workspace_bytes` from fk_{cpu,cuda}_attention_workspace(args, backward[, device]),
 *   allocated by the caller (zero-filled not required); NULL when that is 0.
 * flags: FK_ATTN_DETERMINISTIC (bitwise reproducible backward, no atomics across CTAs),
 *   FK_ATTN_FORCE_GENERAL (CUDA: the sm_80 kernel even on Hopper; tests and A/Bs),
 *   FK_ATTN_TOP_LEFT (the mask's shift is 0, above). */
enum { FK_ATTN_DETERMINISTIC = 1, FK_ATTN_FORCE_GENERAL = 2, FK_ATTN_TOP_LEFT = 4 };
typedef struct {
    const void *q, *k, *v;
    void *out;        /* forward output; backward input */
    void *lse;        /* forward output; backward input */
    const void *dout; /* backward only */
    void *dq, *dk, *dv;
    const int32_t *cu_seqlens_q, *cu_seqlens_k;
    void *workspace;
    int64_t workspace_bytes;
    int64_t batch, sq, sk, heads, kv_heads, d;
    int64_t q_batch, q_row, q_head;
    int64_t k_batch, k_row, k_head;
    int64_t v_batch, v_row, v_head;
    int64_t o_batch, o_row, o_head;
    int64_t do_batch, do_row, do_head;
    double scale;
    int64_t window_left, window_right;
    fk_dtype dtype;
    int flags;
} fk_attention_args;
int64_t fk_cpu_attention_workspace(const fk_attention_args *args, int backward);
fk_status fk_cpu_attention_fwd(const fk_attention_args *args, int threads);
fk_status fk_cpu_attention_bwd(const fk_attention_args *args, int threads);
int64_t fk_cuda_attention_workspace(const fk_attention_args *args, int backward, int device);
fk_status fk_cuda_attention_fwd(const fk_attention_args *args, int device, void *stream);
fk_status fk_cuda_attention_bwd(const fk_attention_args *args, int device, void *stream);
/* The strategy fk_cuda_attention_fwd (backward = 0) or _bwd (1) would take ("fwd_mma_sm80", ...). */
const char *fk_cuda_attention_plan(const fk_attention_args *args, int backward, int device);

/* ---- CUDA runtime facts (csrc/cuda/common.cu) ------------------------------------------------- */
int fk_cuda_device_count(void);                       /* 0 without a driver or a GPU */
fk_status fk_cuda_device_name(int device, char *buf, int len, int *major, int *minor);
const char *fk_cuda_archs(void);                      /* the compiled targets, e.g. "sm_80,sm_90a" */

#ifdef __cplusplus
}
#endif
#endif
