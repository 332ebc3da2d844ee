/* softmax.c's vector paths (fp32 / fp16 / bf16, fp32 arithmetic in vec.h's types, one body per ISA,
 * picked at run time; FASTKERN_CPU_ISA forces one). Included by softmax.c only.
 *
 * rows (inner == 1), one row a call; a causal mask only shortens the row to its L unmasked keys:
 *   forward  pass 1 m = max(x * scale); pass 2 e = exp(x * scale - m), s = sum e (fp32 lanes per
 *            FK_CHUNK keys, chunks summed in fp64), e kept (fp32: in y; 16-bit: a per-thread
 *            buffer); pass 3 y = e / s, or log: x * scale - m - log s (no exp); masked keys 0 / -inf.
 *   backward pass 1 p = exp(x * scale - m) (m the forward's saved row max), z = sum p, a = sum dy p
 *            (log: sum dy over all n keys), p kept as in the forward; pass 2 dx from the kept p:
 *            one exp an element, not two (D-84). z and a: fp32 lanes (TwoSum-compensated for fp32);
 *            dx = scale p / z (dy - c), c = a / z, in fp64 for fp32 (fp32's roundings there were over 2x
 *            torch's error where dy - c cancels, at a row's dominant key), else in fp32 with c held
 *            as a pair c_hi + c_lo; log: dx = scale (dy - p (a / z)).
 * cols (inner > 1): a tile of FK_TILE adjacent columns of one slab, the same passes over its n keys
 *   with one accumulator lane per column (sums flushed to fp64 every FK_COLS_FLUSH keys); the tile
 *   (n x 32 floats: 1 MiB at n = 8192) stays in L2 between passes.
 * Napkin math: fp32 (4096, 1024) forward reads 16 MiB and writes 16 MiB; one exp (~15 vector ops a
 * 16-lane vector with AVX-512) and ~8 other ops an element put it at ~1 cycle an element a core, so
 * the exps, not DRAM, set the time on this 2-core machine (~2 ms on one core, ~1 ms on two).
 * NaN / +inf: the max skips NaN, and exp(NaN) (or inf - inf) then makes s, and the row, NaN, as
 * torch's row turns NaN. A row with every key masked is NaN (torch: softmax of all -inf).
 */
#define FK_KEEP 16384     /* keys a 16-bit row keeps on the stack; longer rows: one malloc a run */
#define FK_COLS_FLUSH 256 /* keys a column's fp32 sum takes before it joins the fp64 total */

/* Keys of the row `row` left unmasked by the causal mask (all n without one). */
static inline int64_t row_valid(const softmax_job *j, int64_t row) {
    if (j->causal_sq == 0) return j->n;
    int64_t len = row % j->causal_sq + 1 + j->n - j->causal_sq;
    return len < 0 ? 0 : (len > j->n ? j->n : len);
}

/* dst[at + i] = value for i < len (the masked keys of a row). */
static void fill_keys(fk_dtype dtype, void *dst, int64_t at, int64_t len, float value) {
    float buf[FK_CHUNK];
    for (int i = 0; i < FK_CHUNK; i++) buf[i] = value;
    for (int64_t i = 0; i < len; i += FK_CHUNK)
        fk_store_f32(dtype, buf, at + i, len - i < FK_CHUNK ? len - i : FK_CHUNK, dst);
}

/* Does a call of this job keep its exps in a scratch buffer (16-bit rows: softmax forward, log
 * backward; fp32 keeps them in its output)? */
static inline int needs_scratch(const softmax_job *j) {
    return j->inner == 1 && j->dtype != FK_FLOAT32 && (j->dy ? j->is_log : !j->is_log);
}

