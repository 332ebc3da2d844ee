/* The CPU kernels' vector layer: GNU vector types and fp32 math written once and instantiated per
 * ISA with target attributes (one build runs everywhere; the caller picks at run time with
 * fk_cpu_isa()). Per ISA `isa` (lanes: AVX-512 16, AVX2 + FMA + F16C 8, portable 4):
 *   vf_isa / vi_isa / vu_isa   float / int32 / uint32 vectors (4-byte aligned: unaligned access)
 *   vd_isa                     lanes / 2 doubles, one register: fp32 lanes widen to two of them
 *                              (widen_lo_isa / widen_hi_isa) and narrow back from two (narrow_isa);
 *                              a two-register double vector type made GCC keep it in memory
 *   vload_isa(dtype, p, i)     lanes elements p[i..] as fp32: fp32 as is, bf16 by a 16-bit shift,
 *                              fp16 by F16C (vcvtph2ps) where present
 *   vstore_isa(dtype, v, p, i) the reverse, rounding to nearest even (bf16 in integer lanes, NaN
 *                              kept quiet; fp16 by vcvtps2ph)
 *   vany_isa(mask)             is any lane of a compare's mask set
 *   sum_dot_f64_isa(e, g, len, &z, &a)  z = sum e[i], a = sum e[i] g[i] over fp32 arrays, in fp64
 *                              (the products exact); AVX-512 takes AVX2's 256-bit loop (D-109)
 *   exp_isa(x)                 Cephes expf: n = round(x log2 e), r = x - n ln 2 (two-part ln 2),
 *                              exp(r) by a degree-6 polynomial, times 2^n from the exponent bits.
 *                              ~1 ulp on [-87.3, 88]; below -87.3 0 (the true value is under
 *                              FLT_MIN: subnormals are dropped), above 88 clamped; NaN stays NaN.
 *   exp2_isa(t)                2^t for callers that fold a scale and an offset into t with one FMA
 *                              (16-bit outputs only: t's rounding makes ~|t| 2^-24 relative error):
 *                              n = round(t), 2^(t - n) by a degree-5 minimax polynomial (1.8e-7
 *                              relative, evaluated in fp32), times 2^n; below -126 0, above 127
 *                              clamped; NaN stays NaN.
 * Included by the .c files that vectorise (their static functions are per translation unit).
 */
#ifndef FASTKERN_CPU_VEC_H
#define FASTKERN_CPU_VEC_H

#include <stdlib.h>
#include <string.h>

#include "common.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FK_X86 1
#else
#define FK_X86 0
#endif

enum { FK_ISA_GENERIC, FK_ISA_AVX2, FK_ISA_AVX512 };

/* gelu.c: GELU (erf, or tanh with `approximate`) in place over x[0..n) in the vector body of `isa`
 * (an fk_cpu_isa() value): matmul.c's epilogue */
void fk_cpu_gelu_f32_inplace(float *x, int64_t n, int approximate, int isa);

/* For the small vector helpers a kernel's loop calls: GCC left some (softmax_vec.h's loads) as calls,
 * each spilling the loop's vector registers around it. */
#define FK_INLINE inline __attribute__((always_inline))
static int fk_avx512bf16; /* the AVX-512 path may round to bf16 with vcvtneps2bf16 */

/* The widest ISA the CPU runs; FASTKERN_CPU_ISA=generic|avx2|avx512 forces a narrower one (one the
 * CPU lacks falls back to the next narrower), so tests cover each path on one machine. */
static inline int fk_cpu_isa(void) {
    const char *want = getenv("FASTKERN_CPU_ISA");
    int generic = want && !strcmp(want, "generic"), avx2 = want && !strcmp(want, "avx2");
#if FK_X86
    __builtin_cpu_init();
    int has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                   __builtin_cpu_supports("f16c");
    if (!generic && !avx2 && has_avx2 && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw")) {
        fk_avx512bf16 = __builtin_cpu_supports("avx512bf16") && !(want && !strcmp(want, "avx512-nobf16"));
        return FK_ISA_AVX512;
    }
    if (!generic && has_avx2) return FK_ISA_AVX2;
#endif
    (void)generic, (void)avx2;
    return FK_ISA_GENERIC;
}

