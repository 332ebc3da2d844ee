// matmul_wgmma_sm90: the Hopper GEMM for bf16 / fp16, and fp32 under TF32 (sm_90a). dispatch.cu rows
// "16-bit, sm_90, TMA-describable operands" and "fp32, TF32 allowed, sm_90, K-major operands".
//
// Napkin math: 4096^3 is 137 GFLOP: 0.2 ms at the H200's measured ~650-700 TFLOP/s (cuBLAS,
// CUDA-graph timing). A 128 x 128 CTA tile moves (128 + 128) x 64 x 2 = 32 KB of operands a k-step
// for 2 x 128^2 x 64 = 2.1 MFLOP (64 FLOPs a byte); 5-6 stages keep that many k-steps of TMA
// latency in flight. Measured (H200, benchmarks/results/matmul-h200-2026-11-27.json): 4096^3 721
// TFLOP/s (1.10x cuBLAS), 8192^3 0.97x, the six training shapes 0.87-1.00x.
//
// Algorithm (STYLE.md's producer / consumer skeleton): a persistent grid, one CTA an SM, walks the
// output tiles in grouped order. Warpgroup 0 is the producer: one thread waits for a free stage
// (empty[slot]), announces its bytes on full[slot] and issues the TMA copies of A's and B's k-tile
// (128-byte swizzle, zero-filled past the matrix edges, so any M, N, K). Warpgroups 1 and 2 are
// consumers, in one of two arrangements (launch() picks, D-114):
//   ping-pong (16-bit, two tiles or more a CTA, TMA-stored C): each consumer owns whole tiles, the
//     CTA's tiles alternating between them; their mainloops take turns (named barriers kOrder0 + c),
//     so one consumer's epilogue runs under the other's mainloop. Eight wgmma m64n128k16 a stage.
//   cooperative: each consumer owns 64 rows of every tile, four wgmma m64n128k16 a stage; for long K
//     (dispatch.cu's 128 x 256 row, D-139) the tile is 128 x 256 (4 stages of 48 KB, four m64n256k16 a
//     stage: B's slice read once a consumer instead of once a 64-row block, 48 KB from L2 for 4.2
//     MFLOP instead of 32 KB for 2.1), and each consumer stores its 64 x 256 block as two 64 x 128
//     halves through one staging block. Less energy a FLOP: at the power cap its clock ran 1.50 GHz
//     against 1.40 (K 8192, H200): +4-8% at K 8192, +3% at K 7168.
// A consumer waits full[slot], issues its wgmmas (K- or M/N-major operands through the descriptors'
// transpose bits), keeps one wgmma group in flight and releases the previous stage. The epilogue
// (bias, pre-activation, GELU; compiled once per activation, D-112) writes 64-row blocks into
// swizzled shared staging, stored by TMA, or, where C's rows are not 16-byte aligned, by coalesced
// element stores (D-113).
// The launches: wgmma_sm90.cu (persistent), wgmma_sm90_small.cu (below).
// Small problems (dispatch.cu's row, 16-bit, D-128 / D-136): where 128 x 128 tiles number at most half
// the SMs and K has 4 k-steps or more, K is split over a 2-CTA cluster a tile (kSplit): rank r takes
// half the k-steps, row block c's partial accumulators (fp32) go by st.async into rank c's staging
// buffers (64 x kBN fp32 fit them), and consumer c adds them and runs the epilogue; where 128 x 128
// tiles are <= SMs / 4 the tile is also 128 x 64 (wgmma m64n64k16). Where B's rows are not 128-byte
// aligned (L2-bound loads: 1000^3's 64 CTAs read 32 KB a k-step at ~6 TB/s, 650 cycles against 490 at
// 512^3) and tile rows pair up, two CTAs of a cluster share B instead (kShareB): tiles 2i and 2i + 1
// (one tile column) each load half of B's k-tile and multicast it to both (24 KB a k-step from L2
// instead of 32); a stage is then released by the four consumers of both CTAs. Both take the lean
// prologue (stamps.cuh). H200 x cuBLAS: 512^3 0.65 -> 1.03x, 1000^3 0.77 -> 0.96x (D-136).
// TF32 (fp32 operands): the same kernel in bytes, cooperative. A 128-byte swizzled row holds 32 fp32
// instead of 64 halves, so a stage is still 32 KB (BK = 32) and a wgmma m64n128k8 step still 32
// bytes along it; the TMA rounds fp32 to tf32 on load (TFLOAT32 maps, round to nearest like cuBLAS).
// fp32 C needs 64 KB of staging, so the ring has 5 stages. TF32 4096^3: 0.39 ms at cuBLAS's ~350
// TFLOP/s (H200). wgmma reads tf32 K-major only. An N-major B (x @ w) is taken as it is (D-132):
// the tile is computed transposed, C^T = B^T A^T, B's tile the A operand from registers (each
// thread loads its fragment from the 32 x 32 boxes, 8-byte loads, no extra shared-memory bytes),
// A's K-major tile the B operand; the epilogue writes C^T's accumulators transposed into the same
// staging. That saves ops/matmul.py's K-major copy of w (4096^2 fp32: 64 MB read + 64 MB written,
// ~30-90 us against a ~400 us GEMM: x @ w was 0.78x cuBLAS, F.linear 0.88x). Other majors are copied
// K-major by ops/matmul.py first (one pass over them).
#pragma once

#include <type_traits>

#include "../hopper.cuh"
#include "matmul.cuh"
#include "stamps.cuh"
#include "wgmma_ops.cuh"


