/* Matmul / linear on the CPU: C[b] = act(A[b] @ B[b] + bias), optionally writing the
 * pre-activation, for fp32 / fp16 / bf16 (fp32 arithmetic) and fp64 (fp64 arithmetic).
 * Strategies: bf16 on CPUs with AMX tiles runs the same blocks through matmul_amx.c (bf16 panels,
 * tile products, 128-row blocks); fp32 / fp16 / bf16 otherwise the fp32 micro-kernels below; fp64
 * plain rows. FASTKERN_CPU_MATMUL_KERNEL=amx|avx512|avx2|generic picks (pick_kernel).
 *
 * Napkin math: 2 m n k FLOPs. A Zen 4 / Skylake-X core retires two 8-lane (or one 16-lane) fp32 FMA
 * per cycle, ~32 FLOP/cycle, ~100 GFLOP/s at 3 GHz; torch (MKL) reaches ~50 GFLOP/s for fp32 1024^3
 * on this project's 2-core dev VM. To stay compute-bound every loaded float must feed many FMAs.
 *
 * Algorithm (Goto / BLIS, fp32 path):
 *   - The output is cut into blocks of kMc x nc (nc <= kNcMax); thread ranges are contiguous runs of
 *     blocks ordered (batch, column block, row block), so a thread packs each B panel once.
 *   - Packing copies a block of A (mc x k) into row panels of MR rows, k-major, and B (k x nc) into
 *     column panels of NR columns, converting fp16 / bf16 to fp32 and zero-padding the edges; either
 *     operand may be row- or column-major (the loop order follows the unit stride).
 *   - A register-blocked micro-kernel keeps an MR x NR fp32 accumulator tile in vector registers
 *     (12 x 32 in 24 zmm with AVX-512, 6 x 16 in 12 ymm with AVX2 + FMA, 4 x 8 otherwise) and runs
 *     over kKc values of k: one B row (NR floats) load and MR broadcasts of A feed MR x NR FMAs.
 *     Chunks of kKc are summed into an fp32 block tile, so the sum is blocked (error ~ kKc + k / kKc
 *     roundings instead of k), like MKL's.
 *   - The epilogue adds the bias, stores `pre`, applies GELU (gelu.c's vector bodies) and rounds
 *     to the output dtype through the vector layer (store_row), one block row at a time.
 * The packing buffers are malloc'ed once per thread per call (k x (kMc + nc) + kMc x nc floats):
 * the one CPU entry point that allocates (fastkern.h says so).
 * fp64 exists so gradcheck can run: plain row-by-row loops (axpy or dot form by B's layout).
 */
#include <stdatomic.h>
#include <stdlib.h>

#include "matmul_amx.h"
#include "vec.h"

#define kKc 256     /* k per micro-kernel run: its A and B slices (~12 + 32 KiB) stay in L1 / L2 */
#define kMc 144     /* rows of a block: multiple of every MR (12, 6, 4); A block k x 144 in L2 */
#define kMcAmx 128  /* rows of a block on AMX: a multiple of its 32-row pieces */
#define kNcMax 256  /* columns of a block: multiple of every NR (32, 16, 8) */
#define kBlockMinFlops (4 << 20) /* work a thread must get (~0.1 ms) for its start to pay */

/* ---- micro-kernels ------------------------------------------------------------------------------
 * c[i * ldc + j] (+)= sum_p a[p * MR + i] * b[p * NR + j], i < MR, j < NR; b 64-byte aligned and
 * ldc a multiple of NR. One generic body, instantiated per ISA with GNU vector types; the
 * accumulators are a constant-indexed array the compiler keeps in registers, and fp-contract
 * fuses acc + a * b into one FMA (objdump: vfmadd231ps on zmm / ymm in the hot loop). */
typedef void (*micro_fn)(int64_t kc, const float *a, const float *b, float *c, int64_t ldc,
                         int accumulate);