#define FK_VEC_TYPES(isa, lanes)                                                                   \
    typedef float vf_##isa __attribute__((vector_size(4 * lanes), aligned(4)));                   \
    typedef int32_t vi_##isa __attribute__((vector_size(4 * lanes), aligned(4)));                 \
    typedef uint32_t vu_##isa __attribute__((vector_size(4 * lanes), aligned(4)));                \
    typedef uint16_t vh_##isa __attribute__((vector_size(2 * lanes), aligned(2)));                \
    typedef double vd_##isa __attribute__((vector_size(4 * lanes)));

/* fp16 <-> fp32 of one vector: F16C where the ISA has it, else common.h's scalar conversions. */
#define FK_VEC_F16_SCALAR(isa, attrs, lanes)                                                       \
    static FK_INLINE attrs vf_##isa f16_load_##isa(const uint16_t *p) {                               \
        vf_##isa v;                                                                                 \
        for (int l = 0; l < lanes; l++) v[l] = fk_f16_to_f32(p[l]);                                 \
        return v;                                                                                   \
    }                                                                                               \
    static FK_INLINE attrs void f16_store_##isa(vf_##isa v, uint16_t *p) {                            \
        for (int l = 0; l < lanes; l++) p[l] = fk_f32_to_f16(v[l]);                                 \
    }

/* mask ? a : b per lane (mask lanes all ones or zero, as vector compares give) */
#define FK_VEC_SELECT(isa, attrs)                                                                  \
    static FK_INLINE attrs vf_##isa select_##isa(vi_##isa mask, vf_##isa a, vf_##isa b) {            \
        return (vf_##isa)(((vi_##isa)a & mask) | ((vi_##isa)b & ~mask));                           \
    }

/* bf16 <-> fp32 of one vector in integer lanes: a shift; rounding to nearest even, NaN kept quiet */
#define FK_VEC_BF16_LOAD(isa, attrs)                                                               \
    static FK_INLINE attrs vf_##isa bf16_load_##isa(const uint16_t *h) {                           \
        return (vf_##isa)(__builtin_convertvector(*(const vh_##isa *)h, vu_##isa) << 16);          \
    }
#define FK_VEC_BF16_INT(isa, attrs)                                                                \
    static FK_INLINE attrs void bf16_store_int_##isa(vf_##isa v, uint16_t *h) {                       \
        vu_##isa b = (vu_##isa)v;                                                                   \
        vi_##isa nan = (vi_##isa)((b & 0x7fffffffu) > 0x7f800000u);                                 \
        vu_##isa r = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;                                        \
        r = (vu_##isa)(((vi_##isa)((b >> 16) | 0x40u) & nan) | ((vi_##isa)r & ~nan));               \
        *(vh_##isa *)h = __builtin_convertvector(r, vh_##isa);                                      \
    }

#define FK_VEC_MATH(isa, attrs, lanes)                                                             \
    static FK_INLINE attrs vf_##isa vload_##isa(fk_dtype dtype, const void *p, int64_t i) {           \
        if (dtype == FK_FLOAT32) return *(const vf_##isa *)((const float *)p + i);                 \
        const uint16_t *h = (const uint16_t *)p + i;                                                \
        if (dtype == FK_FLOAT16) return f16_load_##isa(h);                                          \
        return bf16_load_##isa(h);                                                                  \
    }                                                                                               \
                                                                                                    \
    static FK_INLINE attrs void vstore_##isa(fk_dtype dtype, vf_##isa v, void *p, int64_t i) {        \
        if (dtype == FK_FLOAT32) {                                                                  \
            *(vf_##isa *)((float *)p + i) = v;                                                      \
            return;                                                                                 \
        }                                                                                           \
        uint16_t *h = (uint16_t *)p + i;                                                            \
        if (dtype == FK_FLOAT16) {                                                                  \
            f16_store_##isa(v, h);                                                                  \
            return;                                                                                 \
        }                                                                                           \
        bf16_store_##isa(v, h);                                                                     \
    }                                                                                               \
                                                                                                    \
    /* v's lanes summed in order in fp64, and their max (NaN lanes skipped), read through memory: a  \
     * vector subscripted in a loop made GCC keep it in memory for the whole function, its loop's    \
     * accumulator included */                                                                      \
    static FK_INLINE attrs double vsum_##isa(vf_##isa v) {                                         \
        float t[lanes];                                                                             \
        double s = 0.0;                                                                             \
        memcpy(t, &v, sizeof t);                                                                    \
        for (int l = 0; l < lanes; l++) s += t[l];                                                  \
        return s;                                                                                   \
    }                                                                                               \
    static FK_INLINE attrs float vmax_##isa(vf_##isa v) {                                          \
        float t[lanes], m = -INFINITY;                                                              \
        memcpy(t, &v, sizeof t);                                                                    \
        for (int l = 0; l < lanes; l++) m = t[l] > m ? t[l] : m;                                    \
        return m;                                                                                   \
    }                                                                                               \
    static FK_INLINE attrs double vsum_d_##isa(vd_##isa v) {                                       \
        double t[lanes / 2], s = 0.0;                                                               \
        memcpy(t, &v, sizeof t);                                                                    \
        for (int l = 0; l < lanes / 2; l++) s += t[l];                                              \
        return s;                                                                                   \
    }

