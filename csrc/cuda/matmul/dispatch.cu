// Matmul on the GPU: which strategy runs for which problem. First matching row wins.
//
// dtype   device   flags / shape                      strategy      tile                    why
// fp32    sm_90    TF32 allowed, built for sm_90a,    wgmma_sm90    128 x 128, persistent    tf32 wgmma (K-major
//                  not forced general, A K-major, B                                          only: an N-major B
//                  K- or N-major, TMA-describable                                            swaps roles, D-132;
//                                                                                            ops/matmul.py copies
//                                                                                            the others)
// fp32    any      otherwise                          simt_fp32     128 x 256 when its grid  exact (tile: D-121,
//                                                                   fills the SMs twice,     chosen in its
//                                                                   else 128 x 128           launcher)
// 16-bit  sm_90    built for sm_90a, not forced       wgmma_sm90    128 x 64, K split over   small problems:
//                  general, operands TMA-describable,  "128x64       2-CTA clusters           4x the CTAs, lean
//                  128 x 128 tiles <= SMs / 4,         split-k"                               prologue (D-128,
//                  K >= 193 (4 k-steps)                                                       D-136)
// 16-bit  sm_90    as above, tiles <= SMs / 2, B's    wgmma_sm90    128 x 128, a tile a CTA, L2-bound: 24 of
//                  rows not 128-byte aligned, an       "shared-b"    2-CTA clusters share B   32 KB a k-step
//                  even count of 128-row tiles                       (multicast halves)       (D-136)
// 16-bit  sm_90    as above, otherwise                wgmma_sm90    128 x 128, K split over  2x the CTAs
//                                                      "split-k"     2-CTA clusters           (D-128, D-136)
// 16-bit  sm_90    as above, K >= 6144, 128 x 256     wgmma_sm90    128 x 256, persistent,   energy a FLOP at
//                  tiles >= 2 x SMs                    "128x256"     cooperative (m64n256)    the power cap:
//                                                                                            +3-8% (D-139)
// 16-bit  sm_90    as above, A's rows not 128-byte    wgmma_sm90    as the row above         half of A's TMA
//                  aligned, 128 x 256 waves (x 2)     "128x256"                              rows a FLOP:
//                  <= 1.25 x 128 x 128 waves                                                 2040^3 +26% (D-144)
// 16-bit  sm_90    built for sm_90a, not forced       wgmma_sm90    128 x 128, persistent    TMA + wgmma
//                  general, operands TMA-describable
//                  (16-byte aligned base and strides)
// 16-bit  sm_80+   any                                mma_sm80      128 x 256 when aligned,  the general kernel:
//                                                                   its grid fills 7/8 of    any alignment, and
//                                                                   the SMs and 144 KB of    FK_MM_FORCE_GENERAL
//                                                                   shared memory fit, else  (D-123)
//                                                                   64 x 64
// any     < sm_80  -                                  (refused: RuntimeError)
//
// In every row, operands whose base and non-unit strides are 16-byte multiples take cp.async
// loads (plan.aligned), others element loads into the same pipeline.
#include <cstring>

#include "matmul.cuh"

