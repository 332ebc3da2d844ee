// matmul_wgmma_sm90's persistent instances (the kernel and its napkin math: wgmma_sm90.cuh): dispatch.cu's
// rows "16-bit / fp32 under TF32, sm_90, TMA-describable operands". A grid of one CTA an SM walks
// 128 x 128 tiles, ping-pong or cooperative, or, for long K (plan.tile 2), 128 x 256 tiles, cooperative
// (D-139). The small-problem instances (K split, shared B) are in wgmma_sm90_small.cu.
#ifndef FK_MM_STAMP_SMALL
#define FK_MM_STAMPS_EXPORT 1  // a timestamp build's stamps are this unit's (stamps.cuh)
#endif
#include "wgmma_sm90.cuh"

namespace fk::mm {
namespace {

template <typename T, bool kAKMajor, bool kBKMajor>
fk_status launch(const Plan &plan, const Params &p, fk_dtype dtype, int device, cudaStream_t stream) {
    // plan.tile 2 (16-bit): 128 x 256 tiles, wgmma m64n256k16, cooperative (dispatch.cu's long-K row, D-139)
    const bool wide = sizeof(T) == 2 && plan.tile == 2;
    const int bn = wide ? 256 : 128;
    Maps m;
    if (!encode_maps<T, kAKMajor, kBKMajor>(m, p, dtype, bn))
        return fk_fail(FK_ERR_RUNTIME, "matmul: cuTensorMapEncodeTiled failed");
    const int64_t tiles = ((p.m + kBM - 1) / kBM) * ((p.n + bn - 1) / bn) * p.batch;
    const int sms = sm_count(device);
    const unsigned grid = (unsigned)std::min<int64_t>(tiles, sms);  // persistent: one CTA an SM
    if constexpr (sizeof(T) == 2) {
        if (wide)
            return launch_kernel(matmul_wgmma_sm90<T, false, 256, kAlone, kAKMajor, kBKMajor>,
                                 kSmemBytes<T, false, 256>, m, grid, 1, device, stream);
        // Ping-pong where every CTA has two tiles or more and C takes TMA stores. Else cooperative:
        // with one tile a CTA both consumers work on it (512^3: 0.57x cuBLAS ping-pong, 0.65x
        // cooperative), and element-stored C ran slower ping-pong (the LM head's linear 3.73x
        // cuBLAS, against 4.32x; D-114).
        if (m.q.tma_store && tiles >= 2 * (int64_t)sms)
            return launch_kernel(matmul_wgmma_sm90<T, true, 128, kAlone, kAKMajor, kBKMajor>, kSmemBytes<T, true>,
                                 m, grid, 1, device, stream);
    }
    return launch_kernel(matmul_wgmma_sm90<T, false, 128, kAlone, kAKMajor, kBKMajor>, kSmemBytes<T, false>, m,
                         grid, 1, device, stream);
}

}  // namespace

// 2 16-bit dtypes x 4 operand majors x (128 x 128 ping-pong, 128 x 128 cooperative, 128 x 256
// cooperative) + fp32 (tf32), cooperative, with A K-major and B K-major or N-major (swapped, D-132)
// = 26 instances (and wgmma_sm90_small.cu's 24).
fk_status launch_wgmma_sm90(const Plan &plan, const Params &p, fk_dtype dtype, bool a_kmajor, bool b_kmajor,
                            int device, cudaStream_t stream) {
    if (dtype == FK_FLOAT32) {
        if (!a_kmajor)  // dispatch.cu sends fp32 here only with A K-major
            return fk_fail(FK_ERR_RUNTIME, "matmul: the tf32 kernel needs a K-major A");
        return b_kmajor ? launch<float, true, true>(plan, p, dtype, device, stream)
                        : launch<float, true, false>(plan, p, dtype, device, stream);
    }
    if (plan.split_k == 2 || plan.share_b)  // small problems: 2-CTA clusters
        return launch_wgmma_sm90_small(plan, p, dtype, a_kmajor, b_kmajor, device, stream);
    return with_majors(a_kmajor, b_kmajor, [&](auto ak, auto bk) {
        return dtype == FK_BFLOAT16 ? launch<__nv_bfloat16, ak.value, bk.value>(plan, p, dtype, device, stream)
                                    : launch<__half, ak.value, bk.value>(plan, p, dtype, device, stream);
    });
}

}  // namespace fk::mm
