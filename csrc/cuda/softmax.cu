// Softmax / log-softmax on the GPU, reduced along the middle axis of an (outer, n, inner) array.
//
// Napkin math. Forward moves 1 read + 1 write per element, backward 2 reads (x, dy) + 1 write: the
// bytes for (16384, 4096) bf16 are 268 MB forward, i.e. 64 us at the H200's 4.2 TB/s copy rate,
// and the aim is >= 90% of that. At 4.2 TB/s an SM must retire ~4 bf16 elements per clock (128
// lane-instructions per clock: ~30 per element). The budget per element here is ~12: unpack, the
// scaled max, then exp as FFMA + FMUL + MUFU.EX2 (ex2.approx.ftz, ~2 ulp) once for the sum and once
// for the output, an add, a multiply by 1 / sum and half a pack. fp32 moves half the elements per
// byte but spends ~21 (the fp64 sums ~5; SASS of the 1024-wide backward: 688 instructions a lane
// for 32 elements, 712 with a select an element, 904 with libdevice's expf). ncu on an H200,
// before these cuts: 62-88% issue-active (9 of 12 kernels at 76-88%) at 39-77 instructions an fp32
// element and 22-39 a 16-bit one, so instructions per element are the budget to watch, not just
// bytes. Masks cost nothing on rows without one (kCausal is a template parameter), and out-of-row
// checks are per 16-byte access, not per element.
// Little's law: 4.2 TB/s x ~1 us latency = ~32 KB in flight per SM; every thread issues all loads of
// its slice (64 bytes) before it uses the first, so an SM has ~64 KB in flight.
// Launch: a kernel of 8 us (bf16 65536 x 128 forward) loses ~1 us to its launch and first load;
// programmatic dependent launch (fk::Launch, grid_dependency_sync) overlaps the launch and set-up
// with the previous kernel's tail: H200, back to back, 85-87 -> 93-94% of copy there.
// A warp-kernel grid that fits one wave (e.g. 3000 rows of 1000) is capped at ceil(CTAs / SMs)
// CTAs an SM (one_wave_smem), or the next call's early CTAs crowd the SMs that drain first.
//
// Strategies for inner == 1 (rows contiguous), by row length n:
//   n <= 1024     the fewest lanes of a warp that hold the row at 64 bytes a lane (backward: 32 of
//                 each of x and dy), e.g. 8 lanes for 128 fp32; row in registers, read once, and
//                 no branch around an access (zero-filled loads, selects). Scalar rows: 1..4 rows
//                 per lane group. 128-thread CTAs; one-warp CTAs for fp32 rows of 32 elements a
//                 lane on grids of more than one wave (with_warp_block).
//   backward, 1025-8192 (16-bit rows of whole packs, unmasked: 16384): one CTA of up to 512
//                 threads a row, each thread holding 8 elements of x and of dy in registers (16 past
//                 4096, or 16-bit past 2048 where DRAM is fast: kFastDramPerSm; 32 past
//                 8192), loaded at once (softmax_bwd_rows_packs; torch.compile's shape, with y
//                 recomputed).
//   forward, fp32, 1025-8192: the row-block kernel below, one CTA a row, 16 elements a thread in
//                 registers (32 past 4096) and each exp kept for the write pass (H100, against the
//                 shared-memory kernels: packed 1100 / 2048 / 4096 / 8192 97.2 / 98.9 / 98.6 / 94.2 -> 100.1 /
//                 99.9 / 99.3 / 96.5% of copy; ragged 2001 / 6001 94.7 -> 99.0).
//   longer, sm_90, tensors 16-byte aligned: the row slice is bulk-copied (TMA) into shared
//                 memory and read from there (a warp per row up to 8 KB of row data, else one CTA or
//                 a cluster of 32 KB CTAs per row, up to 112 KB when 32 KB ones cannot hold it, and
//                 unmasked forwards up to 224 KB, one CTA an SM, past that; see
//                 "row slices in shared memory" below; a backward whose x and dy outgrow that
//                 holds dy in registers, up to 128 KB of x a CTA; unmasked backward CTAs take 128
//                 threads, 256 where DRAM is slow: kSmemBwdSlowDramThreads). H200: 91-101% of copy
//                 on the issue's 4K-256K rows.
//   longer, other K CTAs per row (K = 1, else a thread-block cluster of up to 16 on sm_90), each
//                 thread holding 64 bytes (backward: 32 of x and 32 of dy) raw in registers per
//                 chunk, CTAs of up to 512 threads, and K the smallest power of two that leaves a CTA
//                 at most two chunks (a second chunk is re-read from L2, which measured cheaper on an
//                 H100 than a larger cluster or 256-thread CTAs). One combined reduction of (max, sum
//                 of exp) pairs (backward: the two sums) per row: warp shuffles, one __syncthreads,
//                 and for clusters one exchange through distributed shared memory (each CTA sends
//                 its pair into every peer with st.async; see row_reduce). Looped slices take an online
//                 max / rescaled-sum pass, then the write pass re-reads them, last chunk first (the
//                 last is still in registers). fp32 slices that fit one chunk instead reduce the
//                 exact max first and keep each exp for the write pass (one exp per element
//                 instead of two: measured faster with libdevice's expf,
//                 within a point either way with ex2.approx, H200); 16-bit ones measured faster
//                 with the single reduction and a second ex2.approx.
//   ragged rows (n not a multiple of 16 bytes, tensors 16-byte aligned): the same kernels through
//                 the 16-byte accesses covering each row (row_lead), the shared-memory ones in their
//                 masked instances, bulk-copying each slice from its 16-byte aligned start; tensors
//                 not 16-byte aligned, and masked ragged rows that a warp holds, the scalar path
//                 (VEC 1).
// inner > 1 (columns x[o, :, i]): columns of up to 2048 elements (backward 1024) a CTA, or up to 16
// CTAs of them in a cluster, take the column tile: 8 rows of 16 bytes of adjacent columns a thread
// (fp32 backwards of up to 64 rows: 4; fp32 forwards 4 up to 512 rows, else 16), in registers, so x
// is read once (H100, against the looped kernels: 17-60 -> 50-94% of copy forward, 33-84 -> 56-100
// backward). Longer columns: the same clusters in chunks of rows (x read three times forward, x and
// dy twice backward). Where one column a thread's looped grid covers the SMs: a thread per (outer,
// inner) column, 32 of them per warp so loads stay coalesced, up to 8..32 threads splitting n,
// online max / sum down n, then a write pass (x read twice).
//
// Numerics: fp32 arithmetic; fp32 data sums rows in fp64 (RowSum). The max is taken of x * scale
// rounded (__fmul_rn), and exponents are fmaf(x, scale, -max): exact near the max, where the
// output's mass is, so ex2.approx(that * log2(e)) costs ~2 ulp there, as libdevice's expf does
// (exp_ftz). y = e / sum (fp32) or e * (1 / sum) (16-bit outputs round far coarser). Masked keys
// and all -inf rows contribute nothing to the sum, so fully masked or all -inf rows give 0 *
// (1 / 0) = NaN and rows with +inf / NaN give NaN, exactly as torch.softmax after
// masked_fill(-inf). The row statistic saved for backward is the row max m of the scaled, masked
// row; backward recomputes y' = exp(fmaf(x, scale, -m)) and divides by z = sum y', exactly the
// forward's formula: the exponent is exact near the max, where the mass is. (Saving row_max = m +
// log(s) instead put a rounding of ulp(log s) into every dominant exponent: fp32 gradients at up to
// 4x torch's error.)
#include <cooperative_groups.h>

#include <type_traits>

#include "common.cuh"

namespace {

namespace cg = cooperative_groups;

constexpr int kWarpMaxN = 1024;     // longest row the warp kernel holds (32 lanes x 32 elements)
constexpr int kWarpBlock = 128;     // threads per CTA of the warp kernels (but see with_warp_block)
constexpr int kCtaChunks = 2;       // chunks a CTA loops over before rows take a cluster
constexpr int kBlockThreads = 512;  // most threads per CTA of the row-block kernels: 2 CTAs / SM
constexpr int kMaxCluster = 16;

// Keys of row `row` at or beyond the returned length are masked.
// causal_sq 1 (ragged rows through the masked kernels) needs no division, and one that fits 32 bits
// takes a 32-bit one: a 64-bit `%` is a ~90-instruction routine, run three times in thread 0's
// path to its first bulk copy by the shared-memory kernels (H100, bf16 ragged (32768, 4097)
// forward 83 -> 87% of copy).
__device__ __forceinline__ int64_t causal_len(int64_t row, int64_t n, int64_t causal_sq) {
    if (causal_sq == 1) return n;
    const int64_t query = (row | causal_sq) >> 32 ? row % causal_sq : (uint32_t)row % (uint32_t)causal_sq;
    const int64_t len = query + 1 + n - causal_sq;
    return len < 0 ? 0 : (len > n ? n : len);
}

// e^t is fk::exp_ftz: one FMUL and MUFU.EX2 (ex2.approx.ftz, ~2 ulp for the exponents near 0 that
// carry the row's mass, plus the product's rounding, |t| x 2^-24 relative, where e^t is small;
// results below 2^-126 flush to 0, irrelevant next to the max), as torch.compile's Triton kernels
// take. fp32 took libdevice's expf (~9 instructions: ex2.approx of the exactly reduced fraction,
// then 2^j) before the exponents were made exact near the max; with them, ex2.approx measured fp32
// (3000,1000) about 1 point of copy faster backward and 2 forward (H200). The looped column
// kernels, for columns the tile cannot hold, still take expf (not measured).
using fk::exp_ftz;

// The fp32 warp backward's exp, where a gradient's cancellation (dx = y (dy - sum dy y)) puts a
// row's exp errors whole into a small dx: rows one at a time against the tests' 2x-torch bound
// (20000 draws of each length, benchmarks/row_tails.py, H200) crossed it in 12-18 rows of 64 and
// 128 and in 4-15 of 96, 127, 197, 257 and 1000 with ex2.approx, and in 0-2 with expf (the worst
// row at 1.31 of the bound, where torch's own error was lucky), the 99.9th percentile of a length
// 0.81-0.99 -> 0.72-0.77. The 16-byte instances take expf, and measured level or faster with it (x
// torch.compile, (16384, 1000) 0.988 -> 0.999, (3000,1000) 1.048 -> 1.069, the rest within 0.4%);
// the scalar instances (ragged rows past kRaggedFp32BwdMax) keep ex2.approx: expf lost 9% at 257,
// where half the lanes' slots lie past the row and take an exp too. Elsewhere expf lost: the fp32
// column tile 37-39%, the shared-memory backward 1-3%; rows of 4096 (the row-block backward)
// measured none past the bound with ex2.approx, longer rows and columns were not measured. 16-bit
// gradients round far coarser than either.
template <typename T, int VEC> __device__ __forceinline__ float exp_warp_bwd(float t) {
    if constexpr (std::is_same_v<T, float> && VEC > 1) return expf(t);
    else return exp_ftz(t);
}

// exp is taken relative to the max, or to 0 while the max is -inf, so that -inf - -inf never
// turns a partial sum into NaN before a finite value arrives.
__device__ __forceinline__ float exp_ref(float m) { return m == -INFINITY ? 0.f : m; }

// s was accumulated against exp_ref(from); re-express it against to >= from, in s's precision A:
// an fp64 sum (fp32 data) takes the difference and the exp in fp64, an fp32 sum accurate expf. It
// runs once per partial sum, and one factor scales many elements; from == to needs no exp (the
// factor is exactly 1; a sum against an infinite max is NaN already, from its own +inf element).
template <typename A> __device__ __forceinline__ A rescale(A s, float from, float to) {
    if (from == -INFINITY || from == to) return s;
    if constexpr (std::is_same_v<A, double>) return s * exp((double)from - (double)to);
    else return s * expf(from - to);
}

// fp32 output is e / s correctly rounded, as torch divides: q = e * (1 / s) and one remainder step
// (exact for e in [0, 1], s in [1, n], the softmax range), three instructions against an IEEE
// division's eight and a slow-path branch. 16-bit output rounds far coarser than 1 / s does.
template <typename T> __device__ __forceinline__ float normalize(float e, float s, float inv_s) {
    if constexpr (std::is_same<T, float>::value) {
        const float q = e * inv_s;
        return fmaf(fmaf(-q, s, e), inv_s, q);
    } else {
        return e * inv_s;
    }
}

// VEC == Pack<T>::N: one 16-byte access; VEC == 1: the scalar path for misaligned or odd rows.
template <typename T, int VEC>
using Raw = typename std::conditional<VEC == 1, T, fk::Pack<T>>::type;

// An L2 cache policy that evicts the lines it covers last (sm_80+).
__device__ __forceinline__ uint64_t l2_evict_last() {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// A pack of x (or dy) for the one-CTA-a-row register kernels: fp32 under an L2 evict_last policy,
// as Triton's first-pass loads. Same-process A/B, x torch.compile: the pack backward (H200), fp32
// (16384, 4096) 0.997-0.999 -> 1.006-1.009x; the row-block forward (H100), fp32 (16384, 4096) 0.995
// -> 1.000x, (32768, 2048) 0.992 -> 0.998x, (8192, 8192) 0.994 -> 1.001x. 16-bit loads lost 0.7-2.3%
// with it in the pack backward (every row length measured, 2048-8192, timed after torch.compile's
// kernel; see bench.release_kept_l2_lines) and take it only where kKeep says (the pack backward's
// rows past 4096).
template <typename T, bool kKeep = std::is_same_v<T, float>>
__device__ __forceinline__ fk::Pack<T> load_pack_kept(const T *p) {
    if constexpr (kKeep) {
        fk::Pack<T> out;
        uint4 &r = *reinterpret_cast<uint4 *>(&out);
        asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p), "l"(l2_evict_last()));
        return out;
    } else {
        return fk::load_pack(p);
    }
}

template <typename T, int VEC> __device__ __forceinline__ Raw<T, VEC> load_raw(const T *p) {
    if constexpr (VEC == 1) return __ldg(p);
    else return fk::load_pack(p);
}

// The access at p when `in`, else zeros: the passes then compute every element and select, with
// no branch around each access (branches kept each exp's dependent chain from overlapping the next).
template <typename T, int VEC> __device__ __forceinline__ Raw<T, VEC> load_or_zero(const T *p, bool in) {
    Raw<T, VEC> r;
    if constexpr (VEC == 1) r = T(0.f);
    else *reinterpret_cast<uint4 *>(&r) = make_uint4(0, 0, 0, 0);
    if (in) r = load_raw<T, VEC>(p);
    return r;
}

// Converted a 32-bit word at a time (fk::pack_f32): element by element, the zero-filled bf16 loads
// were moved a 16-bit half at a time (two PRMT an element: the bf16 warp backward of 1000-wide rows
// took 664 instructions a lane, now 584, and 80 registers, now 64).
template <typename T, int VEC> __device__ __forceinline__ float raw_at(const Raw<T, VEC> &r, int k) {
    if constexpr (VEC == 1) return fk::to_f32(r);
    else return fk::pack_f32<T>(r, k);
}

// kPtx: the 16-byte store through inline PTX (see store_in). kStream: as st.global.cs, a streaming
// store whose lines L2 evicts first; the shared-memory kernels' write passes take it. H100,
// same-process A/B, kept L2 lines released before each sample: fp32 forwards (4096, 16384) 98.1 ->
// 99.3% of copy, (1024, 65536) 98.1 -> 99.3, (256, 262144) 93.5 -> 96.8; bf16 (4096, 16384) 94.2 ->
// 95.8, (256, 262144) backward 95.3 -> 96.3; others up 0.7 or within 0.4, but the scaled causal
// forward lost 0.5. In every kernel it had cost the lane-group and row-block kernels up to 9
// points (fp32 (3000, 1000) backward 102.5 -> 93.9).
template <typename T, int VEC, bool kPtx = false, bool kStream = false>
__device__ __forceinline__ void store_vec(T *p, const float *v) {
    if constexpr (VEC == 1) {
        *p = fk::from_f32<T>(v[0]);
    } else {
        fk::Pack<T> out;
#pragma unroll
        for (int k = 0; k < VEC; k++) out.v[k] = fk::from_f32<T>(v[k]);
        const uint4 w = *reinterpret_cast<const uint4 *>(&out);
        if constexpr (kStream) {
            asm volatile("st.global.cs.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w)
                         : "memory");
        } else if constexpr (kPtx) {
            asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w)
                         : "memory");
        } else {
            fk::store_pack(p, out);
        }
    }
}

// Stores the elements of the VEC at p (frame index j, with j < hi) that lie in [lo, hi): one
// 16-byte store when all do. kRagged: lo and hi need not fall on access boundaries; the whole
// access is then stored through inline PTX, as with plain C++ stores the compiler split it into
// 4-byte stores in every masked and ragged instance (the masked shared-memory forward: no 16-byte
// store at all, bf16 elements in 2-byte stores). kStream: see store_vec.
template <typename T, int VEC, bool kRagged, bool kStream = false>
__device__ __forceinline__ void store_in(T *p, const float *v, int j, int lo, int hi) {
    if (!kRagged || VEC == 1 || (j >= lo && j + VEC <= hi)) {
        store_vec<T, VEC, kRagged, kStream>(p, v);
    } else {
#pragma unroll
        for (int k = 0; k < VEC; k++)
            if (j + k >= lo && j + k < hi) p[k] = fk::from_f32<T>(v[k]);
    }
}

// Ragged rows: in 16-byte aligned tensors whose rows are not a multiple of 16 bytes (n % VEC != 0,
// e.g. a 50257-word vocabulary or 197 ViT tokens), a row starting at element row * n is read as
// the aligned accesses covering it, a frame starting `lead` elements before the row; its elements
// are frame indices [lead, lead + n). Unmasked, the warp and in-register kernels take them in
// their kRagged instances (unragged, below), the row-block and shared-memory kernels in their
// masked ones with causal_sq 1 (every key in; the bulk copies start at the frame, 16-byte aligned);
// masked ragged rows that a warp holds take the scalar path. The first
// and last accesses of a row are partly another row's: read, but written element by element
// (store_in). The tensor's last access may read up to 15 bytes past its end, within its 16-byte
// block, so within a mapped page (torch's allocator rounds blocks up to 512 bytes). Packed rows
// have lead 0. H200, against the scalar path, x torch.compile: bf16 (4096, 50257) forward 0.71 ->
// 1.66x, backward 0.75 -> 1.28x; bf16 (131072, 1100) backward 0.67 -> 1.13x. The shared-memory
// kernels then took long rows from the row-block kernel (H100, % of copy, forward / backward):
// bf16 (4096, 50257) 78 / 78 -> 98 / 99, (256, 250001) 75 / 73 -> 94 / 94; fp32 (4096, 50257)
// 80 / 80 -> 98 / 99, (1024, 65543) 61 / 56 -> 97 / 100; 16-bit forwards of 1025-8192 from one CTA
// a row in registers, bf16 (131072, 1100) 87 -> 95, (16384, 6001) 92 -> 97, but (32768, 4097) 94 -> 81
// (now 97: causal_len and kMaskedWarpPacks).
template <int VEC> __device__ __forceinline__ int row_lead(int64_t row, int64_t n) {
    return VEC == 1 ? 0 : (int)((row * n) & (VEC - 1));
}

// zero(k) for the elements k of the access at frame index j that lie outside [lo, hi).
template <int VEC, typename Zero> __device__ __forceinline__ void zero_each_outside(int j, int lo, int hi, Zero zero) {
#pragma unroll
    for (int k = 0; k < VEC; k++)
        if (j + k < lo || j + k >= hi) zero(k);
}

// Ragged rows without a mask (kRagged): every access is taken as a whole (accesses wholly past
// the row as zeros, as for packed rows), then in an access at frame index j that straddles an end
// of the row [lo, hi), the values outside it are zeroed (zero(k)) before they join the row's
// reductions: one test an access, where the masked instances tested every element.
template <int VEC> __device__ __forceinline__ bool straddles(int j, int lo, int hi) {
    return j < hi && (j < lo || j + VEC > hi);
}
template <int VEC, typename Zero> __device__ __forceinline__ void unragged(int j, int lo, int hi, Zero zero) {
    if (straddles<VEC>(j, lo, hi)) zero_each_outside<VEC>(j, lo, hi, zero);
}

// The shared-memory kernels' masked instances (causal or ragged rows) likewise: an access at frame
// index j that reaches outside the keys [lo, hi) (straddling an end, or wholly outside: there the
// slice holds stale values) is zeroed outside them. Testing every element instead took a select and
// a branch region each: bf16 backward of ragged rows at 41-54% of copy, against 78% for the
// row-block kernel (H100).
template <int VEC> __device__ __forceinline__ bool reaches_out(int j, int lo, int hi) {
    return j < lo || j + VEC > hi;
}
template <int VEC, typename Zero> __device__ __forceinline__ void zero_outside(int j, int lo, int hi, Zero zero) {
    if (reaches_out<VEC>(j, lo, hi)) zero_each_outside<VEC>(j, lo, hi, zero);
}

