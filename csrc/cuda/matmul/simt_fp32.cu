// matmul_simt_fp32: exact fp32 GEMM on the CUDA cores (torch's default fp32 matmul, TF32 off), any
// shape, major and alignment. dispatch.cu row "fp32, otherwise".
//
// Napkin math: 2 M N K FMAs at the H200's ~67 TFLOP/s fp32 peak (132 SMs x 128 FMA lanes x 1.98 GHz;
// cuBLAS measured 51 at 4096^3): 4096^3 is 137 GFLOP, 2.7 ms at cuBLAS's rate. An SM's shared memory
// returns 32 words a cycle to 128 FMA lanes: a thread's 8 x 8 outputs load 16 words a k for 64 FMAs,
// which keeps shared memory as busy as the FMA pipes; 8 x 16 outputs load 24 for 128 (75%).
//
// Algorithm: a CTA of 256 threads owns a 128 x kBN block of C (kBN 256: 8 x 16 outputs a thread, one
// CTA an SM, for grids that fill the SMs twice; else 128: 8 x 8, 2 CTAs an SM) and walks K in steps
// of 8. Each step's A (128 x 8) and B (8 x kBN) tiles are copied by 4-byte cp.async (zero-filled past
// the edges; inner tiles skip the bounds) straight into k-major rows (As[k][m], Bs[k][n], padded
// against bank conflicts) through a 4-stage ring, one __syncthreads a step. A thread's outputs are
// 4 x 4 blocks 64 rows and 64 columns apart, read as float4s; a step's 8 k are unrolled, the next
// k's fragments loaded while this k's FMAs run. Sums run in two levels (kChunkTiles steps in
// registers, then a running total in shared memory), so a thread holds 64 (kBN 256: 128)
// accumulators, not twice that. The arithmetic, and so every result bit, is the one-CTA 128 x 128
// version's. H200, 4096^3: 39.0 TFLOP/s = 0.76x cuBLAS (was 33.1 = 0.645x; D-121).
#include <cuda_pipeline.h>

#include "matmul.cuh"

