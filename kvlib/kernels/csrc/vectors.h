/* The vectors kvlib's CPU kernels compute with, and the few vector functions they share.
 *
 * The kernels are written in logical vectors of LANES = 16 floats, on every CPU: a reduction's order is theirs (lane i
 * of a dot product sums elements i, i + 16, ...; hsum adds the 16 lanes in one tree), and the callers check that
 * their widths are multiples of LANES. A logical vector is PARTS native vectors `vf` of WIDTH floats, the CPU's own
 * width, chosen here from the compiler's target: AVX-512 16, AVX 8, else 4 (SSE, NEON, or what gcc makes of generic
 * vectors elsewhere). So each path does the same operations in the same order and gives the same bits wherever
 * a x b + c is fused alike (every x86 CPU with AVX2 has FMA, as does every aarch64; x86-64's SSE2 baseline has
 * none). Sixteen-float vectors on a narrower CPU were split by the compiler, passed through memory, and changed the
 * ABI (-Wpsabi). KVLIB_VECTOR_WIDTH forces a narrower path (tests/test_kernel_paths.py). */
#ifndef KVLIB_VECTORS_H
#define KVLIB_VECTORS_H
#include <stdint.h>
#include <string.h>

#define LANES 16

#if defined(KVLIB_VECTOR_WIDTH)
#define WIDTH KVLIB_VECTOR_WIDTH
#elif defined(__AVX512F__)
#define WIDTH 16
#elif defined(__AVX__)
#define WIDTH 8
#else
#define WIDTH 4
#endif
#if WIDTH != 4 && WIDTH != 8 && WIDTH != 16
#error "KVLIB_VECTOR_WIDTH: 4, 8 or 16"
#endif
#define PARTS (LANES / WIDTH)

#if WIDTH == 16
#define VECTOR_ISA "avx512"
#elif WIDTH == 8 && defined(__AVX2__)
#define VECTOR_ISA "avx2"
#elif WIDTH == 8
#define VECTOR_ISA "avx"
#else
#define VECTOR_ISA "portable"
#endif
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA) || defined(__FP_FAST_FMAF)
#define VECTOR_FMA 1
#else
#define VECTOR_FMA 0
#endif

/* Loads and stores through these need no alignment. */
typedef float vf __attribute__((vector_size(WIDTH * sizeof(float)), aligned(4), may_alias));
typedef int32_t vi __attribute__((vector_size(WIDTH * sizeof(int32_t)), aligned(4), may_alias));
typedef float v4 __attribute__((vector_size(4 * sizeof(float))));

/* The sum of a logical vector's 16 lanes (its PARTS native vectors): lanes 0-7 + 8-15, then 0-3 + 4-7, then
 * (0 + 2) + (1 + 3), on every path. */
static inline float hsum(const vf v[PARTS]) {
    v4 a, b;
#if WIDTH == 16
    typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
    v8 lo, hi;
    memcpy(&lo, v, sizeof lo);
    memcpy(&hi, (const char *)v + sizeof lo, sizeof hi);
    lo += hi;
    memcpy(&a, &lo, sizeof a);
    memcpy(&b, (char *)&lo + sizeof a, sizeof b);
#elif WIDTH == 8
    const vf lo = v[0] + v[1];
    memcpy(&a, &lo, sizeof a);
    memcpy(&b, (const char *)&lo + sizeof a, sizeof b);
#else
    a = v[0] + v[2];
    b = v[1] + v[3];
#endif
    a += b;
    return (a[0] + a[2]) + (a[1] + a[3]);
}

static inline float dot(const float *a, const float *b, int64_t dim) {
    vf s[PARTS];
    for (int p = 0; p < PARTS; p++) s[p] = *(const vf *)(a + p * WIDTH) * *(const vf *)(b + p * WIDTH);
    for (int64_t d = LANES; d < dim; d += LANES)
        for (int p = 0; p < PARTS; p++) s[p] += *(const vf *)(a + d + p * WIDTH) * *(const vf *)(b + d + p * WIDTH);
    return hsum(s);
}

/* exp(x) for x <= 0 (a score minus its row's max): 2^k exp(r), k = round(x / ln 2), |r| <= ln 2 / 2, exp(r) by
 * Cephes' expf polynomial (within ~2 ulp). Below -87 it returns exp(-87) ~ 1.6e-38, as good as 0 beside the max's 1. */
static inline vf vexp(vf x) {
    const vi low = x < -87.f; /* -1 where true */
    x = (vf)(((vi)x & ~low) | ((vi)((vf){} - 87.f) & low));
    const vi k = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi); /* truncation: round for x <= 0 */
    const vf kf = __builtin_convertvector(k, vf);
    const vf r = x - kf * 0.693359375f + kf * 2.12194440e-4f;
    vf p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    return p * (vf)((k + 127) << 23);
}

/* |x| */
static inline vf vabs(vf x) { return (vf)((vi)x & ((vi){} + INT32_MAX)); }

/* Where mask (-1 or 0 per lane, from a comparison) pick a, else b. */
static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

#endif
