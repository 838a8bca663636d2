/* Decode attention that reads the paged K/V cache in place (common/engine/native).
 *
 * One query per row, each row attending to positions 0 .. len-1 of its own sequence through its block
 * table (or to the last `window` of them: a sliding-window layer's), its scores soft-capped where the model
 * asks (Gemma 2). The eager path gathers every row's context into a padded copy, widens it to fp32 and calls
 * SDPA: three passes over the context's bytes plus a mask. This reads each K and V row once, where it
 * lies, and accumulates in fp32.
 *
 * Invariant 4 (same inputs, same tokens) needs a row's result never to depend on the other rows: a work
 * item is one (row, query head) pair (one row alone on several threads: its positions for the scores, its
 * dims for V) and reads nothing of other rows; every sum runs in a fixed order that depends only on the row's
 * own length (16 fixed lanes over head_dim, then a fixed tree; positions in order), never on addresses or on
 * how the work is split between threads. Built without -ffast-math for that reason: the compiler may not
 * reassociate a sum. exp, and the soft-cap's tanh built on it, are polynomials in plain C, so that they vectorize
 * without libmvec and give the same bits in every build.
 *
 * Layouts (elements, not bytes):
 *   q     [rows, heads, dim], row stride q_stride, head stride dim
 *   kv    one layer: [slots, 2, kv_heads, dim], contiguous (K then V of a slot side by side)
 *   table [rows, table_stride] block ids; slot of position p = table[p / block] * block + p % block
 *   out   [rows, heads, dim], contiguous
 */
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#define ATTENTION_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ATTENTION_AVX2 1
#endif

#include "bf16.h"
#include "float_math.h"
#include "handoff_native.h"

#ifdef ATTENTION_AVX512
/* sum_lanes of 16 vectors at once, the same additions on the same operands (so the same bits): the pairs
 * of a level sit side by side in one register after a shuffle, so a level is a few vector adds, where one
 * vector at a time was a chain of scalar adds per score. out[p] = sum_lanes(v[p]). */
static inline void sum_lanes16(const __m512 v[16], float out[16]) {
    __m512 l1[8], l2[4], l3[2];
    for (int j = 0; j < 8; j++) /* a_i = l_i + l_(i+8): positions 2j (lanes 0-7), 2j + 1 (8-15) */
        l1[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                              _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xee));
    for (int k = 0; k < 4; k++) /* a_i + a_(i+4): positions 4k .. 4k + 3, one per 128-bit quarter */
        l2[k] = _mm512_add_ps(_mm512_shuffle_f32x4(l1[2 * k], l1[2 * k + 1], 0x88),
                              _mm512_shuffle_f32x4(l1[2 * k], l1[2 * k + 1], 0xdd));
    for (int m = 0; m < 2; m++) /* b0 = a0 + a2, b1 = a1 + a3 */
        l3[m] = _mm512_add_ps(_mm512_shuffle_ps(l2[2 * m], l2[2 * m + 1], 0x44),
                              _mm512_shuffle_ps(l2[2 * m], l2[2 * m + 1], 0xee));
    /* b0 + b1; lane 4q + e holds position 4e + q, put back in order */
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(l3[0], l3[1], 0x88), _mm512_shuffle_ps(l3[0], l3[1], 0xdd));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, s));
}

static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
#define VEC_LOAD_BF16 load16_bf16 /* a register's worth of K or V widened to fp32 */
#define VEC_LOAD_F32 load16_f32
#endif

#ifdef ATTENTION_AVX2
/* sum_lanes of 8 positions at once in 256-bit registers, the same additions on the same operands (so the
 * same bits): v[p] holds position p's a_i = l_i + l_(i+8), i = 0..7 (sum_lanes' first level, one add of
 * its two halves). out[p] = sum_lanes(position p's 16 lanes). */
static inline void sum_lanes8(const __m256 v[8], float out[8]) {
    __m256 l2[4], l3[2];
    for (int j = 0; j < 4; j++) /* a_i + a_(i+4): positions 2j (lanes 0-3), 2j + 1 (4-7) */
        l2[j] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * j], v[2 * j + 1], 0x20),
                              _mm256_permute2f128_ps(v[2 * j], v[2 * j + 1], 0x31));
    for (int k = 0; k < 2; k++) /* b0 = a0 + a2, b1 = a1 + a3: positions 4k, 4k + 2 (low half), 4k + 1, 4k + 3 */
        l3[k] = _mm256_add_ps(_mm256_shuffle_ps(l2[2 * k], l2[2 * k + 1], 0x44),
                              _mm256_shuffle_ps(l2[2 * k], l2[2 * k + 1], 0xee));
    /* b0 + b1: positions 0, 2, 4, 6, 1, 3, 5, 7; put back in order */
    const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(l3[0], l3[1], 0x88), _mm256_shuffle_ps(l3[0], l3[1], 0xdd));
    _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

static inline __m256 load8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
#define VEC_LOAD_BF16 load8_bf16
#define VEC_LOAD_F32 load8_f32
#endif

