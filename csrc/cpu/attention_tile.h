/* attention.c's tile kernels for one arithmetic type and ISA: the matmul micro-kernel, vector exp and
 * row reductions, and the three work items (forward, backward's dq pass, its dk / dv pass); the
 * algorithm is in attention.c's header. Included by attention.c once per instantiation with FK_T
 * (float or double; FK_T_DOUBLE for double), FK_LANES, FK_MR (rows of the micro-kernel), FK_ISA (the
 * name suffix) and FK_ATTRS defined; undefines them at the end.
 * Buffers are fp32 (fp64) tiles carved from the item's workspace slot, rows padded to dp (head dim)
 * or kPad (keys / queries) with zeros, so every vector loop runs whole vectors. */

#define FK_CAT2(a, b) a##_##b
#define FK_CAT(a, b) FK_CAT2(a, b)
#define FN(name) FK_CAT(name, FK_ISA)
#define T FK_T
#ifdef FK_T_DOUBLE
#define V FN(vec)
#define IV FN(ivec)
typedef T V __attribute__((vector_size(sizeof(T) * FK_LANES), aligned(sizeof(T))));
typedef __typeof__((V){0} < (V){0}) IV;

static inline FK_ATTRS V FN(select)(IV mask, V a, V b) {
    return (V)(((IV)a & mask) | ((IV)b & ~mask));
}
#else /* fp32: vec.h's vectors, select and exp of this ISA */
#define V FK_CAT(vf, FK_ISA)
#define IV FK_CAT(vi, FK_ISA)
#endif

/* c[r ldc + x] (+)= sum_p a[r ars + p aps] b[p ldb + x] for r < mr, x < 2 FK_LANES: mr x 2 vector
 * accumulators in registers; each row of b (two vector loads) feeds 2 mr FMAs. A is read by its
 * strides (aps = 1: row-major; ars = 1: a transposed tile), so no tile is ever transposed for it. */
static inline __attribute__((always_inline)) FK_ATTRS void FN(micro)(int mr, int64_t k, const T *a,
                                                                     int64_t ars, int64_t aps,
                                                                     const T *b, int64_t ldb, T *c,
                                                                     int64_t ldc, int accumulate) {
    V acc[FK_MR][2];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = (V){0};
    for (int64_t p = 0; p < k; p++, b += ldb, a += aps) {
        V b0 = *(const V *)b, b1 = *(const V *)(b + FK_LANES);
        for (int r = 0; r < mr; r++) {
            T x = a[r * ars];
            acc[r][0] += x * b0;
            acc[r][1] += x * b1;
        }
    }
    for (int r = 0; r < mr; r++) {
        V *o = (V *)(c + r * ldc);
        if (accumulate) o[0] += acc[r][0], o[1] += acc[r][1];
        else o[0] = acc[r][0], o[1] = acc[r][1];
    }
}

/* C (m x n) (+)= A (m x k, element (r, p) at a[r ars + p aps]) B (k x n, row stride ldb); n a
 * multiple of 2 FK_LANES. */
static FK_ATTRS void FN(gemm)(int64_t m, int64_t n, int64_t k, const T *a, int64_t ars, int64_t aps,
                              const T *b, int64_t ldb, T *c, int64_t ldc, int accumulate) {
    for (int64_t x = 0; x < n; x += 2 * FK_LANES) {
        int64_t r = 0;
        for (; r + FK_MR <= m; r += FK_MR)
            FN(micro)(FK_MR, k, a + r * ars, ars, aps, b + x, ldb, c + r * ldc + x, ldc, accumulate);
        if (FK_MR > 4)
            for (; r + 4 <= m; r += 4)
                FN(micro)(4, k, a + r * ars, ars, aps, b + x, ldb, c + r * ldc + x, ldc, accumulate);
        for (; r < m; r++)
            FN(micro)(1, k, a + r * ars, ars, aps, b + x, ldb, c + r * ldc + x, ldc, accumulate);
    }
}

#ifdef FK_T_DOUBLE
static void FN(exp_inplace)(T *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = exp(x[i]);
}
#else
/* x[i] = exp(x[i]) for i < n (a multiple of FK_LANES): vec.h's Cephes expf (~1 ulp; 0 for -inf,
 * NaN stays NaN). */
static FK_ATTRS void FN(exp_inplace)(T *x, int64_t n) {
    for (int64_t i = 0; i < n; i += FK_LANES) *(V *)(x + i) = FN(exp)(*(V *)(x + i));
}
#endif

