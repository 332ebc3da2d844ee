/* Shared by the CPU kernels: fp16 / bf16 <-> fp32 conversion and chunked load / store, so that each
 * op's arithmetic is written once in fp32 (and once in fp64 where gradcheck needs it). */
#ifndef FASTKERN_CPU_COMMON_H
#define FASTKERN_CPU_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../fastkern.h"

/* Elements processed per chunk: small enough for the stack and L1, long enough to vectorize. */
#define FK_CHUNK 512

static inline float fk_bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t fk_f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* quiet NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

static inline float fk_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: value = man * 2^-24 */
        float f = (float)man * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t fk_f32_to_f16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    uint32_t abs = bits & 0x7fffffffu;
    if (abs > 0x7f800000u) return sign | 0x7e00u;          /* NaN */
    if (abs >= 0x477ff000u) return sign | 0x7c00u;         /* rounds to >= 65520: inf */
    if (abs < 0x38800000u) {                               /* below 2^-14: subnormal or zero */
        float a;
        memcpy(&a, &abs, 4);
        /* adding 0.5 (2^-1) makes the FPU round a * 2^24 to an integer for us */
        float r = a + 0.5f;
        uint32_t rb;
        memcpy(&rb, &r, 4);
        return sign | (uint16_t)(rb - 0x3f000000u);
    }
    uint32_t mant_odd = (abs >> 13) & 1u;
    abs += 0xc8000fffu + mant_odd; /* rebias exponent (-112 << 23) and round to nearest even */
    return sign | (uint16_t)(abs >> 13);
}

/* out[i] = (float)src[start + i] for i < len. */
static inline void fk_load_f32(fk_dtype dtype, const void *src, int64_t start, int64_t len,
                               float *out) {
    if (dtype == FK_FLOAT32) {
        memcpy(out, (const float *)src + start, (size_t)len * sizeof(float));
    } else if (dtype == FK_BFLOAT16) {
        const uint16_t *s = (const uint16_t *)src + start;
        for (int64_t i = 0; i < len; i++) out[i] = fk_bf16_to_f32(s[i]);
    } else {
        const uint16_t *s = (const uint16_t *)src + start;
        for (int64_t i = 0; i < len; i++) out[i] = fk_f16_to_f32(s[i]);
    }
}

/* dst[start + i] = in[i] rounded to dtype, for i < len. */
static inline void fk_store_f32(fk_dtype dtype, const float *in, int64_t start, int64_t len,
                                void *dst) {
    if (dtype == FK_FLOAT32) {
        memcpy((float *)dst + start, in, (size_t)len * sizeof(float));
    } else if (dtype == FK_BFLOAT16) {
        uint16_t *d = (uint16_t *)dst + start;
        for (int64_t i = 0; i < len; i++) d[i] = fk_f32_to_bf16(in[i]);
    } else {
        uint16_t *d = (uint16_t *)dst + start;
        for (int64_t i = 0; i < len; i++) d[i] = fk_f32_to_f16(in[i]);
    }
}

/* Runs fn(ctx, begin, end) over contiguous ranges covering [0, items) on up to `threads` threads
 * of a persistent pool (the caller's among them), none given fewer than min_items items; the
 * ranges depend on items and the thread count only (parallel.c). */
typedef void (*fk_range_fn)(void *ctx, int64_t begin, int64_t end);
void fk_parallel_for(int threads, int64_t items, int64_t min_items, fk_range_fn fn, void *ctx);
/* The threads fk_parallel_for(threads, ...) runs on at most (FASTKERN_CPU_THREADS or the pool size
 * cap it); fk_parallel_threads(INT32_MAX) is the most any call uses. */
int fk_parallel_threads(int threads);

/* Elements a thread must have for waking a pool worker (a few us, parallel.c) to pay: the kernels
 * here take ~0.3-3 ns an element. */
#define FK_MIN_THREAD_ELEMS 16384