#define FK_SOFTMAX_VEC(isa, attrs, lanes)                                                          \
    static inline attrs vi_##isa head_##isa(int64_t len) { /* lanes < len */                       \
        vi_##isa iota;                                                                              \
        for (int l = 0; l < lanes; l++) iota[l] = l;                                                \
        return iota < (int32_t)len;                                                                 \
    }                                                                                               \
    /* x[at + i] * scale, i < lanes (i < len: a tail; the other lanes `fill`) */                   \
    static inline attrs vf_##isa xs_##isa(fk_dtype dt, const void *x, int64_t at, int64_t len,     \
                                          float scale, float fill) {                                \
        const vf_##isa zero = {0};                                                                  \
        if (len >= lanes) return vload_##isa(dt, x, at) * scale;                                    \
        vf_##isa v = vload_part_##isa(dt, x, at, len, 0.0f) * scale;                                \
        return select_##isa(head_##isa(len), v, zero + fill);                                       \
    }                                                                                               \
    static inline attrs void put_##isa(fk_dtype dt, vf_##isa v, void *p, int64_t at, int64_t len) { \
        if (len >= lanes) vstore_##isa(dt, v, p, at);                                               \
        else vstore_part_##isa(dt, v, p, at, len);                                                  \
    }                                                                                               \
                                                                                                    \
    static attrs void softmax_fwd_rows_##isa(const softmax_job *j, int64_t row, float *scratch) {  \
        const vf_##isa zero = {0};                                                                  \
        const fk_dtype dt = j->dtype;                                                               \
        const float scale = (float)j->scale;                                                        \
        int64_t n = j->n, len = row_valid(j, row), at = row * n;                                    \
        if (len == 0) {                                                                             \
            fill_keys(dt, j->out, at, n, NAN);                                                      \
            if (j->row_max) ((float *)j->row_max)[row] = -INFINITY;                                 \
            return;                                                                                 \
        }                                                                                           \
        vf_##isa vmax = zero - INFINITY;                                                            \
        for (int64_t i = 0; i < len; i += lanes) {                                                  \
            vf_##isa v = xs_##isa(dt, j->in, at + i, len - i, scale, -INFINITY);                     \
            vmax = select_##isa(v > vmax, v, vmax);                                                 \
        }                                                                                           \
        float m = -INFINITY;                                                                        \
        for (int l = 0; l < lanes; l++) m = vmax[l] > m ? vmax[l] : m;                              \
        float *keep = j->is_log ? NULL : dt == FK_FLOAT32 ? (float *)j->out + at : scratch;         \
        double s = 0.0;                                                                             \
        for (int64_t j0 = 0; j0 < len; j0 += FK_CHUNK) {                                            \
            int64_t end = len - j0 < FK_CHUNK ? len : j0 + FK_CHUNK;                                \
            vf_##isa acc = zero;                                                                    \
            for (int64_t i = j0; i < end; i += lanes) {                                             \
                vf_##isa e = exp_##isa(xs_##isa(dt, j->in, at + i, len - i, scale, -INFINITY) - m);  \
                acc += e;                                                                           \
                if (keep) put_##isa(FK_FLOAT32, e, keep, i, len - i);                               \
            }                                                                                       \
            for (int l = 0; l < lanes; l++) s += acc[l];                                            \
        }                                                                                           \
        if (j->row_max) ((float *)j->row_max)[row] = m;                                             \
        if (j->is_log) {                                                                            \
            float ls = (float)log(s);                                                               \
            for (int64_t i = 0; i < len; i += lanes)                                                \
                put_##isa(dt, xs_##isa(dt, j->in, at + i, len - i, scale, 0.0f) - m - ls, j->out,    \
                          at + i, len - i);                                                         \
        } else {                                                                                    \
            float inv = (float)(1.0 / s);                                                           \
            for (int64_t i = 0; i < len; i += lanes) {                                              \
                vf_##isa e = keep ? xs_##isa(FK_FLOAT32, keep, i, len - i, 1.0f, 0.0f)              \
                                  : exp_##isa(xs_##isa(dt, j->in, at + i, len - i, scale, 0.0f) - m); \
                put_##isa(dt, e * inv, j->out, at + i, len - i);                                    \
            }                                                                                       \
        }                                                                                           \
        fill_keys(dt, j->out, at + len, n - len, j->is_log ? -INFINITY : 0.0f);                     \
    }                                                                                               \
                                                                                                    \
    /* dx from the forward's output y (D-87). fp32: exact products and fp64 sums, dy's weights y      \
     * normalised by z = sum y (log: sum exp y), the last step in fp64; 16-bit: torch's formula (z =   \
     * 1: our y then mostly is torch's, bit for bit, and so is the error it carries), fp32 lanes per   \
     * FK_CHUNK keys (16-bit products are exact in fp32) joined in fp64, the last step in fp32 with   \
     * c = a / z held as c_hi + c_lo. */                                                            \
    static attrs void softmax_bwd_rows_##isa(const softmax_job *j, int64_t row, float *scratch) {  \
        const vf_##isa zero = {0};                                                                  \
        const fk_dtype dt = j->dtype;                                                               \
        const int log = j->is_log;                                                                  \
        const float fill = log ? -INFINITY : 0.0f; /* a tail lane's y: exp(-inf) = 0 */             \
        int64_t n = j->n, len = row_valid(j, row), at = row * n;                                    \
        float *keep = !log ? NULL : dt == FK_FLOAT32 ? (float *)j->out + at : scratch; /* exp y */  \
        double z = 1.0, a = 0.0;                                                                    \
        if (dt == FK_FLOAT32) {                                                                     \
            vd_##isa zacc = {0}, aacc = {0};                                                        \
            for (int64_t i = 0; i < len; i += lanes) {                                              \
                vf_##isa e = xs_##isa(dt, j->in, at + i, len - i, 1.0f, fill);                      \
                vf_##isa g = xs_##isa(dt, j->dy, at + i, len - i, 1.0f, 0.0f);                      \
                if (log) {                                                                          \
                    e = exp_##isa(e);                                                               \
                    put_##isa(FK_FLOAT32, e, keep, i, len - i);                                     \
                }                                                                                   \
                vd_##isa ed = __builtin_convertvector(e, vd_##isa);                                 \
                vd_##isa gd = __builtin_convertvector(g, vd_##isa);                                 \
                zacc += ed;                                                                         \
                aacc += log ? gd : gd * ed;                                                         \
            }                                                                                       \
            z = 0.0;                                                                                \
            for (int l = 0; l < lanes; l++) z += zacc[l], a += aacc[l];                             \
        } else {                                                                                    \
            for (int64_t j0 = 0; j0 < len; j0 += FK_CHUNK) {                                        \
                int64_t end = len - j0 < FK_CHUNK ? len : j0 + FK_CHUNK;                            \
                vf_##isa aacc = zero;                                                               \
                for (int64_t i = j0; i < end; i += lanes) {                                         \
                    vf_##isa g = xs_##isa(dt, j->dy, at + i, len - i, 1.0f, 0.0f);                  \
                    if (log) {                                                                      \
                        put_##isa(FK_FLOAT32, exp_##isa(xs_##isa(dt, j->in, at + i, len - i, 1.0f, fill)), \
                                  keep, i, len - i);                                                \
                        aacc += g;                                                                  \
                    } else aacc += g * xs_##isa(dt, j->in, at + i, len - i, 1.0f, fill);            \
                }                                                                                   \
                for (int l = 0; l < lanes; l++) a += aacc[l];                                       \
            }                                                                                       \
        }                                                                                           \
        if (log) /* masked keys too: their output is -inf, a constant */                            \
            for (int64_t i = len; i < n; i += FK_CHUNK) {                                           \
                float gb[FK_CHUNK];                                                                 \
                int64_t c = n - i < FK_CHUNK ? n - i : FK_CHUNK;                                    \
                fk_load_f32(dt, j->dy, at + i, c, gb);                                              \
                for (int64_t k = 0; k < c; k++) a += gb[k];                                         \
            }                                                                                       \
        /* softmax: dx = k y (dy - c), k = scale / z; log: dx = scale (dy - e c); c = a / z */       \
        double c = a / z, kd = j->scale / z;                                                        \
        float scale = (float)j->scale, k = (float)kd, c_hi = (float)c, c_lo = (float)(c - c_hi);    \
        for (int64_t i = 0; i < len; i += lanes) {                                                  \
            vf_##isa e = keep ? xs_##isa(FK_FLOAT32, keep, i, len - i, 1.0f, 0.0f)                  \
                              : xs_##isa(dt, j->in, at + i, len - i, 1.0f, 0.0f);                   \
            vf_##isa g = xs_##isa(dt, j->dy, at + i, len - i, 1.0f, 0.0f), d;                       \
            if (dt == FK_FLOAT32) { /* fp32's ~4 roundings here were over 2x torch's error (D-87) */ \
                vd_##isa ed = __builtin_convertvector(e, vd_##isa);                                 \
                vd_##isa gd = __builtin_convertvector(g, vd_##isa);                                 \
                d = __builtin_convertvector(log ? j->scale * (gd - ed * c) : kd * ed * (gd - c), vf_##isa); \
            } else if (log) d = scale * (g - e * c_hi);                                             \
            else d = k * e * ((g - c_hi) - c_lo);                                                   \
            put_##isa(dt, d, j->out, at + i, len - i);                                              \
        }                                                                                           \
        fill_keys(dt, j->out, at + len, n - len, 0.0f); /* masked keys: no gradient */              \
    }                                                                                               \
                                                                                                    \
    /* Columns [i0, i0 + w) of slab o (block b), w <= FK_TILE, one lane a column. */               \
    static attrs void softmax_fwd_cols_##isa(const softmax_job *j, int64_t b, float *scratch) {    \
        enum { kVecs = FK_TILE / lanes };                                                           \
        const vf_##isa zero = {0};                                                                  \
        const fk_dtype dt = j->dtype;                                                               \
        const float scale = (float)j->scale;                                                        \
        int64_t n = j->n, inner = j->inner, i0 = b % j->tiles * FK_TILE, o = b / j->tiles;          \
        int64_t w = inner - i0 < FK_TILE ? inner - i0 : FK_TILE, nv = (w + lanes - 1) / lanes;      \
        int64_t at0 = o * n * inner + i0;                                                           \
        vf_##isa m[kVecs], acc[kVecs], f[kVecs];                                                    \
        double s[FK_TILE] = {0};                                                                    \
        (void)scratch;                                                                              \
        for (int v = 0; v < nv; v++) m[v] = zero - INFINITY;                                        \
        for (int64_t key = 0; key < n; key++)                                                       \
            for (int v = 0; v < nv; v++) {                                                          \
                vf_##isa x = xs_##isa(dt, j->in, at0 + key * inner + v * lanes, w - v * lanes,      \
                                      scale, -INFINITY);                                            \
                m[v] = select_##isa(x > m[v], x, m[v]);                                             \
            }                                                                                       \
        int keep = !j->is_log && dt == FK_FLOAT32; /* fp32 p kept in y */                          \
        for (int64_t k0 = 0; k0 < n; k0 += FK_COLS_FLUSH) {                                         \
            int64_t k1 = n - k0 < FK_COLS_FLUSH ? n : k0 + FK_COLS_FLUSH;                           \
            for (int v = 0; v < nv; v++) acc[v] = zero;                                             \
            for (int64_t key = k0; key < k1; key++)                                                 \
                for (int v = 0; v < nv; v++) {                                                      \
                    int64_t at = at0 + key * inner + v * lanes, left = w - v * lanes;               \
                    vf_##isa p = exp_##isa(xs_##isa(dt, j->in, at, left, scale, -INFINITY) - m[v]); \
                    acc[v] += p;                                                                    \
                    if (keep) put_##isa(FK_FLOAT32, p, j->out, at, left);                           \
                }                                                                                   \
            for (int c = 0; c < w; c++) s[c] += acc[c / lanes][c % lanes];                          \
        }                                                                                           \
        for (int c = 0; c < nv * lanes; c++) { /* softmax: f = 1 / s; log: f = log s */            \
            double sc = c < w ? s[c] : 1.0;                                                         \
            f[c / lanes][c % lanes] = j->is_log ? (float)log(sc) : (float)(1.0 / sc);               \
        }                                                                                           \
        if (j->row_max)                                                                             \
            for (int c = 0; c < w; c++) ((float *)j->row_max)[o * inner + i0 + c] = m[c / lanes][c % lanes]; \
        for (int64_t key = 0; key < n; key++)                                                       \
            for (int v = 0; v < nv; v++) {                                                          \
                int64_t at = at0 + key * inner + v * lanes, left = w - v * lanes;                   \
                vf_##isa out;                                                                       \
                if (j->is_log) out = xs_##isa(dt, j->in, at, left, scale, 0.0f) - m[v] - f[v];      \
                else out = f[v] * (keep ? xs_##isa(FK_FLOAT32, j->out, at, left, 1.0f, 0.0f)        \
                                        : exp_##isa(xs_##isa(dt, j->in, at, left, scale, 0.0f) - m[v])); \
                put_##isa(dt, out, j->out, at, left);                                               \
            }                                                                                       \
    }                                                                                               \
                                                                                                    \
    /* The backward of those columns from y, the rows kernel's passes and numerics one lane a      \
     * column (16-bit: z = 1); fp32 log keeps exp y in dx, 16-bit log recomputes it. */             \
    static attrs void softmax_bwd_cols_##isa(const softmax_job *j, int64_t b, float *scratch) {    \
        enum { kVecs = FK_TILE / lanes };                                                           \
        const vf_##isa zero = {0};                                                                  \
        const vd_##isa zd = {0};                                                                    \
        const fk_dtype dt = j->dtype;                                                               \
        const int log = j->is_log, keep = log && dt == FK_FLOAT32;                                  \
        const float fill = log ? -INFINITY : 0.0f;                                                  \
        int64_t n = j->n, inner = j->inner, i0 = b % j->tiles * FK_TILE, o = b / j->tiles;          \
        int64_t w = inner - i0 < FK_TILE ? inner - i0 : FK_TILE, nv = (w + lanes - 1) / lanes;      \
        int64_t at0 = o * n * inner + i0;                                                           \
        double z[FK_TILE] = {0}, a[FK_TILE] = {0};                                                  \
        (void)scratch;                                                                              \
        for (int64_t k0 = 0; k0 < n; k0 += FK_COLS_FLUSH) {                                         \
            int64_t k1 = n - k0 < FK_COLS_FLUSH ? n : k0 + FK_COLS_FLUSH;                           \
            vf_##isa aacc[kVecs];                                                                   \
            vd_##isa zaccd[kVecs], aaccd[kVecs];                                                    \
            for (int v = 0; v < nv; v++) aacc[v] = zero, zaccd[v] = aaccd[v] = zd;                  \
            for (int64_t key = k0; key < k1; key++)                                                 \
                for (int v = 0; v < nv; v++) {                                                      \
                    int64_t at = at0 + key * inner + v * lanes, left = w - v * lanes;               \
                    vf_##isa e = xs_##isa(dt, j->in, at, left, 1.0f, fill);                         \
                    vf_##isa g = xs_##isa(dt, j->dy, at, left, 1.0f, 0.0f);                         \
                    if (log) e = exp_##isa(e);                                                      \
                    if (keep) put_##isa(FK_FLOAT32, e, j->out, at, left);                           \
                    if (dt == FK_FLOAT32) {                                                         \
                        vd_##isa ed = __builtin_convertvector(e, vd_##isa);                         \
                        vd_##isa gd = __builtin_convertvector(g, vd_##isa);                         \
                        zaccd[v] += ed;                                                             \
                        aaccd[v] += log ? gd : gd * ed;                                             \
                    } else aacc[v] += log ? g : g * e;                                              \
                }                                                                                   \
            for (int c = 0; c < w; c++)                                                             \
                z[c] += zaccd[c / lanes][c % lanes],                                                \
                a[c] += aaccd[c / lanes][c % lanes] + aacc[c / lanes][c % lanes];                   \
        }                                                                                           \
        /* per column: c = a / z; fp32: k = scale / z and c in fp64 lanes; 16-bit: k, c_hi, c_lo */ \
        vf_##isa k[kVecs], c_hi[kVecs], c_lo[kVecs];                                                \
        vd_##isa kd[kVecs], cd[kVecs];                                                              \
        for (int c = 0; c < nv * lanes; c++) {                                                      \
            double zc = c < w && dt == FK_FLOAT32 ? z[c] : 1.0, cc = c < w ? a[c] / zc : 0.0;       \
            float hi = (float)cc;                                                                   \
            kd[c / lanes][c % lanes] = j->scale / zc, cd[c / lanes][c % lanes] = cc;                \
            k[c / lanes][c % lanes] = (float)(j->scale / zc);                                       \
            c_hi[c / lanes][c % lanes] = hi, c_lo[c / lanes][c % lanes] = (float)(cc - hi);         \
        }                                                                                           \
        const float scale = (float)j->scale;                                                        \
        for (int64_t key = 0; key < n; key++)                                                       \
            for (int v = 0; v < nv; v++) {                                                          \
                int64_t at = at0 + key * inner + v * lanes, left = w - v * lanes;                   \
                vf_##isa e = keep ? xs_##isa(FK_FLOAT32, j->out, at, left, 1.0f, 0.0f)              \
                                  : xs_##isa(dt, j->in, at, left, 1.0f, fill);                      \
                vf_##isa g = xs_##isa(dt, j->dy, at, left, 1.0f, 0.0f), d;                          \
                if (log && !keep) e = exp_##isa(e);                                                 \
                if (dt == FK_FLOAT32) {                                                             \
                    vd_##isa ed = __builtin_convertvector(e, vd_##isa);                             \
                    vd_##isa gd = __builtin_convertvector(g, vd_##isa);                             \
                    d = __builtin_convertvector(log ? j->scale * (gd - ed * cd[v])                  \
                                                    : kd[v] * ed * (gd - cd[v]), vf_##isa);         \
                } else if (log) d = scale * (g - e * c_hi[v]);                                      \
                else d = k[v] * e * ((g - c_hi[v]) - c_lo[v]);                                      \
                put_##isa(dt, d, j->out, at, left);                                                 \
            }                                                                                       \
    }

