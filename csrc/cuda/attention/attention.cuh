// Shared by the attention strategies: the kernel parameters, the plan, the per-sequence geometry
// (varlen offsets, the mask band and the tile ranges it implies), shared-memory tile loads and the
// register-fragment helpers of the mma.sync kernels. dispatch.cu decides which strategy runs.
#pragma once

#include "../common.cuh"
#include "../matmul/matmul.cuh"  // cp.async, ldmatrix, mma.sync wrappers and the swizzled tile

namespace fk::attn {

using mm::cp_async_16;
using mm::cp_async_commit;
using mm::cp_async_wait;
using mm::ldmatrix_x4;
using mm::ldmatrix_x4_trans;
using mm::mma_m16n8k16;
using mm::SwizzledTile;

// fk_attention_args as the kernels take it (by value), plus what the plan adds.
struct Params {
    const void *q, *k, *v;
    void *out;
    float *lse;
    const void *dout;
    void *dq, *dk, *dv;
    const int32_t *cu_q, *cu_k;
    int64_t batch, sq, sk, heads, kv_heads, d;
    int64_t q_batch, q_row, q_head;
    int64_t k_batch, k_row, k_head;
    int64_t v_batch, v_row, v_head;
    int64_t o_batch, o_row, o_head;
    int64_t do_batch, do_row, do_head;
    float scale, scale_log2;          // scale, and scale * log2(e) for exp2
    int64_t window_left, window_right;
    bool top_left;
    bool async;                       // rows 16-byte aligned: cp.async loads, else element loads
    bool pack_gqa;                    // forward: a CTA's rows are (query, head of the kv head's group)
    int splits;                       // forward: key ranges per query tile (1: no split)
    float *part_out, *part_lse;       // split forward: partial outputs (fp32) and their lse
    float *dvec;                      // backward: rowsum(dO * O), (batch, heads, sq) fp32 (bwd_wgmma_sm90:
                                      // its whole workspace, laid out there)
    unsigned long long *next_tile;    // fwd_wgmma_sm90's dynamic walk: tiles claimed past the grid's
                                      // first (its workspace, zeroed by the launch); NULL: static walk
};

// A/B switches (FASTKERN_NVCC_FLAGS=-D...): the key tile of the forward and of the dQ kernel at
// D <= 128, and whether the Hopper forward's persistent CTAs claim their tiles from a counter (else
// a static walk).
#ifndef FK_ATTN_FWD_BN  // D 128
#define FK_ATTN_FWD_BN 64
#endif
#ifndef FK_ATTN_FWD_BN_D64
#define FK_ATTN_FWD_BN_D64 64
#endif
#ifndef FK_ATTN_FWD_Q_REGS  // fwd_mma_sm80 at D 64: Q's fragments in registers for the whole key loop
#define FK_ATTN_FWD_Q_REGS 1
#endif
#ifndef FK_ATTN_DQ_BN
#define FK_ATTN_DQ_BN 64
#endif
#ifndef FK_ATTN_DKV_BM  // query rows a ring slot of the dK / dV kernel at D 128
#define FK_ATTN_DKV_BM 32
#endif
#ifndef FK_ATTN_FWD_DYNAMIC  // the Hopper forward's persistent CTAs claim tiles from a counter
#define FK_ATTN_FWD_DYNAMIC 1
#endif

// ---- host side ----------------------------------------------------------------------------------

enum class Strategy {
    kEmpty, kFwdMmaSm80, kFwdSplitMmaSm80, kFwdDecodeMmaSm80, kFwdWgmmaSm90, kBwdMmaSm80, kBwdAtomicMmaSm80,
    kBwdWgmmaSm90
};
const char *strategy_name(Strategy s);

struct Plan {
    Strategy strategy = Strategy::kEmpty;
    int d_bucket = 0;   // 64, 128 or 256: the template instance; columns >= d are predicated off
                        // (fwd_wgmma_sm90: d itself, 64 or 128)
    int splits = 1;     // split-KV forward: key ranges per query tile (fwd_decode: per kv head)
    int stages = 0;     // fwd_decode_mma_sm80: (K, V) slots of each warp's ring
    bool cluster = false;   // fwd_decode_mma_sm80: the splits of a kv head merge in a cluster (sm_90)
    bool pack_gqa = false;  // forward: the heads sharing a kv head packed into one CTA's rows
    bool persistent = false;  // fwd_wgmma_sm90: one CTA an SM walking the query tiles (else one a tile)
    bool dynamic = false;     // fwd_wgmma_sm90 persistent: CTAs claim tiles from a counter (workspace)
    int64_t workspace_bytes = 0;
};

// The split (flash-decoding) forward's tile, every D bucket: 64 query rows x 32 keys; its K / V ring
// has 3 stages at D <= 128 (64 KB of shared memory: 3 CTAs an SM), 2 at D 256 (96 KB: 2).
constexpr int kSplitBM = 64, kSplitBN = 32;
// fwd_mma_sm80's key tile (whole form) per head-dim bucket: 64 at D 64 (Q in registers; FA2's 128
// keys spill: 0.92 / 0.80x FLASH full / causal against 0.96 / 0.89x, D-129) and at D 128 (32: -3%);
// D 256 runs the split shape.
constexpr int fwd_block_n(int bucket) { return bucket <= 64 ? FK_ATTN_FWD_BN_D64 : bucket <= 128 ? FK_ATTN_FWD_BN : kSplitBN; }
constexpr int split_stages(int bucket) { return bucket <= 128 ? 3 : 2; }
constexpr int split_slots(int bucket) { return bucket <= 128 ? 3 : 2; }

// fwd_decode_mma_sm80: the rows of a kv head (sq x group) in one 16-row mma tile, 4 warps
// (FK_ATTN_DECODE_WARPS) each streaming its own key tiles (K and V: 16 KB together, 32 keys at D
// 128; 8 warps: 8 KB, 16 keys, level within 1%, D-134) through a ring of 2 or 3 slots (as shared
// memory allows). The splits of a kv head merge in a cluster of at most 8.
#ifndef FK_ATTN_DECODE_WARPS
#define FK_ATTN_DECODE_WARPS 4
#endif
constexpr int kDecodeRows = 16, kDecodeWarps = FK_ATTN_DECODE_WARPS, kDecodeMaxCluster = 8;
constexpr int decode_block_n(int bucket) { return 4 * 32 * 128 / (kDecodeWarps * (bucket <= 64 ? 64 : 128)); }
constexpr int decode_smem_bytes(int bucket, int stages) {
    return 2 * (kDecodeRows * bucket + kDecodeWarps * stages * 2 * decode_block_n(bucket) * bucket);
}
// Clusters of k of its CTAs (stages slots, D 128) the device holds at once (0: none, or not sm_90a).
int decode_clusters_fit(int device, int k, int stages);

// bwd_wgmma_sm90's and bwd_atomic_mma_sm80's queries a step at head-dim instance D (their
// workspace rounds sq up to them).
constexpr int bwd_wgmma_block_m(int d) { return d == 64 ? 128 : 64; }
constexpr int bwd_atomic_block_m(int d) { return d == 64 ? 128 : 64; }

// The atomic backwards' fp32 workspace (bwd_wgmma_sm90, bwd_atomic_mma_sm80; bwd_workspace.cu):
// lse log2 e and D = rowsum(dO O), (batch, heads, m_tiles x 64) each (padding rows: +inf, 0), then
// dQ, a 64 x cols tile per (batch, head, 64 query rows) in accumulator order: the tile-local float
// index of (row, col), cl = col % 64, is (col / 64) x 4096 + (cl / 8) x 512 + 4 t + 2 ((row / 8) &
// 1) + (col & 1), t = 32 (row / 16) + 4 (row % 8) + (cl % 8) / 2: the m16n8 accumulator of the
// warp owning rows 16 (row / 16) .. + 15 (an m64n64 wgmma's warp w), n8 block cl / 8, is one
// coalesced float4 a lane. sq rounds up to the query step block_m; varlen uses the longest sequence.
constexpr int kBwdRowTile = 64;
struct BwdWork {
    float *lse2, *dvec, *dq;
    int m_tiles;  // 64-row tiles a (sequence, head)
};
inline int64_t bwd_work_rows(int64_t batch, int64_t heads, int64_t sq, int block_m) {
    return batch * heads * ((sq + block_m - 1) / block_m * block_m);
}
inline int64_t bwd_workspace_bytes(int64_t batch, int64_t heads, int64_t sq, int block_m, int cols) {
    return bwd_work_rows(batch, heads, sq, block_m) * (2 + cols) * (int64_t)sizeof(float);
}
inline BwdWork bwd_work(const Params &p, int block_m) {
    BwdWork ws;
    ws.m_tiles = (int)((p.sq + block_m - 1) / block_m * (block_m / kBwdRowTile));
    const int64_t rows = bwd_work_rows(p.batch, p.heads, p.sq, block_m);
    ws.lse2 = p.dvec, ws.dvec = p.dvec + rows, ws.dq = p.dvec + 2 * rows;  // p.dvec: the workspace
    return ws;
}
// Before the main kernel: lse2, dvec and a zeroed dQ; after it: dq = scale dQ (bwd_workspace.cu).
fk_status launch_bwd_prep(const BwdWork &ws, int cols, const Params &p, fk_dtype dtype, int device,
                          cudaStream_t stream);
fk_status launch_bwd_dq_convert(const BwdWork &ws, int cols, const Params &p, fk_dtype dtype, int device,
                                cudaStream_t stream);

fk_status launch_fwd_mma_sm80(const Plan &plan, const Params &p, fk_dtype dtype, int device, cudaStream_t stream);
fk_status launch_fwd_decode_mma_sm80(const Plan &plan, const Params &p, fk_dtype dtype, int device,
                                    cudaStream_t stream);
// The split forwards' second pass: out and lse from p.splits fp32 partials (fwd_mma_sm80.cu).
fk_status launch_fwd_combine(const Params &p, fk_dtype dtype, int device, cudaStream_t stream);
fk_status launch_fwd_wgmma_sm90(const Plan &plan, const Params &p, fk_dtype dtype, int device, cudaStream_t stream);
fk_status launch_bwd_mma_sm80(const Plan &plan, const Params &p, fk_dtype dtype, int device, cudaStream_t stream);
fk_status launch_bwd_atomic_mma_sm80(const Plan &plan, const Params &p, fk_dtype dtype, int device,
                                    cudaStream_t stream);
fk_status launch_bwd_wgmma_sm90(const Plan &plan, const Params &p, fk_dtype dtype, int device, cudaStream_t stream);

// ---- per-sequence geometry ----------------------------------------------------------------------

// Sequence b: its first row in the dense outputs (varlen: in q / k), its lengths, the mask's shift.
struct Seq {
    int64_t q0, k0;  // first row of the sequence in (batch * sq | total_q) and (batch * sk | total_k)
    int sq, sk;      // its lengths
    int64_t shift;   // query i sees key j iff j - i - shift in [-window_left, window_right]
};

__device__ __forceinline__ Seq seq_of(const Params &p, int b) {
    Seq s;
    if (p.cu_q) {
        s.q0 = p.cu_q[b];
        s.sq = p.cu_q[b + 1] - p.cu_q[b];
        s.k0 = p.cu_k[b];
        s.sk = p.cu_k[b + 1] - p.cu_k[b];
    } else {
        s.q0 = (int64_t)b * p.sq;  // row offset in the dense (batch, s, ...) outputs
        s.sq = (int)p.sq;
        s.k0 = (int64_t)b * p.sk;
        s.sk = (int)p.sk;
    }
    s.shift = p.top_left ? 0 : (int64_t)s.sk - s.sq;
    return s;
}

// Offset of sequence b's row 0 in an input strided like q (rows q_row, sequences q_batch; varlen:
// row `first` of the packed rows).
__device__ __forceinline__ int64_t seq_offset(const Params &p, int b, int64_t first, int64_t batch_stride,
                                              int64_t row_stride) {
    return p.cu_q ? first * row_stride : (int64_t)b * batch_stride;
}

// Index of (b, h, i) in the fp32 lse: (batch, heads, sq), or (heads, total_q) for varlen.
__device__ __forceinline__ int64_t lse_index(const Params &p, const Seq &s, int b, int h, int i) {
    if (p.cu_q) return (int64_t)h * p.cu_q[p.batch] + s.q0 + i;
    return ((int64_t)b * p.heads + h) * p.sq + i;
}

// Index of (b, h, i) in the per-row fp32 workspaces (dvec, split lse): (batch, heads, sq max).
__device__ __forceinline__ int64_t row_index(const Params &p, int b, int h, int i) {
    return ((int64_t)b * p.heads + h) * p.sq + i;
}

// The half-open key range [lo, hi) that query rows [m0, m1) see (hi <= lo: none).
struct Range { int lo, hi; };
__device__ __forceinline__ Range key_range(const Params &p, const Seq &s, int m0, int m1) {
    int64_t lo = 0, hi = s.sk;
    if (p.window_left >= 0) lo = max(lo, (int64_t)m0 + s.shift - p.window_left);
    if (p.window_right >= 0) hi = min(hi, (int64_t)m1 - 1 + s.shift + p.window_right + 1);
    return {(int)lo, (int)max(hi, lo)};
}
// The query range [lo, hi) that sees at least one of keys [n0, n1).
__device__ __forceinline__ Range query_range(const Params &p, const Seq &s, int n0, int n1) {
    int64_t lo = 0, hi = s.sq;
    if (p.window_right >= 0) lo = max(lo, (int64_t)n0 - s.shift - p.window_right);
    if (p.window_left >= 0) hi = min(hi, (int64_t)n1 - 1 - s.shift + p.window_left + 1);
    return {(int)lo, (int)max(hi, lo)};
}
// Intersects each lane's key range [lo, hi) with those of the lanes whose index differs from it in
// bit kFirst and above (kFirst 1: the whole warp; 4: the lanes holding the same fragment column).
template <int kFirst> __device__ __forceinline__ void warp_key_range(int &lo, int &hi) {
#pragma unroll
    for (int o = kFirst; o < 32; o *= 2) {
        lo = max(lo, __shfl_xor_sync(0xffffffffu, lo, o));
        hi = min(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    }
}
// Whether query i sees key j (both inside the sequence's lengths).
__device__ __forceinline__ bool visible(const Params &p, const Seq &s, int i, int j) {
    const int64_t rel = (int64_t)j - i - s.shift;
    return j < s.sk && i < s.sq && (p.window_right < 0 || rel <= p.window_right) &&
           (p.window_left < 0 || rel >= -p.window_left);
}
// Whether every (i, j) of rows [m0, m0 + bm) x keys [n0, n0 + bn) is visible (no masking needed).
__device__ __forceinline__ bool tile_visible(const Params &p, const Seq &s, int m0, int bm, int n0, int bn) {
    return n0 + bn <= s.sk && m0 + bm <= s.sq &&
           (p.window_right < 0 || (int64_t)n0 + bn - 1 - m0 - s.shift <= p.window_right) &&
           (p.window_left < 0 || (int64_t)n0 - (m0 + bm - 1) - s.shift >= -p.window_left);
}

// ---- shared-memory tiles ------------------------------------------------------------------------

// Loads rows x cols (cols a multiple of 8) of g (row stride `stride` elements) into the swizzled
// kRows x kCols tile; the rest of the tile is zero-filled. async: 16-byte cp.async (rows 16-byte
// aligned), else element loads through registers (any alignment).
template <typename T, int kRows, int kCols, int kThreads>
__device__ __forceinline__ void load_tile(T *smem, const T *g, int64_t stride, int rows, int cols, bool async) {
    using Tile = SwizzledTile<kRows, kCols>;
    constexpr int kChunksPerRow = kCols / 8, kChunks = kRows * kChunksPerRow;
    constexpr int kPerThread = (kChunks + kThreads - 1) / kThreads;
    if (async) {
#pragma unroll
        for (int i = 0; i < kPerThread; i++) {
            const int idx = i * kThreads + threadIdx.x;
            if (kChunks % kThreads != 0 && idx >= kChunks) break;
            const int r = idx / kChunksPerRow, c = (idx % kChunksPerRow) * 8;
            const bool in = r < rows && c < cols;
            cp_async_16(smem + Tile::offset(r, c), g + (in ? r * stride + c : 0), in ? 16 : 0);
        }
    } else {
        // One chunk at a time: unrolled, the element loads would hold registers the kernels'
        // accumulators need (they are live across this call).
#pragma unroll 1
        for (int i = 0; i < kPerThread; i++) {
            const int idx = i * kThreads + threadIdx.x;
            if (idx >= kChunks) break;
            const int r = idx / kChunksPerRow, c = (idx % kChunksPerRow) * 8;
            const bool in = r < rows && c < cols;
            const T *src = g + (in ? r * stride + c : 0);
            Pack<T> v;
#pragma unroll
            for (int e = 0; e < 8; e++) v.v[e] = in ? src[e] : from_f32<T>(0.0f);
            store_pack(smem + Tile::offset(r, c), v);
        }
    }
}

// The same for rows at arbitrary addresses: row r (< rows) starts at row_ptr(r).
template <typename T, int kRows, int kCols, int kThreads, typename RowPtr>
__device__ __forceinline__ void load_rows(T *smem, int rows, int cols, bool async, RowPtr row_ptr) {
    using Tile = SwizzledTile<kRows, kCols>;
    constexpr int kChunksPerRow = kCols / 8, kChunks = kRows * kChunksPerRow;
#pragma unroll 1
    for (int idx = threadIdx.x; idx < kChunks; idx += kThreads) {
        const int r = idx / kChunksPerRow, c = (idx % kChunksPerRow) * 8;
        const bool in = r < rows && c < cols;
        const T *src = in ? row_ptr(r) + c : row_ptr(0);
        if (async) {
            cp_async_16(smem + Tile::offset(r, c), src, in ? 16 : 0);
        } else {
            Pack<T> v;
#pragma unroll
            for (int e = 0; e < 8; e++) v.v[e] = in ? src[e] : from_f32<T>(0.0f);
            store_pack(smem + Tile::offset(r, c), v);
        }
    }
}

// ---- register fragments -------------------------------------------------------------------------

// Two fp32 values as one register of two 16-bit T (lo in the low half).
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    } else {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
}

// The A fragment (16 x 16, k = columns 16 kk .. 16 kk + 15) made of two m16n8 accumulator tiles
// 2 kk and 2 kk + 1: the accumulator layout of m16n8k16 is the A layout of the next product.
template <typename T, int N>
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&c)[N][4], int kk) {
    a[0] = pack2<T>(c[2 * kk][0], c[2 * kk][1]);
    a[1] = pack2<T>(c[2 * kk][2], c[2 * kk][3]);
    a[2] = pack2<T>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[3] = pack2<T>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// A fragment of rows m .. m + 15, columns kk .. kk + 15 of a row-major swizzled tile.
template <typename Tile, typename T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T *tile, int m, int kk, int lane) {
    ldmatrix_x4(a, tile + Tile::offset(m + (lane & 15), kk + (lane >> 4) * 8));
}
// B fragments of n-tiles n / 8 and n / 8 + 1, k = kk .. kk + 15, from a tile whose rows are n
// (k contiguous, "K-major": K for Q Kᵀ).
template <typename Tile, typename T>
__device__ __forceinline__ void load_b_rows_n(uint32_t (&b0)[2], uint32_t (&b1)[2], const T *tile, int n, int kk, int lane) {
    const int j = lane >> 3, r = lane & 7;
    uint32_t q[4];
    ldmatrix_x4(q, tile + Tile::offset(n + (j >> 1) * 8 + r, kk + (j & 1) * 8));
    b0[0] = q[0], b0[1] = q[1], b1[0] = q[2], b1[1] = q[3];
}
// The same from a tile whose rows are k (n contiguous: V for P V).
template <typename Tile, typename T>
__device__ __forceinline__ void load_b_rows_k(uint32_t (&b0)[2], uint32_t (&b1)[2], const T *tile, int n, int kk, int lane) {
    const int j = lane >> 3, r = lane & 7;
    uint32_t q[4];
    ldmatrix_x4_trans(q, tile + Tile::offset(kk + (j & 1) * 8 + r, n + (j >> 1) * 8));
    b0[0] = q[0], b0[1] = q[1], b1[0] = q[2], b1[1] = q[3];
}

