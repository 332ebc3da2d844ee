// Attention on the GPU: which strategy runs for which call. First matching row wins.
//
// dir  dtype   device  shape                                          strategy          why
// any  16-bit  any     batch or heads == 0, or sq == 0 (bwd: sq ==    empty             nothing to do
//                      sk == 0; other empty sides get zero grads)
// fwd  16-bit  sm_80+  d <= 128, sq x group <= 16 (a kv head's rows    fwd_decode_mma_   decoding: 1.04 /
//                      fill one 16-row tile), a CTA's 2-slot ring fits sm80              1.00x compile,
//                      (3 where it fits); units = batch kv_heads CTAs,                   split kernel
//                      one an SM: splits <= key tiles / 8 and 64, as                     0.93 / 0.97x
//                      many as one wave holds (units <= SMs), else by                    (H200, D-134)
//                      wave efficiency; sm_90a, not FK_ATTN_FORCE_
//                      GENERAL, 2..8 splits whose clusters all fit
//                      at once: merged in the cluster, else by
//                      attention_fwd_combine
// fwd  16-bit  sm_80+  query-tile CTAs < SMs and >= 4 key tiles a      fwd_split_mma_sm80 one query still
//                      CTA: splits = min(floor(slots SMs / split         (64 x 32 tiles) fills the GPU
//                      CTAs), 32-key tiles / 2, 64) >= 2 (slots:                         (flash-decoding)
//                      split_slots, 3 at d <= 128)
// fwd  16-bit  sm_90   d 64 or 128, sk > 0, not varlen, no GQA pack, fwd_wgmma_sm90    TMA + wgmma,
//                      q / k / v / out bases, strides 16-byte aligned,                   2.3x sm_80
//                      built for sm_90a, not FK_ATTN_FORCE_GENERAL;                      (H200)
//                      persistent grid; CTAs claim tiles from a counter
//                      (FK_ATTN_FWD_DYNAMIC; 0: a static walk, only
//                      without a mask band)
// fwd  16-bit  sm_80+  otherwise                                      fwd_mma_sm80      the general kernel
// fwd (sm_80 rows): GQA with sq x group <= 128 (64 at D 256) packs the group's heads into one CTA's
//      rows (pack_gqa): K / V read once per group, CTAs counted per kv head.
// bwd  16-bit  sm_80+  FK_ATTN_DETERMINISTIC (bitwise: no atomics,    bwd_mma_sm80      deterministic
//                      a dQ kernel)
// bwd  16-bit  sm_90   d 64 or 128, sq, sk > 0, not varlen, q / k / v / bwd_wgmma_sm90    TMA + wgmma, 5
//                      dout / out TMA-describable (as fwd_wgmma_sm90), built             products not 7
//                      for sm_90a, not FK_ATTN_FORCE_GENERAL
// bwd  16-bit  sm_80+  d <= 128                                       bwd_atomic_mma_   5 products, dQ by
//                                                                     sm80              atomics (D-117)
// bwd  16-bit  sm_80+  otherwise (d > 128)                            bwd_mma_sm80      the general kernel
// any  fp32 / fp64     -                                              (TypeError)
// any  any     < sm_80 -                                              (RuntimeError)
//
// Every row: head-dim instances D 64 (d <= 64), 128 (d <= 128), 256 (d <= 256); rows whose every
// tensor has a 16-byte aligned base and strides that are multiples of 8 elements take cp.async,
// others element loads (p.async). fwd_wgmma_sm90 instantiates d 64 and 128 exactly (other d keep
// the sm_80 kernel); its TMA copies need the alignment its row names; so does bwd_wgmma_sm90's.
// (The fwd_wgmma_sm90 row's figures: its file's napkin math.)
//
// Workspace: forward split (and decode with splits > 1, no cluster): splits x batch x heads x sq x
// (1 + d) fp32 (partial lse, then outputs); bwd_mma_sm80: batch x heads x sq fp32 (rowsum(dO * O));
// bwd_wgmma_sm90 and bwd_atomic_mma_sm80: batch x heads x sq rounded up to their query tile
// (bwd_wgmma_block_m, bwd_atomic_block_m) x (2 + D) fp32 (lse log2 e, rowsum(dO * O), the dQ
// accumulators; D the head-dim instance; attention.cuh's BwdWork). varlen sizes use the maximum
// lengths.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "attention.cuh"

