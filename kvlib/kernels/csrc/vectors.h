/* 16-float vectors (gcc's vector extension) and the few vector functions kvlib's CPU kernels share. LANES is set by
 * the including file's needs: the callers check that their widths are multiples of it. */
#ifndef KVLIB_VECTORS_H
#define KVLIB_VECTORS_H
#include <stdint.h>
#include <string.h>

#define LANES 16

/* Loads and stores through these need no alignment; the compiler splits them where vectors are narrower. */
typedef float vf __attribute__((vector_size(LANES * sizeof(float)), aligned(4), may_alias));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t)), aligned(4), may_alias));
typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
typedef float v4 __attribute__((vector_size(4 * sizeof(float))));

static inline float hsum(vf v) {
    v8 lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (char *)&v + sizeof lo, sizeof hi);
    lo += hi;
    v4 a, b;
    memcpy(&a, &lo, sizeof a);
    memcpy(&b, (char *)&lo + sizeof a, sizeof b);
    a += b;
    return (a[0] + a[2]) + (a[1] + a[3]);
}

static inline float dot(const float *a, const float *b, int64_t dim) {
    vf s = *(const vf *)a * *(const vf *)b;
    for (int64_t d = LANES; d < dim; d += LANES) s += *(const vf *)(a + d) * *(const vf *)(b + d);
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
