/* Flash attention on the CPU: out = softmax(scale * Q Kᵀ + mask) V and its gradients, for fp32 / fp16
 * / bf16 (fp32 arithmetic) and fp64 (fp64 arithmetic), never materialising the Sq x Sk scores.
 *
 * Napkin math: forward 4 Sq Sk d FLOPs per head (two matmuls), backward 14 (seven: the dq pass
 * recomputes S and dP, see below). (1, 1024, 8, 64) fp32 is 2.1 GFLOP forward and 7.5 backward; on
 * a 2-core AVX-512 VM the tile micro-kernel sustains ~50-70 GFLOP/s, so ~35 ms forward, ~75 ms
 * backward (measured on a shared machine: 40 ms forward, 110 ms forward + backward). torch's math
 * SDPA runs the same matmuls in MKL but writes and rereads the 32 MiB of scores and probabilities.
 *
 * Algorithm (FlashAttention-2 on tiles of kTile = 64 rows, fp32 buffers in the workspace):
 *   forward, one work item per (batch, head, q tile): load the tile of Q (scaled) and transpose it
 *     once, then for each tile of keys it can see (tiles wholly masked by causal / window are never
 *     visited) load K and V as they lie, Sᵀ = K Qᵀ, mask the tile's edge elements, online softmax
 *     with the row statistics as vectors across the tile's queries (running max m and sum l, the
 *     output rescaled by exp(m_old - m_new)), O += P V; finally O /= l and lse = m + log l. A row
 *     that sees no key gets O = 0 and lse = +inf. A tile of one query (decoding) takes its scores
 *     as dot products along d instead (the tile path pads queries to 32 columns) and reads K and V
 *     where they lie when it can (fwd_row).
 *   backward, two passes, each writing only what it owns (deterministic, no atomics, the same bits
 *     for any thread count): a dq pass per (batch, head, q tile) computes D = rowsum(dO * O) into the
 *     workspace, then for each visible key tile Sᵀ = K Qᵀ, Pᵀ = exp(Sᵀ - lse), dPᵀ = V dOᵀ,
 *     dSᵀ = Pᵀ (dPᵀ - D), dQ += scale dS K; a dk / dv pass per (batch, kv head, key tile) walks every
 *     head of its GQA group and every q tile that sees it, S = Q Kᵀ, dP = dO Vᵀ (K and V transposed
 *     once), dV += Pᵀ dO, dK += scale dSᵀ Q. (Triton's fused-attention tutorial splits its backward
 *     the same way.) Each item transposes only the operand it keeps (Q, or K and V): the micro-kernel
 *     reads its A operand by strides, so P and dS are used transposed where they lie; transposing a
 *     64 x 64 tile per matmul had cost ~25% of the time (1.2x on (1, 1024, 8, 64) fwd+bwd).
 * The matmuls are one register-blocked micro-kernel (attention_tile.h: MR rows x 2 vectors of
 * columns in registers, GNU vector types, instantiated for AVX-512, AVX2 + FMA and a portable
 * build, chosen at run time; FASTKERN_CPU_ISA=generic|avx2|avx512 forces one), exp a vectorised
 * Cephes polynomial (as vec.h). Work items go to fixed workspace slots: slot s runs items
 * [n s / slots, n (s + 1) / slots); q tiles are taken zig-zag (first, last, second, ...) so causal
 * work balances across slots.
 */
#include <stdlib.h>

#include "common.h"
#include "vec.h"

#define kTile 64 /* rows of a Q tile and keys of a K / V tile: a 64 x 256 fp32 tile is 64 KiB (L2) */
#define kPad 32  /* head dims and key counts are padded to this: 2 vectors of the widest ISA */

typedef struct attn_job attn_job;
typedef void (*item_fn)(const attn_job *job, char *slot, int64_t item);

struct attn_job {
    const fk_attention_args *a;
    item_fn fn;
    int64_t items, slots, slot_bytes, dp, total_q, group;
    char *ws;     /* the slots' buffers */
    void *delta;  /* backward: rowsum(dO * O) laid out as lse, of the arithmetic type */
};

/* One sequence of the batch: its sizes, mask shift and where its rows start (element offsets). */
typedef struct {
    int64_t sq, sk, shift;
    int64_t q, k, v, o, dout; /* offsets of row 0 (the batch term, or the varlen row) */
    int64_t grad_q, grad_k;   /* first row of the dense (rows, heads, d) gradients */
    int64_t lse, lse_head;    /* offset of row 0 of head 0 in lse, and its head stride */
} seq_t;

