// attention_fwd_mma_sm80: flash-attention forward on the tensor cores of every GPU from sm_80
// (mma.sync m16n8k16, fp16 / bf16 in, fp32 accumulate), and attention_fwd_combine, the second pass
// of its split-KV (flash-decoding) form. dispatch.cu rows "fwd" and "fwd split".
//
// Napkin math: 4 B H Sq Sk D FLOPs (half when causal). B 4, H 16, S 4096, D 128: 137 GFLOP, 0.18 ms
// at the H100's mma.sync rate (~2/3 of its dense wgmma 990 TFLOP/s, so ~650; FlashAttention-2, also
// mma.sync, reaches 340-350 TFLOP/s on the H200, PERF.md). A CTA of BM query rows reads each K / V
// tile once for BM rows: 128 x 64 x 128 tiles do 4 MFLOP per 32 KB loaded, 128 FLOPs a byte, far
// above what L2 must feed. The exponentials (Sq Sk MUFU ops, 1/(4 D) of the MMA FLOPs at D 128) and
// the softmax bookkeeping are the real cost beside the MMAs. Two CTAs an SM of 4 warps at ~255
// registers leave 2 warps a scheduler, so the loop is issue-bound: a 32 x 64 x 64 warp step is 128
// mma.sync (~6 cycles each a scheduler) against ~1000 other instructions before D-129 (swizzle
// arithmetic for every ldmatrix and cp.async, 64-bit mask tests each tile). Now: ldmatrix
// addresses are one XOR from a lane offset, a cp.async chunk two fixed offsets, the mask test one
// compare against the warp's common key range, Q's fragments stay in registers at D 64.
// Measured (H200, bf16, TFLOP/s and x SDPA FLASH in the same process, D-129): (16, 1024, 32, 64)
// full / causal 268 / 192 (0.97 / 0.88x), (4, 4096, 16, 128) 316 / 281 (0.94 / 0.93x), (8, 2048,
// 16, 128) 307 / 251 (0.94 / 0.90x). The split form now serves short queries whose rows exceed
// one 16-row tile a kv head (decoding went to fwd_decode_mma_sm80, D-134: 72.5 -> 64.7 us for B 8
// H 32/8 Sq 1 Sk 8192).
//
// Algorithm: one CTA per (query tile of BM rows, head, sequence[, key range]); 4 warps each own
// 32 query rows (D 256: 16); query tiles launch last first (the longest under a causal band). Q is
// loaded once into shared memory (D 64: then into registers); K / V tiles of BN keys stream through
// a two-slot cp.async ring (tile t + 1 lands while tile t computes). Per tile: S = Q Kᵀ (fp32
// accumulators), the mask on tiles that cross its band or the sequence end, the online softmax in
// registers (exp2, scale x log2(e) folded into one FFMA; running max and sum per row, O
// rescaled), then O += P V with P converted in registers into the A operand. Key tiles
// outside the mask band are never visited (the loop bounds come from the mask). Epilogue: O / sum,
// lse = (max + log2(sum)) ln 2 (max in log2 units); a row with no visible key: out 0, lse +inf; O
// goes through the warp's own rows of the Q tile and out in 16-byte row chunks (16-byte rows).
// Split form: the CTA's key tiles are cut into p.splits ranges (blockIdx.z), each writing an fp32
// partial O and its lse to the workspace; attention_fwd_combine merges them (one warp a row). GQA
// (p.pack_gqa: sq x group <= BM) packs the heads sharing a kv head into one CTA's rows, so K / V
// are read once per group and the rows fill warps instead of one row a CTA.
//
// Head dims: instances for D buckets 64, 128, 256; columns d .. bucket are zero-filled in shared
// memory (the MMAs run over the whole bucket: unpredicated, fully unrolled) and never stored, so
// d 72 costs what d 128 does. Rows not 16-byte aligned take element loads into the same ring
// (p.async false).
#include "attention.cuh"

