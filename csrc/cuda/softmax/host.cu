// Device queries the softmax plan and launchers share, each cached per kernel instance and device:
// cluster limits, occupancy, and the one-wave shared-memory cap of the rows_warp grids.
#include "../common.cuh"
#include "plan.h"

namespace fk::softmax {
namespace {

// One cached int per (kernel, device, slot); 0 = not asked yet (values are stored + 1).
constexpr int kCacheSize = 4096;
struct CacheEntry {
    const void *kernel;
    int device, slot, value;
};
CacheEntry cache[kCacheSize];

int &cached(const void *kernel, int device, int slot) {
    const uint64_t h = ((uint64_t)(uintptr_t)kernel >> 4) * 0x9e3779b97f4a7c15ull ^ (uint64_t)(device * 8 + slot);
    for (int i = 0; i < kCacheSize; i++) {
        CacheEntry &e = cache[(h + i) % kCacheSize];
        if (e.kernel == kernel && e.device == device && e.slot == slot) return e.value;
        if (e.kernel == nullptr) {
            e = CacheEntry{kernel, device, slot, 0};
            return e.value;
        }
    }
    static int overflow;  // never reached: the instances number well under kCacheSize / 6
    overflow = 0;
    return overflow;
}

enum Slot { kLimitNoSmem, kLimitCta, kLimitBig, kLimitHuge, kOccupancy, kHinted };

// One-wave rows_warp grids: each CTA reserves 1 / k of a 100 KB carveout, k = ceil(CTAs / SMs), so
// SMs that drain first cannot take more than their share of the next call's CTAs (D-13).
constexpr int kSpreadCarveout = 100 * 1024;

}  // namespace

int cluster_limit(const void *kernel, int device, int threads, int smem) {
    if (fk::compute_major(device) < 9 || device < 0 || device >= 64) return 1;
    const int which = smem == 0 ? kLimitNoSmem : smem <= kSmemCtaMax ? kLimitCta : smem <= kSmemCtaBigMax ? kLimitBig : kLimitHuge;
    int &known = cached(kernel, device, which);
    if (known == 0) {
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
        known = limit + 1;
    }
    return known - 1;
}

int warp_occupancy(const void *kernel, int threads, int device) {
    if (device < 0 || device >= 64) return -1;
    int &occupancy = cached(kernel, device, kOccupancy);
    if (occupancy == 0) {
        int v = 0;
        if (fk::smem_per_sm(device) <= 0 ||
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, kernel, threads, 0) != cudaSuccess ||
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 kSpreadCarveout - fk::smem_reserved_per_cta(device)) != cudaSuccess)
            v = -1;
        cudaGetLastError();
        occupancy = v > 0 ? v : -1;
    }
    return occupancy;
}

size_t one_wave_smem(const void *kernel, int threads, int64_t ctas, int device) {
    const int occupancy = warp_occupancy(kernel, threads, device);
    if (occupancy < 0) return 0;
    int &hinted = cached(kernel, device, kHinted);  // 1: not hinted, 2: the carveout hint is set
    const int sms = fk::sm_count(device);
    const int64_t k = (ctas + sms - 1) / sms;
    const bool spread = k > 0 && k < occupancy;  // one wave, where the cap binds
    if (spread != (hinted == 2)) {
        const int percent =
            spread ? (int)(100LL * kSpreadCarveout / fk::smem_per_sm(device)) : cudaSharedmemCarveoutDefault;
        if (cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, percent) != cudaSuccess) {
            cudaGetLastError();
            return 0;
        }
        hinted = spread ? 2 : 1;
    }
    return spread ? (size_t)(kSpreadCarveout / k / 128 * 128 - fk::smem_reserved_per_cta(device)) : 0;
}

}  // namespace fk::softmax