static seq_t sequence(const attn_job *job, int64_t b) {
    const fk_attention_args *a = job->a;
    seq_t s;
    if (a->cu_seqlens_q) {
        int64_t q0 = a->cu_seqlens_q[b], k0 = a->cu_seqlens_k[b];
        s.sq = a->cu_seqlens_q[b + 1] - q0, s.sk = a->cu_seqlens_k[b + 1] - k0;
        s.q = q0 * a->q_row, s.k = k0 * a->k_row, s.v = k0 * a->v_row;
        s.o = q0 * a->o_row, s.dout = q0 * a->do_row;
        s.grad_q = q0, s.grad_k = k0, s.lse = q0, s.lse_head = job->total_q;
    } else {
        s.sq = a->sq, s.sk = a->sk;
        s.q = b * a->q_batch, s.k = b * a->k_batch, s.v = b * a->v_batch;
        s.o = b * a->o_batch, s.dout = b * a->do_batch;
        s.grad_q = b * a->sq, s.grad_k = b * a->sk, s.lse = b * a->heads * a->sq, s.lse_head = a->sq;
    }
    s.shift = a->flags & FK_ATTN_TOP_LEFT ? 0 : s.sk - s.sq;
    return s;
}

/* Keys [key_lo, key_hi) are visible to query i (none when key_lo >= key_hi); both are
 * non-decreasing in i, so a tile of rows sees the union [key_lo(first), key_hi(last)). */
static inline int64_t key_lo(const fk_attention_args *a, const seq_t *s, int64_t i) {
    int64_t lo = a->window_left < 0 ? 0 : i + s->shift - a->window_left;
    return lo < 0 ? 0 : lo > s->sk ? s->sk : lo;
}
static inline int64_t key_hi(const fk_attention_args *a, const seq_t *s, int64_t i) {
    int64_t hi = a->window_right < 0 ? s->sk : i + s->shift + a->window_right + 1;
    return hi < 0 ? 0 : hi > s->sk ? s->sk : hi;
}

/* Whether every query of [i0, i0 + rows) sees every key of [j0, j0 + keys): no element mask needed. */
static inline int tile_unmasked(const fk_attention_args *a, const seq_t *s, int64_t i0, int64_t rows,
                                int64_t j0, int64_t keys) {
    return j0 >= key_lo(a, s, i0 + rows - 1) && j0 + keys <= key_hi(a, s, i0);
}

/* A q tile work item (forward, dq pass): (batch, head, tile), tiles zig-zag within a head. */
typedef struct {
    seq_t s;
    int64_t h, g, i0, rows;
} q_tile;

static int decode_q_tile(const attn_job *job, int64_t item, q_tile *t) {
    const fk_attention_args *a = job->a;
    int64_t tiles = (a->sq + kTile - 1) / kTile, pos = item % tiles, bh = item / tiles;
    int64_t tile = pos % 2 == 0 ? pos / 2 : tiles - 1 - pos / 2;
    t->h = bh % a->heads, t->g = t->h / job->group;
    t->s = sequence(job, bh / a->heads);
    t->i0 = tile * kTile;
    if (t->i0 >= t->s.sq) return 0;
    t->rows = t->s.sq - t->i0 < kTile ? t->s.sq - t->i0 : kTile;
    return 1;
}

/* A key tile work item (dk / dv pass): (batch, kv head, tile), zig-zag likewise. */
typedef struct {
    seq_t s;
    int64_t g, j0, keys;
} k_tile;

static int decode_k_tile(const attn_job *job, int64_t item, k_tile *t) {
    const fk_attention_args *a = job->a;
    int64_t tiles = (a->sk + kTile - 1) / kTile, pos = item % tiles, bg = item / tiles;
    int64_t tile = pos % 2 == 0 ? pos / 2 : tiles - 1 - pos / 2;
    t->g = bg % a->kv_heads;
    t->s = sequence(job, bg / a->kv_heads);
    t->j0 = tile * kTile;
    if (t->j0 >= t->s.sk) return 0;
    t->keys = t->s.sk - t->j0 < kTile ? t->s.sk - t->j0 : kTile;
    return 1;
}

