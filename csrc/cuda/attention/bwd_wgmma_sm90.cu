// attention_bwd_wgmma_sm90: the Hopper flash-attention backward (sm_90a: TMA, wgmma, warp
// specialization), FlashAttention-3's scheme. dispatch.cu row "bwd, sm_90, d 64 / 128, not
// deterministic". Tested on the H100 and H200 (tests/test_attention.py). H200, bf16, backward alone
// (fwd+bwd less fwd): 0.91-1.06x cuDNN, 1.24-1.64x FlashAttention-2, S 512-16k
// (benchmarks/results/attention-h200-2026-11-27.json; docs/attention.md).
//
// Napkin math: 5 products of 2 Sq Sk D FLOPs (S, dP, dV, dK, dQ), counted as 2.5x the forward;
// B 4, H 16, S 4096, D 128: 344 GFLOP, 0.69 ms at cuDNN's ~500 TFLOP/s backward (H200, PERF.md).
// A CTA's 128 keys x 64 queries step does 5 x 2 MFLOP at D 128 (~2.3 us at 4.5 TFLOP/s an SM) for
// 33 KB of TMA loads (Q, dO, lse, D) and a 32 KB fp32 dQ bulk reduction into L2: 14 KB / us an SM,
// ~1.9 TB/s of L2 traffic on 132 SMs, within L2's reach; 8 K exponentials (~0.2 us). The dS and dQ
// round trips through shared memory (16 + 32 KB a step) are the overhead FlashAttention-3 pays too.
// D 64 steps take 128 queries (the same 5 x 2 MFLOP, 64-column wgmmas twice as wide, half the dQ
// reductions a query: fwd+bwd +6-10% over 64-query steps, H200, D-105).
// Registers (consumer): dK + dV + S + dP fp32 = 64 + 64 + 32 + 32 (D 128) or 32 + 32 + 64 + 64
// (D 64) = 192 at the peak, of 240 (no spills since D-140: the shared struct addressed as shared).
// Shared memory: K + V + 2 stages x (Q + dO + lse + D) + dS + dQ = 64 + 2 x 33 + 16 + 32 = 178 KB
// (D 128), 32 + 2 x 33 + 32 + 32 = 162 KB (D 64); one CTA an SM.
//
// Algorithm: attention_bwd_prep (bwd_workspace.cu) writes lse log2 e and D = rowsum(dO O) per
// row, padded to query tiles (padding: +inf, 0), and zeroes the fp32 dQ workspace. One CTA per (128 keys, kv
// head, sequence); warpgroup 0, the producer, loads K and V once, then for each head of the kv
// head's group (GQA summed in the CTA) and each query tile (kBM) the mask lets see the keys: Q, dO
// (TMA) and lse, D (1-d bulk copies) through a two-stage mbarrier ring. Consumer warpgroup c owns
// keys 64 c .. 64 c + 63: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (wgmma SS), Pᵀ = 2^(Sᵀ scale log2 e - lse
// log2 e) (masked), dSᵀ = Pᵀ (dPᵀ - D); dV += Pᵀ dO and dK += dSᵀ Q (wgmma, Pᵀ / dSᵀ from registers:
// the accumulator layout is the A layout); dS goes to shared memory (stmatrix .trans: K-major,
// 128-byte swizzle) and dQ = dS K (wgmma SS) splits the head dim (D 128) or the queries (D 64)
// between the warpgroups; dQ goes to shared memory in accumulator order and one thread adds it to
// the fp32 workspace by a bulk reduction (cp.reduce.async.bulk .add.f32);
// attention_bwd_dq_convert (bwd_workspace.cu) writes dq = scale dQ.
// Why: the sm_80 kernel does 7 products where this does 5, with mma.sync (155 TFLOP/s, H200).
#include "../hopper.cuh"
#include "../matmul/wgmma_ops.cuh"
#include "attention.cuh"

