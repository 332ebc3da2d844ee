/* GELU forward and backward on the CPU, optionally with a fused bias.
 *
 * Napkin math: elementwise, 1 read + 1 write per element forward, 2 reads + 1 write backward; at
 * ~35 vector ops per 16 lanes (one exp, one divide, a degree-7 polynomial for erfc) a Zen 4 core
 * does ~1.5 cycles an element, so 2^22 fp32 elements take ~2.5 ms on one core and the DRAM traffic
 * (32 MiB) is not the limit: op count is.
 * The backward optionally also writes y = gelu(x + b) (FusedMLP's backward, D-131): the forward's
 * vector bodies on the same vectors, so bit for bit the forward's values.
 * fp32 / fp16 / bf16: fp32 vector bodies (vec.h, AVX-512 / AVX2 / portable picked at run time),
 * fp16 / bf16 converted in registers. fp64: scalar libm, so gradcheck can run.
 * Rows are walked in column chunks of FK_CHUNK so the bias chunk is loaded once per tile and its
 * gradient accumulates in stack buffers without any allocation (fp32 over FK_TILE_ROWS rows, then
 * fp64). Tiles go to the caller's threads in contiguous runs (fk_parallel_for), whole columns when
 * the bias gradient is summed, so results do not depend on the thread count.
 */
#include "vec.h"

static fk_status check_args(const char *op, int64_t rows, int64_t cols, fk_dtype dtype) {
    if (rows < 0 || cols < 0) return fk_fail(FK_ERR_VALUE, "%s: negative size (%lld, %lld)", op,
                                             (long long)rows, (long long)cols);
    return fk_cpu_check_dtype(dtype, op);
}

/* The (rows, cols) array is walked in tiles of FK_CHUNK columns by row_block rows, numbered
 * row-block-major, so threads take contiguous runs of memory. A tile loads its bias chunk once, so
 * tiles span FK_TILE_ROWS rows (one row a tile: fp32 bias forward (2048, 1024) 13.2-13.5 ms on one
 * thread, against 10.4-11.8). A backward with dbias takes whole columns (row_block = rows): each
 * tile then holds its columns' complete sums, written once, and the result does not depend on the
 * thread count (but uses at most cols / FK_CHUNK threads). */
#define FK_TILE_ROWS 32

typedef struct {
    const void *dy, *x, *bias;
    void *out, *dbias, *y; /* y: backward's optional second output, gelu(x + b) */
    int64_t rows, cols, chunks, row_block;
    int approximate, isa;
    fk_dtype dtype;
} gelu_job;

typedef struct {
    int64_t r0, r1, c0, len;
} gelu_tile;

static gelu_tile tile_of(const gelu_job *j, int64_t t) {
    int64_t c0 = t % j->chunks * FK_CHUNK, r0 = t / j->chunks * j->row_block;
    return (gelu_tile){r0, r0 + j->row_block < j->rows ? r0 + j->row_block : j->rows, c0,
                       j->cols - c0 < FK_CHUNK ? j->cols - c0 : FK_CHUNK};
}

/* ---- fp32 vector bodies (vec.h), one per ISA ----
 * tanh form: x * sigmoid(2u) = x / (1 + exp(-2u)), u = sqrt(2 / pi) (x + 0.044715 x^3), as common.h's
 * scalar form (one exp, no cancellation for negative x). erf form: Phi(x) = erfc(-x / sqrt 2) / 2,
 * erfc(a) = exp(-a^2) t Q(t), t = 1 / (1 + 0.43 a), a = |.|, Q of degree 7 fitted for relative
 * error (8.5e-8 in exact arithmetic, 3.9e-7 evaluated in fp32, for a in [0, 9.6]), so the negative
 * tail keeps its digits; erfc(-a) = 2 - erfc(a); exp(-a^2) is also the gradient's Gaussian (one exp
 * forward and backward). The forward of a vector whose lanes all have |x| < 3 skips the exp and the
 * divide: Phi(x) = 1/2 + x R(x^2), R of degree 10 fitted for relative error (2.5e-8 exact; ~16 ops,
 * D-89). Measured against float64 (D-83): see docs/gelu.md. */