/* Queries [lo, hi) that see at least one key of [j0, j0 + keys). */
static void query_range(const fk_attention_args *a, const seq_t *s, int64_t j0, int64_t keys,
                        int64_t *lo, int64_t *hi) {
    int64_t l = a->window_right < 0 ? 0 : j0 - s->shift - a->window_right;
    int64_t h = a->window_left < 0 ? s->sq : j0 + keys - s->shift + a->window_left;
    *lo = l < 0 ? 0 : l > s->sq ? s->sq : l;
    *hi = h < *lo ? *lo : h > s->sq ? s->sq : h;
}

static inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

/* The next 64-byte-aligned buffer of `count` elements of `size` bytes from *p. */
static inline void *carve(char **p, int64_t count, int64_t size) {
    void *r = *p;
    *p += (count * size + 63) & ~(int64_t)63;
    return r;
}

#define FK_VEC_ATTRS(isa_list) __attribute__((target(isa_list), optimize("fp-contract=fast")))

#define FK_T float
#define FK_LANES 4
#define FK_MR 4
#define FK_ISA generic
#define FK_ATTRS FK_ATTRS_GENERIC
#include "attention_tile.h"
#if FK_X86
#define FK_T float
#define FK_LANES 8
#define FK_MR 4
#define FK_ISA avx2
#define FK_ATTRS FK_ATTRS_AVX2
#include "attention_tile.h"
#define FK_T float
#define FK_LANES 16
#define FK_MR 8
#define FK_ISA avx512
#define FK_ATTRS FK_ATTRS_AVX512
#include "attention_tile.h"
#endif
#define FK_T double
#define FK_T_DOUBLE 1
#define FK_LANES 2
#define FK_MR 4
#define FK_ISA f64
#define FK_ATTRS
#include "attention_tile.h"

typedef struct {
    item_fn fwd, dq, dkdv;
} attn_kernels;

/* The widest fp32 kernels the CPU runs (FASTKERN_CPU_ISA forces a narrower one, as softmax.c). */
static attn_kernels pick_kernels(fk_dtype dtype) {
    if (dtype == FK_FLOAT64) return (attn_kernels){fwd_item_f64, dq_item_f64, dkdv_item_f64};
#if FK_X86
    switch (fk_cpu_isa()) {
    case FK_ISA_AVX512: return (attn_kernels){fwd_item_avx512, dq_item_avx512, dkdv_item_avx512};
    case FK_ISA_AVX2: return (attn_kernels){fwd_item_avx2, dq_item_avx2, dkdv_item_avx2};
    }
#endif
    return (attn_kernels){fwd_item_generic, dq_item_generic, dkdv_item_generic};
}

/* ---- sizes, checks, workspace ------------------------------------------------------------------ */

static int64_t arith_size(const fk_attention_args *a) { return a->dtype == FK_FLOAT64 ? 8 : 4; }

/* Bytes of one slot's buffers (the carve order of attention_tile.h, plus alignment). */
static int64_t slot_bytes(const fk_attention_args *a, int backward) {
    int64_t dp = round_up(a->d, kPad), t = kTile;
    int64_t elems = backward ? 7 * t * dp + 2 * t * t + 2 * t  /* the dq pass, the larger */
                             : 5 * t * dp + t * t + 5 * t;
    return elems * arith_size(a) + 16 * 64;
}

static int64_t total_q(const fk_attention_args *a) {
    return a->cu_seqlens_q ? a->cu_seqlens_q[a->batch] : a->batch * a->sq;
}

static int64_t delta_bytes(const fk_attention_args *a) {
    return (a->heads * total_q(a) * arith_size(a) + 63) & ~(int64_t)63;
}

static fk_status check_args(const fk_attention_args *a, int backward) {
    const char *op = backward ? "fastkern attention backward" : "fastkern attention";
    fk_status st = fk_cpu_check_dtype(a->dtype, op);
    if (st != FK_OK) return st;
    if (a->batch < 0 || a->sq < 0 || a->sk < 0 || a->heads < 0 || a->kv_heads < 0 || a->d < 1)
        return fk_fail(FK_ERR_VALUE, "%s: sizes must be >= 0 and d >= 1 (batch %lld, sq %lld, sk %lld, "
                       "heads %lld, kv_heads %lld, d %lld)", op, (long long)a->batch, (long long)a->sq,
                       (long long)a->sk, (long long)a->heads, (long long)a->kv_heads, (long long)a->d);
    if (a->heads > 0 && (a->kv_heads < 1 || a->heads % a->kv_heads != 0))
        return fk_fail(FK_ERR_VALUE, "%s: heads %lld is not a multiple of kv_heads %lld", op,
                       (long long)a->heads, (long long)a->kv_heads);
    if ((a->cu_seqlens_q == NULL) != (a->cu_seqlens_k == NULL))
        return fk_fail(FK_ERR_VALUE, "%s: cu_seqlens_q and cu_seqlens_k must be given together", op);
    return FK_OK;
}