namespace fk::mm {

const char *strategy_name(Strategy s) {
    switch (s) {
    case Strategy::kMmaSm80: return "mma_sm80";
    case Strategy::kSimtFp32: return "simt_fp32";
    case Strategy::kWgmmaSm90: return "wgmma_sm90";
    default: return "none";
    }
}

namespace {

// The Hopper kernel's body exists only in an sm_90a build (FASTKERN_CUDA_ARCHS).
const bool kBuiltForSm90a = std::strstr(FK_CUDA_ARCHS, "sm_90a") != nullptr;

// A is K-major when its columns (K) are contiguous, B when its rows (K) are.
bool a_kmajor(const fk_matmul_args &x) { return x.a_col == 1; }
bool b_kmajor(const fk_matmul_args &x) { return x.b_col != 1 && x.b_row == 1; }

bool operand_aligned(const void *p, int64_t stride, int64_t batch_stride, int elem) {
    return aligned16(p) && (stride * elem) % 16 == 0 && (batch_stride * elem) % 16 == 0;
}

Plan plan_matmul(const fk_matmul_args &x, int device) {
    Plan plan;
    if (compute_major(device) < 8) return plan;
    const bool hopper = compute_major(device) == 9 && kBuiltForSm90a && !(x.flags & FK_MM_FORCE_GENERAL);
    if (x.dtype == FK_FLOAT32) {
        // A K-major; B K-major, or N-major (the kernel computes C^T = B^T A^T then, D-132)
        const bool tma_tf32 = x.k > 0 && a_kmajor(x) && operand_aligned(x.a, x.a_row, x.a_batch, 4) &&
                              operand_aligned(x.b, b_kmajor(x) ? x.b_col : x.b_row, x.b_batch, 4);
        plan.strategy = hopper && (x.flags & FK_MM_TF32) && tma_tf32 ? Strategy::kWgmmaSm90 : Strategy::kSimtFp32;
        return plan;
    }
    plan.aligned = operand_aligned(x.a, a_kmajor(x) ? x.a_row : x.a_col, x.a_batch, 2) &&
                   operand_aligned(x.b, b_kmajor(x) ? x.b_col : x.b_row, x.b_batch, 2);
    if (hopper && plan.aligned) {
        plan.strategy = Strategy::kWgmmaSm90;
        // Where 128 x 128 tiles would leave most SMs idle, each SM's k-loop is the time (512^3: 16
        // tiles of 8 k-steps, ~490 cycles each at the tensor-core rate, 1.9 of 4.4 us; D-136): 128 x 64
        // tiles with K split over 2-CTA clusters give 4x the CTAs where K has 4 k-steps or more, and
        // 128 x 128 tiles split K for a quarter to half of the SMs. Rows that are not 128-byte aligned
        // make the loads L2-bound there (1000^3: 64 CTAs at ~6 TB/s, 650 cycles a k-step; D-113): pairs
        // of tiles share B's loads instead where tile rows pair up (1000^3 0.88x -> 0.96x cuBLAS, 768^3
        // and 1024^3 lose; D-136).
        const int64_t tiles_m = (x.m + 127) / 128, k_steps = (x.k + 63) / 64;
        const int64_t tiles = tiles_m * x.batch * ((x.n + 127) / 128), sms = sm_count(device);  // 128 x 128
        const bool b_rows_aligned = (b_kmajor(x) ? x.b_col : x.b_row) * 2 % 128 == 0;
        if (2 * tiles <= sms && k_steps >= 4) {
            plan.tile = 4 * tiles <= sms ? 1 : 0;
            plan.share_b = plan.tile == 0 && tiles_m % 2 == 0 && !b_rows_aligned;
            plan.split_k = plan.share_b ? 1 : 2;
        }
        // Long K: the 128 x 128 tiles' k-steps run 636 cycles at every shape (80% of the tensor rate,
        // H200 stamps), level with cuBLAS a cycle, but at a power-capped clock 7-9% below cuBLAS's
        // (1.40 against 1.53 GHz at 550-570 W): two m64n128 wgmmas a k16 read B's slice twice from
        // shared memory, and a 128 x 128 tile reads 32 KB from L2 for 2.1 MFLOP. 128 x 256 tiles
        // (one m64n256 a consumer, 48 KB for 4.2 MFLOP) ran at 1.50 GHz: K 8192 +4-8%, 7168 +3%; they
        // expose the epilogue once a tile (cooperative), so short K does not gain (K 1280 level,
        // 4096^3 -5%), and at least two tiles a CTA (D-139).
        const int64_t tiles_256 = tiles_m * x.batch * ((x.n + 255) / 256);  // 128 x 256
        if (plan.split_k == 1 && x.k >= 6144 && tiles_256 >= 2 * sms) plan.tile = 2;
        // A's rows 16-byte but not 128-byte aligned (K 2040, 1800): each 128-byte TMA box row spans
        // two lines, and 128 x 128 tiles' loads bound the k-loop (H200, 2040^3: 416 TFLOP/s in place,
        // 669 on rows padded to 128 bytes). 128 x 256 tiles load half of A's rows a FLOP (B's stay):
        // 528. Taken where their waves, at twice a 128 x 128 wave each, cost at most 1.25x (D-144).
        const bool a_rows_aligned = (a_kmajor(x) ? x.a_row : x.a_col) * 2 % 128 == 0;
        const int64_t waves = (tiles + sms - 1) / sms, waves_256 = (tiles_256 + sms - 1) / sms;
        if (plan.split_k == 1 && !a_rows_aligned && 8 * waves_256 <= 5 * waves) plan.tile = 2;
        return plan;
    }
    plan.strategy = Strategy::kMmaSm80;
    // mma_sm80.cu's large tile: 128 x 256, 3 stages of (128 + 256) x 64 x 2 bytes (not on sm_86 / sm_89).
    const bool large_fits = smem_per_sm(device) >= 3 * 384 * 64 * 2 + smem_reserved_per_cta(device);
    // 7/8 of a wave of large tiles beats 64 x 64 tiles: 2048^3 (128 tiles, 132 SMs) +43%, H200 (D-123).
    const bool large_fills = ((x.m + 127) / 128) * ((x.n + 255) / 256) * x.batch * 8 >= sm_count(device) * 7;
    plan.tile = plan.aligned && large_fits && large_fills ? 0 : 1;
    return plan;
}

// The plan's name: the strategy's, and wgmma_sm90's small-problem variants (the table's rows).
const char *plan_name(const Plan &p) {
    if (p.strategy != Strategy::kWgmmaSm90) return strategy_name(p.strategy);
    if (p.share_b) return "wgmma_sm90 shared-b";
    if (p.split_k == 1) return p.tile == 2 ? "wgmma_sm90 128x256" : strategy_name(p.strategy);
    return p.tile == 1 ? "wgmma_sm90 128x64 split-k" : "wgmma_sm90 split-k";
}

fk_status check_args(const fk_matmul_args &x) {
    if (x.dtype != FK_FLOAT32 && x.dtype != FK_FLOAT16 && x.dtype != FK_BFLOAT16)
        return fk_fail(FK_ERR_TYPE, "matmul: dtype code %d is not supported on CUDA (float32, float16, "
                       "bfloat16)", (int)x.dtype);
    if (x.batch < 0 || x.m < 0 || x.n < 0 || x.k < 0)
        return fk_fail(FK_ERR_VALUE, "matmul: negative size (batch %lld, m %lld, n %lld, k %lld)",
                       (long long)x.batch, (long long)x.m, (long long)x.n, (long long)x.k);
    if (x.a_col != 1 && x.a_row != 1)
        return fk_fail(FK_ERR_VALUE, "matmul: a must be row- or column-major (strides %lld, %lld)",
                       (long long)x.a_row, (long long)x.a_col);
    if (x.b_col != 1 && x.b_row != 1)
        return fk_fail(FK_ERR_VALUE, "matmul: b must be row- or column-major (strides %lld, %lld)",
                       (long long)x.b_row, (long long)x.b_col);
    if (x.activation < FK_ACT_NONE || x.activation > FK_ACT_GELU_TANH)
        return fk_fail(FK_ERR_VALUE, "matmul: activation code %d is unknown", x.activation);
    const int64_t tiles = ((x.m + 63) / 64) * ((x.n + 63) / 64);
    if (tiles > INT32_MAX)
        return fk_fail(FK_ERR_VALUE, "matmul: %lld x %lld output is too large", (long long)x.m, (long long)x.n);
    return FK_OK;
}

Params params_of(const fk_matmul_args &x) {
    const int elem = fk_dtype_size(x.dtype);
    auto pair_ok = [&](const void *p) {
        return p == nullptr || (reinterpret_cast<uintptr_t>(p) % (2 * elem) == 0);
    };
    return Params{x.a, x.b, x.bias, x.c, x.pre, x.batch, x.m, x.n, x.k,
                  x.a_batch, x.a_row, x.a_col, x.b_batch, x.b_row, x.b_col, x.c_batch, x.c_row,
                  x.activation,
                  pair_ok(x.c) && pair_ok(x.pre) && x.c_row % 2 == 0 && x.c_batch % 2 == 0, false};
}

}  // namespace
}  // namespace fk::mm

