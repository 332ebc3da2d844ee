// Softmax / log-softmax on the GPU: which strategy runs for which call. First matching row wins.
//
// frame: n, or for ragged rows (16-byte accesses, n not a multiple of a pack) n + pack - 1 (D-46).
// vec: 16-byte accesses when every tensor is 16-byte aligned and n % pack == 0, or n > 1024, or the
//      frame <= 1024 and not causal and not (fp32 backward, n > 64) (D-50); else scalar (vec 1).
//
// layout  dir  dtype   n / frame                       needs                      strategy          why
// inner>1 any  any     columns a 16-CTA cluster holds  -                          cols_tile         D-51
// inner>1 any  any     longer: 16-byte columns, or     -                          cols_tile_chunked D-56
//                      1 a thread on grids < SMs
// inner>1 any  any     otherwise                       -                          cols_loop         fallback
// rows    any  any     frame <= 1024                   -                          rows_warp         D-06
// rows    bwd  any     frame <= 8192 (16-bit unmasked  vec 16 B, not causal and   rows_packs        D-23, D-24
//                      packed rows: <= 16384)          ragged
// rows    fwd  fp32    frame <= 8192                   -                          rows_block        D-19
// rows    fwd  16-bit  n <= 4096 (8 KB)                sm_90, vec 16 B            rows_smem_warp    D-29
// rows    any  any     slices fit 32 KB CTAs in a      sm_90, vec 16 B            rows_smem_cta     D-30, D-40,
//                      cluster, else 112 KB (forward                                                D-41
//                      unmasked: 224 KB)
// rows    bwd  any     x slices fit 64 KB / 128 KB     sm_90, vec 16 B            rows_smem_dyreg   D-42
// rows    any  any     otherwise                       -                          rows_block        D-16
//
// Card row (fk::dram_bytes_per_us_per_sm: H100 ~25 000, H200 ~37 000):
// rows    bwd  16-bit  2049-4096 in rows_packs         DRAM > 30 000              16 elements a thread  D-25

#include <algorithm>
#include <cstdio>
#include <type_traits>

#include "../common.cuh"
#include "plan.h"

