// Shared by the CUDA kernels: dtype conversion, 16-byte packs, warp / block reductions, the
// device guard and launch checks. Kernels compute in fp32 whatever the storage dtype.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "../fastkern.h"

namespace fk {

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// 16 bytes of T: one 128-bit load or store.
template <typename T> struct alignas(16) Pack {
    static constexpr int N = 16 / sizeof(T);
    T v[N];
};

// A plain 128-bit load: on an H200 the read-only path (__ldg) streamed bf16 GELU backward at 84%
// of copy bandwidth against 97% for this.
template <typename T> __device__ __forceinline__ Pack<T> load_pack(const T *p) {
    Pack<T> out;
    *reinterpret_cast<uint4 *>(&out) = *reinterpret_cast<const uint4 *>(p);
    return out;
}

// Element k (a compile-time index after unrolling) of a pack, as fp32. A bf16 is the top half of
// an fp32, so the 32-bit word holding elements 2i and 2i + 1 converts with one shift or one mask;
// the element-wise conversion extracted odd elements first (PRMT + SHF: 1.5 instructions an
// element instead of 1).
template <typename T> __device__ __forceinline__ float pack_f32(const Pack<T> &p, int k) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        const uint32_t w = reinterpret_cast<const uint32_t *>(p.v)[k >> 1];
        return __uint_as_float(k & 1 ? w & 0xffff0000u : w << 16);
    } else {
        return to_f32(p.v[k]);
    }
}

template <typename T> __device__ __forceinline__ void store_pack(T *p, const Pack<T> &v) {
    *reinterpret_cast<uint4 *>(p) = *reinterpret_cast<const uint4 *>(&v);
}

constexpr float kLog2e = 1.44269504088896340736f;

// 2^t as one MUFU.EX2 (ex2.approx.ftz: ~2 ulp; results below 2^-126 flush to 0).
__device__ __forceinline__ float ex2_ftz(float t) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(t));
    return r;
}

// e^t as one FMUL and ex2_ftz: the product's rounding adds |t| x 2^-24 relative error.
__device__ __forceinline__ float exp_ftz(float t) { return ex2_ftz(t * kLog2e); }

__host__ __device__ __forceinline__ bool aligned16(const void *p) {
    return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// Runs `body` with T bound to the storage type of `dtype`; fp64 is CPU-only.
#define FK_DISPATCH_CUDA_DTYPE(dtype, op, ...)                                                    \
    switch (dtype) {                                                                              \
    case FK_FLOAT32: { using T = float; __VA_ARGS__; break; }                                     \
    case FK_FLOAT16: { using T = __half; __VA_ARGS__; break; }                                    \
    case FK_BFLOAT16: { using T = __nv_bfloat16; __VA_ARGS__; break; }                            \
    default:                                                                                      \
        return fk_fail(FK_ERR_TYPE, "%s: dtype code %d is not supported on CUDA (float32, "       \
                       "float16, bfloat16)", op, (int)(dtype));                                   \
    }

// Makes `device` current for the scope of a launch and restores the caller's device after it.
struct DeviceGuard {
    int previous = -1;
    cudaError_t error = cudaSuccess;
    explicit DeviceGuard(int device) {
        error = cudaGetDevice(&previous);
        if (error == cudaSuccess && previous != device) error = cudaSetDevice(device);
        else previous = -1;
    }
    ~DeviceGuard() {
        if (previous >= 0) cudaSetDevice(previous);
    }
};

// Multiprocessor count of `device`, read once per device.
int sm_count(int device);

// Shared memory of one SM (0 if it cannot be read), and the bytes the system reserves in it for
// every resident CTA, read once per device.
int smem_per_sm(int device);
int smem_reserved_per_cta(int device);

// The DRAM bytes `device` can move per microsecond per SM, from its peak memory clock and bus width
// (0 if they cannot be read), read once per device: H100 SXM ~25 000, H200 ~37 000.
int dram_bytes_per_us_per_sm(int device);

// Compute capability major of `device` (0 if it cannot be read), read once per device.
int compute_major(int device);

// Programmatic dependent launch (sm_90 and later). A kernel launched through fk::Launch on such a
// device may be scheduled while the stream's previous kernel drains, so every kernel calls
// grid_dependency_sync() before its first global load or store: it returns once the previous grid
// has finished and its writes are visible, so stream order holds for memory exactly as without it.
// Set-up before the call (mbarriers, cluster arrival) overlaps the previous kernel's tail. The
// call also lets the next kernel launch at once; its CTAs can only take the SM slots this grid's
// last wave frees, and they wait in turn. FASTKERN_PDL=0 in the environment turns it off.
// Its two halves are also called apart, by kernels whose roles wait separately (wgmma_sm90's lean
// prologue, D-133): the launch at once, and each role's wait right before its first global access.
__device__ __forceinline__ void grid_dependency_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dependency_sync() {
    grid_dependency_launch();
    grid_dependency_wait();
}
// The wait, with a, b and c computed before it (operands, so the compiler cannot sink them past it).
__device__ __forceinline__ void grid_dependency_wait(int64_t &a, int64_t &b, int64_t &c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" : "+l"(a), "+l"(b), "+l"(c)::"memory");
#endif
}

// Whether launches on `device` ask for programmatic dependent launch (see grid_dependency_sync).
bool pdl_on(int device);

// A cudaLaunchKernelEx configuration: `grid` CTAs of `block` threads and `smem` bytes of dynamic
// shared memory, in clusters of `cluster_k` when > 1, with programmatic dependent launch where
// pdl_on(device) (device -1: never, e.g. for occupancy queries). Not copyable: the config points at
// its own attributes.
struct Launch {
    cudaLaunchConfig_t config = {};
    cudaLaunchAttribute attrs[2] = {};
    Launch(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, int device, int64_t cluster_k = 1) {
        config.gridDim = grid;
        config.blockDim = block;
        config.dynamicSmemBytes = smem;
        config.stream = stream;
        config.attrs = attrs;
        if (cluster_k > 1) {
            cudaLaunchAttribute &a = attrs[config.numAttrs++];
            a.id = cudaLaunchAttributeClusterDimension;
            a.val.clusterDim.x = (unsigned)cluster_k;
            a.val.clusterDim.y = 1;
            a.val.clusterDim.z = 1;
        }
        if (pdl_on(device)) {
            cudaLaunchAttribute &a = attrs[config.numAttrs++];
            a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
            a.val.programmaticStreamSerializationAllowed = 1;
        }
    }
    Launch(const Launch &) = delete;
    Launch &operator=(const Launch &) = delete;
    // FK_OK, or the launch's CUDA error as a RuntimeError naming `op`.
    template <typename... KernelArgs, typename... Args>
    fk_status operator()(const char *op, void (*kernel)(KernelArgs...), Args... args) const;
};

// FK_OK, or a RuntimeError carrying `error`.
fk_status cuda_status(cudaError_t error, const char *op);

template <typename... KernelArgs, typename... Args>
fk_status Launch::operator()(const char *op, void (*kernel)(KernelArgs...), Args... args) const {
    return cuda_status(cudaLaunchKernelEx(&config, kernel, args...), op);
}

}  // namespace fk

// Opens an entry point: checks the guard and turns its failure into a status.
#define FK_CUDA_ENTER(op, device)                                                                 \
    fk::DeviceGuard fk_guard_(device);                                                            \
    if (fk_guard_.error != cudaSuccess) return fk::cuda_status(fk_guard_.error, op)
