// matmul_simt_fp32: exact fp32 GEMM on the CUDA cores (torch's default fp32 matmul, TF32 off), any
// shape, major and alignment. dispatch.cu row "fp32, otherwise".
//
// Napkin math: 2 M N K FMAs at the H200's ~67 TFLOP/s fp32 peak (132 SMs x 128 FMA lanes x 1.98 GHz;
// cuBLAS measured 51 at 4096^3): 4096^3 is 137 GFLOP, 2.7 ms at cuBLAS's rate. An SM's shared memory
// returns 32 words a cycle to 128 FMA lanes: a thread's 8 x 8 outputs load 16 words a k for 64 FMAs,
// which keeps shared memory as busy as the FMA pipes; 8 x 16 outputs load 24 for 128 (75%). The same
// pipe takes the global -> shared copies, per 32-byte sector a warp's copy touches: 128 x 256 tiles
// take ~380 LDS.128 wavefronts an 8-k step, and the copies took 512 more for a K-major A, 2048 for a
// K-major B (a lane a row); now 128 and 256 (8 lanes a row): the 4096^3 FFMAs need 2048 cycles a step.
//
// Algorithm: a CTA of 256 threads owns a 128 x kBN block of C (kBN 256: 8 x 16 outputs a thread, one
// CTA an SM, for grids that fill the SMs twice; else 128: 8 x 8, 2 CTAs an SM) and walks K in steps
// of 8. Each step's A (128 x 8) and B (8 x kBN) tiles are copied by cp.async (TileCopy: 16 bytes where
// rows are contiguous and aligned, else 4, transposed for K-major operands; zero-filled past the
// edges; inner tiles skip the bounds) into k-major rows (As[k][m], Bs[k][n], padded against bank
// conflicts) through a 4-stage ring, one __syncthreads a step. A thread's outputs are 4 x 4 blocks 64
// rows and 64 columns apart, read as float4s; a step's 8 k are unrolled, the next k's fragments
// loaded while this k's FMAs run. Sums run in two levels (kChunkTiles steps in registers, then a
// running total of float4s in shared memory), so a thread holds 64 (kBN 256: 128) accumulators, not
// twice that; every result bit is the one-CTA 128 x 128 version's. H200, same process x cuBLAS
// (D-141): 4096^3 39.0 -> 42.8 TFLOP/s (0.762 -> 0.837x), linear (w K-major) 0.450 -> 0.718x.
#include <cuda_pipeline.h>

#include "matmul.cuh"