/* A vector's tail through a buffer: p[i..i+len) as fp32 lanes, len <= lanes, the rest `fill`; and
 * the reverse (AVX-512 has masked loads and stores instead, below). */
#define FK_VEC_PART(isa, attrs, lanes)                                                             \
    static inline attrs vf_##isa vload_part_##isa(fk_dtype dtype, const void *p, int64_t i,        \
                                                  int64_t len, float fill) {                        \
        float buf[lanes];                                                                           \
        fk_load_f32(dtype, p, i, len, buf);                                                         \
        for (int64_t l = len; l < lanes; l++) buf[l] = fill;                                        \
        return *(const vf_##isa *)buf;                                                              \
    }                                                                                               \
                                                                                                    \
    static inline attrs void vstore_part_##isa(fk_dtype dtype, vf_##isa v, void *p, int64_t i,     \
                                               int64_t len) {                                       \
        float buf[lanes];                                                                           \
        *(vf_##isa *)buf = v;                                                                       \
        fk_store_f32(dtype, buf, i, len, p);                                                        \
    }

#define FK_VEC_EXP(isa, attrs)                                                                     \
    static FK_INLINE attrs vf_##isa exp_##isa(vf_##isa x) {                                           \
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
    }                                                                                               \

#define FK_VEC_EXP2(isa, attrs)                                                                    \
    static FK_INLINE attrs vf_##isa exp2_##isa(vf_##isa t) {                                         \
        const vf_##isa zero = {0};                                                                  \
        vi_##isa tiny = t < -126.0f;                                                                \
        t = select_##isa(tiny, zero - 126.0f, t);                                                   \
        t = select_##isa(t > 127.0f, zero + 127.0f, t);                                             \
        vf_##isa k = t + 12582912.0f; /* 1.5 * 2^23: rounds to integer */                           \
        vf_##isa n = k - 12582912.0f;                                                               \
        vi_##isa ni = (vi_##isa)k - 0x4b400000;                                                     \
        vf_##isa r = t - n, p = zero + 1.3264698209e-3f;                                            \
        p = p * r + 9.6715092659e-3f;                                                               \
        p = p * r + 5.5507339537e-2f;                                                               \
        p = p * r + 2.4022242427e-1f;                                                               \
        p = p * r + 6.9314700365e-1f;                                                               \
        p = p * r + 1.0f;                                                                           \
        vf_##isa y = p * (vf_##isa)((ni + 127) << 23);                                              \
        return (vf_##isa)((vi_##isa)y & ~tiny);                                                     \
    }

#define FK_VEC_ATTRS(isa_list) __attribute__((target(isa_list), optimize("fp-contract=fast")))
#define FK_ATTRS_GENERIC __attribute__((optimize("fp-contract=fast")))
#define FK_ATTRS_AVX2 FK_VEC_ATTRS("avx2,fma,f16c")
/* avx512bf16 in the target so that bf16_store_cvt inlines (a call per vector spilled every zmm);
 * its one instruction runs only where fk_cpu_isa() found the feature */
