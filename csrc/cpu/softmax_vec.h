/* softmax.c's vector paths (fp32 / fp16 / bf16, fp32 arithmetic in vec.h's types, one body per ISA,
 * picked at run time; FASTKERN_CPU_ISA forces one). Included by softmax.c only.
 *
 * rows (inner == 1), one row a call; a causal mask only shortens the row to its L unmasked keys:
 *   forward  pass 1 m = max(x * scale); pass 2 e = exp(x * scale - m), s = sum e (fp32 lanes per
 *            FK_SUM_VECS vectors, then fp64 lanes: with 512 keys a lane, the 4-lane and 8-lane
 *            paths' fp32 (3, 513) rows were over 2x torch's error in 45 and 8 of 300 draws; now 0,
 *            at the same speed), e kept (fp32: in y; 16-bit: a per-thread
 *            buffer); pass 3 y = e / s, or log: x * scale - m - log s (no exp); masked keys 0 / -inf.
 *   backward (D-87) from the forward's output y: pass 1 z = sum y (log: sum exp y, kept as the
 *            forward keeps e), a = sum dy y (log: sum dy over all n keys); pass 2 (the row is in L1)
 *            dx = k y ((dy - c_hi) - c_lo), k = scale / z, c = a / z held as a pair of floats (log:
 *            dx = scale (dy - exp y c)). fp32's z and a take exact products and fp64 sums: fp32 sums
 *            (8-key lanes into fp64, or FMA-exact products) put 4-44 rows in 2000 over 2x torch's
 *            error, where dy - c cancels at a row's dominant key.
 * cols (inner > 1): a block of up to FK_COLS_WIDTH adjacent columns of one slab, one accumulator
 *   lane per column (sums flushed to fp64 every FK_COLS_FLUSH keys). The forward: an online max and
 *   sum over its n keys, then the output with a second exp an element (16-bit: exp2 of one FMA,
 *   D-125); narrow blocks that keep their exps ran slower (D-125). The backward sums in chunks of
 *   keys fixed by n, added in order; with fewer blocks than FK_COLS_SPLIT_BLOCKS a thread, the
 *   threads share out the chunks (sums, then outputs), each reading whole key rows: split by
 *   columns, (8192, 256) dim 0 ran slower on 2 threads than on one (D-90).
 * Napkin math: fp32 (4096, 1024) forward reads 16 MiB and writes 16 MiB; one exp (~15 vector ops a
 * 16-lane vector with AVX-512) and ~8 other ops an element put it at ~1 cycle an element a core, so
 * the exps, not DRAM, set the time on this 2-core machine (~2 ms on one core, ~1 ms on two).
 * NaN / +inf: the max skips NaN, and exp(NaN) (or inf - inf) then makes s, and the row, NaN, as
 * torch's row turns NaN. A row with every key masked is NaN (torch: softmax of all -inf).
 */
#define FK_SUM_VECS 8     /* vectors of exps a forward's fp32 lanes sum before joining the fp64 total */
#define FK_KEEP 16384     /* keys a 16-bit row keeps on the stack; longer rows: one malloc a run */
#define FK_COLS_FLUSH 256 /* keys a column's fp32 sum takes before it joins the fp64 total */
#define FK_COLS_WIDTH 256 /* columns a block at most: per-column state of a few KiB stays in L1 */
#define FK_COLS_KEYS 16   /* keys of the forward's online max step: 16 x 1 KiB of fp32 keys in L1 */
#define FK_COLS_CHUNK 512 /* keys a column backward's partial sums take (a multiple of FK_COLS_FLUSH) */
#define FK_COLS_CHUNKS 64 /* chunks a column at most: longer columns take longer chunks */
#define FK_COLS_SPLIT_BLOCKS 4 /* column backwards of fewer blocks than 4 a thread share out chunks */

/* Keys a chunk of a column backward: fixed by n alone, so its sums do not depend on the threads. */
static inline int64_t cols_chunk_keys(int64_t n) {
    int64_t keys = FK_COLS_CHUNK;
    while (keys * FK_COLS_CHUNKS < n) keys *= 2;
    return keys;
}