namespace fk::attn {
namespace {

// Tile shape per D bucket: kWarps warps of kMT x 16 query rows (BM in all), BN keys a K / V tile
// (attention.cuh fwd_block_n), kStages K / V slots. Two row tiles a warp use each K / V fragment
// read from shared memory twice (ldmatrix traffic per MMA 0.31 instead of 0.5); D 256 has no
// registers for a second 16 x 256 fp32 output tile. The split (decoding) form streams K / V with
// little math per byte: 64 x 32 tiles (the D 256 shape: no spills, D 128 had 255 registers and
// spilled) in a deeper ring, and small enough that 3 CTAs share an SM (attention.cuh split_slots):
// more bytes in flight. kQRegs: Q's fragments stay in registers for the whole key loop (D 64 only:
// 32 registers; D 128's 64 do not fit beside its output tile).
template <int D, bool kSplit = false> struct FwdCfg {
    static constexpr int kD = D, kWarps = 4;
    static constexpr int kMT = D <= 128 && !kSplit ? 2 : 1;
    static constexpr int BM = 16 * kMT * kWarps, BN = kSplit ? kSplitBN : fwd_block_n(D);
    static constexpr int kStages = kSplit ? split_stages(D) : 2;
    static constexpr bool kQRegs = !kSplit && D == 64 && FK_ATTN_FWD_Q_REGS;
    static_assert(!kSplit || BM == kSplitBM, "the plan counts the split kernel's CTAs by kSplitBM");
    static constexpr int kThreads = 32 * kWarps, kMinBlocks = kSplit && D <= 128 ? split_slots(D) : 1;
    using QTile = SwizzledTile<BM, D>;
    using KVTile = SwizzledTile<BN, D>;
    // Q, then kStages slots of (K, V): 128 x 128 + 4 x 64 x 128 16-bit = 96 KB at D 128 (2 CTAs an
    // SM), 128 x 64 + 4 x 64 x 64 = 48 KB at D 64; split 64 x 128 + 6 x 32 x 128 = 64 KB.
    static constexpr int kSmemBytes = 2 * (QTile::kElems + 2 * kStages * KVTile::kElems);
    static_assert(!kSplit || split_slots(D) * kSmemBytes <= 227 * 1024, "split_slots CTAs fit an SM");
};

// A K / V tile (kRows x kCols, rows of g `stride` apart) by cp.async into the swizzled tile, rows
// >= rows and columns >= cols zero-filled. Thread chunk i is row i kRowStep + tr, columns tc .. tc
// + 7: with kRowStep a multiple of 8 rows every chunk has the first one's swizzle, so the chunks
// are two offsets stepped by constants (kFastKV; else load_tile's general indexing). Nothing
// stays live between tiles (the loop's registers are full).
template <int kRows, int kCols, int kThreads>
constexpr bool kFastKV = kThreads % (kCols / 8) == 0 && (kThreads / (kCols / 8)) % 8 == 0 &&
                         kRows % (kThreads / (kCols / 8)) == 0;
template <typename T, int kRows, int kCols, int kThreads>
__device__ __forceinline__ void load_kv_tile(T *smem, const T *g, int64_t stride, int rows, int cols) {
    constexpr int kPerRow = kCols / 8, kRowStep = kThreads / kPerRow;
    const int tr = threadIdx.x / kPerRow, tc = threadIdx.x % kPerRow * 8;
    T *dst = smem + SwizzledTile<kRows, kCols>::offset(tr, tc);
    const T *src = g + tr * stride + tc;
#pragma unroll
    for (int i = 0; i < kRows / kRowStep; i++) {
        const bool in = tc < cols && i * kRowStep + tr < rows;
        cp_async_16(dst + i * kRowStep * kCols, in ? src + i * kRowStep * stride : g, in ? 16 : 0);
    }
}

constexpr float kLn2 = 0.693147180559945309f;

template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks) attention_fwd_mma_sm80(Params p) {
    constexpr int D = Cfg::kD, BM = Cfg::BM, BN = Cfg::BN, kMT = Cfg::kMT, kNT = BN / 8, kDT = D / 8;
    constexpr int kStages = Cfg::kStages, kThreads = Cfg::kThreads;
    constexpr bool kQRegs = Cfg::kQRegs;
    using QTile = typename Cfg::QTile;
    using KVTile = typename Cfg::KVTile;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *sq_tile = reinterpret_cast<T *>(smem_raw);
    T *sk_tile = sq_tile + QTile::kElems;           // slot s: sk_tile + s * KVTile::kElems
    T *sv_tile = sk_tile + kStages * KVTile::kElems;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // Rows of a (sequence, blockIdx.y): queries of head blockIdx.y, or with p.pack_gqa the queries
    // of every head sharing kv head blockIdx.y, row r = query r / group of head g group + r % group.
    const int group = (int)(p.heads / p.kv_heads), b = blockIdx.z / p.splits, split = blockIdx.z % p.splits;
    const int g = p.pack_gqa ? blockIdx.y : blockIdx.y / group;
    const int d = (int)p.d;
    auto row_query = [&](int r) { return p.pack_gqa ? r / group : r; };
    auto row_head = [&](int r) { return p.pack_gqa ? g * group + r % group : (int)blockIdx.y; };
    grid_dependency_sync();
    const Seq s = seq_of(p, b);
    const int rows = p.pack_gqa ? s.sq * group : s.sq;
    // Query tiles launch last first: under a causal band they see the most keys, and started first
    // they leave the short ones to fill the last wave.
    const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;
    if (m0 >= rows) return;  // varlen: this sequence is shorter than the longest

    const T *q = static_cast<const T *>(p.q) + seq_offset(p, b, s.q0, p.q_batch, p.q_row);
    const T *k = static_cast<const T *>(p.k) + seq_offset(p, b, s.k0, p.k_batch, p.k_row) + g * p.k_head;
    const T *v = static_cast<const T *>(p.v) + seq_offset(p, b, s.k0, p.v_batch, p.v_row) + g * p.v_head;

    // Key tiles [t_lo, t_hi) this CTA visits: the mask band of its rows, then its split's share.
    const Range keys = key_range(p, s, row_query(m0), row_query(min(m0 + BM, rows) - 1) + 1);
    int t_lo = keys.lo / BN, t_hi = keys.hi > keys.lo ? (keys.hi + BN - 1) / BN : t_lo;
    if (p.splits > 1) {
        const int per = (t_hi - t_lo + p.splits - 1) / p.splits;
        t_lo = min(t_hi, t_lo + split * per);
        t_hi = min(t_hi, t_lo + per);
    }

    if (p.pack_gqa)
        load_rows<T, BM, D, kThreads>(sq_tile, rows - m0, d, p.async, [&](int r) {
            return q + (int64_t)row_query(m0 + r) * p.q_row + row_head(m0 + r) * p.q_head;
        });
    else
        load_tile<T, BM, D, kThreads>(sq_tile, q + (int64_t)m0 * p.q_row + row_head(0) * p.q_head, p.q_row,
                                      rows - m0, d, p.async);
    cp_async_commit();
    auto load_kv = [&](int slot, int t) {
        const int n0 = t * BN;
        T *ks = sk_tile + slot * KVTile::kElems, *vs = sv_tile + slot * KVTile::kElems;
        const T *kg = k + (int64_t)n0 * p.k_row, *vg = v + (int64_t)n0 * p.v_row;
        if (kFastKV<BN, D, kThreads> && p.async) {
            load_kv_tile<T, BN, D, kThreads>(ks, kg, p.k_row, s.sk - n0, d);
            load_kv_tile<T, BN, D, kThreads>(vs, vg, p.v_row, s.sk - n0, d);
        } else {
            load_tile<T, BN, D, kThreads>(ks, kg, p.k_row, s.sk - n0, d, p.async);
            load_tile<T, BN, D, kThreads>(vs, vg, p.v_row, s.sk - n0, d, p.async);
        }
    };
#pragma unroll
    for (int st = 0; st < kStages - 1; st++) {  // one commit group a stage, loaded or not
        if (t_lo + st < t_hi) load_kv(st, t_lo + st);
        cp_async_commit();
    }

    // Columns past d are zeros in shared memory: the MMAs run over the whole bucket, unpredicated.
    const int wm0 = warp * 16 * kMT;                // this warp's rows in the tile
    const bool active = m0 + wm0 < rows;            // warps past the sequence skip the math
    const int r0 = m0 + wm0 + (lane >> 2);          // rows held: r0 + 16 mt + 8 hr
    // A held row's visible keys (rows past the sequence: every key; computed from zero rows of Q,
    // never stored), and the range every row of the warp sees: key tiles inside it take no mask.
    auto row_keys = [&](int r) {
        return r < rows ? key_range(p, s, row_query(r), row_query(r) + 1) : Range{0, s.sk};
    };
    int w_lo = 0, w_hi = s.sk;
#pragma unroll
    for (int mt = 0; mt < kMT; mt++)
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const Range kr = row_keys(r0 + 16 * mt + 8 * hr);
            w_lo = max(w_lo, kr.lo), w_hi = min(w_hi, kr.hi);
        }
    warp_key_range<1>(w_lo, w_hi);
    // The lanes' ldmatrix offsets for each operand's first block (ldsm_x4: the others are a column
    // XOR and a row add away). Q (A): rows lane % 16, column 8 (lane / 16); K (B, rows n): 8 x 8
    // block lane / 8 at n 8 (j / 2), k 8 (j % 2); V (B, rows k, .trans): k 8 (j % 2), n 8 (j / 2).
    const int j8 = lane >> 3, r8 = lane & 7;
    const int a_q = QTile::offset(wm0 + (lane & 15), (lane >> 4) * 8);  // kk: ^ 16 kk, mt: + 16 mt D
    const int b_k = KVTile::offset((j8 >> 1) * 8 + r8, (j8 & 1) * 8);   // kk: ^ 16 kk, np: + 16 np D
    const int b_v = KVTile::offset((j8 & 1) * 8 + r8, (j8 >> 1) * 8);   // np: ^ 16 np, kk: + 16 kk D
    uint32_t q_frag[kQRegs ? kMT : 1][kQRegs ? D / 16 : 1][4];
    if constexpr (kQRegs) {
        cp_async_wait<kStages - 1>();  // Q's group
        __syncthreads();
#pragma unroll
        for (int mt = 0; mt < kMT; mt++)
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) ldsm_x4<false>(q_frag[mt][kk], sq_tile, a_q, 16 * kk, 16 * mt * D);
    }
    const bool fold = p.scale_log2 > 0.0f;
    const float mul = fold ? p.scale_log2 : 1.0f;
    float acc_o[kMT][kDT][4] = {};
    float row_max[kMT][2], row_sum[kMT][2] = {};
