// attention_fwd_wgmma_sm90: the Hopper flash-attention forward (sm_90a: TMA, wgmma, warp
// specialization). dispatch.cu row "fwd, sm_90, d 64 / 128, TMA-describable q / k / v".
//
// Napkin math: 4 B H Sq Sk D FLOPs (half when causal); B 4, H 16, S 4096, D 128: 137 GFLOP, 0.23 ms
// at cuDNN's ~600 TFLOP/s (H200, PERF.md). A 128 x 128 tile pair does 8.4 MFLOP at D 128 (~1.9 us
// at 4.5 TFLOP/s an SM) for 64 KB of L2-resident TMA traffic, and 16 K exponentials (MUFU, 16 a
// clock: ~0.6 us, a third of the matmul time at D 128, two thirds at D 64): the softmax of one tile
// must run under the matmuls of the next; the mma.sync kernel cannot, and stops at 285.
// Registers (consumer, D 128): O 64 + S 64 fp32 + P 32 16-bit pairs = 160 of 232. Shared memory:
// Q, K and V rings of 32 KB tiles at D 128, 2 + 2 + 3 = 224 KB; of 16 KB at D 64, 3 + 3 + 3 = 144 KB;
// one CTA an SM. At S 512 a tile has 4 key tiles: what a tile costs beyond them (its first S and
// softmax with no P V to hide under, the last P V and the epilogue with no softmax) must hide too.
// Measured (self-test, bf16, H100; the H200 within 2%): D 128, 16k tokens, S 512 / 1k / 4k / 16k:
// 464 / 568 / 674 / 689 TFLOP/s, causal 237 / 362 / 568 / 693; D 64 387 / - / 469 / 499, B 8 H 32
// S 2048 445. Short and causal S lose to per-tile set-up.
//
// Algorithm: CTAs walk (128-row query tile, head, sequence) tiles, longest causal tiles first;
// persistent (one CTA an SM). The producer claims each next tile from a counter in global memory
// (plan.dynamic: a CTA that drew short causal tiles takes more) and hands its index to the
// consumers through a two-slot ring in shared memory; with FK_ATTN_FWD_DYNAMIC 0, a static walk
// without a mask band and one CTA a tile with one.
// Warpgroup 0, the producer: one thread loads per tile K_(t_lo), Q, then K_t and V_(t-1) through
// mbarrier rings (128-byte swizzle; rows past the sequence end zero-filled), Q up to two tiles
// ahead (a ring of kQSlots = 3; a slot stages its tile's O, then goes back). Warpgroups 1, 2 own
// 64 query rows each. Per key tile t, S_t = Q K_tᵀ (wgmma SS) and O += P_(t-1) V_(t-1) (wgmma, P
// from registers) issue together; the softmax of S_t (mask where the tile crosses the band or the
// end, running max, exp2 with scale x log2 e folded into one FFMA, running sum) runs under the P V
// product; then O is rescaled and P_t packed. The warpgroups take turns issuing (named barriers
// kTurn0 + c; H200: D 64 355 -> 417 TFLOP/s, D 128 649 -> 663), one's softmax under the other's
// matmuls, and the turns run on from tile to tile; a tile's last P V waits for the next tile's
// first turn, so that the epilogue and the next first softmax run under matmuls too (D-135). Key
// tiles outside the band are never loaded. Epilogue: O / sum from registers through the tile's Q
// slot, lse = (max + log2 sum) ln 2; a row that sees no key gets out 0, lse +inf.
#include "../hopper.cuh"
#include "../matmul/wgmma_ops.cuh"
#include "attention.cuh"

#include <algorithm>

#ifndef FK_ATTN_PINGPONG  // A/B switch: consumer warpgroups take turns issuing their matmuls
#define FK_ATTN_PINGPONG 1
#endif
#ifndef FK_ATTN_D64_CONSUMERS  // A/B switch: consumer warpgroups (64 query rows each) at D 64
#define FK_ATTN_D64_CONSUMERS 2
#endif
#ifndef FK_ATTN_D64_BN  // A/B switch: keys a K / V tile at D 64 (128 or 192)
#define FK_ATTN_D64_BN 128
#endif
#ifndef FK_ATTN_D128_V_STAGES  // A/B switch: V stages at D 128 (3, with 2 Q slots; or 2, with 3)
#define FK_ATTN_D128_V_STAGES 3
#endif
#ifndef FK_ATTN_D128_BN  // A/B switch: keys a K / V tile at D 128 (128, or 176 as FlashAttention-3)
#define FK_ATTN_D128_BN 128
#endif

