/* The small ops of a Llama decoder layer on a CPU, each one pass over its rows. At decode a row is a few thousand
 * floats, and what these cost in PyTorch is the dispatch of the six to eight ops each is made of, not the arithmetic.
 * fp32; widths are multiples of LANES. Each returns 0, or -1 where it refused a shape (then nothing is written): the
 * caller (kvlib.kernels.checks) checks what these cannot see, the tensors' sizes. Large calls (prefill) run on the
 * OpenMP threads. */
#include <math.h>

#include "vectors.h"

/* x[r] += delta[r] where delta is given; out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight (RMSNorm). */
int add_rms_norm(float *x, const float *delta, const float *weight, float *out, int64_t rows, int64_t n,
                 float eps) {
    if (rows < 0 || n < LANES || n % LANES) return -1;
#pragma omp parallel for if (rows * n >= 1 << 16)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * n, *o = out + r * n;
        vf squares[PARTS] = {};
        for (int64_t i = 0; i < n; i += LANES)
            for (int p = 0; p < PARTS; p++) {
                vf v = *(vf *)(xr + i + p * WIDTH);
                if (delta) *(vf *)(xr + i + p * WIDTH) = v += *(const vf *)(delta + r * n + i + p * WIDTH);
                squares[p] += v * v;
            }
        const float inv = 1.f / sqrtf(hsum(squares) / (float)n + eps);
        for (int64_t i = 0; i < n; i += WIDTH) *(vf *)(o + i) = *(vf *)(xr + i) * inv * *(const vf *)(weight + i);
    }
    return 0;
}

/* In place, Llama's RoPE on rows x heads vectors of dim (row r's head h at x + r * row_stride + h * dim):
 * x = x cos[r] + rotate_half(x) sin[r], rotate_half(x) = (-x[dim/2:], x[:dim/2]). */
int rope(float *x, int64_t row_stride, const float *cos, const float *sin, int64_t rows, int64_t heads,
         int64_t dim) {
    if (rows < 0 || heads < 0 || dim < 2 * LANES || dim % (2 * LANES) || heads > row_stride / dim) return -1;
    const int64_t half = dim / 2;
#pragma omp parallel for if (rows * heads * dim >= 1 << 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * dim, *s = sin + r * dim;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + r * row_stride + h * dim;
            for (int64_t i = 0; i < half; i += WIDTH) {
                const vf a = *(vf *)(v + i), b = *(vf *)(v + half + i);
                *(vf *)(v + i) = a * *(const vf *)(c + i) - b * *(const vf *)(s + i);
                *(vf *)(v + half + i) = b * *(const vf *)(c + half + i) + a * *(const vf *)(s + half + i);
            }
        }
    }
    return 0;
}

/* out[r] = silu(gate_up[r, :n]) * gate_up[r, n:], silu(g) = g sigmoid(g). */
int silu_mul(const float *gate_up, float *out, int64_t rows, int64_t n) {
    if (rows < 0 || n < LANES || n % LANES) return -1;
#pragma omp parallel for if (rows * n >= 1 << 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * n, *u = g + n;
        for (int64_t i = 0; i < n; i += WIDTH) {
            const vf x = *(const vf *)(g + i), e = vexp(-vabs(x)); /* exp(-|x|) <= 1: no overflow */
            const vf sigmoid = vselect(x < 0.f, e / (1.f + e), 1.f / (1.f + e));
            *(vf *)(out + r * n + i) = x * sigmoid * *(const vf *)(u + i);
        }
    }
    return 0;
}