#pragma unroll
    for (int mt = 0; mt < kMT; mt++) row_max[mt][0] = row_max[mt][1] = -INFINITY;

    for (int t = t_lo; t < t_hi; t++) {
        const int slot = (int)((unsigned)(t - t_lo) % kStages);
        cp_async_wait<kStages - 2>();
        __syncthreads();  // tile t (and Q) landed; the slot of tile t - 1 is free again
        if (t + kStages - 1 < t_hi) load_kv((int)((unsigned)(t - t_lo + kStages - 1) % kStages), t + kStages - 1);
        cp_async_commit();
        if (!active) continue;
        const T *ks = sk_tile + slot * KVTile::kElems, *vs = sv_tile + slot * KVTile::kElems;

        // S = Q Kᵀ for this warp's kMT x 16 rows x BN keys.
        float acc_s[kMT][kNT][4] = {};
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            uint32_t a[kMT][4];
#pragma unroll
            for (int mt = 0; mt < kMT; mt++) {
                if constexpr (kQRegs) {
#pragma unroll
                    for (int e = 0; e < 4; e++) a[mt][e] = q_frag[mt][kk][e];
                } else {
                    ldsm_x4<false>(a[mt], sq_tile, a_q, 16 * kk, 16 * mt * D);
                }
            }
#pragma unroll
            for (int np = 0; np < kNT / 2; np++) {
                uint32_t bk[4];
                ldsm_x4<false>(bk, ks, b_k, 16 * kk, 16 * np * D);
#pragma unroll
                for (int mt = 0; mt < kMT; mt++) {
                    mma_m16n8k16<T>(acc_s[mt][2 * np], a[mt], {bk[0], bk[1]});
                    mma_m16n8k16<T>(acc_s[mt][2 * np + 1], a[mt], {bk[2], bk[3]});
                }
            }
        }

        // The mask on tiles outside the warp's common range, then the online softmax. The scale is
        // folded into the exponent's FFMA (p = 2^(s mul - max mul)) when positive; any other scale
        // multiplies the scores first (mul 1). row_max is in the units of s.
        const int n0 = t * BN;
        if (!fold) {
#pragma unroll
            for (int mt = 0; mt < kMT; mt++)
#pragma unroll
                for (int nt = 0; nt < kNT; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) acc_s[mt][nt][e] *= p.scale_log2;
        }
        if (n0 < w_lo || n0 + BN > w_hi) {
#pragma unroll
            for (int mt = 0; mt < kMT; mt++)
#pragma unroll
                for (int hr = 0; hr < 2; hr++) {
                    const Range kr = row_keys(r0 + 16 * mt + 8 * hr);
                    const int lo = kr.lo - n0 - 2 * (lane & 3), hi = kr.hi - n0 - 2 * (lane & 3);
#pragma unroll
                    for (int nt = 0; nt < kNT; nt++)
#pragma unroll
                        for (int e = 0; e < 2; e++)
                            if (nt * 8 + e < lo || nt * 8 + e >= hi) acc_s[mt][nt][2 * hr + e] = -INFINITY;
                }
        }
