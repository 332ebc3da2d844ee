// matmul_wgmma_sm90's small-problem instances (the kernel: wgmma_sm90.cuh): dispatch.cu's 16-bit rows
// where 128 x 128 tiles number at most half the SMs. K split over a 2-CTA cluster a tile, in 128 x 128
// or 128 x 64 tiles, or pairs of tiles (2i, 2i + 1 of one tile column) in a 2-CTA cluster sharing B's
// loads (D-128, D-136: 512^3 0.65 -> 1.03x cuBLAS, 1000^3 0.77 -> 0.96x, H200).
#ifdef FK_MM_STAMP_SMALL
#define FK_MM_STAMPS_EXPORT 1  // a timestamp build's stamps are this unit's (stamps.cuh)
#endif
#include "wgmma_sm90.cuh"

namespace fk::mm {
namespace {

template <typename T, bool kAKMajor, bool kBKMajor>
fk_status launch_small(const Plan &plan, const Params &p, fk_dtype dtype, int device, cudaStream_t stream) {
    // plan.split_k 2: K split, one tile a cluster, 128 x 64 tiles where plan.tile is 1; plan.share_b:
    // each CTA of the pair loads half of B's k-tile (64 rows of N), multicast to both.
    const bool narrow = plan.split_k == 2 && plan.tile == 1, share_b = plan.share_b;
    const int bn = narrow ? 64 : 128;
    Maps m;
    if (!encode_maps<T, kAKMajor, kBKMajor>(m, p, dtype, share_b ? 64 : bn))
        return fk_fail(FK_ERR_RUNTIME, "matmul: cuTensorMapEncodeTiled failed");
    const int64_t tiles = ((p.m + kBM - 1) / kBM) * ((p.n + bn - 1) / bn) * p.batch;
    // split: a cluster for every tile (partial_full serves one tile); sharing B: a CTA a tile
    // (dispatch.cu: tile rows even, so pairs share a tile column).
    const unsigned grid = (unsigned)(share_b ? tiles : 2 * tiles);
    if (narrow)
        return launch_kernel(matmul_wgmma_sm90<T, false, 64, kSplitK, kAKMajor, kBKMajor>, kSmemBytes<T, false, 64>, m,
                             grid, 2, device, stream);
    if (share_b)
        return launch_kernel(matmul_wgmma_sm90<T, false, 128, kShareB, kAKMajor, kBKMajor>, kSmemBytes<T, false>, m,
                             grid, 2, device, stream);
    return launch_kernel(matmul_wgmma_sm90<T, false, 128, kSplitK, kAKMajor, kBKMajor>, kSmemBytes<T, false>, m,
                         grid, 2, device, stream);
}

}  // namespace

// 2 16-bit dtypes x 4 operand majors x (split K 128 x 128 and 128 x 64, sharing B 128 x 128) = 24 instances.
fk_status launch_wgmma_sm90_small(const Plan &plan, const Params &p, fk_dtype dtype, bool a_kmajor, bool b_kmajor,
                                  int device, cudaStream_t stream) {
    if (dtype == FK_FLOAT32) return fk_fail(FK_ERR_RUNTIME, "matmul: the small-problem kernels are 16-bit");
    return with_majors(a_kmajor, b_kmajor, [&](auto ak, auto bk) {
        return dtype == FK_BFLOAT16 ? launch_small<__nv_bfloat16, ak.value, bk.value>(plan, p, dtype, device, stream)
                                    : launch_small<__half, ak.value, bk.value>(plan, p, dtype, device, stream);
    });
}

}  // namespace fk::mm
