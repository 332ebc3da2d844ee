// attention_fwd_decode_mma_sm80: the forward where the rows of a kv head (sq x group: each query of
// every head sharing it) fit one 16-row mma tile: decoding, and a few queries of GQA. dispatch.cu
// row "fwd decode".
//
// Napkin math: K and V are the whole cost. (8, 1 / 8192, 32 / 8, 128) bf16 reads 268 MB: 61 us at
// the H200's ~4.4 TB/s read rate (64 at its 4.2 TB/s copy); 4 B H Sq Sk D = 1.1 GFLOP, even as
// 16-row tiles ~1% of the tensor cores' time. Little's law: 4.4 TB/s x ~1 us of loaded DRAM latency
// is ~4.4 MB in flight, 34 KB an SM; every warp here keeps 2 tiles of 16 KB in flight (3 slots),
// 128 KB an SM, in copies of whole 128-byte lines (half-line copies ran at 3.4 TB/s, presumably
// the SM's outstanding requests running out before its bytes). A warp's tile step (64 mma.sync,
// the softmax of 16 x 32 scores, ~1000 cycles) is well under the ~3700 its 16 KB take at an SM's
// share of the bandwidth: one warp a scheduler keeps up. The rest is fixed cost, the splits' merge.
// Measured (H200, bf16, same process, D-134): Sk 8192 64.7 us (1.04x torch.compile's 67.1; the
// split kernel it replaces 72.5, 0.93x), Sk 32768 245.7 us (1.00x; 252.7, 0.97x): 4.45 TB/s
// marginal, ~4.4 us fixed (the split kernel ~12).
//
// Algorithm: one CTA of 4 warps per (split, kv head, sequence). Every warp holds all 16 rows (row r:
// query r / group of head g group + r % group; Q's fragments in registers) and streams its own key
// tiles (w, w + 4, ... of the CTA's range) through its own cp.async ring, synchronised by
// __syncwarp alone: no CTA barrier in the loop. Per tile, as fwd_mma_sm80: S = Q Kᵀ, the mask on
// tiles crossing a row's band or the sequence end, the online softmax (exp2, running max and sum),
// O += P V with P from the accumulators. Each warp then leaves its rows' (max, sum, unnormalised O)
// in its own ring and the partials merge: with plan.cluster (sm_90) the splits of a kv head form one
// cluster, every CTA merging a share of the (row, 4-column) chunks of all of them through
// distributed shared memory and writing out and lse itself: no workspace, no second kernel; else a
// CTA merges its 4 warps into out (one split) or an fp32 partial for attention_fwd_combine.
#include "../hopper.cuh"
#include "attention.cuh"