#define FK_MICRO_KERNEL(name, attrs, vec, lanes, MR, NV)                                           \
    static attrs void name(int64_t kc, const float *a, const float *b, float *c, int64_t ldc,     \
                           int accumulate) {                                                       \
        vec acc[MR][NV];                                                                           \
        for (int i = 0; i < MR; i++)                                                               \
            for (int v = 0; v < NV; v++) acc[i][v] = (vec){0};                                     \
        for (int64_t p = 0; p < kc; p++, a += MR, b += NV * lanes) {                               \
            vec bv[NV];                                                                            \
            for (int v = 0; v < NV; v++) bv[v] = *(const vec *)(b + v * lanes);                    \
            for (int i = 0; i < MR; i++)                                                           \
                for (int v = 0; v < NV; v++) acc[i][v] = acc[i][v] + a[i] * bv[v];                 \
        }                                                                                          \
        for (int i = 0; i < MR; i++)                                                               \
            for (int v = 0; v < NV; v++) {                                                         \
                vec *out = (vec *)(c + i * ldc + v * lanes);                                       \
                *out = accumulate ? *out + acc[i][v] : acc[i][v];                                  \
            }                                                                                      \
    }

typedef float v4f __attribute__((vector_size(16)));
FK_MICRO_KERNEL(micro_4x8_generic, __attribute__((optimize("fp-contract=fast"))), v4f, 4, 4, 2)
#if defined(__x86_64__) && defined(__GNUC__)
typedef float v8f __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));
FK_MICRO_KERNEL(micro_6x16_avx2, __attribute__((target("avx2,fma"), optimize("fp-contract=fast"))),
                v8f, 8, 6, 2)
FK_MICRO_KERNEL(micro_12x32_avx512,
                __attribute__((target("avx512f,avx2,fma"), optimize("fp-contract=fast"))), v16f, 16,
                12, 2)
#endif

typedef struct {
    micro_fn run; /* NULL: bf16 blocks on AMX tiles (matmul_amx.c) */
    int mr, nr;
} micro_kernel;

/* The widest kernel the CPU runs for `dtype`: AMX tiles for bf16 where the CPU has them, else the
 * widest fp32 micro-kernel; FASTKERN_CPU_MATMUL_KERNEL=avx512|avx2|generic picks an fp32 one
 * (tests cover every kernel on one machine). */
static micro_kernel pick_kernel(fk_dtype dtype) {
    const char *want = getenv("FASTKERN_CPU_MATMUL_KERNEL");
    int generic = want && !strcmp(want, "generic"), avx2 = want && !strcmp(want, "avx2");
    if (dtype == FK_BFLOAT16 && (!want || !strcmp(want, "amx")) && fk_amx_bf16_ready())
        return (micro_kernel){NULL, 32, 32};
    (void)avx2;
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (!generic && !avx2 && __builtin_cpu_supports("avx512f"))
        return (micro_kernel){micro_12x32_avx512, 12, 32};
    if (!generic && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return (micro_kernel){micro_6x16_avx2, 6, 16};
#endif
    (void)generic;
    return (micro_kernel){micro_4x8_generic, 4, 8};
}

/* ---- packing --------------------------------------------------------------------------------- */

static const void *elem(fk_dtype dtype, const void *base, int64_t offset) {
    return (const char *)base + offset * fk_dtype_size(dtype);
}

/* dst[i * dst_stride] = (float)src[i * src_stride] for i < n. */
static void load_strided(fk_dtype dtype, const void *src, int64_t src_stride, int64_t n,
                         float *dst, int64_t dst_stride) {
    if (dtype == FK_FLOAT32) {
        const float *s = (const float *)src;
        if (src_stride == 1 && dst_stride == 1) memcpy(dst, s, (size_t)n * sizeof(float));
        else for (int64_t i = 0; i < n; i++) dst[i * dst_stride] = s[i * src_stride];
    } else if (dtype == FK_BFLOAT16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i * dst_stride] = fk_bf16_to_f32(s[i * src_stride]);
    } else {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i * dst_stride] = fk_f16_to_f32(s[i * src_stride]);
    }
}