#pragma unroll
        for (int mt = 0; mt < kMT; mt++) {
#pragma unroll
            for (int hr = 0; hr < 2; hr++) {
                float mx = row_max[mt][hr];
#pragma unroll
                for (int nt = 0; nt < kNT; nt++) mx = fmaxf(mx, fmaxf(acc_s[mt][nt][2 * hr], acc_s[mt][nt][2 * hr + 1]));
                mx = quad_max(mx);
                // A row that has seen no key yet keeps max -inf: exponents are taken against 0 then.
                const float base = mx == -INFINITY ? 0.0f : mx * mul;
                const float alpha = ex2_ftz(row_max[mt][hr] * mul - base);  // 0 while the old max is -inf
                row_max[mt][hr] = mx;
                float sum = 0.0f;
#pragma unroll
                for (int nt = 0; nt < kNT; nt++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const float pv = ex2_ftz(fmaf(acc_s[mt][nt][2 * hr + e], mul, -base));
                        acc_s[mt][nt][2 * hr + e] = pv;
                        sum += pv;
                    }
                row_sum[mt][hr] = row_sum[mt][hr] * alpha + sum;
#pragma unroll
                for (int dt = 0; dt < kDT; dt++) acc_o[mt][dt][2 * hr] *= alpha, acc_o[mt][dt][2 * hr + 1] *= alpha;
            }
        }

        // O += P V, P from the accumulators.
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            uint32_t a[kMT][4];
#pragma unroll
            for (int mt = 0; mt < kMT; mt++) acc_to_a<T>(a[mt], acc_s[mt], kk);