namespace fk::attn {
namespace {

constexpr int kThreads = 32 * kDecodeWarps;
constexpr float kLn2 = 0.693147180559945309f;

template <int D> struct DecodeCfg {
    static constexpr int BN = decode_block_n(D);
    using QTile = SwizzledTile<kDecodeRows, D>;
    using KVTile = SwizzledTile<BN, D>;
    static constexpr int kSlotElems = 2 * KVTile::kElems;  // K, then V
    // A warp's partial in its ring: O (rows of D + 8 floats: the float2 stores of a quad's rows hit
    // distinct banks), then the rows' max (log2 units) and sum.
    static constexpr int kPartStride = D + 8, kPartMax = kDecodeRows * kPartStride, kPartSum = kPartMax + kDecodeRows;
    static_assert((kPartSum + kDecodeRows) * 4 <= 2 * kSlotElems * 2, "a warp's partial fits 2 ring slots");
    static_assert(decode_smem_bytes(D, 1) == 2 * (QTile::kElems + kDecodeWarps * kSlotElems), "dispatch's sizes");
};

// A K and a V tile (BN keys) into a warp's slot by its 32 lanes: lane l takes 16-byte chunk l % (D /
// 8) of rows l / (D / 8) + (32 / (D / 8)) j, so one copy instruction covers whole rows (whole 128-byte
// lines; 8 rows x 64 bytes a copy ran at 0.78x the split kernel, D-134) and a lane's chunks repeat
// their swizzle every 8 rows. Keys >= keys and columns >= d are zero-filled. async: cp.async (rows
// 16-byte aligned), else element loads through registers.
template <typename T, int BN, int D>
__device__ __forceinline__ void load_kv_warp(T *ks, T *vs, const T *kg, const T *vg, int64_t k_row, int64_t v_row,
                                             int keys, int d, bool async, int lane) {
    using Tile = SwizzledTile<BN, D>;
    constexpr int kPerRow = D / 8, kRowStep = 32 / kPerRow, kPeriod = 8 / kRowStep;  // j's swizzle period
    static_assert(BN % kRowStep == 0 && (BN / kRowStep) % kPeriod == 0, "whole swizzle periods a tile");
    const int r0 = lane / kPerRow, col = lane % kPerRow * 8;
    int at[kPeriod];
#pragma unroll
    for (int j = 0; j < kPeriod; j++) at[j] = Tile::offset(r0 + kRowStep * j, col);  // + 8 D a period
#pragma unroll
    for (int j = 0; j < BN / kRowStep; j++) {
        const int r = r0 + kRowStep * j, dst = at[j % kPeriod] + j / kPeriod * 8 * D;
        const bool in = r < keys && col < d;
        const T *ksrc = in ? kg + r * k_row + col : kg, *vsrc = in ? vg + r * v_row + col : vg;
        if (async) {
            cp_async_16(ks + dst, ksrc, in ? 16 : 0);
            cp_async_16(vs + dst, vsrc, in ? 16 : 0);
        } else {
            Pack<T> kp, vp;
#pragma unroll
            for (int e = 0; e < 8; e++) {
                kp.v[e] = in ? ksrc[e] : from_f32<T>(0.0f);
                vp.v[e] = in ? vsrc[e] : from_f32<T>(0.0f);
            }
            store_pack(ks + dst, kp);
            store_pack(vs + dst, vp);
        }
    }
}

// A warp's partial (source `src` = cluster rank x 4 + warp) at float `index`: with kCluster from
// any CTA of the cluster (distributed shared memory), else from this CTA.
template <bool kCluster> struct Partials {
    const float *base;   // this CTA's warp 0 partial
    int warp_floats;     // floats from one warp's partial to the next (its ring)
    __device__ __forceinline__ const float *at(int src, int index) const {
        return base + (src % kDecodeWarps) * warp_floats + index;
    }
    __device__ __forceinline__ float load(int src, int index) const {
        if constexpr (kCluster) return ld_shared_cluster_f32(mapa_shared_cluster(at(src, index), src / kDecodeWarps));
        else return *at(src, index);
    }
    __device__ __forceinline__ float4 load4(int src, int index) const {
        if constexpr (kCluster)
            return ld_shared_cluster_v4_f32(mapa_shared_cluster(at(src, index), src / kDecodeWarps));
        else return *reinterpret_cast<const float4 *>(at(src, index));
    }
};

template <typename T, int D, bool kCluster>
__global__ void __launch_bounds__(kThreads, 1) attention_fwd_decode_mma_sm80(Params p, int stages) {
    using Cfg = DecodeCfg<D>;
    using QTile = typename Cfg::QTile;
    using KVTile = typename Cfg::KVTile;
    constexpr int BN = Cfg::BN, kNT = BN / 8, kDT = D / 8;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *q_tile = reinterpret_cast<T *>(smem_raw);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    T *ring = q_tile + QTile::kElems + warp * stages * Cfg::kSlotElems;  // this warp's slots

    // blockIdx.x: the split (with a cluster: its rank, gridDim.x being the cluster).
    const int split = blockIdx.x, g = blockIdx.y, b = blockIdx.z;
    const int group = (int)(p.heads / p.kv_heads), d = (int)p.d;
    auto row_query = [&](int r) { return r / group; };
    auto row_head = [&](int r) { return g * group + r % group; };
    grid_dependency_sync();
    const Seq s = seq_of(p, b);
    const int rows = s.sq * group;  // <= kDecodeRows (the plan's row)
    if (rows == 0) return;          // varlen: an empty sequence; the whole cluster returns

    const T *q = static_cast<const T *>(p.q) + seq_offset(p, b, s.q0, p.q_batch, p.q_row);
    const T *k = static_cast<const T *>(p.k) + seq_offset(p, b, s.k0, p.k_batch, p.k_row) + g * p.k_head;
    const T *v = static_cast<const T *>(p.v) + seq_offset(p, b, s.k0, p.v_batch, p.v_row) + g * p.v_head;

    // Key tiles [t_lo, t_hi) of this split: the rows' band cut into p.splits ranges of whole rounds
    // of the 4 warps; this warp takes t_lo + warp + 4 i, i < n_tiles.
    const Range keys = key_range(p, s, 0, s.sq);
    int t_lo = keys.lo / BN, t_hi = keys.hi > keys.lo ? (keys.hi + BN - 1) / BN : t_lo;
    if (p.splits > 1) {
        const int per = ((t_hi - t_lo + p.splits - 1) / p.splits + kDecodeWarps - 1) / kDecodeWarps * kDecodeWarps;
        t_lo = min(t_hi, t_lo + split * per);
        t_hi = min(t_hi, t_lo + per);
    }
    const int n_tiles = t_hi - t_lo > warp ? (t_hi - t_lo - warp + kDecodeWarps - 1) / kDecodeWarps : 0;

    load_rows<T, kDecodeRows, D, kThreads>(q_tile, rows, d, p.async, [&](int r) {
        return q + (int64_t)row_query(r) * p.q_row + row_head(r) * p.q_head;
    });
    cp_async_commit();
    auto load_kv = [&](int slot, int i) {  // this warp's tile i into `slot`
        const int n0 = (t_lo + warp + kDecodeWarps * i) * BN;
        T *ks = ring + slot * Cfg::kSlotElems;
        load_kv_warp<T, BN, D>(ks, ks + KVTile::kElems, k + (int64_t)n0 * p.k_row, v + (int64_t)n0 * p.v_row,
                               p.k_row, p.v_row, s.sk - n0, d, p.async, lane);
    };
    for (int st = 0; st < stages - 1; st++) {  // one commit group a slot, loaded or not
        if (st < n_tiles) load_kv(st, st);
        cp_async_commit();
    }

    // A held row's visible keys (rows past the sequence: every key; their Q rows are zeros, their
    // results never stored) and the range all 16 rows see: tiles inside it take no mask.
    const int r0 = lane >> 2;  // rows held: r0, r0 + 8
    auto row_keys = [&](int r) {
        return r < rows ? key_range(p, s, row_query(r), row_query(r) + 1) : Range{0, s.sk};
    };
    int w_lo = 0, w_hi = s.sk;
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const Range kr = row_keys(r0 + 8 * hr);
        w_lo = max(w_lo, kr.lo), w_hi = min(w_hi, kr.hi);
    }
    warp_key_range<4>(w_lo, w_hi);

