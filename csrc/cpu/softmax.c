/* Softmax / log-softmax on the CPU, reduced along the middle axis of an (outer, n, inner) array.
 *
 * Two paths:
 *   vector (fp32 / fp16 / bf16): fp32 arithmetic in vec.h's types, one body per ISA (AVX-512,
 *          AVX2 + FMA, portable) picked at run time; rows (inner == 1) and columns (inner > 1)
 *          kernels in softmax_vec.h, whose header has the algorithm and the napkin math.
 *   blocks (fp64): fp64 arithmetic, scalar libm; fp64 is what gradcheck runs on.
 * The row statistic saved for backward is the row max m of the scaled, masked row (fp32 except for
 * fp64); backward recomputes p = exp(x * scale - m) and divides by z = sum(p), the forward's own
 * formula, so the statistic's rounding cancels.
 * Row blocks go to the caller's threads in contiguous runs (fk_parallel_for); each row is reduced by
 * one thread in a fixed order, so the result does not depend on the thread count.
 */
#include <math.h>
#include <stdlib.h>

#include "vec.h"

#define FK_TILE 32 /* columns a block: n x 32 floats (1 MiB at n = 8192) stay in L2 */

static void load_f64(fk_dtype dtype, const void *src, int64_t start, int64_t len, double *out) {
    if (dtype == FK_FLOAT64) {
        memcpy(out, (const double *)src + start, (size_t)len * sizeof(double));
        return;
    }
    float tmp[FK_CHUNK];
    fk_load_f32(dtype, src, start, len, tmp);
    for (int64_t i = 0; i < len; i++) out[i] = tmp[i];
}

static void store_f64(fk_dtype dtype, const double *in, int64_t start, int64_t len, void *dst) {
    if (dtype == FK_FLOAT64) {
        memcpy((double *)dst + start, in, (size_t)len * sizeof(double));
        return;
    }
    float tmp[FK_CHUNK];
    for (int64_t i = 0; i < len; i++) tmp[i] = (float)in[i];
    fk_store_f32(dtype, tmp, start, len, dst);
}

/* One tile of a row block: keys [j0, j0 + keys) of columns [i0, i0 + width) of slab o, stored
 * key-major in buf (buf[k * width + c]). Either keys or width is 1 unless inner == 1. */
typedef struct {
    int64_t n, inner, o, i0, width;
} fk_rows;

static int64_t tile_keys(const fk_rows *r, int64_t j0) {
    int64_t most = r->inner == 1 ? FK_CHUNK : 1;
    return r->n - j0 < most ? r->n - j0 : most;
}

static void load_tile(const fk_rows *r, fk_dtype dtype, const void *src, int64_t j0, int64_t keys,
                      double *buf) {
    if (r->inner == 1) {
        load_f64(dtype, src, r->o * r->n + j0, keys, buf);
        return;
    }
    for (int64_t k = 0; k < keys; k++)
        load_f64(dtype, src, (r->o * r->n + j0 + k) * r->inner + r->i0, r->width, buf + k * r->width);
}

static void store_tile(const fk_rows *r, fk_dtype dtype, const double *buf, int64_t j0, int64_t keys,
                       void *dst) {
    if (r->inner == 1) {
        store_f64(dtype, buf, r->o * r->n + j0, keys, dst);
        return;
    }
    for (int64_t k = 0; k < keys; k++)
        store_f64(dtype, buf + k * r->width, (r->o * r->n + j0 + k) * r->inner + r->i0, r->width, dst);
}

/* Number of unmasked keys of the row that column c of the block is (all n without a mask). */
static int64_t unmasked(const fk_rows *r, int64_t c, int64_t causal_sq) {
    if (causal_sq == 0) return r->n;
    int64_t len = (r->o * r->inner + r->i0 + c) % causal_sq + 1 + r->n - causal_sq;
    return len < 0 ? 0 : (len > r->n ? r->n : len);
}

/* exp relative to m, or to 0 while m is -inf so that -inf - -inf does not make NaN early. */
static inline double ref(double m) { return m == -INFINITY ? 0.0 : m; }

