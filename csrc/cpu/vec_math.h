/* fp32 vector math shared by the CPU rows kernels (softmax_rows.h, cross_entropy.c): GNU vector
 * types of `lanes` floats, a lane select and a vectorised expf, instantiated per ISA by
 * FK_VEC_MATH(isa, attrs, lanes) inside each kernel family's own macro; fk_cpu_isa() picks the ISA
 * at run time (FASTKERN_CPU_ISA=generic|avx2|avx512 forces one, so tests cover each). */
#ifndef FASTKERN_CPU_VEC_MATH_H
#define FASTKERN_CPU_VEC_MATH_H

#include <stdlib.h>
#include <string.h>

enum { FK_ISA_GENERIC = 0, FK_ISA_AVX2 = 1, FK_ISA_AVX512 = 2 };

/* The widest ISA this CPU runs, or FASTKERN_CPU_ISA's choice (one the CPU lacks falls back to the
 * next narrower). */
static inline int fk_cpu_isa(void) {
    const char *want = getenv("FASTKERN_CPU_ISA");
    int generic = want && !strcmp(want, "generic"), avx2 = want && !strcmp(want, "avx2");
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (!generic && !avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq"))
        return FK_ISA_AVX512;
    if (!generic && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return FK_ISA_AVX2;
#endif
    (void)generic, (void)avx2;
    return FK_ISA_GENERIC;
}

#define FK_VEC_ATTRS(isa_list) __attribute__((target(isa_list), optimize("fp-contract=fast")))

/* Cephes expf: n = round(x log2 e), r = x - n ln 2 (two-part ln 2), exp(r) by a degree-6
 * polynomial, times 2^n from the exponent bits. ~1 ulp on [-87.3, 88]; below ln(FLT_MIN) 0 (the
 * true value is < 1.2e-38: subnormals are dropped), above 88 clamped (softmax's arguments are <= 0);
 * NaN stays NaN. */
#define FK_VEC_MATH(isa, attrs, lanes)                                                              \
    typedef float vf_##isa __attribute__((vector_size(4 * lanes), aligned(4)));                    \
    typedef int32_t vi_##isa __attribute__((vector_size(4 * lanes), aligned(4)));                  \
    typedef double vd_##isa __attribute__((vector_size(8 * lanes)));                               \
                                                                                                    \
    static inline attrs vf_##isa select_##isa(vi_##isa mask, vf_##isa a, vf_##isa b) {            \
        return (vf_##isa)(((vi_##isa)a & mask) | ((vi_##isa)b & ~mask));                           \
    }                                                                                               \
                                                                                                    \
    static inline attrs vf_##isa exp_##isa(vf_##isa x) {                                           \
        const vf_##isa zero = {0};                                                                  \
        vi_##isa tiny = x < -87.33654475f;                                                          \
        x = select_##isa(tiny, zero - 87.0f, x);                                                    \
        x = select_##isa(x > 88.0f, zero + 88.0f, x);                                               \
        vf_##isa t = x * 1.44269504088896341f + 12582912.0f; /* 1.5 * 2^23: rounds to integer */   \
        vf_##isa n = t - 12582912.0f;                                                               \
        vi_##isa ni = (vi_##isa)t - 0x4b400000;                                                     \
        vf_##isa r = x - n * 0.693359375f;                                                          \
        r = r - n * -2.12194440e-4f;                                                                \
        vf_##isa p = zero + 1.9875691500e-4f;                                                       \
        p = p * r + 1.3981999507e-3f;                                                               \
        p = p * r + 8.3334519073e-3f;                                                               \
        p = p * r + 4.1665795894e-2f;                                                               \
        p = p * r + 1.6666665459e-1f;                                                               \
        p = p * r + 5.0000001201e-1f;                                                               \
        p = p * (r * r) + r + 1.0f;                                                                 \
        vf_##isa y = p * (vf_##isa)((ni + 127) << 23);                                              \
        return (vf_##isa)((vi_##isa)y & ~tiny);                                                     \
    }

#endif
