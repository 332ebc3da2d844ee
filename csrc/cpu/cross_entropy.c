/* Cross-entropy on the CPU: F.cross_entropy over (rows, classes) logits and int64 targets, fused
 * over the log-softmax (fastkern.h has the formulas).
 *
 * Napkin math: bf16 (2048, 50257) reads 206 MB forward (one pass) and reads + writes 412 MB
 * backward (one pass each way); a row (<= 200 KB as fp32) is walked in chunks of FK_CHUNK through a
 * stack buffer, so the cost is the exps (vec.h's Cephes expf, ~1 ns an element a core).
 * Forward, per row, one read: each chunk is loaded (fp16 / bf16 converted to fp32), its max taken;
 * a new max rescales the running sum once (s *= exp(m_old - m_new), fp64), then the chunk's exps add
 * in fp32 lanes and the chunk's total in fp64 (error ~ a chunk's roundings, not the row's). With
 * label smoothing the chunk's plain sum adds too. lse = m + log s, then the row's loss in fp64.
 * Backward, per row, one read and one write: dx = g * (exp((x - m) - log s) - eps / C), the target's
 * element minus g * (1 - eps), written chunk by chunk over what was read (so dx may be x).
 * The saved statistic is the pair (m, log s), not lse = m + log s (fastkern.h says why).
 * Ignored rows are not read: statistic (0, 0), loss 0, dx 0.
 * fp64 (gradcheck): the same passes in scalar fp64 with libm's exp.
 * Rows go to the caller's threads in contiguous runs (fk_parallel_for); a reduction's per-row losses
 * land in the workspace and are summed in row order afterwards, so every result is the same bits for
 * any thread count.
 */
#include <math.h>

#include "common.h"
#include "vec.h"

typedef struct ce_job ce_job;
typedef void (*ce_row_fn)(const ce_job *j, int64_t row);
struct ce_job {
    const void *x, *grad;
    const int64_t *target;
    void *out;      /* forward: the loss (reduction none); backward: dx */
    void *lse;      /* forward writes, backward reads */
    void *row_loss; /* forward with a reduction: the workspace */
    int64_t classes, ignore_index;
    int64_t x_ld, out_ld; /* row strides of x and of dx (elements) */
    double eps, g; /* label smoothing; backward with a reduction: the gradient of every row's loss */
    int reduction;
    fk_dtype dtype, loss_dtype;
    ce_row_fn row;
};

/* exp relative to m, or to 0 while m is -inf, so that -inf - -inf does not make NaN early. */
static inline double ref(double m) { return m == -INFINITY ? 0.0 : m; }

/* A row's loss into the loss tensor (reduction none) or the workspace. */
static void put_loss(const ce_job *j, int64_t row, double loss) {
    if (j->reduction != FK_REDUCE_NONE) {
        if (j->dtype == FK_FLOAT64) ((double *)j->row_loss)[row] = loss;
        else ((float *)j->row_loss)[row] = (float)loss;
    } else if (j->loss_dtype == FK_FLOAT64) {
        ((double *)j->out)[row] = loss;
    } else {
        float f = (float)loss;
        fk_store_f32(j->loss_dtype, &f, row, 1, j->out);
    }
}

/* The gradient of row `row`'s loss. */
static double row_grad(const ce_job *j, int64_t row) {
    if (j->reduction != FK_REDUCE_NONE) return j->g;
    if (j->loss_dtype == FK_FLOAT64) return ((const double *)j->grad)[row];
    float g;
    fk_load_f32(j->loss_dtype, j->grad, row, 1, &g);
    return g;
}