#define FK_ATTRS_AVX512 FK_VEC_ATTRS("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")

FK_VEC_TYPES(generic, 4)
FK_VEC_F16_SCALAR(generic, FK_ATTRS_GENERIC, 4)
FK_VEC_SELECT(generic, FK_ATTRS_GENERIC)
FK_VEC_BF16_LOAD(generic, FK_ATTRS_GENERIC)
FK_VEC_BF16_INT(generic, FK_ATTRS_GENERIC)
static FK_INLINE FK_ATTRS_GENERIC void bf16_store_generic(vf_generic v, uint16_t *h) {
    bf16_store_int_generic(v, h);
}
FK_VEC_MATH(generic, FK_ATTRS_GENERIC, 4)
FK_VEC_PART(generic, FK_ATTRS_GENERIC, 4)
FK_VEC_EXP(generic, FK_ATTRS_GENERIC)
FK_VEC_EXP2(generic, FK_ATTRS_GENERIC)
static FK_INLINE FK_ATTRS_GENERIC vd_generic widen_lo_generic(vf_generic v) { return (vd_generic){v[0], v[1]}; }
static FK_INLINE FK_ATTRS_GENERIC vd_generic widen_hi_generic(vf_generic v) { return (vd_generic){v[2], v[3]}; }
static FK_INLINE FK_ATTRS_GENERIC vf_generic narrow_generic(vd_generic lo, vd_generic hi) {
    return (vf_generic){(float)lo[0], (float)lo[1], (float)hi[0], (float)hi[1]};
}
static FK_INLINE FK_ATTRS_GENERIC int vany_generic(vi_generic m) { return (m[0] | m[1] | m[2] | m[3]) != 0; }
static inline FK_ATTRS_GENERIC void sum_dot_f64_generic(const float *e, const float *g, int64_t len, double *z,
                                                      double *a) {
    vd_generic z_lo = {0}, z_hi = {0}, a_lo = {0}, a_hi = {0};
    int64_t i = 0;
    for (; i + 4 <= len; i += 4) {
        vf_generic ev = *(const vf_generic *)(e + i), gv = *(const vf_generic *)(g + i);
        vd_generic e_lo = widen_lo_generic(ev), e_hi = widen_hi_generic(ev);
        z_lo += e_lo, z_hi += e_hi;
        a_lo += e_lo * widen_lo_generic(gv), a_hi += e_hi * widen_hi_generic(gv);
    }
    double zs = vsum_d_generic(z_lo + z_hi), as = vsum_d_generic(a_lo + a_hi);
    for (; i < len; i++) zs += e[i], as += (double)e[i] * g[i];
    *z = zs, *a = as;
}

#if FK_X86
FK_VEC_TYPES(avx2, 8)
static FK_INLINE FK_ATTRS_AVX2 vf_avx2 f16_load_avx2(const uint16_t *p) {
    return (vf_avx2)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static FK_INLINE FK_ATTRS_AVX2 void f16_store_avx2(vf_avx2 v, uint16_t *p) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT));
}
FK_VEC_SELECT(avx2, FK_ATTRS_AVX2)
/* bf16 loads as one widening load and a shift (the vector-extension form took five ops) */
static FK_INLINE FK_ATTRS_AVX2 vf_avx2 bf16_load_avx2(const uint16_t *h) {
    return (vf_avx2)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h)), 16);
}
FK_VEC_BF16_INT(avx2, FK_ATTRS_AVX2)
static FK_INLINE FK_ATTRS_AVX2 void bf16_store_avx2(vf_avx2 v, uint16_t *h) { bf16_store_int_avx2(v, h); }
FK_VEC_MATH(avx2, FK_ATTRS_AVX2, 8)
FK_VEC_PART(avx2, FK_ATTRS_AVX2, 8)
FK_VEC_EXP(avx2, FK_ATTRS_AVX2)
FK_VEC_EXP2(avx2, FK_ATTRS_AVX2)
static FK_INLINE FK_ATTRS_AVX2 vd_avx2 widen_lo_avx2(vf_avx2 v) {
    return (vd_avx2)_mm256_cvtps_pd(_mm256_castps256_ps128((__m256)v));
}
static FK_INLINE FK_ATTRS_AVX2 vd_avx2 widen_hi_avx2(vf_avx2 v) {
    return (vd_avx2)_mm256_cvtps_pd(_mm256_extractf128_ps((__m256)v, 1));
}
static FK_INLINE FK_ATTRS_AVX2 vf_avx2 narrow_avx2(vd_avx2 lo, vd_avx2 hi) {
    return (vf_avx2)_mm256_set_m128(_mm256_cvtpd_ps((__m256d)hi), _mm256_cvtpd_ps((__m256d)lo));
}
static FK_INLINE FK_ATTRS_AVX2 int vany_avx2(vi_avx2 m) { return _mm256_movemask_ps((__m256)m) != 0; }
/* 4 floats to 4 doubles straight from memory (vcvtps2pd ymm, m128), 4 sums each: Zen 4 widens at
 * ~0.10 ns an element so, 0.16 through zmm registers (8 at a time, half of them extracted; D-109). */