namespace fk::softmax {
namespace {

struct Problem {
    const char *op;
    bool backward, log;
    fk_dtype dtype;
    int64_t outer, n, inner, causal_sq;
    bool aligned;  // every tensor 16-byte aligned
    int device;
};

int dtype_bytes(fk_dtype d) { return d == FK_FLOAT32 ? 4 : 2; }

// The longest ragged fp32 backward row that takes 16-byte accesses in rows_warp (D-50).
constexpr int64_t kRaggedFp32BwdMax = 64;

// ---- one function per table row group --------------------------------------------------------------

// rows_warp: the fewest lanes that hold the frame at kBytes a lane (compile-time counts 4-32; rows
// just past a power of two take half the lanes with 3/2 the elements), 128-thread CTAs.
fk_status plan_rows_warp(const Problem &q, Plan &p, int64_t frame) {
    const int bytes = dtype_bytes(q.dtype), kBytes = q.backward ? 32 : 64;
    const int c0 = p.vec == 1 ? 1 : kBytes / bytes;
    int c = c0;
    while (c < 32 && 32 * c < frame) c *= 2;
    int group = (int)pow2_ceil((frame + c - 1) / c), lanes;
    if (c == 1) {
        lanes = 0;
    } else if (p.vec == 1 || c > c0) {
        lanes = 32;
    } else {
        const int c3 = c % (2 * p.vec) == 0 ? 3 * c / 2 : c;
        if (c3 != c && group >= 16 && frame <= group / 2 * c3) {
            c = c3;
            lanes = group == 32 ? 16 : 8;
        } else {
            lanes = group == 32 || group == 16 || group == 8 || group == 4 ? group : 0;
        }
        if (lanes) group = lanes;
    }
    p.strategy = Strategy::kRowsWarp;
    p.elems = c;
    p.lanes = lanes;
    p.group = group;
    const int rows_per_lane_group = warp_rows(bytes, c, q.backward ? 2 : 1);
    auto ctas = [&](int threads) {
        const int64_t per_cta = (int64_t)rows_per_lane_group * (32 / group) * (threads / 32);
        return (q.outer + per_cta - 1) / per_cta;
    };
    p.block_x = kWarpBlock;
    p.grid = ctas(p.block_x);
    if (p.grid > 0x7fffffff) return fk_fail(FK_ERR_VALUE, "%s: %lld rows exceed the CUDA grid", q.op, (long long)q.outer);
    return FK_OK;
}

// rows_block: K CTAs a row, K the smallest power of two leaving a CTA at most kCtaChunks chunks.
fk_status plan_rows_block(const Problem &q, Plan &p, int64_t frame, int elems) {
    p.strategy = Strategy::kRowsBlock;
    p.elems = elems, p.lanes = 0, p.smem = 0;
    const int64_t per_cta = (int64_t)kBlockThreads * elems * kCtaChunks;
    int64_t k = 1;
    if (frame > per_cta) {
        const void *kernel = rows_block_kernel(p);
        const int64_t limit = kernel ? cluster_limit(kernel, q.device, kBlockThreads, 0) : 1;
        k = pow2_ceil((frame + per_cta - 1) / per_cta);
        if (k > limit) k = limit;
    }
    p.seg = ((frame + k - 1) / k + p.vec - 1) / p.vec * p.vec;
    const int64_t warps = ((p.seg + elems - 1) / elems + 31) / 32;
    p.block_x = 32 * (int)(warps < kBlockThreads / 32 ? warps : kBlockThreads / 32);
    p.cluster = (int)k;
    p.grid = q.outer * k;
    if (q.outer * k > 0x7fffffff)
        return fk_fail(FK_ERR_VALUE, "%s: %lld rows of %lld elements exceed the CUDA grid", q.op, (long long)q.outer,
                       (long long)q.n);
    return FK_OK;
}

// rows_packs: one CTA a row, kPackElems a thread (x2 past wide_from, x4 past kPackRowMax).
fk_status plan_rows_packs(const Problem &q, Plan &p, int64_t frame) {
    if (q.outer > 0x7fffffff) return fk_fail(FK_ERR_VALUE, "%s: %lld rows exceed the CUDA grid", q.op, (long long)q.outer);
    constexpr int64_t kReach = (int64_t)kPackElems * kPackThreads;  // 4096: 8 elements a thread
    const bool wide16 = p.vec == 8 && frame > kReach / 2 && frame <= kReach &&
                        fk::dram_bytes_per_us_per_sm(q.device) > kFastDramPerSm;  // card row
    const int64_t wide_from = wide16 ? kReach / 2 : kReach;
    const int times = frame > kPackRowMax ? 4 : frame > wide_from ? 2 : 1;
    p.strategy = Strategy::kRowsPacks;
    p.elems = times * kPackElems;
    p.block_x = (int)(((frame + p.elems - 1) / p.elems + 31) / 32 * 32);
    p.grid = q.outer;
    return FK_OK;
}

// rows_smem_*: true when a shared-memory shape holds the row (the plan then names it).
bool plan_rows_smem(const Problem &q, Plan &p, int64_t frame) {
    if (fk::compute_major(q.device) < 9) return false;
    const int bytes = dtype_bytes(q.dtype), tensors = q.backward ? 2 : 1;
    frame = (frame + p.vec - 1) / p.vec * p.vec;
    const int64_t row_bytes = frame * bytes * tensors;
    if (q.n * bytes * tensors <= kSmemWarpRowMax) {  // decided by the row: a ragged 8 KB row takes a warp too
        if (q.backward || q.dtype == FK_FLOAT32) return false;
        const int64_t ctas = (q.outer + kWarpRows - 1) / kWarpRows;
        if (ctas > 0x7fffffff) return false;
        p.strategy = Strategy::kRowsSmemWarp;
        p.lanes = 32 * kWarpRows;
        p.grid = ctas, p.block_x = 32 * kWarpRows, p.smem = (size_t)(kWarpRows * row_bytes);
        p.seg = frame, p.cluster = 1;
        return true;
    }
    int64_t k = pow2_ceil((row_bytes + kSmemCtaMax - 1) / kSmemCtaMax);
    p.strategy = Strategy::kRowsSmemCta;
    p.lanes = q.backward ? kSmemBwdThreads : kSmemFwdThreads;
    int threads = p.lanes;
    const void *cta = rows_smem_kernel(p);
    if (!cta) return false;
    const int64_t limit = cluster_limit(cta, q.device, threads, (int)kSmemCtaMax);
    if (limit == 0) return false;
    if (k > limit) k = limit;
    const int64_t line = 128 / bytes;  // slices of whole 128-byte lines, as their shared-memory copies
    const int64_t seg = ((frame + k - 1) / k + line - 1) / line * line;
    const int64_t smem = seg * bytes * tensors;
    if (q.outer * k > 0x7fffffff) return false;
    if (!q.backward && p.masked) {  // masked forwards: a warp per kMaskedWarpPacks packs
        const int64_t warps = (seg * bytes / 16 + kMaskedWarpPacks - 1) / kMaskedWarpPacks;
        if (warps < threads / 32) threads = 32 * (int)warps;
    }
    p.grid = q.outer * k, p.cluster = (int)k, p.seg = seg;
    auto fits = [&](int64_t max) { return smem <= max && cluster_limit(cta, q.device, threads, (int)max) >= k; };
    if (smem <= kSmemCtaMax || fits(kSmemCtaBigMax) || (!q.backward && !p.masked && fits(kSmemCtaHugeMax))) {
        p.block_x = threads, p.smem = (size_t)smem;
        return true;
    }
    if (!q.backward) return false;
    p.strategy = Strategy::kRowsSmemDyReg;  // x in shared memory, dy in registers
    const int64_t x_smem = seg * bytes;
    for (int lanes : {kDyRegThreads, kDyRegWideThreads}) {
        p.lanes = lanes;
        const void *kernel = rows_smem_kernel(p);
        if (kernel && x_smem <= kDyRegSliceMax(lanes) &&
            cluster_limit(kernel, q.device, lanes, (int)kDyRegSliceMax(lanes)) >= k) {
            p.block_x = lanes, p.smem = (size_t)x_smem;
            return true;
        }
    }
    return false;
}

// cols_tile[_chunked]: true when the tile (or its chunks) takes the columns.
bool plan_cols_tile(const Problem &q, Plan &p) {
    const int bytes = dtype_bytes(q.dtype);
    const bool fp32 = q.dtype == FK_FLOAT32;
    // the instance: its thread bound (kMax), the CTA size it takes (threads), accesses a thread
    // (rows), the size of the values it reduces (acc), and the chunked instance's CTA size
    int max_threads, threads, rows, acc, chunk_threads = 0, chunk_bound = 0;
    if (!q.backward) {
        if (fp32 && q.n <= kTileFwdShortMax) max_threads = kTileFwdThreads, threads = kTileFwdThreads / 2, rows = 4;
        else if (fp32) max_threads = kTileFwdThreads / 2, threads = kTileFwdThreads / 4, rows = 16, chunk_threads = threads;
        else max_threads = kTileFwdThreads, threads = kTileFwdThreads / 2, rows = kTileRows,
             chunk_threads = p.vec == 1 ? kTileFwdThreads / 2 : kTileFwdThreads / 4;
        if (chunk_threads) chunk_bound = kTileFwdThreads / 2;
        acc = fp32 ? 8 : 4;
    } else {
        if (fp32 && q.n <= kTileShortMax) max_threads = threads = kTileShortThreads, rows = kTileShortRows, p.min_ctas = 3;
        else max_threads = kTileBwdThreads, threads = kTileBwdThreads / 2, rows = kTileRows,
             chunk_threads = kTileBwdThreads / 2, chunk_bound = kTileBwdThreads;
        acc = fp32 ? 16 : 8;
    }
    p.strategy = Strategy::kColsTile;
    p.elems = rows, p.lanes = max_threads;
    const int64_t columns = q.outer * q.inner;
    const int64_t tx_min = p.vec == 1 ? 32 : kTileRowBytes / (p.vec * bytes);
    auto smem_of = [&](int64_t tx, int64_t ty) { return (size_t)((tx * ty / 32 + 2) * tx * p.vec) * acc; };
    const int64_t row_threads = std::max<int64_t>(1, (q.n + rows - 1) / rows);
    int64_t tx = 0, k = 0;
    auto shape = [&](int64_t cta) {
        tx = 32;
        while (tx > tx_min && tx * row_threads > cta) tx /= 2;
        k = pow2_ceil((row_threads + cta / tx - 1) / (cta / tx));
    };
    shape(threads);
    if (k > 1) {
        shape(max_threads);
        if (k > 1) shape(threads);
    }
    int64_t ty_max = max_threads / tx;
    if (k > 1) {
        const int64_t limit = std::min<int64_t>(
            kMaxCluster, cluster_limit(cols_tile_kernel(p), q.device, max_threads, (int)smem_of(tx_min, max_threads / tx_min)));
        if (k > limit) {
            if (!chunk_threads) return false;
            // one column a thread: cols_loop where its grid (a CTA per kColsX columns) covers the SMs
            if (p.vec == 1 && (columns + kColsX - 1) / kColsX >= fk::sm_count(q.device)) return false;
            p.strategy = Strategy::kColsTileChunked;
            p.lanes = chunk_bound;
            k = std::min<int64_t>(limit, cluster_limit(cols_tile_kernel(p), q.device, chunk_threads,
                                                       (int)smem_of(tx, chunk_threads / tx)));
            if (k < 1) return false;
            ty_max = chunk_threads / tx;
        }
    }
    const int64_t group = 32 / tx, ty = std::min(ty_max, ((row_threads + k - 1) / k + group - 1) / group * group);
    p.grid = (columns / p.vec + tx - 1) / tx * k;
    p.block_x = (int)tx, p.block_y = (int)ty, p.cluster = (int)k, p.smem = smem_of(tx, ty);
    return true;
}

void plan_cols_loop(const Problem &q, Plan &p) {
    const int64_t columns = q.outer * q.inner, ctas = (columns + kColsX - 1) / kColsX;
    p.strategy = Strategy::kColsLoop;
    p.vec = 1;
    p.grid = ctas;
    p.block_x = kColsX;
    p.block_y = (int)std::max<int64_t>(
        1, std::min<int64_t>(ctas >= 8 * fk::sm_count(q.device) ? 8 : 32, (q.n + kColsUnroll - 1) / kColsUnroll));
}

// ---- the table, row for row ---------------------------------------------------------------------------
fk_status plan_softmax(const Problem &q, Plan &p) {
    if (q.dtype != FK_FLOAT32 && q.dtype != FK_FLOAT16 && q.dtype != FK_BFLOAT16)
        return fk_fail(FK_ERR_TYPE, "%s: dtype code %d is not supported on CUDA (float32, float16, bfloat16)", q.op,
                       (int)q.dtype);
    const int bytes = dtype_bytes(q.dtype), pack = 16 / bytes;
    p = Plan{};
    p.dtype = q.dtype, p.backward = q.backward, p.log = q.log;
    p.rows = q.outer, p.n = q.n, p.inner = q.inner;
    if (q.inner > 1) {
        p.vec = q.aligned && q.inner % pack == 0 ? pack : 1;
        if (plan_cols_tile(q, p)) return FK_OK;                    // cols_tile, cols_tile_chunked
        plan_cols_loop(q, p);                                      // cols_loop
        return FK_OK;
    }
    const bool causal = q.causal_sq > 0;
    const bool warp_ragged = !causal && !(q.backward && q.dtype == FK_FLOAT32 && q.n > kRaggedFp32BwdMax);
    const auto frame_of = [&](int vec) { return q.n % vec ? q.n + vec - 1 : q.n; };
    p.vec = q.aligned && (q.n % pack == 0 || q.n > kWarpMaxN || (warp_ragged && frame_of(pack) <= kWarpMaxN)) ? pack : 1;
    const int64_t frame = frame_of(p.vec);
    const bool ragged = frame != q.n;
    // rows_warp and rows_packs take ragged rows in their unmasked ragged instances; rows_block and
    // rows_smem_* in their masked ones, every key in (mask_sq 1)
    p.masked = causal, p.ragged = ragged && !causal, p.mask_sq = q.causal_sq;
    if (frame <= kWarpMaxN) return plan_rows_warp(q, p, frame);  // rows_warp
    const bool fp32 = q.dtype == FK_FLOAT32;
    if (q.backward && p.vec > 1 && !(ragged && causal) &&        // rows_packs
        frame <= (fp32 || causal || ragged ? kPackRowMax : 2 * kPackRowMax))
        return plan_rows_packs(q, p, frame);
    p.masked = causal || ragged, p.ragged = false, p.mask_sq = causal ? q.causal_sq : (int64_t)p.masked;
    if (!q.backward && fp32 && frame <= kPackRowMax)             // rows_block, fp32 forwards
        return plan_rows_block(q, p, frame, block_elems(bytes, p.vec, false));
    if (p.vec > 1 && plan_rows_smem(q, p, frame)) return FK_OK;  // rows_smem_warp, _cta, _dyreg
    return plan_rows_block(q, p, frame, block_elems(bytes, p.vec, q.backward));  // rows_block, fallback
}

fk_status check_args(const char *op, int64_t outer, int64_t n, int64_t inner, int64_t causal_sq) {
    if (outer < 0 || n < 0 || inner < 0)
        return fk_fail(FK_ERR_VALUE, "%s: sizes must be >= 0, got outer=%lld n=%lld inner=%lld", op,
                       (long long)outer, (long long)n, (long long)inner);
    if (causal_sq < 0 || (causal_sq > 0 && inner != 1))
        return fk_fail(FK_ERR_VALUE, "%s: causal_sq must be >= 0 and needs inner == 1, got "
                       "causal_sq=%lld inner=%lld", op, (long long)causal_sq, (long long)inner);
    return FK_OK;
}

template <typename Args> fk_status launch(const Plan &p, const Args &a) {
    switch (p.strategy) {
    case Strategy::kRowsWarp: return launch_rows_warp(p, a);
    case Strategy::kRowsBlock: return launch_rows_block(p, a);
    case Strategy::kRowsPacks:
        if constexpr (std::is_same_v<Args, BwdArgs>) return launch_rows_packs(p, a);
        break;
    case Strategy::kRowsSmemWarp:
    case Strategy::kRowsSmemCta:
    case Strategy::kRowsSmemDyReg: return launch_rows_smem(p, a);
    case Strategy::kColsTile:
    case Strategy::kColsTileChunked: return launch_cols_tile(p, a);
    case Strategy::kColsLoop: return launch_cols_loop(p, a);
    }
    return no_instance(p, a.op);
}

}  // namespace
}  // namespace fk::softmax

