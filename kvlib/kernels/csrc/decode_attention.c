/* Decode attention on a CPU, the one every kvlib policy decodes with: one new token per row, attending what that row
 * and KV head reads where it lies (a row of a contiguous cache, a paged pool through a block table per row, a block
 * list per row and KV head, an index list), each over its own length: no copy, no padding to the longest row.
 * Optionally it also returns each token's attention probability summed over the KV head's query group (H2O's score).
 * A row's oldest keys and values may be low-bit codes (KIVI's layout, kvlib.kernels.quantized), read where they lie:
 * a group of coded keys is scored channel by channel, a vector of tokens at a time, against the query scaled by the
 * channel's scale (no key is dequantized); a coded value is dequantized as it is read, into a vector that stays in L1.
 * The cache's codes are all that is read from memory.
 *
 * Work is split into (row, KV head, chunk of CHUNK tokens) jobs, so one long row still keeps every core busy; each
 * job writes its softmax's max, sum and weighted values, and a second pass merges a row's chunks. Every read is
 * checked against the cache's extent before any work, and what the kernel refuses it returns as a code. The G query heads
 * of a KV head share each key as it is read (grouped-query attention without repeating K/V). fp32 throughout, as
 * SDPA's scores are.
 *
 * The arithmetic is written with vectors (vectors.h, gcc's vector extension; 16-float logical vectors, the CPU's
 * width natively): left to the auto-vectorizer, the dot products stayed scalar (profiled: 42 ns a token and KV head on
 * 2 threads, slower than PyTorch's flash kernel; 12 ns written out). No -ffast-math: a shared library built with it
 * sets flush-to-zero for the whole process that loads it, so exp is a polynomial here, not libm's. */
#include <math.h>
#include <stdlib.h>

#include "vectors.h"

#define CHUNK 256
#define MAX_GROUP 16
#define MAX_DIM 256
#define PREFETCH 16 /* tokens ahead whose K and V are prefetched */
#define RAW_BITS 32 /* "codes" that are each value's own fp32 bytes: the quantized layout's exactness check */

int decode_attention_limits(int64_t *chunk, int64_t *max_group, int64_t *max_dim, int64_t *lanes) {
    *chunk = CHUNK;
    *max_group = MAX_GROUP;
    *max_dim = MAX_DIM;
    *lanes = LANES;
    return 0;
}

/* The vector path this build runs (vectors.h): its instruction set, its native vector's floats, and whether it fuses
 * a x b + c. */
int vector_path(const char **isa, int64_t *width, int64_t *fma) {
    *isa = VECTOR_ISA;
    *width = WIDTH;
    *fma = VECTOR_FMA;
    return 0;
}

/* What the kernel refuses, before it reads anything (kvlib.kernels.cpu_kernel turns each into one error). */
enum { OK = 0, BAD_SHAPE = -1, BAD_LENGTH = -2, OUT_OF_BOUNDS = -3, NO_MEMORY = -4, BAD_QUANTIZED = -5 };

/* The keys and values row b, KV head h reads: tokens t < lengths[b * kv_heads + h], token t at element
 *   row_offset[b] + h * head_stride + (tbl[t / block_size] * block_size + t % block_size) * dim
 * of k (and v), tbl = table + b * table_row_stride + h * table_head_stride. One layout covers a contiguous per-row
 * cache (a row is one block), a paged pool (one table per row: table_head_stride 0), a block list per row and head
 * (Quest's selection) and an index list (block_size 1). */
typedef struct {
    const int64_t *row_offset, *table, *lengths;
    int64_t table_row_stride, table_head_stride, table_width, block_size, head_stride, kv_heads, dim;
} layout;

static inline const int64_t *table_of(const layout *l, int64_t b, int64_t h) {
    return l->table + b * l->table_row_stride + h * l->table_head_stride;
}

static inline int64_t slot(const layout *l, const int64_t *tbl, int64_t base, int64_t t) {
    return base + (tbl[t / l->block_size] * l->block_size + t % l->block_size) * l->dim;
}

