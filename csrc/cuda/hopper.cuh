// Hopper (sm_90a) instruction wrappers shared by the warp-specialized kernels (matmul/, attention/):
// mbarriers, TMA tensor copies, the cluster barrier and distributed shared memory (remote loads and
// stores), wgmma fences and smem descriptors, setmaxnreg. One function per instruction, named after
// it; kernel files hold no asm. The bodies compile to nothing on other targets (dispatch never
// selects these kernels there).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <stdint.h>

#include "common.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FK_SM90A 1
#else
#define FK_SM90A 0
#endif

namespace fk {

__device__ __forceinline__ uint32_t cvta_shared(const void *p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The kernel's dynamic shared memory as an S starting on a 1024-byte boundary (the 128-byte swizzle
// repeats every 1024 bytes; launches ask for sizeof(S) + 1024). The offset is added to `raw` itself:
// rounding a uintptr_t of it lost the shared address space, and every access through the struct was
// a generic LD / ST (sm_90a matmul: ~26k generic epilogue loads and stores against 288 STS).
template <typename S> __device__ __forceinline__ S &smem_aligned_1024(unsigned char *raw) {
    return *reinterpret_cast<S *>(raw + ((1024u - (cvta_shared(raw) & 1023u)) & 1023u));
}

// ---- mbarrier ------------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint64_t *bar, uint32_t count) {
#if FK_SM90A
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(cvta_shared(bar)), "r"(count));
#endif
}
// Makes the inits above visible to the async proxy (TMA) and the other threads.
__device__ __forceinline__ void fence_barrier_init() {
#if FK_SM90A
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t *bar, uint32_t bytes) {
#if FK_SM90A
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(cvta_shared(bar)), "r"(bytes)
                 : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
#if FK_SM90A
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(cvta_shared(bar)) : "memory");
#endif
}
// Arrives on a peer CTA's mbarrier (a shared::cluster address from mapa_shared_cluster).
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar) {
#if FK_SM90A
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(bar) : "memory");
#endif
}
// Blocks until the phase of parity `phase` has completed.
__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t phase) {
#if FK_SM90A
    asm volatile(
        "{\n.reg .pred done;\n"
        "wait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n}\n" ::"r"(cvta_shared(bar)),
        "r"(phase)
        : "memory");
#endif
}

// A position in a ring of kN mbarrier-guarded stages: the slot and the parity of its current pass
// (what mbar_wait takes); next() moves on, flipping the parity at the wrap.
template <int kN> struct RingStage {
    int slot = 0;
    uint32_t phase = 0;
    __device__ __forceinline__ void next() {
        if (++slot == kN) slot = 0, phase ^= 1;
    }
    __device__ __forceinline__ void skip(int n) {  // n stages taken by someone else
        const int to = slot + n;
        phase ^= (uint32_t)(to / kN) & 1u;
        slot = to % kN;
    }
};

// ---- TMA ---------------------------------------------------------------------------------------
// Box at coordinates (c0 innermost, c1, c2) of `map` -> smem, completing `bytes` on `bar`.
__device__ __forceinline__ void tma_load_3d(void *dst, const CUtensorMap *map, uint64_t *bar, int c0, int c1,
                                            int c2) {
#if FK_SM90A
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(
            cvta_shared(dst)),
        "l"(map), "r"(cvta_shared(bar)), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
#endif
}
// The same box into the shared memory of each CTA in `mask` (cluster ranks' bits), at dst's offset
// there, completing its bytes on each one's mbarrier at bar's offset.
__device__ __forceinline__ void tma_load_3d_multicast(void *dst, const CUtensorMap *map, uint64_t *bar, int c0,
                                                      int c1, int c2, uint16_t mask) {
#if FK_SM90A
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, "
        "{%3, %4, %5}], [%2], %6;\n" ::"r"(cvta_shared(dst)),
        "l"(map), "r"(cvta_shared(bar)), "r"(c0), "r"(c1), "r"(c2), "h"(mask)
        : "memory");
#endif
}
// The same for a 4-d map (attention: head dim, row, head, sequence).
__device__ __forceinline__ void tma_load_4d(void *dst, const CUtensorMap *map, uint64_t *bar, int c0, int c1,
                                            int c2, int c3) {
#if FK_SM90A
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(
            cvta_shared(dst)),
        "l"(map), "r"(cvta_shared(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
#endif
}
// smem box -> the tensor at (c0, c1, c2) of `map` (clipped at its edges), in this thread's bulk group.
__device__ __forceinline__ void tma_store_3d(const CUtensorMap *map, const void *src, int c0, int c1, int c2) {
#if FK_SM90A
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(map),
                 "r"(cvta_shared(src)), "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
#endif
}
// 1-d bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned) global -> smem,
// completing `bytes` on `bar`.
__device__ __forceinline__ void bulk_load(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
#if FK_SM90A
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     cvta_shared(dst)),
                 "l"(src), "r"(bytes), "r"(cvta_shared(bar))
                 : "memory");
#endif
}
// 1-d bulk reduction: dst[i] += src[i] (fp32, `bytes` a multiple of 16, 16-byte aligned) from smem
// into global memory, element-wise atomic, in this thread's bulk group.
__device__ __forceinline__ void bulk_reduce_add_f32(float *dst, const float *src, uint32_t bytes) {
#if FK_SM90A
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
                 "r"(cvta_shared(src)), "r"(bytes)
                 : "memory");