namespace fk::attn {
namespace {

using mm::wgmma_m64n128k16;
using mm::wgmma_m64n128k16_rs;
using mm::wgmma_m64n64k16;
using mm::wgmma_m64n64k16_rs;

constexpr int kBoxCols = 64;   // a 128-byte swizzled TMA box is 64 columns wide
// Queries a ring stage: 128 at D 64 (each warpgroup's dQ takes 64 of them), 64 at D 128 (one m64
// wgmma of dQ, the warpgroups splitting the head dim).
template <int D> constexpr int kBM = bwd_wgmma_block_m(D);
constexpr int kBN = 128;       // keys a CTA: two consumer warpgroups of 64
constexpr int kConsumers = 2;
constexpr int kThreads = 128 * (1 + kConsumers);
// A ring stage is released by every consumer thread (its empty barrier counts kReleasers
// arrivals): each reads the stage's lse and D with generic loads (softmax_grad) before the
// producer's next bulk copy overwrites them. One arrival a warpgroup behind a named barrier, or a
// warp's lane 0 after __syncwarp, is ordered too, but compute-sanitizer's racecheck does not see
// those orders and reported the reads racing the copy (32 errors, H100); with every thread
// arriving it reports none, at no cost: fwd+bwd within 0.4% of lane-0-a-warp arrivals (D-98).
constexpr int kReleasers = kConsumers * 128;
constexpr int kStages = 2;
constexpr int kRegsProducer = 24, kRegsConsumer = 240;
static_assert(registers_fit(kConsumers, kRegsProducer, kRegsConsumer), "register pool");
constexpr int kDqRegionFloats = 64 * 64;  // one warpgroup's m64n64 dQ accumulator

// Named barriers: 0 is __syncthreads. Both consumer warpgroups meet on kDsReady (dS in shared
// memory, the previous dQ reduction done reading its buffer) and on kDqReady (dQ in shared memory,
// dS no longer read).
enum NamedBarrier { kDsReady = 1, kDqReady = 2 };

template <typename T, int D> struct Smem {
    alignas(1024) T k[kBN * D];              // D / 64 boxes of kBN rows x 64 columns
    alignas(1024) T v[kBN * D];
    alignas(1024) T q[kStages][kBM<D> * D];     // D / 64 boxes of kBM rows x 64 columns
    alignas(1024) T dout[kStages][kBM<D> * D];
    alignas(1024) T ds[kBM<D> * kBN];           // dS: kBN / 64 boxes of kBM queries x 64 keys, K-major
    alignas(128) float dq[kConsumers * kDqRegionFloats];  // accumulator order (see below)
    alignas(16) float lse2[kStages][kBM<D>];   // lse log2 e
    alignas(16) float dvec[kStages][kBM<D>];   // rowsum(dO O)
    uint64_t kv_full, full[kStages], empty[kStages];
};
template <int D> constexpr int kSmemBytes = sizeof(Smem<__half, D>) + 1024;  // + room to align to 1024
static_assert(kSmemBytes<128> <= 227 * 1024 && kSmemBytes<64> <= 227 * 1024, "fits Hopper's shared memory");

// The CTA's job: keys [n0, n0 + kBN) of kv head g of sequence b; query tiles [t_lo, t_lo + nq) of
// each of the group's heads: iteration it is head g x group + it / nq, tile t_lo + it % nq.
// ([[maybe_unused]] here and below: other targets compile the kernel body out.)
struct Job {
    Seq s;
    int b, g, group, n0, t_lo, nq;
};
template <int D> [[maybe_unused]] __device__ __forceinline__ Job job_of(const Params &p) {
    Job j;
    j.b = blockIdx.z, j.g = blockIdx.y, j.group = (int)(p.heads / p.kv_heads), j.n0 = blockIdx.x * kBN;
    j.s = seq_of(p, j.b);
    const Range rows = query_range(p, j.s, j.n0, min(j.n0 + kBN, j.s.sk));
    j.t_lo = rows.lo / kBM<D>;
    j.nq = rows.hi > rows.lo ? (rows.hi + kBM<D> - 1) / kBM<D> - j.t_lo : 0;
    return j;
}

// One thread: K and V once, then Q, dO, lse, D per iteration, in the order the consumers take them.
template <typename T, int D>
__device__ __forceinline__ void producer(Smem<T, D> &s, const CUtensorMap *map_q, const CUtensorMap *map_k,
                                         const CUtensorMap *map_v, const CUtensorMap *map_do, const Params &p,
                                         const BwdWork &ws, const Job &j) {
    constexpr int kM = kBM<D>;
    constexpr uint32_t kKVBytes = kBN * D * 2, kStageBytes = 2 * kM * D * 2 + 2 * kM * 4;
    mbar_arrive_expect_tx(&s.kv_full, 2 * kKVBytes);
#pragma unroll
    for (int box = 0; box < D / kBoxCols; box++) {
        tma_load_4d(s.k + box * kBN * kBoxCols, map_k, &s.kv_full, box * kBoxCols, j.n0, j.g, j.b);
        tma_load_4d(s.v + box * kBN * kBoxCols, map_v, &s.kv_full, box * kBoxCols, j.n0, j.g, j.b);
    }
    RingStage<kStages> st;
    for (int it = 0; it < j.nq * j.group; it++) {
        const int h = j.g * j.group + it / j.nq, m0 = (j.t_lo + it % j.nq) * kM;
        mbar_wait(&s.empty[st.slot], st.phase ^ 1);  // the first pass finds every slot free
        mbar_arrive_expect_tx(&s.full[st.slot], kStageBytes);
#pragma unroll
        for (int box = 0; box < D / kBoxCols; box++) {
            tma_load_4d(s.q[st.slot] + box * kM * kBoxCols, map_q, &s.full[st.slot], box * kBoxCols, m0, h, j.b);
            tma_load_4d(s.dout[st.slot] + box * kM * kBoxCols, map_do, &s.full[st.slot], box * kBoxCols, m0, h,
                        j.b);
        }
        const int64_t row = ((int64_t)j.b * p.heads + h) * ws.m_tiles * kBwdRowTile + m0;
        bulk_load(s.lse2[st.slot], ws.lse2 + row, kM * 4, &s.full[st.slot]);
        bulk_load(s.dvec[st.slot], ws.dvec + row, kM * 4, &s.full[st.slot]);
        st.next();
    }
}

// Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for warpgroup c's 64 keys: K-major operands, 128-byte rows of a box,
// 8-row groups 1024 bytes apart; a k16 step is 32 bytes along a row, every fourth the next box.
template <typename T, int D>
__device__ __forceinline__ void issue_s_dp(float (&sc)[kBM<D> / 2], float (&dp)[kBM<D> / 2], const Smem<T, D> &s,
                                           int slot, int c) {
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        const int kv = (kk / 4) * kBN * kBoxCols + c * 64 * kBoxCols + (kk % 4) * 16;
        const int qo = (kk / 4) * kBM<D> * kBoxCols + (kk % 4) * 16;
        const uint64_t k = smem_desc_sw128(s.k + kv, 16, 1024), q = smem_desc_sw128(s.q[slot] + qo, 16, 1024);
        const uint64_t v = smem_desc_sw128(s.v + kv, 16, 1024), g = smem_desc_sw128(s.dout[slot] + qo, 16, 1024);
        if constexpr (kBM<D> == 128) {
            wgmma_m64n128k16<T, 0, 0>(sc, k, q, kk > 0);
            wgmma_m64n128k16<T, 0, 0>(dp, v, g, kk > 0);
        } else {
            wgmma_m64n64k16<T, 0, 0>(sc, k, q, kk > 0);
            wgmma_m64n64k16<T, 0, 0>(dp, v, g, kk > 0);
        }
    }
}

// acc += Aᵀ-from-registers x B (kBM query rows, D columns, N-major: 64-column boxes kBM x 128 bytes
// apart, the leading byte offset; a k16 step is 16 query rows = 2048 bytes): dV += Pᵀ dO, dK += dSᵀ Q.
template <typename T, int D>
__device__ __forceinline__ void issue_rs(float (&acc)[D / 2], const uint32_t (&a)[kBM<D> / 16][4], const T *b) {
#pragma unroll
    for (int kk = 0; kk < kBM<D> / 16; kk++) {
        const uint64_t desc = smem_desc_sw128(b + kk * 16 * kBoxCols, kBM<D> * kBoxCols * 2, 1024);
        if constexpr (D == 64) wgmma_m64n64k16_rs<T, 1>(acc, a[kk], desc, 1);
        else wgmma_m64n128k16_rs<T, 1>(acc, a[kk], desc, 1);
    }
}

// dQ = dS K for warpgroup c over all kBN keys: D 128, the 64 queries x columns 64 c .. 64 c + 63;
// D 64, queries 64 c .. 64 c + 63 x all 64 columns. A = dS (K-major, as Q above); B = K rows
// (keys, N-major as dO above).
template <typename T, int D>
__device__ __forceinline__ void issue_dq(float (&dq)[32], const Smem<T, D> &s, int c) {
#pragma unroll
    for (int key16 = 0; key16 < kBN / 16; key16++) {  // the k16 step's first key / 16
        const T *a = s.ds + (key16 / 4) * kBM<D> * kBoxCols + (D == 64 ? c * 64 * kBoxCols : 0) + (key16 % 4) * 16;
        const T *b = s.k + (D == 128 ? c * kBN * kBoxCols : 0) + key16 * 16 * kBoxCols;
        wgmma_m64n64k16<T, 0, 1>(dq, smem_desc_sw128(a, 16, 1024), smem_desc_sw128(b, kBN * kBoxCols * 2, 1024),
                                 key16 > 0);
    }
}

// Accumulator layout of m64nN (Sᵀ rows = keys, columns = queries): warp w of the warpgroup holds
// key rows 16 w + lane / 4 (hr 0) and + 8 (hr 1); n8 block jj, query columns 8 jj + 2 (lane % 4)
// (+ 1): acc[4 jj + 2 hr] and acc[4 jj + 2 hr + 1]. Pᵀ into sc, dSᵀ into dp; masked where the
// tile crosses the band or a sequence end (keys past sk read zeros; queries past sq have lse +inf).
template <typename T, int D>
__device__ __forceinline__ void softmax_grad(float (&sc)[kBM<D> / 2], float (&dp)[kBM<D> / 2], const Smem<T, D> &s,
                                             int slot, const Params &p, const Seq &sq, int m0, int kc0, int key0) {
    constexpr int kM = kBM<D>;
    const int lane = threadIdx.x % 32;
    int lo[2] = {0, 0}, hi[2] = {kM, kM};  // visible query columns of key rows hr 0, 1
    if (!tile_visible(p, sq, m0, kM, kc0, 64)) {
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int64_t jk = key0 + 8 * hr;
            int64_t a = 0, z = jk < sq.sk ? sq.sq : 0;
            if (p.window_right >= 0) a = max(a, jk - sq.shift - p.window_right);
            if (p.window_left >= 0) z = min(z, jk - sq.shift + p.window_left + 1);
            lo[hr] = (int)min(max(a - m0, (int64_t)0), (int64_t)kM);
            hi[hr] = (int)min(max(z - m0, (int64_t)0), (int64_t)kM);
        }
    }
#pragma unroll
    for (int jj = 0; jj < kM / 8; jj++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int col = 8 * jj + 2 * (lane & 3) + e;
            const float l2 = s.lse2[slot][col], dv = s.dvec[slot][col];
#pragma unroll
            for (int hr = 0; hr < 2; hr++) {
                const int x = 4 * jj + 2 * hr + e;
                float pv = ex2_ftz(fmaf(sc[x], p.scale_log2, -l2));
                if (col < lo[hr] || col >= hi[hr]) pv = 0.0f;
                sc[x] = pv;
                dp[x] = pv * (dp[x] - dv);
            }
        }
}