namespace fk::mm {
namespace {

// Output tiles are kBM x kBN: 128 x 128, or 128 x 64 for problems whose 128 x 128 tiles leave most
// SMs idle (the split-K instances of dispatch.cu's small-problem row, D-128; 16-bit, cooperative), or
// 128 x 256 for long K (16-bit, cooperative, D-139).
constexpr int kBM = 128;
constexpr int kConsumers = 2, kThreads = 128 * (1 + kConsumers);
// kPP (ping-pong, 16-bit only): each consumer owns whole tiles (two 64-row blocks), the two taking
// turns, so one's epilogue runs under the other's mainloop. Else cooperative: each consumer owns 64
// rows of every tile (TF32: fp32 staging for two whole tiles would leave 3 stages). launch() picks.
template <bool kPP> constexpr int kRowBlocks = kPP ? 2 : 1;  // 64-row blocks a consumer owns
constexpr int kRegsProducer = 40, kRegsConsumer = 232;
static_assert(registers_fit(kConsumers, kRegsProducer, kRegsConsumer), "register pool");
constexpr int kBoxBytes = 64 * 64 * 2;                // one 64 x 64 TMA box of 16-bit elements (8 KB)
// An M/N-major operand arrives in kBK x kBK boxes (128-byte rows of M/N, kBK rows of K): 64 x 64
// 16-bit, 32 x 32 fp32.
// Per element type T: a 128-byte swizzled row holds kBK elements (the k-tile: 64 halves, 32 fp32),
// a wgmma k-step covers 32 bytes of it (k16, or k8 for tf32), a 16-byte chunk kChunk elements.
template <typename T> constexpr int kBK = 128 / (int)sizeof(T);
template <typename T> constexpr int kStepK = 32 / (int)sizeof(T);
template <typename T> constexpr int kChunk = 16 / (int)sizeof(T);
// TF32 with an N-major B: C^T = B^T A^T, B's tile the A operand from registers (D-132).
template <typename T, bool kAKMajor, bool kBKMajor>
constexpr bool kSwapAB = sizeof(T) == 4 && kAKMajor && !kBKMajor;
// Staging: 16 KB per 64-row block of 16-bit C (64 KB ping-pong, 32 KB cooperative), 32 KB of fp32.
// 128 x 256 tiles (kBN 256): 48 KB a stage, so 4 stages, and one 64 x 128 staging block a consumer.
template <typename T, bool kPP, int kBN = 128>
constexpr int kStages = kBN == 256 ? 4 : kPP || sizeof(T) == 4 ? 5 : 6;
template <int kBN> constexpr int kOutCols = kBN > 128 ? 128 : kBN;  // a staging block's columns
template <int kBN> constexpr int kStageBytes = (kBM + kBN) * 128;  // 32 KB (24 KB at kBN 64) for every T
// The lean prologue (stamps.cuh, D-133): always in the split-K instances, elsewhere by the switch.
// How a CTA works with another (small problems; 2-CTA clusters): alone (persistent), split K, or
// sharing B with the CTA of the next tile.
enum Pairing { kAlone, kSplitK, kShareB };
template <int kPair> constexpr bool kLean = FK_MM_LEAN_PROLOGUE || kPair != kAlone;

// Named barriers: 0 is __syncthreads; consumer warpgroup c syncs its 128 threads on kConsumer0 + c;
// ping-pong consumer c may start a mainloop once the other has arrived on kOrder0 + c.
enum NamedBarrier { kConsumer0 = 1, kOrder0 = 3 };

template <typename T, bool kPP, int kBN = 128> struct Smem {
    static constexpr int kStages = ::fk::mm::kStages<T, kPP, kBN>;
    alignas(1024) T a[kStages][kBM * kBK<T>];
    alignas(1024) T b[kStages][kBN * kBK<T>];
    // A 64 x kOutCols block as swizzled 64 x kBK boxes. Split K: also the fp32 partial tile (64 x kBN)
    // the peer CTA sends in (as large as two 16-bit staging blocks), read before any staging.
    alignas(1024) T out[kConsumers * kRowBlocks<kPP>][64 * kOutCols<kBN>];
    alignas(16) T bias[kConsumers][kOutCols<kBN>];  // each consumer's block of the bias
    uint64_t full[kStages], empty[kStages];
    uint64_t partial_full;  // split K: the peer's partial tile has landed in `out`
};
template <typename T, bool kPP, int kBN = 128> constexpr int kSmemBytes = sizeof(Smem<T, kPP, kBN>) + 1024;  // + to align
static_assert(kSmemBytes<__half, true> <= 227 * 1024 && kSmemBytes<__half, false> <= 227 * 1024 &&
                  kSmemBytes<__half, false, 256> <= 227 * 1024 &&
                  kSmemBytes<float, false> <= 227 * 1024,
              "the operand ring and staging fit Hopper's shared memory");
template <int kBN> constexpr bool kPartialFits = sizeof(Smem<__half, false, kBN>::out) >= 64 * kBN * 4;
static_assert(kPartialFits<128> && kPartialFits<64>, "a split-K partial tile fits the staging buffers");

// Tile `tile` of the persistent walk: its batch, then grouped (tm, tn).
struct Work {
    int64_t batch, m0, n0;
};
template <int kBN = 128> __device__ __forceinline__ Work work_of(int64_t tile, int tiles_m, int tiles_n) {
    const int64_t per_batch = (int64_t)tiles_m * tiles_n;
    const TileIndex t = grouped_tile((int)(tile % per_batch), tiles_m, tiles_n, 8);
    return {tile / per_batch, (int64_t)t.tm * kBM, (int64_t)t.tn * kBN};
}

// Which output tiles and k-tiles a CTA takes: persistent; with split K (a 2-CTA cluster a tile, one
// tile a cluster) cluster rank r takes k-tiles [r k_tiles / 2, (r + 1) k_tiles / 2); sharing B, tile
// blockIdx.x (one a CTA), all k-tiles.
struct Walk {
    int64_t first, step;  // tiles first, first + step, ...
    int kt_begin, kt_end;
    int rank;             // the cluster rank (split K: its consumer `rank` finishes the tile), else 0
};
template <int kPair> __device__ __forceinline__ Walk walk_of(int k_tiles) {
    if constexpr (kPair == kAlone) return {blockIdx.x, gridDim.x, 0, k_tiles, 0};
    const int rank = (int)cluster_ctarank();
    if constexpr (kPair == kShareB) return {blockIdx.x, gridDim.x, 0, k_tiles, rank};
    return {blockIdx.x / 2, gridDim.x / 2, k_tiles * rank / 2, k_tiles * (rank + 1) / 2, rank};
}

template <typename T, bool kPP, int kBN, int kPair, bool kAKMajor, bool kBKMajor>
__device__ __forceinline__ void producer(Smem<T, kPP, kBN> &s, const CUtensorMap *map_a, const CUtensorMap *map_b,
                                         const KernelParams &p, int tiles_m, int tiles_n, int k_tiles) {
    RingStage<kStages<T, kPP, kBN>> st;
    const int64_t total = (int64_t)tiles_m * tiles_n * p.batch;
    const Walk wk = walk_of<kPair>(k_tiles);
    if constexpr (kPair == kShareB) barrier_cluster_wait();  // the peer's barriers are ready for its B half
    for (int64_t tile = wk.first; tile < total; tile += wk.step) {
        Work w = work_of<kBN>(tile, tiles_m, tiles_n);
        if constexpr (kLean<kPair>) {
            if (tile == wk.first) {  // the first tile's coordinates are made before the wait
                grid_dependency_wait(w.batch, w.m0, w.n0);
                FK_MM_STAMP(p, kStampWaited);
            }
        }
        const int ca = p.a_batch ? (int)w.batch : 0, cb = p.b_batch ? (int)w.batch : 0;
        for (int kt = wk.kt_begin; kt < wk.kt_end; kt++, st.next()) {
            mbar_wait(&s.empty[st.slot], st.phase ^ 1);  // the first pass finds every slot free
            mbar_arrive_expect_tx(&s.full[st.slot], kStageBytes<kBN>);
            const int k0 = kt * kBK<T>;
            if constexpr (kAKMajor) {
                tma_load_3d(s.a[st.slot], map_a, &s.full[st.slot], k0, (int)w.m0, ca);
            } else {
#pragma unroll
                for (int h = 0; h < kBM / kBK<T>; h++)
                    tma_load_3d(s.a[st.slot] + h * kBK<T> * kBK<T>, map_a, &s.full[st.slot], (int)w.m0 + kBK<T> * h,
                                k0, ca);
            }
            if constexpr (kPair == kShareB) {  // B's half `rank` (64 rows of N), into both CTAs
                const int h = wk.rank;
                if constexpr (kBKMajor) {
                    tma_load_3d_multicast(s.b[st.slot] + h * 64 * kBK<T>, map_b, &s.full[st.slot], k0,
                                          (int)w.n0 + 64 * h, cb, 0b11);
                } else {
                    tma_load_3d_multicast(s.b[st.slot] + h * kBK<T> * kBK<T>, map_b, &s.full[st.slot],
                                          (int)w.n0 + kBK<T> * h, k0, cb, 0b11);
                }
            } else if constexpr (kBKMajor) {
                tma_load_3d(s.b[st.slot], map_b, &s.full[st.slot], k0, (int)w.n0, cb);
            } else {
#pragma unroll
                for (int h = 0; h < kBN / kBK<T>; h++)
                    tma_load_3d(s.b[st.slot] + h * kBK<T> * kBK<T>, map_b, &s.full[st.slot], (int)w.n0 + kBK<T> * h,
                                k0, cb);
            }
            if (tile == wk.first && kt == wk.kt_begin) FK_MM_STAMP(p, kStampIssued);
        }
    }
}

// Element (r, col) of a consumer's 64 x 128 staging tile, in the TMA's 128-byte-swizzled box layout:
// boxes of 64 rows x 128 bytes, the 16-byte chunk of row r at chunk ^ (r % 8), so the 8 rows a warp
// writes at once fall in different banks.
template <typename T> __device__ __forceinline__ int staged_at(int r, int col) {
    constexpr int kBox = kBK<T>, kCh = kChunk<T>;  // a box row: 128 bytes of C
    const int cc = col % kBox;
    return (col / kBox) * 64 * kBox + r * kBox + (((cc / kCh) ^ (r % 8)) * kCh) + cc % kCh;
}

// Each consumer writes its 64 x 128 tile (bias added, GELU applied, in T) into its staging buffer,
// then stores it: by TMA (one thread; clipped at the matrix edges; the warpgroup moves on while the
// copy drains), or, where C's rows are not 16-byte aligned (n = 1793), by the whole warpgroup, a
// row at a time, consecutive threads on consecutive columns (coalesced 2-byte stores; stores of
// accumulator pairs from registers touched 8 rows an instruction: 1793^3 ran 1.7x slower, D-113).
// The pre-activation, when asked, goes first. Staging buffers: a ping-pong consumer has two and
// alternates them, block after block (pre-activation and C of a block when there is a pre-activation,
// else one block then the other), so a block is written while the previous block's TMA store still
// reads the other buffer; a cooperative consumer has one, and each block waits for the store before.
// The bias is loaded once a block, a column a thread, into the consumer's `bias_s`, and added to the
// accumulators before both passes (per-element global loads, twice with a pre-activation, were where
// ncu found the epilogue waiting; D-119).
// Row block rb (64 rows from w.m0 + 64 rb) through `buffers`, consumer c's kBuffers staging buffers.
template <int kAct, bool kPre, typename T, int kBN, int kBuffers>
__device__ __forceinline__ void epilogue(T (*buffers)[64 * kBN], T *bias_s, const CUtensorMap *map_c,
                                         const CUtensorMap *map_pre, const Params &p, float (&acc)[kBN / 2],
                                         const Work &w, int rb, int c, int t) {
    static_assert(kBN <= 128, "at most a bias column a consumer thread");
    const int row0 = (t / 32) * 16 + (t % 32) / 4;
    if (p.bias) {  // the last reads of the previous block's bias were before its last barrier
        const int64_t n = w.n0 + t;
        if (t < kBN) bias_s[t] = n < p.n ? static_cast<const T *>(p.bias)[n] : from_f32<T>(0.0f);
        named_barrier_sync(kConsumer0 + c, 128);
#pragma unroll
        for (int j = 0; j < kBN / 8; j++) {  // added to the accumulators once, for both passes
            const int col = 8 * j + 2 * (t % 4);
            const float b0 = to_f32(bias_s[col]), b1 = to_f32(bias_s[col + 1]);
#pragma unroll
            for (int h = 0; h < 2; h++) acc[4 * j + 2 * h] += b0, acc[4 * j + 2 * h + 1] += b1;
        }
    }
#pragma unroll
    for (int pass = 0; pass < 2; pass++) {  // 0: the pre-activation (when asked), 1: C
        if (pass == 0 && !kPre) continue;
        T *out = buffers[kBuffers == 1 ? 0 : kPre ? pass : rb];
        if (p.tma_store && t == 0) bulk_wait_group_read<kBuffers - 1>();  // its previous store has read it
        named_barrier_sync(kConsumer0 + c, 128);  // (element stores: every thread has read it)
#pragma unroll
        for (int j = 0; j < kBN / 8; j++) {
            const int col = 8 * j + 2 * (t % 4);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
                if (pass == 1) v0 = activate<kAct, T>(v0), v1 = activate<kAct, T>(v1);
                const int at = staged_at<T>(row0 + 8 * h, col);
                if constexpr (std::is_same_v<T, float>) {
                    *reinterpret_cast<float2 *>(out + at) = make_float2(v0, v1);
                } else {
                    T pair[2] = {from_f32<T>(v0), from_f32<T>(v1)};
                    *reinterpret_cast<uint32_t *>(out + at) = *reinterpret_cast<const uint32_t *>(pair);
                }
            }
        }
        if (p.tma_store) {
            fence_proxy_async_shared();
            named_barrier_sync(kConsumer0 + c, 128);
            if (t == 0) {
#pragma unroll
                for (int box = 0; box < kBN / kBK<T>; box++)
                    tma_store_3d(pass == 0 ? map_pre : map_c, out + box * 64 * kBK<T>, (int)w.n0 + box * kBK<T>,
                                 (int)w.m0 + rb * 64, (int)w.batch);
                bulk_commit_group();
            }
            continue;
        }
        named_barrier_sync(kConsumer0 + c, 128);
        T *dst = static_cast<T *>(pass == 0 ? p.pre : p.c) + w.batch * p.c_batch;
        constexpr int kRowsAtOnce = 128 / kBN;  // a column a thread, 128 / kBN rows at once
        const int64_t col = w.n0 + t % kBN, row_end = p.m - (w.m0 + rb * 64);
        if (col < p.n) {
#pragma unroll 8
            for (int r = t / kBN; r < 64 && r < row_end; r += kRowsAtOnce)
                dst[(w.m0 + rb * 64 + r) * p.c_row + col] = out[staged_at<T>(r, t % kBN)];
        }
    }
}

// ---- TF32 with an N-major B (kSwapAB, D-132): C^T = B^T A^T ------------------------------------
// Consumer c owns B's columns 64c .. 64c + 63 of the tile (its accumulator rows) against all 128 of
// A's rows (its accumulator columns). Accumulator rows g and g + 8 of warp u's 16 are made the
// adjacent columns swapped_col(t) and + 1 of B, so a thread loads its fragment's pairs with 8-byte
// loads and stores C's pairs with 8-byte stores. A half warp's 8 columns are the 16-byte chunks h
// and h ^ 5 of a 128-byte row (h = its index 0..3 in the box): under the swizzle (chunk ^ row % 8)
// its four k-rows of a load (row % 8 in 0..3 or 4..7) and its four C rows of a store (row % 8 in
// {0, 2, 4, 6} + e) then fall in 8 different chunks: neither conflicts. Consumer-local, 0..62, even.
constexpr int kBNSwapped = 128;  // its tile is 128 x 128
__device__ __forceinline__ int swapped_col(int t) {
    const int u = t / 32, g = (t % 32) / 4, h = 2 * (u % 2) + g / 4, p = g % 4;
    return 32 * (u / 2) + 4 * (p / 2 ? h ^ 5 : h) + 2 * (p % 2);
}

// One k-tile: each thread loads its A fragments (B's tile, 32 x 32 boxes of 32 k-rows of 128 bytes)
// for the four k8 steps into `frag`, then the warpgroup issues the four wgmmas on them and A's
// K-major tile. `other` holds the previous k-tile's fragments, read by the group still in flight
// until the wait here: fencing them after it keeps the compiler from reusing their registers sooner.
__device__ __forceinline__ void swapped_k_tile(Smem<float, false> &s, RingStage<kStages<float, false>> &st,
                                               float (&acc)[kBNSwapped / 2], uint32_t (&frag)[4][4],
                                               uint32_t (&other)[4][4], const int (&at)[2], int kt, int t,
                                               int &previous) {
    mbar_wait(&s.full[st.slot], st.phase);
    const float *b = s.b[st.slot];
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {  // k8 step kk: box rows 8 kk + t % 4 (a0, a1) and + 4 (a2, a3)
        ld_shared_v2_b32(frag[kk][0], frag[kk][1], b + at[0] + kk * 8 * 32);
        ld_shared_v2_b32(frag[kk][2], frag[kk][3], b + at[1] + kk * 8 * 32);
    }
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
        wgmma_m64n128k8_tf32_rs(acc, frag[kk], smem_desc_sw128(s.a[st.slot] + kk * kStepK<float>, 16, 1024),
                                kt > 0 || kk > 0);
    wgmma_commit();
    wgmma_wait<1>();  // the previous k-tile's wgmmas are done: release its stage, reuse its registers
#pragma unroll
    for (int kk = 0; kk < 4; kk++) wgmma_fence_operands(other[kk]);
    if (previous >= 0 && t == 0) mbar_arrive(&s.empty[previous]);
    previous = st.slot;
    st.next();
}

// The mainloop of one tile; returns the last stage read (released by the caller after wait<0>).
__device__ __forceinline__ int swapped_mainloop(Smem<float, false> &s, RingStage<kStages<float, false>> &st,
                                                float (&acc)[kBNSwapped / 2], int k_tiles, int c, int t) {
    // Element (k, col) of the stage's B tile: box col / 32, its k-row k, 16-byte chunk
    // (col % 32 / 4) ^ (k % 8); this thread reads columns col, col + 1 at k-rows t % 4 and t % 4 + 4.
    const int col = 64 * c + swapped_col(t), box = col / 32, chunk = col % 32 / 4;
    int at[2];
#pragma unroll
    for (int q = 0; q < 2; q++) {
        const int kr = t % 4 + 4 * q;
        at[q] = box * 32 * 32 + kr * 32 + ((chunk ^ kr) * 4) + col % 4;
    }
    uint32_t frag0[4][4] = {}, frag1[4][4] = {};
    int previous = -1, kt = 0;
    for (; kt + 1 < k_tiles; kt += 2) {  // two fragment sets, taken in turn
        swapped_k_tile(s, st, acc, frag0, frag1, at, kt, t, previous);
        swapped_k_tile(s, st, acc, frag1, frag0, at, kt + 1, t, previous);
    }
    if (kt < k_tiles) swapped_k_tile(s, st, acc, frag0, frag1, at, kt, t, previous);
    return previous;
}

// The epilogue of a swapped tile: consumer c's block of C is A's 128 rows x its 64 columns of B,
// staged as two 64-row halves of two 64 x 32 swizzled boxes (out + 64 * 64 * (row / 64)), stored
// by TMA (4 boxes) or by element stores (64 threads a row, coalesced). A thread's accumulators
// 4 j + e (row g) and 4 j + 2 + e (row g + 8) are C's columns col, col + 1 of row 8 j + 2 (t % 4) + e:
// one 8-byte shared store, conflict-free per half warp. Bias, pre-activation and the order of the
// passes as in epilogue() (cooperative: one buffer).
template <int kAct, bool kPre>
__device__ __forceinline__ void swapped_epilogue(float *out, float *bias_s, const CUtensorMap *map_c,
                                                 const CUtensorMap *map_pre, const Params &p,
                                                 float (&acc)[kBNSwapped / 2], const Work &w, int c, int t) {
    const int col = swapped_col(t), row_lane = 2 * (t % 4);
    if (p.bias) {  // the last reads of the previous tile's bias were before its last barrier
        const int64_t n = w.n0 + t;
        bias_s[t] = n < p.n ? static_cast<const float *>(p.bias)[n] : 0.0f;
        named_barrier_sync(kConsumer0 + c, 128);
        const float b0 = bias_s[64 * c + col], b1 = bias_s[64 * c + col + 1];
#pragma unroll
        for (int j = 0; j < kBNSwapped / 8; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) acc[4 * j + e] += b0, acc[4 * j + 2 + e] += b1;
    }
#pragma unroll
    for (int pass = 0; pass < 2; pass++) {  // 0: the pre-activation (when asked), 1: C
        if (pass == 0 && !kPre) continue;
        if (p.tma_store && t == 0) bulk_wait_group_read<0>();  // its previous store has read it
        named_barrier_sync(kConsumer0 + c, 128);                // (element stores: every thread has read it)
#pragma unroll
        for (int j = 0; j < kBNSwapped / 8; j++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float v0 = acc[4 * j + e], v1 = acc[4 * j + 2 + e];
                if (pass == 1) v0 = activate<kAct, float>(v0), v1 = activate<kAct, float>(v1);
                const int r = 8 * j + row_lane + e;
                st_shared_v2_f32(out + (r / 64) * 64 * 64 + staged_at<float>(r % 64, col), v0, v1);
            }
        }
        if (p.tma_store) {
            fence_proxy_async_shared();
            named_barrier_sync(kConsumer0 + c, 128);
            if (t == 0) {
#pragma unroll
                for (int half = 0; half < 2; half++)
#pragma unroll
                    for (int box = 0; box < 2; box++)
                        tma_store_3d(pass == 0 ? map_pre : map_c, out + half * 64 * 64 + box * 64 * 32,
                                     (int)w.n0 + 64 * c + 32 * box, (int)w.m0 + 64 * half, (int)w.batch);
                bulk_commit_group();
            }
            continue;
        }
        named_barrier_sync(kConsumer0 + c, 128);
        float *dst = static_cast<float *>(pass == 0 ? p.pre : p.c) + w.batch * p.c_batch;
        const int64_t n = w.n0 + 64 * c + t % 64, row_end = p.m - w.m0;
        if (n < p.n) {
#pragma unroll 8
            for (int r = t / 64; r < kBM && r < row_end; r += 2)
                dst[(w.m0 + r) * p.c_row + n] = out[(r / 64) * 64 * 64 + staged_at<float>(r % 64, t % 64)];
        }
    }
}