static void forward_block(const fk_rows *r, fk_dtype dtype, const void *x, void *y, void *row_max,
                          double scale, int64_t causal_sq, int is_log) {
    double m[FK_TILE], s[FK_TILE], buf[FK_CHUNK];
    int64_t valid[FK_TILE], w = r->width;
    for (int64_t c = 0; c < w; c++) m[c] = -INFINITY, s[c] = 0.0, valid[c] = unmasked(r, c, causal_sq);
    for (int64_t j0 = 0; j0 < r->n; j0 += tile_keys(r, j0)) {
        int64_t keys = tile_keys(r, j0);
        load_tile(r, dtype, x, j0, keys, buf);
        for (int64_t k = 0; k < keys; k++)
            for (int64_t c = 0; c < w; c++) {
                if (j0 + k >= valid[c]) continue;
                double v = buf[k * w + c] * scale;
                if (v > m[c] || isnan(v)) { /* NaN (and +inf) poison s, as torch's row turns NaN */
                    if (s[c] != 0.0) s[c] *= exp(ref(m[c]) - ref(v)); /* 0 * inf would be NaN */
                    m[c] = v;
                }
                s[c] += exp(v - ref(m[c]));
            }
    }
    double log_s[FK_TILE];
    for (int64_t c = 0; c < w; c++) {
        log_s[c] = log(s[c]);
        double l = m[c];
        int64_t at = r->o * r->inner + r->i0 + c;
        if (row_max == NULL) continue;
        if (dtype == FK_FLOAT64) ((double *)row_max)[at] = l;
        else ((float *)row_max)[at] = (float)l;
    }
    for (int64_t j0 = 0; j0 < r->n; j0 += tile_keys(r, j0)) {
        int64_t keys = tile_keys(r, j0);
        load_tile(r, dtype, x, j0, keys, buf);
        for (int64_t k = 0; k < keys; k++)
            for (int64_t c = 0; c < w; c++) {
                double v = buf[k * w + c] * scale - m[c];
                if (j0 + k >= valid[c]) v = -INFINITY;
                buf[k * w + c] = is_log ? v - log_s[c] : exp(v) / s[c];
            }
        store_tile(r, dtype, buf, j0, keys, y);
    }
}

/* Backward from the forward's output y (fp64): z = sum y (log: sum exp y) over the unmasked keys,
 * a = sum dy y (log: sum dy over all n keys, the masked ones' output being the constant -inf);
 * dx = scale y / z (dy - a / z) (log: scale (dy - exp(y) a / z)), 0 at masked keys. Dividing by z
 * leaves only y's rounding relative to its row (D-87). */
static void backward_block(const fk_rows *r, fk_dtype dtype, const void *dy, const void *y, void *dx,
                           double scale, int64_t causal_sq, int is_log) {
    double z[FK_TILE], a[FK_TILE], yb[FK_CHUNK], gb[FK_CHUNK];
    int64_t valid[FK_TILE], w = r->width;
    for (int64_t c = 0; c < w; c++) z[c] = 0.0, a[c] = 0.0, valid[c] = unmasked(r, c, causal_sq);
    for (int64_t j0 = 0; j0 < r->n; j0 += tile_keys(r, j0)) {
        int64_t keys = tile_keys(r, j0);
        load_tile(r, dtype, y, j0, keys, yb);
        load_tile(r, dtype, dy, j0, keys, gb);
        for (int64_t k = 0; k < keys; k++)
            for (int64_t c = 0; c < w; c++) {
                double g = gb[k * w + c];
                if (is_log) a[c] += g;
                if (j0 + k >= valid[c]) continue;
                double e = is_log ? exp(yb[k * w + c]) : yb[k * w + c];
                z[c] += e;
                if (!is_log) a[c] += g * e;
            }
    }
    for (int64_t j0 = 0; j0 < r->n; j0 += tile_keys(r, j0)) {
        int64_t keys = tile_keys(r, j0);
        load_tile(r, dtype, y, j0, keys, yb);
        load_tile(r, dtype, dy, j0, keys, gb);
        for (int64_t k = 0; k < keys; k++)
            for (int64_t c = 0; c < w; c++) {
                double g = gb[k * w + c], e = is_log ? exp(yb[k * w + c]) : yb[k * w + c], q = a[c] / z[c];
                if (j0 + k >= valid[c]) yb[k * w + c] = 0.0;
                else yb[k * w + c] = is_log ? scale * (g - e * q) : scale * e / z[c] * (g - q);
            }
        store_tile(r, dtype, yb, j0, keys, dx);
    }
}

static fk_status check_args(const char *op, int64_t outer, int64_t n, int64_t inner,
                            int64_t causal_sq, fk_dtype dtype) {
    if (outer < 0 || n < 0 || inner < 0 || causal_sq < 0)
        return fk_fail(FK_ERR_VALUE, "%s: negative size", op);
    if (causal_sq > 0 && inner != 1)
        return fk_fail(FK_ERR_VALUE, "%s: a causal mask needs the keys on the last dim", op);
    return fk_cpu_check_dtype(dtype, op);
}

/* Row blocks (one slab o, up to `width` adjacent columns i0..) are independent: threads take
 * contiguous runs of them, numbered o * tiles + i0 / width. */
typedef struct softmax_job softmax_job;
typedef void (*rows_fn)(const softmax_job *j, int64_t item, float *scratch);
struct softmax_job {
    const void *dy;  /* backward: the output's gradient; NULL: forward */
    const void *in;  /* forward: x; backward: the forward's output y */
    void *out, *row_max;
    int64_t n, inner, width, tiles, causal_sq; /* width: columns a block (1 for rows) */
    double scale;
    int is_log;
    fk_dtype dtype;
    rows_fn row; /* the vector path's kernel (a row or a column block an item), NULL for fp64 */
    int phase;   /* column backward: -1 a block an item; 0 / 1 a key chunk an item, sums / output */
    int64_t chunk_keys, chunks; /* column backward: keys a chunk, chunks a column */
    double *part;               /* column backward, phases 0 / 1: per block, chunk: z, a per column */
};