#define FK_SQRT_2_OVER_PI_F 0.7978845608028654f
#define FK_PHI_POLY_MAX 3.0f /* |v| up to which the erf forward takes Phi's polynomial */
#define FK_GELU_VEC(isa, attrs, lanes)                                                             \
    static inline attrs vf_##isa tanh_exp_##isa(vf_##isa v) { /* exp(-2u) */                       \
        const float k0 = -2.0f * FK_SQRT_2_OVER_PI_F, k1 = k0 * (float)FK_TANH_COEF;                \
        return exp_##isa(v * (k0 + k1 * (v * v)));                                                  \
    }                                                                                               \
    /* erfc(-v / sqrt 2) (twice Phi(v)) into *cdf2 and exp(-v^2 / 2) into *gauss */              \
    static inline attrs void erfc_##isa(vf_##isa v, vf_##isa *cdf2, vf_##isa *gauss) {             \
        const vf_##isa zero = {0};                                                                  \
        vf_##isa z = v * -(float)FK_SQRT1_2;                                                        \
        vf_##isa a = (vf_##isa)((vi_##isa)z & 0x7fffffff);                                          \
        vf_##isa t = 1.0f / (1.0f + 0.43f * a);                                                     \
        vf_##isa q = zero + 7.367143829e-02f;                                                       \
        q = q * t - 3.102255751e-01f;                                                               \
        q = q * t + 3.834578417e-01f;                                                               \
        q = q * t - 8.550342482e-02f;                                                               \
        q = q * t + 2.467296075e-01f;                                                               \
        q = q * t + 2.049851467e-01f;                                                               \
        q = q * t + 2.443700912e-01f;                                                               \
        q = q * t + 2.425149514e-01f;                                                               \
        vf_##isa g = exp_##isa(v * -0.5f * v), e = t * q * g; /* erfc(|z|) */                      \
        *cdf2 = select_##isa(z < 0, 2.0f - e, e);                                                   \
        *gauss = g;                                                                                 \
    }                                                                                               \
    static inline attrs vf_##isa gelu_##isa(vf_##isa v, int approximate) {                         \
        if (approximate) return v / (1.0f + tanh_exp_##isa(v));                                     \
        vf_##isa a = (vf_##isa)((vi_##isa)v & 0x7fffffff);                                          \
        if (!vany_##isa(a >= FK_PHI_POLY_MAX)) { /* Phi(v) = 1/2 + v R(v^2) */                      \
            vf_##isa u = v * v, r = u * 5.1781624759e-13f - 3.9027775929e-11f;                      \
            r = r * u + 1.4264571041e-09f;                                                          \
            r = r * u - 3.4404783919e-08f;                                                          \
            r = r * u + 6.2751806447e-07f;                                                          \
            r = r * u - 9.2947526588e-06f;                                                          \
            r = r * u + 1.1504063871e-04f;                                                          \
            r = r * u - 1.1866619063e-03f;                                                          \
            r = r * u + 9.9728909835e-03f;                                                          \
            r = r * u - 6.6490045657e-02f;                                                          \
            r = r * u + 3.9894222348e-01f;                                                          \
            return v * (v * r + 0.5f);                                                              \
        }                                                                                           \
        vf_##isa c2, g;                                                                             \
        erfc_##isa(v, &c2, &g);                                                                     \
        return 0.5f * v * c2;                                                                       \
    }                                                                                               \
    static inline attrs vf_##isa gelu_grad_##isa(vf_##isa v, int approximate) {                    \
        if (approximate) { /* s (1 + 2u' x e s), s = 1 / (1 + e) */                                 \
            const float d0 = 2.0f * FK_SQRT_2_OVER_PI_F, d1 = 3.0f * (float)FK_TANH_COEF * d0;      \
            vf_##isa e = tanh_exp_##isa(v), s = 1.0f / (1.0f + e);                                  \
            return s * (v * (d0 + d1 * (v * v)) * (e * s) + 1.0f);                                  \
        }                                                                                           \
        vf_##isa c2, g;                                                                             \
        erfc_##isa(v, &c2, &g);                                                                     \
        return 0.5f * c2 + v * ((float)FK_INV_SQRT_2PI * g);                                        \
    }                                                                                               \
                                                                                                    \
    /* rows [r0, r1) of columns [c0, c0 + len): y = gelu(x + b), b the tile's bias (0 padded) */   \
    static attrs void gelu_fwd_tile_##isa(const gelu_job *j, gelu_tile tile, const float *b) {     \
        const fk_dtype dt = j->dtype;                                                               \
        const int ap = j->approximate;                                                              \
        int64_t full = tile.len / lanes * lanes, rest = tile.len - full;                            \
        for (int64_t r = tile.r0; r < tile.r1; r++) {                                               \
            int64_t at = r * j->cols + tile.c0;                                                     \
            for (int64_t i = 0; i < full; i += lanes) {                                             \
                vf_##isa v = vload_##isa(dt, j->x, at + i) + *(const vf_##isa *)(b + i);      \
                vstore_##isa(dt, gelu_##isa(v, ap), j->out, at + i);             \
            }                                                                                       \
            if (rest) {                                                                             \
                vf_##isa v = vload_part_##isa(dt, j->x, at + full, rest, 0.0f);               \
                v = gelu_##isa(v + *(const vf_##isa *)(b + full), ap);                  \
                vstore_part_##isa(dt, v, j->out, at + full, rest);                            \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
                                                                                                    \
    /* dx = dy * gelu'(x + b) (and y = gelu(x + b), the forward's vectors and code, when j->y); */ \
    /* with dbias, column sums in fp32 over FK_TILE_ROWS rows, then fp64 */                        \
    static attrs void gelu_bwd_tile_##isa(const gelu_job *j, gelu_tile tile, const float *b,       \
                                          double *sum) {                                            \
        const fk_dtype dt = j->dtype;                                                               \
        const int ap = j->approximate;                                                              \
        float acc[FK_CHUNK] __attribute__((aligned(64)));                                           \
        int64_t full = tile.len / lanes * lanes, rest = tile.len - full;                            \
        int64_t padded = full + (rest ? lanes : 0);                                                 \
        for (int64_t r0 = tile.r0; r0 < tile.r1; r0 += FK_TILE_ROWS) {                              \
            int64_t r1 = r0 + FK_TILE_ROWS < tile.r1 ? r0 + FK_TILE_ROWS : tile.r1;                 \
            if (sum) memset(acc, 0, (size_t)padded * sizeof(float));                                \
            for (int64_t r = r0; r < r1; r++) {                                                     \
                int64_t at = r * j->cols + tile.c0;                                                 \
                for (int64_t i = 0; i < full; i += lanes) {                                         \
                    vf_##isa v = vload_##isa(dt, j->x, at + i) + *(const vf_##isa *)(b + i);  \
                    if (j->y) vstore_##isa(dt, gelu_##isa(v, ap), j->y, at + i);                    \
                    vf_##isa d = vload_##isa(dt, j->dy, at + i) * gelu_grad_##isa(v, ap); \
                    vstore_##isa(dt, d, j->out, at + i);                                      \
                    if (sum) *(vf_##isa *)(acc + i) += d;                                           \
                }                                                                                   \
                if (rest) {                                                                         \
                    vf_##isa v = vload_part_##isa(dt, j->x, at + full, rest, 0.0f);           \
                    vf_##isa g = vload_part_##isa(dt, j->dy, at + full, rest, 0.0f);          \
                    v = v + *(const vf_##isa *)(b + full);                                          \
                    if (j->y) vstore_part_##isa(dt, gelu_##isa(v, ap), j->y, at + full, rest);      \
                    vf_##isa d = g * gelu_grad_##isa(v, ap);                                        \
                    vstore_part_##isa(dt, d, j->out, at + full, rest);                        \
                    if (sum) *(vf_##isa *)(acc + full) += d;                                        \
                }                                                                                   \
            }                                                                                       \
            if (sum)                                                                                \
                for (int64_t i = 0; i < tile.len; i++) sum[i] += acc[i];                            \
        }                                                                                           \
    }

/* GELU in place over n fp32 values (matmul.c's epilogue; its scalar libm form took ~0.5 ms of the
 * 1.9 ms of a (512, 512) x (512, 512)^T linear + GELU on 2 threads) */
#define FK_GELU_ROW(isa, attrs, lanes)                                                             \
    static attrs void gelu_row_##isa(float *x, int64_t n, int ap) {                               \
        int64_t full = n / lanes * lanes;                                                           \
        for (int64_t i = 0; i < full; i += lanes)                                                   \
            vstore_##isa(FK_FLOAT32, gelu_##isa(vload_##isa(FK_FLOAT32, x, i), ap), x, i);          \
        if (full < n)                                                                               \
            vstore_part_##isa(FK_FLOAT32, gelu_##isa(vload_part_##isa(FK_FLOAT32, x, full, n - full, 0.0f), ap), \
                              x, full, n - full);                                                   \
    }

FK_GELU_VEC(generic, FK_ATTRS_GENERIC, 4)
FK_GELU_ROW(generic, FK_ATTRS_GENERIC, 4)
#if FK_X86
FK_GELU_VEC(avx2, FK_ATTRS_AVX2, 8)
FK_GELU_ROW(avx2, FK_ATTRS_AVX2, 8)
FK_GELU_VEC(avx512, FK_ATTRS_AVX512, 16)
FK_GELU_ROW(avx512, FK_ATTRS_AVX512, 16)
#endif

void fk_cpu_gelu_f32_inplace(float *x, int64_t n, int approximate, int isa) {
#if FK_X86
    if (isa == FK_ISA_AVX512) {
        gelu_row_avx512(x, n, approximate);
        return;
    }
    if (isa == FK_ISA_AVX2) {
        gelu_row_avx2(x, n, approximate);
        return;
    }
#endif
    (void)isa;
    gelu_row_generic(x, n, approximate);
}

static void forward_tile(const gelu_job *j, gelu_tile tile) {
    int64_t c0 = tile.c0, len = tile.len, cols = j->cols;
    if (j->dtype == FK_FLOAT64) {
        const double *b = j->bias ? (const double *)j->bias + c0 : NULL;
        for (int64_t r = tile.r0; r < tile.r1; r++) {
            const double *xr = (const double *)j->x + r * cols + c0;
            double *yr = (double *)j->out + r * cols + c0;
            for (int64_t i = 0; i < len; i++) yr[i] = gelu_f64(xr[i] + (b ? b[i] : 0.0), j->approximate);
        }
        return;
    }
    float b[FK_CHUNK + 16] __attribute__((aligned(64))) = {0};
    if (j->bias) fk_load_f32(j->dtype, j->bias, c0, len, b);
#if FK_X86
    if (j->isa == FK_ISA_AVX512) gelu_fwd_tile_avx512(j, tile, b);
    else if (j->isa == FK_ISA_AVX2) gelu_fwd_tile_avx2(j, tile, b);
    else
#endif
        gelu_fwd_tile_generic(j, tile, b);
}

static void backward_tile(const gelu_job *j, gelu_tile tile) {
    int64_t c0 = tile.c0, len = tile.len, cols = j->cols;
    if (j->dtype == FK_FLOAT64) {
        const double *b = j->bias ? (const double *)j->bias + c0 : NULL;
        double sum[FK_CHUNK] = {0};
        for (int64_t r = tile.r0; r < tile.r1; r++) {
            const double *xr = (const double *)j->x + r * cols + c0;
            const double *gr = (const double *)j->dy + r * cols + c0;
            double *dr = (double *)j->out + r * cols + c0;
            double *yr = j->y ? (double *)j->y + r * cols + c0 : NULL;
            for (int64_t i = 0; i < len; i++) {
                double v = xr[i] + (b ? b[i] : 0.0);
                if (yr) yr[i] = gelu_f64(v, j->approximate);
                dr[i] = gr[i] * gelu_grad_f64(v, j->approximate);
                sum[i] += dr[i];
            }
        }
        if (j->dbias) memcpy((double *)j->dbias + c0, sum, (size_t)len * sizeof(double));
        return;
    }
    float b[FK_CHUNK + 16] __attribute__((aligned(64))) = {0};
    double sum[FK_CHUNK] = {0}; /* a long column sum in fp32 would lose to torch's cascade */
    double *s = j->dbias ? sum : NULL;
    if (j->bias) fk_load_f32(j->dtype, j->bias, c0, len, b);
#if FK_X86
    if (j->isa == FK_ISA_AVX512) gelu_bwd_tile_avx512(j, tile, b, s);
    else if (j->isa == FK_ISA_AVX2) gelu_bwd_tile_avx2(j, tile, b, s);
    else
#endif
        gelu_bwd_tile_generic(j, tile, b, s);
    if (j->dbias) {
        for (int64_t i = 0; i < len; i++) b[i] = (float)sum[i];
        fk_store_f32(j->dtype, b, c0, len, j->dbias);
    }
}

/* A thread's run of tiles: backward when the job has dy. */
static void run_tiles(void *arg, int64_t begin, int64_t end) {
    const gelu_job *j = (const gelu_job *)arg;
    for (int64_t t = begin; t < end; t++) {
        if (j->dy) backward_tile(j, tile_of(j, t));
        else forward_tile(j, tile_of(j, t));
    }
}

static void split_tiles(gelu_job *j, int threads) {
    j->chunks = (j->cols + FK_CHUNK - 1) / FK_CHUNK;
    /* with dbias one block of all rows, even of none (its sums, zeros, are still written) */
    int64_t row_blocks = j->dbias ? 1 : (j->rows + j->row_block - 1) / j->row_block;
    int64_t tile = j->row_block * (j->cols < FK_CHUNK ? j->cols : FK_CHUNK);
    fk_parallel_for(threads, row_blocks * j->chunks, fk_min_items(tile), run_tiles, j);
}

fk_status fk_cpu_gelu_fwd(const void *x, const void *bias, void *y, int64_t rows, int64_t cols,
                          int approximate, fk_dtype dtype, int threads) {
    fk_status status = check_args("gelu", rows, cols, dtype);
    if (status != FK_OK) return status;
    gelu_job j = {NULL, x, bias, y, NULL, NULL, rows, cols, 0, FK_TILE_ROWS, approximate, fk_cpu_isa(), dtype};
    split_tiles(&j, threads);
    return FK_OK;
}

fk_status fk_cpu_gelu_bwd(const void *dy, const void *x, const void *bias, void *dx, void *dbias,
                          void *y, int64_t rows, int64_t cols, int approximate, fk_dtype dtype,
                          int threads) {
    fk_status status = check_args("gelu_backward", rows, cols, dtype);
    if (status != FK_OK) return status;
    gelu_job j = {dy, x, bias, dx, dbias, y, rows, cols, 0, dbias ? rows : FK_TILE_ROWS, approximate,
                  fk_cpu_isa(), dtype};
    split_tiles(&j, threads);
    return FK_OK;
}
