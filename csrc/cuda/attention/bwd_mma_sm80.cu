// attention_bwd_*_mma_sm80: flash-attention backward on the tensor cores of every GPU from sm_80
// (mma.sync m16n8k16, fp32 accumulate). dispatch.cu rows "bwd, FK_ATTN_DETERMINISTIC" and "bwd, d >
// 128" (d <= 128 otherwise takes bwd_atomic_mma_sm80, D-117).
//
// Napkin math: the gradients take 5 products of 2 Sq Sk D FLOPs (S, dP, dV, dK, dQ): 2.5x the
// forward, counted as such in TFLOP/s. This file recomputes S and dP once more for dQ (7 products
// instead of 5) in exchange for no atomics and no fp32 dQ workspace: bitwise reproducible by
// construction, FK_ATTN_DETERMINISTIC or not. B 4, H 16, S 4096, D 128: 344 GFLOP counted, 0.69 ms
// at ~500 TFLOP/s of mma.sync work on an H100 (0.96 ms of real MMA work at 7/5).
// Measured (H200, bf16, self-test harness, FLOPs counted as 2.5x forward): B 4 H 16 S 4096 D 128
// 155 TFLOP/s (causal 141), B 8 H 32 S 2048 D 64 118, GQA 32/8 S 8192 causal 148. FlashAttention-2
// reaches 266-307 (PERF.md): its dQ rides in the dK / dV kernel through fp32 atomics (5 products,
// not 7), as bwd_atomic_mma_sm80's does; this file keeps the bitwise-reproducible path.
//
// Algorithm, three kernels:
//   attention_bwd_preprocess: dvec = rowsum(dO * O) in fp32 (workspace), one warp a row.
//   attention_bwd_dkdv_mma_sm80: one CTA per (key tile of 64, kv head, sequence, column half);
//     warp w owns keys 16w .. 16w + 15. K and V are loaded once; for every head sharing the kv head
//     (GQA summed inside the CTA: deterministic) and every query tile the mask lets see these keys,
//     Q, dO, lse and dvec stream through a two-slot cp.async ring; the warp computes Sᵀ = K Qᵀ and
//     dPᵀ = V dOᵀ, Pᵀ = exp2(Sᵀ scale log2e - lse log2e), dSᵀ = Pᵀ (dPᵀ - dvec), then dV += Pᵀ dO
//     and dK += dSᵀ Q with Pᵀ, dSᵀ turned into A operands in registers (no shared-memory round trip).
//     D 256 keeps 2 x 16 x 256 fp32 accumulators out of reach, so it runs as two column halves
//     (blockIdx.z), each recomputing Sᵀ and dPᵀ (1.5x the work at D 256 only).
//   attention_bwd_dq_mma_sm80: one CTA per (query tile, head, sequence), warp w owns 16 rows; K, V
//     stream through the ring; S, dP recomputed, dS = P (dP - dvec), dQ += dS K in registers.
// Rows that see no key (lse +inf) get P = 0 and zero gradients; keys no query sees get dK = dV = 0.
// Columns d .. bucket are zeros in shared memory: the MMAs run over the whole bucket, unpredicated.
#include "attention.cuh"

