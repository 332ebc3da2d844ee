/* softmax.c's rows path (inner == 1, fp32 / fp16 / bf16): one row a call, fp32 arithmetic in GNU
 * vector types. One body per direction, instantiated for each ISA by FK_SOFTMAX_ROWS (AVX-512: 16
 * lanes, AVX2 + FMA: 8, portable: 4); pick_rows chooses at run time (FASTKERN_CPU_ISA forces one).
 * Rows are walked in chunks of FK_CHUNK keys through a stack buffer: load (converting fp16 / bf16),
 * scale, mask (-inf past the causal diagonal and in the padding to a whole vector), then vector
 * passes; softmax.c's header has the algorithm. Included by softmax.c only, after vec_math.h. */

/* Keys of the row `row` left unmasked by the causal mask (all n without one). */
static inline int64_t row_valid(const softmax_job *j, int64_t row) {
    if (j->causal_sq == 0) return j->n;
    int64_t len = row % j->causal_sq + 1 + j->n - j->causal_sq;
    return len < 0 ? 0 : (len > j->n ? j->n : len);
}

/* buf[i] = x[row, j0 + i] * scale for i < len (-inf from key `valid` on), -inf up to `padded`. */
static inline void load_scaled(const softmax_job *j, int64_t row, int64_t j0, int64_t len,
                               int64_t padded, int64_t valid, float scale, float *buf) {
    fk_load_f32(j->dtype, j->x, row * j->n + j0, len, buf);
    int64_t live = valid - j0 < 0 ? 0 : (valid - j0 < len ? valid - j0 : len);
    for (int64_t i = 0; i < live; i++) buf[i] *= scale;
    for (int64_t i = live; i < padded; i++) buf[i] = -INFINITY;
}

/* buf[i] = dy[row, j0 + i] for i < len, 0 up to `padded`. */
static inline void load_grad(const softmax_job *j, int64_t row, int64_t j0, int64_t len,
                             int64_t padded, float *buf) {
    fk_load_f32(j->dtype, j->dy, row * j->n + j0, len, buf);
    for (int64_t i = len; i < padded; i++) buf[i] = 0.0f;
}