/* Where a row's oldest tokens are codes: row b's keys of tokens t < keys_quantized[b] and values of tokens
 * t < values_quantized[b] are read from cache row rows[b] of the arrays below (each contiguous), the rest through the
 * layout above. Keys are quantized per channel over groups of `group` tokens, each channel's codes packed along
 * the group's tokens (as KIVI's own kernels pack them); values per token over groups of `value_group` channels,
 * packed along the channels; x = code x scale + zero; codes of `bits` bits packed into bytes lowest bits first
 * (RAW_BITS: the fp32 value itself, no scale).
 *   key_codes [n_rows, kv_heads, capacity / group, dim, group * bits / 8]; value_codes [n_rows, kv_heads, capacity,
 *   code_bytes]; key_scale, key_zero [n_rows, kv_heads, capacity / group, dim]; value_scale, value_zero [n_rows,
 *   kv_heads, capacity, dim / value_group] */
typedef struct {
    const uint8_t *key_codes, *value_codes;
    const float *key_scale, *key_zero, *value_scale, *value_zero;
    const int64_t *rows, *keys_quantized, *values_quantized;
    int64_t n_rows, bits, code_bytes, capacity, group, value_group;
} quantized;

typedef uint32_t vu __attribute__((vector_size(WIDTH * sizeof(uint32_t)), aligned(4), may_alias));
typedef uint8_t vbytes __attribute__((vector_size(WIDTH), aligned(1), may_alias));
typedef uint16_t vshorts __attribute__((vector_size(WIDTH * sizeof(uint16_t)), aligned(2), may_alias));

/* The WIDTH codes packed at c (WIDTH x bits / 8 bytes), as floats. Codes sit lowest bits first, so with 2 bits lane i
 * is bits 2i..2i+1 of the 32-bit word c[0..3], with 4 bits bits 4i.. of the 64-bit c[0..7]: a broadcast, one shift per
 * lane and a mask. */
static inline vf unpacked(const uint8_t *c, int64_t bits) {
    vu lane;
    for (int i = 0; i < WIDTH; i++) lane[i] = i;
    uint32_t w[2] = {0, 0};
    vf raw;
    switch (bits) {
    case 2:
        memcpy(w, c, WIDTH * 2 / 8);
        return __builtin_convertvector(((vu){} + w[0]) >> (lane * 2) & 3, vf);
    case 4: {
        memcpy(w, c, WIDTH * 4 / 8);
        if (WIDTH * 4 <= 32) return __builtin_convertvector(((vu){} + w[0]) >> (lane * 4) & 15, vf);
        const vu low = (vu)(lane < 8); /* all ones in lanes 0-7 */
        const vu word = (((vu){} + w[0]) & low) | (((vu){} + w[1]) & ~low);
        return __builtin_convertvector(word >> (lane % 8 * 4) & 15, vf);
    }
    case 8: return __builtin_convertvector(*(const vbytes *)c, vf);
    case 16: return __builtin_convertvector(*(const vshorts *)c, vf);
    default: memcpy(&raw, c, sizeof raw); return raw; /* RAW_BITS */
    }
}

/* Code i of those packed at c (i * bits bits in). */
static inline float code_at(const uint8_t *c, int64_t i, int64_t bits) {
    if (bits == 16) return (float)(c[2 * i] | c[2 * i + 1] << 8);
    return (float)(c[i * bits / 8] >> (i * bits % 8) & ((1 << bits) - 1));
}

/* The key group holding token t of cache row `row`, KV head h, as an index of channels: its scales and zero points
 * start at element key_group(...) of key_scale and key_zero, its codes at key_group(...) x group * bits / 8 bytes. */
static inline int64_t key_group(const quantized *q, int64_t row, int64_t h, int64_t kv_heads, int64_t t, int64_t dim) {
    return ((row * kv_heads + h) * (q->capacity / q->group) + t / q->group) * dim;
}

/* Key t into out[dim], channel by channel (a group whose tokens do not fill whole vectors). */
static void dequantized_key(const quantized *q, int64_t row, int64_t h, int64_t kv_heads, int64_t t, int64_t dim,
                            float *out) {
    const int64_t at = key_group(q, row, h, kv_heads, t, dim), i = t % q->group, group_bytes = q->group * q->bits / 8;
    const uint8_t *codes = q->key_codes + at * group_bytes;
    if (q->bits == RAW_BITS) {
        for (int64_t c = 0; c < dim; c++) memcpy(out + c, codes + c * group_bytes + i * sizeof(float), sizeof(float));
        return;
    }
    for (int64_t c = 0; c < dim; c++)
        out[c] = code_at(codes + c * group_bytes, i, q->bits) * q->key_scale[at + c] + q->key_zero[at + c];
}