// A consumer's release of stage `slot`: to its producer, and sharing B (peer_empty: the peer CTA's
// empty[0]) to the peer's, whose half of B it read too.
template <int kPair, typename T, bool kPP, int kBN>
__device__ __forceinline__ void release(Smem<T, kPP, kBN> &s, uint32_t peer_empty, int slot) {
    mbar_arrive(&s.empty[slot]);
    if constexpr (kPair == kShareB) mbar_arrive_cluster(peer_empty + (uint32_t)(slot * sizeof(uint64_t)));
}

// Split K: the partial tile of consumer c (fp32, 64 x kBN) into the `out` buffers of cluster rank
// `to`, 16 bytes a store (thread t's accumulators i..i+3 at float4 (i / 4) x 128 + t), counted on that
// CTA's partial_full. The caller has waited on the cluster barrier: the peer's mbarrier is ready.
template <typename T, int kBN>
__device__ __forceinline__ void send_partial(Smem<T, false, kBN> &s, const float (&acc)[kBN / 2], uint32_t to, int t) {
    const uint32_t dst = mapa_shared_cluster(s.out, to), bar = mapa_shared_cluster(&s.partial_full, to);
#pragma unroll
    for (int i = 0; i < kBN / 2; i += 4)
        st_async_v4(dst + (uint32_t)(((i / 4) * 128 + t) * 16), acc[i], acc[i + 1], acc[i + 2], acc[i + 3], bar);
}
// ... and its sum into the receiving consumer's accumulators, once all of it has landed.
template <typename T, int kBN>
__device__ __forceinline__ void add_partial(Smem<T, false, kBN> &s, float (&acc)[kBN / 2], int t) {
    mbar_wait(&s.partial_full, 0);
    const float4 *in = reinterpret_cast<const float4 *>(&s.out[0][0]);
#pragma unroll
    for (int i = 0; i < kBN / 2; i += 4) {
        const float4 v = in[(i / 4) * 128 + t];
        acc[i] += v.x, acc[i + 1] += v.y, acc[i + 2] += v.z, acc[i + 3] += v.w;
    }
}