using namespace fk::softmax;

extern "C" fk_status fk_cuda_softmax_fwd(const void *x, void *y, float *row_max, int64_t outer, int64_t n,
                                         int64_t inner, double scale, int64_t causal_sq, int log,
                                         fk_dtype dtype, int device, void *stream) {
    const char *op = "softmax_fwd";
    fk_status st = check_args(op, outer, n, inner, causal_sq);
    if (st != FK_OK || outer == 0 || inner == 0) return st;
    FK_CUDA_ENTER(op, device);
    const Problem q{op, false, log != 0, dtype, outer, n, inner, causal_sq, fk::aligned16(x) && fk::aligned16(y), device};
    Plan p;
    if ((st = plan_softmax(q, p)) != FK_OK) return st;
    return launch(p, FwdArgs{x, y, row_max, (float)scale, (cudaStream_t)stream, device, op});
}

extern "C" fk_status fk_cuda_softmax_bwd(const void *dy, const void *x, const float *row_max, void *dx,
                                         int64_t outer, int64_t n, int64_t inner, double scale,
                                         int64_t causal_sq, int log, fk_dtype dtype, int device,
                                         void *stream) {
    const char *op = "softmax_bwd";
    fk_status st = check_args(op, outer, n, inner, causal_sq);
    if (st != FK_OK || outer == 0 || inner == 0 || n == 0) return st;
    FK_CUDA_ENTER(op, device);
    const Problem q{op, true, log != 0, dtype, outer, n, inner, causal_sq,
                    fk::aligned16(dy) && fk::aligned16(x) && fk::aligned16(dx), device};
    Plan p;
    if ((st = plan_softmax(q, p)) != FK_OK) return st;
    return launch(p, BwdArgs{dy, x, row_max, dx, (float)scale, (cudaStream_t)stream, device, op});
}