// The m64nN accumulator layout is the register-A layout of the next wgmma (k = N): 16-bit pairs.
template <typename T, int N>
__device__ __forceinline__ void pack_a(uint32_t (&a)[N / 16][4], const float (&x)[N / 2]) {
#pragma unroll
    for (int kk = 0; kk < N / 16; kk++)
#pragma unroll
        for (int r = 0; r < 4; r++) a[kk][r] = pack2<T>(x[8 * kk + 2 * r], x[8 * kk + 2 * r + 1]);
}

// dSᵀ (registers) -> dS in box c of s.ds: row = query, column = key, 128-byte swizzle (16-byte
// chunk index XOR row % 8), as TMA lays out Q. stmatrix: da[kk][m] is the 8 x 8 block (keys
// 16 w + 8 (m % 2) + 0..7, queries 8 (2 kk + m / 2) + 0..7); stored transposed, its row r (query)
// is the 16-byte chunk of keys 2 w + m % 2 of dS row 8 (2 kk + m / 2) + r.
template <typename T, int D>
__device__ __forceinline__ void store_ds(Smem<T, D> &s, const uint32_t (&da)[kBM<D> / 16][4], int c) {
    const int t = threadIdx.x % 128, w = t / 32, lane = t % 32, m = lane / 8, r = lane % 8;
    T *box = s.ds + c * kBM<D> * kBoxCols;
#pragma unroll
    for (int kk = 0; kk < kBM<D> / 16; kk++) {
        const int row = 8 * (2 * kk + m / 2) + r;
        stmatrix_x4_trans(box + row * kBoxCols + (((2 * w + m % 2) ^ r) * 8), da[kk]);
    }
}