#endif
}
__device__ __forceinline__ void bulk_commit_group() {
#if FK_SM90A
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
// Waits until at most N of this thread's bulk groups are still reading their shared memory.
template <int N> __device__ __forceinline__ void bulk_wait_group_read() {
#if FK_SM90A
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
#endif
}
// Waits until at most N of this thread's bulk groups are still in flight (their writes done).
template <int N> __device__ __forceinline__ void bulk_wait_group() {
#if FK_SM90A
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}
// Orders this thread's generic-proxy shared-memory writes before later async-proxy (TMA) reads.
__device__ __forceinline__ void fence_proxy_async_shared() {
#if FK_SM90A
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// 8 bytes of shared memory (p 8-byte aligned) into r0, r1 / from v0, v1 by ld / st.shared: a pointer
// into the aligned dynamic-shared window compiles to generic LD / ST otherwise (its address space
// is lost in the alignment arithmetic).
__device__ __forceinline__ void ld_shared_v2_b32(uint32_t &r0, uint32_t &r1, const void *p) {
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(cvta_shared(p)));
}
__device__ __forceinline__ void st_shared_v2_f32(void *p, float v0, float v1) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(cvta_shared(p)), "f"(v0), "f"(v1) : "memory");
}
// Stores four 8 x 8 16-bit matrices transposed: register j of lane l holds row l / 4, columns
// 2 (l % 4) and + 1 of matrix j (the mma / wgmma accumulator layout); lane l gives the address of row
// l % 8 of the transposed matrix l / 8 (16 contiguous bytes: column l % 8 of the original).
__device__ __forceinline__ void stmatrix_x4_trans(void *p, const uint32_t (&r)[4]) {
#if FK_SM90A
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(cvta_shared(p)),
                 "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
#endif
}
// bar.sync on named barrier `id` (1..15; 0 is __syncthreads) for `count` threads.
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// bar.arrive on named barrier `id` for `count` threads: signals without waiting (the producer side
// of a bar.sync handshake, e.g. one consumer warpgroup handing the tensor cores to the next).
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void prefetch_tensormap(const CUtensorMap *map) {
#if FK_SM90A
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
#endif
}

// ---- clusters (distributed shared memory) -------------------------------------------------------
// This CTA's rank in its cluster.
__device__ __forceinline__ uint32_t cluster_ctarank() {
    uint32_t r = 0;
#if FK_SM90A
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
#endif
    return r;
}
// Split cluster barrier (the forms that need no converged warp): every thread of every CTA of the
// cluster arrives once, after what peers may touch is ready (relaxed: mbarrier inits are released
// by fence_barrier_init), and waits once, before its first access to a peer or else before it exits.
__device__ __forceinline__ void barrier_cluster_arrive_relaxed() {
#if FK_SM90A
    asm volatile("barrier.cluster.arrive.relaxed;\n" ::: "memory");
#endif
}
// The same with release semantics: this thread's earlier memory operations (shared, global, on peers:
// remote mbarrier arrivals) are performed before the barrier completes; the wait acquires the
// others' (the decoding kernel's merge reads its peers' partial outputs after it).
__device__ __forceinline__ void barrier_cluster_arrive() {
#if FK_SM90A
    asm volatile("barrier.cluster.arrive;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void barrier_cluster_wait() {
#if FK_SM90A
    asm volatile("barrier.cluster.wait;\n" ::: "memory");
#endif
}
// The shared::cluster address of `p`'s counterpart in the CTA of cluster rank `rank`.
__device__ __forceinline__ uint32_t mapa_shared_cluster(const void *p, uint32_t rank) {
    uint32_t a = 0;
#if FK_SM90A
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(a) : "r"(cvta_shared(p)), "r"(rank));
#endif
    return a;
}
// Loads from a shared::cluster address (mapa_shared_cluster): any CTA of the cluster's shared memory.
__device__ __forceinline__ float ld_shared_cluster_f32(uint32_t addr) {
    float v = 0.0f;
#if FK_SM90A
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
#endif
    return v;
}
__device__ __forceinline__ float4 ld_shared_cluster_v4_f32(uint32_t addr) {
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#if FK_SM90A
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(addr)
                 : "memory");
#endif
    return v;
}
// 16 bytes from registers into a peer's shared memory (`dst`, 16-byte aligned), their bytes
// completing on the peer's mbarrier `bar` (both shared::cluster addresses from mapa_shared_cluster).
__device__ __forceinline__ void st_async_v4(uint32_t dst, float a, float b, float c, float d, uint32_t bar) {
#if FK_SM90A
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(
                     dst),
                 "r"(__float_as_uint(a)), "r"(__float_as_uint(b)), "r"(__float_as_uint(c)), "r"(__float_as_uint(d)),
                 "r"(bar)
                 : "memory");
