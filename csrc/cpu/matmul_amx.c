/* bf16 matmul blocks on Intel AMX (the tile unit of Sapphire Rapids and later): matmul.c's strategy
 * for bf16 operands where the CPU has AMX-BF16 and the kernel grants this process its tile state.
 *
 * Napkin math: one TDPBF16PS multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 fp32
 * sums, 16384 FLOPs, at about one every 16 cycles: ~1000 FLOP a cycle a core, 16x two AVX-512 FMA
 * ports. torch's bf16 CPU matmul uses AMX (oneDNN): 1024^3 1.6 ms on the 2-core dev VM (~1.3
 * TFLOP/s), against 16 ms for matmul.c's fp32 micro-kernel on bf16 converted while packing.
 *
 * Algorithm: matmul.c's blocks (rows x columns of C, threads over blocks) with bf16 packing:
 *   - A's block rows in panels of 16 rows, each k-step of 32 one 16 x 32 tile (64-byte rows);
 *   - B's block columns in panels of 16 columns, each k-step one 16 x 16-pair tile in the VNNI
 *     order TDPBF16PS reads (row r holds k 2r and 2r + 1 of each column, interleaved);
 *   - zero padding to whole tiles in m, n and k, so the tiles need no masks;
 *   - a 32 x 32 piece of C is four accumulator tiles (tmm0-3) fed by two A (tmm4-5) and two B
 *     (tmm6-7) tiles a k-step; k goes in chunks of 256 (two A panels' chunk stays in L1 while every
 *     B panel goes by), the accumulators stored into the block's fp32 tile and loaded back between.
 * Measured (D-120, 2-core VM): 1024^3 1.23x torch's matmul, 0.45-0.77x at the other shapes tried.
 * Products of bf16 are exact in fp32 and the sums are fp32 over all of k, as torch's AMX path sums:
 * against the bf16 output's rounding (2^-9) their error (~k 2^-24) does not show.
 */
#define _GNU_SOURCE /* syscall */
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "matmul_amx.h"

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define FK_ARCH_REQ_XCOMP_PERM 0x1023
#define FK_XFEATURE_XTILEDATA 18

int fk_amx_bf16_ready(void) {
    static atomic_int ready = -1; /* -1 not asked yet, then 0 / 1 */
    int r = atomic_load(&ready);
    if (r >= 0) return r;
    unsigned eax, ebx, ecx, edx;
    r = 0;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (edx & (1u << 22)) && (edx & (1u << 24)))
        r = syscall(SYS_arch_prctl, FK_ARCH_REQ_XCOMP_PERM, FK_XFEATURE_XTILEDATA) == 0;
    atomic_store(&ready, r);
    return r;
}

/* The tile shapes, loaded once a thread before its blocks: every tile 16 rows of 64 bytes. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

__attribute__((target("amx-tile"))) void fk_amx_begin(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    /* gcc 12 does not see ldtilecfg read the struct and drops the stores above without this */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) void fk_amx_end(void) { _tile_release(); }

/* The 32 x 32 piece of C at c (row stride ldt floats) over k-steps [s0, s1): four accumulator tiles,
 * zeroed (s0 == 0) or loaded from c, fed by two A panels (a0: rows i.., a0 + one panel: i + 16..)
 * and two B panels a step, then stored back. */
__attribute__((target("amx-tile,amx-bf16"))) static void piece(const uint16_t *a0, const uint16_t *b0,
                                                               int64_t steps, int64_t s0, int64_t s1, float *c,
                                                               int64_t ldt) {
    const uint16_t *a1 = a0 + steps * 512, *b1 = b0 + steps * 512;
    const int64_t stride = ldt * 4;
    if (s0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_loadd(0, c, stride);
        _tile_loadd(1, c + 16, stride);
        _tile_loadd(2, c + 16 * ldt, stride);
        _tile_loadd(3, c + 16 * ldt + 16, stride);
    }
    for (int64_t s = s0; s < s1; s++) {
        _tile_loadd(4, a0 + s * 512, 64);
        _tile_loadd(5, a1 + s * 512, 64);
        _tile_loadd(6, b0 + s * 512, 64);
        _tile_loadd(7, b1 + s * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, stride);
    _tile_stored(1, c + 16, stride);
    _tile_stored(2, c + 16 * ldt, stride);
    _tile_stored(3, c + 16 * ldt + 16, stride);
}

/* k in chunks of kChunkSteps steps, so that a chunk of two A panels (16 KB) stays in L1 while the
 * B panels go by; the pieces' sums go to the fp32 tile between chunks. */
#define kChunkSteps 8
void fk_amx_block(const uint16_t *a_pack, const uint16_t *b_pack, int64_t mc_pad, int64_t nc_pad, int64_t k,
                  float *tile, int64_t ldt) {
    const int64_t steps = fk_amx_steps(k);
    for (int64_t s0 = 0; s0 < steps; s0 += kChunkSteps) {
        int64_t s1 = s0 + kChunkSteps < steps ? s0 + kChunkSteps : steps;
        for (int64_t i = 0; i < mc_pad; i += 32)
            for (int64_t j = 0; j < nc_pad; j += 32)
                piece(a_pack + (i / 16) * steps * 512, b_pack + (j / 16) * steps * 512, steps, s0, s1,
                      tile + i * ldt + j, ldt);
    }
}

/* Two k rows of 16 lanes (even, odd) interleaved into one VNNI row: even[0], odd[0], even[1], ...
 * (fk_amx_pack takes the same target, so that this inlines: AMX CPUs have AVX-512 BW) */
#define FK_AMX_PACK_ATTRS __attribute__((target("avx512f,avx512bw")))
static inline FK_AMX_PACK_ATTRS void interleave16(const uint16_t *even, const uint16_t *odd,
                                                                     uint16_t *out) {
    static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)even)),
                                      _mm256_loadu_si256((const __m256i *)odd), 1);
    _mm512_storeu_si512(out, _mm512_permutexvar_epi16(_mm512_loadu_si512(order), both));
}

