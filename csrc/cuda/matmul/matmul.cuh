// Shared by the matmul strategies: the kernel parameters, the tensor-core PTX wrappers (cp.async,
// ldmatrix, mma.sync), the swizzled shared-memory tile, and the epilogue (bias, pre-activation
// store, GELU, store). See dispatch.cu for which strategy runs where.
#pragma once

#include "../common.cuh"
#include "../gelu_math.cuh"

namespace fk::mm {

// fk_matmul_args as the kernels take it (by value): C[b] = act(A[b] @ B[b] + bias).
struct Params {
    const void *a, *b, *bias;
    void *c, *pre;
    int64_t batch, m, n, k;
    int64_t a_batch, a_row, a_col;
    int64_t b_batch, b_row, b_col;
    int64_t c_batch, c_row;
    int activation;
    bool pair_stores;  // c (and pre) take 4-byte (16-bit) / 8-byte (fp32) stores of column pairs
    bool tma_store;    // wgmma_sm90: c (and pre) stored by TMA from shared memory
};

// ---- PTX wrappers (sm_80+) ----------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, the bytes past `src_bytes` (0..16) zero-filled; src must be 16-byte
// aligned even when src_bytes is 0 (then nothing is read).
__device__ __forceinline__ void cp_async_16(void *dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 matrices of 16-bit elements; lane l gives the address of row (l & 7) of matrix l >> 3.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
// The same, each matrix transposed on the way to the registers.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// d += a (16x16, row) * b (16x8, col), fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                     "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
                     "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
}

// ---- a tile of kRows x kCols 16-bit elements in shared memory, kCols contiguous ------------------
// 16-byte chunks are XOR-swizzled by row (chunk ^ (row & 7)), so the 8 row addresses of an
// ldmatrix (8 consecutive rows, one chunk) and of its transposed form fall in 8 different bank
// groups. kCols >= 64 (8 chunks a row).
template <int kRows, int kCols> struct SwizzledTile {
    static_assert(kCols >= 64 && kCols % 64 == 0, "a swizzled row holds at least 8 chunks");
    static constexpr int kElems = kRows * kCols;
    __device__ static __forceinline__ int offset(int row, int col) {
        return row * kCols + ((((col >> 3) ^ row) & 7) | ((col >> 3) & ~7)) * 8 + (col & 7);
    }
};

// Loads the kRows x kCols tile whose element (r, c) is g[r * stride + c] into `smem`, elements with
// r >= rows or c >= cols as zeros. kAsync: 16-byte cp.async (g 16-byte aligned, stride a multiple
// of 8 elements); else element loads through registers (any alignment).
template <typename T, int kRows, int kCols, int kThreads, bool kAsync>
__device__ __forceinline__ void load_tile(T *smem, const T *g, int64_t stride, int rows, int cols) {
    using Tile = SwizzledTile<kRows, kCols>;
    constexpr int kChunksPerRow = kCols / 8, kChunks = kRows * kChunksPerRow;
    static_assert(kChunks % kThreads == 0, "every thread loads the same number of chunks");
#pragma unroll
    for (int i = 0; i < kChunks / kThreads; i++) {
        const int idx = i * kThreads + threadIdx.x;
        const int r = idx / kChunksPerRow, c = (idx % kChunksPerRow) * 8;
        const bool in = r < rows && c < cols;
        T *dst = smem + Tile::offset(r, c);
        const T *src = g + (in ? r * stride + c : 0);
        if constexpr (kAsync) {
            cp_async_16(dst, src, in ? 2 * min(8, cols - c) : 0);
        } else {
            Pack<T> v;
#pragma unroll
            for (int e = 0; e < 8; e++) v.v[e] = in && c + e < cols ? src[e] : from_f32<T>(0.0f);
            store_pack(dst, v);
        }
    }
}

// ---- epilogue -----------------------------------------------------------------------------------

// act(v) for the FK_ACT_* code kAct; 16-bit outputs take GELU's fast form, fp32 the accurate one.
template <int kAct, typename T> __device__ __forceinline__ float activate(float v) {
    constexpr bool kFast = !std::is_same_v<T, float>;
    if constexpr (kAct == FK_ACT_GELU) return gelu<0, kFast>(v);
    if constexpr (kAct == FK_ACT_GELU_TANH) return gelu<1, kFast>(v);
    return v;
}

// Runs f(std::integral_constant<int, FK_ACT_*>) for the run-time code: an epilogue is compiled once
// per activation as straight-line code. A per-element switch made the Hopper kernel's epilogue
// ~3700 instructions of branches that stalled on instruction fetch even with no activation (D-112).
template <typename F> __device__ __forceinline__ void with_activation(int activation, F &&f) {
    if (activation == FK_ACT_GELU) {
        f(std::integral_constant<int, FK_ACT_GELU>{});
    } else if (activation == FK_ACT_GELU_TANH) {
        f(std::integral_constant<int, FK_ACT_GELU_TANH>{});
    } else {
        f(std::integral_constant<int, FK_ACT_NONE>{});
    }
}

// Writes the accumulators v0, v1 of row `row`, columns col and col + 1 (col + 1 may lie past n):
// bias added, pre-activation stored when asked, activation kAct applied, stored in T.
template <int kAct, typename T>
__device__ __forceinline__ void store_pair(const Params &p, T *c, T *pre, const T *bias, int64_t row,
                                           int64_t col, float v0, float v1) {
    if (row >= p.m || col >= p.n) return;
    const bool two = col + 1 < p.n;
    if (bias) {
        v0 += to_f32(bias[col]);
        if (two) v1 += to_f32(bias[col + 1]);
    }
    const int64_t at = row * p.c_row + col;
    if (pre) {
        if (two && p.pair_stores) {
            if constexpr (std::is_same_v<T, float>) {
                *reinterpret_cast<float2 *>(pre + at) = make_float2(v0, v1);
            } else {
                T pair[2] = {from_f32<T>(v0), from_f32<T>(v1)};
                *reinterpret_cast<uint32_t *>(pre + at) = *reinterpret_cast<uint32_t *>(pair);
            }
        } else {
            pre[at] = from_f32<T>(v0);
            if (two) pre[at + 1] = from_f32<T>(v1);
        }
    }
    v0 = activate<kAct, T>(v0);
    v1 = activate<kAct, T>(v1);
    if (two && p.pair_stores) {
        if constexpr (std::is_same_v<T, float>) {
            *reinterpret_cast<float2 *>(c + at) = make_float2(v0, v1);
        } else {
            T pair[2] = {from_f32<T>(v0), from_f32<T>(v1)};
            *reinterpret_cast<uint32_t *>(c + at) = *reinterpret_cast<uint32_t *>(pair);
        }
    } else {
        c[at] = from_f32<T>(v0);
        if (two) c[at + 1] = from_f32<T>(v1);
    }
}

// Output tile (tm, tn) of CTA `pid` in a grid of tiles_m x tiles_n: tiles taken in groups of
// kGroupM rows of tiles, column by column, so CTAs running together share A and B panels in L2.
struct TileIndex { int tm, tn; };
__device__ __forceinline__ TileIndex grouped_tile(int pid, int tiles_m, int tiles_n, int group_m) {
    const int per_group = group_m * tiles_n;
    const int first_m = (pid / per_group) * group_m;
    const int size = min(tiles_m - first_m, group_m);
    const int in_group = pid % per_group;
    return {first_m + in_group % size, in_group / size};
}

}  // namespace fk::mm