/* Packs `lanes` lanes (rows of A, or columns of B) by k of an operand into panels of `width` lanes:
 * lane l, step p lands at dst[(l / width) * width * k + p * width + l % width]; lanes past `lanes`
 * up to the next multiple of width are zero. Element (l, p) is at src + l * lane_stride +
 * p * k_stride; the loop runs along whichever stride is 1. */
static void pack_panels(fk_dtype dtype, const void *src, int64_t lane_stride, int64_t k_stride,
                        int64_t lanes, int64_t k, int width, float *dst) {
    for (int64_t l0 = 0; l0 < lanes; l0 += width, dst += width * k) {
        int64_t valid = lanes - l0 < width ? lanes - l0 : width;
        if (lane_stride == 1) {
            for (int64_t p = 0; p < k; p++) {
                load_strided(dtype, elem(dtype, src, l0 + p * k_stride), 1, valid, dst + p * width, 1);
                for (int64_t l = valid; l < width; l++) dst[p * width + l] = 0.0f;
            }
        } else {
            for (int64_t l = 0; l < valid; l++)
                load_strided(dtype, elem(dtype, src, (l0 + l) * lane_stride), k_stride, k, dst + l,
                             width);
            for (int64_t l = valid; l < width; l++)
                for (int64_t p = 0; p < k; p++) dst[p * width + l] = 0.0f;
        }
    }
}

/* ---- the fp32-arithmetic GEMM ------------------------------------------------------------------ */

typedef struct {
    const fk_matmul_args *args;
    micro_kernel kern;
    int isa; /* the epilogue's GELU vectors (vec.h) */
    int64_t mc, nc, m_blocks, n_blocks; /* block rows (kMc, or kMcAmx on AMX) and columns */
    atomic_int out_of_memory;
} gemm_job;

typedef struct {
    float *a, *b, *tile, *bias; /* AMX: a and b hold packed bf16 */
} gemm_buffers;

static void *alloc_floats(int64_t count) {
    size_t bytes = ((size_t)(count > 0 ? count : 1) * sizeof(float) + 63) & ~(size_t)63;
    return aligned_alloc(64, bytes);
}

/* n fp32 values -> dst[at..] in `dtype`, in the vector body of `isa` (the scalar conversion was ~10%
 * of a bf16 1024^3 on AMX tiles) */
#define FK_STORE_ROW(isa, attrs, lanes)                                                            \
    static attrs void store_row_##isa(fk_dtype dt, const float *x, int64_t n, void *dst, int64_t at) { \
        int64_t full = n / lanes * lanes;                                                           \
        for (int64_t i = 0; i < full; i += lanes) vstore_##isa(dt, vload_##isa(FK_FLOAT32, x, i), dst, at + i); \
        if (full < n)                                                                               \
            vstore_part_##isa(dt, vload_part_##isa(FK_FLOAT32, x, full, n - full, 0.0f), dst, at + full, \
                              n - full);                                                            \
    }
FK_STORE_ROW(generic, FK_ATTRS_GENERIC, 4)
#if FK_X86
FK_STORE_ROW(avx2, FK_ATTRS_AVX2, 8)
FK_STORE_ROW(avx512, FK_ATTRS_AVX512, 16)
#endif

static void store_row(int isa, fk_dtype dt, const float *x, int64_t n, void *dst, int64_t at) {
#if FK_X86
    if (isa == FK_ISA_AVX512) return store_row_avx512(dt, x, n, dst, at);
    if (isa == FK_ISA_AVX2) return store_row_avx2(dt, x, n, dst, at);
#endif
    store_row_generic(dt, x, n, dst, at);
}

/* Adds the bias, stores pre, applies the activation and stores C for the mc x nc block at
 * (batch bb, row m0, column n0), whose fp32 sums are in tile (row stride ldt). */
