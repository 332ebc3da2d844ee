// attention_bwd_atomic_mma_sm80: the flash-attention backward on the tensor cores of every GPU
// from sm_80 (mma.sync m16n8k16, fp32 accumulate), FlashAttention-2's scheme: dQ is added into an
// fp32 workspace by atomics, so S and dP are computed once (5 products, not bwd_mma_sm80's 7).
// dispatch.cu row "bwd, d <= 128, not deterministic" (the sm_80 path; Hopper's when forced).
//
// Napkin math: 5 products of 2 Sq Sk D FLOPs (S, dP, dV, dK, dQ), counted as 2.5x the forward;
// B 4, H 16, S 4096, D 128: 344 GFLOP, ~1.1 ms at FlashAttention-2's ~300 TFLOP/s (H200, PERF.md).
// A step (128 keys x kBM queries, kBM x D = 8192) is 10.5 MFLOP, 2560 mma.sync a CTA, and ~610 KB
// of ldmatrix reads (FA2's warp tiles: each warp reads a 32-row slice of Q, dO, K, V, the Pᵀ / dSᵀ
// it needs and half of Q, dO, K): ~4.8K cycles at 128 B / cycle, ~0.6 ms for 344 GFLOP on 132 SMs.
// With 8 warps an SM (255 registers) issue latency, not bandwidth, is the limit (ncu: ~5.6 cycles
// an instruction a warp), so the step's instruction count is what counts: the Pᵀ / dSᵀ step carries
// no per-element branches or address arithmetic, ldmatrix addresses are one XOR (ldsm_x4).
// dQ: a 32 KB fp32 reduction a step (red.global.add.v4.f32, 512 contiguous bytes a warp), ~14 KB /
// us an SM into L2, as bwd_wgmma_sm90's bulk reductions.
// Registers: dK + dV + Sᵀ + dPᵀ fp32 = 64 + 64 + 32 + 32 (D 128, kBM 64) or 32 + 32 + 64 + 64 (D
// 64, kBM 128) = 192 at the peak, of 255 (256 threads, one CTA an SM); no spills (sm_90a, sm_80).
// Shared memory: K + V + 2 x (Q + dO) + Pᵀ + dSᵀ + 2 x (lse, D) = 64 + 64 + 32 + 1 = 161 KB (D
// 128), 32 + 64 + 64 + 2 = 162 KB (D 64).
//
// Algorithm: attention_bwd_prep (bwd_workspace.cu) writes lse log2 e and D = rowsum(dO O) per
// row and zeroes the dQ workspace. One CTA per (128 keys, kv head, sequence), 8 warps. K and V are
// loaded once; for each head of the group (GQA summed in the CTA) and each query tile the mask lets
// see the keys, Q, dO, lse and D stream through a two-slot cp.async ring. Per step: Sᵀ = K Qᵀ and
// dPᵀ = V dOᵀ (warp tiles 32 keys x kBM / 2 queries), Pᵀ = 2^(Sᵀ scale log2 e - lse log2 e)
// (masked where the tile crosses the band), dSᵀ = Pᵀ (dPᵀ - D), both to shared memory; barrier;
// dV += Pᵀ dO and dK += dSᵀ Q (32 keys x D / 2 columns a warp, in registers all along) and dQ = dS K
// (32 queries x 32 columns a warp, dS by ldmatrix .trans), added to the workspace in accumulator
// order; attention_bwd_dq_convert writes dq = scale dQ.
// Why: bwd_mma_sm80's 7 products ran fwd+bwd at 0.51-0.57x FlashAttention-2, this at 0.88-0.91x
// (H200, forced sm_80 path; D-117, D-118).
#include "attention.cuh"

