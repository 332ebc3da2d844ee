/* matmul_amx.c's entry points: bf16 blocks of matmul.c's GEMM on Intel AMX tiles. */
#ifndef FASTKERN_CPU_MATMUL_AMX_H
#define FASTKERN_CPU_MATMUL_AMX_H

#include <stdint.h>

/* k-steps of 32 (one tile's depth) covering k. */
static inline int64_t fk_amx_steps(int64_t k) { return (k + 31) / 32; }

/* Whether this CPU has AMX-BF16 and the kernel gave this process its tile state (asked once). */
int fk_amx_bf16_ready(void);
/* A thread's tile configuration, before its first fk_amx_block, and its release after the last. */
void fk_amx_begin(void);
void fk_amx_end(void);
/* Packs a bf16 operand's `lanes` x k (A: rows, vnni 0; B: columns, vnni 1) into
 * 16 * ceil(lanes / 16) * 32 * fk_amx_steps(k) elements of dst (zero-padded). */
void fk_amx_pack(const uint16_t *src, int64_t lane_stride, int64_t k_stride, int64_t lanes, int64_t k,
                 int vnni, uint16_t *dst);
/* tile[i * ldt + j] = sum over k of A (i, :) B (:, j) for i < mc_pad, j < nc_pad (multiples of 32). */
void fk_amx_block(const uint16_t *a_pack, const uint16_t *b_pack, int64_t mc_pad, int64_t nc_pad, int64_t k,
                  float *tile, int64_t ldt);

#endif