#define FK_CE_ROWS(isa, attrs, lanes)                                                               \
    static attrs void ce_fwd_row_##isa(const ce_job *j, int64_t row) {                              \
        float buf[FK_CHUNK] __attribute__((aligned(64)));                                           \
        const vf_##isa zero = {0};                                                                  \
        int64_t c = j->classes, t = j->target[row];                                                 \
        if (t == j->ignore_index) {                                                                 \
            ((float *)j->lse)[2 * row] = ((float *)j->lse)[2 * row + 1] = 0.0f;                     \
            put_loss(j, row, 0.0);                                                                  \
            return;                                                                                 \
        }                                                                                           \
        float m = -INFINITY;                                                                        \
        double s = 0.0, sx = 0.0;                                                                   \
        for (int64_t j0 = 0; j0 < c; j0 += FK_CHUNK) {                                              \
            int64_t len = c - j0 < FK_CHUNK ? c - j0 : FK_CHUNK;                                    \
            int64_t padded = (len + lanes - 1) / lanes * lanes;                                     \
            fk_load_f32(j->dtype, j->x, row * j->x_ld + j0, len, buf);                              \
            if (j->eps != 0.0) {                                                                    \
                for (int64_t i = len; i < padded; i++) buf[i] = 0.0f;                               \
                vf_##isa acc = zero;                                                                \
                for (int64_t i = 0; i < padded; i += lanes) acc += *(const vf_##isa *)(buf + i);    \
                for (int l = 0; l < lanes; l++) sx += acc[l];                                       \
            }                                                                                       \
            for (int64_t i = len; i < padded; i++) buf[i] = -INFINITY;                              \
            vf_##isa vmax = zero - INFINITY;                                                        \
            for (int64_t i = 0; i < padded; i += lanes) {                                           \
                vf_##isa v = *(const vf_##isa *)(buf + i);                                          \
                vmax = select_##isa(v > vmax, v, vmax); /* NaN is skipped; its exp poisons s */     \
            }                                                                                       \
            float cm = m;                                                                           \
            for (int l = 0; l < lanes; l++) cm = vmax[l] > cm ? vmax[l] : cm;                       \
            if (cm > m) {                                                                           \
                if (s != 0.0) s *= exp(ref(m) - ref(cm)); /* 0 * inf would be NaN */                \
                m = cm;                                                                             \
            }                                                                                       \
            float r = (float)ref(m);                                                                \
            vf_##isa acc = zero;                                                                    \
            for (int64_t i = 0; i < padded; i += lanes) acc += exp_##isa(*(const vf_##isa *)(buf + i) - r); \
            for (int l = 0; l < lanes; l++) s += acc[l];                                            \
        }                                                                                           \
        double lse = m + log(s);                                                                    \
        float xt;                                                                                   \
        fk_load_f32(j->dtype, j->x, row * j->x_ld + t, 1, &xt);                                     \
        ((float *)j->lse)[2 * row] = m, ((float *)j->lse)[2 * row + 1] = (float)log(s);             \
        double loss = lse - (1.0 - j->eps) * xt;                                                    \
        if (j->eps != 0.0) loss -= j->eps / (double)c * sx;                                         \
        put_loss(j, row, loss);                                                                     \
    }                                                                                               \
                                                                                                    \
    static attrs void ce_bwd_row_##isa(const ce_job *j, int64_t row) {                              \
        float buf[FK_CHUNK] __attribute__((aligned(64)));                                           \
        int64_t c = j->classes, t = j->target[row];                                                 \
        int size = fk_dtype_size(j->dtype);                                                         \
        if (t == j->ignore_index) {                                                                 \
            memset((char *)j->out + row * j->out_ld * size, 0, (size_t)(c * size));                 \
            return;                                                                                 \
        }                                                                                           \
        double g = row_grad(j, row);                                                                \
        float m = ((const float *)j->lse)[2 * row], log_s = ((const float *)j->lse)[2 * row + 1];   \
        float gf = (float)g;                                                                        \
        float off = (float)(j->eps / (double)c);                                                    \
        for (int64_t j0 = 0; j0 < c; j0 += FK_CHUNK) {                                              \
            int64_t len = c - j0 < FK_CHUNK ? c - j0 : FK_CHUNK;                                    \
            int64_t padded = (len + lanes - 1) / lanes * lanes;                                     \
            fk_load_f32(j->dtype, j->x, row * j->x_ld + j0, len, buf);                              \
            for (int64_t i = len; i < padded; i++) buf[i] = 0.0f;                                   \
            int has_t = t >= j0 && t < j0 + len;                                                    \
            float xt = has_t ? buf[t - j0] : 0.0f;                                                  \
            for (int64_t i = 0; i < padded; i += lanes) {                                           \
                vf_##isa p = exp_##isa((*(const vf_##isa *)(buf + i) - m) - log_s);                 \
                *(vf_##isa *)(buf + i) = gf * (p - off);                                            \
            }                                                                                       \
            if (has_t) /* p - 1 cancels near 1: the target's element in fp64 */                     \
                buf[t - j0] = (float)(g * (exp((double)(xt - m) - log_s) - j->eps / (double)c - (1.0 - j->eps))); \
            fk_store_f32(j->dtype, buf, row * j->out_ld + j0, len, j->out);                         \
        }                                                                                           \
    }

