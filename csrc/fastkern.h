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
 *           (`cols` elements of `dtype`).
 * The CUDA backward reduces dbias deterministically through `workspace`, fp32, of
 * fk_cuda_gelu_bwd_workspace(...) elements, asked with the same pointers and sizes as the call. */
fk_status fk_cpu_gelu_fwd(const void *x, const void *bias, void *y, int64_t rows, int64_t cols,
                          int approximate, fk_dtype dtype, int threads);
fk_status fk_cpu_gelu_bwd(const void *dy, const void *x, const void *bias, void *dx, void *dbias,
                          int64_t rows, int64_t cols, int approximate, fk_dtype dtype, int threads);
fk_status fk_cuda_gelu_fwd(const void *x, const void *bias, void *y, int64_t rows, int64_t cols,
                           int approximate, fk_dtype dtype, int device, void *stream);
int64_t fk_cuda_gelu_bwd_workspace(const void *dy, const void *x, const void *bias, const void *dx,
                                   int64_t rows, int64_t cols, int approximate, fk_dtype dtype,
                                   int device);
fk_status fk_cuda_gelu_bwd(const void *dy, const void *x, const void *bias, void *dx, void *dbias,
                           float *workspace, int64_t rows, int64_t cols, int approximate,
                           fk_dtype dtype, int device, void *stream);

/* ---- Softmax / log-softmax --------------------------------------------------------------------
 * x, y, dy, dx: `outer * n * inner` elements of `dtype`, row-major, reduced along the middle axis
 * (length n, stride inner): one "row" is x[o, :, i]. The op is softmax(x * scale) (log: log_softmax).
 * causal_sq > 0 (only with inner == 1): rows are the query rows of (causal_sq, n) score blocks; row
 * r is query q = r % causal_sq and key j is masked (-inf) when j > q + (n - causal_sq).
 * row_max: `outer * inner` per-row maxima of the scaled, masked rows; fp64 when dtype is FK_FLOAT64,
 * fp32 otherwise. forward writes y and row_max (NULL: not wanted, no backward follows); backward
 * reads x and row_max (never y), recomputes
 * y = exp(x * scale - row_max) / sum(exp(x * scale - row_max)) and writes
 *   softmax:     dx = scale * y * (dy - sum_j dy_j * y_j)
 *   log_softmax: dx = scale * (dy - y * sum_j dy_j)
 * (The max, not the log-sum-exp, is saved: its exponents are exact near the max, so the recomputed
 * y is as accurate as the forward's.) Masked positions get y = 0 (log: -inf) and dx = 0. Rows that
 * are all -inf, fully masked, or hold +inf / NaN produce NaN, as torch.softmax does.          */
fk_status fk_cpu_softmax_fwd(const void *x, void *y, void *row_max, int64_t outer, int64_t n,
                             int64_t inner, double scale, int64_t causal_sq, int log,
                             fk_dtype dtype, int threads);
fk_status fk_cpu_softmax_bwd(const void *dy, const void *x, const void *row_max, void *dx,
                             int64_t outer, int64_t n, int64_t inner, double scale,
                             int64_t causal_sq, int log, fk_dtype dtype, int threads);
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

/* ---- CUDA runtime facts (csrc/cuda/common.cu) ------------------------------------------------- */
int fk_cuda_device_count(void);                       /* 0 without a driver or a GPU */
fk_status fk_cuda_device_name(int device, char *buf, int len, int *major, int *minor);
const char *fk_cuda_archs(void);                      /* the compiled targets, e.g. "sm_80,sm_90a" */

#ifdef __cplusplus
}
#endif
#endif