namespace fk::attn {
namespace {

// dK / dV kernel: 4 warps x 16 keys; BM query rows a ring slot; kDOut accumulator columns.
template <int D> struct DkvCfg {
    static constexpr int kD = D, kThreads = 128, BN = 64;  // 4 warps x 16 keys
    static constexpr int BM = D <= 64 ? 64 : D <= 128 ? FK_ATTN_DKV_BM : 32;
    static constexpr int kDOut = D < 128 ? D : 128;
    using KTile = SwizzledTile<BN, D>;
    using QTile = SwizzledTile<BM, D>;
    // K, V, then two slots of (Q, dO), then two slots of (lse, dvec): 64 KB at D 128.
    static constexpr int kSmemBytes = 2 * (2 * KTile::kElems + 4 * QTile::kElems) + 4 * 4 * BM;
};

// dQ kernel: 16 x warps query rows, BN keys a ring slot.
template <int D> struct DqCfg {
    static constexpr int kD = D;
    static constexpr int kWarps = D <= 128 ? 8 : 4;
    static constexpr int BM = 16 * kWarps, BN = D <= 128 ? FK_ATTN_DQ_BN : 32;
    static constexpr int kThreads = 32 * kWarps;
    using QTile = SwizzledTile<BM, D>;
    using KVTile = SwizzledTile<BN, D>;
    // Q, dO, then two slots of (K, V): 128 KB at D 128.
    static constexpr int kSmemBytes = 2 * (2 * QTile::kElems + 4 * KVTile::kElems);
};

template <typename T>
__global__ void __launch_bounds__(128) attention_bwd_preprocess(Params p) {
    const int lane = threadIdx.x % 32;
    const int64_t row = (int64_t)blockIdx.x * 4 + threadIdx.x / 32;  // (b, h, i) over (batch, heads, sq)
    grid_dependency_sync();
    if (row >= p.batch * p.heads * p.sq) return;
    const int i = (int)(row % p.sq), h = (int)(row / p.sq % p.heads), b = (int)(row / p.sq / p.heads);
    const Seq s = seq_of(p, b);
    if (i >= s.sq) return;
    const T *o = static_cast<const T *>(p.out) + seq_offset(p, b, s.q0, p.o_batch, p.o_row) + h * p.o_head + (int64_t)i * p.o_row;
    const T *dout = static_cast<const T *>(p.dout) + seq_offset(p, b, s.q0, p.do_batch, p.do_row) + h * p.do_head +
                    (int64_t)i * p.do_row;
    float sum = 0.0f;
    for (int c = lane; c < p.d; c += 32) sum += to_f32(o[c]) * to_f32(dout[c]);
    sum = warp_sum(sum);
    if (lane == 0) p.dvec[row] = sum;
}

template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads) attention_bwd_dkdv_mma_sm80(Params p) {
    constexpr int D = Cfg::kD, BM = Cfg::BM, BN = Cfg::BN, kDOut = Cfg::kDOut;
    constexpr int kQT = BM / 8, kOT = kDOut / 8;
    using KTile = typename Cfg::KTile;
    using QTile = typename Cfg::QTile;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *sk_tile = reinterpret_cast<T *>(smem_raw);
    T *sv_tile = sk_tile + KTile::kElems;
    T *sq_tile = sv_tile + KTile::kElems;           // slot s: sq_tile + s * QTile::kElems
    T *sdo_tile = sq_tile + 2 * QTile::kElems;
    float *s_lse = reinterpret_cast<float *>(sdo_tile + 2 * QTile::kElems);  // [2][BM], log2 units
    float *s_dvec = s_lse + 2 * BM;                                           // [2][BM]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = blockIdx.y, b = blockIdx.z / (D / kDOut), c0 = (blockIdx.z % (D / kDOut)) * kDOut;
    const int group = (int)(p.heads / p.kv_heads), d = (int)p.d;
    grid_dependency_sync();
    const Seq s = seq_of(p, b);
    const int n0 = blockIdx.x * BN;
    if (n0 >= s.sk) return;

    const T *k = static_cast<const T *>(p.k) + seq_offset(p, b, s.k0, p.k_batch, p.k_row) + g * p.k_head;
    const T *v = static_cast<const T *>(p.v) + seq_offset(p, b, s.k0, p.v_batch, p.v_row) + g * p.v_head;
    load_tile<T, BN, D, Cfg::kThreads>(sk_tile, k + (int64_t)n0 * p.k_row, p.k_row, s.sk - n0, d, p.async);
    load_tile<T, BN, D, Cfg::kThreads>(sv_tile, v + (int64_t)n0 * p.v_row, p.v_row, s.sk - n0, d, p.async);

    // Query tiles [t_lo, t_hi) that see one of these keys, for each of the group's heads.
    const Range rows = query_range(p, s, n0, min(n0 + BN, s.sk));
    const int t_lo = rows.lo / BM, nq = rows.hi > rows.lo ? (rows.hi + BM - 1) / BM - t_lo : 0;
    const int iters = nq * group;
    auto load_q = [&](int slot, int it) {
        const int h = g * group + it / nq, m0 = (t_lo + it % nq) * BM;
        const T *q = static_cast<const T *>(p.q) + seq_offset(p, b, s.q0, p.q_batch, p.q_row) + h * p.q_head;
        const T *dout = static_cast<const T *>(p.dout) + seq_offset(p, b, s.q0, p.do_batch, p.do_row) + h * p.do_head;
        load_tile<T, BM, D, Cfg::kThreads>(sq_tile + slot * QTile::kElems, q + (int64_t)m0 * p.q_row, p.q_row,
                                           s.sq - m0, d, p.async);
        load_tile<T, BM, D, Cfg::kThreads>(sdo_tile + slot * QTile::kElems, dout + (int64_t)m0 * p.do_row, p.do_row,
                                           s.sq - m0, d, p.async);
        for (int r = threadIdx.x; r < BM; r += Cfg::kThreads) {
            const int i = m0 + r;
            const bool in = i < s.sq;
            s_lse[slot * BM + r] = in ? p.lse[lse_index(p, s, b, h, i)] * kLog2e : INFINITY;
            s_dvec[slot * BM + r] = in ? p.dvec[row_index(p, b, h, i)] : 0.0f;
        }
    };
    if (iters > 0) load_q(0, 0);
    cp_async_commit();

    const int kw0 = warp * 16;                      // this warp's keys in the tile
    const int j0 = n0 + kw0 + (lane >> 2);          // the two keys this thread holds: j0, j0 + 8
    float acc_dk[kOT][4] = {}, acc_dv[kOT][4] = {};

    for (int it = 0; it < iters; it++) {
        const int slot = it & 1;
        cp_async_wait<0>();
        __syncthreads();  // slot `slot` (and K, V) landed; the other slot is free again
        if (it + 1 < iters) load_q(slot ^ 1, it + 1);
        cp_async_commit();
        const T *qs = sq_tile + slot * QTile::kElems, *dos = sdo_tile + slot * QTile::kElems;
        const float *lse2 = s_lse + slot * BM, *dvec = s_dvec + slot * BM;
        const int m0 = (t_lo + it % nq) * BM;

        // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for this warp's 16 keys x BM queries.
        float acc_s[kQT][4] = {}, acc_dp[kQT][4] = {};
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            uint32_t a_k[4], a_v[4];
            load_a<KTile>(a_k, sk_tile, kw0, kk * 16, lane);
            load_a<KTile>(a_v, sv_tile, kw0, kk * 16, lane);
#pragma unroll
            for (int np = 0; np < kQT / 2; np++) {
                uint32_t b0[2], b1[2];
                load_b_rows_n<QTile>(b0, b1, qs, np * 16, kk * 16, lane);
                mma_m16n8k16<T>(acc_s[2 * np], a_k, b0);
                mma_m16n8k16<T>(acc_s[2 * np + 1], a_k, b1);
                load_b_rows_n<QTile>(b0, b1, dos, np * 16, kk * 16, lane);
                mma_m16n8k16<T>(acc_dp[2 * np], a_v, b0);
                mma_m16n8k16<T>(acc_dp[2 * np + 1], a_v, b1);
            }
        }

        // Pᵀ (masked) into acc_s, dSᵀ = Pᵀ (dPᵀ - dvec) into acc_dp.
        const bool full = tile_visible(p, s, m0, BM, n0 + kw0, 16);
#pragma unroll
        for (int qt = 0; qt < kQT; qt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int ic = qt * 8 + 2 * (lane & 3) + (e & 1), j = j0 + (e >> 1) * 8;
                float pv = ex2_ftz(acc_s[qt][e] * p.scale_log2 - lse2[ic]);
                if (!full && !visible(p, s, m0 + ic, j)) pv = 0.0f;
                acc_s[qt][e] = pv;
                acc_dp[qt][e] = pv * (acc_dp[qt][e] - dvec[ic]);
            }

        // dV += Pᵀ dO, dK += dSᵀ Q over this CTA's kDOut columns.
#pragma unroll
        for (int kk = 0; kk < BM / 16; kk++) {
            uint32_t a_p[4], a_ds[4];
            acc_to_a<T>(a_p, acc_s, kk);
            acc_to_a<T>(a_ds, acc_dp, kk);
#pragma unroll
            for (int np = 0; np < kOT / 2; np++) {
                uint32_t b0[2], b1[2];
                load_b_rows_k<QTile>(b0, b1, dos, c0 + np * 16, kk * 16, lane);
                mma_m16n8k16<T>(acc_dv[2 * np], a_p, b0);
                mma_m16n8k16<T>(acc_dv[2 * np + 1], a_p, b1);
                load_b_rows_k<QTile>(b0, b1, qs, c0 + np * 16, kk * 16, lane);
                mma_m16n8k16<T>(acc_dk[2 * np], a_ds, b0);
                mma_m16n8k16<T>(acc_dk[2 * np + 1], a_ds, b1);
            }
        }
    }
    cp_async_wait<0>();