// Largest x * scale (rounded, as __fmul_rn) over a 16-byte pack: the max and min of the raw values
// (16-bit: packed pair instructions, 8 elements in 3 + 3), then one multiply, taking the min when
// scale < 0 (rounding is monotonic, so this is the max of the rounded products). NaN elements are
// skipped here, as fmaxf skips them; their exp then turns the row's sum into NaN.
template <typename T> __device__ __forceinline__ float pack_max_scaled(const fk::Pack<T> &v, float scale) {
    float hi, lo;
    if constexpr (std::is_same_v<T, float>) {
        hi = fmaxf(fmaxf(v.v[0], v.v[1]), fmaxf(v.v[2], v.v[3]));
        lo = fminf(fminf(v.v[0], v.v[1]), fminf(v.v[2], v.v[3]));
    } else {
        using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
        const T2 *p = reinterpret_cast<const T2 *>(v.v);
        const T2 h = __hmax2(__hmax2(p[0], p[1]), __hmax2(p[2], p[3]));
        const T2 l = __hmin2(__hmin2(p[0], p[1]), __hmin2(p[2], p[3]));
        hi = fmaxf(fk::to_f32(h.x), fk::to_f32(h.y));
        lo = fminf(fk::to_f32(l.x), fk::to_f32(l.y));
    }
    return __fmul_rn(scale >= 0.f ? hi : lo, scale);
}

// Per-row statistics combined across lanes, warps and CTAs: (max, sum of exp relative to it) for
// the forward pass (V: float2, or double2 for fp32 data, whose sums are fp64; x holds the fp32 max
// exactly; group_reduce combines these pairs its own way, below), a max alone, or two plain sums
// for the backward pass.
template <typename V> struct MaxSum {
    static __device__ __forceinline__ V identity() { return V{-INFINITY, 0}; }
};
struct MaxOnly {
    static __device__ __forceinline__ float2 identity() { return make_float2(-INFINITY, 0.f); }
    static __device__ __forceinline__ float2 combine(float2 a, float2 b) {
        return make_float2(fmaxf(a.x, b.x), 0.f);
    }
};
template <typename V> struct SumSum {  // V: float2, or double2 for the fp32 backward's sums
    static __device__ __forceinline__ V identity() { return V{0, 0}; }
    static __device__ __forceinline__ V combine(V a, V b) { return V{a.x + b.x, a.y + b.y}; }
};
template <typename Op> constexpr bool kIsMaxSum = false;
template <typename V> constexpr bool kIsMaxSum<MaxSum<V>> = true;

// The backward's sums (z = sum y', a = sum dy * y'): fp64 for fp32 data. A row dominated by one
// key has dx there = y (dy - a / z) ~ 0, so every rounding of a and z lands in the result (fp32
// sums left single rows at 3x torch's error). fp16 / bf16 outputs round far coarser than fp32.
template <typename T> using Acc = std::conditional_t<std::is_same_v<T, float>, double, float>;
template <typename T> using Acc2 = std::conditional_t<std::is_same_v<T, float>, double2, float2>;

// One lane's running row sum: fp64 for fp32 data (one F2F.F64 and one DADD per term), rounded to
// fp32 once at the end. A row dominated by one key has y ~ 1 there and dx ~ 0 there, so every
// rounding of a running sum near 1 lands in those results: plain fp32 lane sums left single fp32
// rows at 3-25x torch's error (forward: 1.65e-7 against 6.4e-9, n = 1000). TwoSum / TwoProduct
// pairs in fp32 are as exact but cost 7-10 instructions a term against two (the kernels are
// instruction-bound: ncu on an H200 showed up to 88% issue-active). A product dy * y' is rounded
// to fp32 once before it joins the sum, as torch rounds its own: exact where it matters (y' = 1
// at the max), and one conversion instead of two and a DFMA (fp32 (32768, 1024) backward 94 -> 99%
// of copy, H200). 16-bit data: plain fp32 sums (their outputs round far coarser).
template <typename T> struct RowSum {
    Acc<T> s = 0;
    __device__ __forceinline__ void add(float v) { s += (Acc<T>)v; }
    __device__ __forceinline__ void add_product(float g, float y) {
        if constexpr (std::is_same_v<Acc<T>, double>) s += (double)(g * y);
        else s = fmaf(g, y, s);
    }
    __device__ __forceinline__ Acc<T> value() const { return s; }
};

// The backward's two sums: z = sum y', a = sum dy * y' (log: sum dy).
template <typename T, bool kLog> struct BwdSums {
    RowSum<T> z, a;
    __device__ __forceinline__ void add(float y, float g) {
        z.add(y);
        if (kLog) a.add(g);
        else a.add_product(g, y);
    }
    __device__ __forceinline__ Acc2<T> value() const { return Acc2<T>{z.value(), a.value()}; }
};

// The forward's row sum of exps over the lanes `reduce` combines (a SumSum reduction of Acc2<T>),
// rounded to fp32 once.
template <typename T, typename Reduce>
__device__ __forceinline__ float row_sum(const RowSum<T> &sum, Reduce reduce) {
    return (float)reduce(Acc2<T>{sum.value(), 0}).x;
}

// dx for one element from the row's sums, in fp32 arithmetic: a / z is carried as a_hi + a_lo, so
// dy - a / z keeps its accuracy where it cancels (dy - a_hi is exact there) without converting every
// element to fp64 (F2F.F64 issues at 16 per clock per SM: it cost 13% on the fp32 backward).
// 16-bit outputs fold scale and 1 / z into one factor per row (c) and take y' (c g - c a): an FFMA
// and a multiply an element where (y' c)(g - a) took three instructions, and roundings of fp32 that
// their own rounding dwarfs (c a's is ulp(c a), the size of torch's own rounding of a). fp32
// softmax takes y' c ((g - a_hi) - a_lo): c = scale / z rounds once a row where scale * (...) rounded
// once an element (the same for scale 1, where c is 1 / z), one multiply an element fewer.
template <typename T> struct BwdRow {
    static constexpr bool kSplit = std::is_same_v<T, float>;  // 16-bit: a_lo is 0
    float inv_z, a_hi, a_lo, scale, c, ca;
    BwdRow() = default;
    __device__ __forceinline__ BwdRow(Acc<T> z, Acc<T> a, bool is_log, float scale_) : scale(scale_) {
        const Acc<T> inv = 1 / z, a_z = is_log ? a : a * inv;
        inv_z = (float)inv;
        a_hi = (float)a_z;
        a_lo = kSplit ? (float)(a_z - (Acc<T>)a_hi) : 0.f;
        c = is_log ? scale * inv_z * a_hi : scale * inv_z;
        ca = c * a_hi;
    }
    template <bool kLog> __device__ __forceinline__ float dx(float y_unnorm, float g) const {
        if (!kSplit) return kLog ? fmaf(-y_unnorm, c, scale * g) : y_unnorm * fmaf(c, g, -ca);
        if (!kLog) return y_unnorm * c * ((g - a_hi) - a_lo);
        const float y = y_unnorm * inv_z;
        return scale * (fmaf(-y, a_hi, g) - y * a_lo);
    }
};

// Reduction over the `group` lanes (a power of two <= 32) that share a row. (max, sum) pairs take
// the max first, then each lane rescales its sum once and the sums add: one exp a lane, not one
// per level (an fp64 exp is ~40 instructions).
template <typename Op, typename V> __device__ __forceinline__ V group_reduce(V v, int group) {
    if constexpr (kIsMaxSum<Op>) {
        const float m = group_reduce<MaxOnly>(make_float2((float)v.x, 0.f), group).x;
        return V{m, group_reduce<SumSum<V>>(V{rescale(v.y, (float)v.x, exp_ref(m)), 0}, group).x};
    } else {
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            if (offset < group) {
                const V other{__shfl_xor_sync(0xffffffffu, v.x, offset), __shfl_xor_sync(0xffffffffu, v.y, offset)};
                v = Op::combine(v, other);
            }
        }
        return v;
    }
}

// Shared memory of one row-block reduction: a pair per warp, then a pair per CTA of the cluster.
// A kernel that reduces twice uses two, so no slot is ever reused.
template <typename V, int kWarpSlots = kBlockThreads / 32> struct RowReduceSmem {
    V warp[kWarpSlots];
    V cta[kMaxCluster];
    uint64_t landed;  // cluster exchange: completes when every CTA's pair has landed in cta[]
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

// A one-shot mbarrier expecting one arrival (thread 0's, with the bytes it announces).
__device__ __forceinline__ void mbar_init(uint64_t *bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)) : "memory");
}

// Thread 0's one arrival on `bar`, announcing the bytes the copies after it deliver.
__device__ __forceinline__ void mbar_expect(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t *bar) {
    asm volatile("{\n.reg .pred done;\nWAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n"
                 "@!done bra WAIT;\n}" ::"r"(smem_u32(bar))
                 : "memory");
}

// Split cluster barrier: the early arrive tells peers this CTA has started (so its shared memory
// may be written); the wait before the first remote write then costs nothing.
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }

// The shared::cluster address of `p`'s counterpart in the CTA of cluster rank `rank`.
__device__ __forceinline__ uint32_t peer_u32(const void *p, int rank) {
    uint32_t a;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem_u32(p)), "r"(rank));
    return a;
}

// Writes v to a peer's shared memory (st.async), counted on that peer's mbarrier `bar`.
__device__ __forceinline__ void send_to_peer(uint32_t dst, float2 v, uint32_t bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];"
                 ::"r"(dst), "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(bar) : "memory");
}
__device__ __forceinline__ void send_to_peer(uint32_t dst, double2 v, uint32_t bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b64 [%0], {%1, %2}, [%3];"
                 ::"r"(dst), "l"(__double_as_longlong(v.x)), "l"(__double_as_longlong(v.y)), "r"(bar) : "memory");
}
#endif

// Start of a kernel: thread 0 readies the CTA's `count` one-shot copy mbarriers `bar` (one arrival
// each: thread 0's, plus the copied bytes) and, when its rows take a cluster of K CTAs, the
// mbarrier of each exchange `reds` for the K pairs it will receive; one fence and one
// __syncthreads for all of them; then with a cluster every thread arrives on the cluster barrier,
// which peers wait on before their first write into this CTA (row_reduce). Last, the wait for the
// previous kernel (fk::grid_dependency_sync): the set-up above overlaps its tail.
template <typename... V>
__device__ __forceinline__ void kernel_start(uint64_t *bar, int count, int cluster_k, RowReduceSmem<V> &...reds) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const bool exchange = cluster_k > 1;
    if (count > 0 || exchange) {
        if (threadIdx.x == 0) {
            for (int i = 0; i < count; i++) mbar_init(&bar[i]);
            auto ready = [&](auto &red) {
                mbar_init(&red.landed);
                mbar_expect(&red.landed, (uint32_t)(cluster_k * sizeof(red.cta[0])));
            };
            if (exchange) (ready(reds), ...);
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncthreads();
        if (exchange) cluster_arrive_relaxed();
    }
#endif
    fk::grid_dependency_sync();
}

// Reduction over the CTA, then over the K CTAs of the row's cluster; every thread gets the result.
// One __syncthreads; with a cluster, warp 0 sends the CTA's pair into every peer's smem (st.async,
// counted on the peer's mbarrier) and each CTA waits only for its own K pairs to land: no cluster
// barrier, whose release fence (MEMBAR.ALL.GPU) every thread paid. The kernel's first exchange
// (`first`) waits on the arrive made in kernel_start, so no pair lands on an unready barrier.
template <typename Op, typename V, int kWarpSlots>
__device__ __forceinline__ V row_reduce(V v, RowReduceSmem<V, kWarpSlots> &smem, int cluster_k, bool first = true) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = group_reduce<Op>(v, 32);
    if (lane == 0) smem.warp[warp] = v;
    __syncthreads();
    v = group_reduce<Op>(lane < warps ? smem.warp[lane] : Op::identity(), 32);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (cluster_k > 1) {
        if (first) cluster_wait();  // pairs with the arrive in kernel_start
        if (warp == 0 && lane < cluster_k)
            send_to_peer(peer_u32(&smem.cta[cg::this_cluster().block_rank()], lane), v, peer_u32(&smem.landed, lane));
        mbar_wait(&smem.landed);
        v = group_reduce<Op>(lane < cluster_k ? smem.cta[lane] : Op::identity(), 32);
    }
#endif
    return v;
}

// ---- rows of up to 1024 elements: a lane group per row ---------------------------------------

// Rows per lane group: enough that each lane has >= 64 bytes of loads in flight.
template <typename T, int C> __host__ __device__ constexpr int warp_rows() {
    constexpr int rows = 64 / (C * (int)sizeof(T));
    return rows < 1 ? 1 : (rows > 4 ? 4 : rows);
}

// A warp kernel's lane group: `group` lanes (a power of two) share each of its ROWS consecutive rows
// from `first`; this lane is lane `li` of the group, and its access p of a row's frame sits at
// col(p). frame(): a row's lead (row_lead) and the end of its keys in the frame (0 past the last
// row).
template <int VEC> struct LaneGroup {
    int group, li;
    int64_t first;
    template <int kThreads, int ROWS> static __device__ __forceinline__ LaneGroup of(int group) {
        const int lane = threadIdx.x & 31;
        const int64_t warp = (int64_t)blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5);
        return LaneGroup{group, lane & (group - 1), (warp * (32 / group) + lane / group) * ROWS};
    }
    __device__ __forceinline__ int col(int p) const { return (p * group + li) * VEC; }
    template <bool kRagged, bool kCausal>
    static __device__ __forceinline__ void frame(int64_t row, int64_t rows, int n, int64_t causal_sq, int &lead,
                                                 int &valid) {
        lead = kRagged ? row_lead<VEC>(row, n) : 0;
        valid = row >= rows ? 0 : lead + (kCausal ? (int)causal_len(row, n, causal_sq) : n);
    }
    // stores a row's outputs; `out` is its frame's start, value(p, k) element k of access p
    template <typename T, int P, bool kRagged, typename Value>
    __device__ __forceinline__ void store(T *out, int lead, int n, Value value) const {
#pragma unroll
        for (int p = 0; p < P; p++) {
            if (col(p) < lead + n) {
                float o[VEC];
#pragma unroll
                for (int k = 0; k < VEC; k++) o[k] = value(p, k);
                store_in<T, VEC, kRagged>(out + col(p), o, col(p), lead, lead + n);
            }
        }
    }
};