// Sum / max over the 4 lanes of a quad (the lanes holding one accumulator row).
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// A fragment (rows m .. m + 15, k = kk .. kk + 15) from a tile stored transposed (rows k, m
// contiguous: dSᵀ for dS K).
template <typename Tile, typename T>
__device__ __forceinline__ void load_a_trans(uint32_t (&a)[4], const T *tile, int m, int kk, int lane) {
    const int j = lane >> 3, r = lane & 7;
    ldmatrix_x4_trans(a, tile + Tile::offset(kk + (j >> 1) * 8 + r, m + (j & 1) * 8));
}

// ldmatrix x4 (.trans with kTrans) at element offset (lane_off ^ x) + y of a swizzled tile: lane_off
// the lane's Tile::offset for the first block, x a column step (a multiple of 8 below the tile's
// width whose bits the first column's chunk index does not use), y a row step (a multiple of 8
// rows, in elements). The swizzle permutes a row's 16-byte chunks by the row's low 3 bits, which
// 8-row steps keep, so a column step is one XOR instead of the offset's arithmetic.
template <bool kTrans, typename T>
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const T *tile, int lane_off, int x, int y) {
    if constexpr (kTrans) ldmatrix_x4_trans(r, tile + ((lane_off ^ x) + y));
    else ldmatrix_x4(r, tile + ((lane_off ^ x) + y));
}

// p[0..3] += v[0..3] in global memory, no result: red.global.add.v4.f32 (one 16-byte reduction,
// sm_90), four scalar red.global.add.f32 before sm_90. p 16-byte aligned.
__device__ __forceinline__ void red_add_f32x4(float *p, const float (&v)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(v[0]), "f"(v[1]), "f"(v[2]),
                 "f"(v[3])
                 : "memory");
#else
#pragma unroll
    for (int e = 0; e < 4; e++) asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p + e), "f"(v[e]) : "memory");
#endif
}

// Stores two adjacent elements (v0 at p[0], v1 at p[1]) as T: one 4-byte store when aligned.
template <typename T> __device__ __forceinline__ void store2(T *p, float v0, float v1) {
    if ((reinterpret_cast<uintptr_t>(p) & 3) == 0) {
        *reinterpret_cast<uint32_t *>(p) = pack2<T>(v0, v1);
    } else {
        p[0] = from_f32<T>(v0);
        p[1] = from_f32<T>(v1);
    }
}

}  // namespace fk::attn