    // dk, dv: dense (batch | total, sk, kv_heads, d) rows; dK carries the softmax scale.
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int j = j0 + hr * 8;
        if (j >= s.sk) continue;
        const int64_t at = ((s.k0 + j) * p.kv_heads + g) * p.d;
        T *dk = static_cast<T *>(p.dk) + at, *dv = static_cast<T *>(p.dv) + at;
#pragma unroll
        for (int ot = 0; ot < kOT; ot++) {
            const int c = c0 + ot * 8 + 2 * (lane & 3);
            if (c >= d) continue;
            store2<T>(dk + c, acc_dk[ot][2 * hr] * p.scale, acc_dk[ot][2 * hr + 1] * p.scale);
            store2<T>(dv + c, acc_dv[ot][2 * hr], acc_dv[ot][2 * hr + 1]);
        }
    }
}

template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads) attention_bwd_dq_mma_sm80(Params p) {
    constexpr int D = Cfg::kD, BM = Cfg::BM, BN = Cfg::BN, kNT = BN / 8, kDT = D / 8;
    using QTile = typename Cfg::QTile;
    using KVTile = typename Cfg::KVTile;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *sq_tile = reinterpret_cast<T *>(smem_raw);
    T *sdo_tile = sq_tile + QTile::kElems;
    T *sk_tile = sdo_tile + QTile::kElems;          // slot s: sk_tile + s * KVTile::kElems
    T *sv_tile = sk_tile + 2 * KVTile::kElems;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int h = blockIdx.y, b = blockIdx.z, g = h / (int)(p.heads / p.kv_heads), d = (int)p.d;
    grid_dependency_sync();
    const Seq s = seq_of(p, b);
    const int m0 = blockIdx.x * BM;
    if (m0 >= s.sq) return;

    const T *q = static_cast<const T *>(p.q) + seq_offset(p, b, s.q0, p.q_batch, p.q_row) + h * p.q_head;
    const T *dout = static_cast<const T *>(p.dout) + seq_offset(p, b, s.q0, p.do_batch, p.do_row) + h * p.do_head;
    const T *k = static_cast<const T *>(p.k) + seq_offset(p, b, s.k0, p.k_batch, p.k_row) + g * p.k_head;
    const T *v = static_cast<const T *>(p.v) + seq_offset(p, b, s.k0, p.v_batch, p.v_row) + g * p.v_head;
    const Range keys = key_range(p, s, m0, min(m0 + BM, s.sq));
    const int t_lo = keys.lo / BN, t_hi = keys.hi > keys.lo ? (keys.hi + BN - 1) / BN : t_lo;

    load_tile<T, BM, D, Cfg::kThreads>(sq_tile, q + (int64_t)m0 * p.q_row, p.q_row, s.sq - m0, d, p.async);
    load_tile<T, BM, D, Cfg::kThreads>(sdo_tile, dout + (int64_t)m0 * p.do_row, p.do_row, s.sq - m0, d, p.async);
    auto load_kv = [&](int slot, int t) {
        const int n = t * BN;
        load_tile<T, BN, D, Cfg::kThreads>(sk_tile + slot * KVTile::kElems, k + (int64_t)n * p.k_row, p.k_row,
                                           s.sk - n, d, p.async);
        load_tile<T, BN, D, Cfg::kThreads>(sv_tile + slot * KVTile::kElems, v + (int64_t)n * p.v_row, p.v_row,
                                           s.sk - n, d, p.async);
    };
    if (t_lo < t_hi) load_kv(0, t_lo);
    cp_async_commit();

    const int wm0 = warp * 16;
    const bool active = m0 + wm0 < s.sq;
    const int r0 = m0 + wm0 + (lane >> 2);
    float lse2[2], dvec[2];
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int i = r0 + hr * 8;
        lse2[hr] = i < s.sq ? p.lse[lse_index(p, s, b, h, i)] * kLog2e : INFINITY;
        dvec[hr] = i < s.sq ? p.dvec[row_index(p, b, h, i)] : 0.0f;
    }
    float acc_dq[kDT][4] = {};

    for (int t = t_lo; t < t_hi; t++) {
        const int slot = (t - t_lo) & 1;
        cp_async_wait<0>();
        __syncthreads();
        if (t + 1 < t_hi) load_kv(slot ^ 1, t + 1);
        cp_async_commit();
        if (!active) continue;
        const T *ks = sk_tile + slot * KVTile::kElems, *vs = sv_tile + slot * KVTile::kElems;

        float acc_s[kNT][4] = {}, acc_dp[kNT][4] = {};
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            uint32_t a_q[4], a_do[4];
            load_a<QTile>(a_q, sq_tile, wm0, kk * 16, lane);
            load_a<QTile>(a_do, sdo_tile, wm0, kk * 16, lane);
#pragma unroll
            for (int np = 0; np < kNT / 2; np++) {
                uint32_t b0[2], b1[2];
                load_b_rows_n<KVTile>(b0, b1, ks, np * 16, kk * 16, lane);
                mma_m16n8k16<T>(acc_s[2 * np], a_q, b0);
                mma_m16n8k16<T>(acc_s[2 * np + 1], a_q, b1);
                load_b_rows_n<KVTile>(b0, b1, vs, np * 16, kk * 16, lane);
                mma_m16n8k16<T>(acc_dp[2 * np], a_do, b0);
                mma_m16n8k16<T>(acc_dp[2 * np + 1], a_do, b1);
            }
        }

        const int n0 = t * BN;
        const bool full = tile_visible(p, s, m0 + wm0, 16, n0, BN);
