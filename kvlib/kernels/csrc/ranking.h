/* The total order the selection kernels rank by (quest_select.c, infinigen_select.c): a float score's bits as an
 * integer of the same order, above 32 bits that break ties by position, and the k-th largest of such keys. */
#ifndef KVLIB_RANKING_H
#define KVLIB_RANKING_H
#include <stdint.h>
#include <string.h>

/* A float's bits as an unsigned integer of the same order: negatives flipped below positives, -0 made 0 first. */
static inline uint32_t ordered(float x) {
    uint32_t u;
    x += 0.f; /* -0 + 0 = +0 */
    memcpy(&u, &x, sizeof u);
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}

/* The k-th largest (1 <= k <= n) of n distinct values, a[] reordered (Hoare's quickselect). */
static inline uint64_t kth_largest(uint64_t *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    const int64_t want = k - 1; /* its index in descending order */
    while (lo < hi) {
        const uint64_t pivot = a[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) { /* after: a[lo..j] >= pivot >= a[i..hi], a[j+1..i-1] == pivot */
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) {
                const uint64_t t = a[i];
                a[i++] = a[j];
                a[j--] = t;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return pivot;
    }
    return a[want];
}

#endif