// ---- host side: strategies and their launchers --------------------------------------------------
namespace fk::mm {

enum class Strategy { kNone, kMmaSm80, kSimtFp32, kWgmmaSm90 };
const char *strategy_name(Strategy s);

// What dispatch.cu decided: the strategy, its tile variant, whether the operands take the 16-byte
// asynchronous loads, and wgmma_sm90's K split.
struct Plan {
    Strategy strategy = Strategy::kNone;
    int tile = 0;     // the strategy's tile variant (its launcher's table; wgmma_sm90: 2 is 128 x 256)
    bool aligned = false;
    int split_k = 1;  // wgmma_sm90: 2 splits each tile's K over a 2-CTA cluster (tile 1: 128 x 64)
    bool share_b = false;  // wgmma_sm90: tiles 2i and 2i + 1 in a 2-CTA cluster, B's k-tiles multicast
};

fk_status launch_mma_sm80(const Plan &plan, const Params &p, fk_dtype dtype, bool a_kmajor,
                          bool b_kmajor, int device, cudaStream_t stream);
fk_status launch_wgmma_sm90(const Plan &plan, const Params &p, fk_dtype dtype, bool a_kmajor,
                            bool b_kmajor, int device, cudaStream_t stream);
// wgmma_sm90's small-problem instances (plan.split_k 2 or plan.share_b), from launch_wgmma_sm90
fk_status launch_wgmma_sm90_small(const Plan &plan, const Params &p, fk_dtype dtype, bool a_kmajor,
                                  bool b_kmajor, int device, cudaStream_t stream);
fk_status launch_simt_fp32(const Plan &plan, const Params &p, bool a_kmajor, bool b_kmajor,
                           int device, cudaStream_t stream);

}  // namespace fk::mm