#pragma unroll
            for (int np = 0; np < kDT / 2; np++) {
                uint32_t bv[4];
                ldsm_x4<true>(bv, vs, b_v, 16 * np, 16 * kk * D);
#pragma unroll
                for (int mt = 0; mt < kMT; mt++) {
                    mma_m16n8k16<T>(acc_o[mt][2 * np], a[mt], {bv[0], bv[1]});
                    mma_m16n8k16<T>(acc_o[mt][2 * np + 1], a[mt], {bv[2], bv[3]});
                }
            }
        }
    }
    cp_async_wait<0>();

    // Epilogue: O / sum and lse (split: fp32 partials and their lse, -inf for an empty range).
    // Whole form with 16-byte rows (p.async): O as T through this warp's own rows of the Q tile
    // (only this warp reads them), then 16-byte stores of whole rows.
    const bool staged = p.splits == 1 && p.async;
    if (staged) __syncthreads();  // every Q copy landed (a CTA with no key tile never waited)
#pragma unroll
    for (int mt = 0; mt < kMT; mt++) {
        const float sums[2] = {quad_sum(row_sum[mt][0]), quad_sum(row_sum[mt][1])};
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int r = r0 + 16 * mt + hr * 8, i = row_query(r), h = row_head(r);
            const float sum = sums[hr];
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            const float(&o_acc)[kDT][4] = acc_o[mt];
            if (staged) {
                const int at = QTile::offset(r - m0, 2 * (lane & 3));  // chunk dt: ^ 8 dt
#pragma unroll
                for (int dt = 0; dt < kDT; dt++)
                    *reinterpret_cast<uint32_t *>(sq_tile + (at ^ (8 * dt))) =
                        pack2<T>(o_acc[dt][2 * hr] * inv, o_acc[dt][2 * hr + 1] * inv);
            }
            if (r >= rows) continue;
            const float lse = sum > 0.0f ? (row_max[mt][hr] * mul + log2f(sum)) * kLn2 : (p.splits > 1 ? -INFINITY : INFINITY);
            if (p.splits > 1) {
                const int64_t row = (int64_t)split * p.batch * p.heads * p.sq + row_index(p, b, h, i);
                float *po = p.part_out + row * d;
#pragma unroll
                for (int dt = 0; dt < kDT; dt++) {
                    const int c = dt * 8 + 2 * (lane & 3);
                    if (c < d) *reinterpret_cast<float2 *>(po + c) = make_float2(o_acc[dt][2 * hr] * inv, o_acc[dt][2 * hr + 1] * inv);
                }
                if ((lane & 3) == 0) p.part_lse[row] = lse;
            } else {
                if (!staged) {
                    T *o = static_cast<T *>(p.out) + seq_offset(p, b, s.q0, p.o_batch, p.o_row) + h * p.o_head + (int64_t)i * p.o_row;
#pragma unroll
                    for (int dt = 0; dt < kDT; dt++) {
                        const int c = dt * 8 + 2 * (lane & 3);
                        if (c < d) store2<T>(o + c, o_acc[dt][2 * hr] * inv, o_acc[dt][2 * hr + 1] * inv);
                    }
                }
                if ((lane & 3) == 0) p.lse[lse_index(p, s, b, h, i)] = lse;
            }
        }
    }
    if (staged) {
        __syncwarp();
        constexpr int kChunks = 16 * kMT * (D / 8);  // the warp's rows x 16-byte chunks
        T *o = static_cast<T *>(p.out) + seq_offset(p, b, s.q0, p.o_batch, p.o_row);
#pragma unroll
        for (int idx = lane; idx < kChunks; idx += 32) {
            const int rl = wm0 + idx / (D / 8), c = idx % (D / 8) * 8, r = m0 + rl;
            if (r < rows && c < d)
                *reinterpret_cast<uint4 *>(o + row_head(r) * p.o_head + (int64_t)row_query(r) * p.o_row + c) =
                    *reinterpret_cast<const uint4 *>(sq_tile + QTile::offset(rl, c));
        }
    }
}