// C elements per lane (C / VEC accesses); G lanes per row (0: `group_arg`, known at run time),
// group * C >= n. A compile-time G folds the reductions' level tests away.
template <typename T, int VEC, int C, int G, bool kCausal, bool kLog, int kThreads, bool kRagged = false>
__global__ void __launch_bounds__(kThreads)
softmax_fwd_rows_warp(int64_t rows, int n, int group_arg, const T *__restrict__ x, T *__restrict__ y,
                      float *__restrict__ row_max, float scale, int64_t causal_sq) {
    fk::grid_dependency_sync();
    constexpr int ROWS = warp_rows<T, C>(), P = C / VEC;
    const auto lg = LaneGroup<VEC>::template of<kThreads, ROWS>(G ? G : group_arg);

    Raw<T, VEC> raw[ROWS][P];
    int lead[ROWS], valid[ROWS];  // the row's frame (row_lead): keys are [lead, valid)
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int64_t row = lg.first + r;
        LaneGroup<VEC>::template frame<kRagged, kCausal>(row, rows, n, causal_sq, lead[r], valid[r]);
#pragma unroll
        for (int p = 0; p < P; p++) {
            const int col = lg.col(p);
            raw[r][p] = load_or_zero<T, VEC>(x + row * n - lead[r] + col, col < valid[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int64_t row = lg.first + r;
        // element k of access p is a key: without a mask whole accesses are in or out (n % VEC == 0)
        auto is_key = [&](int p, int k) {
            const int col = lg.col(p);
            return kCausal ? col + k < valid[r] : col < valid[r];
        };
        float m = -INFINITY;
#pragma unroll
        for (int p = 0; p < P; p++) {
            if constexpr (VEC > 1 && !kCausal) {
                const int col = lg.col(p);
                float pm = is_key(p, 0) ? pack_max_scaled<T>(raw[r][p], scale) : -INFINITY;
                if (kRagged && straddles<VEC>(col, lead[r], valid[r])) {  // the row's elements only
                    pm = -INFINITY;
#pragma unroll
                    for (int k = 0; k < VEC; k++)
                        if (col + k >= lead[r] && col + k < valid[r]) pm = fmaxf(pm, __fmul_rn(raw_at<T, VEC>(raw[r][p], k), scale));
                }
                m = fmaxf(m, pm);
            } else {
#pragma unroll
                for (int k = 0; k < VEC; k++) {
                    const float v = __fmul_rn(raw_at<T, VEC>(raw[r][p], k), scale);
                    m = fmaxf(m, is_key(p, k) ? v : -INFINITY);
                }
            }
        }
        m = group_reduce<MaxOnly>(make_float2(m, 0.f), lg.group).x;
        const float ref = exp_ref(m);
        float e[C];  // one exp per element, kept for the output
        RowSum<T> sum;
#pragma unroll
        for (int p = 0; p < P; p++) {
#pragma unroll
            for (int k = 0; k < VEC; k++) {
                const float ek = exp_ftz(fmaf(raw_at<T, VEC>(raw[r][p], k), scale, -ref));
                e[p * VEC + k] = is_key(p, k) ? ek : 0.f;
            }
            if (kRagged) unragged<VEC>(lg.col(p), lead[r], valid[r], [&](int k) { e[p * VEC + k] = 0.f; });
#pragma unroll
            for (int k = 0; k < VEC; k++) sum.add(e[p * VEC + k]);
        }
        const float s = row_sum(sum, [&](Acc2<T> v) { return group_reduce<SumSum<Acc2<T>>>(v, lg.group); });
        const float inv_s = 1.f / s, log_s = logf(s);
        if (row < rows) {
            if (lg.li == 0 && row_max) row_max[row] = m;
            lg.template store<T, P, kRagged>(y + row * n - lead[r], lead[r], n, [&](int p, int k) {
                if (kLog) return is_key(p, k) ? fmaf(raw_at<T, VEC>(raw[r][p], k), scale, -ref) - log_s : -INFINITY - log_s;
                return normalize<T>(e[p * VEC + k], s, inv_s);
            });
        }
    }
}

// fp32 with 32 elements a lane: capped at 80 registers (6 CTAs an SM instead of 5): 1024-wide rows
// 78 -> 82% of copy on an H200. The one-warp CTAs of grids past a wave (with_warp_block) are capped
// at 128 registers instead, 16 an SM rather than 24 (H100, same-process A/B, six rounds: (32768,
// 1024) 98.1-99.7 -> 99.6-100.2% of copy, 0.999 -> 1.005x torch.compile; (16384, 1000) 0.998 ->
// 1.006x; (65536, 1024) 0.999 -> 1.004x; 20 an SM gained half as much). Without a mask a lane's
// accesses are whole keys or zero-filled non-keys, so a non-key access takes its exps against +inf
// instead of the row max (exp(0 * scale - inf) = 0, the same zero the select gave): one select an
// access, not one an element. SASS of the fp32 1024-wide backward: 712 -> 688 instructions a lane
// (80 registers, no spills, either way), and its (3000, 1000) rows went from 88-90 to 94-96% of
// copy (H200, same-process A/B); other shapes level. (The forward, with the same change, measured
// level to -1.5 points, so it keeps its select.)
template <typename T, int VEC, int C, int G, bool kCausal, bool kLog, int kThreads, bool kRagged = false>
__global__ void __launch_bounds__(kThreads, !std::is_same_v<T, float> || C != 32 ? 1 : kThreads == 32 ? 16 : 6)
softmax_bwd_rows_warp(int64_t rows, int n, int group_arg, const T *__restrict__ dy, const T *__restrict__ x,
                      const float *__restrict__ row_max, T *__restrict__ dx, float scale, int64_t causal_sq) {
    fk::grid_dependency_sync();
    constexpr int ROWS = warp_rows<T, 2 * C>(), P = C / VEC;  // x and dy: 64 bytes between them
    const auto lg = LaneGroup<VEC>::template of<kThreads, ROWS>(G ? G : group_arg);

    Raw<T, VEC> raw_x[ROWS][P], raw_dy[ROWS][P];
    int lead[ROWS], valid[ROWS], dy_len[ROWS];  // the row's frame (row_lead): keys [lead, valid)
    float m_saved[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int64_t row = lg.first + r;
        LaneGroup<VEC>::template frame<kRagged, kCausal>(row, rows, n, causal_sq, lead[r], valid[r]);
        // log_softmax sums dy over masked keys too (their y is 0, not their dy)
        dy_len[r] = row >= rows ? 0 : kLog ? lead[r] + n : valid[r];
        m_saved[r] = row < rows ? row_max[row] : 0.f;
#pragma unroll
        for (int p = 0; p < P; p++) {
            const int col = lg.col(p);
            raw_x[r][p] = load_or_zero<T, VEC>(x + row * n - lead[r] + col, col < valid[r]);
            raw_dy[r][p] = load_or_zero<T, VEC>(dy + row * n - lead[r] + col, col < dy_len[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int64_t row = lg.first + r;
        auto in = [&](int p, int k, int len) {
            const int col = lg.col(p);
            return kCausal ? col + k < len : col < len;
        };
        float yv[C], g[C];
        BwdSums<T, kLog> sums;  // (z, a): sum of y', sum of dy * y' (log: of dy)
        const float ref = exp_ref(m_saved[r]);
#pragma unroll
        for (int p = 0; p < P; p++) {
            const float ref_p = kCausal || in(p, 0, valid[r]) ? ref : INFINITY;
#pragma unroll
            for (int k = 0; k < VEC; k++) {
                const int i = p * VEC + k;
                const float yk = exp_warp_bwd<T, VEC>(fmaf(raw_at<T, VEC>(raw_x[r][p], k), scale, -ref_p));
                yv[i] = kCausal && !in(p, k, valid[r]) ? 0.f : yk;
                g[i] = !kCausal || in(p, k, dy_len[r]) ? raw_at<T, VEC>(raw_dy[r][p], k) : 0.f;
            }
            if (kRagged)
                unragged<VEC>(lg.col(p), lead[r], valid[r], [&](int k) { yv[p * VEC + k] = g[p * VEC + k] = 0.f; });
#pragma unroll
            for (int k = 0; k < VEC; k++) sums.add(yv[p * VEC + k], g[p * VEC + k]);
        }
        const Acc2<T> za = group_reduce<SumSum<Acc2<T>>>(sums.value(), lg.group);
        const BwdRow<T> br(za.x, za.y, kLog, scale);
        if (row < rows) {
            lg.template store<T, P, kRagged>(dx + row * n - lead[r], lead[r], n, [&](int p, int k) {
                const float d = br.template dx<kLog>(yv[p * VEC + k], g[p * VEC + k]);
                return kCausal && !in(p, k, valid[r]) ? 0.f : d;
            });
        }
    }
}

// ---- longer rows: K CTAs per row, each owning the slice [rank * seg, rank * seg + seg) ---------

// Elements per thread per chunk: 64 bytes forward, 32 bytes of each of x and dy backward (the
// scalar path keeps 8 of each: a register apiece), within the 64 registers of 2 x 512 threads.
template <typename T, int VEC> __host__ __device__ constexpr int block_elems_fwd() {
    return VEC == 1 ? 8 : 64 / (int)sizeof(T);
}
template <typename T, int VEC> __host__ __device__ constexpr int block_elems_bwd() {
    return VEC == 1 ? 8 : 32 / (int)sizeof(T);
}

// Whether a row-block kernel whose slice fits its registers keeps each element's exp for the write
// pass (fp32) or takes it again (16-bit: the kept values cost registers and, forward, a second
// reduction: measured slower). Chosen when fp32 took libdevice's ~8-instruction expf; with
// ex2.approx, taking it again measured level to -0.5 (H200, session 16 of the perf log).
template <typename T> constexpr bool kExpOnce = std::is_same_v<T, float>;

// Elements left from a thread's first access, as an int in [-1, chunk].
__device__ __forceinline__ int clamp_offset(int64_t left, int64_t chunk) {
    return (int)(left < 0 ? -1 : (left > chunk ? chunk : left));
}

// Elements of a thread's chunk that a pass takes: offsets [lo, hi) from its first access (lo is
// above -1 only in the chunk holding a ragged row's lead).
struct Span {
    int lo, hi;
    // element k of access p; without a mask (kCausal false) whole accesses are in or out (slices
    // and n are multiples of VEC, lo is -1) and k is not looked at
    template <bool kCausal, int VEC> __device__ __forceinline__ bool has(int p, int k) const {
        const int j = p * 32 * VEC + (kCausal ? k : 0);
        return (!kCausal || j >= lo) && j < hi;
    }
    // the elements below `stop` of the chunk whose first access (this thread's) is at `first`, in a
    // frame whose row starts at `lead`
    template <bool kCausal>
    static __device__ __forceinline__ Span of(int lead, int64_t first, int64_t stop, int64_t chunk) {
        return Span{kCausal ? clamp_offset(lead - first, chunk) : -1, clamp_offset(stop - first, chunk)};
    }
};

// Stores a row-block thread's chunk (P accesses of VEC elements, 32 * VEC apart, from `out`): element
// (p, k) is value(p, k); accesses from outs.hi on hold none of the row's outputs.
template <typename T, int VEC, int P, bool kCausal, typename Value>
__device__ __forceinline__ void store_chunk(T *out, Span outs, Value value) {
#pragma unroll
    for (int p = 0; p < P; p++) {
        if (p * 32 * VEC < outs.hi) {
            float o[VEC];
#pragma unroll
            for (int k = 0; k < VEC; k++) o[k] = value(p, k);
            store_in<T, VEC, kCausal>(out + p * 32 * VEC, o, p * 32 * VEC, outs.lo, outs.hi);
        }
    }
}

// fp32 forwards of rows past kWideFwdMin (up to kPackRowMax) take kWideFwdElems elements a thread
// in CTAs of up to 256 threads, three an SM (see launch_fwd_rows).
constexpr int kWideFwdElems = 32;
constexpr int64_t kWideFwdMin = 4096;
template <typename T, int VEC, bool kCausal, bool kLog, int C = block_elems_fwd<T, VEC>()>
__global__ void __launch_bounds__(C == block_elems_fwd<T, VEC>() ? kBlockThreads : 256,
                                  C == block_elems_fwd<T, VEC>() ? 2 : 3)
softmax_fwd_rows_block(int64_t n, int64_t seg, int cluster_k, const T *__restrict__ x, T *__restrict__ y,
                       float *__restrict__ row_max, float scale, int64_t causal_sq) {
    constexpr int P = C / VEC;
    __shared__ RowReduceSmem<float2> smem;       // the in-register path's max
    __shared__ RowReduceSmem<Acc2<T>> sum_smem;  // its sum; the looped path's (max, sum) pairs
    kernel_start(nullptr, 0, cluster_k, smem, sum_smem);
    const int64_t row = blockIdx.x / cluster_k;
    const int rank = blockIdx.x % cluster_k;
    // slices of the row's frame (row_lead): its keys are [lead, lead + causal_len)
    const int lead = kCausal ? row_lead<VEC>(row, n) : 0;
    const int64_t begin = rank * seg, end = min(lead + n, begin + seg);
    const int64_t load_end = kCausal ? min(end, lead + causal_len(row, n, causal_sq)) : end;
    const int64_t chunk = (int64_t)blockDim.x * C;
    const int64_t chunks = end > begin ? (end - begin + chunk - 1) / chunk : 1;
    // Each warp owns 32 * C consecutive elements of a chunk, so a thread's accesses sit at constant
    // offsets (p * 32 * VEC) from one pointer: no per-access 64-bit address arithmetic.
    const int64_t lane_off = (int64_t)(threadIdx.x >> 5) * 32 * C + (threadIdx.x & 31) * VEC;
    const T *xr = x + row * n - lead + lane_off;
    T *yr = y + row * n - lead + lane_off;
    Raw<T, VEC> raw[P];

    // this thread's elements of the chunk at `start` below `stop`, from the lead on
    auto span = [&](int64_t start, int64_t stop) { return Span::of<kCausal>(lead, start + lane_off, stop, chunk); };
    auto is_key = [](int p, int k, Span keys) { return keys.has<kCausal, VEC>(p, k); };
    // an access is read when it holds a key (lo < VEC: every access overlaps [lo, chunk])
    auto load_chunk = [&](int64_t start) {
        const Span keys = span(start, load_end);
#pragma unroll
        for (int p = 0; p < P; p++)
            if (p * 32 * VEC < keys.hi) {
                if constexpr (VEC == 1) raw[p] = load_raw<T, VEC>(xr + start + p * 32 * VEC);
                else raw[p] = load_pack_kept(xr + start + p * 32 * VEC);
            }
    };

    // One chunk for every CTA of the row (decided by seg, which all ranks share: the last rank's
    // shorter slice must not pick a different reduction than its cluster peers).
    const bool in_registers = kExpOnce<T> && seg <= chunk;
    float m, s, e[C];
    if (in_registers) {
        // The slice sits in registers: the exact row max first, then one exp per element, kept
        // for the output (a second reduction, but half the MUFU work of recomputing the exp).
        load_chunk(begin);
        const Span keys = span(begin, load_end);
        m = -INFINITY;
#pragma unroll
        for (int p = 0; p < P; p++)
#pragma unroll
            for (int k = 0; k < VEC; k++)
                if (is_key(p, k, keys)) m = fmaxf(m, __fmul_rn(raw_at<T, VEC>(raw[p], k), scale));
        m = row_reduce<MaxOnly>(make_float2(m, 0.f), smem, cluster_k).x;
        RowSum<T> sum;
#pragma unroll
        for (int p = 0; p < P; p++)
#pragma unroll
            for (int k = 0; k < VEC; k++) {
                const int i = p * VEC + k;
                e[i] = is_key(p, k, keys) ? exp_ftz(fmaf(raw_at<T, VEC>(raw[p], k), scale, -exp_ref(m))) : 0.f;
                sum.add(e[i]);
            }
        s = row_sum(sum, [&](Acc2<T> v) { return row_reduce<SumSum<Acc2<T>>>(v, sum_smem, cluster_k, false); });
    } else {
        // (max, sum of exp relative to it) of this thread's elements, online across chunks (the sum
        // in fp64 for fp32 data, as RowSum: fp32 partial sums left single rows of 65543 at up to 11x
        // torch's error); the write pass re-reads each chunk (mostly from L2) and takes its exp again
        float lm = -INFINITY;
        Acc<T> ls = 0;
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t start = begin + c * chunk;
            load_chunk(start);
            const Span keys = span(start, load_end);
            float cm = lm;
#pragma unroll
            for (int p = 0; p < P; p++)
#pragma unroll
                for (int k = 0; k < VEC; k++)
                    if (is_key(p, k, keys)) cm = fmaxf(cm, __fmul_rn(raw_at<T, VEC>(raw[p], k), scale));
            const float ref = exp_ref(cm);
            ls = rescale(ls, lm, ref);
#pragma unroll
            for (int p = 0; p < P; p++)
#pragma unroll
                for (int k = 0; k < VEC; k++)
                    if (is_key(p, k, keys)) ls += (Acc<T>)exp_ftz(fmaf(raw_at<T, VEC>(raw[p], k), scale, -ref));
            lm = cm;
        }
        const Acc2<T> ms = row_reduce<MaxSum<Acc2<T>>>(Acc2<T>{lm, ls}, sum_smem, cluster_k);
        m = (float)ms.x;
        s = (float)ms.y;
    }
    const float ref = exp_ref(m), inv_s = 1.f / s, log_s = logf(s);
    if (rank == 0 && threadIdx.x == 0 && row_max) row_max[row] = m;

    // writes the chunk at `start`; exp_of(i, t) is element i's exp(t), t = x * scale - m
    auto write_chunk = [&](int64_t start, auto exp_of) {
        const Span keys = span(start, load_end), outs = span(start, end);
        store_chunk<T, VEC, P, kCausal>(yr + start, outs, [&](int p, int k) {
            const float t = fmaf(raw_at<T, VEC>(raw[p], k), scale, -ref);
            if (kLog) return is_key(p, k, keys) ? t - log_s : -INFINITY - log_s;
            return normalize<T>(is_key(p, k, keys) ? exp_of(p * VEC + k, t) : 0.f, s, inv_s);
        });
    };
    if (in_registers) {
        write_chunk(begin, [&](int i, float) { return e[i]; });
    } else {
        // Last chunk first: it is still in registers, and the chunks read last are the likeliest
        // to be still in L2. H100, same-process A/B against first to last, % of copy: fp32 (128,
        // 1048576) 66.0 -> 69.4, ragged (256, 500001) 67.1 -> 73.0, bf16 ragged (128, 1000003)
        // 66.1 -> 71.9; the backward fp32 (128, 600000) 58.2 -> 62.3 (0.97 -> 1.04x torch.compile),
        // (64, 900000) 56.5 -> 58.6, (128, 1048576) 59.8 -> 62.0.
        for (int64_t c = chunks - 1; c >= 0; c--) {
            if (c < chunks - 1) load_chunk(begin + c * chunk);
            write_chunk(begin + c * chunk, [](int, float t) { return exp_ftz(t); });
        }
    }
}

template <typename T, int VEC, bool kCausal, bool kLog>
__global__ void __launch_bounds__(kBlockThreads, 2)
softmax_bwd_rows_block(int64_t n, int64_t seg, int cluster_k, const T *__restrict__ dy,
                       const T *__restrict__ x, const float *__restrict__ row_max, T *__restrict__ dx,
                       float scale, int64_t causal_sq) {
    constexpr int C = block_elems_bwd<T, VEC>(), P = C / VEC;
    __shared__ RowReduceSmem<Acc2<T>> smem;
    kernel_start(nullptr, 0, cluster_k, smem);
    const int64_t row = blockIdx.x / cluster_k;
    const int rank = blockIdx.x % cluster_k;
    // slices of the row's frame (row_lead): its keys are [lead, lead + causal_len)
    const int lead = kCausal ? row_lead<VEC>(row, n) : 0;
    const int64_t begin = rank * seg, end = min(lead + n, begin + seg);
    const int64_t x_end = kCausal ? min(end, lead + causal_len(row, n, causal_sq)) : end;
    const int64_t dy_end = kLog ? end : x_end;  // log_softmax sums dy over masked keys too
    const int64_t chunk = (int64_t)blockDim.x * C;
    const int64_t chunks = end > begin ? (end - begin + chunk - 1) / chunk : 1;
    const float m_saved = row_max[row];
    const int64_t lane_off = (int64_t)(threadIdx.x >> 5) * 32 * C + (threadIdx.x & 31) * VEC;
    const T *xr = x + row * n - lead + lane_off, *dyr = dy + row * n - lead + lane_off;
    T *dxr = dx + row * n - lead + lane_off;
    Raw<T, VEC> raw_x[P], raw_dy[P];

    auto span = [&](int64_t start, int64_t stop) { return Span::of<kCausal>(lead, start + lane_off, stop, chunk); };
    auto in = [](int p, int k, Span s) { return s.has<kCausal, VEC>(p, k); };
    auto load_chunk = [&](int64_t start) {
        const Span xs = span(start, x_end), dys = span(start, dy_end);
#pragma unroll
        for (int p = 0; p < P; p++) {
            if (p * 32 * VEC < xs.hi) raw_x[p] = load_raw<T, VEC>(xr + start + p * 32 * VEC);
            if (p * 32 * VEC < dys.hi) raw_dy[p] = load_raw<T, VEC>(dyr + start + p * 32 * VEC);
        }
    };
    // y' = exp(x * scale - row_max): unnormalised, z = sum y' renormalises it
    auto y_unnorm = [&](int p, int k, Span xs) {
        return in(p, k, xs) ? exp_ftz(fmaf(raw_at<T, VEC>(raw_x[p], k), scale, -exp_ref(m_saved))) : 0.f;
    };

    BwdSums<T, kLog> sums;  // (z, a): sum of y', sum of dy * y' (log: of dy)
    float yv[C];  // the last chunk's y': with one chunk, the write pass takes no second exp
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t start = begin + c * chunk;
        load_chunk(start);
        const Span xs = span(start, x_end), dys = span(start, dy_end);
#pragma unroll
        for (int p = 0; p < P; p++)
#pragma unroll
            for (int k = 0; k < VEC; k++) {
                const float yk = y_unnorm(p, k, xs), gk = in(p, k, dys) ? raw_at<T, VEC>(raw_dy[p], k) : 0.f;
                if (kExpOnce<T>) yv[p * VEC + k] = yk;
                sums.add(yk, gk);
            }
    }
    const Acc2<T> za = row_reduce<SumSum<Acc2<T>>>(sums.value(), smem, cluster_k);
    const BwdRow<T> br(za.x, za.y, kLog, scale);

    // writes the chunk at `start` from y_of(p, k, xs), element (p, k)'s y'
    auto write_chunk = [&](int64_t start, auto y_of) {
        const Span xs = span(start, x_end), outs = span(start, end);
        store_chunk<T, VEC, P, kCausal>(dxr + start, outs, [&](int p, int k) {
            const float d = br.template dx<kLog>(y_of(p, k, xs), raw_at<T, VEC>(raw_dy[p], k));
            return in(p, k, xs) ? d : 0.f;
        });
    };
    if (kExpOnce<T> && chunks == 1) {
        write_chunk(begin, [&](int p, int k, Span) { return yv[p * VEC + k]; });
    } else {
        for (int64_t c = chunks - 1; c >= 0; c--) {  // last chunk first, as the forward
            if (c < chunks - 1) load_chunk(begin + c * chunk);
            write_chunk(begin + c * chunk, y_unnorm);
        }
    }
}

// ---- sm_90, rows over 1024 elements: row slices in shared memory, loaded by the copy engine ----
//
// Thread 0 of each CTA starts bulk copies (cp.async.bulk, the TMA engine) of its slices into shared
// memory, counted on mbarriers (a lone CTA per row cuts its copy into 4 pieces, one barrier each,
// and its first pass starts on the first piece), and, forward or where a CTA holds more than
// kSmemCtaMax, asks L2 for the slices of the CTA one SM count ahead (prefetch_next_cta); the
// passes then read shared memory, so global memory is read
// once and a whole slice per CTA is in flight whatever the registers (the register kernels above
// hold 32-64 bytes per thread and re-read a second chunk from L2). Two shapes:
//  - kWarpRows (forward): a CTA of kWarpRows warps takes kWarpRows short rows, a warp each (warp shuffles
//    only, one mbarrier per row), so a CTA has kWarpRows slices in flight;
//  - else K CTAs of kSmemThreads per row (a cluster when K > 1; DSMEM exchange of the partials).
// One CTA per row (or row group): a persistent grid walking rows with a two-stage pipeline
// measured 25-40% slower on an H200, and so did 256-thread CTAs holding one short row.
// Forward: the exact max first (a packed max / min of the raw values and one multiply per pack),
// then the sum of exp relative to it (no online rescaling), then the write pass; fp32 and bf16 keep
// each exp in place of its x (kKeepExp), fp16 takes its ex2.approx again.

// Slice sizes of the shared-memory kernels, in bytes of all the tensors a CTA holds. Rows up to
// kSmemWarpRowMax take a warp each; longer ones take K CTAs, K the smallest power of two that
// brings a CTA to kSmemCtaMax (six CTAs an SM), capped by the cluster limit. Measured on an H200:
// warps for rows of 8 KB beat 256-thread CTAs (bf16 16384 x 4096 forward 81% of copy against 51%,
// causal 2048-wide rows 79% against 28%) and lose to them at 16 KB (79-83% against 88-90%).
// 32 KB CTAs beat 64 KB ones (benchmark runs, two a build): bf16 (256, 262144) forward 88.6-89.0
// -> 93.7-94.3, fp32 (4096, 16384) / (1024, 65536) forwards 95 -> 97-98, bf16 (4096, 16384)
// backward 95.7-96.3 -> 97.5-98.3, bf16 (1024, 65536) backward 94.6-95.2 -> 96.7-97.7; others
// level. 16 KB ones lost up to 7 points (fp32 (1024, 65536) forward 97 -> 91; bf16 (1024, 65536)
// backward 97 -> 89.6; fp32 (16384, 4096) backward, split in two, 100 -> 95). Rows that a full
// cluster of kSmemCtaMax CTAs cannot hold take CTAs of up to kSmemCtaBigMax (two an SM), against
// the register block kernel (H200, % of copy): forward fp32 (300, 300000) 56 -> 90, (256, 400000)
// 57 -> 83, bf16 (300, 600000) 60 -> 92; backward fp32 (256, 140000) 72 -> 90 and bf16 (300,
// 300000) 73 -> 92 (those two against dy in registers, below: 2-4 points either way at 100 KB).
constexpr int64_t kSmemWarpRowMax = 8 * 1024;
constexpr int64_t kSmemCtaMax = 32 * 1024;
constexpr int64_t kSmemCtaBigMax = 112 * 1024;
// Forward rows that a full cluster of kSmemCtaBigMax CTAs cannot hold (fp32 past 458752 elements,
// 16-bit past 917504) take CTAs of up to kSmemCtaHugeMax, one an SM (with the static shared memory,
// under the 227 KB a CTA may have), when clusters of that many fit, in the unmasked instance: fp32
// rows of up to 917504 elements, 16-bit of up to 1835008, are then still read once. H100,
// same-process A/B against the register block kernel, % of copy: fp32 (256, 524288) 68.3 -> 79.3,
// (128, 600000) 65.5 -> 77.9, (128, 600004) 65.5 -> 76.8, (64, 900000) 61.7 -> 74.4, (256, 917504)
// 66.5 -> 83.1; bf16 (128, 1048576) 68.3 -> 73.1. The masked instances (ragged rows here), whose
// warps carry ~25% more work, lost: fp32 (256, 500001) 67.4 -> 60.5, bf16 (128, 1000003) 66.2 ->
// 60.5; they keep the register block kernel. The L2 prefetch of the next CTAs (29 MB at one CTA an
// SM) lost up to 15 points on these CTAs, which go without it.
constexpr int64_t kSmemCtaHugeMax = 224 * 1024;

// Threads of a row CTA: 256 forward (128 lost 3 points on bf16 1024 x 65536), 128 backward (H200,
// backward with 2-CTA clusters: fp32 4096 x 16384 90% of copy against 83% with 256; a 256-thread
// instance for clustered rows only gained 1.4-2.4 points in fastkern-only runs, and with kept bf16
// y' it took bf16 1024 x 65536 from 95 to 87-88 in the benchmark's own runs).
template <bool kBackward> constexpr int kSmemThreads = kBackward ? 128 : 256;
// Unmasked backward rows whose CTAs hold at least 3/4 of kSmemCtaMax (3 or 4 packs of x and of dy
// a thread) take 256 threads instead on devices whose DRAM streams at most kFastDramPerSm bytes a
// microsecond per SM (the H100). H100, same-process A/B, five rounds, 256 threads for every
// unmasked row, x torch.compile: fp32 (4096, 16384) 0.999 -> 1.005x, (2048, 32768) 1.046 ->
// 1.051x, (1024, 65536) 1.703-1.714 -> 1.712-1.721x, bf16 (2048, 32768) 1.006-1.007 -> 1.009-1.010x,
// the rest level; but fp32 (16384, 9000) (18 KB CTAs, 2.2 packs a thread) 1.008 -> 0.914x, hence
// the size line ((8192, 12000), 24 000-byte CTAs just under it, gained 0.3%), and masked rows lost
// (ragged (4096, 50257) fp32 2.142 -> 1.981x, bf16 1.962 -> 1.919x): they keep 128. On the H200
// 256 threads lost (fp32 (4096, 16384) 1.016 -> 0.930x, session 28 of the perf log).
constexpr int kSmemBwdSlowDramThreads = 256;
// The forward's masked instances (causal or ragged rows) take their thread count at run time: a
// warp per kMaskedWarpPacks packs of the slice (2.5 a lane), at most kSmemThreads. Their per-warp
// cost (slice bounds, the edge packs, barriers and reductions) is ~25% above the unmasked one's,
// and with 2 packs a lane (rows of 8-9 KB) it left them issue-bound (ncu, H100, bf16 (32768,
// 4097): 0.91 warps issued a cycle per scheduler, 174M instructions against 139M for packed 4104
// rows at 98% of copy). Fewer warps share that cost over more packs: same-process A/B against 8
// warps, % of copy, H100: bf16 ragged (32768, 4097) 85-86 -> 97, (32768, 4700) 92-95 -> 97-99,
// (1024, 65543) 97.5 -> 98; 6001 / 8185 / 50257 level. Sweeping the warps of 4097-6001-wide rows
// (H100) found no single packs-a-lane figure best everywhere (4097: 7 warps 98, 6 warps 93, 5
// warps 99; 5001: 7 warps 98, 5 warps 96; 4 warps lost 2-10 points), and 2.5 a lane picks 7-8
// there. The unmasked instances keep a compile-time 256 (a run-time count cost their clustered
// rows ~1 point).
constexpr int kMaskedWarpPacks = 80;
constexpr int kWarpRows = 4;  // rows (warps) per CTA of the warp-per-row shape
// Whether the shared-memory forward keeps each exp in place of its x for the write pass: fp32 as
// is, bf16 as fp16 (e in [0, 1] at 2^-11 relative error, far below bf16's 2^-8: H200, bf16
// forwards 0 to +2.4 points of copy, the causal (4, 8, 2048, 2048) one 82 -> 105; worst forward
// error 1.00 -> 1.09x torch's). fp16 takes its exp again (an fp16-kept y' put fp16 gradients at
// up to 3.9x torch's error), and so does the bf16 backward (kExpOnce): kept y' with 256-thread
// clustered CTAs measured +0.4-2.4 in fastkern-only runs but took bf16 (1024, 65536) from 95 to
// 87-88 in the benchmark's own runs (the two were not measured apart).
template <typename T> constexpr bool kKeepExp = !std::is_same_v<T, __half>;
template <typename T> __device__ __forceinline__ void keep_exp(fk::Pack<T> &v, int k, float e) {
    if constexpr (std::is_same_v<T, float>) v.v[k] = e;
    else reinterpret_cast<__half *>(&v)[k] = __float2half_rn(e);
}
template <typename T> __device__ __forceinline__ float kept_exp(const fk::Pack<T> &v, int k) {
    if constexpr (std::is_same_v<T, float>) return v.v[k];
    else return __half2float(reinterpret_cast<const __half *>(&v)[k]);
}
// Alignment of the shared-memory slices. The copy engine needs 16 bytes, but slices so aligned began
// 32-64 bytes into a 128-byte line, after the static shared memory (1312-1856 bytes). H200, same
// kernels otherwise: 48 bytes in cost one-CTA rows 6-14 points of copy against 32 (fp32 (16384,
// 4096) backward 100 -> 86), and 128-byte alignment against 48 lifted clustered rows 1-14 (bf16
// (256, 262144) backward 78 -> 90).
constexpr int kSliceAlign = 128;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

// Copies [src, src + bytes) to shared dst, counted on `bar`; bytes is a multiple of 16.
// keep: under an L2 evict_last policy (see the backward's copies).
__device__ __forceinline__ void bulk_load(void *dst, const void *src, uint32_t bytes, uint64_t *bar, bool keep = false) {
    if (keep) {
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
                     ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(l2_evict_last())
                     : "memory");
        return;
    }
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}

#endif

// Bytes to copy for elements [0, len) of a slice: whole 16-byte packs, never past `cap` elements.
template <typename T> __device__ __forceinline__ uint32_t slice_bytes(int64_t len, int64_t cap) {
    constexpr int64_t per = 16 / sizeof(T);
    if (len > cap) len = cap;
    if (len < 0) len = 0;
    return (uint32_t)((len + per - 1) / per * 16);
}

// One CTA's part of the work: slice `w` of its rows (w: the warp with kWarpRows, else 0) is
// elements [begin, begin + len) of row `row`'s frame (len <= 0: nothing), from start(t, n) in a
// tensor t; keys are its elements [lo, keys). Masked instances (kCausal) take ragged rows too
// (causal_sq 1): their frame starts `lead` elements before the row (row_lead), and lo is the lead
// in the first slice (lead < VEC <= seg); unmasked, lead and lo are 0 and the frame is the row.
struct Slice {
    int64_t row, begin, len, keys;
    int lo, lead;
    bool valid;
    template <typename P> __device__ __forceinline__ P *start(P *t, int64_t n) const { return t + row * n + begin - lead; }
};
template <typename T, bool kCausal, bool kWarps, bool kDiv = false>
__device__ __forceinline__ Slice slice_of(int w, int64_t rows, int64_t n, int64_t seg, int cluster_k,
                                          int64_t causal_sq, int64_t block = blockIdx.x) {
    Slice sl;
    // K is a power of two: a mask and a shift, not 64-bit divisions (a ~100-instruction routine each,
    // in thread 0's path to its bulk copies). H200, benchmark runs: fp32 (16384, 4096) forward 91 ->
    // 96% of copy, (256, 262144) 88 -> 92, bf16 (256, 262144) 87 -> 89.6. The backward keeps the
    // divisions (kDiv): with the mask its bf16 (4096, 16384) fell 96 -> 90 in the benchmark's runs
    // (not in fastkern-only ones; the same split as an earlier session saw; cause not found).
    const int rank = kWarps ? 0 : kDiv ? (int)(block % cluster_k) : (int)(block & (cluster_k - 1));
    sl.row = kWarps ? block * kWarpRows + w : kDiv ? block / cluster_k : block >> (__ffs(cluster_k) - 1);
    sl.valid = sl.row < rows;
    const int lead = kCausal ? row_lead<fk::Pack<T>::N>(sl.row, n) : 0;
    sl.begin = rank * seg;
    sl.lead = lead;
    sl.lo = sl.begin < lead ? lead - (int)sl.begin : 0;
    const int64_t end = min(lead + n, sl.begin + seg);
    sl.len = sl.valid ? end - sl.begin : 0;
    sl.keys = sl.valid ? (kCausal ? min(end, lead + causal_len(sl.row, n, causal_sq)) : end) - sl.begin : 0;
    return sl;
}

// Packs of a slice the write pass stores: a ragged row's last one in part (store_in).
template <typename T, bool kCausal> __device__ __forceinline__ int out_packs(const Slice &sl) {
    return (int)(kCausal ? slice_bytes<T>(sl.len, sl.len) / 16 : sl.len > 0 ? sl.len / fk::Pack<T>::N : 0);
}

// Copy pieces of a CTA-per-row slice: 4 when the row has one CTA, so its passes start on the
// first quarter while the rest is in flight (H200, measured when rows of up to 64 KB took one CTA:
// bf16 (16384, 4096) backward 89 -> 98% of copy, fp32 (4096, 16384) forward / backward 89 -> 94 /
// 97%); 1 in a cluster (its forward lost 3-5 points with 4) and for the warp-per-row kernels.
constexpr int kMaxPieces = 4;
struct Pieces {
    int count;      // barriers per slice
    uint32_t bytes; // bytes of each piece but the last: a multiple of 16, count * bytes >= a slice
};
template <typename T, bool kWarps, bool kDiv = false> __device__ __forceinline__ Pieces pieces_of(int64_t seg, int cluster_k) {
    const int count = kWarps || cluster_k > 1 ? 1 : kMaxPieces;
    if constexpr (kDiv) return {count, (uint32_t)(((seg * (int64_t)sizeof(T) + count - 1) / count + 15) / 16 * 16)};
    const uint32_t bytes = (uint32_t)seg * (uint32_t)sizeof(T);  // a slice is at most kSmemCtaBigMax
    return {count, ((count == 1 ? bytes : (bytes + kMaxPieces - 1) / kMaxPieces) + 15) / 16 * 16};
}

// Thread 0's L2 prefetch (cp.async.bulk.prefetch) of the slices of the CTA one SM count ahead in
// the grid, which starts while this one runs (six 32 KB CTAs an SM), so that its bulk copies
// hit L2 and DRAM keeps reading while CTAs wait on their cluster's exchange. H200, against no
// prefetch: +2.5-4 points of copy on the 16K-256K forwards (bf16 (4096, 16384) 87.7 -> 91.5) and
// the fp32 (1024, 65536) backward, +0.8-0.9 on the other clustered backwards, others level. With
// 64 KB CTAs half the distance gained less, 1.5x lost up to 5 points and 3x up to 27 (L2
// thrashing); with 32 KB ones 2x lost clustered rows up to 19 points; the
// warp-per-row kernels (causal 2048-wide rows 80.7 -> 75.2) and the register warp kernels (up to
// 26 points) lost with it, so only CTA-per-row slices take it. With 32 KB CTAs, backward ones of up
// to kSmemCtaMax (x and dy together) do better without it (H200, benchmark runs, two a build: bf16
// (4096, 16384) 97.4-97.7 -> 100.5-100.6% of copy, (16384, 4096) 99.2-99.6 -> 100.9-101.2,
// (1024, 65536) 97.0-97.2 -> 100.4, fp32 (1024, 65536) 98.5-98.6 -> 100.8-101.0, (4096, 16384)
// 99.9-100.0 -> 100.8-101.0, others level); larger ones keep it (without it bf16 (256, 262144),
// 64 KB CTAs, 92.6-92.8 -> 90.8-91.1), and so do the forward's (without it -1.5 to -2.5 points).
template <typename T, bool kCausal, bool kDiv = false, typename Copies>
__device__ __forceinline__ void prefetch_next_cta(int64_t rows, int64_t n, int64_t seg, int cluster_k,
                                                  int64_t causal_sq, Copies copies) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint32_t sms;
    asm("mov.u32 %0, %%nsmid;" : "=r"(sms));
    const int64_t next = (int64_t)blockIdx.x + sms;
    if (next >= gridDim.x) return;
    copies(0, slice_of<T, kCausal, false, kDiv>(0, rows, n, seg, cluster_k, causal_sq, next),
           [&](int64_t, const T *src, uint32_t bytes) {
               if (bytes)
                   asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
           });
#endif
}

// Thread 0 starts the CTA's copies: copies(i, slice, copy) names, for slice i of the CTA, each
// tensor's copy as copy(shared offset, source, bytes). Each tensor's copy is cut into pieces.count
// pieces of pieces.bytes at the same offsets, piece c of slice i counted on
// bar[i * pieces.count + c], so a warp starts on its own row and the passes on the first piece
// while the rest are in flight. One arrival per barrier announces all its bytes, so no phase completes before
// its last copy is counted.
template <typename T, bool kCausal, bool kWarps, bool kDiv = false, typename Copies>
__device__ __forceinline__ void start_copies(uint64_t *bar, Pieces pieces, unsigned char *smem, int64_t rows,
                                             int64_t n, int64_t seg, int cluster_k, int64_t causal_sq,
                                             bool prefetch, Copies copies, bool keep = false) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (threadIdx.x != 0) return;
    for (int i = 0; i < (kWarps ? kWarpRows : 1); i++) {
        const Slice sl = slice_of<T, kCausal, kWarps, kDiv>(i, rows, n, seg, cluster_k, causal_sq);
        for (int c = 0; c < pieces.count; c++) {
            uint64_t *b = &bar[i * pieces.count + c];
            auto lo = [&](uint32_t bytes) { return min((uint32_t)c * pieces.bytes, bytes); };
            auto len = [&](uint32_t bytes) { return min(lo(bytes) + pieces.bytes, bytes) - lo(bytes); };
            uint32_t total = 0;
            copies(i, sl, [&](int64_t, const T *, uint32_t bytes) { total += len(bytes); });
            mbar_expect(b, total);
            copies(i, sl, [&](int64_t offset, const T *src, uint32_t bytes) {
                if (len(bytes))
                    bulk_load(smem + offset + lo(bytes), reinterpret_cast<const unsigned char *>(src) + lo(bytes),
                              len(bytes), b, keep);
            });
        }
    }
    if (!kWarps && prefetch) prefetch_next_cta<T, kCausal, kDiv>(rows, n, seg, cluster_k, causal_sq, copies);
#endif
}