namespace fk::attn {
namespace {

using mm::wgmma_m64n128k16;
using mm::wgmma_m64n128k16_rs;
using mm::wgmma_m64n64k16_rs;

constexpr int kBoxCols = 64;                         // a 128-byte swizzled TMA box is 64 columns wide

// Two consumer warpgroups (O + S + P: 160 registers a thread at D 128, 128 at D 64, of 232).
// Three consumers at D 64 (192 rows, 160 registers: spills) measured 486 vs 476 TFLOP/s at S 4096 as one CTA a tile, but 344 persistent
// and 307 vs 320 causal (H100); with the dynamic walk +4% at S 4096 full, -5 to -23% at causal and
// short S (H200, D-106): two it is. Registers (registers_fit): two consumers at 232 and the
// producer at 40 spill nothing; at 24 the producer spilled its tile walk (60 bytes).
template <int D> struct Cfg {
    static constexpr int kConsumers = D == 64 ? FK_ATTN_D64_CONSUMERS : 2;
    static constexpr int kBM = 64 * kConsumers, kBN = D == 64 ? FK_ATTN_D64_BN : FK_ATTN_D128_BN;  // query rows, keys
    static constexpr int kThreads = 128 * (1 + kConsumers);
    // Ring depths. Q: a tile's Q, then its O (staged in the next tile's first turn), and the next
    // tile's Q loaded ahead. V: a tile's last V stays until the next tile's first turn, so the
    // next tile's loads have one slot fewer. D 128 has room for 7 x 32 KB: Q 2, K 2, V 3 by
    // default, or Q 3, K 2, V 2 (FK_ATTN_D128_V_STAGES 2).
    static constexpr int kKStages = D == 64 ? 3 : 2, kVStages = D == 64 ? 3 : FK_ATTN_D128_V_STAGES;
    static constexpr int kQSlots = D == 64 || kVStages == 2 ? 3 : 2;
    static constexpr int kRegsProducer = kConsumers == 2 ? 40 : 32, kRegsConsumer = kConsumers == 2 ? 232 : 160;
    static constexpr int kBoxes = D / kBoxCols;
    static constexpr uint32_t kQBytes = kBM * D * 2, kKVBytes = kBN * D * 2;
    static_assert(registers_fit(kConsumers, kRegsProducer, kRegsConsumer), "register pool");
};

// Named barriers: 0 is __syncthreads; consumer warpgroup c waits on kTurn0 + c for its turn on the
// tensor cores (ids 1 .. kConsumers) and meets its own threads on kStage0 + c around the output stage.
enum NamedBarrier { kTurn0 = 1, kStage0 = 5 };

template <typename T, int D> struct Smem {
    // A ring of Q tiles (Cfg::kQSlots); a finished tile's O is staged in its own slot (a
    // warpgroup's 64 rows of each box, the TMA layout), which is released after.
    alignas(1024) T q[Cfg<D>::kQSlots][Cfg<D>::kBM * D];  // D / 64 boxes of kBM rows x 64 columns
    alignas(1024) T k[Cfg<D>::kKStages][Cfg<D>::kBN * D];  // the same, kBN keys
    alignas(1024) T v[Cfg<D>::kVStages][Cfg<D>::kBN * D];
    int4 tile[2];  // the walk's next tiles, producer to consumers: (b, h, m0); b -1: the walk is over
    uint64_t q_full[Cfg<D>::kQSlots], q_empty[Cfg<D>::kQSlots], k_full[Cfg<D>::kKStages],
        k_empty[Cfg<D>::kKStages], v_full[Cfg<D>::kVStages], v_empty[Cfg<D>::kVStages];
    uint64_t tile_full[2], tile_empty[2];
};
template <int D> constexpr int kSmemBytes = sizeof(Smem<__half, D>) + 1024;  // + room to align to 1024
static_assert(kSmemBytes<128> <= 227 * 1024 && kSmemBytes<64> <= 227 * 1024, "fits Hopper's shared memory");

// Query tile `tile` of the persistent walk (query tiles fastest, the ones with the most keys first
// under a causal mask, so the heads sharing K / V in L2 run together): (b, h, m0), and from those
// the key tiles [t_lo, t_hi) its rows see. The producer divides; the consumers get (b, h, m0).
struct Work {
    Seq s;
    int b, h, g, m0, t_lo, t_hi;
};
template <int kBM, int kBN> __device__ __forceinline__ Work work_at(const Params &p, int b, int h, int m0) {
    Work w;
    w.b = b, w.h = h, w.m0 = m0;
    w.g = w.h / (int)(p.heads / p.kv_heads);
    // Dense batches only (the plan keeps varlen on sm_80): the geometry comes from the constant
    // bank and costs the consumers no registers across the key loop.
    w.s.q0 = (int64_t)w.b * p.sq, w.s.k0 = (int64_t)w.b * p.sk, w.s.sq = (int)p.sq, w.s.sk = (int)p.sk;
    w.s.shift = p.top_left ? 0 : p.sk - p.sq;
    const Range keys = key_range(p, w.s, w.m0, min(w.m0 + kBM, w.s.sq));
    w.t_lo = keys.lo / kBN;
    w.t_hi = keys.hi > keys.lo ? (keys.hi + kBN - 1) / kBN : w.t_lo;
    return w;
}
template <int kBM> __device__ __forceinline__ int4 tile_at(const Params &p, int64_t tile, int m_tiles) {
    return make_int4((int)(tile / m_tiles / p.heads), (int)(tile / m_tiles % p.heads),
                     (m_tiles - 1 - (int)(tile % m_tiles)) * kBM, 0);
}

// One thread, per tile of the walk: K_(t_lo), Q (into the slot of kQSlots tiles ago, freed after
// its epilogue), then K_t and V_(t-1) alternately: the order the consumers take them.
template <typename T, int D>
__device__ __forceinline__ void producer(Smem<T, D> &s, const CUtensorMap *map_q, const CUtensorMap *map_k,
                                         const CUtensorMap *map_v, const Params &p, int m_tiles, int64_t tiles) {
    using C = Cfg<D>;
    constexpr int kBN = C::kBN;
    RingStage<C::kQSlots> qs;
    RingStage<C::kKStages> ks;
    RingStage<C::kVStages> vs;
    auto load_k = [&](const Work &w, int t) {
        mbar_wait(&s.k_empty[ks.slot], ks.phase ^ 1);  // the first pass finds every slot free
        mbar_arrive_expect_tx(&s.k_full[ks.slot], C::kKVBytes);
#pragma unroll
        for (int box = 0; box < C::kBoxes; box++)
            tma_load_4d(s.k[ks.slot] + box * kBN * kBoxCols, map_k, &s.k_full[ks.slot], box * kBoxCols, t * kBN, w.g,
                        w.b);
        ks.next();
    };
    RingStage<2> ts;
    for (int64_t tile = blockIdx.x;; ) {
        // The next tile is claimed now: the atomic's round trip hides under this tile's loads.
        const int64_t next = tile >= tiles ? tiles
                             : p.next_tile ? gridDim.x + (int64_t)atomicAdd(p.next_tile, 1ull)
                                           : tile + gridDim.x;
        const int4 at = tile < tiles ? tile_at<C::kBM>(p, tile, m_tiles) : make_int4(-1, 0, 0, 0);
        mbar_wait(&s.tile_empty[ts.slot], ts.phase ^ 1);
        s.tile[ts.slot] = at;
        mbar_arrive(&s.tile_full[ts.slot]);  // releases the store to the consumers
        ts.next();
        if (tile >= tiles) break;
        const Work w = work_at<C::kBM, kBN>(p, at.x, at.y, at.z);
        if (w.t_lo < w.t_hi) load_k(w, w.t_lo);
        mbar_wait(&s.q_empty[qs.slot], qs.phase ^ 1);
        mbar_arrive_expect_tx(&s.q_full[qs.slot], C::kQBytes);
#pragma unroll
        for (int box = 0; box < C::kBoxes; box++)
            tma_load_4d(s.q[qs.slot] + box * C::kBM * kBoxCols, map_q, &s.q_full[qs.slot], box * kBoxCols, w.m0, w.h,
                        w.b);
        qs.next();
        for (int t = w.t_lo + 1; t <= w.t_hi; t++) {
            if (t < w.t_hi) load_k(w, t);
            mbar_wait(&s.v_empty[vs.slot], vs.phase ^ 1);
            mbar_arrive_expect_tx(&s.v_full[vs.slot], C::kKVBytes);
#pragma unroll
            for (int box = 0; box < C::kBoxes; box++)
                tma_load_4d(s.v[vs.slot] + box * kBN * kBoxCols, map_v, &s.v_full[vs.slot], box * kBoxCols,
                            (t - 1) * kBN, w.g, w.b);
            vs.next();
        }
        tile = next;
    }
}

// S = Q Kᵀ for warpgroup c's 64 rows: K-major operands, 128-byte rows of a box, 8-row groups 1024
// bytes apart; a k16 step is 32 bytes along a row, every fourth one moves to the next box.
template <typename T, int D, int kBN>
__device__ __forceinline__ void issue_qk(float (&sc)[kBN / 2], const T *q, const T *k, int c) {
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        const T *qk = q + (kk / 4) * Cfg<D>::kBM * kBoxCols + c * 64 * kBoxCols + (kk % 4) * 16;
        const uint64_t dq = smem_desc_sw128(qk, 16, 1024);
        const uint64_t dk = smem_desc_sw128(k + (kk / 4) * kBN * kBoxCols + (kk % 4) * 16, 16, 1024);
        if constexpr (kBN == 128) wgmma_m64n128k16<T, 0, 0>(sc, dq, dk, kk > 0);
        else if constexpr (kBN == 176) mm::wgmma_m64n176k16<T, 0, 0>(sc, dq, dk, kk > 0);
        else mm::wgmma_m64n192k16<T, 0, 0>(sc, dq, dk, kk > 0);
    }
}

// O += P V: V is N-major (d contiguous): 64-column boxes kBN x 128 bytes apart (the leading byte
// offset), a k16 step is 16 key rows = 2048 bytes.
template <typename T, int D, int kBN>
__device__ __forceinline__ void issue_pv(float (&o)[D / 2], const uint32_t (&pa)[kBN / 16][4], const T *v) {
#pragma unroll
    for (int kk = 0; kk < kBN / 16; kk++) {
        const uint64_t dv = smem_desc_sw128(v + kk * 16 * kBoxCols, kBN * kBoxCols * 2, 1024);
        if constexpr (D == 64) wgmma_m64n64k16_rs<T, 1>(o, pa[kk], dv, 1);
        else wgmma_m64n128k16_rs<T, 1>(o, pa[kk], dv, 1);
    }
}

// Accumulator layout of m64nN: warp w of the warpgroup holds rows 16 w + lane / 4 (hr 0) and + 8
// (hr 1); n8 block j, columns 8 j + 2 (lane % 4) (+ 1): acc[4 j + 2 hr] and acc[4 j + 2 hr + 1].
// Masks S (tiles crossing the band or the sequence end), then the online softmax: new running max,
// S <- 2^(S mul - max mul), running sum; alpha = the factor O must still be rescaled by.
template <int kBN>
__device__ __forceinline__ void softmax_tile(float (&sc)[kBN / 2], float (&row_max)[2], float (&row_sum)[2],
                                             float (&alpha)[2], const Params &p, const Seq &s, int wm0, int r0,
                                             int n0, bool fold, float mul) {
    const int lane = threadIdx.x % 32;
    if (!fold) {
#pragma unroll
        for (int e = 0; e < kBN / 2; e++) sc[e] *= p.scale_log2;
    }
    if (!tile_visible(p, s, wm0, 64, n0, kBN)) {
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            // Keys [lo, hi) of the tile that row r0 + 8 hr sees, in tile columns (empty past sq).
            const int64_t i = r0 + 8 * hr;
            int64_t a = 0, z = i < s.sq ? s.sk : 0;
            if (p.window_left >= 0) a = max(a, i + s.shift - p.window_left);
            if (p.window_right >= 0) z = min(z, i + s.shift + p.window_right + 1);
            const int lo = (int)min(max(a - n0, (int64_t)0), (int64_t)kBN) - 2 * (lane & 3);
            const int hi = (int)min(max(z - n0, (int64_t)0), (int64_t)kBN) - 2 * (lane & 3);
#pragma unroll
            for (int j = 0; j < kBN / 8; j++)
#pragma unroll
                for (int e = 0; e < 2; e++)
                    if (8 * j + e < lo || 8 * j + e >= hi) sc[4 * j + 2 * hr + e] = -INFINITY;
        }
    }
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        float mx = row_max[hr];
#pragma unroll
        for (int j = 0; j < kBN / 8; j++) mx = fmaxf(mx, fmaxf(sc[4 * j + 2 * hr], sc[4 * j + 2 * hr + 1]));
        mx = quad_max(mx);
        // A row that has seen no key yet keeps max -inf: exponents are taken against 0 then.
        const float base = mx == -INFINITY ? 0.0f : mx * mul;
        alpha[hr] = ex2_ftz(row_max[hr] * mul - base);  // 0 while the old max is -inf
        row_max[hr] = mx;
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < kBN / 8; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const float pv = ex2_ftz(fmaf(sc[4 * j + 2 * hr + e], mul, -base));
                sc[4 * j + 2 * hr + e] = pv;
                sum += pv;
            }
        row_sum[hr] = row_sum[hr] * alpha[hr] + sum;
    }
}