// Split-KV second pass (this file's split form and fwd_decode_mma_sm80's without a cluster): one
// warp per (sequence, head, row) merges the p.splits partial outputs, weighting each by exp(lse_s -
// max lse); no visible key anywhere: out 0, lse +inf.
template <typename T>
__global__ void __launch_bounds__(128) attention_fwd_combine(Params p) {
    constexpr int kWarps = 4;
    const int lane = threadIdx.x % 32;
    const int64_t row = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32;  // (b, h, i) over (batch, heads, sq)
    grid_dependency_sync();
    if (row >= p.batch * p.heads * p.sq) return;
    const int i = (int)(row % p.sq), h = (int)(row / p.sq % p.heads), b = (int)(row / p.sq / p.heads);
    const Seq s = seq_of(p, b);
    if (i >= s.sq) return;
    const int64_t split_stride = p.batch * p.heads * p.sq;
    float mx = -INFINITY;
    for (int sp = 0; sp < p.splits; sp++) mx = fmaxf(mx, p.part_lse[sp * split_stride + row]);
    const int d = (int)p.d;
    T *o = static_cast<T *>(p.out) + seq_offset(p, b, s.q0, p.o_batch, p.o_row) + h * p.o_head + (int64_t)i * p.o_row;
    if (mx == -INFINITY) {
        for (int c = lane; c < d; c += 32) o[c] = from_f32<T>(0.0f);
        if (lane == 0) p.lse[lse_index(p, s, b, h, i)] = INFINITY;
        return;
    }
    float acc[8] = {}, total = 0.0f;  // lane holds columns lane + 32 e (d <= 256)
    for (int sp = 0; sp < p.splits; sp++) {
        const float w = __expf(p.part_lse[sp * split_stride + row] - mx);
        total += w;
        if (w == 0.0f) continue;
        const float *po = p.part_out + (sp * split_stride + row) * d;
#pragma unroll
        for (int e = 0; e < 8; e++)
            if (lane + 32 * e < d) acc[e] += w * po[lane + 32 * e];
    }
#pragma unroll
    for (int e = 0; e < 8; e++)
        if (lane + 32 * e < d) o[lane + 32 * e] = from_f32<T>(acc[e] / total);
    if (lane == 0) p.lse[lse_index(p, s, b, h, i)] = mx + logf(total);
}