// The first pass over a slice's packs (16-byte units from its start): body(p) for p = first,
// first + stride, ... < packs, piece by piece, every thread waiting for piece c's barrier before
// the packs of piece c (so every barrier is waited for and no copy is in flight at exit). The
// inner loop holds no wait, so its shared-memory loads stay free to be scheduled early (a wait
// inside the loop cost clustered rows 2-5 points).
template <int kUnroll, typename Body>
__device__ __forceinline__ void over_pieces(uint64_t *bar, Pieces pieces, int packs, int first, int stride,
                                            Body body) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const int per = (int)(pieces.bytes / 16);  // 32-bit bounds: fp32 (16384, 4096) forward 96 -> 98% of copy
    int p = first, end = 0;
    for (int c = 0; c < pieces.count; c++) {
        mbar_wait(&bar[c]);
        end = min(packs, end + per);
#pragma unroll kUnroll
        for (; p < end; p += stride) body(p);
    }
#endif
}

// Reduction over the lanes that share a slice's row: the warp (kWarps), else the CTA and cluster.
template <bool kWarps, typename Op, typename V>
__device__ __forceinline__ V slice_reduce(V v, RowReduceSmem<V> &smem, int cluster_k, bool first = true) {
    if constexpr (kWarps) return group_reduce<Op>(v, 32);
    else return row_reduce<Op>(v, smem, cluster_k, first);
}

template <typename T, bool kCausal, bool kLog, bool kWarps>
__global__ void __launch_bounds__(kSmemThreads<false>)
softmax_fwd_rows_smem(int64_t n, int64_t seg, int cluster_k, int64_t rows, const T *__restrict__ x,
                      T *__restrict__ y, float *__restrict__ row_max, float scale, int64_t causal_sq) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr int VEC = fk::Pack<T>::N;
    constexpr bool kExpInPlace = kKeepExp<T> && !kLog;  // log_softmax writes t - log(s), no exp
    extern __shared__ __align__(kSliceAlign) unsigned char smem_raw[];
    __shared__ uint64_t bar[kWarps ? kWarpRows : kMaxPieces];
    __shared__ RowReduceSmem<float2> red;
    __shared__ RowReduceSmem<Acc2<T>> sum_red;
    const Pieces pieces = pieces_of<T, kWarps>(seg, cluster_k);
    kernel_start(bar, kWarps ? kWarpRows : pieces.count, kWarps ? 1 : cluster_k, red, sum_red);
    const int w = kWarps ? threadIdx.x / 32 : 0;
    const int lane = kWarps ? threadIdx.x % 32 : threadIdx.x;
    const int lanes = kWarps ? 32 : kCausal ? (int)blockDim.x : kSmemThreads<false>;  // kMaskedWarpPacks
    const int64_t slice_bytes_max = seg * (int64_t)sizeof(T);
    // Copies under an L2 evict_last policy (but for causal rows) measured card by card, kept L2
    // lines released before each sample: H200, same-process A/B, bf16 (16384, 4096) 92.5 -> 96.2%
    // of copy, (4096, 16384) 93.8 -> 95.7, fp32 (4096, 16384) 98.0 -> 98.9; H100, benchmark run
    // against run: fp32 (4096, 16384) 99.3 -> 97.7, (1024, 65536) 99.3 -> 98.1, (256, 262144) 96.8
    // -> 92.6, bf16 (4096, 16384) 95.8 -> 94.6, (16384, 4096) 96.0 -> 97.0. Not taken.
    start_copies<T, kCausal, kWarps>(bar, pieces, smem_raw, rows, n, seg, cluster_k, causal_sq,
                                     slice_bytes_max <= kSmemCtaBigMax,
                                     [&](int i, const Slice &s, auto copy) {
                                         copy(i * slice_bytes_max, s.start(x, n), slice_bytes<T>(s.keys, s.len));
                                     });
    const Slice sl = slice_of<T, kCausal, kWarps>(w, rows, n, seg, cluster_k, causal_sq);
    const int packs = (int)(slice_bytes<T>(sl.keys, sl.len) / 16), outs = out_packs<T, kCausal>(sl);
    fk::Pack<T> *sx = reinterpret_cast<fk::Pack<T> *>(smem_raw + w * slice_bytes_max);
    // masked (kCausal): packs reaching outside the keys [lo, keys) are zeroed outside them
    // (zero_outside; packs past the copied ones hold stale values, all zeroed); others go whole
    const int keys = (int)sl.keys;

    // the exact max first, then each exp once (kept in place of x for the write pass, kKeepExp;
    // fp16 takes ex2.approx again there), then the write pass
    float m = -INFINITY;
    over_pieces<4>(bar + w, pieces, packs, lane, lanes, [&](int p) {
        const fk::Pack<T> v = sx[p];
        if (!kCausal || !reaches_out<VEC>(p * VEC, sl.lo, keys)) {
            m = fmaxf(m, pack_max_scaled<T>(v, scale));
        } else {
#pragma unroll
            for (int k = 0; k < VEC; k++)
                if (p * VEC + k >= sl.lo && p * VEC + k < keys) m = fmaxf(m, __fmul_rn(fk::pack_f32<T>(v, k), scale));
        }
    });
    m = slice_reduce<kWarps, MaxOnly>(make_float2(m, 0.f), red, cluster_k).x;
    float s;
    {
        const float ref = exp_ref(m);
        RowSum<T> sum;
#pragma unroll 4
        for (int p = lane; p < packs; p += lanes) {
            fk::Pack<T> v = sx[p];
            float e[VEC];
#pragma unroll
            for (int k = 0; k < VEC; k++) {
                e[k] = exp_ftz(fmaf(fk::pack_f32<T>(v, k), scale, -ref));
                if constexpr (!kCausal) sum.add(e[k]);  // unmasked: summed as taken, as measured
            }
            if constexpr (kCausal) {
                zero_outside<VEC>(p * VEC, sl.lo, keys, [&](int k) { e[k] = 0.f; });
#pragma unroll
                for (int k = 0; k < VEC; k++) sum.add(e[k]);
            }
            if constexpr (kExpInPlace) {
#pragma unroll
                for (int k = 0; k < VEC; k++) keep_exp<T>(v, k, e[k]);
                sx[p] = v;
            }
        }
        s = row_sum(sum, [&](Acc2<T> v) { return slice_reduce<kWarps, SumSum<Acc2<T>>>(v, sum_red, cluster_k, false); });
    }
    const float ref = exp_ref(m), inv_s = 1.f / s, log_s = logf(s);
    if (!sl.valid) return;
    if (lane == 0 && sl.begin == 0 && row_max) row_max[sl.row] = m;
    T *yr = sl.start(y, n);
#pragma unroll 4
    for (int p = lane; p < outs; p += lanes) {
        const fk::Pack<T> v = sx[p];
        float o[VEC];
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            const float t = fmaf(fk::pack_f32<T>(v, k), scale, -ref);
            const float e = kExpInPlace ? kept_exp<T>(v, k) : exp_ftz(t);
            o[k] = kLog ? t - log_s : normalize<T>(e, s, inv_s);
        }
        if constexpr (kCausal)  // a masked key's output, as for exp 0 (NaN in an all-masked row)
            zero_outside<VEC>(p * VEC, sl.lo, keys, [&](int k) { o[k] = kLog ? -INFINITY - log_s : normalize<T>(0.f, s, inv_s); });
        store_in<T, VEC, kCausal, true>(yr + p * VEC, o, p * VEC, sl.lo, (int)sl.len);
    }
