// matmul_mma_sm80: the general tensor-core GEMM for bf16 / fp16, every GPU from sm_80, any shape,
// any operand major, any alignment. dispatch.cu rows "16-bit, not Hopper" and "forced general".
//
// Napkin math: a CTA tile of BM x BN over K does 2 BM BN K FLOPs and loads (BM + BN) K 2-byte
// elements: 128 x 256 gives 85 FLOPs a loaded byte, ~5x what the H100's SM needs from L2 at
// mma.sync's rate. mma.sync peaks near 2/3 of wgmma's rate on Hopper (the issue's aim there: >= 0.65x
// cuBLAS at 4096^3); on an A100 it is the peak path. Measured: 4096^3 0.51-0.53x cuBLAS (~375
// TFLOP/s), 2048^3 0.50x, H200 (D-123).
//
// Algorithm: a kStages-deep ring of shared-memory stages filled by cp.async (16-byte, zero-filled
// past the matrix edges) while the tensor cores work on the oldest stage; each warp owns a WM x WN
// block of C in registers (m16n8k16 fragments from ldmatrix, .trans for the operand whose
// contiguous dim is not K), the fragments of K step s + 1 loaded while step s's mma run. Each
// thread's ldmatrix and cp.async addresses are computed once, outside the K loop. Operands whose
// rows are not 16-byte aligned take element loads through registers into the same ring (kAsync
// false): correct for any view, slower. Epilogue: bias, the pre-activation store, GELU, the 16-bit
// store, straight from the accumulators.
//
// Tile variants (plan.tile): 0 = 128 x 256 (8 warps, 64 x 64 each, 3 stages of 48 KB), aligned
// operands only; 1 = 64 x 64 (4 warps, 32 x 32) for grids under 7/8 of a wave of large tiles,
// element loads, and GPUs with less than 144 KB of shared memory a CTA (sm_86 / sm_89).
#include "matmul.cuh"