namespace fk::attn {
namespace {

template <int D> struct AtomicCfg {
    static constexpr int kD = D, kThreads = 256, BN = 128;
    static constexpr int BM = bwd_atomic_block_m(D);  // queries a step
    // Warp tiles (8 warps): Sᵀ / dPᵀ 32 keys x BM / 2 queries (4 x 2 warps); dK / dV 32 keys x D / 2
    // columns (4 x 2); dQ 32 queries x 32 columns (BM / 32 x D / 32).
    static constexpr int kSQ = BM / 2, kKD = D / 2;
    static_assert((BM / 32) * (D / 32) == 8, "the warps tile dQ");
    using KTile = SwizzledTile<BN, D>;
    using QTile = SwizzledTile<BM, D>;
    using PTile = SwizzledTile<BN, BM>;  // Pᵀ and dSᵀ: keys x queries
    static constexpr int kSmemBytes = 2 * (2 * KTile::kElems + 4 * QTile::kElems + 2 * PTile::kElems) + 4 * 4 * BM;
};

template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1) attention_bwd_atomic_mma_sm80(const Params p, const BwdWork ws) {
    constexpr int D = Cfg::kD, BM = Cfg::BM, BN = Cfg::BN, kThreads = Cfg::kThreads;
    constexpr int kSQ = Cfg::kSQ, kKD = Cfg::kKD;
    using KTile = typename Cfg::KTile;
    using QTile = typename Cfg::QTile;
    using PTile = typename Cfg::PTile;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *sk_tile = reinterpret_cast<T *>(smem_raw);
    T *sv_tile = sk_tile + KTile::kElems;
    T *sq_tile = sv_tile + KTile::kElems;           // slot s: sq_tile + s * QTile::kElems
    T *sdo_tile = sq_tile + 2 * QTile::kElems;
    T *sp_tile = sdo_tile + 2 * QTile::kElems;      // Pᵀ
    T *sds_tile = sp_tile + PTile::kElems;          // dSᵀ
    float *s_lse = reinterpret_cast<float *>(sds_tile + PTile::kElems);  // [2][BM], log2 units
    float *s_dvec = s_lse + 2 * BM;                                       // [2][BM]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = blockIdx.y, b = blockIdx.z, group = (int)(p.heads / p.kv_heads), d = (int)p.d;
    const int n0 = blockIdx.x * BN;
    grid_dependency_sync();
    const Seq s = seq_of(p, b);
    if (n0 >= s.sk) return;

    const T *k = static_cast<const T *>(p.k) + seq_offset(p, b, s.k0, p.k_batch, p.k_row) + g * p.k_head;
    const T *v = static_cast<const T *>(p.v) + seq_offset(p, b, s.k0, p.v_batch, p.v_row) + g * p.v_head;
    load_tile<T, BN, D, kThreads>(sk_tile, k + (int64_t)n0 * p.k_row, p.k_row, s.sk - n0, d, p.async);
    load_tile<T, BN, D, kThreads>(sv_tile, v + (int64_t)n0 * p.v_row, p.v_row, s.sk - n0, d, p.async);

    // Query tiles [t_lo, t_lo + nq) that see one of these keys, for each of the group's heads.
    const Range rows = query_range(p, s, n0, min(n0 + BN, s.sk));
    const int t_lo = rows.lo / BM, nq = rows.hi > rows.lo ? (rows.hi + BM - 1) / BM - t_lo : 0;
    const int iters = nq * group;
    auto load_q = [&](int slot, int it) {
        const int h = g * group + it / nq, m0 = (t_lo + it % nq) * BM;
        const T *q = static_cast<const T *>(p.q) + seq_offset(p, b, s.q0, p.q_batch, p.q_row) + h * p.q_head;
        const T *dout = static_cast<const T *>(p.dout) + seq_offset(p, b, s.q0, p.do_batch, p.do_row) + h * p.do_head;
        load_tile<T, BM, D, kThreads>(sq_tile + slot * QTile::kElems, q + (int64_t)m0 * p.q_row, p.q_row, s.sq - m0,
                                      d, p.async);
        load_tile<T, BM, D, kThreads>(sdo_tile + slot * QTile::kElems, dout + (int64_t)m0 * p.do_row, p.do_row,
                                      s.sq - m0, d, p.async);
        // lse log2 e and D: padded to the query step in the workspace (16-byte chunks, always there)
        const int64_t row = ((int64_t)b * p.heads + h) * ws.m_tiles * kBwdRowTile + m0;
        if (threadIdx.x < BM / 2) {
            const int c = threadIdx.x % (BM / 4) * 4;
            const bool lse = threadIdx.x < BM / 4;
            cp_async_16((lse ? s_lse : s_dvec) + slot * BM + c, (lse ? ws.lse2 : ws.dvec) + row + c, 16);
        }
    };
    if (iters > 0) load_q(0, 0);
    cp_async_commit();

    const int kw = 32 * (warp % 4);                 // this warp's keys in the tile (all three products)
    const int sq0 = kSQ * (warp / 4);               // its queries in Sᵀ / dPᵀ
    const int kd0 = kKD * (warp / 4);               // its dK / dV columns
    const int dq_m = 32 * (warp % (BM / 32)), dq_c = 32 * (warp / (BM / 32));  // its dQ block
    float acc_dk[2][kKD / 8][4] = {}, acc_dv[2][kKD / 8][4] = {};
    // The lanes' ldmatrix offsets for each operand's first block (ldsm_x4: the other blocks are a
    // column XOR and a row add away). A: rows lane % 16, column 8 (lane / 16); B: 8 x 8 block
    // lane / 8 (rows n: n 8 (j / 2), k 8 (j % 2); rows k: the transpose).
    const int j8 = lane >> 3, r8 = lane & 7;
    const int a_kv = KTile::offset(kw + (lane & 15), (lane >> 4) * 8);     // K, V; kk: ^ 16 kk, mt: + 16 mt D
    const int b_qn = QTile::offset(sq0 + (j8 >> 1) * 8 + r8, (j8 & 1) * 8);  // Q, dO; kk: ^ 16 kk, np: + 16 np D
    const int a_pt = PTile::offset(kw + (lane & 15), (lane >> 4) * 8);      // Pᵀ, dSᵀ; kk: ^ 16 kk, mt: + 16 mt BM
    const int b_qk = QTile::offset((j8 & 1) * 8 + r8, kd0 + (j8 >> 1) * 8);  // dO, Q; np: ^ 16 np, kk: + 16 kk D
    const int a_ds = PTile::offset((j8 >> 1) * 8 + r8, dq_m + (j8 & 1) * 8);  // dS (.trans); mt: ^ 16 mt, kk: + 16 kk BM
    const int b_kk = KTile::offset((j8 & 1) * 8 + r8, dq_c + (j8 >> 1) * 8);  // K; np: ^ 16 np, kk: + 16 kk D

    for (int it = 0; it < iters; it++) {
        const int slot = it & 1;
        cp_async_wait<0>();
        __syncthreads();  // slot `slot` (and K, V) landed; the other slot and Pᵀ / dSᵀ are free again
        if (it + 1 < iters) load_q(slot ^ 1, it + 1);
        cp_async_commit();
        const T *qs = sq_tile + slot * QTile::kElems, *dos = sdo_tile + slot * QTile::kElems;
        const float *lse2 = s_lse + slot * BM, *dvec = s_dvec + slot * BM;
        const int h = g * group + it / nq, m0 = (t_lo + it % nq) * BM;

        {   // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ: 32 keys x kSQ queries a warp.
            float acc_s[2][kSQ / 8][4] = {}, acc_dp[2][kSQ / 8][4] = {};
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                uint32_t a_k[2][4], a_v[2][4];
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    ldsm_x4<false>(a_k[mt], sk_tile, a_kv, 16 * kk, 16 * mt * D);
                    ldsm_x4<false>(a_v[mt], sv_tile, a_kv, 16 * kk, 16 * mt * D);
                }
#pragma unroll
                for (int np = 0; np < kSQ / 16; np++) {
                    uint32_t bq[4], bo[4];
                    ldsm_x4<false>(bq, qs, b_qn, 16 * kk, 16 * np * D);
                    ldsm_x4<false>(bo, dos, b_qn, 16 * kk, 16 * np * D);
#pragma unroll
                    for (int mt = 0; mt < 2; mt++)
#pragma unroll
                        for (int h2 = 0; h2 < 2; h2++) {
                            mma_m16n8k16<T>(acc_s[mt][2 * np + h2], a_k[mt], {bq[2 * h2], bq[2 * h2 + 1]});
                            mma_m16n8k16<T>(acc_dp[mt][2 * np + h2], a_v[mt], {bo[2 * h2], bo[2 * h2 + 1]});
                        }
                }
            }
            // Pᵀ (masked) and dSᵀ = Pᵀ (dPᵀ - dvec), as T, into shared memory. The thread's
            // elements: keys kw + 16 mt + 8 hr + lane / 4, queries sq0 + 8 nt + 2 (lane % 4) + e.
            // Key rows 16 mt + 8 hr apart share a swizzle (multiples of 8 rows), and query block nt
            // is chunk nt XOR the first's (sq0 / 8 a multiple of kSQ / 8): one offset, XORed.
            const int off0 = PTile::offset(kw + (lane >> 2), sq0 + 2 * (lane & 3));
            auto softmax_grad = [&](auto masked) {
                int lo[2][2], hi[2][2];  // visible query columns (from sq0) of each key row
                if constexpr (decltype(masked)::value) {
#pragma unroll
                    for (int mt = 0; mt < 2; mt++)
#pragma unroll
                        for (int hr = 0; hr < 2; hr++) {
                            const int64_t j = n0 + kw + 16 * mt + 8 * hr + (lane >> 2);
                            int64_t first = 0, end = j < s.sk ? s.sq : 0;
                            if (p.window_right >= 0) first = max(first, j - s.shift - p.window_right);
                            if (p.window_left >= 0) end = min(end, j - s.shift + p.window_left + 1);
                            const int64_t q0 = m0 + sq0;
                            lo[mt][hr] = (int)min(max(first - q0, (int64_t)0), (int64_t)kSQ);
                            hi[mt][hr] = (int)min(max(end - q0, (int64_t)0), (int64_t)kSQ);
                        }
                }
#pragma unroll
                for (int nt = 0; nt < kSQ / 8; nt++) {
                    const int c = nt * 8 + 2 * (lane & 3);  // query column from sq0
                    const float2 l2 = *reinterpret_cast<const float2 *>(lse2 + sq0 + c);
                    const float2 dv = *reinterpret_cast<const float2 *>(dvec + sq0 + c);
                    const int off = off0 ^ (nt * 8);
#pragma unroll
                    for (int mt = 0; mt < 2; mt++)
#pragma unroll
                        for (int hr = 0; hr < 2; hr++) {
                            float pv[2], ds[2];
#pragma unroll
                            for (int e = 0; e < 2; e++) {
                                pv[e] = ex2_ftz(fmaf(acc_s[mt][nt][2 * hr + e], p.scale_log2, e ? -l2.y : -l2.x));
                                if constexpr (decltype(masked)::value)
                                    if (c + e < lo[mt][hr] || c + e >= hi[mt][hr]) pv[e] = 0.0f;
                                ds[e] = pv[e] * (acc_dp[mt][nt][2 * hr + e] - (e ? dv.y : dv.x));
                            }
                            const int at = off + (16 * mt + 8 * hr) * BM;
                            *reinterpret_cast<uint32_t *>(sp_tile + at) = pack2<T>(pv[0], pv[1]);
                            *reinterpret_cast<uint32_t *>(sds_tile + at) = pack2<T>(ds[0], ds[1]);
                        }
                }
            };
            if (tile_visible(p, s, m0 + sq0, kSQ, n0 + kw, 32)) softmax_grad(std::false_type{});
            else softmax_grad(std::true_type{});
        }
        __syncthreads();  // Pᵀ, dSᵀ complete