    // ldmatrix lane offsets (fwd_mma_sm80's): Q (A) rows lane % 16, column 8 (lane / 16); K (B, rows
    // n) block lane / 8 at n 8 (j / 2), k 8 (j % 2); V (B, rows k, .trans) k 8 (j % 2), n 8 (j / 2).
    const int j8 = lane >> 3, r8 = lane & 7;
    const int a_q = QTile::offset(lane & 15, (lane >> 4) * 8);         // kk: ^ 16 kk
    const int b_k = KVTile::offset((j8 >> 1) * 8 + r8, (j8 & 1) * 8);  // kk: ^ 16 kk, np: + 16 np D
    const int b_v = KVTile::offset((j8 & 1) * 8 + r8, (j8 >> 1) * 8);  // np: ^ 16 np, kk: + 16 kk D
    if (stages == 3) cp_async_wait<2>();  // Q's group
    else cp_async_wait<1>();
    __syncthreads();
    uint32_t q_frag[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) ldsm_x4<false>(q_frag[kk], q_tile, a_q, 16 * kk, 0);

    const bool fold = p.scale_log2 > 0.0f;
    const float mul = fold ? p.scale_log2 : 1.0f;
    float acc_o[kDT][4] = {};
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {};
    int slot = 0, load_slot = stages - 1;  // tile i's slot, and the slot tile i + stages - 1 fills
    for (int i = 0; i < n_tiles; i++) {
        if (stages == 3) cp_async_wait<1>();
        else cp_async_wait<0>();
        __syncwarp();  // tile i landed for every lane; the slot of tile i - 1 is free again
        if (i + stages - 1 < n_tiles) load_kv(load_slot, i + stages - 1);
        cp_async_commit();
        load_slot = load_slot + 1 == stages ? 0 : load_slot + 1;
        const T *ks = ring + slot * Cfg::kSlotElems, *vs = ks + KVTile::kElems;
        slot = slot + 1 == stages ? 0 : slot + 1;

        // S = Q Kᵀ: 16 rows x BN keys.
        float acc_s[kNT][4] = {};
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
#pragma unroll
            for (int np = 0; np < kNT / 2; np++) {
                uint32_t bk[4];
                ldsm_x4<false>(bk, ks, b_k, 16 * kk, 16 * np * D);
                mma_m16n8k16<T>(acc_s[2 * np], q_frag[kk], {bk[0], bk[1]});
                mma_m16n8k16<T>(acc_s[2 * np + 1], q_frag[kk], {bk[2], bk[3]});
            }

        // The mask on tiles outside the common range, then the online softmax (fwd_mma_sm80's: the
        // scale folded into the exponent's FFMA when positive; row_max in the units of s).
        const int n0 = (t_lo + warp + kDecodeWarps * i) * BN;
        if (!fold) {
#pragma unroll
            for (int nt = 0; nt < kNT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc_s[nt][e] *= p.scale_log2;
        }
        if (n0 < w_lo || n0 + BN > w_hi) {
#pragma unroll
            for (int hr = 0; hr < 2; hr++) {
                const Range kr = row_keys(r0 + 8 * hr);
                const int lo = kr.lo - n0 - 2 * (lane & 3), hi = kr.hi - n0 - 2 * (lane & 3);
#pragma unroll
                for (int nt = 0; nt < kNT; nt++)
#pragma unroll
                    for (int e = 0; e < 2; e++)
                        if (nt * 8 + e < lo || nt * 8 + e >= hi) acc_s[nt][2 * hr + e] = -INFINITY;
            }
        }
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            float mx = row_max[hr];
#pragma unroll
            for (int nt = 0; nt < kNT; nt++) mx = fmaxf(mx, fmaxf(acc_s[nt][2 * hr], acc_s[nt][2 * hr + 1]));
            mx = quad_max(mx);
            const float base = mx == -INFINITY ? 0.0f : mx * mul;  // no key seen yet: exponents against 0
            const float alpha = ex2_ftz(row_max[hr] * mul - base);   // 0 while the old max is -inf
            row_max[hr] = mx;
            float sum = 0.0f;
#pragma unroll
            for (int nt = 0; nt < kNT; nt++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const float pv = ex2_ftz(fmaf(acc_s[nt][2 * hr + e], mul, -base));
                    acc_s[nt][2 * hr + e] = pv;
                    sum += pv;
                }
            row_sum[hr] = row_sum[hr] * alpha + sum;
#pragma unroll
            for (int dt = 0; dt < kDT; dt++) acc_o[dt][2 * hr] *= alpha, acc_o[dt][2 * hr + 1] *= alpha;
        }

        // O += P V.
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            uint32_t a[4];
            acc_to_a<T>(a, acc_s, kk);
#pragma unroll
            for (int np = 0; np < kDT / 2; np++) {
                uint32_t bv[4];
                ldsm_x4<true>(bv, vs, b_v, 16 * np, 16 * kk * D);
                mma_m16n8k16<T>(acc_o[2 * np], a, {bv[0], bv[1]});
                mma_m16n8k16<T>(acc_o[2 * np + 1], a, {bv[2], bv[3]});
            }
        }
    }
    cp_async_wait<0>();
    __syncwarp();