extern "C" const char *fk_cuda_matmul_plan(const fk_matmul_args *args, int device) {
    fk::DeviceGuard guard(device);
    if (guard.error != cudaSuccess) return "none";
    return fk::mm::plan_name(fk::mm::plan_matmul(*args, device));
}

extern "C" fk_status fk_cuda_matmul(const fk_matmul_args *args, int device, void *stream) {
    using namespace fk::mm;
    const fk_matmul_args &x = *args;
    fk_status status = check_args(x);
    if (status != FK_OK || x.batch == 0 || x.m == 0 || x.n == 0) return status;
    FK_CUDA_ENTER("matmul", device);
    const Plan plan = plan_matmul(x, device);
    const Params p = params_of(x);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (plan.strategy) {
    case Strategy::kSimtFp32: return launch_simt_fp32(plan, p, a_kmajor(x), b_kmajor(x), device, s);
    case Strategy::kWgmmaSm90: return launch_wgmma_sm90(plan, p, x.dtype, a_kmajor(x), b_kmajor(x), device, s);
    case Strategy::kMmaSm80: return launch_mma_sm80(plan, p, x.dtype, a_kmajor(x), b_kmajor(x), device, s);
    default: return fk_fail(FK_ERR_RUNTIME, "matmul: needs a GPU of compute capability 8.0 or newer");
    }
}