        // dV += Pᵀ dO, dK += dSᵀ Q: 32 keys x kKD columns a warp, over the BM queries.
#pragma unroll
        for (int kk = 0; kk < BM / 16; kk++) {
            uint32_t a_p[2][4], a_ds[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                ldsm_x4<false>(a_p[mt], sp_tile, a_pt, 16 * kk, 16 * mt * BM);
                ldsm_x4<false>(a_ds[mt], sds_tile, a_pt, 16 * kk, 16 * mt * BM);
            }
#pragma unroll
            for (int np = 0; np < kKD / 16; np++) {
                uint32_t bo[4], bq[4];
                ldsm_x4<true>(bo, dos, b_qk, 16 * np, 16 * kk * D);
                ldsm_x4<true>(bq, qs, b_qk, 16 * np, 16 * kk * D);
#pragma unroll
                for (int mt = 0; mt < 2; mt++)
#pragma unroll
                    for (int h2 = 0; h2 < 2; h2++) {
                        mma_m16n8k16<T>(acc_dv[mt][2 * np + h2], a_p[mt], {bo[2 * h2], bo[2 * h2 + 1]});
                        mma_m16n8k16<T>(acc_dk[mt][2 * np + h2], a_ds[mt], {bq[2 * h2], bq[2 * h2 + 1]});
                    }
            }
        }

