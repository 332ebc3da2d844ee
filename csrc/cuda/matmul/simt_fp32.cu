// matmul_simt_fp32: exact fp32 GEMM on the CUDA cores (torch's default fp32 matmul, TF32 off), any
// shape, major and alignment. dispatch.cu row "fp32, otherwise".
//
// Napkin math: 2 M N K FMAs at the H100's ~60 TFLOP/s fp32 peak (cuBLAS measured 51 at 4096^3 on an
// H200): 4096^3 is 137 GFLOP, ~2.7 ms. A thread's 8 x 8 outputs take 16 shared-memory words a k
// step for 64 FMAs: 4 FMAs a loaded word, enough to keep the FMA pipes ahead of shared memory.
//
// Algorithm: a CTA of 256 threads owns a 128 x 128 block of C and walks K in steps of 8. Each step's
// A (128 x 8) and B (8 x 128) tiles are copied by 4-byte cp.async (coalesced along the operand's
// contiguous dim, zero-filled past the edges) straight into k-major rows (As[k][m], Bs[k][n], padded
// against bank conflicts) while the previous step is computed: two buffers, one __syncthreads a
// step. A thread's outputs are two 4 x 4 blocks 64 rows and 64 columns apart, read as float4s. Sums
// run in two levels (kChunkTiles steps in registers, then a running total in shared memory), so a
// thread holds 64 accumulators, not 128: 128 registers, 2 CTAs an SM (was 1 at 241-255 registers,
// 4096^3 23-25 TFLOP/s = 0.47x cuBLAS on the H200). The arithmetic, and so every result bit, is the
// one-CTA version's. H100: 4096^3 33 TFLOP/s = 0.63x cuBLAS (session 34).
#include <cuda_pipeline.h>

#include "matmul.cuh"