FK_CE_ROWS(generic, FK_ATTRS_GENERIC, 4)
#if FK_X86
FK_CE_ROWS(avx2, FK_ATTRS_AVX2, 8)
FK_CE_ROWS(avx512, FK_ATTRS_AVX512, 16)
#endif

/* fp64: the same passes, scalar, libm's exp. */
static void ce_fwd_row_f64(const ce_job *j, int64_t row) {
    int64_t c = j->classes, t = j->target[row];
    const double *x = (const double *)j->x + row * j->x_ld;
    if (t == j->ignore_index) {
        ((double *)j->lse)[2 * row] = ((double *)j->lse)[2 * row + 1] = 0.0;
        put_loss(j, row, 0.0);
        return;
    }
    double m = -INFINITY, s = 0.0, sx = 0.0;
    for (int64_t i = 0; i < c; i++) {
        double v = x[i];
        sx += v;
        if (v > m || isnan(v)) {
            if (s != 0.0) s *= exp(ref(m) - ref(v));
            m = v;
        }
        s += exp(v - ref(m));
    }
    double lse = m + log(s);
    ((double *)j->lse)[2 * row] = m, ((double *)j->lse)[2 * row + 1] = log(s);
    double loss = lse - (1.0 - j->eps) * x[t];
    if (j->eps != 0.0) loss -= j->eps / (double)c * sx;
    put_loss(j, row, loss);
}

static void ce_bwd_row_f64(const ce_job *j, int64_t row) {
    int64_t c = j->classes, t = j->target[row];
    const double *x = (const double *)j->x + row * j->x_ld;
    double *dx = (double *)j->out + row * j->out_ld;
    if (t == j->ignore_index) {
        memset(dx, 0, (size_t)c * sizeof(double));
        return;
    }
    double g = row_grad(j, row), off = j->eps / (double)c;
    double m = ((const double *)j->lse)[2 * row], log_s = ((const double *)j->lse)[2 * row + 1];
    for (int64_t i = 0; i < c; i++) {
        double p = exp((x[i] - m) - log_s);
        dx[i] = g * (p - off - (i == t ? 1.0 - j->eps : 0.0));
    }
}

static ce_row_fn pick_row(fk_dtype dtype, int backward) {
    if (dtype == FK_FLOAT64) return backward ? ce_bwd_row_f64 : ce_fwd_row_f64;
#if defined(__x86_64__) && defined(__GNUC__)
    int isa = fk_cpu_isa();
    if (isa == FK_ISA_AVX512) return backward ? ce_bwd_row_avx512 : ce_fwd_row_avx512;
    if (isa == FK_ISA_AVX2) return backward ? ce_bwd_row_avx2 : ce_fwd_row_avx2;
#endif
    return backward ? ce_bwd_row_generic : ce_fwd_row_generic;
}

static void run_rows(void *arg, int64_t begin, int64_t end) {
    const ce_job *j = (const ce_job *)arg;
    for (int64_t r = begin; r < end; r++) j->row(j, r);
}

/* FK_OK when the sizes, options and every target are in range; counts the rows not ignored. */
static fk_status check_args(const char *op, const int64_t *target, int64_t rows, int64_t classes,
                            int64_t ignore_index, double eps, int reduction, fk_dtype dtype,
                            fk_dtype loss_dtype, int64_t *valid) {
    fk_status status = fk_cpu_check_dtype(dtype, op);
    if (status != FK_OK) return status;
    if (loss_dtype != dtype && !(loss_dtype == FK_FLOAT32 && dtype != FK_FLOAT64))
        return fk_fail(FK_ERR_TYPE, "%s: the loss dtype code %d must be the logits' (%d) or float32", op,
                       (int)loss_dtype, (int)dtype);
    if (rows < 0 || classes < 0) return fk_fail(FK_ERR_VALUE, "%s: negative size", op);
    if (reduction != FK_REDUCE_NONE && reduction != FK_REDUCE_MEAN && reduction != FK_REDUCE_SUM)
        return fk_fail(FK_ERR_VALUE, "%s: unknown reduction code %d", op, reduction);
    if (!(eps >= 0.0 && eps <= 1.0))
        return fk_fail(FK_ERR_VALUE, "%s: label_smoothing must be in [0, 1], got %g", op, eps);
    int64_t count = 0;
    for (int64_t r = 0; r < rows; r++) {
        int64_t t = target[r];
        if (t == ignore_index) continue;
        if (t < 0 || t >= classes)
            return fk_fail(FK_ERR_VALUE, "%s: target[%lld] = %lld is out of range for %lld classes",
                           op, (long long)r, (long long)t, (long long)classes);
        count++;
    }
    *valid = count;
    return FK_OK;
}