/* The scores of the group of coded keys from token t (a multiple of q->group, a multiple of LANES) for each of the
 * G query heads qh, into scores[g][i..]: q.k = sum_c q_c scale_c code_c + q.zero, so the query is scaled once a group
 * and each channel's codes, WIDTH tokens in a vector, are multiplied into G sums that never cross lanes. G is a
 * constant where the caller inlines it (the sums stay in registers). */
static inline __attribute__((always_inline)) void coded_key_scores(
    const quantized *q, int64_t row, int64_t h, int64_t kv_heads, int64_t t, const float *qh, const int64_t G,
    int64_t dim, float scale, float scores[][CHUNK], int64_t i) {
    float qs[MAX_GROUP][MAX_DIM] __attribute__((aligned(64))), base[MAX_GROUP];
    const int64_t at = key_group(q, row, h, kv_heads, t, dim);
    for (int64_t g = 0; g < G; g++) {
        float zero = 0.f;
        for (int64_t c = 0; c < dim; c += WIDTH) {
            const vf x = *(const vf *)(qh + g * dim + c) * scale;
            if (q->bits == RAW_BITS) {
                *(vf *)&qs[g][c] = x;
                continue;
            }
            *(vf *)&qs[g][c] = x * *(const vf *)(q->key_scale + at + c);
            /* x . zero: the products rounded, then added in channel order. Written with scalars, whether the
             * compiler fused a product into the sum depended on how -mtune had it vectorize the loop, and the bits
             * with it; a vector's products are never fused into a scalar sum. */
            const vf products = x * *(const vf *)(q->key_zero + at + c);
            for (int i = 0; i < WIDTH; i++) zero += products[i];
        }
        base[g] = zero;
    }
    const int64_t group_bytes = q->group * q->bits / 8;
    const uint8_t *codes = q->key_codes + at * group_bytes;
    for (int64_t j = 0; j < q->group; j += WIDTH) {
        vf acc[MAX_GROUP];
        for (int64_t g = 0; g < G; g++) acc[g] = (vf){} + base[g];
        for (int64_t c = 0; c < dim; c++) {
            const vf x = unpacked(codes + c * group_bytes + j * q->bits / 8, q->bits);
            for (int64_t g = 0; g < G; g++) acc[g] += qs[g][c] * x;
        }
        for (int64_t g = 0; g < G; g++) *(vf *)&scores[g][i + j] = acc[g];
    }
}

static void coded_key_group(const quantized *q, int64_t row, int64_t h, int64_t kv_heads, int64_t t, const float *qh,
                            int64_t group, int64_t dim, float scale, float scores[][CHUNK], int64_t i) {
    switch (group) { /* the query-head groups of common models, unrolled */
    case 1: coded_key_scores(q, row, h, kv_heads, t, qh, 1, dim, scale, scores, i); break;
    case 2: coded_key_scores(q, row, h, kv_heads, t, qh, 2, dim, scale, scores, i); break;
    case 3: coded_key_scores(q, row, h, kv_heads, t, qh, 3, dim, scale, scores, i); break;
    case 4: coded_key_scores(q, row, h, kv_heads, t, qh, 4, dim, scale, scores, i); break;
    case 7: coded_key_scores(q, row, h, kv_heads, t, qh, 7, dim, scale, scores, i); break;
    case 8: coded_key_scores(q, row, h, kv_heads, t, qh, 8, dim, scale, scores, i); break;
    default: coded_key_scores(q, row, h, kv_heads, t, qh, group, dim, scale, scores, i);
    }
}

