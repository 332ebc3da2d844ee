/* Softmax / log-softmax on the CPU, reduced along the middle axis of an (outer, n, inner) array.
 *
 * Napkin math. Forward, inner == 1: one online pass keeps a running max m and a sum s rescaled by
 * exp(m_old - m_new) whenever the max grows (once per 512-element chunk, not per element), then a
 * write pass re-reads the row (from cache for rows up to a few hundred KB) and stores
 * exp(v - m) / s. Bytes: read 2x + write 1x per element, one exp per element per pass. inner > 1:
 * the same algorithm on a tile of up to 64 adjacent columns x 8 rows, so every load is a
 * contiguous run of the innermost axis and the max rescale happens once per 8 rows. Backward reads
 * x and dy twice (sum pass, write pass) and writes dx once; y is recomputed as exp(v - lse).
 * The ceiling is the exp throughput: every inner loop is branch-free (selects instead of ifs), keeps
 * 16 independent accumulators (the order change float sums need before the compiler vectorizes
 * them), and uses exp_f32 below, a polynomial exp the compiler can vectorize (libm's expf cannot be
 * without -ffast-math). fp64 exists for gradcheck, so it uses libm's exp and log.
 *
 * Special values follow torch.softmax: masked keys take the value -inf, so a row that is all -inf
 * (or fully masked) gets m = -inf, s = 0, lse = -inf and y = 0 / 0 = NaN; a row holding +inf or NaN
 * gets s = NaN and so lse and y NaN. The reference point for exp is 0 instead of m when m = -inf, so
 * that -inf - -inf never turns a partial sum into NaN before a finite value arrives.
 */
#include <math.h>
#include <string.h>

#include "common.h"

#define LANES 16                      /* independent accumulators: two AVX-512 or four AVX2 vectors */
#define COLS_W 64                     /* adjacent inner columns per tile */
#define COLS_J (FK_CHUNK / COLS_W)    /* rows per tile: the max rescale is paid once per COLS_J rows */

/* exp(x) to about 1 ulp: x = k ln2 + r with |r| <= ln2 / 2 (Cody-Waite split ln2, exact product for
 * |k| < 2^8), degree-7 Taylor polynomial for exp(r) (truncation 5e-9 relative), 2^k applied as two
 * halves so that results in the subnormal range round once instead of flushing to zero. */
static inline float exp_f32(float x) {
    float xc = x > -104.0f ? x : -104.0f; /* also maps NaN to a value the int conversion accepts */
    xc = xc < 89.0f ? xc : 89.0f;
    float kf = xc * 1.44269504088896341f + 12582912.0f; /* 1.5 * 2^23: rounds to an integer */
    kf -= 12582912.0f;
    float r = xc - kf * 0.693145751953125f;
    r = r - kf * 1.42860682030941723212e-6f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t k = (int32_t)kf, k1 = k / 2, k2 = k - k1;
    uint32_t b1 = (uint32_t)(k1 + 127) << 23, b2 = (uint32_t)(k2 + 127) << 23;
    float s1, s2;
    memcpy(&s1, &b1, 4);
    memcpy(&s2, &b2, 4);
    float e = p * s1 * s2;
    e = x > 88.72283935546875f ? INFINITY : e;
    e = x < -104.0f ? 0.0f : e;
    return x != x ? x : e;
}

static inline void load_f64(fk_dtype dtype, const void *src, int64_t start, int64_t len, double *out) {
    (void)dtype;
    memcpy(out, (const double *)src + start, (size_t)len * sizeof(double));
}

static inline void store_f64(fk_dtype dtype, const double *in, int64_t start, int64_t len, void *dst) {
    (void)dtype;
    memcpy((double *)dst + start, in, (size_t)len * sizeof(double));
}