namespace fk::attn {

const char *strategy_name(Strategy s) {
    switch (s) {
    case Strategy::kFwdMmaSm80: return "fwd_mma_sm80";
    case Strategy::kFwdSplitMmaSm80: return "fwd_split_mma_sm80";
    case Strategy::kFwdDecodeMmaSm80: return "fwd_decode_mma_sm80";
    case Strategy::kFwdWgmmaSm90: return "fwd_wgmma_sm90";
    case Strategy::kBwdMmaSm80: return "bwd_mma_sm80";
    case Strategy::kBwdAtomicMmaSm80: return "bwd_atomic_mma_sm80";
    case Strategy::kBwdWgmmaSm90: return "bwd_wgmma_sm90";
    default: return "empty";
    }
}

namespace {

constexpr int kMaxSplits = 64;

// The Hopper kernel's body exists only in an sm_90a build (FASTKERN_CUDA_ARCHS).
const bool kBuiltForSm90a = std::strstr(FK_CUDA_ARCHS, "sm_90a") != nullptr;

// Forward with no query rows, or backward with no rows at all (sq == 0 still zeroes dk, dv).
bool nothing_to_do(const fk_attention_args &x, int backward) {
    return x.batch == 0 || x.heads == 0 || (backward ? x.sq == 0 && x.sk == 0 : x.sq == 0);
}

int d_bucket(int64_t d) { return d <= 64 ? 64 : d <= 128 ? 128 : 256; }

// The forward kernel's query tile (fwd_mma_sm80.cu FwdCfg; its key tile: attention.cuh fwd_block_n).
int fwd_block_m(int bucket) { return bucket <= 128 ? 128 : 64; }

// Floats of the split forward's partial lse, rounded up to 16 bytes (the partial outputs follow it
// and take 8-byte stores).
int64_t split_lse_floats(int64_t splits, const fk_attention_args &x) {
    return (splits * x.batch * x.heads * x.sq + 3) / 4 * 4;
}

// The split forwards' workspace: the partial lse, then the fp32 partial outputs.
int64_t split_workspace_bytes(int64_t splits, const fk_attention_args &x) {
    return (split_lse_floats(splits, x) + splits * x.batch * x.heads * x.sq * x.d) * (int64_t)sizeof(float);
}

// TMA describes a tensor whose base and (row, head, sequence) strides are 16-byte aligned and
// whose strides are non-zero where their dimension has more than one index.
bool tma_ok(const void *p, int64_t row, int64_t head, int64_t batch, const fk_attention_args &x, int64_t heads) {
    return aligned16(p) && row % 8 == 0 && head % 8 == 0 && batch % 8 == 0 && row > 0 &&
           (heads == 1 || head > 0) && (x.batch == 1 || batch > 0);
}

// What the plan reads of the device (device_facts), so that the plan stays a pure function.
struct DeviceFacts {
    int sms = 0, major = 0;
    int smem = 0;  // shared memory one CTA may take
    int decode_clusters[kDecodeMaxCluster + 1] = {};  // [k]: clusters of k decode CTAs resident at once
};

int decode_stages(int bucket, int smem) { return smem >= decode_smem_bytes(bucket, 3) ? 3 : 2; }

// Splits of the decode kernel's `units` CTAs (one an SM), 1..most: within one wave, as many as
// fit it; past one wave, flash-attn's num_splits_heuristic: the fewest splits whose waves are >= 85%
// as full as the best count's (efficiency: waves / whole waves), so that a last wave of a few long
// CTAs does not leave the DRAM idle (units 140: 4 splits in 4.2 waves, not 1 and a second wave of 8).
int64_t decode_splits(int64_t units, int64_t most, int sms) {
    if (most <= 1) return 1;
    if (units <= sms) return std::min<int64_t>(sms / units, most);
    auto efficiency = [&](int64_t s) {
        const double waves = (double)(units * s) / sms;
        return waves / std::ceil(waves);
    };
    double best = 0.0;
    for (int64_t s = 1; s <= most; s++) best = std::max(best, efficiency(s));
    int64_t s = 1;
    while (efficiency(s) < 0.85 * best) s++;
    return s;
}

// Pure: the strategy, instance and workspace for `x` on the device `dev` describes.
Plan plan_attention(const fk_attention_args &x, int backward, const DeviceFacts &dev) {
    const int sms = dev.sms, major = dev.major;
    Plan plan;
    if (nothing_to_do(x, backward)) return plan;
    plan.d_bucket = d_bucket(x.d);
    if (backward) {
        if (!(x.flags & (FK_ATTN_DETERMINISTIC | FK_ATTN_FORCE_GENERAL)) && major == 9 && kBuiltForSm90a &&
            (x.d == 64 || x.d == 128) && x.sq > 0 && x.sk > 0 && x.cu_seqlens_q == nullptr &&
            tma_ok(x.q, x.q_row, x.q_head, x.q_batch, x, x.heads) &&
            tma_ok(x.k, x.k_row, x.k_head, x.k_batch, x, x.kv_heads) &&
            tma_ok(x.v, x.v_row, x.v_head, x.v_batch, x, x.kv_heads) &&
            tma_ok(x.dout, x.do_row, x.do_head, x.do_batch, x, x.heads) &&
            tma_ok(x.out, x.o_row, x.o_head, x.o_batch, x, x.heads)) {  // out: the prep's 16-byte loads
            plan.strategy = Strategy::kBwdWgmmaSm90;
            plan.d_bucket = (int)x.d;
            plan.workspace_bytes = bwd_workspace_bytes(x.batch, x.heads, x.sq, bwd_wgmma_block_m((int)x.d), (int)x.d);
            return plan;
        }
        if (!(x.flags & FK_ATTN_DETERMINISTIC) && x.d <= 128) {
            plan.strategy = Strategy::kBwdAtomicMmaSm80;
            plan.workspace_bytes = bwd_workspace_bytes(x.batch, x.heads, x.sq, bwd_atomic_block_m(plan.d_bucket),
                                                       plan.d_bucket);
            return plan;
        }
        plan.strategy = Strategy::kBwdMmaSm80;
        plan.workspace_bytes = x.batch * x.heads * x.sq * (int64_t)sizeof(float);
        return plan;
    }
    const int64_t group = x.heads / x.kv_heads, bm = fwd_block_m(plan.d_bucket);
    if (x.sq * group <= kDecodeRows && x.d <= 128 && dev.smem >= decode_smem_bytes(plan.d_bucket, 2)) {
        // One CTA an SM (its ring takes most of the shared memory); splits by wave efficiency,
        // every warp getting 2 key tiles or more a split. A cluster holds a kv head's splits where
        // all its clusters fit at once.
        plan.strategy = Strategy::kFwdDecodeMmaSm80;
        plan.stages = decode_stages(plan.d_bucket, dev.smem);
        const int64_t units = x.batch * x.kv_heads, bn = decode_block_n(plan.d_bucket);
        const int64_t rounds = (x.sk + bn - 1) / bn / kDecodeWarps;
        const int64_t splits = decode_splits(units, std::min<int64_t>(rounds / 2, kMaxSplits), sms);
        plan.splits = (int)splits;
        plan.cluster = splits >= 2 && splits <= kDecodeMaxCluster && major == 9 && kBuiltForSm90a &&
                       !(x.flags & FK_ATTN_FORCE_GENERAL) && dev.decode_clusters[splits] >= units;
        if (splits > 1 && !plan.cluster)
            plan.workspace_bytes = split_workspace_bytes(splits, x);
        return plan;
    }
    plan.strategy = Strategy::kFwdMmaSm80;
    plan.pack_gqa = group > 1 && x.sq * group <= bm;
    const int64_t ctas = plan.pack_gqa ? x.kv_heads * x.batch : (x.sq + bm - 1) / bm * x.heads * x.batch;
    const int64_t key_tiles = (x.sk + fwd_block_n(plan.d_bucket) - 1) / fwd_block_n(plan.d_bucket);
    if (ctas < sms && key_tiles >= 4) {
        // One wave of the split kernel's resident CTAs (split_slots an SM): a second, partial wave
        // would cost as much as the first. Each split gets 2 key tiles or more.
        const int64_t split_ctas = (plan.pack_gqa ? (x.sq * group + kSplitBM - 1) / kSplitBM * x.kv_heads
                                                  : (x.sq + kSplitBM - 1) / kSplitBM * x.heads) * x.batch;
        const int64_t split_tiles = (x.sk + kSplitBN - 1) / kSplitBN;
        int64_t splits = std::min<int64_t>({split_slots(plan.d_bucket) * sms / split_ctas, split_tiles / 2, kMaxSplits});
        splits = std::min<int64_t>(splits, 65535 / std::max<int64_t>(x.batch, 1));
        if (splits > 1) {
            plan.strategy = Strategy::kFwdSplitMmaSm80;
            plan.splits = (int)splits;
            plan.workspace_bytes = split_workspace_bytes(splits, x);
            return plan;
        }
    }
    if (major == 9 && kBuiltForSm90a && !(x.flags & FK_ATTN_FORCE_GENERAL) && (x.d == 64 || x.d == 128) &&
        x.sk > 0 && x.cu_seqlens_q == nullptr && !plan.pack_gqa &&
        tma_ok(x.q, x.q_row, x.q_head, x.q_batch, x, x.heads) &&
        tma_ok(x.k, x.k_row, x.k_head, x.k_batch, x, x.kv_heads) &&
        tma_ok(x.v, x.v_row, x.v_head, x.v_batch, x, x.kv_heads) &&
        tma_ok(x.out, x.o_row, x.o_head, x.o_batch, x, x.heads)) {  // out: 16-byte row stores
        plan.strategy = Strategy::kFwdWgmmaSm90;
        plan.d_bucket = (int)x.d;
        // Persistent: one CTA an SM, the producer loading the next tile under the last one's
        // epilogue (S 1024 full: 568 vs 522 TFLOP/s as one CTA a tile, H100). A static walk cannot
        // balance causal tiles of unequal length (327 vs 363 causal); CTAs that claim tiles from a
        // counter (FK_ATTN_FWD_DYNAMIC, 8 bytes of workspace) can, longest first within a head.
        plan.persistent = FK_ATTN_FWD_DYNAMIC || (x.window_left < 0 && x.window_right < 0);
        plan.dynamic = FK_ATTN_FWD_DYNAMIC;
        if (plan.dynamic) plan.workspace_bytes = sizeof(unsigned long long);
    }
    return plan;
}

bool rows_aligned(const void *p, int64_t batch, int64_t row, int64_t head, bool varlen) {
    return p == nullptr || (aligned16(p) && row % 8 == 0 && head % 8 == 0 && (varlen || batch % 8 == 0));
}

// Sizes, strides and options; with `pointers`, also that the tensors a launch touches are there
// (the plan and workspace queries take sizes alone).
fk_status check_args(const fk_attention_args &x, int backward, const char *op, bool pointers = true) {
    if (x.dtype == FK_FLOAT32 || x.dtype == FK_FLOAT64)
        return fk_fail(FK_ERR_TYPE, "%s: CUDA attention supports float16 and bfloat16, not %s", op,
                       x.dtype == FK_FLOAT32 ? "float32" : "float64");
    if (x.dtype != FK_FLOAT16 && x.dtype != FK_BFLOAT16)
        return fk_fail(FK_ERR_TYPE, "%s: dtype code %d is unknown", op, (int)x.dtype);
    if (x.batch < 0 || x.sq < 0 || x.sk < 0 || x.heads < 0 || x.kv_heads < 0)
        return fk_fail(FK_ERR_VALUE, "%s: negative size (batch %lld, sq %lld, sk %lld, heads %lld, kv_heads %lld)",
                       op, (long long)x.batch, (long long)x.sq, (long long)x.sk, (long long)x.heads,
                       (long long)x.kv_heads);
    if (x.d < 8 || x.d > 256 || x.d % 8 != 0)
        return fk_fail(FK_ERR_VALUE, "%s: head dim d must be a multiple of 8 in 8..256, got %lld", op, (long long)x.d);
    if (x.heads > 0 && (x.kv_heads < 1 || x.heads % x.kv_heads != 0))
        return fk_fail(FK_ERR_VALUE, "%s: heads (%lld) must be a multiple of kv_heads (%lld)", op,
                       (long long)x.heads, (long long)x.kv_heads);
    if (x.window_left < -1 || x.window_right < -1)
        return fk_fail(FK_ERR_VALUE, "%s: window sizes must be >= -1, got (%lld, %lld)", op,
                       (long long)x.window_left, (long long)x.window_right);
    if (!std::isfinite(x.scale))
        return fk_fail(FK_ERR_VALUE, "%s: scale must be finite, got %g", op, x.scale);
    if ((x.cu_seqlens_q == nullptr) != (x.cu_seqlens_k == nullptr))
        return fk_fail(FK_ERR_VALUE, "%s: cu_seqlens_q and cu_seqlens_k must both be given or both be NULL", op);
    if (x.sq > INT32_MAX || x.sk > INT32_MAX)
        return fk_fail(FK_ERR_VALUE, "%s: sequence lengths must be < 2^31 (sq %lld, sk %lld)", op,
                       (long long)x.sq, (long long)x.sk);
    if (x.heads > 65535 || x.batch > (x.d > 128 ? 32767 : 65535))  // grid.y, grid.z (D 256 bwd: 2 z a sequence)
        return fk_fail(FK_ERR_VALUE, "%s: at most 65535 heads and %d sequences (heads %lld, batch %lld)", op,
                       x.d > 128 ? 32767 : 65535, (long long)x.heads, (long long)x.batch);
    if (!pointers || nothing_to_do(x, backward)) return FK_OK;
    // Empty sides may come as NULL (an empty torch tensor's data pointer).
    if (x.sq > 0 && (!x.q || !x.out || !x.lse || (backward && (!x.dout || !x.dq))))
        return fk_fail(FK_ERR_VALUE, "%s: q, out, lse%s must not be NULL", op, backward ? ", dout and dq" : "");
    if (x.sk > 0 && (!x.k || !x.v || (backward && (!x.dk || !x.dv))))
        return fk_fail(FK_ERR_VALUE, "%s: k, v%s must not be NULL", op, backward ? ", dk and dv" : "");
    return FK_OK;
}

Params params_of(const fk_attention_args &x, const Plan &plan) {
    const bool varlen = x.cu_seqlens_q != nullptr;
    Params p{};
    p.q = x.q, p.k = x.k, p.v = x.v, p.out = x.out, p.lse = static_cast<float *>(x.lse), p.dout = x.dout;
    p.dq = x.dq, p.dk = x.dk, p.dv = x.dv, p.cu_q = x.cu_seqlens_q, p.cu_k = x.cu_seqlens_k;
    p.batch = x.batch, p.sq = x.sq, p.sk = x.sk, p.heads = x.heads, p.kv_heads = x.kv_heads, p.d = x.d;
    p.q_batch = x.q_batch, p.q_row = x.q_row, p.q_head = x.q_head;
    p.k_batch = x.k_batch, p.k_row = x.k_row, p.k_head = x.k_head;
    p.v_batch = x.v_batch, p.v_row = x.v_row, p.v_head = x.v_head;
    p.o_batch = x.o_batch, p.o_row = x.o_row, p.o_head = x.o_head;
    p.do_batch = x.do_batch, p.do_row = x.do_row, p.do_head = x.do_head;
    p.scale = (float)x.scale, p.scale_log2 = (float)(x.scale * 1.4426950408889634);
    // A window wider than sq + sk is unbounded in effect; clamped, the kernels' bounds cannot overflow.
    p.window_left = x.window_left < 0 ? -1 : std::min(x.window_left, x.sq + x.sk);
    p.window_right = x.window_right < 0 ? -1 : std::min(x.window_right, x.sq + x.sk);
    p.top_left = (x.flags & FK_ATTN_TOP_LEFT) != 0;
    p.async = rows_aligned(x.q, x.q_batch, x.q_row, x.q_head, varlen) &&
              rows_aligned(x.k, x.k_batch, x.k_row, x.k_head, varlen) &&
              rows_aligned(x.v, x.v_batch, x.v_row, x.v_head, varlen) &&
              rows_aligned(x.out, x.o_batch, x.o_row, x.o_head, varlen) &&
              rows_aligned(x.dout, x.do_batch, x.do_row, x.do_head, varlen);
    p.splits = plan.splits;
    p.pack_gqa = plan.pack_gqa;
    float *ws = static_cast<float *>(x.workspace);
    if (plan.strategy == Strategy::kFwdSplitMmaSm80 ||
        (plan.strategy == Strategy::kFwdDecodeMmaSm80 && plan.splits > 1 && !plan.cluster)) {
        p.part_lse = ws;
        p.part_out = ws + split_lse_floats(plan.splits, x);
    } else if (plan.strategy == Strategy::kBwdMmaSm80 || plan.strategy == Strategy::kBwdWgmmaSm90 ||
               plan.strategy == Strategy::kBwdAtomicMmaSm80) {
        p.dvec = ws;
    } else if (plan.strategy == Strategy::kFwdWgmmaSm90 && plan.dynamic) {
        p.next_tile = static_cast<unsigned long long *>(x.workspace);
    }
    return p;
}

DeviceFacts device_facts(int device) {
    DeviceFacts dev;
    dev.sms = sm_count(device), dev.major = compute_major(device);
    dev.smem = smem_per_sm(device) - smem_reserved_per_cta(device);
    if (dev.major == 9 && kBuiltForSm90a)
        for (int k = 2; k <= kDecodeMaxCluster; k++)
            dev.decode_clusters[k] = decode_clusters_fit(device, k, decode_stages(128, dev.smem));
    return dev;
}

fk_status run(const fk_attention_args *args, int backward, int device, void *stream) {
    using namespace fk::attn;
    const char *op = backward ? "attention_bwd" : "attention_fwd";
    const fk_attention_args &x = *args;
    fk_status status = check_args(x, backward, op);
    if (status != FK_OK) return status;
    if (nothing_to_do(x, backward)) return FK_OK;
    FK_CUDA_ENTER(op, device);
    if (compute_major(device) < 8)
        return fk_fail(FK_ERR_RUNTIME, "%s: needs a GPU of compute capability 8.0 or newer", op);
    const Plan plan = plan_attention(x, backward, device_facts(device));
    if (plan.workspace_bytes > 0 && (x.workspace == nullptr || x.workspace_bytes < plan.workspace_bytes))
        return fk_fail(FK_ERR_VALUE, "%s: workspace of %lld bytes needed (fk_cuda_attention_workspace), got %lld",
                       op, (long long)plan.workspace_bytes, (long long)x.workspace_bytes);
    const Params p = params_of(x, plan);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (plan.strategy) {
    case Strategy::kFwdMmaSm80:
    case Strategy::kFwdSplitMmaSm80: return launch_fwd_mma_sm80(plan, p, x.dtype, device, s);
    case Strategy::kFwdDecodeMmaSm80: return launch_fwd_decode_mma_sm80(plan, p, x.dtype, device, s);
    case Strategy::kFwdWgmmaSm90: return launch_fwd_wgmma_sm90(plan, p, x.dtype, device, s);
    case Strategy::kBwdMmaSm80: return launch_bwd_mma_sm80(plan, p, x.dtype, device, s);
    case Strategy::kBwdAtomicMmaSm80: return launch_bwd_atomic_mma_sm80(plan, p, x.dtype, device, s);
    case Strategy::kBwdWgmmaSm90: return launch_bwd_wgmma_sm90(plan, p, x.dtype, device, s);
    default: return FK_OK;
    }
}

}  // namespace
}  // namespace fk::attn

extern "C" int64_t fk_cuda_attention_workspace(const fk_attention_args *args, int backward, int device) {
    if (fk::attn::check_args(*args, backward, backward ? "attention_bwd" : "attention_fwd", false) != FK_OK) return 0;
    fk::DeviceGuard guard(device);
    if (guard.error != cudaSuccess) return 0;
    return fk::attn::plan_attention(*args, backward, fk::attn::device_facts(device)).workspace_bytes;
}

extern "C" fk_status fk_cuda_attention_fwd(const fk_attention_args *args, int device, void *stream) {
    return fk::attn::run(args, 0, device, stream);
}

extern "C" fk_status fk_cuda_attention_bwd(const fk_attention_args *args, int device, void *stream) {
    return fk::attn::run(args, 1, device, stream);
}

extern "C" const char *fk_cuda_attention_plan(const fk_attention_args *args, int backward, int device) {
    if (fk::attn::check_args(*args, backward, backward ? "attention_bwd" : "attention_fwd", false) != FK_OK)
        return nullptr;
    fk::DeviceGuard guard(device);
    if (guard.error != cudaSuccess) return nullptr;
    return fk::attn::strategy_name(fk::attn::plan_attention(*args, backward, fk::attn::device_facts(device)).strategy);
}