// The m64nN accumulator layout is the register-A layout of the next wgmma: P_t as 16-bit pairs.
template <typename T, int kBN>
__device__ __forceinline__ void pack_p(uint32_t (&pa)[kBN / 16][4], const float (&sc)[kBN / 2]) {
#pragma unroll
    for (int kk = 0; kk < kBN / 16; kk++)
#pragma unroll
        for (int r = 0; r < 4; r++) pa[kk][r] = pack2<T>(sc[8 * kk + 2 * r], sc[8 * kk + 2 * r + 1]);
}

template <int N> __device__ __forceinline__ void rescale(float (&o)[N], const float (&alpha)[2]) {
#pragma unroll
    for (int e = 0; e < N; e++) o[e] *= alpha[(e >> 1) & 1];
}

// Ping-pong: warpgroup c issues its matmuls between turn_begin and turn_end; warpgroup c + 1's
// turn follows (round robin). Both warpgroups take the same turns (the tiles' key tiles, and a
// turn for a held-back P V alone), so the order runs on across tiles: one warpgroup's epilogue
// and next tile's set-up run under the other's products. The last warpgroup arrives once before
// its first turn (warpgroup 0 goes first) and warpgroup 0 waits once after its last, so every
// arrival meets exactly one wait.
template <int kConsumers> __device__ __forceinline__ void turn_begin(int c) {
    if (FK_ATTN_PINGPONG) named_barrier_sync(kTurn0 + c, 2 * 128);
}
template <int kConsumers> __device__ __forceinline__ void turn_end(int c) {
    if (FK_ATTN_PINGPONG) named_barrier_arrive(kTurn0 + (c + 1 == kConsumers ? 0 : c + 1), 2 * 128);
}