#pragma unroll
        for (int nt = 0; nt < kNT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int hr = e >> 1, j = n0 + nt * 8 + 2 * (lane & 3) + (e & 1);
                float pv = ex2_ftz(acc_s[nt][e] * p.scale_log2 - lse2[hr]);
                if (!full && !visible(p, s, r0 + hr * 8, j)) pv = 0.0f;
                acc_dp[nt][e] = pv * (acc_dp[nt][e] - dvec[hr]);
            }

        // dQ += dS K.
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            uint32_t a[4];
            acc_to_a<T>(a, acc_dp, kk);
#pragma unroll
            for (int np = 0; np < kDT / 2; np++) {
                uint32_t b0[2], b1[2];
                load_b_rows_k<KVTile>(b0, b1, ks, np * 16, kk * 16, lane);
                mma_m16n8k16<T>(acc_dq[2 * np], a, b0);
                mma_m16n8k16<T>(acc_dq[2 * np + 1], a, b1);
            }
        }
    }
    cp_async_wait<0>();

    // dq: dense (batch | total, sq, heads, d) rows, times the softmax scale.
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int i = r0 + hr * 8;
        if (i >= s.sq) continue;
        T *dq = static_cast<T *>(p.dq) + ((s.q0 + i) * p.heads + h) * p.d;