namespace fk::mm {
namespace {

template <int BM_, int BN_, int BK_, int WARPS_M_, int WARPS_N_, int STAGES_, int MIN_BLOCKS_> struct TileConfig {
    static constexpr int BM = BM_, BN = BN_, BK = BK_, kWarpsM = WARPS_M_, kWarpsN = WARPS_N_;
    static constexpr int kStages = STAGES_, kMinBlocks = MIN_BLOCKS_;
    static constexpr int kThreads = 32 * kWarpsM * kWarpsN;
    static constexpr int WM = BM / kWarpsM, WN = BN / kWarpsN;
    static constexpr int kMTiles = WM / 16, kNTiles = WN / 8, kKSteps = BK / 16;
    static constexpr int kSmemBytes = kStages * (BM + BN) * BK * 2;
};
// 8 warps of 64 x 64: 32 mma per 8 ldmatrix.x4 (D-123); 144 KB of stages, one CTA an SM.
using Large = TileConfig<128, 256, 64, 2, 4, 3, 1>;
using Small = TileConfig<64, 64, 64, 2, 2, 4, 2>;  // 64 KB

// The shared-memory tile of A (BM x BK) or B (BN x BK): stored with K contiguous when the operand is
// K-major, else transposed (K rows, the other dim contiguous).
template <int kOuter, int kK, bool kKMajor>
using OperandTile = std::conditional_t<kKMajor, SwizzledTile<kOuter, kK>, SwizzledTile<kK, kOuter>>;

// One warp's ldmatrix.x4 addresses into a stage of an operand tile, as byte offsets from the
// stage: fragment f (16 rows of M or N) of K step s (16 of K). The swizzle depends on row & 7 only,
// so one of the two indices is a constant stride and the other a few offsets computed once, not an
// address computation per ldmatrix in the loop.
template <int kOuter, int kK, bool kKMajor, bool kIsA, int kFrags> struct FragOffsets {
    using Tile = OperandTile<kOuter, kK, kKMajor>;
    uint32_t base[kKMajor ? kK / 16 : kFrags];

    __device__ __forceinline__ FragOffsets(int outer0, int lane) {
        // The lane's row of one of the four 8 x 8 matrices: A's as a0..a3 (rows 0-7 / 8-15, then K
        // 8-15), B's as two n8 fragments (K 0-7 / 8-15, then N 8-15).
        const int j = lane >> 3, r = lane & 7;
        const int outer = kIsA ? (kKMajor ? lane & 15 : (j & 1) * 8) : (kKMajor ? (j >> 1) * 8 + r : (j >> 1) * 8);
        const int k = kIsA ? (kKMajor ? (lane >> 4) * 8 : (j >> 1) * 8 + r) : (kKMajor ? (j & 1) * 8 : (j & 1) * 8 + r);
#pragma unroll
        for (int i = 0; i < (kKMajor ? kK / 16 : kFrags); i++)
            base[i] = 2 * (kKMajor ? Tile::offset(outer0 + outer, 16 * i + k) : Tile::offset(k, outer0 + 16 * i + outer));
    }
    __device__ __forceinline__ uint32_t at(int s, int f) const {
        return kKMajor ? base[s] + f * 16 * kK * 2 : base[f] + s * 16 * kOuter * 2;
    }
};

// matmul.cuh's load_tile for one thread with its addresses hoisted out of the K loop: the thread's
// chunks sit kRowStep rows apart in one column, kRowStep a multiple of 8, so chunk i's swizzled
// shared offset is chunk 0's plus a constant and its source chunk 0's plus i row steps.
template <typename T, int kRows, int kCols, int kThreads, bool kAsync> struct TileLoader {
    using Tile = SwizzledTile<kRows, kCols>;
    static constexpr int kChunksPerRow = kCols / 8, kRowStep = kThreads / kChunksPerRow;
    static_assert(kThreads % kChunksPerRow == 0 && kRowStep % 8 == 0 && kRows % kRowStep == 0,
                  "a thread's chunks are whole swizzle periods apart");
    int r0, c0;
    uint32_t dst0;

    __device__ __forceinline__ TileLoader()
        : r0(threadIdx.x / kChunksPerRow), c0(threadIdx.x % kChunksPerRow * 8), dst0(2 * Tile::offset(r0, c0)) {}

    // The tile whose element (r, c) is g[r * stride + c] -> the stage at `smem`, elements with
    // r >= rows or c >= cols as zeros. kAsync: 16-byte cp.async (g 16-byte aligned, stride a
    // multiple of 8 elements); else element loads through registers (any alignment).
    __device__ __forceinline__ void load(unsigned char *smem, const T *g, int64_t stride, int rows, int cols) const {
        const T *src = g + r0 * stride + c0;
        const int valid = c0 < cols ? min(8, cols - c0) : 0;
#pragma unroll
        for (int i = 0; i < kRows / kRowStep; i++) {
            const bool in = r0 + i * kRowStep < rows;
            unsigned char *dst = smem + dst0 + i * kRowStep * kCols * 2;
            if constexpr (kAsync) {
                cp_async_16(dst, in && valid ? src : g, in ? 2 * valid : 0);
            } else {
                Pack<T> v;
#pragma unroll
                for (int e = 0; e < 8; e++) v.v[e] = in && e < valid ? src[e] : from_f32<T>(0.0f);
                store_pack(reinterpret_cast<T *>(dst), v);
            }
            src += kRowStep * stride;
        }
    }
};

template <typename T, typename Cfg, bool kAKMajor, bool kBKMajor, bool kAsync>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks) matmul_mma_sm80(Params p) {
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
    const FragOffsets<Cfg::BM, Cfg::BK, kAKMajor, true, Cfg::kMTiles> frag_a(wm0, lane);
    const FragOffsets<Cfg::BN, Cfg::BK, kBKMajor, false, Cfg::kNTiles / 2> frag_b(wn0, lane);
    const TileLoader<T, kAKMajor ? Cfg::BM : Cfg::BK, kAKMajor ? Cfg::BK : Cfg::BM, Cfg::kThreads, kAsync> load_a;
    const TileLoader<T, kBKMajor ? Cfg::BN : Cfg::BK, kBKMajor ? Cfg::BK : Cfg::BN, Cfg::kThreads, kAsync> load_b;
    const int m_left = (int)(p.m - m0 < Cfg::BM ? p.m - m0 : Cfg::BM);
    const int n_left = (int)(p.n - n0 < Cfg::BN ? p.n - n0 : Cfg::BN);
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
            const T *ga = kAKMajor ? a + m0 * p.a_row + k0 : a + k0 * p.a_col + m0;
            const T *gb = kBKMajor ? b + n0 * p.b_col + k0 : b + k0 * p.b_row + n0;
            const int64_t sta = kAKMajor ? p.a_row : p.a_col, stb = kBKMajor ? p.b_col : p.b_row;
            const int ra = kAKMajor ? m_left : k_left, ca = kAKMajor ? k_left : m_left;
            const int rb = kBKMajor ? n_left : k_left, cb = kBKMajor ? k_left : n_left;
            load_a.load(reinterpret_cast<unsigned char *>(sa), ga, sta, ra, ca);
            load_b.load(reinterpret_cast<unsigned char *>(sb), gb, stb, rb, cb);
        };