#else

int fk_amx_bf16_ready(void) { return 0; }
void fk_amx_begin(void) {}
void fk_amx_end(void) {}
void fk_amx_block(const uint16_t *a_pack, const uint16_t *b_pack, int64_t mc_pad, int64_t nc_pad, int64_t k,
                  float *tile, int64_t ldt) {
    (void)a_pack, (void)b_pack, (void)mc_pad, (void)nc_pad, (void)k, (void)tile, (void)ldt;
}
#define FK_AMX_PACK_ATTRS
static void interleave16(const uint16_t *even, const uint16_t *odd, uint16_t *out) {
    for (int l = 0; l < 16; l++) out[2 * l] = even[l], out[2 * l + 1] = odd[l];
}

#endif

/* Packs `lanes` lanes (A's rows or B's columns) by k of a bf16 operand into 16-lane panels of
 * 32-k steps (zeros past `lanes` and k): tile (panel, step) holds, for A (vnni 0), (lane l, k p) at
 * [l % 16][p % 32], for B (vnni 1) in the VNNI order at [(p % 32) / 2][l % 16][p % 2]. Element
 * (l, p) is at src[l * lane_stride + p * k_stride]. Whole tiles copy along the unit stride: 64-byte
 * rows (A, k contiguous), 4-byte k pairs (B, k contiguous), or two interleaved k rows (B, lanes
 * contiguous); tiles at the edges go element by element. */
FK_AMX_PACK_ATTRS void fk_amx_pack(const uint16_t *src, int64_t lane_stride, int64_t k_stride, int64_t lanes,
                                   int64_t k, int vnni, uint16_t *dst) {
    int64_t steps = fk_amx_steps(k), panels = (lanes + 15) / 16;
    for (int64_t panel = 0; panel < panels; panel++) {
        for (int64_t step = 0; step < steps; step++) {
            uint16_t *t = dst + (panel * steps + step) * 512;
            int64_t l0 = panel * 16, p0 = step * 32;
            const uint16_t *s = src + l0 * lane_stride + p0 * k_stride;
            if (l0 + 16 > lanes || p0 + 32 > k) { /* an edge tile */
                memset(t, 0, 512 * sizeof(uint16_t));
                for (int64_t l = 0; l < 16 && l0 + l < lanes; l++)
                    for (int64_t p = 0; p < 32 && p0 + p < k; p++)
                        t[vnni ? (p / 2) * 32 + l * 2 + p % 2 : l * 32 + p] = s[l * lane_stride + p * k_stride];
            } else if (!vnni && k_stride == 1) {
                for (int l = 0; l < 16; l++) memcpy(t + l * 32, s + l * lane_stride, 64);
            } else if (vnni && k_stride == 1) {
                for (int l = 0; l < 16; l++)
                    for (int r = 0; r < 16; r++) memcpy(t + r * 32 + l * 2, s + l * lane_stride + 2 * r, 4);
            } else if (vnni && lane_stride == 1) {
                for (int r = 0; r < 16; r++) interleave16(s + 2 * r * k_stride, s + (2 * r + 1) * k_stride, t + r * 32);
            } else { /* A with its rows' lanes contiguous (column-major) */
                for (int p = 0; p < 32; p++)
                    for (int l = 0; l < 16; l++) t[l * 32 + p] = s[l * lane_stride + p * k_stride];
            }
        }
    }
}