#endif
}

// Backward rows whose x and dy outgrow a full cluster's shared memory (kSmemCtaBigMax per CTA) but
// whose x alone fits in kDyRegSliceMax: x is bulk-copied into shared memory as above and dy held in
// registers, kDyRegPacks 16-byte packs a thread, loaded once, so both are still read from DRAM
// once: 256 threads (two CTAs an SM by registers) for slices of up to 64 KB, fp32 rows of 229K-256K
// elements, 16-bit ones of 459K-512K; 512 threads (one CTA an SM) up to 128 KB, fp32 rows of up to
// 512K, 16-bit up to 1M. Longer rows take the register block kernel, which re-reads from L2. H200,
// against that kernel: fp32 (256, 262144) 69 -> 92% of copy; bf16 (256, 524288) 65 -> 87. H100,
// same-process A/B, the 512-thread instance against it: fp32 (256, 300000) 65 -> 90, (256,
// 400000) 60 -> 89, (256, 524288) 61 -> 92, (256, 500001) 60 -> 81, (1024, 262145) 75 -> 79;
// bf16 (256, 1000000) 59 -> 86.
constexpr int kDyRegPacks = 16;
constexpr int kDyRegThreads = 256, kDyRegWideThreads = 512;
template <int kLanes> constexpr int64_t kDyRegSliceMax = kLanes * kDyRegPacks * 16;  // 64 / 128 KB

template <typename T, bool kCausal, bool kLog, int kDyRegLanes = 0, int kSmemLanes = kSmemThreads<true>>
__global__ void __launch_bounds__(kDyRegLanes ? kDyRegLanes : kSmemLanes, kDyRegLanes == kDyRegThreads ? 2 : 1)
softmax_bwd_rows_smem(int64_t n, int64_t seg, int cluster_k, int64_t rows, const T *__restrict__ dy,
                      const T *__restrict__ x, const float *__restrict__ row_max, T *__restrict__ dx,
                      float scale, int64_t causal_sq) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr int VEC = fk::Pack<T>::N;
    extern __shared__ __align__(kSliceAlign) unsigned char smem_raw[];
    __shared__ uint64_t bar[kMaxPieces];
    __shared__ RowReduceSmem<Acc2<T>> red;
    const Pieces pieces = pieces_of<T, false, true>(seg, cluster_k);
    constexpr bool kDyRegs = kDyRegLanes > 0;
    constexpr int kLanes = kDyRegs ? kDyRegLanes : kSmemLanes;
    const int lane = threadIdx.x, lanes = kLanes;
    const int64_t slice = seg * (int64_t)sizeof(T);  // x slices, then dy slices (unless in registers)
    const int64_t dy_base = slice;
    // bytes of x and dy for a slice (log_softmax sums dy over masked keys too)
    auto x_bytes = [](const Slice &s) { return slice_bytes<T>(s.keys, s.len); };
    auto dy_bytes = [](const Slice &s) { return slice_bytes<T>(kLog ? s.len : s.keys, s.len); };
    // the L2 prefetch only where a CTA's x and dy come to more than kSmemCtaMax (see
    // prefetch_next_cta), and not in the dy-register kernel: at two CTAs an SM the CTA one SM count
    // ahead is mostly running already (H100, same-process A/B without it: fp32 (256, 262144) 88.5
    // -> 98.7% of copy, (256, 240000) 90.8 -> 97.9, bf16 (256, 524288) 88.5 -> 98.5; prefetching
    // its dy too had cost 9-20 points). The others' copies run under an L2
    // evict_last policy, as Triton's first pass loads: H200, same-process A/B against the default,
    // fp32 (4096, 16384) 1.008 -> 1.015x torch.compile, bf16 0.993 -> 0.994-0.996x, others level
    // (evict_first had cost 5-8 points).
    const bool prefetch = !kDyRegs && 2 * slice > kSmemCtaMax;
    kernel_start(bar, pieces.count, cluster_k, red);
    start_copies<T, kCausal, false, true>(bar, pieces, smem_raw, rows, n, seg, cluster_k, causal_sq, prefetch,
                                           [&](int i, const Slice &s, auto copy) {
                                               copy(i * slice, s.start(x, n), x_bytes(s));
                                               if (!kDyRegs) copy(dy_base + i * slice, s.start(dy, n), dy_bytes(s));
                                           }, !prefetch);
    const Slice sl = slice_of<T, kCausal, false, true>(0, rows, n, seg, cluster_k, causal_sq);
    const int x_packs = (int)(x_bytes(sl) / 16), dy_packs = (int)(dy_bytes(sl) / 16);
    const int outs = out_packs<T, kCausal>(sl);
    // masked (kCausal): packs reaching outside x's keys [lo, keys) (dy's: [lo, dy_keys), log_softmax
    // sums dy over masked keys too) are zeroed outside them (zero_outside; packs past the copied
    // ones hold stale values, all zeroed); the others are taken whole
    const int keys = (int)sl.keys, dy_keys = kLog ? (int)sl.len : keys;
    fk::Pack<T> *sx = reinterpret_cast<fk::Pack<T> *>(smem_raw);
    const fk::Pack<T> *sdy = reinterpret_cast<const fk::Pack<T> *>(smem_raw + dy_base);
    fk::Pack<T> dy_reg[kDyRegs ? kDyRegPacks : 1];  // kDyRegs: pack lane + i * kLanes in dy_reg[i]
    if constexpr (kDyRegs) {
        const T *dyr = sl.start(dy, n);
#pragma unroll
        for (int i = 0; i < kDyRegPacks; i++)
            if (lane + i * kLanes < dy_packs) dy_reg[i] = fk::load_pack(dyr + (lane + i * kLanes) * VEC);
    }
    const float ref = sl.valid ? exp_ref(row_max[sl.row]) : 0.f;
    // y' = exp(x * scale - row_max) of element k of a pack v of x: unnormalised, z = sum y'
    // renormalises it
    auto y_unnorm = [&](int k, const fk::Pack<T> &v) { return exp_ftz(fmaf(fk::pack_f32<T>(v, k), scale, -ref)); };

    // fp32 keeps each y' in place of its x for the write pass (kExpOnce): one exp per element
    BwdSums<T, kLog> sums;  // (z, a): sum of y', sum of dy * y' (log: of dy)
    const int packs = x_packs > dy_packs ? x_packs : dy_packs;
    auto sum_pack = [&](int p, const fk::Pack<T> &g) {
        fk::Pack<T> v = sx[p];
        float yk[VEC], gk[VEC];
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            yk[k] = y_unnorm(k, v);
            gk[k] = fk::pack_f32<T>(g, k);
        }
        if constexpr (kCausal) {
            zero_outside<VEC>(p * VEC, sl.lo, keys, [&](int k) { yk[k] = 0.f; });
            zero_outside<VEC>(p * VEC, sl.lo, dy_keys, [&](int k) { gk[k] = 0.f; });
        }
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            if constexpr (kExpOnce<T>) keep_exp<T>(v, k, yk[k]);
            sums.add(yk[k], gk[k]);
        }
        if constexpr (kExpOnce<T>) sx[p] = v;
    };
    if constexpr (kDyRegs) {
        for (int c = 0; c < pieces.count; c++) mbar_wait(&bar[c]);
#pragma unroll
        for (int i = 0; i < kDyRegPacks; i++) {
            if (lane + i * kLanes < packs) sum_pack(lane + i * kLanes, dy_reg[i]);
            // the packs look rewritten here, so the write pass converts them again rather than
            // keeping both passes' fp32 values live (bf16: 128 registers and spills, 46% of copy
            // at (256, 400000) against fp16's 80%)
            uint4 &raw = *reinterpret_cast<uint4 *>(&dy_reg[i]);
            asm volatile("" : "+r"(raw.x), "+r"(raw.y), "+r"(raw.z), "+r"(raw.w));
        }
    } else {
        over_pieces<2>(bar, pieces, packs, lane, lanes, [&](int p) { sum_pack(p, sdy[p]); });
    }
    const Acc2<T> za = slice_reduce<false, SumSum<Acc2<T>>>(sums.value(), red, cluster_k);
    if (!sl.valid) return;
    const BwdRow<T> br(za.x, za.y, kLog, scale);
    T *dxr = sl.start(dx, n);
    auto write_pack = [&](int p, const fk::Pack<T> &g) {
        const fk::Pack<T> v = sx[p];
        float o[VEC];
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            const float yk = kExpOnce<T> ? kept_exp<T>(v, k) : y_unnorm(k, v);
            o[k] = br.template dx<kLog>(yk, fk::pack_f32<T>(g, k));
        }
        if constexpr (kCausal) zero_outside<VEC>(p * VEC, sl.lo, keys, [&](int k) { o[k] = 0.f; });
        store_in<T, VEC, kCausal, true>(dxr + p * VEC, o, p * VEC, sl.lo, (int)sl.len);
    };
    if constexpr (kDyRegs) {
#pragma unroll
        for (int i = 0; i < kDyRegPacks; i++)
            if (lane + i * kLanes < outs) write_pack(lane + i * kLanes, dy_reg[i]);
    } else {
#pragma unroll 2
        for (int p = lane; p < outs; p += lanes) write_pack(p, sdy[p]);
    }
#endif
}

// ---- backward rows of 1025-8192 elements (16384): one CTA a row, the row in registers ---------
//
// Each thread loads kPackElems elements of x and of dy (P = kPackElems / VEC 16-byte packs of
// each) at once, keeps its y' in registers, and the CTA (ceil(n / kPackElems) threads, up to
// kPackThreads) reduces the row's two sums once; rows too long for 8 elements a thread take 16
// (16-bit rows too long for that 32, see kPackRowMaxOf).
// It replaces the shared-memory kernels' warp-per-row and 128-thread CTA-per-row shapes for these
// rows: those put 4-8x the elements on a thread, so a CTA spent longer computing after its data
// had landed, and more CTAs an SM were needed to keep DRAM busy. This is torch.compile's shape
// (a CTA of up to 512 threads a row, 8 elements a thread a pass), with y recomputed. H200,
// same-process A/B against the shared-memory kernels, x torch.compile: fp32 (16384, 4096) 0.983
// -> 1.006-1.009x, bf16 0.979-0.981 -> 0.996-1.000x; outside the issue's shapes fp32 (131072, 1100)
// 0.74 -> 0.99x, (65536, 1536) 0.90-0.96 -> 1.003x, bf16 (32768, 2048) 0.97 -> 1.006x, (16384, 3000)
// 0.98 -> 1.07x. Measured against it: 8 elements a thread for fp32 rows of up to 2048 as 4 (1
// pack: fp32 (32768, 2048) 0.94-0.95x), 16 for 16-bit rows of up to 4096 (bf16 (16384, 4096)
// 0.992x; taken since on fast-DRAM devices, see kFastDramPerSm), 1024-thread CTAs (fp32
// (16384, 4096) 0.915x). Loads: load_pack_kept.
constexpr int kPackThreads = 512;
constexpr int kPackElems = 8;  // elements of x (and of dy) a thread, or twice that for long rows
constexpr int64_t kPackRowMax = 2 * kPackElems * kPackThreads;  // 8192
// CTAs an SM the kernel is compiled for (its register cap): 16-bit 8 elements a thread 4 (32
// registers), fp32 or 16-bit 16 elements 3 (38-40), fp32 16 elements 2 (62), 16-bit 32 elements 2
// (62-64).
template <typename T, int P> constexpr int kPackCtas = P * fk::Pack<T>::N == kPackElems ? (std::is_same_v<T, float> ? 3 : 4)
                                                     : P * fk::Pack<T>::N == 2 * kPackElems ? (std::is_same_v<T, float> ? 2 : 3)
                                                     : 2;
// Unmasked 16-bit rows of 8193-16384 whose rows are whole 16-byte accesses take 4 x kPackElems a
// thread (two CTAs an SM). H100, same-process A/B against the shared-memory kernels (clusters of two
// 32 KB CTAs), three calls, % of copy: bf16 (4096, 16384) 99.4-99.9 -> 101.1-102.1 (0.995-0.996 ->
// 1.018-1.019x torch.compile), (2048, 16384) 96.7-97.3 -> 99.7-101.8, (16384, 9000) 99.0 ->
// 100.6-100.7, (8192, 12000) 100.1 -> 100.4-100.6; the benchmark's own runs, which time fastkern
// before torch.compile (worth 1-1.5 points to this kernel, not to torch.compile's), measured bf16
// (4096, 16384) at 1.002x and 0.998x torch.compile (0.991-1.002x before). Kept on the shared-memory
// kernels: ragged rows (bf16 (8192, 12001)
// 97.7 -> 85.4), fp32 rows (1 CTA an SM at 120-128 registers: level to 0.6 below), masked rows
// (their 32-element instances spilled 8-76 bytes).
// 16-bit rows of 2049-4096 take 2 x kPackElems a thread (at 4096: six 256-thread CTAs an SM instead
// of four of 512, 1.5x the bytes in flight) on devices whose DRAM streams more than this many
// bytes a microsecond per SM (fk::dram_bytes_per_us_per_sm; Little's law: the faster the DRAM,
// the more must be in flight). Same-process A/B, x torch.compile, bf16 backward: H200 (~37 000)
// (16384, 4096) 0.992-0.995 -> 0.997-0.998x, (32768, 4096) 0.986 -> 0.995x, (16384, 3000) 1.055-1.061
// -> 1.064-1.072x, (16384, 2500) 1.119 -> 1.168x, (65536, 2560) 1.114 -> 1.134x; H100 (~25 000),
// where it is not taken: (16384, 4096) 1.002-1.003 -> 1.000-1.001x, (16384, 3000) 0.997 -> 0.993x,
// (16384, 2500) 1.011 -> 1.008x. The same line splits the shared-memory backward's CTA size
// (kSmemBwdSlowDramThreads).
constexpr int kFastDramPerSm = 30000;
template <typename T, bool kMasked>
constexpr int64_t kPackRowMaxOf = std::is_same_v<T, float> || kMasked ? kPackRowMax : 2 * kPackRowMax;

template <typename T, int P, bool kCausal, bool kLog, bool kRagged = false>
__global__ void __launch_bounds__(kPackThreads, (kPackCtas<T, P>))
softmax_bwd_rows_packs(int64_t n, const T *__restrict__ dy, const T *__restrict__ x,
                       const float *__restrict__ row_max, T *__restrict__ dx, float scale, int64_t causal_sq) {
    constexpr int VEC = fk::Pack<T>::N;
    __shared__ RowReduceSmem<Acc2<T>, kPackThreads / 32> red;
    fk::grid_dependency_sync();
    const int64_t row = blockIdx.x;
    const int lead = kRagged ? row_lead<VEC>(row, n) : 0;  // the row's frame (kRagged: unragged)
    const int packs = (int)(kRagged ? (lead + n + VEC - 1) / VEC : n / VEC);
    const int64_t keys = kCausal ? causal_len(row, n, causal_sq) : n;
    const int64_t dy_keys = kLog ? n : keys;  // log_softmax sums dy over masked keys too
    const T *xr = x + row * n - lead, *dyr = dy + row * n - lead;
    // pack i of this thread: threadIdx.x + i * blockDim.x; element k of it is in a length-`len`
    // prefix of the row when in(i, k, len)
    auto in = [&](int i, int k, int64_t len) {
        const int p = threadIdx.x + i * blockDim.x;
        return p < packs && (!kCausal || (int64_t)p * VEC + k < len);
    };
    // Loads under evict_last: fp32, and 16-bit rows of more than 8 elements a thread. H200,
    // same-process A/B, kept L2 lines released before each sample: bf16 (4096, 16384) 98.9 -> 99.8%
    // of copy (0.985 -> 0.993x torch.compile), (8192, 8192) 100.7 -> 101.7; (16384, 4096), 8
    // elements a thread, lost 0.6 with it. H100: bf16 (4096, 16384) 0.9991x torch.compile (12
    // rounds) -> 1.0026x (10 rounds, 9 ahead), ragged (32768, 4097) 100.7 -> 101.6 (run13 -> run14).
    constexpr bool kKeep = std::is_same_v<T, float> || P > 1;
    fk::Pack<T> vx[P], vg[P];
#pragma unroll
    for (int i = 0; i < P; i++) {
        const int64_t at = (int64_t)(threadIdx.x + i * blockDim.x) * VEC;
        *reinterpret_cast<uint4 *>(&vx[i]) = make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4 *>(&vg[i]) = make_uint4(0, 0, 0, 0);
        if (in(i, 0, keys)) vx[i] = load_pack_kept<T, kKeep>(xr + at);
        if (in(i, 0, dy_keys)) vg[i] = load_pack_kept<T, kKeep>(dyr + at);
    }
    const float ref = exp_ref(row_max[row]);
    BwdSums<T, kLog> sums;  // (z, a): sum of y', sum of dy * y' (log: of dy)
    float yv[P][VEC];
#pragma unroll
    for (int i = 0; i < P; i++) {
        auto add = [&](int k) { sums.add(yv[i][k], in(i, k, dy_keys) ? fk::pack_f32<T>(vg[i], k) : 0.f); };
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            yv[i][k] = in(i, k, keys) ? exp_ftz(fmaf(fk::pack_f32<T>(vx[i], k), scale, -ref)) : 0.f;
            if (!kRagged) add(k);
        }
        if (kRagged) {
            unragged<VEC>((threadIdx.x + i * blockDim.x) * VEC, lead, lead + (int)n, [&](int k) {
                yv[i][k] = 0.f;
                vg[i].v[k] = fk::from_f32<T>(0.f);
            });
#pragma unroll
            for (int k = 0; k < VEC; k++) add(k);
        }
    }
    const Acc2<T> za = row_reduce<SumSum<Acc2<T>>>(sums.value(), red, 1);
    const BwdRow<T> br(za.x, za.y, kLog, scale);
    T *dxr = dx + row * n - lead;
#pragma unroll
    for (int i = 0; i < P; i++) {
        if (!in(i, 0, n)) continue;
        float o[VEC];
#pragma unroll
        for (int k = 0; k < VEC; k++)
            o[k] = in(i, k, keys) ? br.template dx<kLog>(yv[i][k], fk::pack_f32<T>(vg[i], k)) : 0.f;
        const int j = (threadIdx.x + i * blockDim.x) * VEC;
        if (kRagged) {
            store_in<T, VEC, true>(dxr + j, o, j, lead, lead + (int)n);
        } else {  // one conversion an element, as written before kRagged (registers: see kPackCtas)
            fk::Pack<T> out;
#pragma unroll
            for (int k = 0; k < VEC; k++) out.v[k] = fk::from_f32<T>(o[k]);
            fk::store_pack(dxr + j, out);
        }
    }
}

// ---- inner > 1: the column tile in registers (and its chunks) -----------------------------------
//
// A CTA of TX x TY threads takes W = TX x VEC adjacent columns (TX x 16 bytes of each row where VEC
// is a pack, at least kTileRowBytes) and, with the other CTAs of its cluster (K of them, along
// blockIdx.x), all n rows of them: thread (tx, ty) of cluster rank q holds rows q TY + ty + i K TY,
// i < R (kTileRows; fp32 forwards 4 or 16), all loaded before the first is used. x (and dy) are read once,
// where the looped kernels below read them twice. The forward takes the exact column max, then
// one exp an element (fp32 keeps it for the output, 16-bit takes it again, as the row kernels) and
// the sum (fp64 for fp32 data, RowSum); the backward both sums in one pass. Each reduction
// (col_tile_reduce): shuffles across the rows a warp holds, a slot per warp and column in shared
// memory, a CTA total per column, and with a cluster the peers' totals read through distributed
// shared memory. Per SM: 16-bit forwards, two CTAs of 512 threads x 8 x 16 bytes = 128 KB of x in
// flight; fp32 forwards of long columns the same in CTAs of 256 threads x 16; backwards, two CTAs of
// 256 threads x 2 x 8 x 16 = 128 KB of x and dy.
constexpr int kTileRows = 8;            // accesses of x (and of dy) a thread holds
// The fewest bytes of a row a CTA's columns span: 64, two 32-byte sectors, halves the cluster (or
// the CTA) that 128 took for the same rows. H200, same-process A/B against 128, x torch.compile:
// bf16 backward (4096, 8192) dim 0 0.855 -> 0.895, (2048, 8192) 0.932 -> 0.968, (64, 1024, 512)
// dim 1 0.964 -> 0.980, forward (64, 1024, 512) 1.222 -> 1.345, (2048, 8192) 1.190 -> 1.318; fp32
// backward (4096, 8192) 0.956 -> 0.996, (16, 512, 4096) 1.130 -> 1.218, but (64, 1024, 512) 1.217
// -> 1.176. 32 bytes (one sector) lost to 64 on most columns past 512 rows (bf16 (4096, 8192)
// backward 0.864x), 16 lost up to half. H100, with the fp32 forward changes below: every column
// case level (within 0.7%) or ahead. One column a thread keeps a warp along the row (in 64 bytes,
// fp32 (4096, 8191) dim 0 forward went 0.880 -> 0.628x on the H100).
constexpr int kTileRowBytes = 64;
// The kernels' bounds: 64 registers a thread forward (see launch_fwd_col_tile), 128 backward (x and
// dy held). Launches take CTAs of half that, two an SM, whose phases (loads, reductions, stores)
// overlap, and the full size only where it holds the columns without a cluster: H100, % of copy,
// against the full size everywhere: forward fp32 (4096, 8192) dim 0 50 -> 55, (8, 2000, 8192) dim 1
// 59 -> 63, bf16 44 -> 50, 57 -> 62; backward fp32 (64, 1024, 512) dim 1 79 -> 83, (256, 128,
// 4096) 96 -> 100, bf16 (256, 128, 4096) 87 -> 92; fp32 (4096, 8192) dim 0 backward 66.5 -> 65.7;
// where the full size held the columns alone, the half size's 2-CTA clusters lost up to 4.6 points.
constexpr int kTileFwdThreads = 1024;
constexpr int kTileBwdThreads = 512;
// fp32 backwards of columns of up to kTileShortMax take 4 accesses a thread in CTAs of up to 256
// threads, three an SM (80 registers): H100, same-process A/B against 8 accesses, % of copy, (32,
// 19, 256, 512) dim 1 94.9 -> 98.2 (0.988 -> 1.023x torch.compile), (64, 21, 128, 128) 92.5 -> 97.0
// (0.958 -> 1.003x), (32, 40, 4096) 76.7 -> 88.5, (16, 64, 8192) 82.5 -> 91.6; but (256, 128, 4096)
// 100.5 -> 99.8, (64, 256, 1024) 89.8 -> 86.9, and 16-bit columns lost 2-15 points at every length
// but 40.
constexpr int kTileShortMax = 64, kTileShortRows = 4, kTileShortThreads = 256;