        // The fragments of K step s of the stage at shared addresses (sa, sb) -> buffer `buf`.
        uint32_t fa[2][Cfg::kMTiles][4], fb[2][Cfg::kNTiles][2];
        auto load_frags = [&](int buf, const unsigned char *sa, const unsigned char *sb, int s) {
#pragma unroll
            for (int mt = 0; mt < Cfg::kMTiles; mt++) {
                if constexpr (kAKMajor) ldmatrix_x4(fa[buf][mt], sa + frag_a.at(s, mt));
                else ldmatrix_x4_trans(fa[buf][mt], sa + frag_a.at(s, mt));
            }
#pragma unroll
            for (int np = 0; np < Cfg::kNTiles / 2; np++) {
                uint32_t q[4];
                if constexpr (kBKMajor) ldmatrix_x4(q, sb + frag_b.at(s, np));
                else ldmatrix_x4_trans(q, sb + frag_b.at(s, np));
                fb[buf][2 * np][0] = q[0], fb[buf][2 * np][1] = q[1];
                fb[buf][2 * np + 1][0] = q[2], fb[buf][2 * np + 1][1] = q[3];
            }
        };

        float acc[Cfg::kMTiles][Cfg::kNTiles][4] = {};
#pragma unroll
        for (int s = 0; s < Cfg::kStages - 1; s++) {
            if (s < k_tiles) load_stage(s, s);
            cp_async_commit();
        }
        cp_async_wait<Cfg::kStages - 2>();
        __syncthreads();
        int read_slot = 0, write_slot = Cfg::kStages - 1;
        const unsigned char *sa = smem_raw, *sb = smem_raw + Cfg::kStages * TileA::kElems * 2;
        load_frags(0, sa, sb, 0);
        // Fragments are double-buffered in registers: K step s + 1's ldmatrix (the next stage's
        // first step after the last) are issued before step s's mma (D-123).
        for (int kt = 0; kt < k_tiles; kt++) {
#pragma unroll
            for (int s = 0; s < Cfg::kKSteps; s++) {
                if (s == Cfg::kKSteps - 1) {
                    cp_async_wait<Cfg::kStages - 2>();
                    __syncthreads();  // stage kt + 1 landed for every thread; stage kt is free again
                    read_slot = read_slot == Cfg::kStages - 1 ? 0 : read_slot + 1;
                    sa = smem_raw + read_slot * TileA::kElems * 2;
                    sb = smem_raw + (Cfg::kStages * TileA::kElems + read_slot * TileB::kElems) * 2;
                }
                load_frags((s + 1) & 1, sa, sb, (s + 1) % Cfg::kKSteps);
                if (s == 0) {
                    if (kt + Cfg::kStages - 1 < k_tiles) load_stage(write_slot, kt + Cfg::kStages - 1);
                    cp_async_commit();
                    write_slot = write_slot == Cfg::kStages - 1 ? 0 : write_slot + 1;
                }
#pragma unroll
                for (int mt = 0; mt < Cfg::kMTiles; mt++)
#pragma unroll
                    for (int nt = 0; nt < Cfg::kNTiles; nt++) mma_m16n8k16<T>(acc[mt][nt], fa[s & 1][mt], fb[s & 1][nt]);
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

template <typename T, typename Cfg, bool kAsync>
fk_status launch_majors(const Params &p, bool a_kmajor, bool b_kmajor, int device, cudaStream_t stream) {
    switch ((a_kmajor ? 2 : 0) | (b_kmajor ? 1 : 0)) {
    case 0: return launch<T, Cfg, false, false, kAsync>(p, device, stream);
    case 1: return launch<T, Cfg, false, true, kAsync>(p, device, stream);
    case 2: return launch<T, Cfg, true, false, kAsync>(p, device, stream);
    default: return launch<T, Cfg, true, true, kAsync>(p, device, stream);
    }
}

// dispatch.cu gives the large tile aligned operands only: element loads take the small one.
template <typename T>
fk_status launch_tile(const Plan &plan, const Params &p, bool a_kmajor, bool b_kmajor, int device,
                      cudaStream_t stream) {
    if (plan.tile == 0) return launch_majors<T, Large, true>(p, a_kmajor, b_kmajor, device, stream);
    if (plan.aligned) return launch_majors<T, Small, true>(p, a_kmajor, b_kmajor, device, stream);
    return launch_majors<T, Small, false>(p, a_kmajor, b_kmajor, device, stream);
}

}  // namespace

// 2 dtypes x 4 operand majors x (large async, small async, small element loads) = 24 instances.
fk_status launch_mma_sm80(const Plan &plan, const Params &p, fk_dtype dtype, bool a_kmajor,
                          bool b_kmajor, int device, cudaStream_t stream) {
    if (dtype == FK_BFLOAT16) return launch_tile<__nv_bfloat16>(plan, p, a_kmajor, b_kmajor, device, stream);
    return launch_tile<__half>(plan, p, a_kmajor, b_kmajor, device, stream);
}

}  // namespace fk::mm