/* Value t likewise: one scale and zero for each group of value_group channels. */
static inline void dequantized_value(const quantized *q, int64_t row, int64_t h, int64_t kv_heads, int64_t t,
                                     int64_t dim, float *out) {
    const int64_t rh = row * kv_heads + h, step = WIDTH * q->bits / 8, vg = q->value_group;
    const uint8_t *codes = q->value_codes + (rh * q->capacity + t) * q->code_bytes;
    if (q->bits == RAW_BITS) {
        memcpy(out, codes, dim * sizeof(float));
        return;
    }
    const float *scale = q->value_scale + (rh * q->capacity + t) * (dim / vg);
    const float *zero = q->value_zero + (rh * q->capacity + t) * (dim / vg);
    for (int64_t d = 0; d < dim; d += WIDTH, codes += step)
        *(vf *)(out + d) = unpacked(codes, q->bits);
    if (vg % LANES == 0) /* a vector within one group: its scale and zero broadcast */
        for (int64_t d = 0; d < dim; d += WIDTH) *(vf *)(out + d) = *(vf *)(out + d) * scale[d / vg] + zero[d / vg];
    else
        for (int64_t d = 0; d < dim; d++) out[d] = out[d] * scale[d / vg] + zero[d / vg];
}

static int check_quantized(const quantized *q, int64_t batch, int64_t dim) {
    const int64_t bits = q->bits;
    if (!(bits == 2 || bits == 4 || bits == 8 || bits == 16 || bits == RAW_BITS) || q->code_bytes != dim * bits / 8 ||
        q->group < 1 || q->group * bits % 8 || q->capacity < 0 || q->capacity % q->group || q->value_group < 1 ||
        dim % q->value_group || q->n_rows < 0)
        return BAD_QUANTIZED;
    for (int64_t b = 0; b < batch; b++)
        if (q->rows[b] < 0 || q->rows[b] >= q->n_rows || q->keys_quantized[b] < 0 || q->values_quantized[b] < 0 ||
            q->keys_quantized[b] > q->capacity || q->values_quantized[b] > q->capacity ||
            q->keys_quantized[b] % q->group) /* keys are coded in whole groups */
            return BAD_QUANTIZED;
    return OK;
}

/* Token i of a chunk: each of the group's query heads' score against key k, and its value v weighted by them. */
static inline void score(float scores[][CHUNK], int64_t i, const float *qh, const float *k, int64_t group, int64_t dim,
                         float scale) {
    for (int64_t g = 0; g < group; g++) scores[g][i] = dot(qh + g * dim, k, dim) * scale;
}

static inline void add_weighted(float acc[][MAX_DIM], float scores[][CHUNK], int64_t i, const float *v, int64_t group,
                                int64_t dim) {
    for (int64_t g = 0; g < group; g++) {
        const float p = scores[g][i];
        for (int64_t d = 0; d < dim; d += WIDTH) *(vf *)&acc[g][d] += p * *(const vf *)(v + d);
    }
}

/* Every element a (row, head) would read lies in [0, kv_numel): checked block by block, not token by token, in
 * arithmetic that cannot overflow (each factor bounded by kv_numel first, so a huge table entry or offset is refused,
 * never wrapped into range). */
static int check(const layout *l, int64_t batch, int64_t kv_numel, int64_t max_chunks, int64_t probs_width) {
    if (l->head_stride < 0) return OUT_OF_BOUNDS;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t h = 0; h < l->kv_heads; h++) {
            const int64_t n = l->lengths[b * l->kv_heads + h];
            if (n < 0 || (n > 0 && (n - 1) / l->block_size >= l->table_width) || n / CHUNK + (n % CHUNK != 0) > max_chunks ||
                (probs_width >= 0 && n > probs_width))
                return BAD_LENGTH;
            if (n == 0) continue;
            const int64_t *tbl = table_of(l, b, h), offset = l->row_offset[b];
            int64_t base;
            if (offset < 0 || offset > kv_numel || __builtin_mul_overflow(h, l->head_stride, &base) ||
                (base += offset) > kv_numel)
                return OUT_OF_BOUNDS;
            for (int64_t t = 0; t < n; t += l->block_size) {
                const int64_t last = (t + l->block_size < n ? t + l->block_size : n) - 1, entry = tbl[t / l->block_size];
                if (entry < 0 || entry > kv_numel / l->block_size / l->dim || last % l->block_size > kv_numel / l->dim)
                    return OUT_OF_BOUNDS;
                if (slot(l, tbl, base, last) + l->dim > kv_numel) return OUT_OF_BOUNDS;
            }
        }
    return OK;
}