#endif
}

// ---- wgmma -------------------------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() {
#if FK_SM90A
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if FK_SM90A
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N> __device__ __forceinline__ void wgmma_wait() {
#if FK_SM90A
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Keeps the compiler from moving accumulator reads / writes across an asynchronous wgmma.
template <int N> __device__ __forceinline__ void wgmma_fence_operands(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}
// The same for A fragments in registers: keeps them live (unreused) until this point.
template <int N> __device__ __forceinline__ void wgmma_fence_operands(uint32_t (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+r"(r[i])::"memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading and stride byte
// offsets (16-byte units), swizzle mode 1 in bits 62-63. The tile must sit 1024-byte aligned.
__device__ __forceinline__ uint64_t smem_desc_sw128(const void *p, uint32_t lbo_bytes, uint32_t sbo_bytes) {
    return (uint64_t)((cvta_shared(p) & 0x3FFFF) >> 4) | (uint64_t)((lbo_bytes >> 4) & 0x3FFF) << 16 |
           (uint64_t)((sbo_bytes >> 4) & 0x3FFF) << 32 | 1ull << 62;
}

// ---- registers ---------------------------------------------------------------------------------
// setmaxnreg moves registers within the CTA's pool, which holds what the launch gave it: its threads
// x the per-thread count of a one-CTA-an-SM kernel (the register file split evenly, rounded down to
// 8: 168 for 384 threads). More asked than that and setmaxnreg.inc waits forever: a producer at 32
// with two consumers at 240 (512 > 3 x 168) hung every Hopper attention forward (H100).
constexpr bool registers_fit(int consumers, int producer_regs, int consumer_regs) {
    return producer_regs + consumers * consumer_regs <= (consumers + 1) * (65536 / (128 * (consumers + 1)) / 8 * 8);
}
template <int R> __device__ __forceinline__ void setmaxnreg_inc() {
#if FK_SM90A
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
#endif
}
template <int R> __device__ __forceinline__ void setmaxnreg_dec() {
#if FK_SM90A
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
#endif
}

// ---- host --------------------------------------------------------------------------------------

// The driver's cuTensorMapEncodeTiled, reached through the runtime (no -lcuda), with no
// interleave and no out-of-bounds NaN fill; false where it fails. The driver wants a current
// context, which a thread whose first CUDA work is ours lacks (torch's autograd thread when a
// backward's first op is a fastkern GEMM: "cuTensorMapEncodeTiled failed"), and DeviceGuard makes
// none current when the device is already the thread's. A failure is retried once after
// cudaSetDevice, which makes the device's primary context current: nothing is added to a call that
// succeeds.
inline bool encode_tiled(CUtensorMap *map, CUtensorMapDataType type, cuuint32_t rank, const void *base,
                         const cuuint64_t *dims, const cuuint64_t *strides, const cuuint32_t *box,
                         CUtensorMapSwizzle swizzle, CUtensorMapL2promotion promotion) {
    static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
        void *ptr = nullptr;
        cudaDriverEntryPointQueryResult result;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &result) !=
                cudaSuccess ||
            result != cudaDriverEntryPointSuccess)
            ptr = nullptr;
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
    }();
    if (!fn) return false;
    const cuuint32_t elem_strides[5] = {1, 1, 1, 1, 1};
    auto encode = [&] {
        return fn(map, type, rank, const_cast<void *>(base), dims, strides, box, elem_strides,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    };
    if (encode() == CUDA_SUCCESS) return true;
    int device = 0;
    return cudaGetDevice(&device) == cudaSuccess && cudaSetDevice(device) == cudaSuccess && encode() == CUDA_SUCCESS;
}

// A 4-d map (d, rows, heads, sequences) of 16-bit elements in 64 x `box_rows` boxes (64 columns:
// one 128-byte swizzled row), rows past `rows` zero-filled: the attention kernels' Q, K, V, dO. A
// dimension of size 1 takes any valid stride. Strides are in elements.
inline bool encode_map_4d(CUtensorMap *map, fk_dtype dtype, const void *base, int64_t d, int64_t rows, int64_t heads,
                          int64_t batch, int64_t row, int64_t head, int64_t seq, int box_rows) {
    if (heads == 1) head = row * rows;
    if (batch == 1) seq = head * heads;
    const cuuint64_t dims[4] = {(cuuint64_t)d, (cuuint64_t)rows, (cuuint64_t)heads, (cuuint64_t)batch};
    const cuuint64_t strides[3] = {(cuuint64_t)row * 2, (cuuint64_t)head * 2, (cuuint64_t)seq * 2};
    const cuuint32_t box[4] = {64, (cuuint32_t)box_rows, 1, 1};
    return encode_tiled(map, dtype == FK_BFLOAT16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                        4, base, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
}

}  // namespace fk