static inline FK_ATTRS_AVX2 void sum_dot_f64_avx2(const float *e, const float *g, int64_t len, double *z, double *a) {
    __m256d zs[4], as[4];
    for (int k = 0; k < 4; k++) zs[k] = as[k] = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 16 <= len; i += 16)
        for (int k = 0; k < 4; k++) {
            __m256d ev = _mm256_cvtps_pd(_mm_loadu_ps(e + i + 4 * k));
            zs[k] = _mm256_add_pd(zs[k], ev);
            as[k] = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(g + i + 4 * k)), ev, as[k]);
        }
    vd_avx2 zv = (vd_avx2)_mm256_add_pd(_mm256_add_pd(zs[0], zs[1]), _mm256_add_pd(zs[2], zs[3]));
    vd_avx2 av = (vd_avx2)_mm256_add_pd(_mm256_add_pd(as[0], as[1]), _mm256_add_pd(as[2], as[3]));
    double zt = vsum_d_avx2(zv), at = vsum_d_avx2(av);
    for (; i < len; i++) zt += e[i], at += (double)e[i] * g[i];
    *z = zt, *a = at;
}

FK_VEC_TYPES(avx512, 16)
static FK_INLINE FK_ATTRS_AVX512 vf_avx512 f16_load_avx512(const uint16_t *p) {
    return (vf_avx512)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static FK_INLINE FK_ATTRS_AVX512 void f16_store_avx512(vf_avx512 v, uint16_t *p) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT));
}
static FK_INLINE FK_ATTRS_AVX512 vf_avx512 bf16_load_avx512(const uint16_t *h) {
    return (vf_avx512)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)h)), 16);
}
FK_VEC_BF16_INT(avx512, FK_ATTRS_AVX512)
/* AVX-512 BF16's vcvtneps2bf16 where the CPU has it (one op for the integer path's ~10; it flushes
 * subnormals to 0, D-85): fk_cpu_isa() sets the flag. */
static FK_INLINE FK_ATTRS_AVX512 void bf16_store_cvt(vf_avx512 v, uint16_t *h) {
    _mm256_storeu_si256((__m256i *)h, (__m256i)_mm512_cvtneps_pbh((__m512)v));
}
static FK_INLINE FK_ATTRS_AVX512 void bf16_store_avx512(vf_avx512 v, uint16_t *h) {
    if (fk_avx512bf16) bf16_store_cvt(v, h);
    else bf16_store_int_avx512(v, h);
}

/* one vblendmps on the compare's mask register (the and / or form took three ops) */
static FK_INLINE FK_ATTRS_AVX512 vf_avx512 select_avx512(vi_avx512 mask, vf_avx512 a, vf_avx512 b) {
    return (vf_avx512)_mm512_mask_blend_ps(_mm512_movepi32_mask((__m512i)mask), (__m512)b, (__m512)a);
}
FK_VEC_MATH(avx512, FK_ATTRS_AVX512, 16)

/* Tails by masked loads (and fp32 masked stores): through the buffer (scalar stores, then one vector
 * load: a failed store forward) a softmax row of 8 keys took ~90 ns, now ~45 (D-104). Values as the
 * full-vector loads give them; 16-bit stores keep the buffer (rounded by common.h, as before). */