int64_t fk_cpu_attention_workspace(const fk_attention_args *args, int backward) {
    if (check_args(args, backward) != FK_OK) return 0;
    int64_t bytes = fk_parallel_threads(1 << 30) * slot_bytes(args, backward);
    return backward ? bytes + delta_bytes(args) : bytes;
}

/* Slot s of the job runs its share of the items, in order, on its own buffers. */
static void run_slots(void *ctx, int64_t begin, int64_t end) {
    const attn_job *job = (const attn_job *)ctx;
    for (int64_t s = begin; s < end; s++) {
        int64_t first = job->items * s / job->slots, last = job->items * (s + 1) / job->slots;
        for (int64_t t = first; t < last; t++) job->fn(job, job->ws + s * job->slot_bytes, t);
    }
}

/* Runs the items of fn on the workspace's slots; FK_ERR_VALUE when the workspace holds none. */
static fk_status run(attn_job *job, int backward, int threads) {
    const fk_attention_args *a = job->a;
    char *base = (char *)a->workspace;
    int64_t avail = a->workspace_bytes - (backward ? delta_bytes(a) : 0);
    job->slot_bytes = slot_bytes(a, backward);
    if (!base || avail < job->slot_bytes)
        return fk_fail(FK_ERR_VALUE, "fastkern attention%s: workspace of %lld bytes is smaller than "
                       "fk_cpu_attention_workspace's %lld", backward ? " backward" : "",
                       (long long)a->workspace_bytes,
                       (long long)fk_cpu_attention_workspace(a, backward));
    if (backward) job->delta = base, base += delta_bytes(a);
    job->ws = base;
    /* a slot wakes a worker only for ~1 MFLOP of work or more (a wake-up costs a few us) */
    double flops = 4.0 * (double)a->batch * a->heads * a->sq * (a->sk > kTile ? a->sk : kTile) * a->d;
    int64_t slots = fk_parallel_threads(threads), by_work = (int64_t)(flops / (1 << 20)) + 1;
    if (slots > avail / job->slot_bytes) slots = avail / job->slot_bytes;
    if (slots > job->items) slots = job->items;
    if (slots > by_work) slots = by_work;
    job->slots = slots < 1 ? 1 : slots;
    fk_parallel_for((int)job->slots, job->slots, 1, run_slots, job);
    return FK_OK;
}

static void init_job(attn_job *job, const fk_attention_args *a) {
    memset(job, 0, sizeof *job);
    job->a = a;
    job->dp = round_up(a->d, kPad);
    job->total_q = total_q(a);
    job->group = a->kv_heads > 0 ? a->heads / a->kv_heads : 1;
}

fk_status fk_cpu_attention_fwd(const fk_attention_args *args, int threads) {
    fk_status st = check_args(args, 0);
    if (st != FK_OK) return st;
    if (args->batch == 0 || args->heads == 0 || args->sq == 0) return FK_OK;
    attn_job job;
    init_job(&job, args);
    job.fn = pick_kernels(args->dtype).fwd;
    job.items = args->batch * args->heads * ((args->sq + kTile - 1) / kTile);
    return run(&job, 0, threads);
}

fk_status fk_cpu_attention_bwd(const fk_attention_args *args, int threads) {
    fk_status st = check_args(args, 1);
    if (st != FK_OK) return st;
    if (args->batch == 0 || args->heads == 0 || (args->sq == 0 && args->sk == 0)) return FK_OK;
    attn_kernels kernels = pick_kernels(args->dtype);
    attn_job job;
    init_job(&job, args);
    if (args->sq > 0) { /* dq and D (the dk / dv pass reads D) */
        job.fn = kernels.dq;
        job.items = args->batch * args->heads * ((args->sq + kTile - 1) / kTile);
        if ((st = run(&job, 1, threads)) != FK_OK) return st;
    }
    if (args->sk > 0) {
        job.fn = kernels.dkdv;
        job.items = args->batch * args->kv_heads * ((args->sk + kTile - 1) / kTile);
        st = run(&job, 1, threads);
    }
    return st;
}