/* Items of `per_item` elements each that make up FK_MIN_THREAD_ELEMS. */
static inline int64_t fk_min_items(int64_t per_item) {
    return per_item >= FK_MIN_THREAD_ELEMS ? 1 : FK_MIN_THREAD_ELEMS / (per_item > 0 ? per_item : 1);
}

/* FK_OK for the dtypes the CPU kernels take, else a TypeError naming the op. */
static inline fk_status fk_cpu_check_dtype(fk_dtype dtype, const char *op) {
    if (dtype == FK_FLOAT32 || dtype == FK_FLOAT16 || dtype == FK_BFLOAT16 || dtype == FK_FLOAT64)
        return FK_OK;
    return fk_fail(FK_ERR_TYPE, "%s: unsupported dtype code %d on CPU", op, (int)dtype);
}

/* ---- scalar GELU: shared by gelu.c and matmul.c's activation epilogue ---- */
#define FK_SQRT1_2 0.70710678118654752440
#define FK_INV_SQRT_2PI 0.39894228040143267794
#define FK_SQRT_2_OVER_PI 0.79788456080286535588
#define FK_TANH_COEF 0.044715

/* The tanh form as x * sigmoid(2u) = x / (1 + exp(-2u)), like the GPU: one expf (several times
 * cheaper than tanhf in glibc) and no cancellation in 1 + tanh(u) for negative x. The exponent is
 * clamped so that e * s below stays finite. */
static inline float tanh_form_exp(float v) {
    float u = (float)FK_SQRT_2_OVER_PI * (v + (float)FK_TANH_COEF * v * v * v);
    return expf(fminf(-2.0f * u, 88.0f));
}

/* Phi(v) = erfc(-v / sqrt 2) / 2: accurate for negative v, where 1 + erf(v / sqrt 2) cancels (at
 * v = -5 it kept ~1 significant bit, and single bf16 / fp16 elements failed the 2x-torch-error rule
 * about once in 1200 draws). */
static inline float normal_cdf_f32(float v) { return 0.5f * erfcf(-v * (float)FK_SQRT1_2); }

static inline float gelu_f32(float v, int approximate) {
    if (approximate) return v / (1.0f + tanh_form_exp(v));
    return v * normal_cdf_f32(v);
}

static inline float gelu_grad_f32(float v, int approximate) {
    if (approximate) { /* d/dx x * s, s = sigmoid(2u): s * (1 + 2u' x (1 - s)), 1 - s = e * s */
        float e = tanh_form_exp(v), s = 1.0f / (1.0f + e);
        float du2 = 2.0f * (float)FK_SQRT_2_OVER_PI * (1.0f + 3.0f * (float)FK_TANH_COEF * v * v);
        return s * fmaf(v * du2, e * s, 1.0f);
    }
    float cdf = normal_cdf_f32(v);
    float pdf = (float)FK_INV_SQRT_2PI * expf(-0.5f * v * v);
    return cdf + v * pdf;
}

static inline double gelu_f64(double v, int approximate) {
    if (approximate) {
        double u = FK_SQRT_2_OVER_PI * (v + FK_TANH_COEF * v * v * v);
        return 0.5 * v * (1.0 + tanh(u));
    }
    return 0.5 * v * (1.0 + erf(v * FK_SQRT1_2));
}

static inline double gelu_grad_f64(double v, int approximate) {
    if (approximate) {
        double v2 = v * v;
        double u = FK_SQRT_2_OVER_PI * (v + FK_TANH_COEF * v2 * v);
        double t = tanh(u);
        double du = FK_SQRT_2_OVER_PI * (1.0 + 3.0 * FK_TANH_COEF * v2);
        return 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * du;
    }
    return 0.5 * (1.0 + erf(v * FK_SQRT1_2)) + v * FK_INV_SQRT_2PI * exp(-0.5 * v * v);
}

#endif
