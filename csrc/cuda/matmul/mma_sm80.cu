// matmul_mma_sm80: the general tensor-core GEMM for bf16 / fp16, every GPU from sm_80, any shape,
// any operand major, any alignment. dispatch.cu rows "16-bit, not Hopper" and "forced general".
//
// Napkin math: a CTA tile of BM x BN over K does 2 BM BN K FLOPs and loads (BM + BN) K 2-byte
// elements: 128 x 128 gives 64 FLOPs a loaded byte, ~4x what the H100's SM needs from L2 at
// mma.sync's rate. mma.sync peaks near 2/3 of wgmma's rate on Hopper (the issue's aim there: >= 0.65x
// cuBLAS at 4096^3); on an A100 it is the peak path.
//
// Algorithm: a kStages-deep ring of shared-memory stages filled by cp.async (16-byte, zero-filled
// past the matrix edges) while the tensor cores work on the oldest stage; each warp owns a WM x WN
// block of C in registers (m16n8k16 fragments from ldmatrix, .trans for the operand whose
// contiguous dim is not K). Operands whose rows are not 16-byte aligned take element loads through
// registers into the same ring (kAsync false): correct for any view, slower. Epilogue: bias, the
// pre-activation store, GELU, the 16-bit store, straight from the accumulators.
//
// Tile variants (plan.tile): 0 = 128 x 128 (8 warps, 64 x 32 each), 1 = 64 x 64 (4 warps, 32 x 32)
// for grids that would not fill the SMs with the large tile.
#include "matmul.cuh"