namespace fk::mm {
namespace {

constexpr int kBM = 128, kBK = 8, kThreads = 256, kPad = 4;
constexpr int kStages = 4;                     // operand ring: a step's copies have 3 steps to land
constexpr int kLoads = kBM * kBK / kThreads;  // A elements a thread copies a step (4)
constexpr int kChunkTiles = 16;                // k-steps summed before they join the total

// The ring, and the running totals: a thread's 8 x kTN as one column of a [8 kTN][kThreads] array
// (conflict-free, touched once every kChunkTiles k-steps): 64 (128) registers fewer. kBN 128: 97 KB,
// 2 CTAs an SM; 256: 177 KB, one.
template <int kBN> struct Smem {
    static constexpr int kTN = kBN / 16;  // a thread's columns
    float a[kStages][kBK][kBM + kPad];  // As[k][m]: k-major rows, padded against bank conflicts
    float b[kStages][kBK][kBN + kPad];
    float totals[8 * kTN * kThreads];   // total[i][j] of thread t at (kTN i + j) * kThreads + t
};

template <bool kAKMajor, bool kBKMajor, int kBN>
__global__ void __launch_bounds__(kThreads, kBN == 128 ? 2 : 1) matmul_simt_fp32(Params p) {
    constexpr int kTN = kBN / 16, kLoadsB = kBN * kBK / kThreads;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Smem<kBN> &s = *reinterpret_cast<Smem<kBN> *>(smem_raw);
    float *totals = s.totals;
    const int tiles_m = (int)((p.m + kBM - 1) / kBM), tiles_n = (int)((p.n + kBN - 1) / kBN);
    const TileIndex t = grouped_tile(blockIdx.x, tiles_m, tiles_n, 8);
    const int64_t m0 = (int64_t)t.tm * kBM, n0 = (int64_t)t.tn * kBN;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    // Thread (tm, tn) owns rows tm * 4 and 64 + tm * 4, columns tn * 4 + 64 c (c < kTN / 4), 4 each.
    // Warps are 4 x 8 threads, 4 x 2 warps a CTA. Lane bit 0 moves tn, bit 1 moves tm: lanes l and
    // l ^ 1 read the same A float4s, l and l ^ 2 the same B float4s (a pairing that packs LDS.128
    // returns on sm_70; on the H200 within noise of 16 x 2 lanes, D-121).
    const int tm = (warp / 2) * 4 + (lane >> 1 & 1) + (lane >> 4 & 1) * 2;
    const int tn = (warp % 2) * 8 + (lane & 1) + (lane >> 2 & 3) * 2;
    const int k_tiles = (int)((p.k + kBK - 1) / kBK);
    grid_dependency_sync();

    for (int64_t batch = blockIdx.y; batch < p.batch; batch += gridDim.y) {
        const float *a = static_cast<const float *>(p.a) + batch * p.a_batch;
        const float *b = static_cast<const float *>(p.b) + batch * p.b_batch;
        // A thread copies kLoads elements of each step's A tile: 4 consecutive k of one row
        // (K-major: one 16-byte span, immediate offsets) or rows tid % 128 at k, k + 2, ... (M-major:
        // coalesced across threads). Both write banks (4 k + m) % 32 / m % 32: conflict-free. B alike
        // (kBN 256: 8 k of one row, or row tid at every k).
        constexpr int kDkA = kAKMajor ? 1 : kThreads / kBM, kDkB = kBKMajor ? 1 : kThreads / kBN;
        constexpr int kRowA = kBK / kLoads, kRowB = kBK / kLoadsB;  // K-major: threads a row
        const int ma = kAKMajor ? tid / kRowA : tid % kBM, ka = kAKMajor ? (tid % kRowA) * kLoads : tid / kBM;
        const int nb = kBKMajor ? tid / kRowB : tid % kBN, kb = kBKMajor ? (tid % kRowB) * kLoadsB : tid / kBN;
        // The contiguous dim's stride is 1 in every instance (dispatch.cu's a_kmajor / b_kmajor).
        const int64_t a_m = kAKMajor ? p.a_row : 1, a_k = kAKMajor ? 1 : p.a_col;
        const int64_t b_n = kBKMajor ? p.b_col : 1, b_k = kBKMajor ? 1 : p.b_row;
        const int64_t da = kDkA * a_k, db = kDkB * b_k;  // between a thread's elements (K-major: 1)
        const float *ga = a + (m0 + ma) * a_m + ka * a_k, *gb = b + (n0 + nb) * b_n + kb * b_k;
        const bool row_a = ma < p.m - m0, col_b = nb < p.n - n0;
        // Steps before k_full copy whole tiles: no bounds to check.
        const int k_full = m0 + kBM <= p.m && n0 + kBN <= p.n ? (int)(p.k / kBK) : 0;
        // Step kt's tiles -> ring stage `stage`, transposed to k-major rows, by 4-byte asynchronous
        // copies (zeros past the edges): no registers held across the step's FMAs. The global
        // pointers ga, gb advance a step each call (steps are copied in order).
        const int a_off = ka * (kBM + kPad) + ma, b_off = kb * (kBN + kPad) + nb;
        auto copy = [&](int kt, int stage) {
            float *sa = &s.a[stage][0][0] + a_off, *sb = &s.b[stage][0][0] + b_off;
            if (kt < k_full) {
#pragma unroll
                for (int i = 0; i < kLoads; i++) __pipeline_memcpy_async(sa + i * kDkA * (kBM + kPad), ga + i * da, 4);
#pragma unroll
                for (int i = 0; i < kLoadsB; i++) __pipeline_memcpy_async(sb + i * kDkB * (kBN + kPad), gb + i * db, 4);
            } else {
                const int k_left = (int)min(p.k - (int64_t)kt * kBK, (int64_t)kBK);
#pragma unroll
                for (int i = 0; i < kLoads; i++) {
                    const bool in_a = row_a && ka + i * kDkA < k_left;
                    __pipeline_memcpy_async(sa + i * kDkA * (kBM + kPad),
                                            in_a ? ga + i * da : static_cast<const float *>(p.a), 4, in_a ? 0 : 4);
                }
#pragma unroll
                for (int i = 0; i < kLoadsB; i++) {
                    const bool in_b = col_b && kb + i * kDkB < k_left;
                    __pipeline_memcpy_async(sb + i * kDkB * (kBN + kPad),
                                            in_b ? gb + i * db : static_cast<const float *>(p.b), 4, in_b ? 0 : 4);
                }
            }
            ga += kBK * a_k, gb += kBK * b_k;
        };
        // A thread's k-th fragments are 2 + kTN / 4 LDS.128 (a warp reads 4 and 8 distinct, adjacent
        // float4s each: no conflicts).
        auto load_fragments = [&](int stage, int k, float(&fa)[8], float(&fb)[kTN]) {
            *reinterpret_cast<float4 *>(fa) = *reinterpret_cast<const float4 *>(&s.a[stage][k][tm * 4]);
            *reinterpret_cast<float4 *>(fa + 4) = *reinterpret_cast<const float4 *>(&s.a[stage][k][64 + tm * 4]);
#pragma unroll
            for (int c = 0; c < kTN / 4; c++)
                *reinterpret_cast<float4 *>(fb + 4 * c) = *reinterpret_cast<const float4 *>(&s.b[stage][k][64 * c + tn * 4]);
        };

        // Two-level sums: acc takes kChunkTiles k-steps, then folds into total, so a long K adds
        // ~K / 128 + 128 roundings an output instead of K (grad of (7, 4096) @ (4096, 16): 3.7x ->
        // within 2x of cuBLAS's split-K error).
        float acc[8][kTN] = {};
        float fa[2][8], fb[2][kTN];  // fragments of k and k + 1: the next k's loads overlap this k's FMAs
#pragma unroll
        for (int i = 0; i < 8 * kTN; i++) totals[i * kThreads + tid] = 0.0f;
        __syncthreads();  // the previous batch's last fragment loads are done before the ring refills
#pragma unroll
        for (int st = 0; st < kStages - 1; st++) {
            if (st < k_tiles) copy(st, st);
            cp_async_commit();
        }
        for (int kt = 0; kt < k_tiles; kt++) {
            const int stage = kt % kStages;
            cp_async_wait<kStages - 2>();  // step kt's copies have landed (this thread's: wait; everyone's: sync),
            __syncthreads();               // and every thread has left the stage the next copy refills
            if (kt + kStages - 1 < k_tiles) copy(kt + kStages - 1, (kt + kStages - 1) % kStages);
            cp_async_commit();
            load_fragments(stage, 0, fa[0], fb[0]);
#pragma unroll
            for (int k = 0; k < kBK; k++) {
                if (k + 1 < kBK) load_fragments(stage, k + 1, fa[(k + 1) % 2], fb[(k + 1) % 2]);
#pragma unroll
                for (int i = 0; i < 8; i++)
#pragma unroll
                    for (int j = 0; j < kTN; j++) acc[i][j] = fmaf(fa[k % 2][i], fb[k % 2][j], acc[i][j]);
            }
            if ((kt + 1) % kChunkTiles == 0 || kt + 1 == k_tiles) {
#pragma unroll
                for (int i = 0; i < 8; i++)
#pragma unroll
                    for (int j = 0; j < kTN; j++) totals[(kTN * i + j) * kThreads + tid] += acc[i][j], acc[i][j] = 0.0f;
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
                for (int j = 0; j < kTN; j += 2) {
                    const int64_t col = n0 + 64 * (j / 4) + tn * 4 + j % 4;
                    store_pair<act.value, float>(p, c, pre, bias, row, col, totals[(kTN * i + j) * kThreads + tid],
                                                 totals[(kTN * i + j + 1) * kThreads + tid]);
                }
            }
        });
    }
}

template <bool kAKMajor, bool kBKMajor, int kBN> fk_status launch(const Params &p, int device, cudaStream_t stream) {
    const int64_t tiles = ((p.m + kBM - 1) / kBM) * ((p.n + kBN - 1) / kBN);
    const dim3 grid((unsigned)tiles, (unsigned)std::min<int64_t>(p.batch, 65535));
    constexpr auto kernel = matmul_simt_fp32<kAKMajor, kBKMajor, kBN>;
    constexpr int kSmemBytes = (int)sizeof(Smem<kBN>);
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
    if (e != cudaSuccess) return cuda_status(e, "matmul");
    return Launch(grid, dim3(kThreads), kSmemBytes, stream, device)("matmul", kernel, p);
}

template <int kBN> fk_status launch_majors(const Params &p, bool a_kmajor, bool b_kmajor, int device, cudaStream_t stream) {
    if (a_kmajor) return b_kmajor ? launch<true, true, kBN>(p, device, stream) : launch<true, false, kBN>(p, device, stream);
    return b_kmajor ? launch<false, true, kBN>(p, device, stream) : launch<false, false, kBN>(p, device, stream);
}

}  // namespace

// 8 instances: the operand majors x the tile width.
fk_status launch_simt_fp32(const Plan &, const Params &p, bool a_kmajor, bool b_kmajor, int device,
                           cudaStream_t stream) {
    // 128 x 256 tiles (one CTA an SM) once they fill every SM twice; smaller grids keep 128 x 128
    // tiles at 2 CTAs an SM (D-121: H200 (8192,768,3072), 192 wide tiles: 0.59x wide, 0.75x narrow).
    // The wide tiles' 177 KB fit Hopper's shared memory, not sm_80's 164 KB or sm_86's 100 KB.
    const bool wide = ((p.m + kBM - 1) / kBM) * ((p.n + 255) / 256) * p.batch >= 2 * sm_count(device) &&
                      (int)sizeof(Smem<256>) + smem_reserved_per_cta(device) <= smem_per_sm(device);
    return wide ? launch_majors<256>(p, a_kmajor, b_kmajor, device, stream)
                : launch_majors<128>(p, a_kmajor, b_kmajor, device, stream);
}

}  // namespace fk::mm