// dQ accumulator -> region c of s.dq in accumulator order: float4 q of thread t at (q x 128 + t) x 4.
[[maybe_unused]] __device__ __forceinline__ void store_dq(float *dq_smem, const float (&dq)[32], int c) {
    const int t = threadIdx.x % 128;
#pragma unroll
    for (int q = 0; q < 8; q++)
        *reinterpret_cast<float4 *>(dq_smem + c * kDqRegionFloats + (q * 128 + t) * 4) =
            make_float4(dq[4 * q], dq[4 * q + 1], dq[4 * q + 2], dq[4 * q + 3]);
}

// dk, dv: dense (batch, sk, kv_heads, d) rows from the m64nD accumulators; dK carries the scale.
template <typename T, int D>
__device__ __forceinline__ void epilogue(const Params &p, const Job &j, const float (&dk)[D / 2],
                                         const float (&dv)[D / 2], int key0) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int key = key0 + 8 * hr;
        if (key >= j.s.sk) continue;
        const int64_t at = ((j.s.k0 + key) * p.kv_heads + j.g) * D;
        T *gk = static_cast<T *>(p.dk) + at, *gv = static_cast<T *>(p.dv) + at;
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            const int col = 8 * n + 2 * (lane & 3);
            store2<T>(gk + col, dk[4 * n + 2 * hr] * p.scale, dk[4 * n + 2 * hr + 1] * p.scale);
            store2<T>(gv + col, dv[4 * n + 2 * hr], dv[4 * n + 2 * hr + 1]);
        }
    }
}

