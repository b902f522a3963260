/* InfiniGen's selection on a CPU (kvlib.policies.infinigen): during layer i of a decode step, which entries layer
 * i+1 reads. For each (row, KV head), approximate scores of its cached tokens from the partial query and the partial
 * keys (scale x the largest over the head's query group of q_part . k_part); the candidates are the tokens whose
 * score is above the head's best minus alpha; a row fetches the mean of its heads' candidate counts (truncated, as the
 * official code's int(mean)), at most cap[b] and at least one, and each head its best-scored that many. Written as the
 * index list the decode kernel reads (decode_attention.c, one table per row and KV head): the picks in position
 * order, then the row's new token (at position cached[b]), repeated to the table's width. In PyTorch this is ~15 ops
 * a layer (a matmul, the masks, the counts, a top-k, the table), whose dispatch and top-k were a sixth of a step.
 *
 * The ranking is quest_select.c's total order: scores as floats (-0 as 0), equal scores by position, the earlier
 * token first (the PyTorch path sorts stably to the same rule). fp32, OpenMP over (row, KV head). */
#include <math.h>
#include <stdlib.h>

#include "ranking.h"
#include "vectors.h"

enum { OK = 0, BAD_SHAPE = -1, BAD_LENGTH = -2, NO_MEMORY = -4 };

/* q: [batch, kv_heads, group, r], the skewed partial queries; keys: [n_rows, kv_heads, r, capacity], the partial
 * keys, token-minor; rows[b] the cache row query row b reads, cached[b] its tokens (1 <= cached < capacity: its new
 * token goes at cached[b]), cap[b] >= 1 the most it fetches. Writes out_table [batch, kv_heads, width] (width >
 * every cap) and out_count [batch] (the picks a head of the row makes). Returns OK, or what it refused (then nothing
 * is written). */
int infinigen_select(const float *q, const float *keys, int64_t n_rows, int64_t capacity, const int64_t *rows,
                     const int64_t *cached, const int64_t *cap, int64_t batch, int64_t kv_heads, int64_t group,
                     int64_t r, float scale, float alpha, int64_t *out_table, int64_t width, int64_t *out_count) {
    if (batch < 0 || kv_heads < 1 || group < 1 || r < 1 || capacity < 2 || capacity > INT32_MAX || width < 2)
        return BAD_SHAPE;
    int64_t longest = 1;
    for (int64_t b = 0; b < batch; b++) {
        if (rows[b] < 0 || rows[b] >= n_rows || cached[b] < 1 || cached[b] >= capacity || cap[b] < 1 ||
            cap[b] >= width)
            return BAD_LENGTH;
        if (cached[b] > longest) longest = cached[b];
    }
    const int64_t pairs = batch * kv_heads;
    /* each (row, KV head)'s ranking keys twice (one copy the quickselect reorders), then its scores; an even count of
     * slots keeps the next pair's keys 8-byte aligned */
    const int64_t slots = (longest + 1) & ~(int64_t)1, scratch = slots * (2 * sizeof(uint64_t) + sizeof(float));
    char *buffer = malloc((pairs > 0 ? pairs : 1) * scratch);
    int64_t *candidates = malloc((pairs > 0 ? pairs : 1) * sizeof(int64_t));
    if (buffer == NULL || candidates == NULL) {
        free(buffer);
        free(candidates);
        return NO_MEMORY;
    }

#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < pairs; bh++) {
        const int64_t b = bh / kv_heads, h = bh % kv_heads, n = cached[b];
        const float *k = keys + (rows[b] * kv_heads + h) * r * capacity, *qh = q + bh * group * r;
        float *score = (float *)(buffer + bh * scratch + 2 * slots * sizeof(uint64_t));
        int64_t t = 0;
        /* a vector of tokens at once (the keys are token-minor), over whole logical vectors as on every path */
        for (const int64_t whole = n / LANES * LANES; t < whole; t += WIDTH) {
            vf best = {};
            for (int64_t g = 0; g < group; g++) {
                vf s = {};
                for (int64_t j = 0; j < r; j++) s += qh[g * r + j] * *(const vf *)(k + j * capacity + t);
                best = g == 0 ? s : vselect(s > best, s, best);
            }
            *(vf *)(score + t) = best * scale;
        }
        for (; t < n; t++) {
            float best = 0.f;
            for (int64_t g = 0; g < group; g++) {
                float s = 0.f;
                for (int64_t j = 0; j < r; j++) s += qh[g * r + j] * k[j * capacity + t];
                if (g == 0 || s > best) best = s;
            }
            score[t] = best * scale;
        }
        float peak = score[0];
        for (t = 1; t < n; t++) peak = score[t] > peak ? score[t] : peak;
        int64_t c = 0;
        for (t = 0; t < n; t++) c += score[t] > peak - alpha;
        candidates[bh] = c;
    }
    for (int64_t b = 0; b < batch; b++) {
        int64_t sum = 0;
        for (int64_t h = 0; h < kv_heads; h++) sum += candidates[b * kv_heads + h];
        const int64_t mean = sum / kv_heads;
        out_count[b] = mean < cap[b] ? (mean > 1 ? mean : 1) : cap[b];
    }

#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < pairs; bh++) {
        const int64_t b = bh / kv_heads, n = cached[b], picks = out_count[b] < n ? out_count[b] : n;
        uint64_t *key = (uint64_t *)(buffer + bh * scratch), *work = key + slots;
        const float *score = (const float *)(work + slots);
        for (int64_t t = 0; t < n; t++) key[t] = (uint64_t)ordered(score[t]) << 32 | (uint32_t)(INT32_MAX - t);
        memcpy(work, key, n * sizeof(uint64_t));
        const uint64_t threshold = kth_largest(work, n, picks);
        int64_t *out = out_table + bh * width, m = 0;
        for (int64_t t = 0; t < n; t++)
            if (key[t] >= threshold) out[m++] = t;
        while (m < width) out[m++] = n;
    }
    free(buffer);
    free(candidates);
    return OK;
}