        // dQ = dS K for 32 queries x 32 columns a warp, over the CTA's 128 keys, added to the
        // workspace tile in accumulator order (one float4 a lane a m16n8 block: 512 contiguous bytes).
        if (m0 + dq_m >= s.sq) continue;  // rows past the sequence: nothing to add
        float acc_dq[2][4][4] = {};
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            uint32_t a[2][4], b[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++) ldsm_x4<true>(a[mt], sds_tile, a_ds, 16 * mt, 16 * kk * BM);
#pragma unroll
            for (int np = 0; np < 2; np++) ldsm_x4<true>(b[np], sk_tile, b_kk, 16 * np, 16 * kk * D);
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int nt = 0; nt < 4; nt++)
                    mma_m16n8k16<T>(acc_dq[mt][nt], a[mt], {b[nt / 2][2 * (nt % 2)], b[nt / 2][2 * (nt % 2) + 1]});
        }
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
            const int r = m0 + dq_m + 16 * mt;  // a multiple of 16: rows (r % 64) / 16 of 64-row tile r / 64
            if (r >= s.sq) continue;
            float *tile = ws.dq + (((int64_t)b * p.heads + h) * ws.m_tiles + r / kBwdRowTile) * kBwdRowTile * D +
                          (dq_c / 64) * 4096 + (dq_c % 64 / 8) * 512 + 4 * (32 * (r % kBwdRowTile / 16) + lane);