/* q, out: [batch, kv_heads * group, dim]. partial: [batch, kv_heads, max_chunks, group, dim + 2] floats of scratch.
 * Where probs is not NULL it receives, for each (row, KV head), the attention probabilities of its tokens summed over
 * the head's group of queries ([batch, kv_heads, probs_width], zeros past a row's length: what H2O accumulates), with
 * probs_scratch [batch, kv_heads, group, probs_width] floats; probs_width is -1 without them. A row of length 0 reads
 * nothing and gets zeros. quant: NULL, or where rows' oldest tokens are codes (above). Returns OK, or what it refused
 * (then nothing is written). */
int decode_attention(const float *q, const float *k, const float *v, float *out, const int64_t *row_offset,
                     const int64_t *table, int64_t table_row_stride, int64_t table_head_stride, int64_t table_width,
                     const int64_t *lengths, int64_t block_size, int64_t head_stride, int64_t kv_numel, int64_t batch,
                     int64_t kv_heads, int64_t group, int64_t dim, float scale, float *partial, int64_t max_chunks,
                     float *probs, float *probs_scratch, int64_t probs_width, const quantized *quant) {
    if (group < 1 || group > MAX_GROUP || dim < LANES || dim > MAX_DIM || dim % LANES || block_size < 1 ||
        batch < 0 || kv_heads < 1 || table_width < 0 || max_chunks < 0 || (probs != NULL) != (probs_width >= 0) ||
        (probs != NULL && probs_scratch == NULL))
        return BAD_SHAPE;
    const layout l = {row_offset, table, lengths, table_row_stride, table_head_stride, table_width, block_size,
                      head_stride, kv_heads, dim};
    int refused = check(&l, batch, kv_numel, max_chunks, probs_width);
    if (refused == OK && quant != NULL) refused = check_quantized(quant, batch, dim);
    if (refused != OK) return refused;
    const int64_t pairs = batch * kv_heads;
    int64_t *first_job = malloc((pairs + 1) * sizeof(int64_t)); /* the first job of each (row, KV head) */
    if (first_job == NULL) return NO_MEMORY;
    first_job[0] = 0;
    for (int64_t bh = 0; bh < pairs; bh++) first_job[bh + 1] = first_job[bh] + (lengths[bh] + CHUNK - 1) / CHUNK;
    const int64_t jobs = first_job[pairs], part = group * (dim + 2);

#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t job = 0; job < jobs; job++) {
        int64_t lo = 0, hi = pairs; /* the (row, KV head) whose jobs hold this one: first_job[lo] <= job < [lo+1] */
        while (hi - lo > 1) {
            const int64_t mid = (lo + hi) / 2;
            if (first_job[mid] <= job) lo = mid; else hi = mid;
        }
        const int64_t bh = lo, b = bh / kv_heads, h = bh % kv_heads, c = job - first_job[bh];
        const int64_t t0 = c * CHUNK, t1 = t0 + CHUNK < lengths[bh] ? t0 + CHUNK : lengths[bh], n = t1 - t0;
        const float *qh = q + bh * group * dim;
        const int64_t base = row_offset[b] + h * head_stride, *tbl = table_of(&l, b, h);
        float scores[MAX_GROUP][CHUNK] __attribute__((aligned(64)));
        float acc[MAX_GROUP][MAX_DIM] __attribute__((aligned(64)));
        float token[MAX_DIM] __attribute__((aligned(64))); /* a dequantized key or value */
        const int64_t coded_keys = quant != NULL ? quant->keys_quantized[b] : 0;
        const int64_t coded_values = quant != NULL ? quant->values_quantized[b] : 0;

        int64_t t = t0;
        if (quant != NULL && quant->group % LANES == 0 && CHUNK % quant->group == 0) /* t0, coded_keys: whole groups */
            for (; t < t1 && t < coded_keys; t += quant->group)
                coded_key_group(quant, quant->rows[b], h, kv_heads, t, qh, group, dim, scale, scores, t - t0);
        for (; t < t1 && t < coded_keys; t++) {
            dequantized_key(quant, quant->rows[b], h, kv_heads, t, dim, token);
            score(scores, t - t0, qh, token, group, dim, scale);
        }
        while (t < t1) { /* scores, a block's stretch of slots at a time */
            const int64_t off = t % block_size, run = block_size - off < t1 - t ? block_size - off : t1 - t;
            const float *kr = k + slot(&l, tbl, base, t);
            for (int64_t i = 0; i < run; i++, kr += dim) {
                const int64_t ahead = t + i + PREFETCH;
                if (ahead < t1) { /* this token's K and V, PREFETCH tokens ahead: V is read after the chunk's scores */
                    const int64_t at = slot(&l, tbl, base, ahead);
                    for (int64_t d = 0; d < dim; d += 64 / sizeof(float)) {
                        __builtin_prefetch(k + at + d);
                        __builtin_prefetch(v + at + d);
                    }
                }
                score(scores, t - t0 + i, qh, kr, group, dim, scale);
            }
            t += run;
        }
        float *mine = partial + (bh * max_chunks + c) * part;
        const int64_t padded = (n + LANES - 1) / LANES * LANES; /* the exp runs on whole vectors: no lane unset */
        for (int64_t g = 0; g < group; g++) { /* softmax over the chunk, kept unnormalized */
            float m = -INFINITY, s = 0.f;
            for (int64_t i = n; i < padded; i++) scores[g][i] = -INFINITY;
            for (int64_t i = 0; i < n; i++) m = scores[g][i] > m ? scores[g][i] : m;
            for (int64_t i = 0; i < padded; i += WIDTH) *(vf *)&scores[g][i] = vexp(*(vf *)&scores[g][i] - m);
            for (int64_t i = 0; i < n; i++) s += scores[g][i];
            mine[g * (dim + 2)] = m;
            mine[g * (dim + 2) + 1] = s;
            memset(acc[g], 0, dim * sizeof(float));
            if (probs != NULL) memcpy(probs_scratch + (bh * group + g) * probs_width + t0, scores[g], n * sizeof(float));
        }
        for (t = t0; t < t1 && t < coded_values; t++) {
            dequantized_value(quant, quant->rows[b], h, kv_heads, t, dim, token);
            add_weighted(acc, scores, t - t0, token, group, dim);
        }
        while (t < t1) { /* the values, weighted */
            const int64_t off = t % block_size, run = block_size - off < t1 - t ? block_size - off : t1 - t;
            const float *vr = v + slot(&l, tbl, base, t);
            for (int64_t i = 0; i < run; i++, vr += dim) add_weighted(acc, scores, t - t0 + i, vr, group, dim);
            t += run;
        }
        for (int64_t g = 0; g < group; g++) memcpy(mine + g * (dim + 2) + 2, acc[g], dim * sizeof(float));
    }