extern "C" const char *fk_cuda_softmax_plan(int backward, int64_t outer, int64_t n, int64_t inner, int64_t causal_sq,
                                            int log, fk_dtype dtype, int aligned, int device, char *shape,
                                            int shape_size) {
    const char *op = backward ? "softmax_bwd" : "softmax_fwd";
    if (shape && shape_size > 0) shape[0] = 0;
    if (check_args(op, outer, n, inner, causal_sq) != FK_OK) return nullptr;
    if (outer == 0 || inner == 0 || (backward && n == 0)) return "empty";
    fk::DeviceGuard guard(device);
    if (guard.error != cudaSuccess) {
        fk::cuda_status(guard.error, op);
        return nullptr;
    }
    const Problem q{op, backward != 0, log != 0, dtype, outer, n, inner, causal_sq, aligned != 0, device};
    Plan p;
    if (plan_softmax(q, p) != FK_OK) return nullptr;
    if (shape && shape_size > 0)
        snprintf(shape, (size_t)shape_size,
                 "grid=%lld block=(%d,%d) cluster=%d smem=%zu vec=%d elems=%d lanes=%d group=%d seg=%lld masked=%d "
                 "ragged=%d",
                 (long long)p.grid, p.block_x, p.block_y, p.cluster, p.smem, p.vec, p.elems, p.lanes, p.group,
                 (long long)p.seg, (int)p.masked, (int)p.ragged);
    return strategy_name(p.strategy);
}