/* m[i] = max(m[i], x[i]) for i < n (a multiple of FK_LANES); NaN in x is skipped. */
static FK_ATTRS void FN(vec_max)(T *m, const T *x, int64_t n) {
    for (int64_t i = 0; i < n; i += FK_LANES) {
        V v = *(const V *)(x + i), c = *(const V *)(m + i);
        *(V *)(m + i) = FN(select)(v > c, v, c);
    }
}

/* sum of x[i] y[i] over n (a multiple of FK_LANES) elements. */
static FK_ATTRS T FN(row_dot)(const T *x, const T *y, int64_t n) {
    V acc = {0};
    for (int64_t i = 0; i < n; i += FK_LANES) acc += *(const V *)(x + i) * *(const V *)(y + i);
    T r = 0;
    for (int l = 0; l < FK_LANES; l++) r += acc[l];
    return r;
}

/* dst[x] = scale * src[off + x] for x < d, converted; 0 for d <= x < dp. */
static FK_ATTRS void FN(load_row)(fk_dtype dtype, const void *src, int64_t off, int64_t d, int64_t dp,
                                  T scale, T *dst) {
#ifdef FK_T_DOUBLE
    (void)dtype;
    memcpy(dst, (const double *)src + off, (size_t)d * sizeof(double));
#else
    fk_load_f32(dtype, src, off, d, dst);
#endif
    if (scale != (T)1)
        for (int64_t x = 0; x < d; x++) dst[x] *= scale;
    for (int64_t x = d; x < dp; x++) dst[x] = 0;
}

/* dst[off + x] = scale * src[x] for x < d, rounded to dtype (src is scaled in place). */
static FK_ATTRS void FN(store_row)(fk_dtype dtype, T *src, T scale, int64_t off, int64_t d, void *dst) {
    for (int64_t x = 0; x < d; x++) src[x] *= scale;
#ifdef FK_T_DOUBLE
    (void)dtype;
    memcpy((double *)dst + off, src, (size_t)d * sizeof(double));
#else
    fk_store_f32(dtype, src, off, d, dst);
#endif
}

/* dst[x ldd + r] = src[r lds + x] for r < rows, x < cols; dst's columns rows..pad are zero. */
static FK_ATTRS void FN(transpose)(const T *src, int64_t lds, int64_t rows, int64_t cols, T *dst,
                                   int64_t ldd, int64_t pad) {
    for (int64_t x = 0; x < cols; x++) {
        T *out = dst + x * ldd;
        for (int64_t r = 0; r < rows; r++) out[r] = src[r * lds + x];
        for (int64_t r = rows; r < pad; r++) out[r] = 0;
    }
}

/* x[i] = -inf for i < lo and hi <= i < n. */
static inline void FN(mask_outside)(T *x, int64_t lo, int64_t hi, int64_t n) {
    if (lo < 0) lo = 0;
    if (hi > n) hi = n;
    if (hi < lo) hi = lo;
    for (int64_t i = 0; i < lo; i++) x[i] = -(T)INFINITY;
    for (int64_t i = hi; i < n; i++) x[i] = -(T)INFINITY;
}

/* Loads rows [j0, j0 + keys) of kv head g of k (or v) into dst (keys x dp). */
static FK_ATTRS void FN(load_keys)(const fk_attention_args *a, const void *src, int64_t base,
                                   int64_t row, int64_t head, int64_t j0, int64_t keys, int64_t g,
                                   int64_t dp, T *dst) {
    for (int64_t x = 0; x < keys; x++)
        FN(load_row)(a->dtype, src, base + (j0 + x) * row + g * head, a->d, dp, 1, dst + x * dp);
}

/* Loads rows [i0, i0 + rows) of head h of q (scaled) and of dout (when wanted) into row-major
 * tiles q / dout (rows x dp). */
static FK_ATTRS void FN(load_queries)(const fk_attention_args *a, const seq_t *s, int64_t h, int64_t i0,
                                      int64_t rows, int64_t dp, T *q, T *dout) {
    for (int64_t r = 0; r < rows; r++) {
        int64_t i = i0 + r;
        FN(load_row)(a->dtype, a->q, s->q + i * a->q_row + h * a->q_head, a->d, dp, (T)a->scale, q + r * dp);
        if (dout)
            FN(load_row)(a->dtype, a->dout, s->dout + i * a->do_row + h * a->do_head, a->d, dp, 1, dout + r * dp);
    }
}

