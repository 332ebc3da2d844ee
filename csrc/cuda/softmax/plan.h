// Softmax's host-side contract: the Plan that dispatch.cu builds (plain data, no kernels) and the
// launch_<strategy>(plan, args) each strategy file exports. Also the sizes that both the plan and
// the kernels need (a constant lives here when the plan sizes launches by it).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "../../fastkern.h"

namespace fk::softmax {

// ---- sizes shared by the plan and the kernels ----------------------------------------------------
constexpr int kWarpMaxN = 1024;     // longest frame rows_warp holds: 32 lanes x 32 elements (D-06)
constexpr int kWarpBlock = 128;     // threads a rows_warp CTA
constexpr int kBlockThreads = 512;  // most threads a rows_block CTA, 2 an SM (D-16)
constexpr int kCtaChunks = 2;       // chunks a rows_block CTA loops over before rows take a cluster (D-16)
constexpr int kMaxCluster = 16;     // with the non-portable cluster size allowed
// rows_block: elements a thread a chunk, 64 bytes forward, 32 of each of x and dy backward (the
// scalar path keeps 8 of each).
__host__ __device__ constexpr int block_elems(int bytes, int vec, bool backward) {
    return vec == 1 ? 8 : (backward ? 32 : 64) / bytes;
}
constexpr int kPackThreads = 512;   // most threads a rows_packs CTA (D-23)
constexpr int kPackElems = 8;       // elements of x and dy a rows_packs thread, x2 / x4 for long rows (D-23, D-24)
constexpr int64_t kPackRowMax = 2 * kPackElems * kPackThreads;  // 8192
constexpr int64_t kSmemWarpRowMax = 8 * 1024;   // bytes a row: a warp a row up to here (D-29)
constexpr int64_t kSmemCtaMax = 32 * 1024;      // bytes a rows_smem_cta CTA, six an SM (D-30)
constexpr int64_t kSmemCtaBigMax = 112 * 1024;  // where 16 x kSmemCtaMax cannot hold a row (D-40)
constexpr int64_t kSmemCtaHugeMax = 224 * 1024; // unmasked forwards past 16 x kSmemCtaBigMax, one an SM (D-41)
constexpr int kSmemFwdThreads = 256, kSmemBwdThreads = 128;  // (D-36)
constexpr int kMaskedWarpPacks = 80;  // masked rows_smem forwards: a warp per 80 packs, 2.5 a lane (D-38)
constexpr int kWarpRows = 4;          // rows (warps) a rows_smem_warp CTA (D-29)
constexpr int kDyRegPacks = 16;       // rows_smem_dyreg: packs of dy a thread (D-42)
constexpr int kDyRegThreads = 256, kDyRegWideThreads = 512;  // x slices of up to 64 / 128 KB (D-42)
__host__ __device__ constexpr int64_t kDyRegSliceMax(int lanes) { return (int64_t)lanes * kDyRegPacks * 16; }
constexpr int kTileRows = 8;          // cols_tile: accesses of x (and dy) a thread (D-51)
constexpr int kTileRowBytes = 64;     // the fewest bytes of a row a cols_tile CTA spans (D-53)
constexpr int kTileFwdThreads = 1024, kTileBwdThreads = 512;  // bounds; launches take half (D-52)
constexpr int kTileShortMax = 64, kTileShortRows = 4, kTileShortThreads = 256;  // fp32 short bwd columns (D-55)
constexpr int kTileFwdShortMax = 512;  // fp32 forward columns: 4 accesses up to here, else 16 (D-54)
constexpr int kColsX = 32;             // cols_loop: threads a CTA along inner (coalesced loads)
constexpr int kColsUnroll = 4;         // cols_loop: loads in flight a thread
constexpr int kFastDramPerSm = 30000;  // DRAM bytes / us / SM past which a card is fast: H200, not H100 (D-25)

// ---- the plan --------------------------------------------------------------------------------------
enum class Strategy { kRowsWarp, kRowsBlock, kRowsPacks, kRowsSmemWarp, kRowsSmemCta, kRowsSmemDyReg,
                      kColsTile, kColsTileChunked, kColsLoop };

inline const char *strategy_name(Strategy s) {
    switch (s) {
    case Strategy::kRowsWarp: return "rows_warp";
    case Strategy::kRowsBlock: return "rows_block";
    case Strategy::kRowsPacks: return "rows_packs";
    case Strategy::kRowsSmemWarp: return "rows_smem_warp";
    case Strategy::kRowsSmemCta: return "rows_smem_cta";
    case Strategy::kRowsSmemDyReg: return "rows_smem_dyreg";
    case Strategy::kColsTile: return "cols_tile";
    case Strategy::kColsTileChunked: return "cols_tile_chunked";
    case Strategy::kColsLoop: return "cols_loop";
    }
    return "?";
}

struct Plan {
    Strategy strategy = Strategy::kRowsWarp;
    // the kernel instance (its template parameters)
    fk_dtype dtype = FK_FLOAT32;
    bool backward = false, log = false;
    bool masked = false;  // the masked instance: causal rows, or ragged rows (rows_block, rows_smem_*)
    bool ragged = false;  // the unmasked ragged instance (rows_warp, rows_packs)
    int vec = 1;          // elements an access: a 16-byte pack, or 1 (the scalar path)
    int elems = 0;        // rows_warp: a lane's; rows_block / rows_packs: a thread's; cols_tile: accesses a thread
    int lanes = 0;        // rows_warp: compile-time lanes a row (0: run time); else the kernel's thread bound
    int min_ctas = 1;     // cols_tile backward: CTAs an SM the kernel is compiled for
    // the launch
    int64_t grid = 0;
    int block_x = 0, block_y = 1, cluster = 1;
    size_t smem = 0;
    int group = 0;        // rows_warp: lanes a row
    int64_t seg = 0;      // rows_block / rows_smem_*: elements of a row's frame a CTA takes
    int64_t mask_sq = 0;  // causal_sq as the kernels take it (1: ragged rows, every key in)
    int64_t rows = 0, n = 0, inner = 1;
};

struct FwdArgs {
    const void *x;
    void *y;
    float *row_max;
    float scale;
    cudaStream_t stream;
    int device;
    const char *op;
};
struct BwdArgs {
    const void *dy, *x;
    const float *row_max;
    void *dx;
    float scale;
    cudaStream_t stream;
    int device;
    const char *op;
};

// ---- instance tables -------------------------------------------------------------------------------
// Each strategy file ends with its instance list: one line per kernel instance, keyed by the plan
// fields that pick it. A plan whose key is missing is a bug in plan_softmax (an error, never a
// silent fallback).
struct Instance {
    uint64_t key;
    const void *kernel;
};
__host__ __device__ constexpr uint64_t instance_key(fk_dtype dtype, int vec, int elems, int lanes, bool masked, bool log,
                                bool ragged, int extra = 0) {
    return (uint64_t)dtype | (uint64_t)vec << 4 | (uint64_t)elems << 12 | (uint64_t)lanes << 20 |
           (uint64_t)masked << 32 | (uint64_t)log << 33 | (uint64_t)ragged << 34 | (uint64_t)extra << 40;
}
template <size_t N> const void *find_instance(const Instance (&table)[N], uint64_t key) {
    for (const Instance &i : table)
        if (i.key == key) return i.kernel;
    return nullptr;
}

// The instance a plan names (nullptr: not instantiated), one function per strategy file.
const void *rows_warp_fwd_kernel(const Plan &p);
const void *rows_warp_bwd_kernel(const Plan &p);
const void *rows_block_kernel(const Plan &p);
const void *rows_packs_kernel(const Plan &p);
const void *rows_smem_kernel(const Plan &p);
const void *cols_tile_kernel(const Plan &p);

fk_status launch_rows_warp(const Plan &p, const FwdArgs &a);
fk_status launch_rows_warp(const Plan &p, const BwdArgs &a);
fk_status launch_rows_block(const Plan &p, const FwdArgs &a);
fk_status launch_rows_block(const Plan &p, const BwdArgs &a);
fk_status launch_rows_packs(const Plan &p, const BwdArgs &a);
fk_status launch_rows_smem(const Plan &p, const FwdArgs &a);
fk_status launch_rows_smem(const Plan &p, const BwdArgs &a);
fk_status launch_cols_tile(const Plan &p, const FwdArgs &a);
fk_status launch_cols_tile(const Plan &p, const BwdArgs &a);
fk_status launch_cols_loop(const Plan &p, const FwdArgs &a);
fk_status launch_cols_loop(const Plan &p, const BwdArgs &a);

// ---- device queries (host.cu), cached per kernel and device ----------------------------------------
// The largest cluster (16, else 8) `kernel` can be resident with at `threads` threads and `smem`
// bytes of dynamic shared memory: 1 where clusters do not exist, 0 where the kernel may not have
// that much shared memory. Cached per kernel, device and size class (0, kSmemCtaMax,
// kSmemCtaBigMax, larger); the kernel's allowance only grows.
int cluster_limit(const void *kernel, int device, int threads, int smem);
// CTAs of `kernel` an SM holds without the one-wave cap (below), once the kernel may take the
// cap's shared memory; -1 where that cannot be had.
int warp_occupancy(const void *kernel, int threads, int device);
// The dynamic shared memory that caps a one-wave grid of `ctas` CTAs at ceil(ctas / SMs) an SM
// (and sets the carveout hint it needs), or 0.
size_t one_wave_smem(const void *kernel, int threads, int64_t ctas, int device);

// A plan that names no listed instance: a bug in plan_softmax, reported, never launched.
inline fk_status no_instance(const Plan &p, const char *op) {
    return fk_fail(FK_ERR_RUNTIME, "%s: no kernel instance for this plan (strategy %s, dtype %d, vec %d, elems %d, "
                   "lanes %d): a fastkern bug, please report it", op, strategy_name(p.strategy), (int)p.dtype, p.vec,
                   p.elems, p.lanes);
}

// Rows a rows_warp lane group takes (elements of `bytes` bytes, C a lane and tensor, `tensors` of
// them): enough that each lane has >= 64 bytes of loads in flight.
__host__ __device__ constexpr int warp_rows(int bytes, int C, int tensors) {
    const int rows = 64 / (tensors * C * bytes);
    return rows < 1 ? 1 : (rows > 4 ? 4 : rows);
}

inline int64_t pow2_ceil(int64_t v) {
    int64_t p = 1;
    while (p < v) p *= 2;
    return p;
}

}  // namespace fk::softmax