#pragma omp parallel for
    for (int64_t bh = 0; bh < pairs; bh++) { /* each (row, KV head)'s chunks merged by their softmax max */
        const int64_t chunks = first_job[bh + 1] - first_job[bh];
        const float *parts = partial + bh * max_chunks * part;
        float weight[MAX_GROUP]; /* a chunk's factor from its own exps to probabilities, per query head */
        float top[MAX_GROUP], total[MAX_GROUP];
        for (int64_t g = 0; g < group; g++) {
            float *o = out + (bh * group + g) * dim;
            top[g] = -INFINITY;
            total[g] = 0.f;
            for (int64_t c = 0; c < chunks; c++) top[g] = fmaxf(top[g], parts[c * part + g * (dim + 2)]);
            memset(o, 0, dim * sizeof(float));
            for (int64_t c = 0; c < chunks; c++) {
                const float *p = parts + c * part + g * (dim + 2), w = expf(p[0] - top[g]);
                total[g] += w * p[1];
                for (int64_t d = 0; d < dim; d++) o[d] += w * p[2 + d];
            }
            if (chunks > 0) /* the max's own exp is 1: total >= 1 */
                for (int64_t d = 0; d < dim; d++) o[d] /= total[g];
        }
        if (probs == NULL) continue;
        float *row = probs + bh * probs_width;
        memset(row, 0, probs_width * sizeof(float));
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t t0 = c * CHUNK, t1 = t0 + CHUNK < lengths[bh] ? t0 + CHUNK : lengths[bh];
            for (int64_t g = 0; g < group; g++) weight[g] = expf(parts[c * part + g * (dim + 2)] - top[g]) / total[g];
            for (int64_t g = 0; g < group; g++) {
                const float *e = probs_scratch + (bh * group + g) * probs_width;
                for (int64_t t = t0; t < t1; t++) row[t] += weight[g] * e[t];
            }
        }
    }
    free(first_job);
    return OK;
}