template <typename V> __device__ __forceinline__ V shfl_xor(V v, int offset) {
    if constexpr (std::is_same_v<V, float2> || std::is_same_v<V, double2>)
        return V{__shfl_xor_sync(0xffffffffu, v.x, offset), __shfl_xor_sync(0xffffffffu, v.y, offset)};
    else return __shfl_xor_sync(0xffffffffu, v, offset);
}

// Combines v[k] (column tx * VEC + k of the CTA's tile) over every thread of the cluster that
// holds rows of that column: every thread gets the totals. `smem`: (warps + 2) x W values of V.
template <typename V, int VEC, typename Combine>
__device__ __forceinline__ void col_tile_reduce(V (&v)[VEC], unsigned char *smem, int cluster_k, Combine combine) {
    const int tx = threadIdx.x, tid = threadIdx.y * blockDim.x + tx, threads = blockDim.x * blockDim.y;
    const int w = blockDim.x * VEC, warps = threads >> 5;
    V *slot = reinterpret_cast<V *>(smem), *cta = slot + warps * w, *total = cluster_k > 1 ? cta + w : cta;
    // a reduction before this one may still be reading its totals, and where its V is narrower
    // (the forward's float max, then its fp64 sum) they lie where this one's slots go
    __syncthreads();
#pragma unroll
    for (int k = 0; k < VEC; k++)
        for (int offset = blockDim.x; offset < 32; offset <<= 1) v[k] = combine(v[k], shfl_xor(v[k], offset));
    if ((tid & 31) < (int)blockDim.x)
#pragma unroll
        for (int k = 0; k < VEC; k++) slot[(tid >> 5) * w + tx * VEC + k] = v[k];
    __syncthreads();
    for (int c = tid; c < w; c += threads) {
        V t = slot[c];
        for (int i = 1; i < warps; i++) t = combine(t, slot[i * w + c]);
        cta[c] = t;
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (cluster_k > 1) {
        cg::cluster_group cluster = cg::this_cluster();
        cluster.sync();  // every CTA's totals are in
        for (int c = tid; c < w; c += threads) {
            V t = cluster.map_shared_rank(cta, 0)[c];
            for (int r = 1; r < cluster_k; r++) t = combine(t, cluster.map_shared_rank(cta, r)[c]);
            total[c] = t;
        }
        cluster.sync();  // no peer reads this CTA's totals any more (it may exit, or reduce again)
    } else
#endif
        __syncthreads();
#pragma unroll
    for (int k = 0; k < VEC; k++) v[k] = total[tx * VEC + k];
}

// The thread's rows of its column tile: access i reads row first + i * step; in(i): that row is one of
// the n and the thread's columns exist.
struct TileRows {
    int first, step, n;
    bool active;
    __device__ __forceinline__ TileRows(int cluster_k, int n_, bool active_)
        : first((int)(blockIdx.x % cluster_k) * blockDim.y + threadIdx.y), step(cluster_k * blockDim.y), n(n_),
          active(active_) {}
    __device__ __forceinline__ bool in(int i) const { return active && first + i * step < n; }
};

// p + stride, computed where it is used: the compiler cannot keep the accesses' 64-bit offsets
// live from the loads to the stores (16 registers for 8 accesses).
template <typename T> __device__ __forceinline__ T *advance(T *p, int64_t stride) {
    p += stride;
    asm volatile("" : "+l"(p));
    return p;
}

// The column block's base offset (o n inner + i) of the VEC columns from `column`.
__device__ __forceinline__ int64_t column_base(int64_t column, int64_t n, int64_t inner) {
    const int64_t o = column / inner;
    return o * n * inner + (column - o * inner);
}

// kChunked: columns longer than the cluster's threads hold kRows accesses of take chunks of them:
// the max over every chunk, the sum from the last chunk (still held) back to the first, the writes
// from the first (still held) on, so x is read three times, the chunks read again most recently
// first (from L2 where they still are). One chunk (the tile) reads x once.
template <typename T, int VEC, bool kLog, int kThreads, int kRows = kTileRows, bool kChunked = false>
__global__ void __launch_bounds__(kThreads, 1)
softmax_fwd_col_tile(const T *__restrict__ x, T *__restrict__ y, float *__restrict__ row_max, int64_t columns,
                     int n, int64_t inner, int cluster_k, float scale) {
    extern __shared__ __align__(16) unsigned char tile_smem[];
    fk::grid_dependency_sync();
    const int64_t column = ((int64_t)(blockIdx.x / cluster_k) * blockDim.x + threadIdx.x) * VEC;
    const TileRows rows(cluster_k, n, column < columns);
    const int64_t base = rows.active ? column_base(column, n, inner) : 0, stride = rows.step * inner,
                  offset = base + rows.first * inner;
    const int chunks = kChunked ? (n + rows.step * kRows - 1) / (rows.step * kRows) : 1;
    Raw<T, VEC> raw[kRows];
    auto load = [&](int c) {
        const T *xp = x + offset + (int64_t)c * kRows * stride;
#pragma unroll
        for (int i = 0; i < kRows; i++, xp = advance(xp, stride)) raw[i] = load_or_zero<T, VEC>(xp, rows.in(c * kRows + i));
    };
    float m[VEC];
#pragma unroll
    for (int k = 0; k < VEC; k++) m[k] = -INFINITY;
    auto max_of = [&](int c) {
#pragma unroll
        for (int k = 0; k < VEC; k++)
#pragma unroll
            for (int i = 0; i < kRows; i++)
                if (rows.in(c * kRows + i)) m[k] = fmaxf(m[k], __fmul_rn(raw_at<T, VEC>(raw[i], k), scale));
    };
    if constexpr (!kChunked) load(0), max_of(0);
    else
        for (int c = 0; c < chunks; c++) load(c), max_of(c);
    col_tile_reduce(m, tile_smem, cluster_k, [](float a, float b) { return fmaxf(a, b); });
    auto e_of = [&](int i, int k) { return exp_ftz(fmaf(raw_at<T, VEC>(raw[i], k), scale, -exp_ref(m[k]))); };
    float e[kExpOnce<T> && !kChunked ? kRows * VEC : 1];  // a lone chunk's exps (fp32), for the writes
    RowSum<T> sums[VEC];
    auto sum_of = [&](int c) {
#pragma unroll
        for (int k = 0; k < VEC; k++)
#pragma unroll
            for (int i = 0; i < kRows; i++) {
                const float ek = rows.in(c * kRows + i) ? e_of(i, k) : 0.f;
                if constexpr (kExpOnce<T> && !kChunked) e[i * VEC + k] = ek;
                sums[k].add(ek);
            }
    };
    if constexpr (!kChunked) sum_of(0);
    else
        for (int c = chunks - 1; c >= 0; c--) {
            if (c < chunks - 1) load(c);
            sum_of(c);
        }
    Acc<T> s[VEC];
#pragma unroll
    for (int k = 0; k < VEC; k++) s[k] = sums[k].value();
    col_tile_reduce(s, tile_smem, cluster_k, [](Acc<T> a, Acc<T> b) { return a + b; });
    if (rows.active && rows.first == 0 && row_max)
#pragma unroll
        for (int k = 0; k < VEC; k++) row_max[column + k] = m[k];
    float sf[VEC], inv_s[VEC], log_s[VEC];
#pragma unroll
    for (int k = 0; k < VEC; k++) sf[k] = (float)s[k], inv_s[k] = 1.f / sf[k], log_s[k] = logf(sf[k]);
    auto write = [&](int c) {
        T *yp = y + offset + (int64_t)c * kRows * stride;
#pragma unroll
        for (int i = 0; i < kRows; i++, yp = advance(yp, stride)) {
            if (!rows.in(c * kRows + i)) continue;
            float out[VEC];
#pragma unroll
            for (int k = 0; k < VEC; k++)
                out[k] = kLog ? fmaf(raw_at<T, VEC>(raw[i], k), scale, -exp_ref(m[k])) - log_s[k]
                              : normalize<T>(kExpOnce<T> && !kChunked ? e[i * VEC + k] : e_of(i, k), sf[k], inv_s[k]);
            store_vec<T, VEC>(yp, out);
        }
    };
    if constexpr (!kChunked) write(0);
    else
        for (int c = 0; c < chunks; c++) {
            if (c > 0) load(c);
            write(c);
        }
}

template <typename T, int VEC, bool kLog, int kRows = kTileRows, int kThreads = kTileBwdThreads, int kMinCtas = 1,
          bool kChunked = false>
__global__ void __launch_bounds__(kThreads, kMinCtas)
softmax_bwd_col_tile(const T *__restrict__ dy, const T *__restrict__ x, const float *__restrict__ row_max,
                     T *__restrict__ dx, int64_t columns, int n, int64_t inner, int cluster_k, float scale) {
    extern __shared__ __align__(16) unsigned char tile_smem[];
    fk::grid_dependency_sync();
    const int64_t column = ((int64_t)(blockIdx.x / cluster_k) * blockDim.x + threadIdx.x) * VEC;
    const TileRows rows(cluster_k, n, column < columns);
    const int64_t base = rows.active ? column_base(column, n, inner) : 0, stride = rows.step * inner,
                  offset = base + rows.first * inner;
    // kChunked: columns longer than the cluster's threads hold kRows accesses of take chunks of them,
    // the sums over every chunk, then the writes from the last chunk (still held) back to the first
    // (loaded again). One chunk (the tile) reads x and dy once.
    const int chunks = kChunked ? (n + rows.step * kRows - 1) / (rows.step * kRows) : 1;
    Raw<T, VEC> raw_x[kRows], raw_dy[kRows];
    auto load = [&](int c) {
#pragma unroll
        for (int i = 0; i < kRows; i++) {
            const int r = c * kRows + i;
            raw_x[i] = load_or_zero<T, VEC>(x + offset + r * stride, rows.in(r));
            raw_dy[i] = load_or_zero<T, VEC>(dy + offset + r * stride, rows.in(r));
        }
    };
    float ref[VEC];
#pragma unroll
    for (int k = 0; k < VEC; k++) ref[k] = rows.active ? exp_ref(row_max[column + k]) : 0.f;
    // y' = exp(x * scale - row_max): unnormalised, z = sum y' renormalises it
    auto y_of = [&](int c, int i, int k) {
        return rows.in(c * kRows + i) ? exp_ftz(fmaf(raw_at<T, VEC>(raw_x[i], k), scale, -ref[k])) : 0.f;
    };
    float yv[kExpOnce<T> ? kRows * VEC : 1];  // the exps of a lone chunk (fp32), for the writes
    BwdSums<T, kLog> sums[VEC];
    auto accumulate = [&](int c, auto keep) {
#pragma unroll
        for (int k = 0; k < VEC; k++)
#pragma unroll
            for (int i = 0; i < kRows; i++) {
                const float yk = y_of(c, i, k);
                if constexpr (decltype(keep)::value) yv[i * VEC + k] = yk;
                sums[k].add(yk, raw_at<T, VEC>(raw_dy[i], k));
            }
    };
    if constexpr (!kChunked) load(0), accumulate(0, std::bool_constant<kExpOnce<T>>());
    else
        for (int c = 0; c < chunks; c++) load(c), accumulate(c, std::false_type());
    Acc2<T> za[VEC];
#pragma unroll
    for (int k = 0; k < VEC; k++) za[k] = sums[k].value();
    col_tile_reduce(za, tile_smem, cluster_k, [](Acc2<T> a, Acc2<T> b) { return SumSum<Acc2<T>>::combine(a, b); });
    BwdRow<T> br[VEC];
#pragma unroll
    for (int k = 0; k < VEC; k++) br[k] = BwdRow<T>(za[k].x, za[k].y, kLog, scale);
    auto write = [&](int c, auto kept) {
#pragma unroll
        for (int i = 0; i < kRows; i++) {
            const int r = c * kRows + i;
            if (!rows.in(r)) continue;
            float out[VEC];
#pragma unroll
            for (int k = 0; k < VEC; k++)
                out[k] = br[k].template dx<kLog>(decltype(kept)::value ? yv[i * VEC + k] : y_of(c, i, k),
                                                 raw_at<T, VEC>(raw_dy[i], k));
            store_vec<T, VEC>(dx + offset + r * stride, out);
        }
    };
    if constexpr (!kChunked) write(0, std::bool_constant<kExpOnce<T>>());
    else
        for (int c = chunks - 1; c >= 0; c--) {
            if (c < chunks - 1) load(c);
            write(c, std::false_type());
        }
}

// ---- inner > 1, columns the tile does not take (see launch_col_tile): looped kernels -----------
//
// A thread per (outer, inner) column, 32 of them per warp along inner so loads stay coalesced, and
// the CTA's ny threads (threadIdx.y) split n, kColsUnroll loads in flight each. The passes: an
// online (max, sum) down each thread's part of n, a merge of the ny partials through shared memory,
// then the write pass, which re-reads x (from L2 where the CTAs' column blocks fit it). Only columns
// the tile takes one a thread (inner not a multiple of a pack, or tensors not 16-byte aligned) come
// here, where they need more than the largest cluster and this grid covers the SMs: 16-byte columns
// always take the tile, in chunks of rows past its largest cluster.
constexpr int kColsX = 32;  // threads per CTA along inner
constexpr int kColsUnroll = 4;

template <typename T>
__global__ void __launch_bounds__(1024)
softmax_fwd_cols(const T *__restrict__ x, T *__restrict__ y, float *__restrict__ row_max, int64_t columns,
                 int64_t n, int64_t inner, float scale, int is_log) {
    fk::grid_dependency_sync();
    // the sum is kept in fp64: in fp32, its rescalings and the merge of up to 32 partial sums
    // left the output at 3.5x torch's error (torch takes the exact max first, then one sum)
    __shared__ float part_m[32][kColsX];
    __shared__ double part_s[32][kColsX];
    const int tx = threadIdx.x, ty = threadIdx.y, ny = blockDim.y;
    const int64_t column = (int64_t)blockIdx.x * kColsX + tx;
    const bool active = column < columns;
    const int64_t o = column / inner, base = o * n * inner + (column - o * inner);
    auto scaled = [&](int64_t j) { return __fmul_rn(fk::to_f32(__ldg(x + base + j * inner)), scale); };

    float m = -INFINITY;
    double s = 0.0;
    if (active) {
        for (int64_t j0 = (int64_t)ty * kColsUnroll; j0 < n; j0 += (int64_t)ny * kColsUnroll) {
            float v[kColsUnroll];
#pragma unroll
            for (int u = 0; u < kColsUnroll; u++) v[u] = j0 + u < n ? scaled(j0 + u) : -INFINITY;
            float cm = v[0];
#pragma unroll
            for (int u = 1; u < kColsUnroll; u++) cm = fmaxf(cm, v[u]);
            const float m_new = fmaxf(m, cm), ref = exp_ref(m_new);
            s = rescale(s, m, m_new);
#pragma unroll
            for (int u = 0; u < kColsUnroll; u++) s += expf(v[u] - ref);
            m = m_new;
        }
    }
    part_m[ty][tx] = m;
    part_s[ty][tx] = s;
    __syncthreads();
    m = -INFINITY;
    for (int t = 0; t < ny; t++) m = fmaxf(m, part_m[t][tx]);
    s = 0.0;
    for (int t = 0; t < ny; t++) s += rescale(part_s[t][tx], part_m[t][tx], m);
    if (!active) return;
    const float ref = exp_ref(m), inv_s = (float)(1.0 / s), log_s = (float)log(s);
    if (ty == 0 && row_max) row_max[column] = m;
#pragma unroll kColsUnroll
    for (int64_t j = ty; j < n; j += ny) {
        const float v = scaled(j);
        y[base + j * inner] =
            fk::from_f32<T>(is_log ? (v - ref) - log_s : normalize<T>(expf(v - ref), (float)s, inv_s));
    }
}

template <typename T>
__global__ void __launch_bounds__(1024)
softmax_bwd_cols(const T *__restrict__ dy, const T *__restrict__ x, const float *__restrict__ row_max,
                 T *__restrict__ dx, int64_t columns, int64_t n, int64_t inner, float scale,
                 int is_log) {
    fk::grid_dependency_sync();
    __shared__ Acc<T> part_z[32][kColsX], part_a[32][kColsX];
    const int tx = threadIdx.x, ty = threadIdx.y, ny = blockDim.y;
    const int64_t column = (int64_t)blockIdx.x * kColsX + tx;
    const bool active = column < columns;
    const int64_t o = column / inner, base = o * n * inner + (column - o * inner);
    const float ref = active ? exp_ref(row_max[column]) : 0.f;
    auto y_of = [&](int64_t j) { return expf(fmaf(fk::to_f32(__ldg(x + base + j * inner)), scale, -ref)); };
    auto g_of = [&](int64_t j) { return fk::to_f32(__ldg(dy + base + j * inner)); };

    Acc<T> z = 0, a = 0;
    if (active) {
#pragma unroll kColsUnroll
        for (int64_t j = ty; j < n; j += ny) {
            const float yv = y_of(j), g = g_of(j);
            z += yv;
            a += is_log ? (Acc<T>)g : (Acc<T>)g * yv;
        }
    }
    part_z[ty][tx] = z;
    part_a[ty][tx] = a;
    __syncthreads();
    z = 0;
    a = 0;
    for (int t = 0; t < ny; t++) z += part_z[t][tx], a += part_a[t][tx];
    if (!active) return;
    const BwdRow<T> br(z, a, is_log, scale);
#pragma unroll kColsUnroll
    for (int64_t j = ty; j < n; j += ny) {
        const float yv = y_of(j), g = g_of(j);
        dx[base + j * inner] = fk::from_f32<T>(is_log ? br.template dx<true>(yv, g) : br.template dx<false>(yv, g));
    }
}

// ---- host side ---------------------------------------------------------------------------------

// The largest cluster (16, else 8) that `kernel`, with `threads` threads and `smem` bytes of dynamic
// shared memory, can be resident with on `device`: 1 where clusters do not exist, 0 where the
// kernel may not have that much shared memory. Asked once per kernel, device and smem (0,
// kSmemCtaMax, kSmemCtaBigMax, kSmemCtaHugeMax, or kDyRegSliceMax: the dy-register kernels ask for
// that alone; the column tile asks for its clustered CTAs' size alone); the kernel's allowance
// only grows, so a smaller size asked later never takes back a larger one.
template <auto kernel> int cluster_limit(int device, int threads, int smem) {
    static int known[64][4];   // the limit + 1; 0 until asked
    if (fk::compute_major(device) < 9 || device < 0 || device >= 64) return 1;
    const int which = smem == 0 ? 0 : smem <= kSmemCtaMax ? 1 : smem <= kSmemCtaBigMax ? 2 : 3;
    if (known[device][which] == 0) {
        int limit = 0;
        // an allowance is set only past the kernel's current one: setting a smaller one (even below
        // the 48 KB default) would fail its launches with more (the column tile's lone CTAs take
        // more than its clustered ones)
        cudaFuncAttributes attributes = {};
        if ((cudaFuncGetAttributes(&attributes, kernel) == cudaSuccess && smem <= attributes.maxDynamicSharedSizeBytes) ||
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) == cudaSuccess) {
            limit = 1;
            // without the non-portable allowance clusters stop at 8
            cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
            for (int k = kMaxCluster; k > 1 && limit == 1; k /= 2) {
                const fk::Launch launch(dim3((unsigned)k), dim3(threads), smem, nullptr, -1, k);
                int clusters = 0;
                if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &launch.config) == cudaSuccess && clusters > 0)
                    limit = k;
            }
        }
        cudaGetLastError();
        known[device][which] = limit + 1;
    }
    return known[device][which] - 1;
}