/* Keys of row `row` at or beyond the returned length are masked (causal_sq == 0: none are). */
static inline int64_t causal_len(int64_t row, int64_t n, int64_t causal_sq) {
    if (causal_sq == 0) return n;
    int64_t len = row % causal_sq + 1 + n - causal_sq;
    return len < 0 ? 0 : (len > n ? n : len);
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* The kernels, written once for the float work type (fp32 / fp16 / bf16 storage) and once for
 * double (fp64 storage). LOAD / STORE move a chunk between storage and the work type. */
#define DEFINE_SOFTMAX_KERNELS(real, sfx, EXP, LOG, LOAD, STORE)                                    \
                                                                                                    \
    static inline real ref_##sfx(real m) { return m == -(real)INFINITY ? (real)0 : m; }             \
                                                                                                    \
    /* s was accumulated against ref(from); re-express it against to >= from. */                    \
    static inline real rescale_##sfx(real s, real from, real to) {                                  \
        return from == -(real)INFINITY ? s : s * EXP(from - to);                                    \
    }                                                                                               \
                                                                                                    \
    static inline void scale_##sfx(real *v, int64_t len, real scale) {                              \
        for (int64_t i = 0; i < len; i++) v[i] *= scale;                                            \
    }                                                                                               \
                                                                                                    \
    static inline real max_##sfx(const real *v, int64_t len) {                                      \
        real acc[LANES];                                                                            \
        for (int l = 0; l < LANES; l++) acc[l] = -(real)INFINITY;                                   \
        int64_t i = 0;                                                                              \
        for (; i + LANES <= len; i += LANES)                                                        \
            for (int l = 0; l < LANES; l++) acc[l] = v[i + l] > acc[l] ? v[i + l] : acc[l];         \
        for (; i < len; i++) acc[0] = v[i] > acc[0] ? v[i] : acc[0];                                \
        real m = acc[0];                                                                            \
        for (int l = 1; l < LANES; l++) m = acc[l] > m ? acc[l] : m;                                \
        return m;                                                                                   \
    }                                                                                               \
                                                                                                    \
    static inline real sum_exp_##sfx(const real *v, int64_t len, real ref) {                        \
        real acc[LANES] = {0};                                                                      \
        int64_t i = 0;                                                                              \
        for (; i + LANES <= len; i += LANES)                                                        \
            for (int l = 0; l < LANES; l++) acc[l] += EXP(v[i + l] - ref);                          \
        for (; i < len; i++) acc[0] += EXP(v[i] - ref);                                             \
        real s = 0;                                                                                 \
        for (int l = 0; l < LANES; l++) s += acc[l];                                                \
        return s;                                                                                   \
    }                                                                                               \
                                                                                                    \
    /* y = exp(x * scale - lse) with the exponent rounded once: x * scale rounded on its own would  \
     * add an error of ulp(x * scale) that does not cancel against lse. */                          \
    static inline real probs_##sfx(real x, double scale, double lse) {                              \
        return EXP((real)((double)x * scale - lse));                                                \
    }                                                                                               \
                                                                                                    \
    /* sum of y' (g == NULL) or of g * y' */                                                        \
    static inline real sum_probs_##sfx(const real *x, const real *g, int64_t len, double scale,     \
                                       double lse) {                                                \
        real acc[LANES] = {0};                                                                      \
        int64_t i = 0;                                                                              \
        if (g) {                                                                                    \
            for (; i + LANES <= len; i += LANES)                                                    \
                for (int l = 0; l < LANES; l++) acc[l] += g[i + l] * probs_##sfx(x[i + l], scale, lse); \
            for (; i < len; i++) acc[0] += g[i] * probs_##sfx(x[i], scale, lse);                    \
        } else {                                                                                    \
            for (; i + LANES <= len; i += LANES)                                                    \
                for (int l = 0; l < LANES; l++) acc[l] += probs_##sfx(x[i + l], scale, lse);        \
            for (; i < len; i++) acc[0] += probs_##sfx(x[i], scale, lse);                           \
        }                                                                                           \
        real s = 0;                                                                                 \
        for (int l = 0; l < LANES; l++) s += acc[l];                                                \
        return s;                                                                                   \
    }                                                                                               \
                                                                                                    \
    static inline real sum_##sfx(const real *v, int64_t len) {                                      \
        real acc[LANES] = {0};                                                                      \
        int64_t i = 0;                                                                              \
        for (; i + LANES <= len; i += LANES)                                                        \
            for (int l = 0; l < LANES; l++) acc[l] += v[i + l];                                     \
        for (; i < len; i++) acc[0] += v[i];                                                        \
        real s = 0;                                                                                 \
        for (int l = 0; l < LANES; l++) s += acc[l];                                                \
        return s;                                                                                   \
    }                                                                                               \
                                                                                                    \
    /* v[i] (scaled input) -> output for positions start + i; positions >= valid are masked. */     \
    static inline void fwd_out_##sfx(real *v, int64_t len, int64_t start, int64_t valid, real ref,  \
                                     real s, real log_s, int is_log) {                              \
        if (is_log) {                                                                               \
            real masked = (-(real)INFINITY - ref) - log_s;                                          \
            for (int64_t i = 0; i < len; i++)                                                       \
                v[i] = start + i < valid ? (v[i] - ref) - log_s : masked;                           \
        } else {                                                                                    \
            real masked = EXP(-(real)INFINITY - ref) / s;                                           \
            for (int64_t i = 0; i < len; i++)                                                       \
                v[i] = start + i < valid ? EXP(v[i] - ref) / s : masked;                            \
        }                                                                                           \
    }                                                                                               \
                                                                                                    \
    /* x: input, g: dy -> dx in g, for positions start + i; >= valid are masked. The recomputed     \
     * probabilities are divided by their sum z: lse carries a rounding error of ulp(lse) that would \
     * otherwise scale every y of the row (and dominate dx for rows with a large max). */           \
    static inline void bwd_out_##sfx(const real *x, real *g, int64_t len, int64_t start,            \
                                     int64_t valid, real lse, real z, real a, real scale, int is_log) { \
        if (is_log) {                                                                               \
            for (int64_t i = 0; i < len; i++)                                                       \
                g[i] = start + i < valid ? scale * (g[i] - probs_##sfx(x[i], scale, lse) / z * a)   \
                                         : (real)0;                                                 \
        } else {                                                                                    \
            real a_z = a / z;                                                                       \
            for (int64_t i = 0; i < len; i++) {                                                     \
                real y = probs_##sfx(x[i], scale, lse) / z;                                         \
                g[i] = start + i < valid ? scale * (y * (g[i] - a_z)) : (real)0;                    \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
                                                                                                    \
    static void fwd_row_##sfx(fk_dtype dtype, const void *x, void *y, real *lse, int64_t base,      \
                              int64_t n, int64_t valid, real scale, int is_log) {                   \
        real v[FK_CHUNK];                                                                           \
        real m = -(real)INFINITY, s = 0;                                                            \
        for (int64_t c = 0; c < valid; c += FK_CHUNK) {                                             \
            int64_t len = min64(FK_CHUNK, valid - c);                                               \
            LOAD(dtype, x, base + c, len, v);                                                       \
            scale_##sfx(v, len, scale);                                                             \
            real cm = max_##sfx(v, len), m_new = cm > m ? cm : m;                                   \
            s = rescale_##sfx(s, m, m_new) + sum_exp_##sfx(v, len, ref_##sfx(m_new));               \
            m = m_new;                                                                              \
        }                                                                                           \
        real ref = ref_##sfx(m), log_s = LOG(s);                                                    \
        *lse = m + log_s;                                                                           \
        for (int64_t c = 0; c < n; c += FK_CHUNK) {                                                 \
            int64_t len = min64(FK_CHUNK, n - c);                                                   \
            if (c < valid) {                                                                        \
                LOAD(dtype, x, base + c, len, v);                                                   \
                scale_##sfx(v, len, scale);                                                         \
            }                                                                                       \
            fwd_out_##sfx(v, len, c, valid, ref, s, log_s, is_log);                                 \
            STORE(dtype, v, base + c, len, y);                                                      \
        }                                                                                           \
    }                                                                                               \
                                                                                                    \
    /* z = sum of the recomputed probabilities (1 up to lse's rounding); a = sum of dy * y' (softmax) \
     * or of dy over the whole row, masked keys included (log_softmax). */                          \
    static void bwd_row_##sfx(fk_dtype dtype, const void *dy, const void *x, real lse, void *dx,    \
                              int64_t base, int64_t n, int64_t valid, real scale, int is_log) {     \
        real v[FK_CHUNK], g[FK_CHUNK];                                                              \
        real z = 0, a = 0;                                                                          \
        for (int64_t c = 0; c < (is_log ? n : valid); c += FK_CHUNK) {                              \
            int64_t len = min64(FK_CHUNK, (is_log ? n : valid) - c);                                \
            LOAD(dtype, dy, base + c, len, g);                                                      \
            if (c < valid) {                                                                        \
                int64_t vlen = min64(len, valid - c);                                               \
                LOAD(dtype, x, base + c, vlen, v);                                                  \
                z += sum_probs_##sfx(v, NULL, vlen, scale, lse);                                    \
                if (!is_log) a += sum_probs_##sfx(v, g, vlen, scale, lse);                          \
            }                                                                                       \
            if (is_log) a += sum_##sfx(g, len);                                                     \
        }                                                                                           \
        for (int64_t c = 0; c < n; c += FK_CHUNK) {                                                 \
            int64_t len = min64(FK_CHUNK, n - c);                                                   \
            if (c < valid) {                                                                        \
                LOAD(dtype, x, base + c, len, v);                                                   \
                LOAD(dtype, dy, base + c, len, g);                                                  \
                bwd_out_##sfx(v, g, len, c, valid, lse, z, a, scale, is_log);                       \
            } else {                                                                                \
                memset(g, 0, (size_t)len * sizeof(real));                                           \
            }                                                                                       \
            STORE(dtype, g, base + c, len, dx);                                                     \
        }                                                                                           \
    }                                                                                               \
                                                                                                    \
    /* Loads rows [j0, j0 + rows) of the tile at columns [i0, i0 + w) of slab o as v[r * w + c]. */ \
    static inline void load_tile_##sfx(fk_dtype dtype, const void *src, int64_t slab, int64_t j0,   \
                                       int64_t rows, int64_t i0, int64_t w, int64_t inner,          \
                                       real *v) {                                                   \
        for (int64_t r = 0; r < rows; r++) LOAD(dtype, src, slab + (j0 + r) * inner + i0, w, v + r * w); \
    }                                                                                               \
                                                                                                    \
    static void fwd_cols_##sfx(fk_dtype dtype, const void *x, void *y, real *lse, int64_t o,        \
                               int64_t i0, int64_t w, int64_t n, int64_t inner, real scale,         \
                               int is_log) {                                                        \
        real v[COLS_J * COLS_W], m[COLS_W], s[COLS_W], ref[COLS_W], log_s[COLS_W];                  \
        int64_t slab = o * n * inner;                                                               \
        for (int64_t c = 0; c < w; c++) m[c] = -(real)INFINITY, s[c] = 0;                           \
        for (int64_t j0 = 0; j0 < n; j0 += COLS_J) {                                                \
            int64_t rows = min64(COLS_J, n - j0);                                                   \
            load_tile_##sfx(dtype, x, slab, j0, rows, i0, w, inner, v);                             \
            scale_##sfx(v, rows * w, scale);                                                        \
            real m_new[COLS_W];                                                                     \
            for (int64_t c = 0; c < w; c++) m_new[c] = m[c];                                        \
            for (int64_t r = 0; r < rows; r++)                                                      \
                for (int64_t c = 0; c < w; c++)                                                     \
                    m_new[c] = v[r * w + c] > m_new[c] ? v[r * w + c] : m_new[c];                   \
            for (int64_t c = 0; c < w; c++) {                                                       \
                s[c] = rescale_##sfx(s[c], m[c], m_new[c]);                                         \
                m[c] = m_new[c];                                                                    \
                ref[c] = ref_##sfx(m_new[c]);                                                       \
            }                                                                                       \
            for (int64_t r = 0; r < rows; r++)                                                      \
                for (int64_t c = 0; c < w; c++) s[c] += EXP(v[r * w + c] - ref[c]);                 \
        }                                                                                           \
        for (int64_t c = 0; c < w; c++) {                                                           \
            log_s[c] = LOG(s[c]);                                                                   \
            lse[o * inner + i0 + c] = m[c] + log_s[c];                                              \
        }                                                                                           \
        for (int64_t j0 = 0; j0 < n; j0 += COLS_J) {                                                \
            int64_t rows = min64(COLS_J, n - j0);                                                   \
            load_tile_##sfx(dtype, x, slab, j0, rows, i0, w, inner, v);                             \
            scale_##sfx(v, rows * w, scale);                                                        \
            for (int64_t r = 0; r < rows; r++)                                                      \
                for (int64_t c = 0; c < w; c++)                                                     \
                    v[r * w + c] = is_log ? (v[r * w + c] - ref[c]) - log_s[c]                      \
                                       : EXP(v[r * w + c] - ref[c]) / s[c];                         \
            for (int64_t r = 0; r < rows; r++)                                                      \
                STORE(dtype, v + r * w, slab + (j0 + r) * inner + i0, w, y);                        \
        }                                                                                           \
    }                                                                                               \
                                                                                                    \
    static void bwd_cols_##sfx(fk_dtype dtype, const void *dy, const void *x, const real *lse,      \
                               void *dx, int64_t o, int64_t i0, int64_t w, int64_t n,               \
                               int64_t inner, real scale, int is_log) {                             \
        real v[COLS_J * COLS_W], g[COLS_J * COLS_W], l[COLS_W], z[COLS_W], a[COLS_W];               \
        int64_t slab = o * n * inner;                                                               \
        for (int64_t c = 0; c < w; c++) l[c] = lse[o * inner + i0 + c], z[c] = 0, a[c] = 0;         \
        for (int64_t j0 = 0; j0 < n; j0 += COLS_J) {                                                \
            int64_t rows = min64(COLS_J, n - j0);                                                   \
            load_tile_##sfx(dtype, dy, slab, j0, rows, i0, w, inner, g);                            \
            load_tile_##sfx(dtype, x, slab, j0, rows, i0, w, inner, v);                             \
            for (int64_t r = 0; r < rows; r++)                                                      \
                for (int64_t c = 0; c < w; c++) {                                                   \
                    real yv = probs_##sfx(v[r * w + c], scale, l[c]), gv = g[r * w + c];            \
                    z[c] += yv;                                                                     \
                    a[c] += is_log ? gv : gv * yv;                                                  \
                }                                                                                   \
        }                                                                                           \
        for (int64_t c = 0; c < w; c++) a[c] = is_log ? a[c] : a[c] / z[c];                         \
        for (int64_t j0 = 0; j0 < n; j0 += COLS_J) {                                                \
            int64_t rows = min64(COLS_J, n - j0);                                                   \
            load_tile_##sfx(dtype, x, slab, j0, rows, i0, w, inner, v);                             \
            load_tile_##sfx(dtype, dy, slab, j0, rows, i0, w, inner, g);                            \
            for (int64_t r = 0; r < rows; r++)                                                      \
                for (int64_t c = 0; c < w; c++) {                                                   \
                    real yv = probs_##sfx(v[r * w + c], scale, l[c]) / z[c], gv = g[r * w + c];     \
                    g[r * w + c] = is_log ? scale * (gv - yv * a[c]) : scale * (yv * (gv - a[c]));  \
                }                                                                                   \
            for (int64_t r = 0; r < rows; r++)                                                      \
                STORE(dtype, g + r * w, slab + (j0 + r) * inner + i0, w, dx);                       \
        }                                                                                           \
    }

