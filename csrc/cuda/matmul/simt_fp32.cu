// matmul_simt_fp32: exact fp32 GEMM on the CUDA cores (torch's default fp32 matmul, TF32 off), any
// shape, major and alignment. dispatch.cu row "fp32".
//
// Napkin math: 2 M N K FMAs at the H100's ~60 TFLOP/s fp32 peak (cuBLAS measured 51 at 4096^3 on an
// H200): 4096^3 is 137 GFLOP, ~2.7 ms. A thread's 8 x 8 outputs take 16 shared-memory words a k
// step for 64 FMAs: 4 FMAs a loaded word, enough to keep the FMA pipes ahead of shared memory.
//
// Algorithm: a CTA of 256 threads owns a 128 x 128 block of C and walks K in steps of 8. Each step's
// A (128 x 8) and B (8 x 128) tiles are loaded element-wise into registers (coalesced along the
// operand's contiguous dim, zeros past the edges) while the previous step is computed from shared
// memory, then stored transposed to k-major rows (As[k][m], Bs[k][n], padded against bank
// conflicts): two buffers, one __syncthreads a step. A thread's outputs are two 4 x 4 blocks 64 rows
// and 64 columns apart, read as float4s.
#include "matmul.cuh"

namespace fk::mm {
namespace {

constexpr int kBM = 128, kBN = 128, kBK = 8, kThreads = 256, kPad = 4;
constexpr int kLoads = kBM * kBK / kThreads;  // A and B elements a thread loads per step (4)
constexpr int kChunkTiles = 16;                // k-steps summed before they join the total

template <bool kAKMajor, bool kBKMajor>
__global__ void __launch_bounds__(kThreads) matmul_simt_fp32(Params p) {
    __shared__ __align__(16) float As[2][kBK][kBM + kPad];
    __shared__ __align__(16) float Bs[2][kBK][kBN + kPad];
    const int tiles_m = (int)((p.m + kBM - 1) / kBM), tiles_n = (int)((p.n + kBN - 1) / kBN);
    const TileIndex t = grouped_tile(blockIdx.x, tiles_m, tiles_n, 8);
    const int64_t m0 = (int64_t)t.tm * kBM, n0 = (int64_t)t.tn * kBN;
    const int tid = threadIdx.x, tm = tid / 16, tn = tid % 16;
    const int k_tiles = (int)((p.k + kBK - 1) / kBK);
    grid_dependency_sync();

    for (int64_t batch = blockIdx.y; batch < p.batch; batch += gridDim.y) {
        const float *a = static_cast<const float *>(p.a) + batch * p.a_batch;
        const float *b = static_cast<const float *>(p.b) + batch * p.b_batch;
        float ra[kLoads], rb[kLoads];
        // Element e of a step's A tile: (m, k) with the contiguous dim fastest across threads.
        auto a_coord = [&](int e, int &m, int &k) {
            if (kAKMajor) m = e / kBK, k = e % kBK; else m = e % kBM, k = e / kBM;
        };
        auto b_coord = [&](int e, int &n, int &k) {
            if (kBKMajor) n = e / kBK, k = e % kBK; else n = e % kBN, k = e / kBN;
        };
        auto load = [&](int kt) {
            const int64_t k0 = (int64_t)kt * kBK;
#pragma unroll
            for (int i = 0; i < kLoads; i++) {
                int m, n, ka, kb;
                a_coord(i * kThreads + tid, m, ka);
                b_coord(i * kThreads + tid, n, kb);
                ra[i] = m0 + m < p.m && k0 + ka < p.k ? a[(m0 + m) * p.a_row + (k0 + ka) * p.a_col] : 0.0f;
                rb[i] = n0 + n < p.n && k0 + kb < p.k ? b[(k0 + kb) * p.b_row + (n0 + n) * p.b_col] : 0.0f;
            }
        };
        auto store = [&](int buf) {
#pragma unroll
            for (int i = 0; i < kLoads; i++) {
                int m, n, ka, kb;
                a_coord(i * kThreads + tid, m, ka);
                b_coord(i * kThreads + tid, n, kb);
                As[buf][ka][m] = ra[i];
                Bs[buf][kb][n] = rb[i];
            }
        };

        // Two-level sums: acc takes kChunkTiles k-steps, then folds into total, so a long K adds
        // ~K / 128 + 128 roundings an output instead of K (grad of (7, 4096) @ (4096, 16): 3.7x ->
        // within 2x of cuBLAS's split-K error).
        float acc[8][8] = {}, total[8][8] = {};
        if (k_tiles > 0) {
            load(0);
            store(0);
        }
        __syncthreads();
        for (int kt = 0; kt < k_tiles; kt++) {
            const int buf = kt & 1;
            if (kt + 1 < k_tiles) load(kt + 1);
#pragma unroll
            for (int k = 0; k < kBK; k++) {
                float fa[8], fb[8];
                *reinterpret_cast<float4 *>(fa) = *reinterpret_cast<const float4 *>(&As[buf][k][tm * 4]);
                *reinterpret_cast<float4 *>(fa + 4) = *reinterpret_cast<const float4 *>(&As[buf][k][64 + tm * 4]);
                *reinterpret_cast<float4 *>(fb) = *reinterpret_cast<const float4 *>(&Bs[buf][k][tn * 4]);
                *reinterpret_cast<float4 *>(fb + 4) = *reinterpret_cast<const float4 *>(&Bs[buf][k][64 + tn * 4]);
#pragma unroll
                for (int i = 0; i < 8; i++)
#pragma unroll
                    for (int j = 0; j < 8; j++) acc[i][j] = fmaf(fa[i], fb[j], acc[i][j]);
            }
            if (kt + 1 < k_tiles) store(buf ^ 1);
            __syncthreads();
            if ((kt + 1) % kChunkTiles == 0 || kt + 1 == k_tiles) {
#pragma unroll
                for (int i = 0; i < 8; i++)
#pragma unroll
                    for (int j = 0; j < 8; j++) total[i][j] += acc[i][j], acc[i][j] = 0.0f;
            }
        }

        float *c = static_cast<float *>(p.c) + batch * p.c_batch;
        float *pre = p.pre ? static_cast<float *>(p.pre) + batch * p.c_batch : nullptr;
        const float *bias = static_cast<const float *>(p.bias);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int64_t row = m0 + (i < 4 ? tm * 4 + i : 64 + tm * 4 + i - 4);
#pragma unroll
            for (int j = 0; j < 8; j += 2) {
                const int64_t col = n0 + (j < 4 ? tn * 4 + j : 64 + tn * 4 + j - 4);
                store_pair<float>(p, c, pre, bias, row, col, total[i][j], total[i][j + 1]);
            }
        }
    }
}

template <bool kAKMajor, bool kBKMajor> fk_status launch(const Params &p, int device, cudaStream_t stream) {
    const int64_t tiles = ((p.m + kBM - 1) / kBM) * ((p.n + kBN - 1) / kBN);
    const dim3 grid((unsigned)tiles, (unsigned)std::min<int64_t>(p.batch, 65535));
    return Launch(grid, dim3(kThreads), 0, stream, device)("matmul", matmul_simt_fp32<kAKMajor, kBKMajor>, p);
}

}  // namespace

// 4 instances: the operand majors.
fk_status launch_simt_fp32(const Plan &, const Params &p, bool a_kmajor, bool b_kmajor, int device,
                           cudaStream_t stream) {
    if (a_kmajor) return b_kmajor ? launch<true, true>(p, device, stream) : launch<true, false>(p, device, stream);
    return b_kmajor ? launch<false, true>(p, device, stream) : launch<false, false>(p, device, stream);
}

}  // namespace fk::mm