static void store_block(const fk_matmul_args *g, int isa, const gemm_buffers *buf, int64_t ldt,
                        int64_t bb, int64_t m0, int64_t mc, int64_t n0, int64_t nc) {
    for (int64_t i = 0; i < mc; i++) {
        float *row = buf->tile + i * ldt;
        int64_t offset = bb * g->c_batch + (m0 + i) * g->c_row + n0;
        if (g->bias)
            for (int64_t j = 0; j < nc; j++) row[j] += buf->bias[j];
        if (g->pre) store_row(isa, g->dtype, row, nc, g->pre, offset);
        if (g->activation != FK_ACT_NONE)
            fk_cpu_gelu_f32_inplace(row, nc, g->activation == FK_ACT_GELU_TANH, isa);
        store_row(isa, g->dtype, row, nc, g->c, offset);
    }
}

/* One block: pack A's rows, run the micro-kernel over the kKc slices of k, store. B's panel for
 * this (batch, column block) is already packed in buf->b. */
static void run_block(const gemm_job *job, const gemm_buffers *buf, int64_t bb, int64_t m0,
                      int64_t n0, int64_t nc) {
    const fk_matmul_args *g = job->args;
    const micro_kernel *kern = &job->kern;
    int64_t mc = g->m - m0 < job->mc ? g->m - m0 : job->mc, k = g->k, ldt = job->nc;
    int64_t mc_pad = (mc + kern->mr - 1) / kern->mr * kern->mr;
    int64_t nc_pad = (nc + kern->nr - 1) / kern->nr * kern->nr;
    const void *a = elem(g->dtype, g->a, bb * g->a_batch + m0 * g->a_row);
    if (k == 0) {
        memset(buf->tile, 0, (size_t)(mc_pad * ldt) * sizeof(float));
    } else if (!kern->run) {
        fk_amx_pack((const uint16_t *)a, g->a_row, g->a_col, mc, k, 0, (uint16_t *)buf->a);
        fk_amx_block((const uint16_t *)buf->a, (const uint16_t *)buf->b, mc_pad, nc_pad, k, buf->tile, ldt);
        k = 0; /* done: no fp32 micro-kernel runs below */
    } else {
        pack_panels(g->dtype, a, g->a_row, g->a_col, mc, k, kern->mr, buf->a);
    }
    for (int64_t p0 = 0; p0 < k; p0 += kKc) {
        int64_t kc = k - p0 < kKc ? k - p0 : kKc;
        for (int64_t j = 0; j < nc_pad; j += kern->nr) {
            const float *b_panel = buf->b + j * k + p0 * kern->nr;
            for (int64_t i = 0; i < mc_pad; i += kern->mr)
                kern->run(kc, buf->a + i * k + p0 * kern->mr, b_panel, buf->tile + i * ldt + j, ldt,
                          p0 > 0);
        }
    }
    store_block(g, job->isa, buf, ldt, bb, m0, mc, n0, nc);
}

/* A thread's run of blocks, numbered (batch, column block, row block) with row blocks fastest. */
static void run_blocks(void *ctx, int64_t begin, int64_t end) {
    gemm_job *job = (gemm_job *)ctx;
    const fk_matmul_args *g = job->args;
    int64_t k = g->k, nc_max = job->nc, mc_max = job->mc;
    const int amx = !job->kern.run;
    /* AMX: bf16 panels of whole 16-lane, 32-k tiles (half a float an element) */
    int64_t a_floats = amx ? mc_max * 16 * fk_amx_steps(k) : k * mc_max;
    int64_t b_floats = amx ? nc_max * 16 * fk_amx_steps(k) : k * nc_max;
    gemm_buffers buf = {alloc_floats(a_floats), alloc_floats(b_floats), alloc_floats(mc_max * nc_max),
                        alloc_floats(nc_max)};
    if (!buf.a || !buf.b || !buf.tile || !buf.bias) {
        atomic_store(&job->out_of_memory, 1);
    } else {
        if (amx) fk_amx_begin();
        int64_t packed = -1; /* the (batch, column block) whose B panel buf.b holds */
        for (int64_t t = begin; t < end; t++) {
            int64_t bb = t / (job->n_blocks * job->m_blocks), rest = t % (job->n_blocks * job->m_blocks);
            int64_t jn = rest / job->m_blocks, im = rest % job->m_blocks;
            int64_t n0 = jn * nc_max, nc = g->n - n0 < nc_max ? g->n - n0 : nc_max;
            int64_t key = (g->b_batch ? bb : 0) * job->n_blocks + jn;
            if (key != packed) {
                const void *b = elem(g->dtype, g->b, bb * g->b_batch + n0 * g->b_col);
                if (k && amx) fk_amx_pack((const uint16_t *)b, g->b_col, g->b_row, nc, k, 1, (uint16_t *)buf.b);
                else if (k) pack_panels(g->dtype, b, g->b_col, g->b_row, nc, k, job->kern.nr, buf.b);
                if (g->bias) load_strided(g->dtype, elem(g->dtype, g->bias, n0), 1, nc, buf.bias, 1);
                packed = key;
            }
            run_block(job, &buf, bb, im * mc_max, n0, nc);
        }
        if (amx) fk_amx_end();
    }
    free(buf.a);
    free(buf.b);
    free(buf.tile);
    free(buf.bias);
}