DEFINE_SOFTMAX_KERNELS(float, f32, exp_f32, logf, fk_load_f32, fk_store_f32)
DEFINE_SOFTMAX_KERNELS(double, f64, exp, log, load_f64, store_f64)

static fk_status check_args(const char *op, int64_t outer, int64_t n, int64_t inner,
                            int64_t causal_sq, fk_dtype dtype) {
    fk_status st = fk_cpu_check_dtype(dtype, op);
    if (st != FK_OK) return st;
    if (outer < 0 || n < 0 || inner < 0)
        return fk_fail(FK_ERR_VALUE, "%s: sizes must be >= 0, got outer=%lld n=%lld inner=%lld", op,
                       (long long)outer, (long long)n, (long long)inner);
    if (causal_sq < 0 || (causal_sq > 0 && inner != 1))
        return fk_fail(FK_ERR_VALUE, "%s: causal_sq must be >= 0 and needs inner == 1, got "
                       "causal_sq=%lld inner=%lld", op, (long long)causal_sq, (long long)inner);
    return FK_OK;
}

fk_status fk_cpu_softmax_fwd(const void *x, void *y, void *lse, int64_t outer, int64_t n,
                             int64_t inner, double scale, int64_t causal_sq, int log,
                             fk_dtype dtype) {
    fk_status st = check_args("softmax_fwd", outer, n, inner, causal_sq, dtype);
    if (st != FK_OK || outer == 0 || inner == 0) return st;
    int f64 = dtype == FK_FLOAT64;
    if (inner == 1) {
        for (int64_t r = 0; r < outer; r++) {
            int64_t valid = causal_len(r, n, causal_sq);
            if (f64) fwd_row_f64(dtype, x, y, (double *)lse + r, r * n, n, valid, scale, log);
            else fwd_row_f32(dtype, x, y, (float *)lse + r, r * n, n, valid, (float)scale, log);
        }
        return FK_OK;
    }
    for (int64_t o = 0; o < outer; o++)
        for (int64_t i0 = 0; i0 < inner; i0 += COLS_W) {
            int64_t w = min64(COLS_W, inner - i0);
            if (f64) fwd_cols_f64(dtype, x, y, (double *)lse, o, i0, w, n, inner, scale, log);
            else fwd_cols_f32(dtype, x, y, (float *)lse, o, i0, w, n, inner, (float)scale, log);
        }
    return FK_OK;
}