// O / sum staged in the tile's Q slot: warpgroup c's own 64 rows of each box (its wgmmas are done
// with them), in Q's TMA layout (16-byte chunk j of row r at j ^ (r % 8)): the pair writes and the
// 16-byte reads are bank-conflict-free. Then 16-byte row stores, and the slot goes back to the
// producer. Direct stores of the accumulator's 4-byte pairs (8 rows of 16 bytes a warp store):
// S 1024 fwd 2.9-7.8% slower, S 4096 level (D-103).
template <typename T, int D>
__device__ __forceinline__ void epilogue(Smem<T, D> &s, const Params &p, const Work &w, int slot,
                                         const float (&o)[D / 2], const float (&row_max)[2],
                                         const float (&row_sum)[2], float mul) {
    constexpr float kLn2 = 0.693147180559945309f;
    constexpr int kBox = Cfg<D>::kBM * kBoxCols;  // elements a box of the slot
    const int c = threadIdx.x / 128 - 1, t = threadIdx.x % 128, lane = t % 32;
    const int r0 = w.m0 + 64 * c + 16 * (t / 32) + lane / 4;
    T *stage = s.q[slot] + c * 64 * kBoxCols;
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int i = r0 + 8 * hr, lr = 16 * (t / 32) + lane / 4 + 8 * hr;
        const float sum = quad_sum(row_sum[hr]);
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
        for (int j = 0; j < D / 8; j++)
            *reinterpret_cast<uint32_t *>(stage + (j / 8) * kBox + lr * kBoxCols + ((j % 8) ^ (lr % 8)) * 8 +
                                          2 * (lane & 3)) = pack2<T>(o[4 * j + 2 * hr] * inv, o[4 * j + 2 * hr + 1] * inv);
        if ((lane & 3) == 0 && i < w.s.sq)
            p.lse[lse_index(p, w.s, w.b, w.h, i)] = sum > 0.0f ? (row_max[hr] * mul + log2f(sum)) * kLn2 : INFINITY;
    }
    named_barrier_sync(kStage0 + c, 128);
    const int m0 = w.m0 + 64 * c, rows = min(64, w.s.sq - m0);
    T *out = static_cast<T *>(p.out) + (int64_t)w.b * p.o_batch + (int64_t)m0 * p.o_row + (int64_t)w.h * p.o_head;