namespace fk::mm {
namespace {

constexpr int kBM = 128, kBK = 8, kThreads = 256, kPad = 4;
constexpr int kStages = 4;       // operand ring: a step's copies have 3 steps to land
constexpr int kChunkTiles = 16;  // k-steps summed before they join the total

// The ring, and the running totals: a thread's 8 x kTN as float4s, one column of a [2 kTN][kThreads]
// array (conflict-free, touched once every kChunkTiles k-steps): 64 (128) registers fewer. kBN 128:
// 97 KB, 2 CTAs an SM; 256: 177 KB, one.
template <int kBN> struct Smem {
    static constexpr int kTN = kBN / 16;  // a thread's columns
    float a[kStages][kBK][kBM + kPad];  // As[k][m]: k-major rows, padded against bank conflicts
    float b[kStages][kBK][kBN + kPad];
    float4 totals[2 * kTN * kThreads];  // total[i][4 c .. 4 c + 3] of thread t at (kTN / 4 i + c) * kThreads + t
};

// One operand's share of a k-step's tile (kRows rows (M for A, N for B) x kBK k), copied into k-major
// rows tile[k][row] by asynchronous copies, zeros past the edges. Copies go through the pipe that
// also serves the fragments' LDS, which counts a warp's copy once per 32-byte sector it touches:
// - K-major operands: 4-byte copies (transposed), 8 lanes on the 8 k of a row (one sector), 4 rows a
//   warp: 4 sectors a copy (a lane a row had 16 to 32, and the pipe was the limit: D-141). Writes hit
//   banks (4 k + row) % 32: all distinct.
// - Otherwise rows are contiguous: a thread copies 4 adjacent rows at k, k + kDk, ..., one 16-byte
//   copy each where the operand is 16-byte aligned (whole tiles), else 4 of 4 bytes.
template <bool kKMajor, int kRows> struct TileCopy {
    static constexpr int kPer = kRows * kBK / kThreads;      // elements a thread copies a step
    static constexpr int kAcross = kKMajor ? kBK : kRows / 4;  // threads along the contiguous dim
    static constexpr int kDown = kThreads / kAcross;           // rows (K-major) or k a pass covers
    static constexpr int kLd = kRows + kPad;
    const float *g;  // the thread's first element of the next step
    int64_t ld;      // K-major: between rows; else between k
    int row, k;      // the thread's first row and k in the tile
    bool vec;        // 16-byte copies for whole tiles

    __device__ TileCopy(const float *base, int64_t r0, int64_t ld_row, int64_t ld_k, int tid) {
        row = kKMajor ? tid / kAcross : (tid % kAcross) * 4;
        k = kKMajor ? tid % kAcross : tid / kAcross;
        g = base + (r0 + row) * ld_row + k * ld_k;
        ld = kKMajor ? ld_row : ld_k;
        vec = !kKMajor && reinterpret_cast<uintptr_t>(base) % 16 == 0 && ld_k % 4 == 0;
    }
    // Element i of the thread's share: its row and k in the tile, its offset in memory.
    __device__ __forceinline__ int row_of(int i) const { return kKMajor ? row + i * kDown : row + i % 4; }
    __device__ __forceinline__ int k_of(int i) const { return kKMajor ? k : k + i / 4 * kDown; }
    __device__ __forceinline__ int64_t offset(int i) const {
        return kKMajor ? i * kDown * ld : i / 4 * kDown * ld + i % 4;
    }
    // The next step into `tile` (its stage); rows_left / k_left bound it unless `whole` (then the
    // copies are unchecked: a separate branch, so that whole tiles pay no bounds arithmetic).
    __device__ __forceinline__ void next(float *tile, bool whole, int rows_left, int k_left, const float *any) {
        float *dst = tile + k * kLd + row;
        auto at = [&](int i) { return dst + (k_of(i) - k) * kLd + row_of(i) - row; };
        if (whole && !kKMajor && vec) {
#pragma unroll
            for (int i = 0; i < kPer; i += 4) cp_async_16(at(i), g + offset(i), 16);
        } else if (whole) {
#pragma unroll
            for (int i = 0; i < kPer; i++) __pipeline_memcpy_async(at(i), g + offset(i), 4);
        } else {
#pragma unroll
            for (int i = 0; i < kPer; i++) {
                const bool in = row_of(i) < rows_left && k_of(i) < k_left;
                __pipeline_memcpy_async(at(i), in ? g + offset(i) : any, 4, in ? 0 : 4);
            }
        }
        g += kKMajor ? kBK : kBK * ld;
    }
};

template <bool kAKMajor, bool kBKMajor, int kBN>
__global__ void __launch_bounds__(kThreads, kBN == 128 ? 2 : 1) matmul_simt_fp32(Params p) {
    constexpr int kTN = Smem<kBN>::kTN;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Smem<kBN> &s = *reinterpret_cast<Smem<kBN> *>(smem_raw);
    float4 *totals = s.totals;
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
    const int rows_a = (int)min(p.m - m0, (int64_t)kBM), cols_b = (int)min(p.n - n0, (int64_t)kBN);
    grid_dependency_sync();

    for (int64_t batch = blockIdx.y; batch < p.batch; batch += gridDim.y) {
        const float *a = static_cast<const float *>(p.a) + batch * p.a_batch;
        const float *b = static_cast<const float *>(p.b) + batch * p.b_batch;
        // The contiguous dim's stride is 1 in every instance (dispatch.cu's a_kmajor / b_kmajor).
        TileCopy<kAKMajor, kBM> copy_a(a, m0, kAKMajor ? p.a_row : 1, kAKMajor ? 1 : p.a_col, tid);
        TileCopy<kBKMajor, kBN> copy_b(b, n0, kBKMajor ? p.b_col : 1, kBKMajor ? 1 : p.b_row, tid);
        // Steps before k_full copy whole tiles: no bounds to check.
        const int k_full = rows_a == kBM && cols_b == kBN ? (int)(p.k / kBK) : 0;
        // Step kt's tiles -> ring stage `stage` (steps are copied in order): no registers held across
        // the step's FMAs.
        auto copy = [&](int kt, int stage) {
            const int k_left = (int)min(p.k - (int64_t)kt * kBK, (int64_t)kBK);
            copy_a.next(&s.a[stage][0][0], kt < k_full, rows_a, k_left, static_cast<const float *>(p.a));
            copy_b.next(&s.b[stage][0][0], kt < k_full, cols_b, k_left, static_cast<const float *>(p.b));
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

        // Two-level sums: acc takes kChunkTiles k-steps, then folds into total, so a long K adds ~K / 128 + 128
        // roundings an output instead of K (grad of (7, 4096) @ (4096, 16): 3.7x -> within 2x of
        // cuBLAS's split-K error).
        float acc[8][kTN] = {};
        float fa[2][8], fb[2][kTN];  // fragments of k and k + 1: the next k's loads overlap this k's FMAs
#pragma unroll
        for (int q = 0; q < 2 * kTN; q++) totals[q * kThreads + tid] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
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
                    for (int c = 0; c < kTN / 4; c++) {
                        float4 &total = totals[(kTN / 4 * i + c) * kThreads + tid];
                        float4 v = total;
                        v.x += acc[i][4 * c], v.y += acc[i][4 * c + 1], v.z += acc[i][4 * c + 2], v.w += acc[i][4 * c + 3];
                        total = v;
#pragma unroll
                        for (int j = 4 * c; j < 4 * c + 4; j++) acc[i][j] = 0.0f;
                    }
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
                for (int q = 0; q < kTN / 4; q++) {
                    const int64_t col = n0 + 64 * q + tn * 4;
                    const float4 v = totals[(kTN / 4 * i + q) * kThreads + tid];
                    store_pair<act.value, float>(p, c, pre, bias, row, col, v.x, v.y);
                    store_pair<act.value, float>(p, c, pre, bias, row, col + 2, v.z, v.w);
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