fk_status fk_cpu_softmax_bwd(const void *dy, const void *x, const void *lse, void *dx,
                             int64_t outer, int64_t n, int64_t inner, double scale,
                             int64_t causal_sq, int log, fk_dtype dtype) {
    fk_status st = check_args("softmax_bwd", outer, n, inner, causal_sq, dtype);
    if (st != FK_OK || outer == 0 || inner == 0 || n == 0) return st;
    int f64 = dtype == FK_FLOAT64;
    if (inner == 1) {
        for (int64_t r = 0; r < outer; r++) {
            int64_t valid = causal_len(r, n, causal_sq);
            if (f64) bwd_row_f64(dtype, dy, x, ((const double *)lse)[r], dx, r * n, n, valid, scale, log);
            else bwd_row_f32(dtype, dy, x, ((const float *)lse)[r], dx, r * n, n, valid, (float)scale, log);
        }
        return FK_OK;
    }
    for (int64_t o = 0; o < outer; o++)
        for (int64_t i0 = 0; i0 < inner; i0 += COLS_W) {
            int64_t w = min64(COLS_W, inner - i0);
            if (f64) bwd_cols_f64(dtype, dy, x, (const double *)lse, dx, o, i0, w, n, inner, scale, log);
            else bwd_cols_f32(dtype, dy, x, (const float *)lse, dx, o, i0, w, n, inner, (float)scale, log);
        }
    return FK_OK;
}