/* Keys of the row `row` left unmasked by the causal mask (all n without one). */
static inline int64_t row_valid(const softmax_job *j, int64_t row) {
    if (j->causal_sq == 0) return j->n;
    int64_t len = row % j->causal_sq + 1 + j->n - j->causal_sq;
    return len < 0 ? 0 : (len > j->n ? j->n : len);
}

/* dst[at + i] = value for i < len (the masked keys of a row). */
static void fill_keys(fk_dtype dtype, void *dst, int64_t at, int64_t len, float value) {
    if (len <= 0) return; /* most rows: filling buf cost ~4% of a (256, 1024) fp32 backward */
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

/* The entry softmax.c calls for a kernel body `body(j, item, scratch, dtype, is_log)`, inlined once
 * per dtype and direction so that its loads, stores and tests of them are constants (the forward's
 * loop tested the dtype per vector before; D-91). */
#define FK_SPECIALIZE(attrs, entry, body)                                                          \
    static attrs void entry(const softmax_job *j, int64_t item, float *scratch) {                  \
        if (j->dtype == FK_FLOAT32) {                                                               \
            if (j->is_log) body(j, item, scratch, FK_FLOAT32, 1);                                   \
            else body(j, item, scratch, FK_FLOAT32, 0);                                             \
        } else if (j->dtype == FK_BFLOAT16) {                                                       \
            if (j->is_log) body(j, item, scratch, FK_BFLOAT16, 1);                                  \
            else body(j, item, scratch, FK_BFLOAT16, 0);                                            \
        } else {                                                                                    \
            if (j->is_log) body(j, item, scratch, FK_FLOAT16, 1);                                   \
            else body(j, item, scratch, FK_FLOAT16, 0);                                             \
        }                                                                                           \
    }

#define FK_SOFTMAX_VEC(isa, attrs, lanes)                                                           \
    static FK_INLINE attrs vi_##isa head_##isa(int64_t len) { /* lanes < len */                        \
        vi_##isa iota;                                                                              \
        for (int l = 0; l < lanes; l++) iota[l] = l;                                                \
        return iota < (int32_t)len;                                                                 \
    }                                                                                               \
    /* x[at + i] * scale, i < lanes (i < len: a tail; the other lanes `fill`) */                    \
    static FK_INLINE attrs vf_##isa xs_##isa(fk_dtype dt, const void *x, int64_t at, int64_t len,      \
                                          float scale, float fill) {                                \
        const vf_##isa zero = {0};                                                                  \
        if (len >= lanes) return vload_##isa(dt, x, at) * scale;                                    \
        vf_##isa v = vload_part_##isa(dt, x, at, len, 0.0f) * scale;                                \
        return select_##isa(head_##isa(len), v, zero + fill);                                       \
    }                                                                                               \
    static FK_INLINE attrs void put_##isa(fk_dtype dt, vf_##isa v, void *p, int64_t at, int64_t len) { \
        if (len >= lanes) vstore_##isa(dt, v, p, at);                                               \
        else vstore_part_##isa(dt, v, p, at, len);                                                  \
    }                                                                                               \
                                                                                                    \
    static inline __attribute__((always_inline)) attrs void fwd_rows_##isa(                         \
        const softmax_job *j, int64_t row, float *scratch, const fk_dtype dt, const int is_log) {   \
        const vf_##isa zero = {0};                                                                  \
        const float scale = (float)j->scale;                                                        \
        int64_t n = j->n, len = row_valid(j, row), at = row * n;                                    \
        if (len == 0) {                                                                             \
            fill_keys(dt, j->out, at, n, NAN);                                                      \
            if (j->row_max) ((float *)j->row_max)[row] = -INFINITY;                                 \
            return;                                                                                 \
        }                                                                                           \
        vf_##isa vmax = zero - INFINITY, vm[4] = {vmax, vmax, vmax, vmax};                          \
        int64_t i0 = 0;                                                                             \
        for (; i0 + 4 * lanes <= len; i0 += 4 * lanes) /* 4 chains of compare and select */         \
            for (int u = 0; u < 4; u++) {                                                           \
                vf_##isa v = vload_##isa(dt, j->in, at + i0 + u * lanes) * scale;                   \
                vm[u] = select_##isa(v > vm[u], v, vm[u]);                                          \
            }                                                                                       \
        for (int u = 0; u < 4; u++) vmax = select_##isa(vm[u] > vmax, vm[u], vmax);                 \
        for (int64_t i = i0; i < len; i += lanes) {                                                 \
            vf_##isa v = xs_##isa(dt, j->in, at + i, len - i, scale, -INFINITY);                    \
            vmax = select_##isa(v > vmax, v, vmax);                                                 \
        }                                                                                           \
        float m = vmax_##isa(vmax);                                                                 \
        float *keep = is_log ? NULL : dt == FK_FLOAT32 ? (float *)j->out + at : scratch;         \
        vd_##isa sd = {0};                                                                          \
        for (int64_t j0 = 0; j0 < len; j0 += FK_SUM_VECS * lanes) {                                \
            int64_t end = len - j0 < FK_SUM_VECS * lanes ? len : j0 + FK_SUM_VECS * lanes;          \
            vf_##isa acc = zero, acc2 = zero;                                                       \
            int64_t i = j0;                                                                         \
            for (; i + 4 * lanes <= end; i += 4 * lanes) { /* 4 exps' chains interleaved */         \
                vf_##isa e0 = exp_##isa(vload_##isa(dt, j->in, at + i) * scale - m);                \
                vf_##isa e1 = exp_##isa(vload_##isa(dt, j->in, at + i + lanes) * scale - m);        \
                vf_##isa e2 = exp_##isa(vload_##isa(dt, j->in, at + i + 2 * lanes) * scale - m);    \
                vf_##isa e3 = exp_##isa(vload_##isa(dt, j->in, at + i + 3 * lanes) * scale - m);    \
                acc += e0 + e1, acc2 += e2 + e3;                                                    \
                if (keep) {                                                                         \
                    vstore_##isa(FK_FLOAT32, e0, keep, i), vstore_##isa(FK_FLOAT32, e1, keep, i + lanes); \
                    vstore_##isa(FK_FLOAT32, e2, keep, i + 2 * lanes);                              \
                    vstore_##isa(FK_FLOAT32, e3, keep, i + 3 * lanes);                              \
                }                                                                                   \
            }                                                                                       \
            for (; i < end; i += lanes) {                                                           \
                vf_##isa e = exp_##isa(xs_##isa(dt, j->in, at + i, len - i, scale, -INFINITY) - m); \
                acc += e;                                                                           \
                if (keep) put_##isa(FK_FLOAT32, e, keep, i, len - i);                               \
            }                                                                                       \
            acc += acc2;                                                                            \
            sd += widen_lo_##isa(acc) + widen_hi_##isa(acc);                                        \
        }                                                                                           \
        double s = vsum_d_##isa(sd);                                                                \
        if (j->row_max) ((float *)j->row_max)[row] = m;                                             \
        if (is_log) {                                                                            \
            float ls = (float)log(s);                                                               \
            for (int64_t i = 0; i < len; i += lanes)                                                \
                put_##isa(dt, xs_##isa(dt, j->in, at + i, len - i, scale, 0.0f) - m - ls, j->out,   \
                          at + i, len - i);                                                         \
        } else {                                                                                    \
            float inv = (float)(1.0 / s);                                                           \
            for (int64_t i = 0; i < len; i += lanes) {                                              \
                vf_##isa e = keep ? xs_##isa(FK_FLOAT32, keep, i, len - i, 1.0f, 0.0f)              \
                                  : exp_##isa(xs_##isa(dt, j->in, at + i, len - i, scale, 0.0f) - m); \
                put_##isa(dt, e * inv, j->out, at + i, len - i);                                    \
            }                                                                                       \
        }                                                                                           \
        fill_keys(dt, j->out, at + len, n - len, is_log ? -INFINITY : 0.0f);                     \
    }                                                                                               \
                                                                                                    \
    FK_SPECIALIZE(attrs, softmax_fwd_rows_##isa, fwd_rows_##isa)                                   \
                                                                                                    \
    /* dx from the forward's output y (D-87), for one dtype and direction (constants where inlined). \
     * fp32: exact products and fp64 sums, dy's weights y normalised by z = sum y (log: sum exp y); \
     * 16-bit: torch's formula (z = 1: our y then mostly is torch's, bit for bit, and so is the    \
     * error it carries), fp32 lanes per FK_CHUNK keys (16-bit products are exact in fp32) joined   \
     * in fp64. The last step in fp32 for all, with c = a / z held as c_hi + c_lo (fp64 there took  \
     * ~20% of fp32 (4096, 1024)'s time, one thread, for no test's gain). */                 \
    static inline __attribute__((always_inline)) attrs void bwd_rows_##isa(                         \
        const softmax_job *j, int64_t row, float *scratch, const fk_dtype dt, const int is_log) {   \
        const vf_##isa zero = {0};                                                                  \
        const vd_##isa zd = {0};                                                                    \
        const float fill = is_log ? -INFINITY : 0.0f; /* a tail lane's y: exp(-inf) = 0 */          \
        int64_t n = j->n, len = row_valid(j, row), at = row * n;                                    \
        const void *y = j->in, *dy = j->dy; /* through j, each store reloaded them (D-110) */       \
        void *out = j->out;                                                                         \
        float *keep = !is_log ? NULL : dt == FK_FLOAT32 ? (float *)out + at : scratch; /* exp y */  \
        double z = 1.0, a = 0.0;                                                                    \
        if (dt == FK_FLOAT32 && !is_log) {                                                          \
            sum_dot_f64_##isa((const float *)y + at, (const float *)dy + at, len, &z, &a);          \
        } else if (dt == FK_FLOAT32) {                                                              \
            vd_##isa z_lo = zd, z_hi = zd, a_lo = zd, a_hi = zd;                                    \
            for (int64_t i = 0; i < len; i += lanes) {                                              \
                vf_##isa e = xs_##isa(dt, y, at + i, len - i, 1.0f, fill);                          \
                vf_##isa g = xs_##isa(dt, dy, at + i, len - i, 1.0f, 0.0f);                         \
                if (is_log) {                                                                       \
                    e = exp_##isa(e);                                                               \
                    put_##isa(FK_FLOAT32, e, keep, i, len - i);                                     \
                }                                                                                   \
                vd_##isa e_lo = widen_lo_##isa(e), e_hi = widen_hi_##isa(e);                        \
                vd_##isa g_lo = widen_lo_##isa(g), g_hi = widen_hi_##isa(g);                        \
                z_lo += e_lo, z_hi += e_hi;                                                         \
                a_lo += is_log ? g_lo : g_lo * e_lo, a_hi += is_log ? g_hi : g_hi * e_hi;           \
            }                                                                                       \
            z = vsum_d_##isa(z_lo + z_hi), a = vsum_d_##isa(a_lo + a_hi);                           \
        } else {                                                                                    \
            for (int64_t j0 = 0; j0 < len; j0 += FK_CHUNK) {                                        \
                int64_t end = len - j0 < FK_CHUNK ? len : j0 + FK_CHUNK;                            \
                vf_##isa acc = zero;                                                                \
                for (int64_t i = j0; i < end; i += lanes) {                                         \
                    vf_##isa e = xs_##isa(dt, y, at + i, len - i, 1.0f, fill);                      \
                    vf_##isa g = xs_##isa(dt, dy, at + i, len - i, 1.0f, 0.0f);                     \
                    if (is_log) put_##isa(FK_FLOAT32, exp_##isa(e), keep, i, len - i);              \
                    acc += is_log ? g : g * e;                                                      \
                }                                                                                   \
                a += vsum_##isa(acc);                                                               \
            }                                                                                       \
        }                                                                                           \
        if (is_log) /* masked keys too: their output is -inf, a constant */                         \
            for (int64_t i = len; i < n; i += FK_CHUNK) {                                           \
                float gb[FK_CHUNK];                                                                 \
                int64_t c = n - i < FK_CHUNK ? n - i : FK_CHUNK;                                    \
                fk_load_f32(dt, dy, at + i, c, gb);                                                 \
                for (int64_t k = 0; k < c; k++) a += gb[k];                                         \
            }                                                                                       \
        /* softmax: dx = k y (dy - c), k = scale / z; log: dx = scale (dy - e c); c = a / z */      \
        double c = a / z, kd = j->scale / z;                                                        \
        const float scale = (float)j->scale, k = (float)kd, c_hi = (float)c, c_lo = (float)(c - c_hi); \
        for (int64_t i = 0; i < len; i += lanes) {                                                  \
            vf_##isa e = keep ? xs_##isa(FK_FLOAT32, keep, i, len - i, 1.0f, 0.0f)                  \
                              : xs_##isa(dt, y, at + i, len - i, 1.0f, 0.0f);                       \
            vf_##isa g = xs_##isa(dt, dy, at + i, len - i, 1.0f, 0.0f), d;                          \
            if (is_log) d = scale * (g - e * c_hi); /* an FMA: with e normalised, rounding c suffices */ \
            else d = k * e * ((g - c_hi) - c_lo);                                                 \
            put_##isa(dt, d, out, at + i, len - i);                                                 \
        }                                                                                           \
        fill_keys(dt, out, at + len, n - len, 0.0f); /* masked keys: no gradient */                 \
    }                                                                                               \
    FK_SPECIALIZE(attrs, softmax_bwd_rows_##isa, bwd_rows_##isa)                                   \
                                                                                                    \
    /* Columns [i0, i0 + w) of slab o (block b), w <= FK_COLS_WIDTH, one lane a column, the keys    \
     * streamed in order (each key's w columns are adjacent): pass 1 an online max and sum, the max \
     * of each FK_COLS_KEYS keys first, the sum rescaled once per block where it rose; pass 2 the   \
     * output (one more exp an element: kept exps in 32-column blocks ran 1.5-1.9x slower, D-125).  \
     * 16-bit: each exp is exp2 of one FMA (D-125). */                                              \
    static inline __attribute__((always_inline)) attrs void fwd_cols_##isa(                         \
        const softmax_job *j, int64_t b, float *scratch, const fk_dtype dt, const int is_log) {     \
        (void)scratch;                                                                              \
        enum { kVecs = FK_COLS_WIDTH / lanes };                                                     \
        const vf_##isa zero = {0};                                                                  \
        const vd_##isa zd = {0};                                                                    \
        const float scale = (float)j->scale, kLog2e = 1.44269504088896341f;                         \
        /* 16-bit: exp(x scale - m) as exp2(x sl - m log2 e), one FMA for mul, sub and exp's own    \
         * range reduction; sl's rounding costs ~|x scale - m| 2^-24 relative (m log2 e's cancels   \
         * in e / s), far below a 16-bit ulp, not fp32's: fp32 keeps exp */                         \
        const int fused = dt != FK_FLOAT32;                                                         \
        const float sl = (float)(j->scale * 1.4426950408889634);                                    \
        const fk_rows blk = block_of(j, b);                                                         \
        int64_t n = blk.n, inner = blk.inner, i0 = blk.i0, o = blk.o, w = blk.width;                \
        int64_t nv = (w + lanes - 1) / lanes;                                                       \
        const void *x = j->in;                                                                      \
        int64_t at0 = o * n * inner + i0;                                                           \
        vf_##isa m[kVecs], ref[kVecs], part[kVecs];                                                 \
        vd_##isa s_lo[kVecs], s_hi[kVecs];                                                          \
        for (int v = 0; v < nv; v++) m[v] = zero - INFINITY, part[v] = zero, s_lo[v] = s_hi[v] = zd; \
        for (int64_t k0 = 0; k0 < n; k0 += FK_COLS_KEYS) {                                          \
            int64_t k1 = n - k0 < FK_COLS_KEYS ? n : k0 + FK_COLS_KEYS;                             \
            vf_##isa bm[kVecs];                                                                     \
            for (int v = 0; v < nv; v++) bm[v] = m[v];                                              \
            for (int64_t key = k0; key < k1; key++)                                                 \
                for (int v = 0; v < nv; v++) {                                                      \
                    vf_##isa xv = xs_##isa(dt, x, at0 + key * inner + v * lanes, w - v * lanes, scale, -INFINITY); \
                    bm[v] = select_##isa(xv > bm[v], xv, bm[v]);                                    \
                }                                                                                   \
            for (int v = 0; v < nv; v++) { /* the sums rescaled to the new max; exps relative to 0  \
                                            * while it is -inf, so -inf - -inf never makes NaN */   \
                vf_##isa r = exp_##isa(select_##isa(bm[v] > m[v], m[v] - bm[v], zero));             \
                part[v] *= r, s_lo[v] *= widen_lo_##isa(r), s_hi[v] *= widen_hi_##isa(r);           \
                m[v] = bm[v];                                                                       \
                ref[v] = select_##isa(m[v] == -INFINITY, zero, m[v]) * (fused ? kLog2e : 1.0f);     \
            }                                                                                       \
            for (int64_t key = k0; key < k1; key++)                                                 \
                for (int v = 0; v < nv; v++) {                                                      \
                    int64_t at = at0 + key * inner + v * lanes, left = w - v * lanes;               \
                    if (fused) part[v] += exp2_##isa(xs_##isa(dt, x, at, left, 1.0f, -INFINITY) * sl - ref[v]); \
                    else part[v] += exp_##isa(xs_##isa(dt, x, at, left, scale, -INFINITY) - ref[v]); \
                }                                                                                   \
            if (k1 % FK_COLS_FLUSH == 0 || k1 == n)                                                 \
                for (int v = 0; v < nv; v++)                                                        \
                    s_lo[v] += widen_lo_##isa(part[v]), s_hi[v] += widen_hi_##isa(part[v]), part[v] = zero; \
        }                                                                                           \
        vf_##isa f[kVecs]; /* softmax: f = 1 / s; log: f = log s */                                 \
        for (int v = 0; v < nv; v++) {                                                              \
            vd_##isa lo = s_lo[v], hi = s_hi[v];                                                    \
            for (int l = 0; l < lanes / 2; l++) {                                                   \
                f[v][l] = is_log ? (float)log(lo[l]) : (float)(1.0 / lo[l]);                        \
                f[v][l + lanes / 2] = is_log ? (float)log(hi[l]) : (float)(1.0 / hi[l]);            \
            }                                                                                       \
        }                                                                                           \
        if (j->row_max)                                                                             \
            for (int c = 0; c < w; c++) ((float *)j->row_max)[o * inner + i0 + c] = m[c / lanes][c % lanes]; \
        void *out = j->out; /* a local: GCC reloaded j->out every vector (D-110) */                 \
        vf_##isa ml[kVecs];                                                                         \
        for (int v = 0; v < nv; v++) ml[v] = m[v] * kLog2e;                                         \
        for (int64_t key = 0; key < n; key++)                                                       \
            for (int v = 0; v < nv; v++) {                                                          \
                int64_t at = at0 + key * inner + v * lanes, left = w - v * lanes;                   \
                vf_##isa y;                                                                         \
                if (is_log) y = xs_##isa(dt, x, at, left, scale, 0.0f) - m[v] - f[v];               \
                else if (fused) y = exp2_##isa(xs_##isa(dt, x, at, left, 1.0f, 0.0f) * sl - ml[v]) * f[v]; \
                else y = exp_##isa(xs_##isa(dt, x, at, left, scale, 0.0f) - m[v]) * f[v];           \
                put_##isa(dt, y, out, at, left);                                                    \
            }                                                                                       \
    }                                                                                               \
    FK_SPECIALIZE(attrs, softmax_fwd_cols_##isa, fwd_cols_##isa)                                   \
                                                                                                    \
    /* The backward of those columns from y, keys streamed in order, in chunks of j->chunk_keys keys: \
     * pass 1 each chunk's sums (the rows kernel's numerics, one lane a column; 16-bit: fp32 lanes  \
     * flushed to fp64 every FK_COLS_FLUSH keys) into part, the chunks' added in chunk order; pass 2 \
     * the output (exp y again for log). Item `item` of phase j->phase: phase 0 (j->part set) the sums \
     * of chunk item % chunks of block item / chunks; phase 1 that chunk's output; phase -1 (no part) \
     * a whole block, both passes. The sums are the same whichever way a block's chunks are run. */ \
    static inline __attribute__((always_inline)) attrs void bwd_cols_##isa(                         \
        const softmax_job *j, int64_t item, float *scratch, const fk_dtype dt, const int is_log) {  \
        (void)scratch;                                                                              \
        enum { kVecs = FK_COLS_WIDTH / lanes };                                                     \
        const vf_##isa zero = {0};                                                                  \
        const vd_##isa zd = {0};                                                                    \
        const float fill = is_log ? -INFINITY : 0.0f;                                               \
        const int64_t chunks = j->phase < 0 ? 1 : j->chunks, b = item / chunks, ck = j->chunk_keys; \
        const fk_rows blk = block_of(j, b);                                                         \
        int64_t n = blk.n, inner = blk.inner, i0 = blk.i0, o = blk.o, w = blk.width;                \
        int64_t nv = (w + lanes - 1) / lanes, at0 = o * n * inner + i0;                             \
        int64_t c0 = j->phase < 0 ? 0 : item % chunks, c1 = j->phase < 0 ? (n + ck - 1) / ck : c0 + 1; \
        double zs[FK_COLS_WIDTH], as[FK_COLS_WIDTH]; /* per column: z (fp32) and a, all keys */     \
        if (j->phase != 1)                                                                          \
            for (int64_t c = 0; c < w; c++) zs[c] = 0.0, as[c] = 0.0;                               \
        for (int64_t chunk = c0; j->phase != 1 && chunk < c1; chunk++) {                            \
            int64_t k0 = chunk * ck, k1 = n - k0 < ck ? n : k0 + ck;                                \
            vf_##isa part[kVecs];                                                                   \
            vd_##isa z_lo[kVecs], z_hi[kVecs], a_lo[kVecs], a_hi[kVecs];                            \
            for (int v = 0; v < nv; v++) part[v] = zero, z_lo[v] = z_hi[v] = a_lo[v] = a_hi[v] = zd; \
            for (int64_t key = k0; key < k1; key++) {                                               \
                for (int v = 0; v < nv; v++) {                                                      \
                    int64_t at = at0 + key * inner + v * lanes, left = w - v * lanes;               \
                    vf_##isa e = xs_##isa(dt, j->in, at, left, 1.0f, fill);                         \
                    vf_##isa g = xs_##isa(dt, j->dy, at, left, 1.0f, 0.0f);                         \
                    if (is_log) e = exp_##isa(e);                                                   \
                    if (dt == FK_FLOAT32) {                                                         \
                        vd_##isa e_lo = widen_lo_##isa(e), e_hi = widen_hi_##isa(e);                \
                        vd_##isa g_lo = widen_lo_##isa(g), g_hi = widen_hi_##isa(g);                \
                        z_lo[v] += e_lo, z_hi[v] += e_hi;                                           \
                        a_lo[v] += is_log ? g_lo : g_lo * e_lo, a_hi[v] += is_log ? g_hi : g_hi * e_hi; \
                    } else part[v] += is_log ? g : g * e;                                           \
                }                                                                                   \
                if (dt != FK_FLOAT32 && ((key + 1) % FK_COLS_FLUSH == 0 || key + 1 == k1))          \
                    for (int v = 0; v < nv; v++)                                                    \
                        a_lo[v] += widen_lo_##isa(part[v]), a_hi[v] += widen_hi_##isa(part[v]), part[v] = zero; \
            }                                                                                       \
            double *zp = j->phase == 0 ? j->part + (b * chunks + chunk) * 2 * FK_COLS_WIDTH : zs;   \
            double *ap = zp == zs ? as : zp + FK_COLS_WIDTH;                                        \
            for (int64_t c = 0; c < w; c++) { /* lane c % lanes of vector c / lanes */              \
                int v = (int)(c / lanes), l = (int)(c % lanes);                                     \
                double zc = l < lanes / 2 ? z_lo[v][l] : z_hi[v][l - lanes / 2];                    \
                double ac = l < lanes / 2 ? a_lo[v][l] : a_hi[v][l - lanes / 2];                    \
                if (zp == zs) zs[c] += zc, as[c] += ac; /* the chunks in order, as phase 1 adds them */ \
                else zp[c] = zc, ap[c] = ac;                                                        \
            }                                                                                       \
        }                                                                                           \
        if (j->phase == 0) return;                                                                  \
        if (j->phase == 1) { /* the block's chunks' sums, in chunk order */                         \
            for (int64_t c = 0; c < w; c++) zs[c] = 0.0, as[c] = 0.0;                               \
            for (int64_t chunk = 0; chunk < chunks; chunk++) {                                      \
                const double *zp = j->part + (b * chunks + chunk) * 2 * FK_COLS_WIDTH;             \
                const double *ap = zp + FK_COLS_WIDTH;                                              \
                for (int64_t c = 0; c < w; c++) zs[c] += zp[c], as[c] += ap[c];                     \
            }                                                                                       \
        }                                                                                           \
        /* per column c = a / z held as c_hi + c_lo in fp32 lanes and k = scale / z (16-bit: z = 1; \
         * fp32 log: c = a / z, k = scale), the last step in fp32 as the rows' (D-88) */            \
        vf_##isa k[kVecs], q_hi[kVecs], q_lo[kVecs];                                                \
        for (int v = 0; v < nv; v++)                                                                \
            for (int l = 0; l < lanes; l++) {                                                       \
                int64_t c = v * lanes + l < w ? v * lanes + l : w - 1;                              \
                double q = dt == FK_FLOAT32 ? as[c] / zs[c] : as[c];                                \
                q_hi[v][l] = (float)q, q_lo[v][l] = (float)(q - q_hi[v][l]);                        \
                k[v][l] = dt == FK_FLOAT32 && !is_log ? (float)(j->scale / zs[c]) : (float)j->scale; \
            }                                                                                       \
        int64_t k0 = c0 * ck, k1 = n < c1 * ck ? n : c1 * ck;                                       \
        for (int64_t key = k0; key < k1; key++)                                                     \
            for (int v = 0; v < nv; v++) {                                                          \
                int64_t at = at0 + key * inner + v * lanes, left = w - v * lanes;                   \
                vf_##isa e = xs_##isa(dt, j->in, at, left, 1.0f, fill);                             \
                vf_##isa g = xs_##isa(dt, j->dy, at, left, 1.0f, 0.0f), d;                          \
                if (is_log) e = exp_##isa(e);                                                       \
                if (is_log) d = k[v] * (g - e * q_hi[v]);                                           \
                else d = k[v] * e * ((g - q_hi[v]) - q_lo[v]);                                      \
                put_##isa(dt, d, j->out, at, left);                                                 \
            }                                                                                       \
    }                                                                                               \
    FK_SPECIALIZE(attrs, softmax_bwd_cols_##isa, bwd_cols_##isa)

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