/* Sᵀ (keys x rpad, row stride kTile) masked: -inf where query i0 + r does not see key j0 + x (only
 * needed when the tile is not wholly visible). */
static FK_ATTRS void FN(mask_keys_rows)(const fk_attention_args *a, const seq_t *s, T *st, int64_t i0,
                                        int64_t j0, int64_t keys, int64_t rpad) {
    for (int64_t x = 0; x < keys; x++) {
        int64_t lo, hi;
        query_range(a, s, j0 + x, 1, &lo, &hi);
        FN(mask_outside)(st + x * kTile, lo - i0, hi - i0, rpad);
    }
}

/* ---- forward of a tile of one query (decoding) ---------------------------------------------------
 * The tile path pads its queries to whole vectors (kPad), so one query took 32 columns of Sᵀ = K Qᵀ;
 * here its scores are dot products along d, one a key, and O += P V is the same one-row matmul.
 * One row's visible keys are exactly [key_lo, key_hi): no element mask. */
static FK_ATTRS void FN(fwd_row)(const attn_job *job, char *slot, const q_tile *t) {
    const fk_attention_args *a = job->a;
    const seq_t *s = &t->s;
    const int64_t d = a->d, dp = job->dp, i = t->i0;
    T *q = carve(&slot, dp, sizeof(T)), *o = carve(&slot, dp, sizeof(T));
    T *kr = carve(&slot, kTile * dp, sizeof(T)), *v = carve(&slot, kTile * dp, sizeof(T));
    T *p = carve(&slot, kTile, sizeof(T));
#ifdef FK_T_DOUBLE
    const int same = a->dtype == FK_FLOAT64;
#else
    const int same = a->dtype == FK_FLOAT32;
#endif
    /* K and V read where they lie when they hold T and no padding is needed (else copied) */
    const int in_place = same && d == dp;
    FN(load_queries)(a, s, t->h, i, 1, dp, q, NULL);
    memset(o, 0, (size_t)dp * sizeof(T));
    T m = -(T)INFINITY, l = 0;
    int64_t jlo = key_lo(a, s, i), jhi = key_hi(a, s, i);
    for (int64_t j0 = jlo; j0 < jhi; j0 += kTile) {
        int64_t keys = jhi - j0 < kTile ? jhi - j0 : kTile, kp = round_up(keys, kPad);
        const T *kt = kr, *vt = v;
        int64_t ldk = dp, ldv = dp;
        if (in_place) {
            kt = (const T *)a->k + s->k + j0 * a->k_row + t->g * a->k_head, ldk = a->k_row;
            vt = (const T *)a->v + s->v + j0 * a->v_row + t->g * a->v_head, ldv = a->v_row;
        } else {
            FN(load_keys)(a, a->k, s->k, a->k_row, a->k_head, j0, keys, t->g, dp, kr);
            FN(load_keys)(a, a->v, s->v, a->v_row, a->v_head, j0, keys, t->g, dp, v);
        }
        T mnew = m;
        for (int64_t x = 0; x < keys; x++) {
            p[x] = FN(row_dot)(q, kt + x * ldk, dp);
            mnew = p[x] > mnew ? p[x] : mnew; /* NaN skipped, as the tile path's max */
        }
        T alpha = m == -(T)INFINITY ? 0 : (T)exp((double)(m - mnew)), shift = mnew == -(T)INFINITY ? 0 : mnew, sum = 0;
        for (int64_t x = 0; x < kp; x++) p[x] = x < keys ? p[x] - shift : -(T)INFINITY;
        FN(exp_inplace)(p, kp);
        for (int64_t x = 0; x < keys; x++) sum += p[x];
        m = mnew, l = l * alpha + sum;
        if (alpha != (T)1)
            for (int64_t x = 0; x < dp; x++) o[x] *= alpha;
        FN(gemm)(1, dp, keys, p, 1, 1, vt, ldv, o, dp, 1); /* O += P V */
    }
    int empty = l == 0;
    FN(store_row)(a->dtype, o, empty ? 0 : 1 / l, s->o + i * a->o_row + t->h * a->o_head, d, a->out);
    if (a->lse)
        ((T *)a->lse)[s->lse + t->h * s->lse_head + i] = empty ? (T)INFINITY : m + (T)log((double)l);
}