    // This warp's partial into its own ring: O unnormalised, the max in log2 units, the sum.
    float *part = reinterpret_cast<float *>(ring);
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int r = r0 + 8 * hr;
        const float sum = quad_sum(row_sum[hr]);
#pragma unroll
        for (int dt = 0; dt < kDT; dt++)
            *reinterpret_cast<float2 *>(part + r * Cfg::kPartStride + dt * 8 + 2 * (lane & 3)) =
                make_float2(acc_o[dt][2 * hr], acc_o[dt][2 * hr + 1]);
        if ((lane & 3) == 0) part[Cfg::kPartMax + r] = row_max[hr] * mul, part[Cfg::kPartSum + r] = sum;
    }
    if constexpr (kCluster) {
        barrier_cluster_arrive();  // every warp of every CTA of the cluster has written its partial
        barrier_cluster_wait();
    } else {
        __syncthreads();
    }

    // The merge: (row, 4-column) chunks over the cluster's threads (or this CTA's); each weighs the
    // sources' sums and outputs by 2^(max_src - max).
    const int ranks = kCluster ? p.splits : 1, sources = ranks * kDecodeWarps, chunks = d / 4;
    const Partials<kCluster> parts{reinterpret_cast<const float *>(q_tile + QTile::kElems),
                                   stages * Cfg::kSlotElems * (int)sizeof(T) / 4};
    for (int item = (kCluster ? split * kThreads : 0) + threadIdx.x; item < rows * chunks; item += ranks * kThreads) {
        const int r = item / chunks, c = item % chunks * 4, i = row_query(r), h = row_head(r);
        float mx = -INFINITY;
        for (int src = 0; src < sources; src++) mx = fmaxf(mx, parts.load(src, Cfg::kPartMax + r));
        float sum = 0.0f, o[4] = {};
        if (mx != -INFINITY) {
            for (int src = 0; src < sources; src++) {
                const float w = ex2_ftz(parts.load(src, Cfg::kPartMax + r) - mx);  // 0 for a source with no key
                const float4 x = parts.load4(src, r * Cfg::kPartStride + c);
                sum += w * parts.load(src, Cfg::kPartSum + r);
                o[0] += w * x.x, o[1] += w * x.y, o[2] += w * x.z, o[3] += w * x.w;
            }
        }
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f, lse2 = mx + log2f(sum);  // lse2: with sum > 0
        if (kCluster || p.splits == 1) {  // out and lse; no visible key: out 0, lse +inf
            T *out = static_cast<T *>(p.out) + seq_offset(p, b, s.q0, p.o_batch, p.o_row) + h * p.o_head +
                     (int64_t)i * p.o_row + c;
            store2<T>(out, o[0] * inv, o[1] * inv);
            store2<T>(out + 2, o[2] * inv, o[3] * inv);
            if (c == 0) p.lse[lse_index(p, s, b, h, i)] = sum > 0.0f ? lse2 * kLn2 : INFINITY;
        } else {  // the split's fp32 partial for attention_fwd_combine; no visible key: lse -inf
            const int64_t row = (int64_t)split * p.batch * p.heads * p.sq + row_index(p, b, h, i);
            *reinterpret_cast<float4 *>(p.part_out + row * d + c) = make_float4(o[0] * inv, o[1] * inv, o[2] * inv, o[3] * inv);
            if (c == 0) p.part_lse[row] = sum > 0.0f ? lse2 * kLn2 : -INFINITY;
        }
    }
    if constexpr (kCluster) {  // no CTA leaves while a peer may still read its shared memory
        barrier_cluster_arrive();
        barrier_cluster_wait();
    }
}

