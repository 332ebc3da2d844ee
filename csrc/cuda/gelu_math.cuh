// GELU's scalar math on the GPU, shared by the GELU kernels (gelu.cu) and the matmul epilogues
// (matmul/): gelu<kApprox, kFast>(v) and its derivative, kApprox 1 = tanh form, kFast for 16-bit
// outputs (bare MUFU ex2 / rcp), fp32 outputs take libdevice's accurate expf / erff.
#pragma once

#include "common.cuh"

namespace fk {

constexpr float kSqrt1_2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;
constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kTanhCoef = 0.044715f;

// 2^t (fk::ex2_ftz) and 1 / d as single MUFU instructions (no denormal fix-ups: results below
// 2^-126 flush to 0, far below 16-bit resolution next to the values they are added to or divide).
__device__ __forceinline__ float rcp_ftz(float d) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
    return r;
}

template <bool kFast> __device__ __forceinline__ float exp_any(float v) {
    return kFast ? fk::exp_ftz(v) : expf(v);
}

// a / b for b >= 1. 16-bit: a * rcp(b). fp32: the same quotient refined by one remainder step
// (FMA), which rounds it correctly for the quotients GELU takes (where rcp flushes to 0, b > 2^126,
// the true quotient is below 1e-37 and torch's formula gives 0 too, and NaN for a = -inf, as this
// does); an infinite quotient (a = +inf) is kept. Six instructions against IEEE division's ten
// and its slow-path branch.
template <bool kFast> __device__ __forceinline__ float div_any(float a, float b) {
    const float r = rcp_ftz(b), q = a * r;
    if (kFast) return q;
    const float refined = fmaf(fmaf(-q, b, a), r, q);
    return isinf(q) ? q : refined;
}

// exp(-2u), u = sqrt(2/pi) (v + 0.044715 v^3), for the tanh form, clamped so that e * sigmoid stays
// finite (e <= 1.6e38). 16-bit: the constants are folded into one polynomial in base 2.
template <bool kFast> __device__ __forceinline__ float tanh_form_exp(float v) {
    if (kFast) {
        constexpr float c1 = -2.0f * kSqrt2OverPi * kLog2e, c3 = c1 * kTanhCoef;
        return ex2_ftz(fminf(v * fmaf(v * v, c3, c1), 88.0f * kLog2e));
    }
    float u = kSqrt2OverPi * (v + kTanhCoef * v * v * v);
    return expf(fminf(-2.0f * u, 88.0f));
}

template <int kApprox, bool kFast> __device__ __forceinline__ float gelu(float v) {
    if (kApprox) return div_any<kFast>(v, 1.0f + tanh_form_exp<kFast>(v));
    return 0.5f * v * (1.0f + erff(v * kSqrt1_2));
}

// d/dx x * s, s = sigmoid(2u): s + x * 2u' * s * (1 - s), with 1 - s = e * s.
template <int kApprox, bool kFast> __device__ __forceinline__ float gelu_grad(float v) {
    if (kApprox) {
        float e = tanh_form_exp<kFast>(v);
        float s = div_any<kFast>(1.0f, 1.0f + e);
        float du2 = 2.0f * kSqrt2OverPi * (1.0f + 3.0f * kTanhCoef * v * v);
        return s * fmaf(v * du2, e * s, 1.0f);  // e * s <= 1 first: e alone reaches 1e38
    }
    return 0.5f * (1.0f + erff(v * kSqrt1_2)) + v * kInvSqrt2Pi * exp_any<kFast>(-0.5f * v * v);
}

// gelu'(v), with gelu(v) into `value`: gelu_grad's and gelu's own expressions (so bit for bit their
// results), the erf form's erff computed once (the compiler merges the tanh form's exp and rcp by
// itself, not erff's branches: 3 ex2 an element against 2). The GELU backward's second output.
template <int kApprox, bool kFast> __device__ __forceinline__ float gelu_grad_value(float v, float &value) {
    if (kApprox) {
        value = gelu<kApprox, kFast>(v);
        return gelu_grad<kApprox, kFast>(v);
    }
    const float cdf2 = 1.0f + erff(v * kSqrt1_2);
    value = 0.5f * v * cdf2;
    return 0.5f * cdf2 + v * kInvSqrt2Pi * exp_any<kFast>(-0.5f * v * v);
}

}  // namespace fk