#pragma unroll
            for (int nt = 0; nt < 4; nt++) red_add_f32x4(tile + nt * 512, acc_dq[mt][nt]);
        }
    }
    cp_async_wait<0>();

    // dk, dv: dense (batch | total, sk, kv_heads, d) rows; dK carries the softmax scale.
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int j = n0 + kw + 16 * mt + (lane >> 2) + 8 * hr;
            if (j >= s.sk) continue;
            const int64_t at = ((s.k0 + j) * p.kv_heads + g) * p.d;
            T *dk = static_cast<T *>(p.dk) + at, *dv = static_cast<T *>(p.dv) + at;
#pragma unroll
            for (int nt = 0; nt < kKD / 8; nt++) {
                const int c = kd0 + nt * 8 + 2 * (lane & 3);
                if (c >= d) continue;
                store2<T>(dk + c, acc_dk[mt][nt][2 * hr] * p.scale, acc_dk[mt][nt][2 * hr + 1] * p.scale);
                store2<T>(dv + c, acc_dv[mt][nt][2 * hr], acc_dv[mt][nt][2 * hr + 1]);
            }
        }
}

template <typename T, int D> fk_status launch(const Params &p, fk_dtype dtype, int device, cudaStream_t stream) {
    using Cfg = AtomicCfg<D>;
    const BwdWork ws = bwd_work(p, Cfg::BM);
    fk_status st = launch_bwd_prep(ws, D, p, dtype, device, stream);
    if (st != FK_OK) return st;
    if (p.sk > 0) {
        constexpr auto kernel = attention_bwd_atomic_mma_sm80<T, Cfg>;
        cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
        if (e != cudaSuccess) return cuda_status(e, "attention_bwd");
        const dim3 grid((unsigned)((p.sk + Cfg::BN - 1) / Cfg::BN), (unsigned)p.kv_heads, (unsigned)p.batch);
        st = Launch(grid, dim3(Cfg::kThreads), Cfg::kSmemBytes, stream, device)("attention_bwd_atomic", kernel, p, ws);
        if (st != FK_OK) return st;
    }
    return launch_bwd_dq_convert(ws, D, p, dtype, device, stream);
}

}  // namespace

// Instances: attention_bwd_atomic_mma_sm80 x {__half, __nv_bfloat16} x D {64, 128} = 4 (its prep and
// dQ conversion: bwd_workspace.cu).
fk_status launch_bwd_atomic_mma_sm80(const Plan &plan, const Params &p, fk_dtype dtype, int device,
                                    cudaStream_t stream) {
    if (dtype == FK_BFLOAT16)
        return plan.d_bucket == 64 ? launch<__nv_bfloat16, 64>(p, dtype, device, stream)
                                   : launch<__nv_bfloat16, 128>(p, dtype, device, stream);
    return plan.d_bucket == 64 ? launch<__half, 64>(p, dtype, device, stream)
                               : launch<__half, 128>(p, dtype, device, stream);
}

}  // namespace fk::attn