/* Asks for `bytes` at p to be fetched into the caches: a slot of the next block, while the current block
 * is read. A block's 16 slots are contiguous but blocks lie anywhere, so the hardware prefetcher loses the
 * stream at every block boundary; without this the K and V loads waited on memory for most of a long
 * context's attention. Reads nothing: the sums are the same. */
static inline void prefetch_heads(const void *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)p + b, 0, 3);
}

/* Scores of one block's n positions for query heads hq0 .. hq1 - 1 (q already scaled, fp32): scores[hq *
 * len + i] = q . k, 16 lanes (lane l: dims l, 16 + l, ...; a fused multiply-add each, from zero), then
 * sum_lanes; and each head's running maximum. `next` (the following block, or NULL) is prefetched a
 * few slots at a time. Every version computes the same bits: the AVX-512 one takes 16 positions at once so
 * that sum_lanes16 sums them side by side, the AVX2 one 8 (sum_lanes8). */
#if defined(ATTENTION_AVX512) || defined(ATTENTION_AVX2)
/* The vector versions: SCORE_CHUNK positions at once for a head, their lanes summed side by side
 * (CHUNK_SCORES: sum_lanes16 or sum_lanes8), the loop over dims unrolled at head_dim 64 (SmolLM2's). */
#ifdef ATTENTION_AVX512
#define SCORE_CHUNK 16
#define CHUNK_SCORES(T, VLOAD, DIM)                                                                    \
    {                                                                                                  \
        __m512 lanes[16];                                                                              \
        for (int64_t p = 0; p < 16; p++) {                                                             \
            lanes[p] = _mm512_setzero_ps();                                                            \
            if (p >= m) continue;                                                                      \
            const T *k = slots + (i0 + p) * slot_stride + (hq / group) * (DIM);                        \
            for (int64_t d0 = 0; d0 < (DIM); d0 += LANES)                                              \
                lanes[p] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + hq * (DIM) + d0), VLOAD(k + d0), lanes[p]); \
        }                                                                                              \
        sum_lanes16(lanes, sc);                                                                        \
    }
#else
/* Each position's 16 lanes as two registers (lanes 0-7, 8-15) added into sum_lanes' first level. */
#define SCORE_CHUNK 8
#define CHUNK_SCORES(T, VLOAD, DIM)                                                                    \
    {                                                                                                  \
        __m256 halves[8];                                                                              \
        for (int64_t p = 0; p < 8; p++) {                                                              \
            __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();                                 \
            if (p < m) {                                                                               \
                const T *k = slots + (i0 + p) * slot_stride + (hq / group) * (DIM);                    \
                for (int64_t d0 = 0; d0 < (DIM); d0 += LANES) {                                        \
                    lo = _mm256_fmadd_ps(_mm256_loadu_ps(qf + hq * (DIM) + d0), VLOAD(k + d0), lo);    \
                    hi = _mm256_fmadd_ps(_mm256_loadu_ps(qf + hq * (DIM) + d0 + 8), VLOAD(k + d0 + 8), hi); \
                }                                                                                      \
            }                                                                                          \
            halves[p] = _mm256_add_ps(lo, hi);                                                         \
        }                                                                                              \
        sum_lanes8(halves, sc);                                                                        \
    }