int64_t pow2_ceil(int64_t v) {
    int64_t p = 1;
    while (p < v) p *= 2;
    return p;
}

// Picks the cluster size K and CTA size of a row-block kernel (C elements per thread) and launches
// it: K is the smallest power of two that leaves each CTA at most kCtaChunks chunks of kBlockThreads
// threads (capped by the cluster limit), and a slice of one chunk takes only the warps it fills.
// Measured on an H100: re-reading a second chunk from L2 costs less than a larger cluster's
// co-scheduling and barrier, or than CTAs of 256 threads. Sized for `frame` elements a row (a
// ragged row's frame: up to n + VEC - 1).
template <auto kernel, int VEC, int C, typename... Args>
fk_status launch_rows_block(const char *op, int64_t rows, int64_t n, int64_t frame, int device,
                            cudaStream_t stream, Args... args) {
    const int64_t per_cta = (int64_t)kBlockThreads * C * kCtaChunks;
    int64_t k = 1;
    if (frame > per_cta) {
        const int64_t limit = cluster_limit<kernel>(device, kBlockThreads, 0);
        k = pow2_ceil((frame + per_cta - 1) / per_cta);
        if (k > limit) k = limit;
    }
    const int64_t seg = ((frame + k - 1) / k + VEC - 1) / VEC * VEC;
    const int64_t warps = ((seg + C - 1) / C + 31) / 32;
    const int threads = 32 * (int)(warps < kBlockThreads / 32 ? warps : kBlockThreads / 32);
    if (rows * k > 0x7fffffff)
        return fk_fail(FK_ERR_VALUE, "%s: %lld rows of %lld elements exceed the CUDA grid", op,
                       (long long)rows, (long long)n);
    return fk::Launch(dim3((unsigned)(rows * k)), dim3(threads), 0, stream, device, k)(op, kernel, n, seg, (int)k, args...);
}

// Launches a shared-memory row kernel (kTensors slices per row: x, or x and dy) when the device
// has the bulk copy engine, tensors are 16-byte aligned and a CTA's slices fit; returns false
// (launching nothing) otherwise. Sized for `frame` elements a row (row_frame: ragged rows, which
// the masked instances take). warp_kernel nullptr (the backward, whose in-register kernels take
// every row of 8192 elements or less): no kernel for rows of kSmemWarpRowMax or less. warp_packs >
// 0: the CTA kernel takes a warp per warp_packs packs of its slice, up to its fixed thread count.
// huge: the CTA kernel may take slices of up to kSmemCtaHugeMax (the forward's unmasked instances).
template <auto warp_kernel, auto cta_kernel, auto dy_reg_kernel, auto dy_reg_wide_kernel, typename T, int kTensors,
          auto slow_dram_cta_kernel = nullptr, int kCtaThreads = kSmemThreads<kTensors == 2>, typename... Args>
bool launch_rows_smem(fk_status &status, const char *op, int64_t rows, int64_t n, int64_t frame, int device,
                      cudaStream_t stream, int warp_packs, bool huge, Args... args) {
    constexpr int64_t VEC = fk::Pack<T>::N;
    if (fk::compute_major(device) < 9) return false;
    frame = (frame + VEC - 1) / VEC * VEC;
    const int64_t row_bytes = frame * (int64_t)sizeof(T) * kTensors;
    // kWarpRows rows a CTA: at most 32 KB of rows and their frames' leads, under the 48 KB that
    // needs no opt-in (decided by the row, so that a ragged row of 8 KB takes a warp, as a packed
    // one does)
    if (n * (int64_t)sizeof(T) * kTensors <= kSmemWarpRowMax) {
        if constexpr (warp_kernel == nullptr) {
            return false;
        } else {
            const int64_t ctas = (rows + kWarpRows - 1) / kWarpRows;
            if (ctas > 0x7fffffff) return false;
            status = fk::Launch(dim3((unsigned)ctas), dim3(32 * kWarpRows), (size_t)(kWarpRows * row_bytes), stream,
                                device)(op, warp_kernel, n, frame, 1, rows, args...);
            return true;
        }
    }
    int64_t k = pow2_ceil((row_bytes + kSmemCtaMax - 1) / kSmemCtaMax);
    if constexpr (slow_dram_cta_kernel != nullptr)  // CTAs of at least 3/4 kSmemCtaMax, see kSmemBwdSlowDramThreads
        if (4 * row_bytes >= 3 * k * kSmemCtaMax && fk::dram_bytes_per_us_per_sm(device) <= kFastDramPerSm)
            return launch_rows_smem<warp_kernel, slow_dram_cta_kernel, dy_reg_kernel, dy_reg_wide_kernel, T, kTensors,
                                    nullptr, kSmemBwdSlowDramThreads>(status, op, rows, n, frame, device, stream,
                                                                      warp_packs, huge, args...);
    int threads = kCtaThreads;
    const int64_t limit = cluster_limit<cta_kernel>(device, threads, (int)kSmemCtaMax);
    if (limit == 0) return false;
    if (k > limit) k = limit;
    // slices of whole 128-byte lines, as their shared-memory copies (kSliceAlign); H100, against
    // 16-byte multiples: dy-register backwards fp32 (256, 500001) 81.4 -> 86.6% of copy, bf16 (256,
    // 500001) 86.2 -> 90.5, (128, 1000003) 73.9 -> 82.4; others level
    constexpr int64_t kLine = 128 / sizeof(T);
    const int64_t seg = ((frame + k - 1) / k + kLine - 1) / kLine * kLine;
    const int64_t smem = seg * (int64_t)sizeof(T) * kTensors;
    if (rows * k > 0x7fffffff) return false;
    if (warp_packs > 0) {
        const int64_t warps = (seg * (int64_t)sizeof(T) / 16 + warp_packs - 1) / warp_packs;
        if (warps < threads / 32) threads = 32 * (int)warps;
    }
    // a row a full cluster of kSmemCtaMax CTAs cannot hold: CTAs of up to kSmemCtaBigMax, or huge ones
    auto fits = [&](int64_t max) { return smem <= max && cluster_limit<cta_kernel>(device, threads, (int)max) >= k; };
    if (smem <= kSmemCtaMax || fits(kSmemCtaBigMax) || (huge && fits(kSmemCtaHugeMax))) {
        status = fk::Launch(dim3((unsigned)(rows * k)), dim3(threads), (size_t)smem, stream, device, k)(
            op, cta_kernel, n, seg, (int)k, rows, args...);
        return true;
    }
    if constexpr (kTensors == 2) {  // x in shared memory, dy in registers (kDyRegLanes)
        const int64_t x_smem = seg * (int64_t)sizeof(T);
        auto try_launch = [&](auto kernel, int lanes, int64_t max) {
            if (x_smem > max || cluster_limit<decltype(kernel)::value>(device, lanes, (int)max) < k) return false;
            status = fk::Launch(dim3((unsigned)(rows * k)), dim3(lanes), (size_t)x_smem, stream, device, k)(
                op, decltype(kernel)::value, n, seg, (int)k, rows, args...);
            return true;
        };
        return try_launch(std::integral_constant<decltype(dy_reg_kernel), dy_reg_kernel>(), kDyRegThreads,
                          kDyRegSliceMax<kDyRegThreads>) ||
               try_launch(std::integral_constant<decltype(dy_reg_wide_kernel), dy_reg_wide_kernel>(), kDyRegWideThreads,
                          kDyRegSliceMax<kDyRegWideThreads>);
    }
    return false;
}

// Launches an in-register row kernel, one CTA a row, for rows of `frame` elements: kernel takes
// kPackElems elements a thread, wide_kernel twice that past kPackElems * kPackThreads (or past
// `wide_from`), widest_kernel four times past twice that (rows up to kPackRowMaxOf).
template <auto kernel, auto wide_kernel, auto widest_kernel, typename... Args>
fk_status launch_rows_packs(const char *op, int64_t rows, int64_t frame, int64_t wide_from, int device,
                            cudaStream_t stream, Args... args) {
    if (rows > 0x7fffffff) return fk_fail(FK_ERR_VALUE, "%s: %lld rows exceed the CUDA grid", op, (long long)rows);
    const int times = frame > 2 * kPackElems * kPackThreads ? 4 : frame > wide_from ? 2 : 1;
    const int64_t per = times * kPackElems;
    const int threads = (int)(((frame + per - 1) / per + 31) / 32 * 32);
    const fk::Launch launch(dim3((unsigned)rows), dim3(threads), 0, stream, device);
    if (times == 4) return launch(op, widest_kernel, args...);
    return times == 2 ? launch(op, wide_kernel, args...) : launch(op, kernel, args...);
}

// Lanes per row and elements per lane for the warp kernels. Packed rows: kBytes a lane per tensor
// (forward 64, backward 32 of each of x and dy; more for rows that need it) and the fewest lanes
// that cover the row, so a short row is reduced over few lanes (fp32 (65536, 128) forward: 8 lanes,
// 3 shuffle levels, where 32 lanes holding 4 rows each took 20 levels a lane); the common lane
// counts are compile-time. Scalar rows (misaligned or odd n): the smallest C with 32 * C >= n, and
// rows shorter than 32 share a warp. A row of 16 or 32 lanes that 3/4 of their elements hold takes
// half the lanes with 3/2 the elements (kBytes x 3/2 a lane): rows just past a power of two, e.g.
// 257 ViT tokens, fill 69% of their slots instead of 52%. H100, same-process A/B, % of copy: bf16
// (65536, 257) forward 80.5 -> 88.2, backward 82.8 -> 94.8 (0.93 -> 1.07x torch.compile); fp32
// forwards (65536, 160 / 320 / 384) +1 to +2, 257 -1; backwards level. From 8 lanes to 4 it cost
// the fp32 (65536, 90) forward 95 -> 74. Calls launch(C, G, group): C and G as
// std::integral_constant, group the lanes per row (G when G > 0).
template <typename T, int VEC, int kBytes, int C = (VEC == 1 ? 1 : kBytes / (int)sizeof(T)), typename F>
fk_status with_warp_shape(int64_t n, F &&launch) {
    if constexpr (C < 32) {
        if (32 * C < n) return with_warp_shape<T, VEC, kBytes, 2 * C>(n, launch);
    }
    const int group = (int)pow2_ceil((n + C - 1) / C);
    // past the first C, rows fill 32 lanes (n > 16 C)
    if constexpr (C == 1) {
        return launch(std::integral_constant<int, C>(), std::integral_constant<int, 0>(), group);
    } else if constexpr (VEC == 1 || C > kBytes / (int)sizeof(T)) {
        return launch(std::integral_constant<int, C>(), std::integral_constant<int, 32>(), group);
    } else {
        auto with = [&](auto c, auto g) { return launch(c, g, g() ? g() : group); };
        using C1 = std::integral_constant<int, C>;
        using C3 = std::integral_constant<int, C % (2 * VEC) == 0 ? 3 * C / 2 : C>;
        if (C3() != C && group >= 16 && n <= group / 2 * C3()) {
            if (group == 32) return with(C3(), std::integral_constant<int, 16>());
            return with(C3(), std::integral_constant<int, 8>());
        }
        switch (group) {
        case 32: return with(C1(), std::integral_constant<int, 32>());
        case 16: return with(C1(), std::integral_constant<int, 16>());
        case 8: return with(C1(), std::integral_constant<int, 8>());
        case 4: return with(C1(), std::integral_constant<int, 4>());
        default: return with(C1(), std::integral_constant<int, 0>());
        }
    }
}

// A grid of the warp kernels that fits one wave runs at most k = ceil(CTAs / SMs) CTAs an SM. Under
// programmatic dependent launch the next call's CTAs take whichever SM slots are free as this one
// drains, so SMs that finish first take more than their share of the next grid, and a one-wave
// kernel lasts as long as its fullest SM. Each CTA then reserves 1 / k of a 100 KB shared-memory
// carveout, asked for with the carveout hint while the kernel runs such grids (without the hint
// the driver picks a carveout of its own and the cap can fail; with 64 KB it failed for k = 8, 9;
// 228 KB leaves 28 KB of L1: fp32 backward -3). H200, (3000, 1000) (750 CTAs), with the word-wise
// bf16 conversion above: bf16 backward 64-66 -> 75-76% of copy, forward 63-65 -> 71-74, fp32
// forward 79-80 -> 85-88, fp32 backward level.
constexpr int kSpreadCarveout = 100 * 1024;

// CTAs of `kernel` (kThreads threads) an SM holds without the cap, once the kernel may take the
// cap's shared memory; -1 where that cannot be had.
template <auto kernel, int kThreads> int warp_occupancy(int device) {
    static int occupancy[64];
    if (device < 0 || device >= 64) return -1;
    if (occupancy[device] == 0) {
        int v = 0;
        if (fk::smem_per_sm(device) <= 0 ||
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, kernel, kThreads, 0) != cudaSuccess ||
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 kSpreadCarveout - fk::smem_reserved_per_cta(device)) != cudaSuccess)
            v = -1;
        cudaGetLastError();
        occupancy[device] = v > 0 ? v : -1;
    }
    return occupancy[device];
}

template <auto kernel, int kThreads> size_t one_wave_smem(int64_t ctas, int device) {
    static bool hinted[64];  // whether the carveout hint is set
    const int occupancy = warp_occupancy<kernel, kThreads>(device);
    if (occupancy < 0) return 0;
    const int sms = fk::sm_count(device);
    const int64_t k = (ctas + sms - 1) / sms;
    const bool spread = k > 0 && k < occupancy;  // one wave, where the cap binds
    if (spread != hinted[device]) {
        const int percent =
            spread ? (int)(100LL * kSpreadCarveout / fk::smem_per_sm(device)) : cudaSharedmemCarveoutDefault;
        if (cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, percent) != cudaSuccess) {
            cudaGetLastError();
            return 0;
        }
        hinted[device] = spread;
    }
    return spread ? (size_t)(kSpreadCarveout / k / 128 * 128 - fk::smem_reserved_per_cta(device)) : 0;
}

// CTAs of kThreads threads that rows of ROWS per lane group of `group` lanes take.
template <int ROWS, int kThreads> int64_t warp_ctas(int64_t rows, int group) {
    const int64_t rows_per_cta = (int64_t)ROWS * (32 / group) * (kThreads / 32);
    return (rows + rows_per_cta - 1) / rows_per_cta;
}

template <auto kernel, int ROWS, int kThreads, typename... Args>
fk_status launch_rows_warp(const char *op, int64_t rows, int64_t n, int group, int device, cudaStream_t stream,
                           Args... args) {
    const int64_t ctas = warp_ctas<ROWS, kThreads>(rows, group);
    if (ctas > 0x7fffffff) return fk_fail(FK_ERR_VALUE, "%s: %lld rows exceed the CUDA grid", op, (long long)rows);
    return fk::Launch(dim3((unsigned)ctas), dim3(kThreads), one_wave_smem<kernel, kThreads>(ctas, device), stream,
                      device)(op, kernel, rows, (int)n, group, args...);
}

// Calls launch(threads), threads the CTA size of a warp kernel: kWarpBlock, but one warp for fp32
// rows of C = 32 elements a lane (a warp a row: packed rows of 513-1024 elements) on grids of more
// than one wave of kWarpBlock CTAs (`block_kernel` is that instance). H200, same-process A/B: fp32
// (32768, 1024) forward 96.0-96.2 -> 96.8-97.3% of copy (0.992 -> 1.002x torch.compile), backward
// 100.1 -> 100.2-100.7; 64-thread CTAs were level there. One-wave grids keep kWarpBlock CTAs spread
// by one_wave_smem: one-warp CTAs took the (3000, 1000) forward from 1.17x torch.compile to 0.99x.
template <typename T, int C, auto block_kernel, int ROWS, typename F>
fk_status with_warp_block(int64_t rows, int group, int device, F &&launch) {
    if constexpr (std::is_same_v<T, float> && C == 32) {
        const int occupancy = warp_occupancy<block_kernel, kWarpBlock>(device);
        if (occupancy > 0 && warp_ctas<ROWS, kWarpBlock>(rows, group) > (int64_t)occupancy * fk::sm_count(device))
            return launch(std::integral_constant<int, 32>());
    }
    return launch(std::integral_constant<int, kWarpBlock>());
}

// Rows of n elements; VEC > 1 with n % VEC != 0: ragged rows (row_lead), which the register
// kernels take, sized for their longest frame.
template <int VEC> int64_t row_frame(int64_t n) { return n % VEC ? n + VEC - 1 : n; }

// Calls go(std::integral_constant<bool, kRagged>()): true for ragged rows (row_lead) where the
// caller has kRagged instances (not kMasked).
template <int VEC, bool kMasked, typename F> fk_status with_ragged(bool ragged, F &&go) {
    if constexpr (VEC > 1 && !kMasked)
        if (ragged) return go(std::true_type());
    return go(std::false_type());
}

// The forward's warp-per-row shared-memory instance: none for fp32, whose rows of up to 8 KB take
// the row-block kernel (block_first below).
template <typename T, bool kMasked, bool kLog> constexpr auto kFwdWarpRows = softmax_fwd_rows_smem<T, kMasked, kLog, true>;
template <bool kMasked, bool kLog> constexpr auto kFwdWarpRows<float, kMasked, kLog> = nullptr;

template <typename T, int VEC, bool kCausal, bool kLog>
fk_status launch_fwd_rows(const T *x, T *y, float *row_max, int64_t rows, int64_t n, float scale,
                          int64_t causal_sq, int device, cudaStream_t stream, const char *op) {
    const int64_t frame = row_frame<VEC>(n);
    const bool ragged = frame != n;
    if (frame <= kWarpMaxN)
        return with_warp_shape<T, VEC, 64>(frame, [&](auto c, auto g, int group) {
            constexpr int C = decltype(c)::value, G = decltype(g)::value, ROWS = warp_rows<T, C>();
            return with_ragged<VEC, kCausal>(ragged, [&](auto rag) {
                constexpr bool kRag = decltype(rag)::value;
                return with_warp_block<T, C, softmax_fwd_rows_warp<T, VEC, C, G, kCausal, kLog, kWarpBlock, kRag>, ROWS>(
                    rows, group, device, [&](auto threads) {
                        constexpr int kThreads = decltype(threads)::value;
                        return launch_rows_warp<softmax_fwd_rows_warp<T, VEC, C, G, kCausal, kLog, kThreads, kRag>, ROWS,
                                                kThreads>(op, rows, n, group, device, stream, x, y, row_max, scale, causal_sq);
                    });
            });
        });
    const bool block_first = std::is_same_v<T, float> && frame <= kPackRowMax;  // see the strategies
    return with_ragged<VEC, kCausal>(ragged, [&](auto rag) {
        constexpr bool kMasked = kCausal || decltype(rag)::value;
        const int64_t mask_sq = kCausal ? causal_sq : (int64_t)kMasked;
        if constexpr (VEC > 1) {
            fk_status status = FK_OK;
            if (!block_first && launch_rows_smem<kFwdWarpRows<T, kMasked, kLog>,
                                                 softmax_fwd_rows_smem<T, kMasked, kLog, false>, nullptr, nullptr, T, 1>(
                                    status, op, rows, n, frame, device, stream, kMasked ? kMaskedWarpPacks : 0,
                                    !kMasked, x, y, row_max, scale, mask_sq))
                return status;
        }
        // fp32 rows of 4097-8192: 32 elements a thread in 256-thread CTAs (80 registers, three CTAs
        // an SM) instead of 16 in 512 (56 registers, two): ncu put the 8192-wide forward's stalls
        // on global loads, with stretches where both CTAs of an SM were past their loads (H100,
        // same-process A/B: (16384, 8192) 97.9 -> 99.5% of copy, 0.977 -> 0.993x torch.compile;
        // ragged 8185 97.0 -> 98.9; 4097-6000 level). Rows of 2049-4096 keep 16 (4096: 256
        // threads, 4 CTAs an SM): 32 measured 0.5 points lower there.
        auto block = [&](auto elems) {
            constexpr int C = decltype(elems)::value;
            return launch_rows_block<softmax_fwd_rows_block<T, VEC, kMasked, kLog, C>, VEC, C>(
                op, rows, n, frame, device, stream, x, y, row_max, scale, mask_sq);
        };
        if constexpr (std::is_same_v<T, float> && VEC > 1)
            if (block_first && frame > kWideFwdMin) return block(std::integral_constant<int, kWideFwdElems>());
        return block(std::integral_constant<int, block_elems_fwd<T, VEC>()>());
    });
}