/* Block b's slab o, first column i0 and width (columns a block; fewer in the last). */
static fk_rows block_of(const softmax_job *j, int64_t b) {
    int64_t i0 = b % j->tiles * j->width;
    return (fk_rows){j->n, j->inner, b / j->tiles, i0, j->inner - i0 < j->width ? j->inner - i0 : j->width};
}

#include "softmax_vec.h"

/* A thread's run of row blocks: backward when the job has dy. */
static void run_blocks(void *arg, int64_t begin, int64_t end) {
    const softmax_job *j = (const softmax_job *)arg;
    if (j->row) { /* 16-bit rows keep their exps: on the stack, or one buffer a run */
        float stack[FK_KEEP] __attribute__((aligned(64)));
        float *scratch = NULL, *heap = NULL;
        if (needs_scratch(j)) {
            scratch = j->n <= FK_KEEP ? stack : (heap = (float *)malloc((size_t)j->n * sizeof(float)));
        }
        for (int64_t b = begin; b < end; b++) j->row(j, b, scratch); /* NULL: recompute the exps */
        free(heap);
        return;
    }
    for (int64_t b = begin; b < end; b++) {
        fk_rows r = block_of(j, b);
        if (j->dy) backward_block(&r, j->dtype, j->dy, j->in, j->out, j->scale, j->causal_sq, j->is_log);
        else forward_block(&r, j->dtype, j->in, j->out, j->row_max, j->scale, j->causal_sq, j->is_log);
    }
}

static void split_blocks(softmax_job *j, int64_t outer, int threads) {
    /* fp64: FK_TILE columns a block; vector columns: up to FK_COLS_WIDTH, fewer where that leaves
     * threads without a block (a column's result does not depend on its block); column backwards
     * with few blocks and long columns: their key chunks shared out instead, in two phases */
    j->width = j->inner < FK_TILE ? j->inner : FK_TILE;
    j->phase = -1, j->part = NULL, j->chunk_keys = cols_chunk_keys(j->n);
    if (j->dtype != FK_FLOAT64) {
        j->row = pick_vec(j);
        int64_t tiles = (j->inner + FK_COLS_WIDTH - 1) / FK_COLS_WIDTH, t = fk_parallel_threads(threads);
        if (j->inner > 1 && j->dy && t > 1 && outer * tiles < FK_COLS_SPLIT_BLOCKS * t &&
            j->n > j->chunk_keys) {
            j->width = j->inner < FK_COLS_WIDTH ? j->inner : FK_COLS_WIDTH, j->tiles = tiles;
            j->chunks = (j->n + j->chunk_keys - 1) / j->chunk_keys;
            int64_t items = outer * tiles * j->chunks;
            j->part = (double *)malloc((size_t)items * 2 * FK_COLS_WIDTH * sizeof(double));
            if (j->part) { /* else one block an item, the same sums */
                for (j->phase = 0; j->phase < 2; j->phase++)
                    fk_parallel_for(threads, items, fk_min_items(j->chunk_keys * j->width), run_blocks, j);
                free(j->part);
                return;
            }
        }
        if (j->inner > 1) {
            int64_t parts = outer >= threads ? 1 : (threads + outer - 1) / outer;
            int64_t width = ((j->inner + parts - 1) / parts + 15) / 16 * 16;
            j->width = width < FK_COLS_WIDTH ? width : FK_COLS_WIDTH;
        }
    }
    j->tiles = (j->inner + j->width - 1) / j->width;
    fk_parallel_for(threads, outer * j->tiles, fk_min_items(j->n * j->width), run_blocks, j);
}

fk_status fk_cpu_softmax_fwd(const void *x, void *y, void *row_max, int64_t outer, int64_t n,
                             int64_t inner, double scale, int64_t causal_sq, int is_log,
                             fk_dtype dtype, int threads) {
    fk_status status = check_args("softmax", outer, n, inner, causal_sq, dtype);
    if (status != FK_OK) return status;
    softmax_job j = {NULL, x, y, row_max, n, inner, 1, 0, causal_sq, scale, is_log, dtype, NULL, -1, 1, 1,
                     NULL};
    split_blocks(&j, outer, threads);
    return FK_OK;
}

fk_status fk_cpu_softmax_bwd_from_output(const void *dy, const void *y, void *dx, int64_t outer, int64_t n,
                                         int64_t inner, double scale, int64_t causal_sq, int is_log,
                                         fk_dtype dtype, int threads) {
    fk_status status = check_args("softmax_backward", outer, n, inner, causal_sq, dtype);
    if (status != FK_OK) return status;
    softmax_job j = {dy, y, dx, NULL, n, inner, 1, 0, causal_sq, scale, is_log, dtype, NULL, -1, 1, 1, NULL};
    split_blocks(&j, outer, threads);
    return FK_OK;
}