#pragma unroll
    for (int k = t; k < 64 * D / 8; k += 128) {
        const int row = k / (D / 8), j = k % (D / 8);
        if (row < rows)
            *reinterpret_cast<uint4 *>(out + row * p.o_row + 8 * j) =
                *reinterpret_cast<const uint4 *>(stage + (j / 8) * kBox + row * kBoxCols + ((j % 8) ^ (row % 8)) * 8);
    }
    fence_proxy_async_shared();  // the stage's accesses before the TMA write that refills the slot
    mbar_arrive(&s.q_empty[slot]);
}

// The consumers' loop: per key tile t of a query tile, one turn issues S_t = Q K_tᵀ with P_(t-1)
// V_(t-1); the softmax of S_t runs under the P V product. A tile's last P V is held back and
// issued in the next tile's first turn, with its first S: the last tile's epilogue (O, rescaled
// no more, read once that P V is done) and the new tile's first softmax both run under it, as in
// any other turn. A tile without keys, or the walk's end, issues the held-back P V alone.
template <typename T, int D> __device__ __forceinline__ void consumer(Smem<T, D> &s, const Params &p) {
    using C = Cfg<D>;
    constexpr int kC = C::kConsumers, kBN = C::kBN;
    const int c = threadIdx.x / 128 - 1, t = threadIdx.x % 128;
    // The scale folds into the exponent's FFMA when positive; any other scale multiplies S first.
    const bool fold = p.scale_log2 > 0.0f;
    const float mul = fold ? p.scale_log2 : 1.0f;
    RingStage<C::kQSlots> qs;
    RingStage<C::kKStages> ks;
    RingStage<C::kVStages> vs;
    float o[D / 2], sc[kBN / 2], row_max[2], row_sum[2], alpha[2], last_max[2], last_sum[2];
    uint32_t pa[kBN / 16][4];
    Work last;  // the tile whose last P V is held back (has_last), its Q slot, and its statistics
    int last_slot = 0;
    bool has_last = false;
    auto zero_o = [&]() {
#pragma unroll
        for (int e = 0; e < D / 2; e++) o[e] = 0.0f;
    };
    auto wait_pv = [&]() {  // the held-back P V is done: V's stage goes back
        wgmma_wait<0>();
        wgmma_fence_operands(o);
        if (t == 0) mbar_arrive(&s.v_empty[vs.slot]);
        vs.next();
    };
    auto issue_pv_turn = [&]() {
        mbar_wait(&s.v_full[vs.slot], vs.phase);
        issue_pv<T, D, kBN>(o, pa, s.v[vs.slot]);
        wgmma_commit();
    };
    auto finish_last = [&]() {  // the held-back tile's last P V, in a turn of its own, and its epilogue
        turn_begin<kC>(c);
        wgmma_fence();
        issue_pv_turn();
        turn_end<kC>(c);
        wait_pv();
        epilogue<T, D>(s, p, last, last_slot, o, row_max, row_sum, mul);
    };
    zero_o();
    if (c == kC - 1) turn_end<kC>(c);  // warpgroup 0 takes the first turn
    for (RingStage<2> ts;; ts.next()) {
        mbar_wait(&s.tile_full[ts.slot], ts.phase);
        // lane 0's copy, so ptxas sees warp-uniform values: read from shared memory they are not
        // (every branch on them then counted as divergent and the wgmmas were serialized: C7520)
        const int4 at = s.tile[ts.slot];
        const int b = __shfl_sync(0xffffffffu, at.x, 0), h = __shfl_sync(0xffffffffu, at.y, 0),
                  m0 = __shfl_sync(0xffffffffu, at.z, 0);
        mbar_arrive(&s.tile_empty[ts.slot]);
        if (b < 0) break;
        const Work w = work_at<C::kBM, kBN>(p, b, h, m0);
        const int wm0 = w.m0 + 64 * c, r0 = wm0 + 16 * (t / 32) + (t % 32) / 4;  // rows r0 and r0 + 8
        const int slot = qs.slot;
        const T *q = s.q[slot];
        mbar_wait(&s.q_full[slot], qs.phase);
        qs.next();
        if (w.t_lo == w.t_hi) {  // no key to see: out 0, lse +inf
            if (has_last) {
                finish_last();
                zero_o();
                has_last = false;
            }
            row_max[0] = row_max[1] = -INFINITY, row_sum[0] = row_sum[1] = 0.0f;
            epilogue<T, D>(s, p, w, slot, o, row_max, row_sum, mul);
            continue;
        }
        // The first turn, in two copies: ptxas must see every wgmma wait on the path to the
        // registers it guards (one branch on has_last for the issue and another for the wait:
        // C7514, every wgmma serialized).
        auto first_turn = [&](bool with_pv) {
            turn_begin<kC>(c);
            mbar_wait(&s.k_full[ks.slot], ks.phase);
            wgmma_fence();
            issue_qk<T, D, kBN>(sc, q, s.k[ks.slot], c);
            wgmma_commit();
            if (with_pv) issue_pv_turn();
            turn_end<kC>(c);
        };
        auto first_softmax = [&]() {
            wgmma_fence_operands(sc);
            if (t == 0) mbar_arrive(&s.k_empty[ks.slot]);
            ks.next();
#pragma unroll
            for (int hr = 0; hr < 2; hr++)
                last_max[hr] = row_max[hr], last_sum[hr] = row_sum[hr], row_max[hr] = -INFINITY, row_sum[hr] = 0.0f;
            softmax_tile<kBN>(sc, row_max, row_sum, alpha, p, w.s, wm0, r0, w.t_lo * kBN, fold, mul);
        };
        if (has_last) {
            first_turn(true);
            wgmma_wait<1>();  // S is ready; the last tile's P V still runs under its softmax
            first_softmax();
            wait_pv();
            epilogue<T, D>(s, p, last, last_slot, o, last_max, last_sum, mul);
            zero_o();
        } else {
            first_turn(false);
            wgmma_wait<0>();
            first_softmax();
        }
        pack_p<T, kBN>(pa, sc);
        for (int kt = w.t_lo + 1; kt < w.t_hi; kt++) {
            turn_begin<kC>(c);
            mbar_wait(&s.k_full[ks.slot], ks.phase);
            wgmma_fence();
            issue_qk<T, D, kBN>(sc, q, s.k[ks.slot], c);
            wgmma_commit();
            issue_pv_turn();
            turn_end<kC>(c);
            wgmma_wait<1>();  // S_t is ready; P_(t-1) V_(t-1) still runs under its softmax
            wgmma_fence_operands(sc);
            if (t == 0) mbar_arrive(&s.k_empty[ks.slot]);
            ks.next();
            softmax_tile<kBN>(sc, row_max, row_sum, alpha, p, w.s, wm0, r0, kt * kBN, fold, mul);
            wait_pv();
            rescale(o, alpha);
            pack_p<T, kBN>(pa, sc);
        }
        last = w, last_slot = slot, has_last = true;
    }
    if (has_last) finish_last();
    if (c == 0) turn_begin<kC>(c);  // the last warpgroup's last hand-over
}

