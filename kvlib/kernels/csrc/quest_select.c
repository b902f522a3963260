/* Quest's block selection on a CPU (kvlib.policies.quest): one decode step of one layer, for each (row, KV head) the
 * blocks whose upper bound of q.k ranks in the row's top `pages`, the row's last block always among them, written as
 * the block list the decode kernel reads (decode_attention.c, one table per row and KV head) and its length in tokens.
 * In PyTorch this is ~15 ops a layer (two matmuls, masks, a sort, gathers), whose dispatch, not arithmetic, was their
 * cost at decode; here it is one call.
 *
 * A block's bound for query head g is sum over channels of max(q_d x max_d, q_d x min_d) >= q.k for every key of the
 * block; a KV head's bound is the largest over its group of query heads. The ranking is a total order: bounds compare
 * as floats (-0 as 0), equal bounds by position, the earlier block first (the PyTorch path sorts stably to the same
 * rule); the row's last block ranks above everything. (A NaN bound, from NaN keys, ranks in a fixed place; nothing
 * read depends on it.) The chosen blocks are written in position order; past a head's picks the list repeats
 * table[b][table_width - 1] (what the PyTorch path pads with), and the length says where its reads stop. Every table
 * entry the call reads is checked against the pool before any work. fp32, OpenMP over (row, KV head). */
#include <stdlib.h>

#include "ranking.h"
#include "vectors.h"

/* What the call refuses, before it reads anything (kvlib.kernels.cpu_kernel turns each into one error). */
enum { OK = 0, BAD_SHAPE = -1, BAD_LENGTH = -2, OUT_OF_BOUNDS = -3, NO_MEMORY = -4 };

/* q+ . hi + q- . lo over dim channels, in four independent (logical) sums rather than one chain of FMAs each waiting
 * on the last (~10% faster at dim 64, measured; what is left is mostly reading the bounds). */
static inline float upper_bound(const float *p, const float *n, const float *hi, const float *lo, int64_t dim) {
    vf a[PARTS] = {}, b[PARTS] = {}, c[PARTS] = {}, e[PARTS] = {};
    int64_t d = 0;
    for (; d + 2 * LANES <= dim; d += 2 * LANES)
        for (int64_t i = 0, x = d; i < PARTS; i++, x += WIDTH) {
            a[i] += *(const vf *)(p + x) * *(const vf *)(hi + x);
            b[i] += *(const vf *)(n + x) * *(const vf *)(lo + x);
            c[i] += *(const vf *)(p + x + LANES) * *(const vf *)(hi + x + LANES);
            e[i] += *(const vf *)(n + x + LANES) * *(const vf *)(lo + x + LANES);
        }
    if (d < dim) /* dim an odd multiple of LANES */
        for (int64_t i = 0, x = d; i < PARTS; i++, x += WIDTH) {
            a[i] += *(const vf *)(p + x) * *(const vf *)(hi + x);
            b[i] += *(const vf *)(n + x) * *(const vf *)(lo + x);
        }
    for (int i = 0; i < PARTS; i++) a[i] = (a[i] + b[i]) + (c[i] + e[i]);
    return hsum(a);
}

/* q: [batch, kv_heads * group, dim]; key_min, key_max: [pool_blocks, kv_heads, dim], a block's channel-wise bounds
 * of its keys; table: [batch, table_width], row b's blocks in position order, its first row_blocks[b] real; pages[b]
 * (>= 1) the blocks a KV head of row b reads, seen[b] the row's tokens ((row_blocks - 1) x block_size < seen <=
 * row_blocks x block_size). Writes out_table [batch, kv_heads, out_width] (out_width >= every row's
 * min(pages, row_blocks)) and out_lengths [batch, kv_heads]: the tokens each reads, whole blocks but the last. Returns
 * OK, or what it refused (then nothing is written). */
int quest_select(const float *q, const float *key_min, const float *key_max, int64_t pool_blocks,
                 const int64_t *table, int64_t table_width, const int64_t *row_blocks, const int64_t *pages,
                 const int64_t *seen, int64_t batch, int64_t kv_heads, int64_t group, int64_t dim,
                 int64_t block_size, int64_t *out_table, int64_t out_width, int64_t *out_lengths) {
    if (group < 1 || dim < LANES || dim % LANES || block_size < 1 || batch < 0 || kv_heads < 1 ||
        table_width < 1 || table_width > INT32_MAX || block_size > INT32_MAX || out_width < 1 || pool_blocks < 0)
        return BAD_SHAPE;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t nb = row_blocks[b], *tbl = table + b * table_width;
        if (nb < 1 || nb > table_width || pages[b] < 1 || (pages[b] < nb ? pages[b] : nb) > out_width ||
            seen[b] <= (nb - 1) * block_size || seen[b] > nb * block_size)
            return BAD_LENGTH;
        if (tbl[table_width - 1] < 0 || tbl[table_width - 1] >= pool_blocks) return OUT_OF_BOUNDS;
        for (int64_t j = 0; j < nb; j++)
            if (tbl[j] < 0 || tbl[j] >= pool_blocks) return OUT_OF_BOUNDS;
    }
    const int64_t pairs = batch * kv_heads;
    /* each (row, KV head)'s scratch: its ranking keys twice (one copy the quickselect reorders), then its queries'
     * positive and negative parts: sum over d of max(q_d max_d, q_d min_d) = q+ . max + q- . min, two FMAs a lane */
    const int64_t scratch = 2 * table_width * sizeof(uint64_t) + 2 * group * dim * sizeof(float);
    char *buffer = malloc((pairs > 0 ? pairs : 1) * scratch);
    if (buffer == NULL) return NO_MEMORY;

#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < pairs; bh++) {
        const int64_t b = bh / kv_heads, h = bh % kv_heads, nb = row_blocks[b];
        const int64_t picks = pages[b] < nb ? pages[b] : nb, *tbl = table + b * table_width;
        uint64_t *key = (uint64_t *)(buffer + bh * scratch), *work = key + table_width;
        float *pos = (float *)(work + table_width), *neg = pos + group * dim;
        for (int64_t i = 0; i < group * dim; i += WIDTH) {
            const vf x = *(const vf *)(q + bh * group * dim + i);
            *(vf *)(pos + i) = vselect(x > 0.f, x, (vf){});
            *(vf *)(neg + i) = vselect(x < 0.f, x, (vf){});
        }
        for (int64_t j = 0; j < nb; j++) {
            const float *lo = key_min + (tbl[j] * kv_heads + h) * dim, *hi = key_max + (tbl[j] * kv_heads + h) * dim;
            float best = 0.f;
            for (int64_t g = 0; g < group; g++) {
                const float bound = upper_bound(pos + g * dim, neg + g * dim, hi, lo, dim);
                if (g == 0 || bound > best) best = bound;
            }
            /* the bound's order above, then the earlier position; the last block above all */
            key[j] = j == nb - 1 ? UINT64_MAX : (uint64_t)ordered(best) << 32 | (uint32_t)(INT32_MAX - j);
        }
        memcpy(work, key, nb * sizeof(uint64_t));
        const uint64_t threshold = kth_largest(work, nb, picks);
        int64_t *out = out_table + bh * out_width, n = 0;
        for (int64_t j = 0; j < nb; j++)
            if (key[j] >= threshold) out[n++] = tbl[j];
        while (n < out_width) out[n++] = tbl[table_width - 1];
        out_lengths[bh] = (picks - 1) * block_size + seen[b] - (nb - 1) * block_size;
    }
    free(buffer);
    return OK;
}