static inline FK_ATTRS_AVX512 vf_avx512 vload_part_avx512(fk_dtype dtype, const void *p, int64_t i, int64_t len,
                                                          float fill) {
    __mmask16 k = (__mmask16)((1u << len) - 1u);
    __m512 v;
    if (dtype == FK_FLOAT32) {
        v = _mm512_maskz_loadu_ps(k, (const float *)p + i);
    } else {
        __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t *)p + i);
        v = dtype == FK_FLOAT16 ? _mm512_cvtph_ps(h) : (__m512)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
    }
    return (vf_avx512)_mm512_mask_blend_ps(k, _mm512_set1_ps(fill), v);
}

static inline FK_ATTRS_AVX512 void vstore_part_avx512(fk_dtype dtype, vf_avx512 v, void *p, int64_t i, int64_t len) {
    if (dtype == FK_FLOAT32) {
        _mm512_mask_storeu_ps((float *)p + i, (__mmask16)((1u << len) - 1u), (__m512)v);
        return;
    }
    float buf[16];
    *(vf_avx512 *)buf = v;
    fk_store_f32(dtype, buf, i, len, p);
}
static FK_INLINE FK_ATTRS_AVX512 vd_avx512 widen_lo_avx512(vf_avx512 v) {
    return (vd_avx512)_mm512_cvtps_pd(_mm512_castps512_ps256((__m512)v));
}
static FK_INLINE FK_ATTRS_AVX512 vd_avx512 widen_hi_avx512(vf_avx512 v) {
    return (vd_avx512)_mm512_cvtps_pd(_mm512_extractf32x8_ps((__m512)v, 1));
}
static FK_INLINE FK_ATTRS_AVX512 vf_avx512 narrow_avx512(vd_avx512 lo, vd_avx512 hi) {
    return (vf_avx512)_mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps((__m512d)lo)),
                                         _mm512_cvtpd_ps((__m512d)hi), 1);
}
static FK_INLINE FK_ATTRS_AVX512 int vany_avx512(vi_avx512 m) { return _mm512_movepi32_mask((__m512i)m) != 0; }
static inline FK_ATTRS_AVX512 void sum_dot_f64_avx512(const float *e, const float *g, int64_t len, double *z,
                                                     double *a) {
    sum_dot_f64_avx2(e, g, len, z, a);
}

/* The same polynomial, with AVX-512's vscalefps for the 2^n step: it saturates to 0 / inf itself, so
 * the clamps shrink to one max / min (NaN kept: vmaxps returns its second operand for a NaN) and
 * the mask and integer exponent arithmetic go (~15 ops a vector instead of ~20, D-85). Results
 * below FLT_MIN come out subnormal instead of 0; -inf gives 0. */
static FK_INLINE FK_ATTRS_AVX512 vf_avx512 exp_avx512(vf_avx512 v) {
    __m512 x = _mm512_max_ps(_mm512_set1_ps(-110.0f), (__m512)v);
    x = _mm512_min_ps(_mm512_set1_ps(88.0f), x);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf_avx512 r = (vf_avx512)_mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = (vf_avx512)_mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), (__m512)r);
    const vf_avx512 zero = {0};
    vf_avx512 p = zero + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    return (vf_avx512)_mm512_scalef_ps((__m512)p, n);
}
/* 2^t likewise: -inf gives 0 (2^-160), NaN kept. */
static FK_INLINE FK_ATTRS_AVX512 vf_avx512 exp2_avx512(vf_avx512 v) {
    __m512 t = _mm512_max_ps(_mm512_set1_ps(-160.0f), (__m512)v);
    t = _mm512_min_ps(_mm512_set1_ps(128.0f), t);
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf_avx512 r = (vf_avx512)_mm512_sub_ps(t, n);
    const vf_avx512 zero = {0};
    vf_avx512 p = zero + 1.3264698209e-3f;
    p = p * r + 9.6715092659e-3f;
    p = p * r + 5.5507339537e-2f;
    p = p * r + 2.4022242427e-1f;
    p = p * r + 6.9314700365e-1f;
    p = p * r + 1.0f;
    return (vf_avx512)_mm512_scalef_ps((__m512)p, n);
}
#endif

#endif
