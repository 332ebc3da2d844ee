// Device helpers the softmax strategies share: loads and stores of 16-byte packs, ragged-row
// frames, the row statistics and their reductions (lanes, CTA, cluster), the sm_90 mbarrier and
// cluster wrappers, and the numerics (exp, rescaling, normalisation, the backward's dx).
// Numerics and the reasons behind them: docs/softmax.md.
#pragma once

#include <cooperative_groups.h>

#include <type_traits>

#include "../common.cuh"
#include "plan.h"

namespace fk::softmax {
namespace {

namespace cg = cooperative_groups;

// Keys of row `row` at or beyond the returned length are masked. causal_sq 1 (ragged rows) takes no
// division, one that fits 32 bits a 32-bit one (D-49).
__device__ __forceinline__ int64_t causal_len(int64_t row, int64_t n, int64_t causal_sq) {
    if (causal_sq == 1) return n;
    const int64_t query = (row | causal_sq) >> 32 ? row % causal_sq : (uint32_t)row % (uint32_t)causal_sq;
    const int64_t len = query + 1 + n - causal_sq;
    return len < 0 ? 0 : (len > n ? n : len);
}

// e^t: one FMUL and MUFU.EX2, ~2 ulp where the exponent is exact, near the row's max (D-64).
using fk::exp_ftz;


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

// fp32 output: e / s correctly rounded, as torch divides, in three instructions; 16-bit outputs
// round far coarser than e * (1 / s) (D-66).
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

// The access at p with only its elements before `end` (the tensor's end) read, the rest zeros. A
// ragged row's last access reaches past the row, so the tensor's last row takes this for its
// accesses (a per-row or per-CTA test outside the inner loops); every other access loads whole.
template <typename T, int VEC> __device__ __forceinline__ Raw<T, VEC> load_until(const T *p, const T *end) {
    if constexpr (VEC == 1) {
        return __ldg(p);
    } else {
        if (p + VEC <= end) return load_raw<T, VEC>(p);
        Raw<T, VEC> r;
        *reinterpret_cast<uint4 *>(&r) = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int k = 0; k < VEC; k++)
            if (p + k < end) r.v[k] = p[k];
        return r;
    }
}
template <typename T, int VEC>
__device__ __forceinline__ Raw<T, VEC> load_or_zero_until(const T *p, bool in, const T *end) {
    Raw<T, VEC> r;
    if constexpr (VEC == 1) r = T(0.f);
    else *reinterpret_cast<uint4 *>(&r) = make_uint4(0, 0, 0, 0);
    if (in) r = load_until<T, VEC>(p, end);
    return r;
}

// Converted a 32-bit word at a time (fk::pack_f32): element by element, the zero-filled bf16 loads
// were moved a 16-bit half at a time (two PRMT an element: the bf16 warp backward of 1000-wide rows
// took 664 instructions a lane, now 584, and 80 registers, now 64).
template <typename T, int VEC> __device__ __forceinline__ float raw_at(const Raw<T, VEC> &r, int k) {
    if constexpr (VEC == 1) return fk::to_f32(r);
    else return fk::pack_f32<T>(r, k);
}

// kPtx: the 16-byte store as inline PTX (see store_in). kStream: st.global.cs, a streaming store,
// in the shared-memory write passes only (D-43).
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

// Stores the elements of the access at p (frame index j < hi) that lie in [lo, hi): one 16-byte
// store when all do. kRagged: the whole access as inline PTX, which the compiler otherwise split
// into 4-byte stores (decision id pending).
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

// Ragged rows (n % VEC != 0, 16-byte aligned tensors): a row is read as the 16-byte accesses
// covering it, a frame starting row_lead elements before the row; its elements are frame indices
// [lead, lead + n). Edge accesses are partly another row's: read whole, written element by element
// (store_in); the tensor's last row stops at the tensor's end (load_until). Packed rows have lead 0
// (D-46, D-47).
template <int VEC> __device__ __forceinline__ int row_lead(int64_t row, int64_t n) {
    return VEC == 1 ? 0 : (int)((row * n) & (VEC - 1));
}

// zero(k) for the elements k of the access at frame index j that lie outside [lo, hi).
template <int VEC, typename Zero> __device__ __forceinline__ void zero_each_outside(int j, int lo, int hi, Zero zero) {
#pragma unroll
    for (int k = 0; k < VEC; k++)
        if (j + k < lo || j + k >= hi) zero(k);
}

// Unmasked ragged rows (kRagged): accesses are taken whole, and one straddling an end of the row
// [lo, hi) has its values outside zeroed before they join the reductions: one test an access (D-46).
template <int VEC> __device__ __forceinline__ bool straddles(int j, int lo, int hi) {
    return j < hi && (j < lo || j + VEC > hi);
}
template <int VEC, typename Zero> __device__ __forceinline__ void unragged(int j, int lo, int hi, Zero zero) {
    if (straddles<VEC>(j, lo, hi)) zero_each_outside<VEC>(j, lo, hi, zero);
}

// The masked shared-memory instances likewise: an access reaching outside the keys [lo, hi) (or
// wholly outside: stale values) is zeroed outside them, one test an access (D-47).
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

// The backward's sums z = sum y', a = sum dy * y': fp64 for fp32 data, where a dominant key's
// dx ~ 0 takes every rounding of a and z (D-60).
template <typename T> using Acc = std::conditional_t<std::is_same_v<T, float>, double, float>;
template <typename T> using Acc2 = std::conditional_t<std::is_same_v<T, float>, double2, float2>;

// One lane's running row sum: fp64 for fp32 data, rounded to fp32 once; dy * y' is rounded to fp32
// before it joins the sum, as torch rounds its own (D-60, D-62). 16-bit data: fp32 sums.
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

// dx for one element from the row's sums, in fp32: a / z carried as a_hi + a_lo where dy - a / z
// cancels; 16-bit outputs fold scale and 1 / z into one factor c, y' (c g - c a) (D-61).
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
            if (exchange) (mbar_init(&reds.landed), ...);
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncthreads();
        if (exchange) {
            // expect after the barrier: racecheck flags an arrive in the same warp region as the
            // init without one. A peer's bytes landing first is fine: the phase also waits for
            // this one arrival.
            if (threadIdx.x == 0) (mbar_expect(&reds.landed, (uint32_t)(cluster_k * sizeof(reds.cta[0]))), ...);
            cluster_arrive_relaxed();
        }
    }
#endif
    fk::grid_dependency_sync();
}

// Reduction over the CTA, then over the K CTAs of the row's cluster; every thread gets the result.
// One __syncthreads; with a cluster, warp 0 sends the CTA's pair into every peer's shared memory
// (st.async, counted on the peer's mbarrier) and each CTA waits for its own K pairs: no cluster
// barrier (D-32). The first exchange (`first`) waits on kernel_start's cluster arrival.
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


// Whether a kernel holding its slice in registers keeps each exp for the write pass: fp32 yes,
// 16-bit takes it again (D-17).
template <typename T> constexpr bool kExpOnce = std::is_same_v<T, float>;

// ---- rows_warp's lane groups -----------------------------------------------------------------

template <typename T> constexpr fk_dtype dtype_of = FK_FLOAT32;
template <> constexpr fk_dtype dtype_of<__half> = FK_FLOAT16;
template <> constexpr fk_dtype dtype_of<__nv_bfloat16> = FK_BFLOAT16;

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


}  // namespace
}  // namespace fk::softmax