/* ---- forward: one (batch, head, q tile) ----------------------------------------------------------
 * Scores are formed transposed, Sᵀ = K Qᵀ (Q transposed once per item, K read as it lies), so the
 * softmax statistics of the rows are vectors across the tile's queries, and O += P V reads Sᵀ by
 * its strides. */
static FK_ATTRS void FN(fwd_item)(const attn_job *job, char *slot, int64_t item) {
    const fk_attention_args *a = job->a;
    q_tile t;
    if (!decode_q_tile(job, item, &t)) return;
    if (t.rows == 1) { /* decoding */
        FN(fwd_row)(job, slot, &t);
        return;
    }
    const seq_t *s = &t.s;
    const int64_t d = a->d, dp = job->dp, rows = t.rows, i0 = t.i0, rpad = round_up(rows, kPad);
    T *q = carve(&slot, kTile * dp, sizeof(T)), *qt = carve(&slot, dp * kTile, sizeof(T));
    T *kr = carve(&slot, kTile * dp, sizeof(T)), *v = carve(&slot, kTile * dp, sizeof(T));
    T *o = carve(&slot, kTile * dp, sizeof(T)), *st = carve(&slot, kTile * kTile, sizeof(T));
    T *m = carve(&slot, kTile, sizeof(T)), *l = carve(&slot, kTile, sizeof(T));
    T *shift = carve(&slot, kTile, sizeof(T)), *sum = carve(&slot, kTile, sizeof(T));
    T *alpha = carve(&slot, kTile, sizeof(T));
    FN(load_queries)(a, s, t.h, i0, rows, dp, q, NULL);
    FN(transpose)(q, dp, rows, d, qt, kTile, rpad);
    for (int64_t r = 0; r < rpad; r++) m[r] = -(T)INFINITY, l[r] = 0;
    memset(o, 0, (size_t)(rows * dp) * sizeof(T));
    int64_t jlo = key_lo(a, s, i0), jhi = key_hi(a, s, i0 + rows - 1);
    for (int64_t j0 = jlo; j0 < jhi; j0 += kTile) {
        int64_t keys = jhi - j0 < kTile ? jhi - j0 : kTile;
        FN(load_keys)(a, a->k, s->k, a->k_row, a->k_head, j0, keys, t.g, dp, kr);
        FN(load_keys)(a, a->v, s->v, a->v_row, a->v_head, j0, keys, t.g, dp, v);
        FN(gemm)(keys, rpad, d, kr, dp, 1, qt, kTile, st, kTile, 0); /* Sᵀ = K (scale Q)ᵀ */
        if (!tile_unmasked(a, s, i0, rows, j0, keys)) FN(mask_keys_rows)(a, s, st, i0, j0, keys, rpad);
        for (int64_t r = 0; r < rpad; r++) shift[r] = m[r];
        for (int64_t x = 0; x < keys; x++) FN(vec_max)(shift, st + x * kTile, rpad);
        for (int64_t r = 0; r < rpad; r++) { /* shift: the new max (0 while nothing is visible) */
            T mnew = shift[r];
            alpha[r] = m[r] == -(T)INFINITY ? 0 : (T)exp((double)(m[r] - mnew));
            m[r] = mnew, shift[r] = mnew == -(T)INFINITY ? 0 : mnew, sum[r] = 0;
        }
        for (int64_t x = 0; x < keys; x++) { /* Pᵀ, and its column sums */
            T *sx = st + x * kTile;
            for (int64_t r = 0; r < rpad; r++) sx[r] -= shift[r];
            FN(exp_inplace)(sx, rpad);
            for (int64_t r = 0; r < rpad; r++) sum[r] += sx[r];
        }
        for (int64_t r = 0; r < rows; r++) {
            l[r] = l[r] * alpha[r] + sum[r];
            if (alpha[r] != (T)1)
                for (int64_t x = 0; x < dp; x++) o[r * dp + x] *= alpha[r];
        }
        FN(gemm)(rows, dp, keys, st, 1, kTile, v, dp, o, dp, 1); /* O += P V */
    }
    for (int64_t r = 0; r < rows; r++) {
        int empty = l[r] == 0; /* l >= 1 once a key is visible (its max term is exp(0)) */
        FN(store_row)(a->dtype, o + r * dp, empty ? 0 : 1 / l[r],
                      s->o + (i0 + r) * a->o_row + t.h * a->o_head, d, a->out);
        if (a->lse)
            ((T *)a->lse)[s->lse + t.h * s->lse_head + i0 + r] =
                empty ? (T)INFINITY : m[r] + (T)log((double)l[r]);
    }
}