#define FK_SOFTMAX_ROWS(isa, attrs, lanes)                                                          \
    FK_VEC_MATH(isa, attrs, lanes)                                                                  \
                                                                                                    \
    static attrs void softmax_fwd_rows_##isa(const softmax_job *j, int64_t row) {                  \
        float buf[FK_CHUNK] __attribute__((aligned(64)));                                           \
        const vf_##isa zero = {0};                                                                  \
        int64_t n = j->n, valid = row_valid(j, row);                                                \
        float scale = (float)j->scale;                                                              \
        int direct = j->dtype == FK_FLOAT32 && !j->is_log;                                          \
        vf_##isa vmax = zero - INFINITY;                                                            \
        for (int64_t j0 = 0; j0 < n; j0 += FK_CHUNK) {                                              \
            int64_t len = n - j0 < FK_CHUNK ? n - j0 : FK_CHUNK;                                    \
            int64_t padded = (len + lanes - 1) / lanes * lanes;                                     \
            load_scaled(j, row, j0, len, padded, valid, scale, buf);                                \
            for (int64_t i = 0; i < padded; i += lanes) {                                           \
                vf_##isa v = *(const vf_##isa *)(buf + i);                                          \
                vmax = select_##isa(v > vmax, v, vmax);                                             \
            }                                                                                       \
        }                                                                                           \
        float m = -INFINITY;                                                                        \
        for (int l = 0; l < lanes; l++) m = vmax[l] > m ? vmax[l] : m;                              \
        double s = 0.0;                                                                             \
        for (int64_t j0 = 0; j0 < n; j0 += FK_CHUNK) {                                              \
            int64_t len = n - j0 < FK_CHUNK ? n - j0 : FK_CHUNK;                                    \
            int64_t padded = (len + lanes - 1) / lanes * lanes;                                     \
            load_scaled(j, row, j0, len, padded, valid, scale, buf);                                \
            vf_##isa acc = zero;                                                                    \
            for (int64_t i = 0; i < padded; i += lanes) {                                           \
                vf_##isa e = exp_##isa(*(const vf_##isa *)(buf + i) - m);                           \
                acc += e;                                                                           \
                *(vf_##isa *)(buf + i) = e;                                                         \
            }                                                                                       \
            for (int l = 0; l < lanes; l++) s += acc[l];                                            \
            if (direct) memcpy((float *)j->out + row * n + j0, buf, (size_t)len * sizeof(float));  \
        }                                                                                           \
        if (j->row_max) ((float *)j->row_max)[row] = m;                                             \
        float inv = (float)(1.0 / s), log_s = (float)log(s);                                        \
        if (direct) {                                                                               \
            float *y = (float *)j->out + row * n;                                                   \
            for (int64_t i = 0; i < n; i++) y[i] *= inv;                                            \
            return;                                                                                 \
        }                                                                                           \
        for (int64_t j0 = 0; j0 < n; j0 += FK_CHUNK) {                                              \
            int64_t len = n - j0 < FK_CHUNK ? n - j0 : FK_CHUNK;                                    \
            int64_t padded = (len + lanes - 1) / lanes * lanes;                                     \
            load_scaled(j, row, j0, len, padded, valid, scale, buf);                                \
            for (int64_t i = 0; i < padded; i += lanes) {                                           \
                vf_##isa v = *(const vf_##isa *)(buf + i) - m;                                      \
                *(vf_##isa *)(buf + i) = j->is_log ? v - log_s : exp_##isa(v) * inv;                \
            }                                                                                       \
            fk_store_f32(j->dtype, buf, row * n + j0, len, j->out);                                 \
        }                                                                                           \
    }                                                                                               \
                                                                                                    \
    static attrs void softmax_bwd_rows_##isa(const softmax_job *j, int64_t row) {                  \
        float xb[FK_CHUNK] __attribute__((aligned(64))), gb[FK_CHUNK] __attribute__((aligned(64)));\
        int64_t n = j->n, valid = row_valid(j, row);                                                \
        float scale = (float)j->scale, m = ((const float *)j->row_max)[row];                        \
        double z = 0.0, a = 0.0;                                                                    \
        for (int64_t j0 = 0; j0 < n; j0 += FK_CHUNK) {                                              \
            int64_t len = n - j0 < FK_CHUNK ? n - j0 : FK_CHUNK;                                    \
            int64_t padded = (len + lanes - 1) / lanes * lanes;                                     \
            load_scaled(j, row, j0, len, padded, valid, scale, xb);                                 \
            load_grad(j, row, j0, len, padded, gb);                                                 \
            vd_##isa zacc = {0}, aacc = {0}; /* fp64: sum(dy * p) feeds a cancellation below */      \
            for (int64_t i = 0; i < padded; i += lanes) {                                           \
                vd_##isa p = __builtin_convertvector(exp_##isa(*(const vf_##isa *)(xb + i) - m),      \
                                                     vd_##isa);                                     \
                vd_##isa g = __builtin_convertvector(*(const vf_##isa *)(gb + i), vd_##isa);         \
                zacc += p;                                                                          \
                aacc += j->is_log ? g : g * p; /* log: masked keys too (their output is -inf) */   \
            }                                                                                       \
            for (int l = 0; l < lanes; l++) z += zacc[l], a += aacc[l];                             \
        }                                                                                           \
        /* dx in fp64 from the fp32 p: at a row's dominant key dy - sum(dy * y) cancels, and its  \
         * fp32 rounding alone put single fp32 rows over 2x torch's error (test_single_rows_fp32) */\
        double inv = 1.0 / z, c = j->is_log ? a : a / z, sc = j->scale;                             \
        for (int64_t j0 = 0; j0 < n; j0 += FK_CHUNK) {                                              \
            int64_t len = n - j0 < FK_CHUNK ? n - j0 : FK_CHUNK;                                    \
            int64_t padded = (len + lanes - 1) / lanes * lanes;                                     \
            load_scaled(j, row, j0, len, padded, valid, scale, xb);                                 \
            load_grad(j, row, j0, len, padded, gb);                                                 \
            for (int64_t i = 0; i < padded; i += lanes)                                             \
                *(vf_##isa *)(xb + i) = exp_##isa(*(const vf_##isa *)(xb + i) - m);                 \
            if (j->is_log)                                                                          \
                for (int64_t i = 0; i < len; i++) xb[i] = (float)(sc * (gb[i] - xb[i] * inv * c));  \
            else                                                                                    \
                for (int64_t i = 0; i < len; i++) xb[i] = (float)(sc * (xb[i] * inv) * (gb[i] - c));\
            int64_t live = valid - j0 < 0 ? 0 : (valid - j0 < len ? valid - j0 : len);              \
            for (int64_t i = live; i < len; i++) xb[i] = 0.0f; /* masked keys: no gradient */      \
            fk_store_f32(j->dtype, xb, row * n + j0, len, j->out);                                  \
        }                                                                                           \
    }

FK_SOFTMAX_ROWS(generic, __attribute__((optimize("fp-contract=fast"))), 4)
#if defined(__x86_64__) && defined(__GNUC__)
FK_SOFTMAX_ROWS(avx2, FK_VEC_ATTRS("avx2,fma"), 8)
FK_SOFTMAX_ROWS(avx512, FK_VEC_ATTRS("avx512f,avx512dq,avx2,fma"), 16)
#endif

/* The widest rows kernel the CPU runs (vec_math.h: fk_cpu_isa, FASTKERN_CPU_ISA forces one). */
static rows_fn pick_rows(int backward) {
#if defined(__x86_64__) && defined(__GNUC__)
    int isa = fk_cpu_isa();
    if (isa == FK_ISA_AVX512) return backward ? softmax_bwd_rows_avx512 : softmax_fwd_rows_avx512;
    if (isa == FK_ISA_AVX2) return backward ? softmax_bwd_rows_avx2 : softmax_fwd_rows_avx2;
#endif
    return backward ? softmax_bwd_rows_generic : softmax_fwd_rows_generic;
}