#pragma unroll
        for (int dt = 0; dt < kDT; dt++) {
            const int c = dt * 8 + 2 * (lane & 3);
            if (c < d) store2<T>(dq + c, acc_dq[dt][2 * hr] * p.scale, acc_dq[dt][2 * hr + 1] * p.scale);
        }
    }
}

template <typename Cfg, typename Kernel> fk_status set_smem(Kernel kernel) {
    return cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes),
                       "attention_bwd");
}

template <typename T, int D> fk_status launch(const Params &p, int device, cudaStream_t stream) {
    using Kv = DkvCfg<D>;
    using Dq = DqCfg<D>;
    const int64_t rows = p.batch * p.heads * p.sq;
    fk_status st = FK_OK;
    if (rows > 0) {
        st = Launch(dim3((unsigned)((rows + 3) / 4)), dim3(128), 0, stream, device)("attention_bwd_preprocess",
                                                                                 attention_bwd_preprocess<T>, p);
        if (st != FK_OK) return st;
    }
    if (p.sk > 0) {
        auto kernel = attention_bwd_dkdv_mma_sm80<T, Kv>;
        if ((st = set_smem<Kv>(kernel)) != FK_OK) return st;
        const dim3 grid((unsigned)((p.sk + Kv::BN - 1) / Kv::BN), (unsigned)p.kv_heads,
                        (unsigned)(p.batch * (D / Kv::kDOut)));
        if ((st = Launch(grid, dim3(Kv::kThreads), Kv::kSmemBytes, stream, device)("attention_bwd_dkdv", kernel, p)) != FK_OK)
            return st;
    }
    if (p.sq > 0) {
        auto kernel = attention_bwd_dq_mma_sm80<T, Dq>;
        if ((st = set_smem<Dq>(kernel)) != FK_OK) return st;
        const dim3 grid((unsigned)((p.sq + Dq::BM - 1) / Dq::BM), (unsigned)p.heads, (unsigned)p.batch);
        st = Launch(grid, dim3(Dq::kThreads), Dq::kSmemBytes, stream, device)("attention_bwd_dq", kernel, p);
    }
    return st;
}

template <typename T> fk_status launch_bucket(const Plan &plan, const Params &p, int device, cudaStream_t stream) {
    switch (plan.d_bucket) {
    case 64: return launch<T, 64>(p, device, stream);
    case 128: return launch<T, 128>(p, device, stream);
    default: return launch<T, 256>(p, device, stream);
    }
}

}  // namespace

// Instances: attention_bwd_dkdv_mma_sm80 and attention_bwd_dq_mma_sm80, each x {__half,
// __nv_bfloat16} x D {64, 128, 256} = 12, attention_bwd_preprocess x {__half, __nv_bfloat16} = 2;
// 14 in all.
fk_status launch_bwd_mma_sm80(const Plan &plan, const Params &p, fk_dtype dtype, int device, cudaStream_t stream) {
    if (dtype == FK_BFLOAT16) return launch_bucket<__nv_bfloat16>(plan, p, device, stream);
    return launch_bucket<__half>(plan, p, device, stream);
}

}  // namespace fk::attn
