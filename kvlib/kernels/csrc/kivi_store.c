/* KIVI's decode-step store on a CPU (kvlib.policies.kivi): each row's new key and value go into its full-precision
 * ring (token t in slot t % residual); the value they push out of the ring is quantized per token, over groups of
 * value_group channels, into its codes; a key ring that fills is quantized at once, per channel over groups of `group`
 * tokens (each channel's codes packed along the group's tokens). In PyTorch this is ~25 ops a layer (gathers, a
 * min-max quantization, packing, five scatters) whose dispatch, not arithmetic, was their cost: measured at 7.3 ms of
 * an 86 ms step at batch 8 x 2,048 on SmolLM2-135M.
 *
 * The codes are exactly kvlib.kernels.quantized's (tested equal): zero = min, scale = (max - min) / (2^bits - 1),
 * code = round-half-even((x - zero) / scale) clamped to [0, 2^bits - 1] (a zero range codes 0 with scale 0), packed
 * lowest bits first, 8 / bits codes a byte (16 bits: two bytes, low first); RAW_BITS stores each value's own bytes
 * and no scales. Every row, length and shape is checked before anything is written; a NaN value codes 0. */
#include <math.h>

#include "vectors.h"

#define RAW_BITS 32

enum { OK = 0, BAD_SHAPE = -1, BAD_LENGTH = -2 };

/* The scale and zero point of the n values x[0], x[stride], ... */
static void range_of(const float *x, int64_t n, int64_t stride, int64_t bits, float *scale, float *zero) {
    float lo = x[0], hi = x[0];
    for (int64_t i = 1; i < n; i++) {
        const float v = x[i * stride];
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    *zero = lo;
    *scale = (hi - lo) / (float)((1 << bits) - 1);
}

/* A value's code, clamped to [0, 2^bits - 1]; a NaN (from a NaN or infinite value or range) codes 0, where a NaN
 * converted to an integer would be undefined and, ORed unmasked into a byte, would corrupt its neighbours' codes. */
static inline uint32_t code_of(float x, float scale, float zero, int64_t bits) {
    const float levels = (float)((1 << bits) - 1), c = rintf((x - zero) / (scale > 0.f ? scale : 1.f));
    return c >= 0.f ? (uint32_t)(c > levels ? levels : c) : 0u; /* NaN fails c >= 0 */
}

/* The n values x[0], x[stride], ... as packed codes, value i with scale[i / per_scale] and zero[i / per_scale]. */
static void pack_codes(const float *x, int64_t n, int64_t stride, const float *scale, const float *zero,
                       int64_t per_scale, int64_t bits, uint8_t *out) {
    if (bits == RAW_BITS) {
        for (int64_t i = 0; i < n; i++) memcpy(out + i * sizeof(float), x + i * stride, sizeof(float));
        return;
    }
    if (bits == 16) {
        for (int64_t i = 0; i < n; i++) {
            const uint32_t code = code_of(x[i * stride], scale[i / per_scale], zero[i / per_scale], bits);
            out[2 * i] = (uint8_t)(code & 255);
            out[2 * i + 1] = (uint8_t)(code >> 8);
        }
        return;
    }
    const int64_t per = 8 / bits;
    for (int64_t byte = 0; byte < n / per; byte++) {
        uint32_t packed = 0;
        for (int64_t k = 0, i = byte * per; k < per; k++, i++)
            packed |= code_of(x[i * stride], scale[i / per_scale], zero[i / per_scale], bits) << (k * bits);
        out[byte] = (uint8_t)packed;
    }
}

/* key, value: the new tokens, row b's KV head h at element b * key_stride (value_stride) + h * dim of each.
 * Query row b writes cache row rows[b], which holds begin[b] tokens. key_ring, value_ring [n_rows, kv_heads, residual,
 * dim]; key_codes [n_rows, kv_heads, capacity / group, dim, group * bits / 8]; value_codes [n_rows, kv_heads, capacity,
 * code_bytes]; key_scale, key_zero [n_rows, kv_heads, capacity / group, dim]; value_scale, value_zero [n_rows,
 * kv_heads, capacity, dim / value_group] (scales unused with RAW_BITS). Returns OK, or what it refused (then nothing
 * is written). */
int kivi_store(const float *key, const float *value, int64_t key_stride, int64_t value_stride, const int64_t *rows,
               const int64_t *begin, int64_t batch, float *key_ring, float *value_ring, uint8_t *key_codes,
               float *key_scale, float *key_zero, uint8_t *value_codes, float *value_scale, float *value_zero,
               int64_t n_rows, int64_t kv_heads, int64_t dim, int64_t residual, int64_t capacity, int64_t bits,
               int64_t group, int64_t value_group) {
    if (!(bits == 2 || bits == 4 || bits == 8 || bits == 16 || bits == RAW_BITS) || dim < 1 || kv_heads < 1 ||
        batch < 0 || n_rows < 0 || group < 1 || value_group < 1 || dim % value_group || (dim * bits) % 8 ||
        (group * bits) % 8 || residual < group || residual % group || capacity < residual || capacity % residual ||
        key_stride < kv_heads * dim || value_stride < kv_heads * dim)
        return BAD_SHAPE;
    for (int64_t b = 0; b < batch; b++)
        if (rows[b] < 0 || rows[b] >= n_rows || begin[b] < 0 || begin[b] >= capacity)
            return BAD_LENGTH;
    const int64_t code_bytes = dim * bits / 8, groups = capacity / group, value_groups = dim / value_group;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t rh = rows[b] * kv_heads + h, t = begin[b], slot = t % residual;
            float *kring = key_ring + rh * residual * dim, *vring = value_ring + rh * residual * dim;
            if (t >= residual) { /* the value of token t - residual leaves the slot the new one takes */
                const int64_t at = rh * capacity + t - residual;
                const float *x = vring + slot * dim;
                if (bits != RAW_BITS)
                    for (int64_t g = 0; g < value_groups; g++)
                        range_of(x + g * value_group, value_group, 1, bits, value_scale + at * value_groups + g,
                                 value_zero + at * value_groups + g);
                pack_codes(x, dim, 1, value_scale + at * value_groups, value_zero + at * value_groups, value_group,
                           bits, value_codes + at * code_bytes);
            }
            memcpy(kring + slot * dim, key + b * key_stride + h * dim, dim * sizeof(float));
            memcpy(vring + slot * dim, value + b * value_stride + h * dim, dim * sizeof(float));
            if (slot != residual - 1) continue;
            /* the key ring is full: tokens t + 1 - residual .. t, in slots 0 .. residual - 1, become codes, each
             * channel's along its group's tokens */
            const int64_t first = t + 1 - residual, group_bytes = group * bits / 8;
            for (int64_t s0 = 0; s0 < residual; s0 += group) {
                const int64_t at = (rh * groups + (first + s0) / group) * dim;
                for (int64_t c = 0; c < dim; c++) {
                    if (bits != RAW_BITS) range_of(kring + s0 * dim + c, group, dim, bits, key_scale + at + c,
                                                   key_zero + at + c);
                    pack_codes(kring + s0 * dim + c, group, dim, key_scale + at + c, key_zero + at + c, group, bits,
                               key_codes + (at + c) * group_bytes);
                }
            }
        }
    return OK;
}