// Warpgroup c's loop over the CTA's iterations; thread 0 of warpgroup 0 issues the dQ reductions.
template <typename T, int D>
__device__ __forceinline__ void consumer(Smem<T, D> &s, const Params &p, const BwdWork &ws, const Job &j) {
    const int c = threadIdx.x / 128 - 1, t = threadIdx.x % 128;
    const bool reducer = threadIdx.x == 128;
    const int key0 = j.n0 + 64 * c + 16 * (t / 32) + (t % 32) / 4;  // this thread's key rows: key0, key0 + 8
    constexpr int kM = kBM<D>;
    float dk[D / 2], dv[D / 2], sc[kM / 2], dp[kM / 2], dq[32];
    uint32_t pa[kM / 16][4], da[kM / 16][4];
#pragma unroll
    for (int e = 0; e < D / 2; e++) dk[e] = 0.0f, dv[e] = 0.0f;
    RingStage<kStages> st;
    const int iters = j.nq * j.group;
    if (iters > 0) mbar_wait(&s.kv_full, 0);
    for (int it = 0; it < iters; it++) {
        const int h = j.g * j.group + it / j.nq, m0 = (j.t_lo + it % j.nq) * kM;
        mbar_wait(&s.full[st.slot], st.phase);
        wgmma_fence();
        issue_s_dp<T, D>(sc, dp, s, st.slot, c);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(sc);
        wgmma_fence_operands(dp);
        softmax_grad<T, D>(sc, dp, s, st.slot, p, j.s, m0, j.n0 + 64 * c, key0);
        pack_a<T, kM>(pa, sc);
        pack_a<T, kM>(da, dp);
        store_ds<T, D>(s, da, c);  // the previous dS was last read before kDqReady
        wgmma_fence();
        issue_rs<T, D>(dv, pa, s.dout[st.slot]);
        issue_rs<T, D>(dk, da, s.q[st.slot]);
        wgmma_commit();
        fence_proxy_async_shared();  // dS: generic stores, read by wgmma
        if (reducer) bulk_wait_group_read<0>();  // the previous dQ reduction has read s.dq
        named_barrier_sync(kDsReady, kConsumers * 128);
        wgmma_fence();  // dq was last read by store_dq
        issue_dq<T, D>(dq, s, c);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(dk);
        wgmma_fence_operands(dv);
        wgmma_fence_operands(dq);
        mbar_arrive(&s.empty[st.slot]);  // this thread's reads of the stage are done
        st.next();
        store_dq(s.dq, dq, c);
        fence_proxy_async_shared();  // s.dq: generic stores, read by the bulk reduction
        named_barrier_sync(kDqReady, kConsumers * 128);
        if (reducer) {
            // D 128: the warpgroups' column halves of one tile; D 64: their 64-query tiles, adjacent
            float *tile = ws.dq + (((int64_t)j.b * p.heads + h) * ws.m_tiles + m0 / kBwdRowTile) * kBwdRowTile * D;
            bulk_reduce_add_f32(tile, s.dq, kM * D * 4);
            bulk_commit_group();
        }
    }
    if (reducer) bulk_wait_group<0>();
    epilogue<T, D>(p, j, dk, dv, key0);
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1)
    attention_bwd_wgmma_sm90(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                             const __grid_constant__ CUtensorMap map_v, const __grid_constant__ CUtensorMap map_do,
                             const Params p, const BwdWork ws) {
#if FK_SM90A
    extern __shared__ unsigned char smem_raw[];
    auto &s = smem_aligned_1024<Smem<T, D>>(smem_raw);
    if (threadIdx.x == 0) {
        mbar_init(&s.kv_full, 1);
        for (int i = 0; i < kStages; i++) mbar_init(&s.full[i], 1), mbar_init(&s.empty[i], kReleasers);
        fence_barrier_init();
        prefetch_tensormap(&map_q), prefetch_tensormap(&map_k), prefetch_tensormap(&map_v);
        prefetch_tensormap(&map_do);
    }
    __syncthreads();
    grid_dependency_sync();
    const Job j = job_of<D>(p);
    if (threadIdx.x < 128) {
        setmaxnreg_dec<kRegsProducer>();
        if (threadIdx.x == 0 && j.nq > 0) producer<T, D>(s, &map_q, &map_k, &map_v, &map_do, p, ws, j);
    } else {
        setmaxnreg_inc<kRegsConsumer>();
        consumer<T, D>(s, p, ws, j);
    }
#endif
}