// The grid walks the query tiles: one CTA an SM when plan.persistent (the producer loads the next
// tiles' K and Q while the consumers finish the last one), else one CTA a tile. The producer
// thread stays in its loop to the end: it arrives on the tile ring once more (b -1).
template <typename T, int D>
__global__ void __launch_bounds__(Cfg<D>::kThreads, 1)
    attention_fwd_wgmma_sm90(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                             const __grid_constant__ CUtensorMap map_v, const Params p) {
#if FK_SM90A
    extern __shared__ unsigned char smem_raw[];
    auto &s = smem_aligned_1024<Smem<T, D>>(smem_raw);
    if (threadIdx.x == 0) {
        for (int i = 0; i < Cfg<D>::kQSlots; i++)
            mbar_init(&s.q_full[i], 1), mbar_init(&s.q_empty[i], Cfg<D>::kConsumers * 128);
        for (int i = 0; i < Cfg<D>::kKStages; i++) mbar_init(&s.k_full[i], 1), mbar_init(&s.k_empty[i], Cfg<D>::kConsumers);
        for (int i = 0; i < Cfg<D>::kVStages; i++) mbar_init(&s.v_full[i], 1), mbar_init(&s.v_empty[i], Cfg<D>::kConsumers);
        for (int i = 0; i < 2; i++) mbar_init(&s.tile_full[i], 1), mbar_init(&s.tile_empty[i], Cfg<D>::kConsumers * 128);
        fence_barrier_init();
        prefetch_tensormap(&map_q), prefetch_tensormap(&map_k), prefetch_tensormap(&map_v);
    }
    __syncthreads();
    grid_dependency_sync();
    const int m_tiles = (int)((p.sq + Cfg<D>::kBM - 1) / Cfg<D>::kBM);
    const int64_t tiles = (int64_t)m_tiles * p.heads * p.batch;
    if (threadIdx.x < 128) {
        setmaxnreg_dec<Cfg<D>::kRegsProducer>();
        if (threadIdx.x == 0) producer<T, D>(s, &map_q, &map_k, &map_v, p, m_tiles, tiles);
    } else {
        setmaxnreg_inc<Cfg<D>::kRegsConsumer>();
        consumer<T, D>(s, p);
    }
#endif
}