template <typename T, int D, bool kCluster>
fk_status launch(const Plan &plan, const Params &p, int device, cudaStream_t stream) {
    auto kernel = attention_fwd_decode_mma_sm80<T, D, kCluster>;
    const int smem = decode_smem_bytes(D, plan.stages);
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return cuda_status(e, "attention_fwd");
    const dim3 grid((unsigned)plan.splits, (unsigned)p.kv_heads, (unsigned)p.batch);
    fk_status st = Launch(grid, dim3(kThreads), smem, stream, device, kCluster ? plan.splits : 1)(
        "attention_fwd", kernel, p, plan.stages);
    if (st != FK_OK || kCluster || plan.splits == 1) return st;
    return launch_fwd_combine(p, std::is_same_v<T, __half> ? FK_FLOAT16 : FK_BFLOAT16, device, stream);
}

template <typename T> fk_status launch_bucket(const Plan &plan, const Params &p, int device, cudaStream_t stream) {
    if (plan.d_bucket <= 64)
        return plan.cluster ? launch<T, 64, true>(plan, p, device, stream) : launch<T, 64, false>(plan, p, device, stream);
    return plan.cluster ? launch<T, 128, true>(plan, p, device, stream) : launch<T, 128, false>(plan, p, device, stream);
}

}  // namespace

int decode_clusters_fit(int device, int k, int stages) {
    static int fit[64][kDecodeMaxCluster + 1][4];  // +1: 0 means not asked yet
    if (device < 0 || device >= 64 || k < 2 || k > kDecodeMaxCluster || stages < 1 || stages > 3) return 0;
    int &cached = fit[device][k][stages];
    if (cached == 0) {
        auto kernel = attention_fwd_decode_mma_sm80<__nv_bfloat16, 128, true>;
        const int smem = decode_smem_bytes(128, stages);
        int n = 0;
        if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) == cudaSuccess) {
            Launch config(dim3((unsigned)k), dim3(kThreads), smem, nullptr, -1, k);
            if (cudaOccupancyMaxActiveClusters(&n, kernel, &config.config) != cudaSuccess) n = 0;
        }
        cudaGetLastError();
        cached = n + 1;
    }
    return cached - 1;
}

// Instances: attention_fwd_decode_mma_sm80 x {__half, __nv_bfloat16} x D {64, 128} x {cluster, not} = 8.
fk_status launch_fwd_decode_mma_sm80(const Plan &plan, const Params &p, fk_dtype dtype, int device,
                                    cudaStream_t stream) {
    if (dtype == FK_BFLOAT16) return launch_bucket<__nv_bfloat16>(plan, p, device, stream);
    return launch_bucket<__half>(plan, p, device, stream);
}

}  // namespace fk::attn