// ---- host: tensor maps and launch ---------------------------------------------------------------

template <typename T, int D> fk_status launch(const Params &p, fk_dtype dtype, int device, cudaStream_t stream) {
    const BwdWork ws = bwd_work(p, kBM<D>);
    CUtensorMap map_q, map_k, map_v, map_do;
    if (!encode_map_4d(&map_q, dtype, p.q, D, p.sq, p.heads, p.batch, p.q_row, p.q_head, p.q_batch, kBM<D>) ||
        !encode_map_4d(&map_do, dtype, p.dout, D, p.sq, p.heads, p.batch, p.do_row, p.do_head, p.do_batch, kBM<D>) ||
        !encode_map_4d(&map_k, dtype, p.k, D, p.sk, p.kv_heads, p.batch, p.k_row, p.k_head, p.k_batch, kBN) ||
        !encode_map_4d(&map_v, dtype, p.v, D, p.sk, p.kv_heads, p.batch, p.v_row, p.v_head, p.v_batch, kBN))
        return fk_fail(FK_ERR_RUNTIME, "attention_bwd: cuTensorMapEncodeTiled failed");
    fk_status st = launch_bwd_prep(ws, D, p, dtype, device, stream);
    if (st != FK_OK) return st;
    constexpr auto kernel = attention_bwd_wgmma_sm90<T, D>;
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes<D>);
    if (e != cudaSuccess) return cuda_status(e, "attention_bwd");
    const dim3 grid((unsigned)((p.sk + kBN - 1) / kBN), (unsigned)p.kv_heads, (unsigned)p.batch);
    st = Launch(grid, dim3(kThreads), kSmemBytes<D>, stream, device)("attention_bwd", kernel, map_q, map_k, map_v,
                                                                     map_do, p, ws);
    if (st != FK_OK) return st;
    return launch_bwd_dq_convert(ws, D, p, dtype, device, stream);
}

}  // namespace

// Instances: attention_bwd_wgmma_sm90 x {__half, __nv_bfloat16} x D {64, 128} = 4 (its prep and dQ
// conversion: bwd_workspace.cu).
fk_status launch_bwd_wgmma_sm90(const Plan &plan, const Params &p, fk_dtype dtype, int device, cudaStream_t stream) {
    if (dtype == FK_BFLOAT16)
        return plan.d_bucket == 64 ? launch<__nv_bfloat16, 64>(p, dtype, device, stream)
                                   : launch<__nv_bfloat16, 128>(p, dtype, device, stream);
    return plan.d_bucket == 64 ? launch<__half, 64>(p, dtype, device, stream)
                               : launch<__half, 128>(p, dtype, device, stream);
}

}  // namespace fk::attn