static double load_scalar(fk_dtype dtype, const void *p) {
    if (dtype == FK_FLOAT64) return *(const double *)p;
    float f;
    fk_load_f32(dtype, p, 0, 1, &f);
    return f;
}

static void store_scalar(fk_dtype dtype, double v, void *p, int64_t at) {
    if (dtype == FK_FLOAT64) {
        ((double *)p)[at] = v;
        return;
    }
    float f = (float)v;
    if (dtype == FK_FLOAT32) ((float *)p)[at] = f;
    else fk_store_f32(dtype, &f, at, 1, p);
}

fk_status fk_cpu_cross_entropy_fwd(const void *x, const int64_t *target, void *loss, void *lse,
                                   void *valid, void *workspace, int64_t rows, int64_t classes,
                                   int64_t x_ld, int64_t ignore_index, double label_smoothing, int reduction,
                                   fk_dtype dtype, fk_dtype loss_dtype, int threads) {
    int64_t count = 0;
    fk_status status = check_args("cross_entropy", target, rows, classes, ignore_index,
                                  label_smoothing, reduction, dtype, loss_dtype, &count);
    if (status != FK_OK) return status;
    if (classes == 0 && count > 0)
        return fk_fail(FK_ERR_VALUE, "cross_entropy: no classes (logits of shape (%lld, 0))",
                       (long long)rows);
    fk_dtype stat = dtype == FK_FLOAT64 ? FK_FLOAT64 : FK_FLOAT32;
    if (x_ld < classes) return fk_fail(FK_ERR_VALUE, "cross_entropy: row stride %lld < %lld classes",
                                       (long long)x_ld, (long long)classes);
    ce_job j = {x, NULL, target, loss, lse, workspace, classes, ignore_index, x_ld, 0, label_smoothing, 0.0,
                reduction, dtype, loss_dtype, pick_row(dtype, 0)};
    fk_parallel_for(threads, rows, fk_min_items(classes), run_rows, &j);
    store_scalar(stat, (double)count, valid, 0);
    if (reduction == FK_REDUCE_NONE) return FK_OK;
    double total = 0.0; /* in row order: the same bits for any thread count */
    for (int64_t r = 0; r < rows; r++)
        total += stat == FK_FLOAT64 ? ((const double *)workspace)[r] : ((const float *)workspace)[r];
    store_scalar(loss_dtype, reduction == FK_REDUCE_MEAN ? total / (double)count : total, loss, 0);
    return FK_OK;
}

fk_status fk_cpu_cross_entropy_bwd(const void *grad, const void *x, const int64_t *target,
                                   const void *lse, const void *valid, void *dx, int64_t rows,
                                   int64_t classes, int64_t x_ld, int64_t dx_ld, int64_t ignore_index,
                                   double label_smoothing, int reduction, fk_dtype dtype,
                                   fk_dtype loss_dtype, int threads) {
    int64_t count = 0;
    fk_status status = check_args("cross_entropy_backward", target, rows, classes, ignore_index,
                                  label_smoothing, reduction, dtype, loss_dtype, &count);
    if (status != FK_OK) return status;
    fk_dtype stat = dtype == FK_FLOAT64 ? FK_FLOAT64 : FK_FLOAT32;
    double g = 0.0;
    if (reduction != FK_REDUCE_NONE && rows > 0) {
        g = load_scalar(loss_dtype, grad);
        if (reduction == FK_REDUCE_MEAN) g /= load_scalar(stat, valid);
    }
    if (x_ld < classes || dx_ld < classes)
        return fk_fail(FK_ERR_VALUE, "cross_entropy_backward: row strides %lld / %lld < %lld classes",
                       (long long)x_ld, (long long)dx_ld, (long long)classes);
    ce_job j = {x, grad, target, dx, (void *)lse, NULL, classes, ignore_index, x_ld, dx_ld, label_smoothing, g,
                reduction, dtype, loss_dtype, pick_row(dtype, 1)};
    fk_parallel_for(threads, rows, fk_min_items(classes), run_rows, &j);
    return FK_OK;
}
