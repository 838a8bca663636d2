/* The decode step's logits after the LM head (common/engine/native, Llama.decode_logits, Sampler):
 *
 *   refine_top: the int8 head's logits are approximate; each row's k best are recomputed exactly in fp32
 *               from the fp32 head and the row's hidden state (what torch's topk + gather + product + sum +
 *               scatter did, slower);
 *   argmax:     greedy's token, the first of the row's largest logits (what torch's max(dim) did, slower).
 * (docs/benchmarks.md, "Figures behind the code": Top-k refinement and argmax in C.)
 *
 * Invariant 4 (same inputs, same tokens): each row alone, its operations fixed by its own values. The k
 * best are chosen by a total order (NaN above everything, -0 equal to +0, ties to the lower token id), so the
 * set never depends on the scan's vector width; an exact logit is one dot product with 8 lanes (lane l:
 * inputs l, l + 8, ... by fused multiply-adds in order) and a fixed tree over the lanes: the AVX2 and plain C
 * builds give the same bits.
 */
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LOGITS_AVX2 1
#endif

#include "handoff_native.h"

typedef struct {
    int32_t key; /* order_key of the logit */
    int32_t id;  /* its token id */
} cand_t;

/* A float's place in the total order as an int32: NaN highest, then +inf .. -inf, -0 as +0. */
static inline int32_t order_key(float v) {
    if (isnan(v)) return INT32_MAX;
    if (v == 0.0f) return 0;
    int32_t i;
    memcpy(&i, &v, sizeof i);
    return i >= 0 ? i : i ^ 0x7fffffff; /* negatives: larger magnitude, smaller key */
}

/* a ranks below b: a smaller key, or the same key and a later token id. */
static inline int below(cand_t a, cand_t b) { return a.key < b.key || (a.key == b.key && a.id > b.id); }

/* The heap's root is its lowest-ranked candidate; restore that from slot i down. */
static void sift_down(cand_t *heap, int64_t k, int64_t i) {
    for (;;) {
        int64_t low = i;
        const int64_t l = 2 * i + 1, r = l + 1;
        if (l < k && below(heap[l], heap[low])) low = l;
        if (r < k && below(heap[r], heap[low])) low = r;
        if (low == i) return;
        const cand_t t = heap[i];
        heap[i] = heap[low];
        heap[low] = t;
        i = low;
    }
}

static inline void offer(cand_t *heap, int64_t k, const float *row, int64_t id) {
    const cand_t c = {order_key(row[id]), (int32_t)id};
    if (c.key > heap[0].key) { /* a later id with an equal key ranks below the root */
        heap[0] = c;
        sift_down(heap, k, 0);
    }
}

/* The k highest-ranked of row [vocab] into heap [k] (in heap order). */
static void top_k(const float *row, int64_t vocab, int64_t k, cand_t *heap) {
    for (int64_t i = 0; i < k; i++) heap[i] = (cand_t){order_key(row[i]), (int32_t)i};
    for (int64_t i = k / 2 - 1; i >= 0; i--) sift_down(heap, k, i);
    int64_t i = k;
#ifdef LOGITS_AVX2
    /* 8 at a time, only those above the root's value (or NaN) go to `offer`: the same offers in the same
     * order as the plain loop, since a value at or below the root (as floats) never ranks above it. */
    for (; i + 8 <= vocab; i += 8) {
        if (heap[0].key == INT32_MAX) return; /* k NaNs: nothing ranks above */
        float root;
        if (heap[0].key >= 0) memcpy(&root, &heap[0].key, sizeof root);
        else {
            const int32_t bits = heap[0].key ^ 0x7fffffff;
            memcpy(&root, &bits, sizeof root);
        }
        unsigned mask = (unsigned)_mm256_movemask_ps(
            _mm256_cmp_ps(_mm256_loadu_ps(row + i), _mm256_set1_ps(root), _CMP_NLE_UQ)); /* > root, or NaN */
        while (mask) {
            offer(heap, k, row, i + __builtin_ctz(mask));
            mask &= mask - 1;
        }
    }
#endif
    for (; i < vocab; i++) offer(heap, k, row, i);
}

/* sum over i of a[i] * b[i], dim a multiple of 8: 8 lanes of fused multiply-adds, then a fixed tree. */
static float dot8(const float *a, const float *b, int64_t dim) {
    float l[8];
#ifdef LOGITS_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < dim; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    _mm256_storeu_ps(l, acc);
#else
    for (int j = 0; j < 8; j++) l[j] = 0.0f;
    for (int64_t i = 0; i < dim; i += 8)
        for (int j = 0; j < 8; j++) l[j] = fmaf(a[i + j], b[i + j], l[j]);
#endif
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* logits [rows, vocab] fp32, in place: each row's k highest-ranked entries become hidden[row] . head[id],
 * hidden [rows, dim] and head [vocab, dim] fp32 contiguous. Returns 0, or -EINVAL. */
int refine_top(float *logits, int64_t rows, int64_t vocab, const float *hidden, const float *head, int64_t dim,
               int64_t k, int64_t threads) {
    if (rows < 0 || vocab <= 0 || vocab > INT32_MAX || k <= 0 || k > vocab || k > REFINE_MAX || dim <= 0
        || dim % REFINE_LANES)
        return -EINVAL;
#pragma omp parallel for num_threads((int)threads) if (threads > 1 && rows > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        cand_t heap[REFINE_MAX];
        float *row = logits + r * vocab;
        top_k(row, vocab, k, heap);
        for (int64_t c = 0; c < k; c++) {
            const int64_t id = heap[c].id;
            __builtin_prefetch(head + (c + 1 < k ? heap[c + 1].id : id) * dim);
            row[id] = dot8(hidden + r * dim, head + id * dim, dim);
        }
    }
    return 0;
}

/* out[r] = the first index of row r's largest value (a NaN counts as the largest), x [rows, cols] fp32
 * contiguous: torch's max(dim=-1).indices. */
int argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out, int64_t threads) {
    if (rows < 0 || cols <= 0) return -EINVAL;
#pragma omp parallel for num_threads((int)threads) if (threads > 1 && rows > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        /* The largest value first (exact, whatever the order), then its first index. */
        float top = row[0];
        int nan = 0;
        int64_t i = 0;
#ifdef LOGITS_AVX2
        __m256 vtop = _mm256_set1_ps(row[0]), vnan = _mm256_setzero_ps();
        for (; i + 8 <= cols; i += 8) {
            const __m256 v = _mm256_loadu_ps(row + i);
            vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            vtop = _mm256_max_ps(vtop, v);
        }
        float tops[8];
        _mm256_storeu_ps(tops, vtop);
        for (int j = 0; j < 8; j++) top = tops[j] > top ? tops[j] : top;
        nan = _mm256_movemask_ps(vnan) != 0;
#endif
        for (; i < cols; i++) {
            nan |= isnan(row[i]) != 0;
            top = row[i] > top ? row[i] : top;
        }
        int64_t at = 0;
        if (nan) {
            while (!isnan(row[at])) at++;
        } else {
            while (!(row[at] == top)) at++;
        }
        out[r] = at;
    }
    return 0;
}