// ---- host: tensor maps and launch ---------------------------------------------------------------

template <typename T, int D>
fk_status launch(const Params &p, bool persistent, fk_dtype dtype, int device, cudaStream_t stream) {
    CUtensorMap map_q, map_k, map_v;
    using C = Cfg<D>;
    if (!encode_map_4d(&map_q, dtype, p.q, D, p.sq, p.heads, p.batch, p.q_row, p.q_head, p.q_batch, C::kBM) ||
        !encode_map_4d(&map_k, dtype, p.k, D, p.sk, p.kv_heads, p.batch, p.k_row, p.k_head, p.k_batch, C::kBN) ||
        !encode_map_4d(&map_v, dtype, p.v, D, p.sk, p.kv_heads, p.batch, p.v_row, p.v_head, p.v_batch, C::kBN))
        return fk_fail(FK_ERR_RUNTIME, "attention_fwd: cuTensorMapEncodeTiled failed");
    constexpr auto kernel = attention_fwd_wgmma_sm90<T, D>;
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes<D>);
    if (e != cudaSuccess) return cuda_status(e, "attention_fwd");
    const int64_t tiles = (p.sq + C::kBM - 1) / C::kBM * p.heads * p.batch;
    // (grid.x holds 2^31 - 1 CTAs: a larger walk goes persistent whatever the plan says.)
    const bool walk = persistent || tiles > INT32_MAX;
    const unsigned grid = (unsigned)(walk ? std::min<int64_t>(tiles, sm_count(device)) : tiles);
    if (p.next_tile) {  // the dynamic walk's counter starts at 0 each launch (a graph node when captured)
        e = cudaMemsetAsync(p.next_tile, 0, sizeof *p.next_tile, stream);
        if (e != cudaSuccess) return cuda_status(e, "attention_fwd");
    }
    return Launch(dim3(grid), dim3(C::kThreads), kSmemBytes<D>, stream, device)("attention_fwd", kernel, map_q, map_k,
                                                                                 map_v, p);
}

}  // namespace

// Instances: {__half, __nv_bfloat16} x D {64, 128} = 4.
fk_status launch_fwd_wgmma_sm90(const Plan &plan, const Params &p, fk_dtype dtype, int device, cudaStream_t stream) {
    const bool pers = plan.persistent;
    if (dtype == FK_BFLOAT16)
        return plan.d_bucket == 64 ? launch<__nv_bfloat16, 64>(p, pers, dtype, device, stream)
                                   : launch<__nv_bfloat16, 128>(p, pers, dtype, device, stream);
    return plan.d_bucket == 64 ? launch<__half, 64>(p, pers, dtype, device, stream)
                               : launch<__half, 128>(p, pers, dtype, device, stream);
}

}  // namespace fk::attn