static fk_status gemm_f32(const fk_matmul_args *g, int threads) {
    gemm_job job = {.args = g, .kern = pick_kernel(g->dtype), .isa = fk_cpu_isa()};
    job.mc = job.kern.run ? kMc : kMcAmx;
    /* narrow blocks when n is small; keep the packed B panel (k x nc) within ~8 MiB for huge k */
    int64_t nr = job.kern.nr, nc = (g->n + nr - 1) / nr * nr;
    if (nc > kNcMax) nc = kNcMax;
    while (nc > nr && g->k * nc > ((int64_t)2 << 20)) nc -= nr;
    job.nc = nc;
    job.m_blocks = (g->m + job.mc - 1) / job.mc;
    job.n_blocks = (g->n + nc - 1) / nc;
    atomic_init(&job.out_of_memory, 0);
    int64_t block_flops = 2 * (g->m < job.mc ? g->m : job.mc) * (g->n < nc ? g->n : nc) * (g->k + 1);
    int64_t min_blocks = kBlockMinFlops / (block_flops > 0 ? block_flops : 1) + 1;
    fk_parallel_for(threads, g->batch * job.m_blocks * job.n_blocks, min_blocks, run_blocks, &job);
    if (atomic_load(&job.out_of_memory))
        return fk_fail(FK_ERR_RUNTIME, "matmul: out of memory for the CPU packing buffers");
    return FK_OK;
}

/* ---- fp64: row by row --------------------------------------------------------------------------- */

static void run_rows_f64(void *ctx, int64_t begin, int64_t end) {
    const fk_matmul_args *g = (const fk_matmul_args *)ctx;
    const double *bias = (const double *)g->bias;
    double acc[FK_CHUNK];
    for (int64_t r = begin; r < end; r++) {
        int64_t bb = r / g->m, i = r % g->m;
        const double *a = (const double *)g->a + bb * g->a_batch + i * g->a_row;
        const double *b = (const double *)g->b + bb * g->b_batch;
        for (int64_t j0 = 0; j0 < g->n; j0 += FK_CHUNK) {
            int64_t len = g->n - j0 < FK_CHUNK ? g->n - j0 : FK_CHUNK;
            if (g->b_col == 1) { /* row-major B: acc += a_ip * B[p, :] */
                for (int64_t j = 0; j < len; j++) acc[j] = 0.0;
                for (int64_t p = 0; p < g->k; p++) {
                    const double *brow = b + p * g->b_row + j0;
                    double av = a[p * g->a_col];
                    for (int64_t j = 0; j < len; j++) acc[j] += av * brow[j];
                }
            } else { /* column-major B: dot products down its columns */
                for (int64_t j = 0; j < len; j++) {
                    const double *bcol = b + (j0 + j) * g->b_col;
                    double sum = 0.0;
                    for (int64_t p = 0; p < g->k; p++) sum += a[p * g->a_col] * bcol[p * g->b_row];
                    acc[j] = sum;
                }
            }
            int64_t offset = bb * g->c_batch + i * g->c_row + j0;
            for (int64_t j = 0; j < len; j++) {
                double v = acc[j] + (bias ? bias[j0 + j] : 0.0);
                if (g->pre) ((double *)g->pre)[offset + j] = v;
                if (g->activation != FK_ACT_NONE) v = gelu_f64(v, g->activation == FK_ACT_GELU_TANH);
                ((double *)g->c)[offset + j] = v;
            }
        }
    }
}