/* ---- backward, dq pass: one (batch, head, q tile); also writes D = rowsum(dO * O) --------------
 * Transposed like the forward: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (Q and dO transposed once per item). */
static FK_ATTRS void FN(dq_item)(const attn_job *job, char *slot, int64_t item) {
    const fk_attention_args *a = job->a;
    q_tile t;
    if (!decode_q_tile(job, item, &t)) return;
    const seq_t *s = &t.s;
    const int64_t d = a->d, dp = job->dp, rows = t.rows, i0 = t.i0, rpad = round_up(rows, kPad);
    T *q = carve(&slot, kTile * dp, sizeof(T)), *qt = carve(&slot, dp * kTile, sizeof(T));
    T *dout = carve(&slot, kTile * dp, sizeof(T)), *dot = carve(&slot, dp * kTile, sizeof(T));
    T *acc = carve(&slot, kTile * dp, sizeof(T)), *kr = carve(&slot, kTile * dp, sizeof(T));
    T *vr = carve(&slot, kTile * dp, sizeof(T));
    T *st = carve(&slot, kTile * kTile, sizeof(T)), *dpt = carve(&slot, kTile * kTile, sizeof(T));
    T *lse = carve(&slot, kTile, sizeof(T)), *delta = carve(&slot, kTile, sizeof(T));
    FN(load_queries)(a, s, t.h, i0, rows, dp, q, dout);
    for (int64_t r = 0; r < rpad; r++) {
        int64_t i = i0 + r, at = s->lse + t.h * s->lse_head + i;
        if (r >= rows) { /* padding: P = 0, dS = 0 */
            lse[r] = (T)INFINITY, delta[r] = 0;
            continue;
        }
        FN(load_row)(a->dtype, a->out, s->o + i * a->o_row + t.h * a->o_head, d, dp, 1, acc + r * dp);
        delta[r] = FN(row_dot)(dout + r * dp, acc + r * dp, dp);
        ((T *)job->delta)[at] = delta[r];
        lse[r] = ((const T *)a->lse)[at];
    }
    FN(transpose)(q, dp, rows, d, qt, kTile, rpad);
    FN(transpose)(dout, dp, rows, d, dot, kTile, rpad);
    memset(acc, 0, (size_t)(rows * dp) * sizeof(T));
    int64_t jlo = key_lo(a, s, i0), jhi = key_hi(a, s, i0 + rows - 1);
    for (int64_t j0 = jlo; j0 < jhi; j0 += kTile) {
        int64_t keys = jhi - j0 < kTile ? jhi - j0 : kTile;
        FN(load_keys)(a, a->k, s->k, a->k_row, a->k_head, j0, keys, t.g, dp, kr);
        FN(load_keys)(a, a->v, s->v, a->v_row, a->v_head, j0, keys, t.g, dp, vr);
        FN(gemm)(keys, rpad, d, kr, dp, 1, qt, kTile, st, kTile, 0);   /* Sᵀ = K (scale Q)ᵀ */
        FN(gemm)(keys, rpad, d, vr, dp, 1, dot, kTile, dpt, kTile, 0); /* dPᵀ = V dOᵀ */
        if (!tile_unmasked(a, s, i0, rows, j0, keys)) FN(mask_keys_rows)(a, s, st, i0, j0, keys, rpad);
        for (int64_t x = 0; x < keys; x++) {
            T *sx = st + x * kTile, *px = dpt + x * kTile;
            for (int64_t r = 0; r < rpad; r++) sx[r] -= lse[r];
            FN(exp_inplace)(sx, rpad);                                            /* Pᵀ */
            for (int64_t r = 0; r < rpad; r++) px[r] = sx[r] * (px[r] - delta[r]); /* dSᵀ */
        }
        FN(gemm)(rows, dp, keys, dpt, 1, kTile, kr, dp, acc, dp, 1); /* dQ += dS K */
    }
    for (int64_t r = 0; r < rows; r++)
        FN(store_row)(a->dtype, acc + r * dp, (T)a->scale,
                      ((s->grad_q + i0 + r) * a->heads + t.h) * d, d, a->dq);
}

/* ---- backward, dk / dv pass: one (batch, kv head, key tile), every head of its group ----------
 * Row orientation: S = Q Kᵀ and dP = dO Vᵀ (K and V transposed once per item); dV += Pᵀ dO and
 * dK += dSᵀ Q read P and dS by their strides. */