namespace fk::mm {
namespace {

constexpr int kBM = 128, kBN = 128, kBK = 8, kThreads = 256, kPad = 4;
constexpr int kLoads = kBM * kBK / kThreads;  // A and B elements a thread loads per step (4)
constexpr int kChunkTiles = 16;                // k-steps summed before they join the total
// The running totals live in shared memory, a thread's 64 as one column of a [64][kThreads] array
// (conflict-free, touched once every kChunkTiles k-steps): 64 registers fewer, so 2 CTAs fit an SM.
constexpr int kTotalsBytes = 64 * kThreads * 4;  // 64 KB

template <bool kAKMajor, bool kBKMajor>
__global__ void __launch_bounds__(kThreads, 2) matmul_simt_fp32(Params p) {
    __shared__ __align__(16) float As[2][kBK][kBM + kPad];
    __shared__ __align__(16) float Bs[2][kBK][kBN + kPad];
    extern __shared__ float totals[];  // [64][kThreads]: total[i][j] of thread t at (8 i + j) * kThreads + t
    const int tiles_m = (int)((p.m + kBM - 1) / kBM), tiles_n = (int)((p.n + kBN - 1) / kBN);
    const TileIndex t = grouped_tile(blockIdx.x, tiles_m, tiles_n, 8);
    const int64_t m0 = (int64_t)t.tm * kBM, n0 = (int64_t)t.tn * kBN;
    const int tid = threadIdx.x, tm = tid / 16, tn = tid % 16;
    const int k_tiles = (int)((p.k + kBK - 1) / kBK);
    grid_dependency_sync();

    for (int64_t batch = blockIdx.y; batch < p.batch; batch += gridDim.y) {
        const float *a = static_cast<const float *>(p.a) + batch * p.a_batch;
        const float *b = static_cast<const float *>(p.b) + batch * p.b_batch;
        // Element e of a step's A tile: (m, k) with the contiguous dim fastest across threads.
        auto a_coord = [&](int e, int &m, int &k) {
            if (kAKMajor) m = e / kBK, k = e % kBK; else m = e % kBM, k = e / kBM;
        };
        auto b_coord = [&](int e, int &n, int &k) {
            if (kBKMajor) n = e / kBK, k = e % kBK; else n = e % kBN, k = e / kBN;
        };
        // A thread's kLoads elements of a step's tile lie a fixed distance apart: 32 rows (K-major)
        // or 2 k (M/N-major); addresses and bounds from one base each, compared in 32 bits.
        int ma, ka, nb, kb;
        a_coord(tid, ma, ka);
        b_coord(tid, nb, kb);
        constexpr int kStepM = kAKMajor ? kThreads / kBK : 0, kStepKA = kAKMajor ? 0 : kThreads / kBM;
        constexpr int kStepN = kBKMajor ? kThreads / kBK : 0, kStepKB = kBKMajor ? 0 : kThreads / kBN;
        // The contiguous dim's stride is 1 in every instance (dispatch.cu's a_kmajor / b_kmajor).
        const int64_t a_row = kAKMajor ? p.a_row : 1, a_col = kAKMajor ? 1 : p.a_col;
        const int64_t b_row = kBKMajor ? 1 : p.b_row, b_col = kBKMajor ? p.b_col : 1;
        const int64_t da = kStepM * a_row + kStepKA * a_col, db = kStepKB * b_row + kStepN * b_col;
        const float *a0 = a + (m0 + ma) * a_row + ka * a_col, *b0 = b + kb * b_row + (n0 + nb) * b_col;
        const int rows_a = (int)min(p.m - m0, (int64_t)kBM) - ma, cols_b = (int)min(p.n - n0, (int64_t)kBN) - nb;
        // Step kt's tiles -> buffer buf, transposed to k-major rows, by 4-byte asynchronous copies
        // (zeros past the edges): no registers held across the step's FMAs.
        auto copy = [&](int kt, int buf) {
            const int64_t k0 = (int64_t)kt * kBK;
            const int k_left = (int)min(p.k - k0, (int64_t)kBK);
            const float *pa = a0 + k0 * a_col, *pb = b0 + k0 * b_row;
#pragma unroll
            for (int i = 0; i < kLoads; i++) {
                const bool in_a = i * kStepM < rows_a && ka + i * kStepKA < k_left;
                const bool in_b = i * kStepN < cols_b && kb + i * kStepKB < k_left;
                __pipeline_memcpy_async(&As[buf][ka + i * kStepKA][ma + i * kStepM], in_a ? pa + i * da : a, 4,
                                        in_a ? 0 : 4);
                __pipeline_memcpy_async(&Bs[buf][kb + i * kStepKB][nb + i * kStepN], in_b ? pb + i * db : b, 4,
                                        in_b ? 0 : 4);
            }
            __pipeline_commit();
        };

        // Two-level sums: acc takes kChunkTiles k-steps, then folds into total, so a long K adds
        // ~K / 128 + 128 roundings an output instead of K (grad of (7, 4096) @ (4096, 16): 3.7x ->
        // within 2x of cuBLAS's split-K error).
        float acc[8][8] = {};
#pragma unroll
        for (int i = 0; i < 64; i++) totals[i * kThreads + tid] = 0.0f;
        if (k_tiles > 0) copy(0, 0);
        __pipeline_wait_prior(0);
        __syncthreads();
        for (int kt = 0; kt < k_tiles; kt++) {
            const int buf = kt & 1;
            if (kt + 1 < k_tiles) copy(kt + 1, buf ^ 1);  // buf ^ 1 was last read before the previous sync
#pragma unroll 1  // unrolled, ptxas holds the next k's fragments too and spills at 128 registers
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
            __pipeline_wait_prior(0);
            __syncthreads();
            if ((kt + 1) % kChunkTiles == 0 || kt + 1 == k_tiles) {
#pragma unroll
                for (int i = 0; i < 8; i++)
#pragma unroll
                    for (int j = 0; j < 8; j++) totals[(8 * i + j) * kThreads + tid] += acc[i][j], acc[i][j] = 0.0f;
            }
        }

        float *c = static_cast<float *>(p.c) + batch * p.c_batch;
        float *pre = p.pre ? static_cast<float *>(p.pre) + batch * p.c_batch : nullptr;
        const float *bias = static_cast<const float *>(p.bias);
        with_activation(p.activation, [&](auto act) {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const int64_t row = m0 + (i < 4 ? tm * 4 + i : 64 + tm * 4 + i - 4);
#pragma unroll
                for (int j = 0; j < 8; j += 2) {
                    const int64_t col = n0 + (j < 4 ? tn * 4 + j : 64 + tn * 4 + j - 4);
                    store_pair<act.value, float>(p, c, pre, bias, row, col, totals[(8 * i + j) * kThreads + tid],
                                                 totals[(8 * i + j + 1) * kThreads + tid]);
                }
            }
        });
    }
}

template <bool kAKMajor, bool kBKMajor> fk_status launch(const Params &p, int device, cudaStream_t stream) {
    const int64_t tiles = ((p.m + kBM - 1) / kBM) * ((p.n + kBN - 1) / kBN);
    const dim3 grid((unsigned)tiles, (unsigned)std::min<int64_t>(p.batch, 65535));
    constexpr auto kernel = matmul_simt_fp32<kAKMajor, kBKMajor>;
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kTotalsBytes);
    if (e != cudaSuccess) return cuda_status(e, "matmul");
    return Launch(grid, dim3(kThreads), kTotalsBytes, stream, device)("matmul", kernel, p);
}

}  // namespace

// 4 instances: the operand majors.
fk_status launch_simt_fp32(const Plan &, const Params &p, bool a_kmajor, bool b_kmajor, int device,
                           cudaStream_t stream) {
    if (a_kmajor) return b_kmajor ? launch<true, true>(p, device, stream) : launch<true, false>(p, device, stream);
    return b_kmajor ? launch<false, true>(p, device, stream) : launch<false, false>(p, device, stream);
}

}  // namespace fk::mm