template <typename T, int VEC, bool kCausal, bool kLog>
fk_status launch_bwd_rows(const T *dy, const T *x, const float *row_max, T *dx, int64_t rows, int64_t n,
                          float scale, int64_t causal_sq, int device, cudaStream_t stream,
                          const char *op) {
    const int64_t frame = row_frame<VEC>(n);
    const bool ragged = frame != n;
    if (frame <= kWarpMaxN)
        return with_warp_shape<T, VEC, 32>(frame, [&](auto c, auto g, int group) {
            constexpr int C = decltype(c)::value, G = decltype(g)::value, ROWS = warp_rows<T, 2 * C>();
            return with_ragged<VEC, kCausal>(ragged, [&](auto rag) {
                constexpr bool kRag = decltype(rag)::value;
                return with_warp_block<T, C, softmax_bwd_rows_warp<T, VEC, C, G, kCausal, kLog, kWarpBlock, kRag>, ROWS>(
                    rows, group, device, [&](auto threads) {
                        constexpr int kThreads = decltype(threads)::value;
                        return launch_rows_warp<softmax_bwd_rows_warp<T, VEC, C, G, kCausal, kLog, kThreads, kRag>, ROWS,
                                                kThreads>(op, rows, n, group, device, stream, dy, x, row_max, dx, scale,
                                                          causal_sq);
                    });
            });
        });
    if constexpr (VEC > 1) {
        // ragged rows count as masked here, as in kRowMax below
        if (frame <= (ragged ? kPackRowMaxOf<T, true> : kPackRowMaxOf<T, kCausal>) && (!ragged || !kCausal)) {
            constexpr int P = kPackElems / VEC;
            constexpr int64_t kReach = kPackElems * kPackThreads;  // 8 elements a thread
            // the device's DRAM rate is read only for the rows it decides (kFastDramPerSm)
            const bool wide16 = VEC == 8 && frame > kReach / 2 && frame <= kReach &&
                                fk::dram_bytes_per_us_per_sm(device) > kFastDramPerSm;
            const int64_t wide_from = wide16 ? kReach / 2 : kReach;
            return with_ragged<VEC, kCausal>(ragged, [&](auto rag) {
                constexpr bool kRag = decltype(rag)::value;
                constexpr int64_t kRowMax = kPackRowMaxOf<T, kCausal || kRag>;
                return launch_rows_packs<softmax_bwd_rows_packs<T, P, kCausal, kLog, kRag>,
                                         softmax_bwd_rows_packs<T, 2 * P, kCausal, kLog, kRag>,
                                         softmax_bwd_rows_packs<T, (kRowMax > kPackRowMax ? 4 : 2) * P, kCausal, kLog, kRag>>(
                    op, rows, frame, wide_from, device, stream, n, dy, x, row_max, dx, scale, causal_sq);
            });
        }
    }
    return with_ragged<VEC, kCausal>(ragged, [&](auto rag) {
        constexpr bool kMasked = kCausal || decltype(rag)::value;
        const int64_t mask_sq = kCausal ? causal_sq : (int64_t)kMasked;
        if constexpr (VEC > 1) {
            fk_status status = FK_OK;
            constexpr auto kSlowDram = softmax_bwd_rows_smem<T, false, kLog, 0, kSmemBwdSlowDramThreads>;
            if (launch_rows_smem<nullptr, softmax_bwd_rows_smem<T, kMasked, kLog>,
                                 softmax_bwd_rows_smem<T, kMasked, kLog, kDyRegThreads>,
                                 softmax_bwd_rows_smem<T, kMasked, kLog, kDyRegWideThreads>, T, 2,
                                 kMasked ? decltype(kSlowDram)(nullptr) : kSlowDram>(
                    status, op, rows, n, frame, device, stream, 0, false, dy, x, row_max, dx, scale, mask_sq))
                return status;
        }
        return launch_rows_block<softmax_bwd_rows_block<T, VEC, kMasked, kLog>, VEC, block_elems_bwd<T, VEC>()>(
            op, rows, n, frame, device, stream, dy, x, row_max, dx, scale, mask_sq);
    });
}

// Binds the mask and log flags to template parameters: `launch` is called with two
// std::integral_constant<bool> arguments.
template <typename F> fk_status with_flags(int64_t causal_sq, int is_log, F &&launch) {
    using Yes = std::true_type;
    using No = std::false_type;
    if (causal_sq > 0) return is_log ? launch(Yes(), Yes()) : launch(Yes(), No());
    return is_log ? launch(No(), Yes()) : launch(No(), No());
}

// The longest ragged fp32 backward row that takes the 16-byte warp instances (kRagged): the scalar
// ones hold a lane's elements one at a time, 4 bytes of each tensor a load, and short rows leave
// them few bytes in flight. H200, x torch.compile, scalar -> kRagged: 17: 0.451 -> 1.011x, 33:
// 0.739 -> 0.955x, 47: 0.956 -> 1.035x, 65: 0.815 -> 0.836x; from 95 on they lost (row_packs).
constexpr int64_t kRaggedFp32BwdMax = 64;

// Whether rows of n take 16-byte accesses (VEC elements): all tensors 16-byte aligned, and a
// ragged row (n % VEC != 0, row_lead) longer than a warp holds, or one a warp holds whole with its
// frame where `warp_ragged` (bf16 1018-1023 took the row-block kernel at 0.45-0.66x the scalar warp
// kernel's speed, H200). Not warp_ragged: masked rows (the masked warp instances take no lead) and
// fp32 backward rows past kRaggedFp32BwdMax, whose kRagged warp instances lost to the scalar ones
// (H200, x torch.compile, 95: 1.035 -> 0.862x, 127: 0.951 -> 0.839x, 197: 1.021 -> 0.968x, 257:
// 0.982 -> 0.794x, 1001: 0.953 -> 0.925x; H100, 1001: 0.996 -> 1.007x), where the 16-bit ones
// gained (bf16 197: 0.98 -> 1.05x, 257: 0.73 -> 0.79x).
template <int VEC> bool row_packs(int64_t n, bool aligned, bool warp_ragged) {
    return aligned && (n % VEC == 0 || n > kWarpMaxN || (warp_ragged && row_frame<VEC>(n) <= kWarpMaxN));
}

// Launches a looped column kernel over `columns` columns of n: kColsX threads a CTA along inner, and
// threads splitting n: 8, or 32 when there are too few CTAs to fill the GPU, and no more than take
// kColsUnroll of n each.
template <auto kernel, typename... Args>
fk_status launch_cols(const char *op, int64_t columns, int64_t n, int device, cudaStream_t stream, Args... args) {
    const int64_t ctas = (columns + kColsX - 1) / kColsX;
    const int64_t ny = std::max<int64_t>(
        1, std::min<int64_t>(ctas >= 8 * fk::sm_count(device) ? 8 : 32, (n + kColsUnroll - 1) / kColsUnroll));
    return fk::Launch(dim3((unsigned)ctas), dim3(kColsX, (unsigned)ny), 0, stream, device)(op, kernel, args...);
}

// Launches a column-tile kernel through go(kernel)(grid, block, smem, K) over `columns` columns of n, VEC
// columns and kRows accesses a thread, whose reductions combine values of V. CTAs of up to kThreads
// threads: TX threads along the columns from 32 down to the fewest that read kTileRowBytes of a row
// (or 32) while the ceil(n / kRows) threads along n do not fit; past kThreads / TX of them, a cluster of K CTAs (a
// power of two). A CTA of up to kMaxThreads (the kernel's bound) where that holds the columns alone
// and kThreads would take a cluster. Where the columns take a larger cluster than the device holds:
// with a `chunked` kernel (whose threads take chunks of kRows accesses), the largest cluster of full
// CTAs of kChunkThreads that it holds, else false, launching nothing. One column a
// thread (VEC 1) takes the chunks only where the looped kernels' grid does not cover the SMs: H200,
// x torch.compile, against the looped kernels, bf16 (20000, 2047) dim 0 forward / backward 0.373 /
// 0.150 -> 1.027 / 0.416x, (65536, 1023) 0.182 / 0.076 -> 0.616 / 0.369x, fp32 (20000, 2047) 0.357
// / 0.233 -> 0.590 / 0.626x (H100: gains of the same order, but fp32 (3000, 4095) forward 0.720 ->
// 0.653x); where the grid covers them the chunks lost (bf16 (4096, 8191) backward 0.525 ->
// 0.423x). go(kernel) launches a kernel.
template <auto kernel, typename T, int VEC, int kThreads, int kMaxThreads, typename V, int kRows = kTileRows,
          auto chunked = nullptr, int kChunkThreads = kThreads, typename F>
bool launch_col_tile(fk_status &status, int64_t columns, int64_t n, int device, F &&go) {
    constexpr int64_t kTxMin = VEC == 1 ? 32 : kTileRowBytes / (VEC * sizeof(T));
    auto smem_of = [](int64_t tx, int64_t ty) { return (size_t)((tx * ty / 32 + 2) * tx * VEC) * sizeof(V); };
    const int64_t row_threads = std::max<int64_t>(1, (n + kRows - 1) / kRows);
    int64_t tx = 0, k = 0;
    auto shape = [&](int64_t threads) {
        tx = 32;
        while (tx > kTxMin && tx * row_threads > threads) tx /= 2;
        k = pow2_ceil((row_threads + threads / tx - 1) / (threads / tx));
    };
    shape(kThreads);
    if (k > 1) {
        shape(kMaxThreads);
        if (k > 1) shape(kThreads);
    }
    int64_t ty_max = kMaxThreads / tx;
    bool chunks = false;
    if (k > 1) {
        const int64_t limit = std::min<int64_t>(
            kMaxCluster, cluster_limit<kernel>(device, kMaxThreads, (int)smem_of(kTxMin, kMaxThreads / kTxMin)));
        if (k > limit) {
            if constexpr (chunked == nullptr) return false;
            else {
                // one column a thread: the looped kernels where their grid (a CTA per kColsX columns)
                // covers the SMs
                if (VEC == 1 && (columns + kColsX - 1) / kColsX >= fk::sm_count(device)) return false;
                // full CTAs of kChunkThreads, their threads taking chunks of rows
                k = std::min<int64_t>(
                    limit, cluster_limit<chunked>(device, kChunkThreads, (int)smem_of(tx, kChunkThreads / tx)));
                if (k < 1) return false;
                ty_max = kChunkThreads / tx, chunks = true;
            }
        }
    }
    const int64_t group = 32 / tx,
                  ty = std::min(ty_max, ((row_threads + k - 1) / k + group - 1) / group * group);
    // a lone CTA of kMaxThreads launches without a shared-memory allowance (cluster_limit sets one
    // for clustered CTAs only)
    static_assert((kMaxThreads / 32 + 2) * 32 * VEC * sizeof(V) <= 48 * 1024);
    const int64_t ctas = (columns / VEC + tx - 1) / tx;
    const dim3 grid((unsigned)(ctas * k)), block((unsigned)tx, (unsigned)ty);
    if constexpr (chunked != nullptr)
        if (chunks) {
            status = go(chunked)(grid, block, smem_of(tx, ty), (int)k);
            return true;
        }
    status = go(kernel)(grid, block, smem_of(tx, ty), (int)k);
    return true;
}

// fp32 keeps its exps and fp64 sums: with 8 accesses a thread the 1024-thread instance spills
// (40-84 bytes), and the 512-thread one, which does not (108-117 registers), runs one CTA an SM
// where its CTAs are full. So fp32 columns of up to kTileFwdShortMax take 4 accesses a thread in the
// 1024-thread instance, and longer ones 16 in the 512-thread instance, in CTAs of 256 threads, two
// an SM. Same-process A/B against 8 accesses (the 512-thread instance where one CTA of up to 512
// held the columns, else the 1024-thread one) and 128-byte row spans, x torch.compile:
//   H200: (32, 19, 256, 512) dim 1 1.845 -> 2.111, (256, 128, 4096) 0.852 -> 0.989, (16, 512, 4096)
//         0.976 -> 1.127; (64, 1024, 512) 1.064 -> 1.389, (4096, 8192) dim 0 1.023 -> 1.205, (2048,
//         8192) dim 0 1.128 -> 1.233, (8, 2000, 8192) dim 1 0.917 -> 1.109.
// 16 accesses at 512 elements lost (H200 (16, 512, 4096) 0.975 -> 0.917), and 16-bit columns lost with
// them at every length (bf16 (4096, 8192) dim 0 1.041 -> 0.984): 16-bit keeps 8 accesses in the
// 1024-thread instance (64 registers), in CTAs of 512.
constexpr int kTileFwdShortMax = 512;

template <typename T, int VEC, bool kLog>
bool launch_fwd_col_tile(fk_status &status, const T *x, T *y, float *row_max, int64_t columns, int64_t n,
                         int64_t inner, float scale, int device, cudaStream_t stream, const char *op) {
    auto go = [&](auto kernel) {
        return [&, kernel](dim3 grid, dim3 block, size_t smem, int k) {
            return fk::Launch(grid, block, smem, stream, device, k)(op, kernel, x, y, row_max, columns, (int)n, inner,
                                                                     k, scale);
        };
    };
    if constexpr (std::is_same_v<T, float>) {
        if (n <= kTileFwdShortMax) {
            constexpr auto kernel = softmax_fwd_col_tile<T, VEC, kLog, kTileFwdThreads, 4>;
            return launch_col_tile<kernel, T, VEC, kTileFwdThreads / 2, kTileFwdThreads, Acc<T>, 4>(
                status, columns, n, device, go);
        }
        constexpr auto kernel = softmax_fwd_col_tile<T, VEC, kLog, kTileFwdThreads / 2, 16>;
        constexpr auto chunked = softmax_fwd_col_tile<T, VEC, kLog, kTileFwdThreads / 2, 16, true>;
        return launch_col_tile<kernel, T, VEC, kTileFwdThreads / 4, kTileFwdThreads / 2, Acc<T>, 16, chunked>(
            status, columns, n, device, go);
    } else {
        constexpr auto kernel = softmax_fwd_col_tile<T, VEC, kLog, kTileFwdThreads>;
        // Its chunks run in the 512-thread instance (in the 1024-thread one their loop spilled 412
        // bytes in fp16), in CTAs of 256 threads with 16-byte accesses, 512 with one column a thread.
        // Against 512 everywhere, x torch.compile, H200 / H100: bf16 (20000, 4096) dim 0 0.656 ->
        // 0.912 / 0.707 -> 0.980, (16, 20000, 512) dim 1 0.611 -> 0.868 / 0.703 -> 0.995, (32768,
        // 2048) 0.756 -> 0.871 / 0.884 -> 0.971, (8, 40000, 1024) 0.801 -> 0.920 / 0.899 -> 0.969,
        // (40000, 8192) 0.766 -> 0.844 / 0.856 -> 0.878; but (65536, 1024) 0.806 -> 0.773 / 0.861 ->
        // 0.844 and (100000, 512) 0.753 -> 0.744 / level: few columns lose. One column a thread lost
        // (H200 (65536, 1023) 0.615 -> 0.550, (30000, 1001) 0.753 -> 0.636).
        constexpr auto chunked = softmax_fwd_col_tile<T, VEC, kLog, kTileFwdThreads / 2, kTileRows, true>;
        constexpr int kChunkThreads = VEC == 1 ? kTileFwdThreads / 2 : kTileFwdThreads / 4;
        return launch_col_tile<kernel, T, VEC, kTileFwdThreads / 2, kTileFwdThreads, Acc<T>, kTileRows, chunked,
                               kChunkThreads>(status, columns, n, device, go);
    }
}

template <typename T, int VEC, bool kLog>
bool launch_bwd_col_tile(fk_status &status, const T *dy, const T *x, const float *row_max, T *dx, int64_t columns,
                         int64_t n, int64_t inner, float scale, int device, cudaStream_t stream, const char *op) {
    auto go = [&](auto kernel) {
        return [&, kernel](dim3 grid, dim3 block, size_t smem, int k) {
            return fk::Launch(grid, block, smem, stream, device, k)(op, kernel, dy, x, row_max, dx, columns, (int)n,
                                                                     inner, k, scale);
        };
    };
    if constexpr (std::is_same_v<T, float>) {
        if (n <= kTileShortMax) {
            constexpr auto kernel = softmax_bwd_col_tile<T, VEC, kLog, kTileShortRows, kTileShortThreads, 3>;
            return launch_col_tile<kernel, T, VEC, kTileShortThreads, kTileShortThreads, Acc2<T>, kTileShortRows>(
                status, columns, n, device, go);
        }
    }
    constexpr auto kernel = softmax_bwd_col_tile<T, VEC, kLog>;
    constexpr auto chunked = softmax_bwd_col_tile<T, VEC, kLog, kTileRows, kTileBwdThreads, 1, true>;
    return launch_col_tile<kernel, T, VEC, kTileBwdThreads / 2, kTileBwdThreads, Acc2<T>, kTileRows, chunked>(
        status, columns, n, device, go);
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

}  // namespace

extern "C" fk_status fk_cuda_softmax_fwd(const void *x, void *y, float *row_max, int64_t outer, int64_t n,
                                         int64_t inner, double scale, int64_t causal_sq, int log,
                                         fk_dtype dtype, int device, void *stream) {
    const char *op = "softmax_fwd";
    fk_status st = check_args(op, outer, n, inner, causal_sq);
    if (st != FK_OK || outer == 0 || inner == 0) return st;
    FK_CUDA_ENTER(op, device);
    cudaStream_t s = (cudaStream_t)stream;
    FK_DISPATCH_CUDA_DTYPE(dtype, op, {
        const T *xt = (const T *)x;
        T *yt = (T *)y;
        constexpr int N = fk::Pack<T>::N;
        if (inner > 1) {
            const bool packs = fk::aligned16(x) && fk::aligned16(y) && inner % N == 0;
            fk_status status = FK_OK;
            auto tile = [&](auto is_log) {
                constexpr bool kLog = decltype(is_log)::value;
                auto go = [&](auto vec) {
                    return launch_fwd_col_tile<T, decltype(vec)::value, kLog>(status, xt, yt, row_max, outer * inner, n,
                                                                              inner, (float)scale, device, s, op);
                };
                return packs ? go(std::integral_constant<int, N>()) : go(std::integral_constant<int, 1>());
            };
            if (log ? tile(std::true_type()) : tile(std::false_type())) return status;
            return launch_cols<softmax_fwd_cols<T>>(op, outer * inner, n, device, s, xt, yt, row_max, outer * inner,
                                                    n, inner, (float)scale, log);
        }
        const bool packs = row_packs<N>(n, fk::aligned16(x) && fk::aligned16(y), causal_sq == 0);
        return with_flags(causal_sq, log, [&](auto causal, auto is_log) {
            if (packs)
                return launch_fwd_rows<T, N, causal(), is_log()>(xt, yt, row_max, outer, n, (float)scale, causal_sq, device, s, op);
            return launch_fwd_rows<T, 1, causal(), is_log()>(xt, yt, row_max, outer, n, (float)scale, causal_sq, device, s, op);
        });
    });
    return FK_OK;
}

extern "C" fk_status fk_cuda_softmax_bwd(const void *dy, const void *x, const float *row_max, void *dx,
                                         int64_t outer, int64_t n, int64_t inner, double scale,
                                         int64_t causal_sq, int log, fk_dtype dtype, int device,
                                         void *stream) {
    const char *op = "softmax_bwd";
    fk_status st = check_args(op, outer, n, inner, causal_sq);
    if (st != FK_OK || outer == 0 || inner == 0 || n == 0) return st;
    FK_CUDA_ENTER(op, device);
    cudaStream_t s = (cudaStream_t)stream;
    FK_DISPATCH_CUDA_DTYPE(dtype, op, {
        const T *dyt = (const T *)dy, *xt = (const T *)x;
        T *dxt = (T *)dx;
        constexpr int N = fk::Pack<T>::N;
        if (inner > 1) {
            const bool packs = fk::aligned16(dy) && fk::aligned16(x) && fk::aligned16(dx) && inner % N == 0;
            fk_status status = FK_OK;
            auto tile = [&](auto is_log) {
                constexpr bool kLog = decltype(is_log)::value;
                auto go = [&](auto vec) {
                    return launch_bwd_col_tile<T, decltype(vec)::value, kLog>(status, dyt, xt, row_max, dxt, outer * inner,
                                                                              n, inner, (float)scale, device, s, op);
                };
                return packs ? go(std::integral_constant<int, N>()) : go(std::integral_constant<int, 1>());
            };
            if (log ? tile(std::true_type()) : tile(std::false_type())) return status;
            return launch_cols<softmax_bwd_cols<T>>(op, outer * inner, n, device, s, dyt, xt, row_max, dxt,
                                                    outer * inner, n, inner, (float)scale, log);
        }
        const bool packs = row_packs<N>(n, fk::aligned16(dy) && fk::aligned16(x) && fk::aligned16(dx),
                                      causal_sq == 0 && (!std::is_same_v<T, float> || n <= kRaggedFp32BwdMax));
        return with_flags(causal_sq, log, [&](auto causal, auto is_log) {
            if (packs)
                return launch_bwd_rows<T, N, causal(), is_log()>(dyt, xt, row_max, dxt, outer, n, (float)scale, causal_sq, device, s, op);
            return launch_bwd_rows<T, 1, causal(), is_log()>(dyt, xt, row_max, dxt, outer, n, (float)scale, causal_sq, device, s, op);
        });
    });
    return FK_OK;
}