FK_SOFTMAX_VEC(generic, FK_ATTRS_GENERIC, 4)
#if FK_X86
FK_SOFTMAX_VEC(avx2, FK_ATTRS_AVX2, 8)
FK_SOFTMAX_VEC(avx512, FK_ATTRS_AVX512, 16)
#endif

/* The kernel for this job's vector path, on the widest ISA the CPU runs (vec.h: fk_cpu_isa). */
static rows_fn pick_vec(const softmax_job *j) {
    int cols = j->inner > 1, isa = fk_cpu_isa();
#if FK_X86
    if (isa == FK_ISA_AVX512)
        return j->dy ? (cols ? softmax_bwd_cols_avx512 : softmax_bwd_rows_avx512)
                     : (cols ? softmax_fwd_cols_avx512 : softmax_fwd_rows_avx512);
    if (isa == FK_ISA_AVX2)
        return j->dy ? (cols ? softmax_bwd_cols_avx2 : softmax_bwd_rows_avx2)
                     : (cols ? softmax_fwd_cols_avx2 : softmax_fwd_rows_avx2);
#endif
    (void)isa;
    return j->dy ? (cols ? softmax_bwd_cols_generic : softmax_bwd_rows_generic)
                 : (cols ? softmax_fwd_cols_generic : softmax_fwd_rows_generic);
}