template <typename T, bool kPP, int kBN, int kPair, bool kAKMajor, bool kBKMajor>
__device__ __forceinline__ void consumer(Smem<T, kPP, kBN> &s, const CUtensorMap *map_c, const CUtensorMap *map_pre,
                                         const KernelParams &p, int tiles_m, int tiles_n, int k_tiles_all) {
    constexpr int kRB = kRowBlocks<kPP>;
    static_assert(!(kPair != kAlone && kPP), "paired CTAs are cooperative");
    const int c = threadIdx.x / 128 - 1, t = threadIdx.x % 128;
    if constexpr (kLean<kPair>) grid_dependency_wait();  // off the critical path: the first full[] comes after the producer's
    RingStage<kStages<T, kPP, kBN>> st;
    float acc[kRB][kBN / 2];
    const int64_t total = (int64_t)tiles_m * tiles_n * p.batch;
    const Walk wk = walk_of<kPair>(k_tiles_all);
    // sharing B: a stage is released to both producers (the peer's barriers are ready after the wait)
    uint32_t peer_empty = 0;
    if constexpr (kPair == kShareB) {
        barrier_cluster_wait();
        peer_empty = mapa_shared_cluster(&s.empty[0], (uint32_t)(wk.rank ^ 1));
    }
    // timestamps (stamps.cuh): consumer wk.rank's first thread, the one that finishes the tile
    if (c == wk.rank && t == 0) FK_MM_STAMP(p, kStampReady);
    const int k_tiles = wk.kt_end - wk.kt_begin;  // this CTA's
    // Ping-pong: consumer c takes the CTA's tiles c, c + 2, ... and skips the other's ring stages.
    const int64_t first = wk.first + (kPP ? (int64_t)c * wk.step : 0);
    const int64_t step = wk.step * (kPP ? kConsumers : 1);
    if (kPP && c == 1) st.skip(k_tiles);
    for (int64_t tile = first; tile < total; tile += step) {
        const Work w = work_of<kBN>(tile, tiles_m, tiles_n);
        // Ping-pong: the mainloops take turns. Besides keeping the tensor cores to one consumer, the
        // turn makes the parity waits sound: the other's stages of every slot have completed before
        // this consumer waits on the slot again (a wait a whole tile ahead matched an old phase).
        if (kPP && tile != wk.first) named_barrier_sync(kOrder0 + c, 2 * 128);
        int previous = -1;
#pragma unroll
        for (int h = 0; h < kRB; h++) wgmma_fence_operands(acc[h]);
        if constexpr (kSwapAB<T, kAKMajor, kBKMajor>) {
            previous = swapped_mainloop(s, st, acc[0], k_tiles, c, t);
        } else {
            for (int kt = 0; kt < k_tiles; kt++, st.next()) {
                mbar_wait(&s.full[st.slot], st.phase);
                if (c == wk.rank && t == 0 && tile == wk.first && kt == 0) FK_MM_STAMP(p, kStampFull0);
                if (c == wk.rank && t == 0 && tile == wk.first && kt == k_tiles - 1) FK_MM_STAMP(p, kStampFullLast);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < kBK<T> / kStepK<T>; kk++) {
#pragma unroll
                    for (int h = 0; h < kRB; h++) {
                        const int rb = kPP ? h : c;  // the 64-row block of A
                        // K-major: 128-byte rows of K, 8-row groups 1024 bytes apart, a k-step = 32 bytes along a row.
                        // M/N-major (16-bit): 64 x 64 boxes (8 KB apart) of 128-byte K rows, k16 = 16 rows = 2048 bytes.
                        const uint64_t da = kAKMajor
                            ? smem_desc_sw128(s.a[st.slot] + rb * 64 * kBK<T> + kk * kStepK<T>, 16, 1024)
                            : smem_desc_sw128(s.a[st.slot] + rb * 64 * 64 + kk * 16 * 64, kBoxBytes, 1024);
                        const uint64_t db = kBKMajor ? smem_desc_sw128(s.b[st.slot] + kk * kStepK<T>, 16, 1024)
                                                     : smem_desc_sw128(s.b[st.slot] + kk * 16 * 64, kBoxBytes, 1024);
                        if constexpr (std::is_same_v<T, float>) {
                            wgmma_m64n128k8_tf32(acc[h], da, db, kt > 0 || kk > 0);
                        } else if constexpr (kBN == 64) {
                            wgmma_m64n64k16<T, !kAKMajor, !kBKMajor>(acc[h], da, db, kt > 0 || kk > 0);
                        } else if constexpr (kBN == 256) {
                            wgmma_m64n256k16<T, !kAKMajor, !kBKMajor>(acc[h], da, db, kt > 0 || kk > 0);
                        } else {
                            wgmma_m64n128k16<T, !kAKMajor, !kBKMajor>(acc[h], da, db, kt > 0 || kk > 0);
                        }
                    }
                }
                wgmma_commit();
                wgmma_wait<1>();  // the previous stage's wgmmas are done: release it
                if (previous >= 0 && t == 0) release<kPair>(s, peer_empty, previous);
                previous = st.slot;
            }
        }
        if (kPP) named_barrier_arrive(kOrder0 + (1 - c), 2 * 128);  // its waits are done: the other's turn
        wgmma_wait<0>();
#pragma unroll
        for (int h = 0; h < kRB; h++) wgmma_fence_operands(acc[h]);
        if (c == wk.rank && t == 0 && tile == wk.first) FK_MM_STAMP(p, kStampMmaDone);
        if (previous >= 0 && t == 0) release<kPair>(s, peer_empty, previous);
        if (k_tiles == 0) {
#pragma unroll
            for (int h = 0; h < kRB; h++)
#pragma unroll
                for (int i = 0; i < kBN / 2; i++) acc[h][i] = 0.0f;
        }
        if constexpr (kPair == kSplitK) {  // rank c finishes row block c, the other rank's consumer c sends its partial
            if (wk.rank != c) {
                barrier_cluster_wait();  // pairs with the kernel's arrival: the peer's mbarrier is ready
                send_partial(s, acc[0], (uint32_t)c, t);
                if (t == 0) FK_MM_STAMP(p, kStampEnd1);
                return;  // its one tile
            }
            add_partial(s, acc[0], t);
        }
        // compiled per activation and per pre-activation store (the buffers' order depends on it)
        with_activation(p.activation, [&](auto act) {
            auto run = [&](auto pre) {
                if constexpr (kSwapAB<T, kAKMajor, kBKMajor>) {
                    swapped_epilogue<act.value, pre.value>(s.out[c], s.bias[c], map_c, map_pre, p, acc[0], w, c, t);
                } else if constexpr (kBN == 256) {  // two 64 x 128 halves through one staging block
#pragma unroll
                    for (int h = 0; h < 2; h++)
                        epilogue<act.value, pre.value, T, 128, 1>(s.out + c, s.bias[c], map_c, map_pre, p,
                                                                  *reinterpret_cast<float(*)[64]>(&acc[0][64 * h]),
                                                                  Work{w.batch, w.m0, w.n0 + 128 * h}, c, c, t);
                } else {
#pragma unroll
                    for (int h = 0; h < kRB; h++)
                        epilogue<act.value, pre.value, T, kBN, kRB>(s.out + c * kRB, s.bias[c], map_c, map_pre, p,
                                                                    acc[h], w, kPP ? h : c, c, t);
                }
            };
            if (p.pre) run(std::true_type{}); else run(std::false_type{});
        });
        if (c == wk.rank && t == 0 && tile == wk.first) FK_MM_STAMP(p, kStampStored);
        if (kPP) st.skip(k_tiles);  // the other consumer's next tile
    }
    if (p.tma_store && t == 0) bulk_wait_group<0>();  // the last stores finish before the CTA exits
    if (t == 0) FK_MM_STAMP(p, c == wk.rank ? kStampEnd : kStampEnd1);
    if constexpr (kPair == kSplitK) barrier_cluster_wait();  // the kernel's arrival, paired
    if constexpr (kPair == kShareB) barrier_cluster_arrive(), barrier_cluster_wait();  // see the kernel
}

