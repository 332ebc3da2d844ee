// CUDA runtime facts for module.c, and the helpers common.cuh declares.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"

#ifndef FK_CUDA_ARCHS
#define FK_CUDA_ARCHS "unknown"
#endif

namespace fk {

// `attr` of `device`, kept in `cache` after the first read; `fallback` where it cannot be read.
static int attribute_once(int (&cache)[64], int device, cudaDeviceAttr attr, int fallback) {
    if (device < 0 || device >= 64) return fallback;
    if (cache[device] == 0) {
        int v = 0;
        if (cudaDeviceGetAttribute(&v, attr, device) != cudaSuccess || v <= 0) {
            cudaGetLastError();
            return fallback;
        }
        cache[device] = v;
    }
    return cache[device];
}

int sm_count(int device) {
    static int counts[64];
    return attribute_once(counts, device, cudaDevAttrMultiProcessorCount, 132);
}

int smem_per_sm(int device) {
    static int bytes[64];
    return attribute_once(bytes, device, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0);
}

int smem_reserved_per_cta(int device) {
    static int bytes[64];
    return attribute_once(bytes, device, cudaDevAttrReservedSharedMemoryPerBlock, 1024);
}

int dram_bytes_per_us_per_sm(int device) {
    static int clocks_khz[64], widths_bits[64];
    const int64_t clock = attribute_once(clocks_khz, device, cudaDevAttrMemoryClockRate, 0);
    const int64_t width = attribute_once(widths_bits, device, cudaDevAttrGlobalMemoryBusWidth, 0);
    return (int)(2 * clock * width / 8 / 1000 / sm_count(device));  // double data rate
}

int compute_major(int device) {
    static int majors[64];
    return attribute_once(majors, device, cudaDevAttrComputeCapabilityMajor, 0);
}

bool pdl_on(int device) {
    static const bool enabled = [] {
        const char *v = getenv("FASTKERN_PDL");
        return !(v && strcmp(v, "0") == 0);
    }();
    return enabled && compute_major(device) >= 9;
}

fk_status cuda_status(cudaError_t error, const char *op) {
    if (error == cudaSuccess) return FK_OK;
    cudaGetLastError();  // clear a sticky-free error so the next call starts clean
    return fk_fail(FK_ERR_RUNTIME, "%s: CUDA error %s (%s)", op, cudaGetErrorName(error),
                   cudaGetErrorString(error));
}

}  // namespace fk

extern "C" int fk_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

extern "C" fk_status fk_cuda_device_name(int device, char *buf, int len, int *major, int *minor) {
    cudaDeviceProp prop;
    cudaError_t error = cudaGetDeviceProperties(&prop, device);
    if (error != cudaSuccess) return fk::cuda_status(error, "device_name");
    snprintf(buf, (size_t)len, "%s", prop.name);
    *major = prop.major;
    *minor = prop.minor;
    return FK_OK;
}

extern "C" const char *fk_cuda_archs(void) { return FK_CUDA_ARCHS; }
