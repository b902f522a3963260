/* Decode attention on a CPU: one new token per row, attending that row's cached keys and values where they lie (a
 * paged pool through its block table, or a contiguous per-row cache), each row over its own length: no copy, no
 * padding to the longest row.
 *
 * Work is split into (row, KV head, chunk of CHUNK tokens) jobs, so one long row still keeps every core busy; each
 * job writes its softmax's max, sum and weighted values, and a second pass merges a row's chunks. The G query heads
 * of a KV head share each key as it is read (grouped-query attention without repeating K/V). fp32 throughout, as
 * SDPA's scores are.
 *
 * The arithmetic is written with 16-float vectors (vectors.h, gcc's vector extension): left to the auto-vectorizer, the dot
 * products stayed scalar (profiled: 42 ns a token and KV head on 2 threads, slower than PyTorch's flash kernel; 12 ns
 * written out). No -ffast-math: a shared library built with it sets flush-to-zero for the whole process that loads
 * it, so exp is a polynomial here, not libm's. */
#include <math.h>
#include <stdlib.h>

#include "vectors.h"

#define CHUNK 256
#define MAX_GROUP 16
#define MAX_DIM 256
#define PREFETCH 16 /* tokens ahead whose K and V are prefetched */

int decode_attention_limits(int64_t *chunk, int64_t *max_group, int64_t *max_dim, int64_t *lanes) {
    *chunk = CHUNK;
    *max_group = MAX_GROUP;
    *max_dim = MAX_DIM;
    *lanes = LANES;
    return 0;
}

/* q, out: [batch, kv_heads * group, dim]. Token t of row b, KV head h, lies at
 *   k + row_offset[b] + h * head_stride + (table[b * table_width + t / block_size] * block_size + t % block_size) * dim
 * (the same for v). partial: [batch, kv_heads, max_chunks, group, dim + 2] floats of scratch. */
void decode_attention(const float *q, const float *k, const float *v, float *out, const int64_t *row_offset,
                      const int64_t *table, int64_t table_width, const int64_t *lengths, int64_t block_size,
                      int64_t head_stride, int64_t batch, int64_t kv_heads, int64_t group, int64_t dim, float scale,
                      float *partial, int64_t max_chunks) {
    int64_t *first_job = malloc((batch + 1) * sizeof(int64_t)); /* the first job of each row */
    first_job[0] = 0;
    for (int64_t b = 0; b < batch; b++)
        first_job[b + 1] = first_job[b] + kv_heads * ((lengths[b] + CHUNK - 1) / CHUNK);
    const int64_t jobs = first_job[batch], part = group * (dim + 2);

#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t job = 0; job < jobs; job++) {
        int64_t b = 0;
        while (first_job[b + 1] <= job) b++;
        const int64_t chunks = (lengths[b] + CHUNK - 1) / CHUNK;
        const int64_t h = (job - first_job[b]) / chunks, c = (job - first_job[b]) % chunks;
        const int64_t t0 = c * CHUNK, t1 = t0 + CHUNK < lengths[b] ? t0 + CHUNK : lengths[b], n = t1 - t0;
        const float *qh = q + (b * kv_heads + h) * group * dim;
        const int64_t base = row_offset[b] + h * head_stride;
        float scores[MAX_GROUP][CHUNK] __attribute__((aligned(64)));
        float acc[MAX_GROUP][MAX_DIM] __attribute__((aligned(64)));

        const int64_t *row_table = table + b * table_width;
        for (int64_t t = t0; t < t1;) { /* scores, a block's stretch of slots at a time */
            const int64_t off = t % block_size, run = block_size - off < t1 - t ? block_size - off : t1 - t;
            const float *kr = k + base + (row_table[t / block_size] * block_size + off) * dim;
            for (int64_t i = 0; i < run; i++, kr += dim) {
                const int64_t ahead = t + i + PREFETCH;
                if (ahead < t1) { /* this token's K and V, PREFETCH tokens ahead: V is read after the chunk's scores */
                    const int64_t at = base + (row_table[ahead / block_size] * block_size + ahead % block_size) * dim;
                    for (int64_t d = 0; d < dim; d += 64 / sizeof(float)) {
                        __builtin_prefetch(k + at + d);
                        __builtin_prefetch(v + at + d);
                    }
                }
                for (int64_t g = 0; g < group; g++) scores[g][t - t0 + i] = dot(qh + g * dim, kr, dim) * scale;
            }
            t += run;
        }
        float *mine = partial + ((b * kv_heads + h) * max_chunks + c) * part;
        for (int64_t g = 0; g < group; g++) { /* softmax over the chunk, kept unnormalized */
            float m = -INFINITY, l = 0.f;
            for (int64_t i = 0; i < n; i++) m = scores[g][i] > m ? scores[g][i] : m;
            for (int64_t i = 0; i < n; i += LANES) *(vf *)&scores[g][i] = vexp(*(vf *)&scores[g][i] - m);
            for (int64_t i = 0; i < n; i++) l += scores[g][i];
            mine[g * (dim + 2)] = m;
            mine[g * (dim + 2) + 1] = l;
            memset(acc[g], 0, dim * sizeof(float));
        }
        for (int64_t t = t0; t < t1;) { /* the values, weighted */
            const int64_t off = t % block_size, run = block_size - off < t1 - t ? block_size - off : t1 - t;
            const float *vr = v + base + (table[b * table_width + t / block_size] * block_size + off) * dim;
            for (int64_t i = 0; i < run; i++, vr += dim)
                for (int64_t g = 0; g < group; g++) {
                    const float p = scores[g][t - t0 + i];
                    for (int64_t d = 0; d < dim; d += LANES) *(vf *)&acc[g][d] += p * *(const vf *)(vr + d);
                }
            t += run;
        }
        for (int64_t g = 0; g < group; g++) memcpy(mine + g * (dim + 2) + 2, acc[g], dim * sizeof(float));
    }

#pragma omp parallel for
    for (int64_t bh = 0; bh < batch * kv_heads; bh++) { /* each row's chunks merged by their softmax max */
        const int64_t b = bh / kv_heads, chunks = (lengths[b] + CHUNK - 1) / CHUNK;
        const float *parts = partial + bh * max_chunks * part;
        for (int64_t g = 0; g < group; g++) {
            float top = -INFINITY, total = 0.f, *o = out + (bh * group + g) * dim;
            for (int64_t c = 0; c < chunks; c++) top = fmaxf(top, parts[c * part + g * (dim + 2)]);
            memset(o, 0, dim * sizeof(float));
            for (int64_t c = 0; c < chunks; c++) {
                const float *p = parts + c * part + g * (dim + 2), w = expf(p[0] - top);
                total += w * p[1];
                for (int64_t d = 0; d < dim; d++) o[d] += w * p[2 + d];
            }
            for (int64_t d = 0; d < dim; d++) o[d] /= total;
        }
    }
    free(first_job);
}