template <typename T, typename Cfg>
fk_status launch(const Plan &plan, const Params &p, int device, cudaStream_t stream) {
    auto kernel = attention_fwd_mma_sm80<T, Cfg>;
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
    if (e != cudaSuccess) return cuda_status(e, "attention_fwd");
    const int64_t rows = p.pack_gqa ? p.sq * (p.heads / p.kv_heads) : p.sq;
    const dim3 grid((unsigned)((rows + Cfg::BM - 1) / Cfg::BM), (unsigned)(p.pack_gqa ? p.kv_heads : p.heads),
                    (unsigned)(p.batch * plan.splits));
    fk_status st = Launch(grid, dim3(Cfg::kThreads), Cfg::kSmemBytes, stream, device)("attention_fwd", kernel, p);
    if (st != FK_OK || plan.splits == 1) return st;
    return launch_fwd_combine(p, std::is_same_v<T, __half> ? FK_FLOAT16 : FK_BFLOAT16, device, stream);
}

template <typename T> fk_status launch_bucket(const Plan &plan, const Params &p, int device, cudaStream_t stream) {
    const bool split = plan.splits > 1;
    switch (plan.d_bucket) {
    case 64: return split ? launch<T, FwdCfg<64, true>>(plan, p, device, stream) : launch<T, FwdCfg<64>>(plan, p, device, stream);
    case 128: return split ? launch<T, FwdCfg<128, true>>(plan, p, device, stream) : launch<T, FwdCfg<128>>(plan, p, device, stream);
    default: return launch<T, FwdCfg<256, true>>(plan, p, device, stream);  // the D 256 shape either way
    }
}

}  // namespace

// Instances: attention_fwd_mma_sm80 x {__half, __nv_bfloat16} x (D {64, 128} x {whole, split} +
// D 256) = 10, attention_fwd_combine x {__half, __nv_bfloat16} = 2; 12 in all.
fk_status launch_fwd_combine(const Params &p, fk_dtype dtype, int device, cudaStream_t stream) {
    const dim3 grid((unsigned)((p.batch * p.heads * p.sq + 3) / 4));  // a warp a row
    if (dtype == FK_BFLOAT16)
        return Launch(grid, dim3(128), 0, stream, device)("attention_fwd_combine", attention_fwd_combine<__nv_bfloat16>, p);
    return Launch(grid, dim3(128), 0, stream, device)("attention_fwd_combine", attention_fwd_combine<__half>, p);
}

fk_status launch_fwd_mma_sm80(const Plan &plan, const Params &p, fk_dtype dtype, int device, cudaStream_t stream) {
    if (dtype == FK_BFLOAT16) return launch_bucket<__nv_bfloat16>(plan, p, device, stream);
    return launch_bucket<__half>(plan, p, device, stream);
}

}  // namespace fk::attn