static FK_ATTRS void FN(dkdv_item)(const attn_job *job, char *slot, int64_t item) {
    const fk_attention_args *a = job->a;
    k_tile t;
    if (!decode_k_tile(job, item, &t)) return;
    const seq_t *s = &t.s;
    const int64_t d = a->d, dp = job->dp, keys = t.keys, j0 = t.j0, kpad = round_up(keys, kPad);
    T *kt = carve(&slot, dp * kTile, sizeof(T)), *vt = carve(&slot, dp * kTile, sizeof(T));
    T *dk = carve(&slot, kTile * dp, sizeof(T)), *dv = carve(&slot, kTile * dp, sizeof(T));
    T *q = carve(&slot, kTile * dp, sizeof(T)), *dout = carve(&slot, kTile * dp, sizeof(T));
    T *sc = carve(&slot, kTile * kTile, sizeof(T)), *dpm = carve(&slot, kTile * kTile, sizeof(T));
    T *lse = carve(&slot, kTile, sizeof(T)), *delta = carve(&slot, kTile, sizeof(T));
    FN(load_keys)(a, a->k, s->k, a->k_row, a->k_head, j0, keys, t.g, dp, dk); /* dk, dv: staging */
    FN(load_keys)(a, a->v, s->v, a->v_row, a->v_head, j0, keys, t.g, dp, dv);
    FN(transpose)(dk, dp, keys, d, kt, kTile, kpad);
    FN(transpose)(dv, dp, keys, d, vt, kTile, kpad);
    memset(dk, 0, (size_t)(keys * dp) * sizeof(T));
    memset(dv, 0, (size_t)(keys * dp) * sizeof(T));
    int64_t ilo, ihi;
    query_range(a, s, j0, keys, &ilo, &ihi);
    for (int64_t h = t.g * job->group; h < (t.g + 1) * job->group; h++) {
        for (int64_t i0 = ilo; i0 < ihi; i0 += kTile) {
            int64_t rows = ihi - i0 < kTile ? ihi - i0 : kTile;
            FN(load_queries)(a, s, h, i0, rows, dp, q, dout);
            for (int64_t r = 0; r < rows; r++) {
                int64_t at = s->lse + h * s->lse_head + i0 + r;
                lse[r] = ((const T *)a->lse)[at], delta[r] = ((const T *)job->delta)[at];
            }
            FN(gemm)(rows, kpad, d, q, dp, 1, kt, kTile, sc, kTile, 0);     /* S = (scale Q) Kᵀ */
            FN(gemm)(rows, kpad, d, dout, dp, 1, vt, kTile, dpm, kTile, 0); /* dP = dO Vᵀ */
            int full = tile_unmasked(a, s, i0, rows, j0, keys);
            for (int64_t r = 0; r < rows; r++) {
                T *sr = sc + r * kTile, *pr = dpm + r * kTile, shift = lse[r], dr = delta[r];
                if (full) FN(mask_outside)(sr, 0, keys, kpad);
                else FN(mask_outside)(sr, key_lo(a, s, i0 + r) - j0, key_hi(a, s, i0 + r) - j0, kpad);
                for (int64_t x = 0; x < kpad; x++) sr[x] -= shift;
                FN(exp_inplace)(sr, kpad);                            /* P */
                for (int64_t x = 0; x < kpad; x++) pr[x] = sr[x] * (pr[x] - dr); /* dS */
            }
            FN(gemm)(keys, dp, rows, sc, 1, kTile, dout, dp, dv, dp, 1); /* dV += Pᵀ dO */
            FN(gemm)(keys, dp, rows, dpm, 1, kTile, q, dp, dk, dp, 1);   /* dK += dSᵀ (scale Q) */
        }
    }
    for (int64_t x = 0; x < keys; x++) {
        int64_t at = ((s->grad_k + j0 + x) * a->kv_heads + t.g) * d;
        FN(store_row)(a->dtype, dk + x * dp, 1, at, d, a->dk);
        FN(store_row)(a->dtype, dv + x * dp, 1, at, d, a->dv);
    }
}

#undef FK_CAT2
#undef FK_CAT
#undef FN
#undef T
#undef V
#undef IV
#undef FK_T
#undef FK_T_DOUBLE
#undef FK_LANES
#undef FK_MR
#undef FK_ISA
#undef FK_ATTRS