namespace fk::mm {
namespace {

template <int BM_, int BN_, int BK_, int WARPS_M_, int WARPS_N_, int STAGES_> struct TileConfig {
    static constexpr int BM = BM_, BN = BN_, BK = BK_, kWarpsM = WARPS_M_, kWarpsN = WARPS_N_;
    static constexpr int kStages = STAGES_;
    static constexpr int kThreads = 32 * kWarpsM * kWarpsN;
    static constexpr int WM = BM / kWarpsM, WN = BN / kWarpsN;
    static constexpr int kMTiles = WM / 16, kNTiles = WN / 8;
    static constexpr int kSmemBytes = kStages * (BM + BN) * BK * 2;
};
using Large = TileConfig<128, 128, 64, 2, 4, 3>;  // 96 KB of stages
using Small = TileConfig<64, 64, 64, 2, 2, 4>;    // 64 KB

// The shared-memory tile of A (BM x BK) or B (BN x BK): stored with K contiguous when the operand is
// K-major, else transposed (K rows, the other dim contiguous).
template <int kOuter, int kK, bool kKMajor>
using OperandTile = std::conditional_t<kKMajor, SwizzledTile<kOuter, kK>, SwizzledTile<kK, kOuter>>;

template <typename T, typename Cfg, bool kAKMajor, bool kBKMajor, bool kAsync>
__global__ void __launch_bounds__(Cfg::kThreads) matmul_mma_sm80(Params p) {
    using TileA = OperandTile<Cfg::BM, Cfg::BK, kAKMajor>;
    using TileB = OperandTile<Cfg::BN, Cfg::BK, kBKMajor>;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *smem_a = reinterpret_cast<T *>(smem_raw);
    T *smem_b = smem_a + Cfg::kStages * TileA::kElems;

    const int tiles_m = (int)((p.m + Cfg::BM - 1) / Cfg::BM), tiles_n = (int)((p.n + Cfg::BN - 1) / Cfg::BN);
    const TileIndex t = grouped_tile(blockIdx.x, tiles_m, tiles_n, 8);
    const int64_t m0 = (int64_t)t.tm * Cfg::BM, n0 = (int64_t)t.tn * Cfg::BN;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm0 = (warp / Cfg::kWarpsN) * Cfg::WM, wn0 = (warp % Cfg::kWarpsN) * Cfg::WN;
    const int k_tiles = (int)((p.k + Cfg::BK - 1) / Cfg::BK);
    grid_dependency_sync();

    for (int64_t batch = blockIdx.y; batch < p.batch; batch += gridDim.y) {
        const T *a = static_cast<const T *>(p.a) + batch * p.a_batch;
        const T *b = static_cast<const T *>(p.b) + batch * p.b_batch;

        // Stage `slot` <- K tile kt of A and B (rows / cols past the matrix read as zeros).
        auto load_stage = [&](int slot, int kt) {
            const int64_t k0 = (int64_t)kt * Cfg::BK;
            const int k_left = (int)(p.k - k0 < Cfg::BK ? p.k - k0 : Cfg::BK);
            T *sa = smem_a + slot * TileA::kElems;
            T *sb = smem_b + slot * TileB::kElems;
            const int m_left = (int)(p.m - m0 < Cfg::BM ? p.m - m0 : Cfg::BM);
            const int n_left = (int)(p.n - n0 < Cfg::BN ? p.n - n0 : Cfg::BN);
            if constexpr (kAKMajor)
                load_tile<T, Cfg::BM, Cfg::BK, Cfg::kThreads, kAsync>(sa, a + m0 * p.a_row + k0, p.a_row, m_left, k_left);
            else
                load_tile<T, Cfg::BK, Cfg::BM, Cfg::kThreads, kAsync>(sa, a + k0 * p.a_col + m0, p.a_col, k_left, m_left);
            if constexpr (kBKMajor)
                load_tile<T, Cfg::BN, Cfg::BK, Cfg::kThreads, kAsync>(sb, b + n0 * p.b_col + k0, p.b_col, n_left, k_left);
            else
                load_tile<T, Cfg::BK, Cfg::BN, Cfg::kThreads, kAsync>(sb, b + k0 * p.b_row + n0, p.b_row, k_left, n_left);
        };

        float acc[Cfg::kMTiles][Cfg::kNTiles][4] = {};
#pragma unroll
        for (int s = 0; s < Cfg::kStages - 1; s++) {
            if (s < k_tiles) load_stage(s, s);
            cp_async_commit();
        }
        for (int kt = 0; kt < k_tiles; kt++) {
            cp_async_wait<Cfg::kStages - 2>();
            __syncthreads();  // stage kt landed for every thread; stage kt - 1 is free again
            if (kt + Cfg::kStages - 1 < k_tiles) load_stage((kt + Cfg::kStages - 1) % Cfg::kStages, kt + Cfg::kStages - 1);
            cp_async_commit();
            const T *sa = smem_a + (kt % Cfg::kStages) * TileA::kElems;
            const T *sb = smem_b + (kt % Cfg::kStages) * TileB::kElems;
#pragma unroll
            for (int kk = 0; kk < Cfg::BK; kk += 16) {
                uint32_t fa[Cfg::kMTiles][4], fb[Cfg::kNTiles][2];
                const int j = lane >> 3, r = lane & 7;
#pragma unroll
                for (int mt = 0; mt < Cfg::kMTiles; mt++) {
                    const int m = wm0 + mt * 16;
                    if constexpr (kAKMajor)
                        ldmatrix_x4(fa[mt], sa + TileA::offset(m + (lane & 15), kk + (lane >> 4) * 8));
                    else
                        ldmatrix_x4_trans(fa[mt], sa + TileA::offset(kk + (j >> 1) * 8 + r, m + (j & 1) * 8));
                }
#pragma unroll
                for (int np = 0; np < Cfg::kNTiles / 2; np++) {
                    const int n = wn0 + np * 16;
                    uint32_t q[4];
                    if constexpr (kBKMajor)
                        ldmatrix_x4(q, sb + TileB::offset(n + (j >> 1) * 8 + r, kk + (j & 1) * 8));
                    else
                        ldmatrix_x4_trans(q, sb + TileB::offset(kk + (j & 1) * 8 + r, n + (j >> 1) * 8));
                    fb[2 * np][0] = q[0], fb[2 * np][1] = q[1], fb[2 * np + 1][0] = q[2], fb[2 * np + 1][1] = q[3];
                }
#pragma unroll
                for (int mt = 0; mt < Cfg::kMTiles; mt++)
#pragma unroll
                    for (int nt = 0; nt < Cfg::kNTiles; nt++) mma_m16n8k16<T>(acc[mt][nt], fa[mt], fb[nt]);
            }
        }
        cp_async_wait<0>();
        __syncthreads();  // the next batch's first loads overwrite the ring

        T *c = static_cast<T *>(p.c) + batch * p.c_batch;
        T *pre = p.pre ? static_cast<T *>(p.pre) + batch * p.c_batch : nullptr;
        const T *bias = static_cast<const T *>(p.bias);
        with_activation(p.activation, [&](auto act) {
#pragma unroll
            for (int mt = 0; mt < Cfg::kMTiles; mt++)
#pragma unroll
                for (int nt = 0; nt < Cfg::kNTiles; nt++) {
                    const int64_t row = m0 + wm0 + mt * 16 + (lane >> 2);
                    const int64_t col = n0 + wn0 + nt * 8 + 2 * (lane & 3);
                    store_pair<act.value, T>(p, c, pre, bias, row, col, acc[mt][nt][0], acc[mt][nt][1]);
                    store_pair<act.value, T>(p, c, pre, bias, row + 8, col, acc[mt][nt][2], acc[mt][nt][3]);
                }
        });
    }
}

template <typename T, typename Cfg, bool kAKMajor, bool kBKMajor, bool kAsync>
fk_status launch(const Params &p, int device, cudaStream_t stream) {
    auto kernel = matmul_mma_sm80<T, Cfg, kAKMajor, kBKMajor, kAsync>;
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
    if (e != cudaSuccess) return cuda_status(e, "matmul");
    const int64_t tiles = ((p.m + Cfg::BM - 1) / Cfg::BM) * ((p.n + Cfg::BN - 1) / Cfg::BN);
    const dim3 grid((unsigned)tiles, (unsigned)std::min<int64_t>(p.batch, 65535));
    return Launch(grid, dim3(Cfg::kThreads), Cfg::kSmemBytes, stream, device)("matmul", kernel, p);
}

template <typename T, typename Cfg>
fk_status launch_majors(const Plan &plan, const Params &p, bool a_kmajor, bool b_kmajor, int device,
                        cudaStream_t stream) {
    const int key = (a_kmajor ? 4 : 0) | (b_kmajor ? 2 : 0) | (plan.aligned ? 1 : 0);
    switch (key) {
    case 0: return launch<T, Cfg, false, false, false>(p, device, stream);
    case 1: return launch<T, Cfg, false, false, true>(p, device, stream);
    case 2: return launch<T, Cfg, false, true, false>(p, device, stream);
    case 3: return launch<T, Cfg, false, true, true>(p, device, stream);
    case 4: return launch<T, Cfg, true, false, false>(p, device, stream);
    case 5: return launch<T, Cfg, true, false, true>(p, device, stream);
    case 6: return launch<T, Cfg, true, true, false>(p, device, stream);
    default: return launch<T, Cfg, true, true, true>(p, device, stream);
    }
}

template <typename T>
fk_status launch_tile(const Plan &plan, const Params &p, bool a_kmajor, bool b_kmajor, int device,
                      cudaStream_t stream) {
    return plan.tile == 0 ? launch_majors<T, Large>(plan, p, a_kmajor, b_kmajor, device, stream)
                          : launch_majors<T, Small>(plan, p, a_kmajor, b_kmajor, device, stream);
}

}  // namespace

// 2 dtypes x 2 tiles x 4 operand majors x (async, element loads) = 32 instances.
fk_status launch_mma_sm80(const Plan &plan, const Params &p, fk_dtype dtype, bool a_kmajor,
                          bool b_kmajor, int device, cudaStream_t stream) {
    if (dtype == FK_BFLOAT16) return launch_tile<__nv_bfloat16>(plan, p, a_kmajor, b_kmajor, device, stream);
    return launch_tile<__half>(plan, p, a_kmajor, b_kmajor, device, stream);
}

}  // namespace fk::mm