/* ---- entry point ------------------------------------------------------------------------------- */

/* An operand's (row, col) strides: one of them 1 (or its dim <= 1), the other at least the length
 * of the unit-stride dim, so that lines never overlap. */
static int operand_ok(int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride) {
    int row_major = (col_stride == 1 || cols <= 1) && row_stride >= (cols > 1 ? cols : 0);
    int col_major = (row_stride == 1 || rows <= 1) && col_stride >= (rows > 1 ? rows : 0);
    return row_major || col_major;
}

static fk_status check_args(const fk_matmul_args *g) {
    if (!g) return fk_fail(FK_ERR_VALUE, "matmul: args is NULL");
    fk_status status = fk_cpu_check_dtype(g->dtype, "matmul");
    if (status != FK_OK) return status;
    if (g->batch < 0 || g->m < 0 || g->n < 0 || g->k < 0)
        return fk_fail(FK_ERR_VALUE, "matmul: negative size (batch %lld, m %lld, n %lld, k %lld)",
                       (long long)g->batch, (long long)g->m, (long long)g->n, (long long)g->k);
    if (g->activation < FK_ACT_NONE || g->activation > FK_ACT_GELU_TANH)
        return fk_fail(FK_ERR_VALUE, "matmul: activation must be 0 (none), 1 (gelu) or 2 "
                       "(gelu_tanh), got %d", g->activation);
    if (g->flags & ~(FK_MM_TF32 | FK_MM_FORCE_GENERAL))
        return fk_fail(FK_ERR_VALUE, "matmul: unknown flags 0x%x", (unsigned)g->flags);
    if (!operand_ok(g->m, g->k, g->a_row, g->a_col))
        return fk_fail(FK_ERR_VALUE, "matmul: a must be row-major (a_col 1, a_row >= k) or "
                       "column-major (a_row 1, a_col >= m), got a_row %lld, a_col %lld for (%lld, %lld)",
                       (long long)g->a_row, (long long)g->a_col, (long long)g->m, (long long)g->k);
    if (!operand_ok(g->k, g->n, g->b_row, g->b_col))
        return fk_fail(FK_ERR_VALUE, "matmul: b must be row-major (b_col 1, b_row >= n) or "
                       "column-major (b_row 1, b_col >= k), got b_row %lld, b_col %lld for (%lld, %lld)",
                       (long long)g->b_row, (long long)g->b_col, (long long)g->k, (long long)g->n);
    if (g->c_row < g->n || g->a_batch < 0 || g->b_batch < 0 || g->c_batch < 0)
        return fk_fail(FK_ERR_VALUE, "matmul: bad output / batch strides (c_row %lld < n %lld, or a "
                       "negative batch stride)", (long long)g->c_row, (long long)g->n);
    int64_t outputs = g->batch * g->m * g->n;
    if (outputs && !g->c) return fk_fail(FK_ERR_VALUE, "matmul: c is NULL");
    if (outputs && g->k && (!g->a || !g->b)) return fk_fail(FK_ERR_VALUE, "matmul: a or b is NULL");
    return FK_OK;
}

fk_status fk_cpu_matmul(const fk_matmul_args *args, int threads) {
    fk_status status = check_args(args);
    if (status != FK_OK || args->batch * args->m * args->n == 0) return status;
    if (args->dtype != FK_FLOAT64) return gemm_f32(args, threads);
    int64_t row_flops = 2 * args->n * (args->k + 1);
    fk_parallel_for(threads, args->batch * args->m, kBlockMinFlops / row_flops + 1, run_rows_f64,
                    (void *)args);
    return FK_OK;
}