template <typename T, bool kPP, int kBN, int kPair, bool kAKMajor, bool kBKMajor>
__global__ void __launch_bounds__(kThreads, 1)
    matmul_wgmma_sm90(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                      const __grid_constant__ CUtensorMap map_c, const __grid_constant__ CUtensorMap map_pre,
                      KernelParams p) {
    static_assert(!std::is_same_v<T, float> || (kAKMajor && !kPP && kBN == 128 && kPair == kAlone),
                  "tf32: A K-major, cooperative, 128 x 128");
#if FK_SM90A
    extern __shared__ unsigned char smem_raw[];
    auto &s = smem_aligned_1024<Smem<T, kPP, kBN>>(smem_raw);
    if (threadIdx.x == 0) {
        FK_MM_STAMP(p, kStampEntry);
        for (int i = 0; i < kStages<T, kPP, kBN>; i++)  // a stage is released by each consumer reading it
            mbar_init(&s.full[i], 1), mbar_init(&s.empty[i], kPP ? 1 : kConsumers * (kPair == kShareB ? 2 : 1));
        if constexpr (kPair == kSplitK) mbar_init(&s.partial_full, 1);
        fence_barrier_init();
        prefetch_tensormap(&map_a);
        prefetch_tensormap(&map_b);
        FK_MM_STAMP(p, kStampInit);
    }
    __syncthreads();
    if (threadIdx.x == 0) FK_MM_STAMP(p, kStampSynced);
    // Paired CTAs: each thread arrives on the cluster barrier once its CTA's barriers are ready (split K:
    // partial_full takes thread 0's arrival and the peer's bytes) and waits before its first access to
    // the peer. Sharing B, a second arrival and wait at the end keep each CTA alive while the peer may
    // still release its stages (remote arrivals on empty[]).
    if constexpr (kPair != kAlone) {
        if (kPair == kSplitK && threadIdx.x == 0) mbar_arrive_expect_tx(&s.partial_full, 64 * kBN * 4);
        barrier_cluster_arrive_relaxed();
    }
    if constexpr (kLean<kPair>) {
        grid_dependency_launch();  // each role waits for the previous grid itself, as late as it can
    } else {
        grid_dependency_sync();
        if (threadIdx.x == 0) FK_MM_STAMP(p, kStampWaited);
    }
    const int tiles_m = (int)((p.m + kBM - 1) / kBM), tiles_n = (int)((p.n + kBN - 1) / kBN);
    const int k_tiles = (int)((p.k + kBK<T> - 1) / kBK<T>);
    if (threadIdx.x < 128) {
        setmaxnreg_dec<kRegsProducer>();
        if (threadIdx.x == 0)
            producer<T, kPP, kBN, kPair, kAKMajor, kBKMajor>(s, &map_a, &map_b, p, tiles_m, tiles_n, k_tiles);
        if constexpr (kPair != kAlone) {  // the kernel's arrival, paired (the producer thread's, sharing B: there)
            if (kPair == kSplitK || threadIdx.x != 0) barrier_cluster_wait();
            if (kPair == kShareB) barrier_cluster_arrive(), barrier_cluster_wait();
        }
    } else {
        setmaxnreg_inc<kRegsConsumer>();
        consumer<T, kPP, kBN, kPair, kAKMajor, kBKMajor>(s, &map_c, &map_pre, p, tiles_m, tiles_n, k_tiles);
    }
#endif
}