#endif
#define DEFINE_SCORES(NAME, T, LOAD, VLOAD)                                                            \
static inline void NAME(const float *restrict qf, const T *restrict slots, const T *next, int64_t n,   \
                        int64_t slot_stride, int64_t hq0, int64_t hq1, int64_t group, int64_t dim,     \
                        float *restrict scores, int64_t len, float *restrict top) {                    \
    const int64_t h0 = hq0 / group, bytes = ((hq1 - 1) / group + 1 - h0) * dim * (int64_t)sizeof(T);   \
    for (int64_t i0 = 0; i0 < n; i0 += SCORE_CHUNK) {                                                  \
        const int64_t m = n - i0 < SCORE_CHUNK ? n - i0 : SCORE_CHUNK;                                 \
        for (int64_t hq = hq0; hq < hq1; hq++) {                                                       \
            float sc[SCORE_CHUNK];                                                                     \
            if (next) /* the chunk's positions of the next block, spread over the heads */            \
                for (int64_t p = hq - hq0; p < m; p += hq1 - hq0)                                      \
                    prefetch_heads(next + (i0 + p) * slot_stride + h0 * dim, bytes);                   \
            if (dim == 64) {                                                                           \
                CHUNK_SCORES(T, VLOAD, 64)                                                             \
            } else {                                                                                   \
                CHUNK_SCORES(T, VLOAD, dim)                                                            \
            }                                                                                          \
            for (int64_t p = 0; p < m; p++) {                                                          \
                scores[hq * len + i0 + p] = sc[p];                                                     \
                if (sc[p] > top[hq]) top[hq] = sc[p];                                                  \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
}
#else
#define DEFINE_SCORES(NAME, T, LOAD, VLOAD)                                                            \
static inline void NAME(const float *restrict qf, const T *restrict slots, const T *next, int64_t n,   \
                        int64_t slot_stride, int64_t hq0, int64_t hq1, int64_t group, int64_t dim,     \
                        float *restrict scores, int64_t len, float *restrict top) {                    \
    const int64_t h0 = hq0 / group, bytes = ((hq1 - 1) / group + 1 - h0) * dim * (int64_t)sizeof(T);   \
    for (int64_t i = 0; i < n; i++) {                                                                  \
        if (next) prefetch_heads(next + i * slot_stride + h0 * dim, bytes);                            \
        for (int64_t hq = hq0; hq < hq1; hq++) {                                                       \
            const T *k = slots + i * slot_stride + (hq / group) * dim;                                 \
            float lanes[LANES] = {0};                                                                  \
            for (int64_t d0 = 0; d0 < dim; d0 += LANES)                                                \
                for (int l = 0; l < LANES; l++) lanes[l] += qf[hq * dim + d0 + l] * LOAD(k[d0 + l]);   \
            const float sc = sum_lanes(lanes);                                                         \
            scores[hq * len + i] = sc;                                                                 \
            if (sc > top[hq]) top[hq] = sc;                                                            \
        }                                                                                              \
    }                                                                                                  \
}
#endif
DEFINE_SCORES(scores_bf16, uint16_t, bf16_to_f32, VEC_LOAD_BF16)
DEFINE_SCORES(scores_f32, float, LOAD_F32, VEC_LOAD_F32)

/* The weighted sum of V, acc[hq * dim + d] = sum over positions p = first .. len - 1, in order, of
 * w[hq, p - first] * v[p, d], for query heads hq0 .. hq1 - 1. Each term is one fused multiply-add into the running sum, from zero: the same
 * operations as the plain loop below it (which -ffp-contract=fast fuses the same way), so the same bits. At
 * head_dim 64 with AVX-512 the sums stay in registers, V_TILE query heads (4 vectors each) at a time, and a
 * KV head's V row is widened to fp32 once for the query heads of the tile that read it: the plain loop
 * loaded, widened and stored the sums again for every position and query head, most of a long row's time
 * (docs/benchmarks.md, "Figures behind the code": Weighted V in registers). Returns 0, or -1 where the fast
 * path does not apply. */
#define V_TILE 5
#ifdef ATTENTION_AVX512
#define DEFINE_WEIGHTED_V(NAME, T, VLOAD)                                                              \
static inline int NAME(const T *kv, const int64_t *blocks, int64_t block, int64_t slot_stride,          \
                       int64_t kv_heads, int64_t first, int64_t len, int64_t hq0, int64_t hq1, int64_t group, \
                       int64_t dim, const float *scores, float *acc) {                                 \
    if (dim != 64) return -1;                                                                          \
    const int64_t span = len - first;                                                                  \
    for (int64_t t0 = hq0; t0 < hq1; t0 += V_TILE) {                                                   \
        const int64_t nt = hq1 - t0 < V_TILE ? hq1 - t0 : V_TILE;                                      \
        const int64_t h0 = t0 / group, h1 = (t0 + nt - 1) / group + 1;                                 \
        __m512 a[V_TILE][4];                                                                           \
        for (int t = 0; t < V_TILE; t++)                                                               \
            for (int k = 0; k < 4; k++) a[t][k] = _mm512_setzero_ps();                                 \
        for (int64_t p0 = first; p0 < len;) {                                                          \
            const int64_t off = p0 % block, n = len - p0 < block - off ? len - p0 : block - off;       \
            const T *slots = kv + (blocks[p0 / block] * block + off) * slot_stride + kv_heads * dim;   \
            const T *next = p0 + n < len ? kv + blocks[p0 / block + 1] * block * slot_stride + kv_heads * dim \
                                         : NULL;                                                       \
            for (int64_t i = 0; i < n; i++) {                                                          \
                if (next) prefetch_heads(next + i * slot_stride + h0 * dim, (h1 - h0) * dim * (int64_t)sizeof(T)); \
                const T *row = slots + i * slot_stride;                                                \
                const float *w = scores + (p0 - first) + i;                                            \
                int64_t h = -1;                                                                        \
                __m512 v[4];                                                                           \
                for (int t = 0; t < V_TILE; t++) {                                                     \
                    if (t == nt) break;                                                                \
                    const int64_t hq = t0 + t;                                                         \
                    if (hq / group != h) {                                                             \
                        h = hq / group;                                                                \
                        for (int k = 0; k < 4; k++) v[k] = VLOAD(row + h * dim + 16 * k);              \
                    }                                                                                  \
                    const __m512 wt = _mm512_set1_ps(w[hq * span]);                                    \
                    for (int k = 0; k < 4; k++) a[t][k] = _mm512_fmadd_ps(wt, v[k], a[t][k]);         \
                }                                                                                      \
            }                                                                                          \
            p0 += n;                                                                                   \
        }                                                                                              \
        for (int t = 0; t < nt; t++)                                                                   \
            for (int k = 0; k < 4; k++) _mm512_storeu_ps(acc + (t0 + t) * dim + 16 * k, a[t][k]);     \
    }                                                                                                  \
    return 0;                                                                                          \
}
#elif defined(ATTENTION_AVX2)
/* 16 registers: a tile is up to V_TILE2 query heads x half of head_dim (4 registers each), 12 sums; V's
 * loads go straight into the multiply-adds (a KV head's half row is read from L1 once per query head).
 * NAME##_half: dims half .. half + 31 of query heads hq0 .. hq1 - 1 (the one-row split below gives each
 * thread a half); NAME: both halves. */
#define V_TILE2 3
#define DEFINE_WEIGHTED_V(NAME, T, VLOAD)                                                              \
static inline void NAME##_half(const T *kv, const int64_t *blocks, int64_t block, int64_t slot_stride,  \
                               int64_t kv_heads, int64_t first, int64_t len, int64_t hq0, int64_t hq1,  \
                               int64_t group, int64_t dim, const float *scores, float *acc, int64_t half) { \
    const int64_t span = len - first;                                                                  \
    for (int64_t t0 = hq0; t0 < hq1; t0 += V_TILE2) {                                                  \
        const int64_t nt = hq1 - t0 < V_TILE2 ? hq1 - t0 : V_TILE2;                                    \
        const int64_t h0 = t0 / group, h1 = (t0 + nt - 1) / group + 1;                                 \
        __m256 a[V_TILE2][4];                                                                          \
        for (int t = 0; t < V_TILE2; t++)                                                              \
            for (int k = 0; k < 4; k++) a[t][k] = _mm256_setzero_ps();                                 \
        for (int64_t p0 = first; p0 < len;) {                                                          \
            const int64_t off = p0 % block, n = len - p0 < block - off ? len - p0 : block - off;       \
            const T *slots = kv + (blocks[p0 / block] * block + off) * slot_stride + kv_heads * dim;   \
            const T *next = p0 + n < len ? kv + blocks[p0 / block + 1] * block * slot_stride + kv_heads * dim \
                                         : NULL;                                                       \
            for (int64_t i = 0; i < n; i++) {                                                          \
                if (next)                                                                              \
                    for (int64_t h = h0; h < h1; h++)                                                  \
                        prefetch_heads(next + i * slot_stride + h * dim + half, 32 * (int64_t)sizeof(T)); \
                const T *row = slots + i * slot_stride + half;                                         \
                const float *w = scores + (p0 - first) + i;                                            \
                for (int t = 0; t < V_TILE2; t++) {                                                    \
                    if (t == nt) break;                                                                \
                    const int64_t hq = t0 + t;                                                         \
                    const T *v = row + (hq / group) * dim;                                             \
                    const __m256 wt = _mm256_set1_ps(w[hq * span]);                                    \
                    for (int k = 0; k < 4; k++) a[t][k] = _mm256_fmadd_ps(wt, VLOAD(v + 8 * k), a[t][k]); \
                }                                                                                      \
            }                                                                                          \
            p0 += n;                                                                                   \
        }                                                                                              \
        for (int t = 0; t < nt; t++)                                                                   \
            for (int k = 0; k < 4; k++) _mm256_storeu_ps(acc + (t0 + t) * dim + half + 8 * k, a[t][k]); \
    }                                                                                                  \
}                                                                                                      \
static inline int NAME(const T *kv, const int64_t *blocks, int64_t block, int64_t slot_stride,          \
                       int64_t kv_heads, int64_t first, int64_t len, int64_t hq0, int64_t hq1, int64_t group, \
                       int64_t dim, const float *scores, float *acc) {                                 \
    if (dim != 64) return -1;                                                                          \
    for (int64_t half = 0; half < dim; half += 32)                                                     \
        NAME##_half(kv, blocks, block, slot_stride, kv_heads, first, len, hq0, hq1, group, dim, scores, acc, \
                    half);                                                                             \
    return 0;                                                                                          \
}
#define V_SPLIT_DIMS 32 /* the one-row split's dims a part: NAME##_half's */
#else
#define DEFINE_WEIGHTED_V(NAME, T, VLOAD)                                                              \
static inline int NAME(const T *kv, const int64_t *blocks, int64_t block, int64_t slot_stride,          \
                       int64_t kv_heads, int64_t first, int64_t len, int64_t hq0, int64_t hq1, int64_t group, \
                       int64_t dim, const float *scores, float *acc) {                                 \
    (void)kv, (void)blocks, (void)block, (void)slot_stride, (void)kv_heads, (void)first, (void)len, (void)hq0, \
        (void)hq1, (void)group, (void)dim, (void)scores, (void)acc;                                    \
    return -1;                                                                                         \
}
#endif
DEFINE_WEIGHTED_V(weighted_v_bf16, uint16_t, VEC_LOAD_BF16)
DEFINE_WEIGHTED_V(weighted_v_f32, float, VEC_LOAD_F32)

/* A row's window: its positions first .. len - 1 (window 0: all of them). */
static inline int64_t window_first(int64_t len, int64_t window) { return window > 0 && len > window ? len - window : 0; }

/* Soft-capped scores, tanh(s / cap) * cap (Gemma 2), of sg[0 .. n - 1] in place; returns their maximum. The
 * maximum is taken after the cap (tanh_portable is monotonic only up to its rounding). */
static inline float soft_cap(float *sg, int64_t n, float cap) {
    for (int64_t p = 0; p < n; p++) sg[p] = tanh_portable(sg[p] / cap) * cap;
    float top = -INFINITY;
    for (int64_t p = 0; p < n; p++) top = sg[p] > top ? sg[p] : top;
    return top;
}

/* The (row, query head) items item_begin .. item_end - 1, a row's heads together: per position the slot's K
 * (then V) of the KV heads they read is one contiguous read (one head at a time read 256 of every 1,536 bytes
 * and waited on memory: docs/benchmarks.md, "Figures behind the code": Attention reads a row's heads
 * together). The next block is prefetched while one is read, for scores and for V alike. Pointers are
 * restrict: with an fp32 cache the score stores could otherwise alias the K/V loads. A row's positions (its
 * window's: first .. len - 1) are walked block by block, in order, the first block from the window's start;
 * each (row, head)'s sums are the same operations in the same order as alone. Items are query heads, not KV
 * heads, so that one row's 9 heads split 4 / 5 between two threads (by its 3 KV heads the split was 1 / 2); a
 * KV head whose query heads land on both threads is read by both. */
#define DEFINE_ATTENTION_ITEMS(NAME, T, LOAD, STORE, SCORES, WEIGHTED_V)                                \
static int NAME(const T *restrict q, int64_t q_stride, const T *restrict kv, const int64_t *restrict table, \
                int64_t table_stride, const int64_t *restrict lens, int64_t block, int64_t heads,      \
                int64_t kv_heads, int64_t dim, float scale, int64_t window, float softcap, T *restrict out, \
                int64_t item_begin, int64_t item_end, float *restrict scores, float *restrict qf) {    \
    const int64_t group = heads / kv_heads, slot_stride = 2 * kv_heads * dim;                          \
    float *restrict acc = qf + heads * dim, top[MAX_HEADS], inv[MAX_HEADS];                            \
    for (int64_t it = item_begin; it < item_end;) {                                                    \
        const int64_t row = it / heads, hq0 = it % heads; /* query heads hq0 .. hq1 - 1 of the row */  \
        const int64_t hq1 = item_end - row * heads < heads ? item_end - row * heads : heads;           \
        it = row * heads + hq1;                                                                        \
        const int64_t len = lens[row], first = window_first(len, window), span = len - first;          \
        const int64_t h0 = hq0 / group, h1 = (hq1 - 1) / group + 1; /* their KV heads */               \
        const int64_t *restrict blocks = table + row * table_stride;                                   \
        for (int64_t hq = hq0; hq < hq1; hq++) {                                                       \
            const T *qh = q + row * q_stride + hq * dim;                                               \
            for (int64_t d = 0; d < dim; d++) qf[hq * dim + d] = LOAD(qh[d]) * scale;                  \
            top[hq] = -INFINITY;                                                                       \
        }                                                                                              \
        for (int64_t p0 = first; p0 < len;) { /* scores: q . k of every position */                   \
            const int64_t off = p0 % block, n = len - p0 < block - off ? len - p0 : block - off;       \
            const T *slots = kv + (blocks[p0 / block] * block + off) * slot_stride;                    \
            const T *next = p0 + n < len ? kv + blocks[p0 / block + 1] * block * slot_stride : NULL;   \
            SCORES(qf, slots, next, n, slot_stride, hq0, hq1, group, dim, scores + (p0 - first), span, top); \
            p0 += n;                                                                                   \
        }                                                                                              \
        if (softcap > 0.0f)                                                                            \
            for (int64_t hq = hq0; hq < hq1; hq++) top[hq] = soft_cap(scores + hq * span, span, softcap); \
        for (int64_t hq = hq0; hq < hq1; hq++) { /* softmax weights */                                 \
            float *sg = scores + hq * span;                                                            \
            const float t = top[hq];                                                                   \
            for (int64_t p = 0; p < span; p++) sg[p] = exp_nonpositive(sg[p] - t);                     \
        }                                                                                              \
        /* each head's total, positions in order; the heads side by side, so that their chains of      \
         * dependent additions overlap (one after the other, 4 positions' cycles each) */              \
        float total[MAX_HEADS];                                                                        \
        for (int64_t hq = hq0; hq < hq1; hq++) total[hq] = 0.0f;                                       \
        for (int64_t p = 0; p < span; p++)                                                             \
            for (int64_t hq = hq0; hq < hq1; hq++) total[hq] += scores[hq * span + p];                 \
        for (int64_t hq = hq0; hq < hq1; hq++) inv[hq] = total[hq] > 0.0f ? 1.0f / total[hq] : 0.0f;   \
        if (!WEIGHTED_V(kv, blocks, block, slot_stride, kv_heads, first, len, hq0, hq1, group, dim, scores, acc)) \
            goto normalize;                                                                            \
        memset(acc + hq0 * dim, 0, sizeof(float) * (size_t)((hq1 - hq0) * dim));                      \
        for (int64_t p0 = first; p0 < len;) { /* the weighted sum of V, positions in order */         \
            const int64_t off = p0 % block, n = len - p0 < block - off ? len - p0 : block - off;       \
            const T *slots = kv + (blocks[p0 / block] * block + off) * slot_stride + kv_heads * dim;   \
            const T *next = p0 + n < len ? kv + blocks[p0 / block + 1] * block * slot_stride + kv_heads * dim \
                                         : NULL;                                                       \
            for (int64_t i = 0; i < n; i++) {                                                          \
                if (next) prefetch_heads(next + i * slot_stride + h0 * dim, (h1 - h0) * dim * (int64_t)sizeof(T)); \
                for (int64_t hq = hq0; hq < hq1; hq++) {                                               \
                    const T *v = slots + i * slot_stride + (hq / group) * dim;                         \
                    const float w = scores[hq * span + (p0 - first) + i];                              \
                    for (int64_t d = 0; d < dim; d++) acc[hq * dim + d] += w * LOAD(v[d]);             \
                }                                                                                      \
            }                                                                                          \
            p0 += n;                                                                                   \
        }                                                                                              \
    normalize:                                                                                         \
        for (int64_t hq = hq0; hq < hq1; hq++) {                                                       \
            T *o = out + (row * heads + hq) * dim;                                                     \
            for (int64_t d = 0; d < dim; d++) o[d] = STORE(acc[hq * dim + d] * inv[hq]);               \
        }                                                                                              \
    }                                                                                                  \
    return 0;                                                                                          \
}

/* One row on `threads` threads (decode at one stream), with the bits attention_items gives it alone. A
 * position's score and its exp depend on no other position, so the threads split the positions, by blocks:
 * each reads the K of every KV head of its positions (whole lines, none read twice; split by query heads,
 * a row's 9 went 4 / 5 and the KV head between them was read by both). The running maximum is combined in
 * position order (the first of equal maxima, as one thread scans). The sums over positions keep their
 * order: every thread adds each head's softmax total position by position, and the weighted V is split by
 * dims, each thread summing every position into its own V_SPLIT_DIMS dims of every head. Two barriers; the
 * AVX-512 build keeps the split by query heads (ROW_SPLIT 0). */
/* Below this many positions the split by query heads is as fast (two barriers cost what the balance saves:
 * docs/benchmarks.md, "Figures behind the code": One row's attention split by positions). */
#define ROW_SPLIT_MIN 128
#if defined(ATTENTION_AVX512)
#define ROW_SPLIT 0
#define V_SPLIT_DIMS 16
#define DEFINE_ATTENTION_ROW(NAME, T, LOAD, STORE, SCORES, WEIGHTED_V)                                  \
static int NAME(const T *q, const T *kv, const int64_t *blocks, int64_t first, int64_t len, int64_t block, \
                int64_t heads, int64_t kv_heads, int64_t dim, float scale, float softcap, T *out,      \
                int64_t threads) {                                                                     \
    (void)q, (void)kv, (void)blocks, (void)first, (void)len, (void)block, (void)heads, (void)kv_heads, (void)dim, \
        (void)scale, (void)softcap, (void)out, (void)threads;                                          \
    return -1;                                                                                         \
}
#else
#define ROW_SPLIT 1
#ifndef V_SPLIT_DIMS
#define V_SPLIT_DIMS 8
#define V_HALF(WEIGHTED_V, ...) (-1) /* no vector V: the plain loop */
#else
#define V_HALF(WEIGHTED_V, ...) (WEIGHTED_V##_half(__VA_ARGS__), 0)
#endif
#define DEFINE_ATTENTION_ROW(NAME, T, LOAD, STORE, SCORES, WEIGHTED_V)                                  \
static int NAME(const T *restrict q, const T *restrict kv, const int64_t *restrict blocks, int64_t first, \
                int64_t len, int64_t block, int64_t heads, int64_t kv_heads, int64_t dim, float scale, \
                float softcap, T *restrict out, int64_t threads) {                                     \
    const int64_t group = heads / kv_heads, slot_stride = 2 * kv_heads * dim, span = len - first;      \
    const int64_t b_first = first / block, nblocks = (len + block - 1) / block - b_first;             \
    const int64_t v_parts = dim / V_SPLIT_DIMS;                                                        \
    float *scores = malloc(sizeof(float) * (size_t)(heads * (span ? span : 1)));                       \
    float *qf = malloc(sizeof(float) * (size_t)(2 * heads * dim + threads * heads));                   \
    if (!scores || !qf) {                                                                              \
        free(scores);                                                                                  \
        free(qf);                                                                                      \
        return -ENOMEM;                                                                                \
    }                                                                                                  \
    float *acc = qf + heads * dim, *tops = acc + heads * dim;                                          \
    for (int64_t hq = 0; hq < heads; hq++)                                                             \
        for (int64_t d = 0; d < dim; d++) qf[hq * dim + d] = LOAD(q[hq * dim + d]) * scale;            \
    _Pragma("omp parallel num_threads((int)threads)")                                                  \
    {                                                                                                  \
        const int64_t me = omp_get_thread_num(), team = omp_get_num_threads();                        \
        const int64_t b0 = b_first + nblocks * me / team, b1 = b_first + nblocks * (me + 1) / team;    \
        const int64_t pa = b0 * block > first ? b0 * block : first, pb = b1 * block < len ? b1 * block : len; \
        float *top = tops + me * heads, t[MAX_HEADS], inv[MAX_HEADS], total[MAX_HEADS];                \
        for (int64_t hq = 0; hq < heads; hq++) top[hq] = -INFINITY;                                    \
        for (int64_t bi = b0; bi < b1; bi++) { /* scores of this thread's blocks, every head */       \
            const int64_t p0 = bi * block > first ? bi * block : first;                               \
            const int64_t n = ((bi + 1) * block < len ? (bi + 1) * block : len) - p0;                 \
            const T *next = bi + 1 < b1 ? kv + blocks[bi + 1] * block * slot_stride : NULL;            \
            SCORES(qf, kv + (blocks[bi] * block + p0 - bi * block) * slot_stride, next, n, slot_stride, 0, heads, \
                   group, dim, scores + (p0 - first), span, top);                                      \
        }                                                                                              \
        if (softcap > 0.0f)                                                                            \
            for (int64_t hq = 0; hq < heads; hq++)                                                     \
                top[hq] = pa < pb ? soft_cap(scores + hq * span + (pa - first), pb - pa, softcap) : -INFINITY; \
        _Pragma("omp barrier")                                                                         \
        for (int64_t hq = 0; hq < heads; hq++) { /* the maximum, parts in position order */           \
            t[hq] = -INFINITY;                                                                         \
            for (int64_t th = 0; th < team; th++)                                                      \
                if (tops[th * heads + hq] > t[hq]) t[hq] = tops[th * heads + hq];                      \
            float *sg = scores + hq * span;                                                            \
            const float th_max = t[hq];                                                                \
            for (int64_t p = pa - first; p < pb - first; p++) sg[p] = exp_nonpositive(sg[p] - th_max); \
        }                                                                                              \
        _Pragma("omp barrier")                                                                         \
        for (int64_t hq = 0; hq < heads; hq++) total[hq] = 0.0f;                                       \
        for (int64_t p = 0; p < span; p++) /* each head's total, positions in order */                \
            for (int64_t hq = 0; hq < heads; hq++) total[hq] += scores[hq * span + p];                 \
        for (int64_t hq = 0; hq < heads; hq++) inv[hq] = total[hq] > 0.0f ? 1.0f / total[hq] : 0.0f;   \
        for (int64_t vp = me; vp < v_parts; vp += team) {                                              \
            const int64_t d0 = vp * V_SPLIT_DIMS, d1 = d0 + V_SPLIT_DIMS;                              \
            if (dim != 64 || V_HALF(WEIGHTED_V, kv, blocks, block, slot_stride, kv_heads, first, len, 0, heads, \
                                    group, dim, scores, acc, d0)) {                                    \
                for (int64_t hq = 0; hq < heads; hq++)                                                 \
                    for (int64_t d = d0; d < d1; d++) acc[hq * dim + d] = 0.0f;                        \
                for (int64_t p = first; p < len; p++) { /* the weighted sum of V, positions in order */ \
                    const T *slot = kv + (blocks[p / block] * block + p % block) * slot_stride + kv_heads * dim; \
                    for (int64_t hq = 0; hq < heads; hq++) {                                           \
                        const T *v = slot + (hq / group) * dim;                                        \
                        const float w = scores[hq * span + (p - first)];                               \
                        for (int64_t d = d0; d < d1; d++) acc[hq * dim + d] += w * LOAD(v[d]);         \
                    }                                                                                  \
                }                                                                                      \
            }                                                                                          \
            for (int64_t hq = 0; hq < heads; hq++)                                                     \
                for (int64_t d = d0; d < d1; d++) out[hq * dim + d] = STORE(acc[hq * dim + d] * inv[hq]); \
        }                                                                                              \
    }                                                                                                  \
    free(scores);                                                                                      \
    free(qf);                                                                                          \
    return 0;                                                                                          \
}
#endif

/* All rows x query heads; split between `threads` threads of an OpenMP team (torch's, as the matmuls') when
 * there is enough work (one row: ROW, above, where the build has it). Which thread computes an item never
 * changes its bits. A row's cost is its window's positions. */
#define DEFINE_ATTENTION(NAME, ITEMS, ROW, T)                                                          \
int NAME(const T *q, int64_t q_stride, const T *kv, const int64_t *table, int64_t table_stride,        \
         const int64_t *lens, int64_t block, int64_t heads, int64_t kv_heads, int64_t dim, float scale, \
         int64_t window, float softcap, T *out, int64_t rows, int64_t threads) {                       \
    if (heads % kv_heads || heads / kv_heads > MAX_HEADS_PER_KV || heads > MAX_HEADS || dim % LANES || dim > MAX_HEAD_DIM \
        || block <= 0 || window < 0 || !(softcap >= 0.0f))                                            \
        return -1;                                                                                     \
    const int64_t items = rows * heads, group = heads / kv_heads;                                      \
    if (threads > items) threads = items;                                                              \
    if (ROW_SPLIT && threads > 1 && rows == 1 && lens[0] - window_first(lens[0], window) >= ROW_SPLIT_MIN \
        && dim % V_SPLIT_DIMS == 0)                                                                    \
        return ROW(q, kv, table, window_first(lens[0], window), lens[0], block, heads, kv_heads, dim, scale, \
                   softcap, out, threads);                                                             \
    int64_t longest = 1; /* the longest span */                                                        \
    for (int64_t r = 0; r < rows; r++) {                                                               \
        const int64_t span = lens[r] - window_first(lens[r], window);                                  \
        longest = span > longest ? span : longest;                                                     \
    }                                                                                                  \
    if (threads <= 1) {                                                                                \
        float *scores = malloc(sizeof(float) * (size_t)(heads * longest));                             \
        float *qf = malloc(sizeof(float) * (size_t)(2 * heads * dim));                                 \
        const int err = scores && qf ? ITEMS(q, q_stride, kv, table, table_stride, lens, block, heads, kv_heads, \
                                             dim, scale, window, softcap, out, 0, items, scores, qf) : -ENOMEM; \
        free(scores);                                                                                  \
        free(qf);                                                                                      \
        return err;                                                                                    \
    }                                                                                                  \
    /* Units handed out one at a time, the dearest first: a batch mixes contexts, and split by item ranges \
     * a thread holding a long row did all of it while the other idled. A unit is a whole row (its query   \
     * heads share each K and V line), or one KV head's query heads of a row longer than half a thread's   \
     * share of all the positions. A unit's bits do not depend on which thread takes it, or when. */      \
    int64_t total = 0;                                                                                 \
    int64_t *cost = malloc(sizeof(int64_t) * (size_t)rows); /* each row's span */                      \
    int64_t *unit = malloc(sizeof(int64_t) * (size_t)(2 * rows * kv_heads)), n_units = 0;             \
    if (!unit || !cost) {                                                                              \
        free(unit);                                                                                    \
        free(cost);                                                                                    \
        return -ENOMEM;                                                                                \
    }                                                                                                  \
    for (int64_t r = 0; r < rows; r++) {                                                               \
        cost[r] = lens[r] - window_first(lens[r], window);                                             \
        total += cost[r];                                                                              \
    }                                                                                                  \
    for (int64_t r = 0; r < rows; r++) { /* unit u: its first item, its item count; by cost, an insertion sort */ \
        const int64_t split = 2 * threads * cost[r] > total, count = split ? kv_heads : 1;             \
        for (int64_t k = 0; k < count; k++) {                                                          \
            const int64_t first = r * heads + k * (split ? group : 0), n = split ? group : heads;      \
            int64_t i = n_units++;                                                                     \
            for (; i > 0 && cost[unit[2 * (i - 1)] / heads] * unit[2 * (i - 1) + 1] < cost[r] * n; i--) { \
                unit[2 * i] = unit[2 * (i - 1)];                                                       \
                unit[2 * i + 1] = unit[2 * (i - 1) + 1];                                               \
            }                                                                                          \
            unit[2 * i] = first;                                                                       \
            unit[2 * i + 1] = n;                                                                       \
        }                                                                                              \
    }                                                                                                  \
    _Atomic int64_t next = 0;                                                                          \
    int err = 0;                                                                                       \
    _Pragma("omp parallel num_threads((int)threads) reduction(| : err)")                               \
    {                                                                                                  \
        float *scores = malloc(sizeof(float) * (size_t)(heads * longest));                             \
        float *qf = malloc(sizeof(float) * (size_t)(2 * heads * dim));                                 \
        if (!scores || !qf) err = -ENOMEM;                                                             \
        while (!err) {                                                                                 \
            const int64_t u = atomic_fetch_add(&next, 1);                                              \
            if (u >= n_units) break;                                                                   \
            err |= ITEMS(q, q_stride, kv, table, table_stride, lens, block, heads, kv_heads, dim, scale, window, \
                         softcap, out, unit[2 * u], unit[2 * u] + unit[2 * u + 1], scores, qf);        \
        }                                                                                              \
        free(scores);                                                                                  \
        free(qf);                                                                                      \
    }                                                                                                  \
    free(unit);                                                                                        \
    free(cost);                                                                                        \
    return err;                                                                                        \
}

DEFINE_ATTENTION_ITEMS(attention_items_bf16, uint16_t, bf16_to_f32, f32_to_bf16, scores_bf16, weighted_v_bf16)
DEFINE_ATTENTION_ITEMS(attention_items_f32, float, LOAD_F32, STORE_F32, scores_f32, weighted_v_f32)
DEFINE_ATTENTION_ROW(attention_row_bf16, uint16_t, bf16_to_f32, f32_to_bf16, scores_bf16, weighted_v_bf16)
DEFINE_ATTENTION_ROW(attention_row_f32, float, LOAD_F32, STORE_F32, scores_f32, weighted_v_f32)
DEFINE_ATTENTION(decode_attention_bf16, attention_items_bf16, attention_row_bf16, uint16_t)
DEFINE_ATTENTION(decode_attention_f32, attention_items_f32, attention_row_f32, float)