// ---- host: tensor maps and launch ---------------------------------------------------------------

// How a map reads its elements: C (and pre) are stored as they are; fp32 operands are read as tf32,
// the TMA rounding each element to nearest on the way to shared memory.
enum class MapUse { kOperand, kOutput };
CUtensorMapDataType map_type(fk_dtype dtype, MapUse use) {
    if (dtype == FK_FLOAT32)
        return use == MapUse::kOperand ? CU_TENSOR_MAP_DATA_TYPE_TFLOAT32 : CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
    return dtype == FK_BFLOAT16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
}

// A 3-d map (inner, outer, batch) in boxes of 128 bytes (64 16-bit / 32 fp32 elements) x box_outer,
// 128-byte swizzle; a batch stride of 0 (a broadcast operand) is one batch, always read at batch 0.
// L2 promotion of 256 bytes, or 128 where rows are not 256-byte aligned: 1800^3 (rows of 3600
// bytes) took 61 us with 256, 36 with 128 (24 with rows padded to 3712; D-113).
bool encode(CUtensorMap *map, fk_dtype dtype, MapUse use, const void *base, int64_t inner, int64_t outer,
            int64_t stride, int64_t batch, int64_t batch_stride, int box_outer) {
    const int elem = fk_dtype_size(dtype);
    const cuuint64_t dims[3] = {(cuuint64_t)inner, (cuuint64_t)outer, (cuuint64_t)(batch_stride ? batch : 1)};
    const cuuint64_t strides[2] = {(cuuint64_t)(stride * elem),
                                   (cuuint64_t)((batch_stride ? batch_stride : stride * outer) * elem)};
    const cuuint32_t box[3] = {(cuuint32_t)(128 / elem), (cuuint32_t)box_outer, 1};
    return encode_tiled(map, map_type(dtype, use), 3, base, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B,
                        (stride * elem) % 256 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B : CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
}

// The operand maps (a K-major B in boxes of b_box rows of N), C's and the pre-activation's where their
// rows are 16-byte aligned (q.tma_store: TMA stores, else element stores), and the kernel's parameters.
struct Maps {
    CUtensorMap a, b, c = {}, pre = {};
    KernelParams q;
};
template <typename T, bool kAKMajor, bool kBKMajor>
bool encode_maps(Maps &m, const Params &p, fk_dtype dtype, int b_box) {
    constexpr MapUse kIn = MapUse::kOperand, kOut = MapUse::kOutput;
    const bool ok_a = kAKMajor ? encode(&m.a, dtype, kIn, p.a, p.k, p.m, p.a_row, p.batch, p.a_batch, kBM)
                               : encode(&m.a, dtype, kIn, p.a, p.m, p.k, p.a_col, p.batch, p.a_batch, kBK<T>);
    const bool ok_b = kBKMajor ? encode(&m.b, dtype, kIn, p.b, p.k, p.n, p.b_col, p.batch, p.b_batch, b_box)
                               : encode(&m.b, dtype, kIn, p.b, p.n, p.k, p.b_row, p.batch, p.b_batch, kBK<T>);
    m.q = stamped(p);  // p (stamps.cuh: with its stamp slot in a timestamp build)
    constexpr int kElem = (int)sizeof(T);
    m.q.tma_store = aligned16(p.c) && (p.pre == nullptr || aligned16(p.pre)) && (p.c_row * kElem) % 16 == 0 &&
                    (p.c_batch * kElem) % 16 == 0 &&
                    encode(&m.c, dtype, kOut, p.c, p.n, p.m, p.c_row, p.batch, p.c_batch, 64) &&
                    (p.pre == nullptr || encode(&m.pre, dtype, kOut, p.pre, p.n, p.m, p.c_row, p.batch, p.c_batch, 64));
    return ok_a && ok_b;
}

// Launches `kernel` with `smem` bytes of dynamic shared memory, `grid` CTAs in clusters of `cluster`.
template <typename Kernel>
fk_status launch_kernel(Kernel kernel, int smem, const Maps &m, unsigned grid, int cluster, int device,
                        cudaStream_t stream) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return cuda_status(e, "matmul");
    return Launch(dim3(grid), dim3(kThreads), smem, stream, device, cluster)("matmul", kernel, m.a, m.b, m.c, m.pre, m.q);
}

// f(a K-major, b K-major) with both as std::bool_constant: the four operand-major instances.
template <typename F> fk_status with_majors(bool a_kmajor, bool b_kmajor, F f) {
    using Yes = std::true_type;
    using No = std::false_type;
    if (a_kmajor) return b_kmajor ? f(Yes{}, Yes{}) : f(Yes{}, No{});
    return b_kmajor ? f(No{}, Yes{}) : f(No{}, No{});
}

}  // namespace
}  // namespace fk::mm
