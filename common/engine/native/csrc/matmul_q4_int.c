/* The integer Q4 kernel (q4_matmul), on the quads layout (matmul.h).
 *
 * The products are integer, as llama.cpp's are: each activation row is quantized per block of 32 inputs to
 * 16-bit integers (x ~ xq * sx, |xq| <= 32767: 15 bits of the block's largest value, where bf16 keeps 8 of
 * each element), multiplied with the weights' integer codes by vpmaddwd and summed exactly in int32; only
 * then is a block's sum scaled (d * sx) and accumulated in fp32. Q4_1's offset m enters through the block's
 * exact fp32 sum of x: sum_b m_b * sum(x_b). Why not torch's int4 kernel: it takes bf16 activations, rounds
 * the file's fp16 scales to bf16, and costs many times one row's time at 32 rows (docs/benchmarks.md,
 * "Figures behind the code": Integer kernel against torch's int4 kernel); its int8 counterpart
 * (torch._int_mm) has no fast path on AVX2-only hosts. (The q8 head, whose codes share one scale an output,
 * quantizes a row whole instead: matmul_q8_head.c.)
 *
 * Invariant 4 (same inputs, same tokens) needs a row's result never to depend on the other rows: a row
 * is quantized alone, and every (row, output) pair runs the same operations in the same order whatever the
 * batch, the tiling or the thread: per block an exact integer sum into 8 lanes (lane l: inputs 2l, 2l + 1,
 * 16 + 2l, 17 + 2l), then one fused multiply-add per lane, blocks in order; then a fixed tree over the lanes,
 * and the offset term's blocks in order. The AVX2 path and the portable C path compute the same bits; built
 * without -ffast-math so the compiler keeps that order.
 */
#include "matmul.h"

/* One row of x, [in] fp32 or bf16 -> xq (|xq| <= limit), and per block sx and sum(x); the int8 digit kernels'
 * too (matmul.h). Each row alone: its quantization never depends on the other rows. A block's sum has one
 * fixed order, the one 8-lane vectors give: lane l adds inputs l, 8 + l, 16 + l and 24 + l in turn, then
 * sum8's tree over the lanes. */
void quantize_row(const void *x, int x_bf16, int64_t in, float limit, int16_t *xq, float *sx, float *sumx) {
    for (int64_t b = 0; b < in / GROUP; b++) {
        float lanes[8], amax = 0.0f;
#ifdef MATMUL_AVX2
        __m256 v[4], sum = _mm256_setzero_ps(), top = _mm256_setzero_ps();
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        for (int c = 0; c < 4; c++) {
            const int64_t k = b * GROUP + 8 * c;
            v[c] = x_bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
                                _mm_loadu_si128((const __m128i *)((const uint16_t *)x + k))), 16))
                          : _mm256_loadu_ps((const float *)x + k);
            sum = c ? _mm256_add_ps(sum, v[c]) : v[c];
            top = _mm256_max_ps(_mm256_and_ps(v[c], abs_mask), top); /* a NaN is passed over, as below */
        }
        _mm256_storeu_ps(lanes, sum);
        float tops[8];
        _mm256_storeu_ps(tops, top);
        for (int l = 0; l < 8; l++) amax = tops[l] > amax ? tops[l] : amax;
#else
        float v[GROUP];
        for (int i = 0; i < GROUP; i++) {
            const int64_t k = b * GROUP + i;
            v[i] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
            const float a = fabsf(v[i]);
            if (a > amax) amax = a;
        }
        for (int l = 0; l < 8; l++) lanes[l] = ((v[l] + v[8 + l]) + v[16 + l]) + v[24 + l];
#endif
        const float sum_x = sum8(lanes);
        /* A NaN or an infinity in the block makes its scale NaN, so that every output it reaches is NaN,
         * as a float product's would be, instead of a quantized zero hiding it. (With a finite sum every
         * element is finite, so the largest |x| above never met a NaN.) */
        const float s = isfinite(sum_x) ? amax / limit : NAN;
        sx[b] = s;
        sumx[b] = sum_x;
        int16_t *q = xq + b * GROUP;
        if (!(s > 0.0f)) { /* all zeros, or not finite */
            memset(q, 0, GROUP * sizeof *q);
            continue;
        }
#ifdef MATMUL_AVX2
        const __m256 vs = _mm256_set1_ps(s), hi = _mm256_set1_ps(limit), lo = _mm256_set1_ps(-limit);
        __m256i n[4];
        for (int c = 0; c < 4; c++) /* the same IEEE division and round-to-nearest-even as rintf(v / s) */
            n[c] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(
                _mm256_round_ps(_mm256_div_ps(v[c], vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi));
        for (int c = 0; c < 4; c += 2) /* packs interleaves 128-bit halves; the permute puts them back */
            _mm256_storeu_si256((__m256i *)(q + 8 * c),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(n[c], n[c + 1]), 0xd8));
#else
        for (int i = 0; i < GROUP; i++) {
            const float r = rintf(v[i] / s); /* rintf: to nearest even */
            q[i] = (int16_t)(r > limit ? limit : r < -limit ? -limit : r);
        }
#endif
    }
}

/* q4's offset term of the 4 outputs of a quad for one row: sum over blocks, in order, of m * sum(x). */
static void offsets(const job_t *j, int64_t row, int64_t quad, float out[QUAD]) {
    const int64_t blocks = j->w.in / GROUP;
    const float *sumx = j->sumx + row * blocks;
    const uint8_t *rec = record(&j->w, quad, 0);
#ifdef MATMUL_AVX2
    __m128 acc = _mm_setzero_ps();
    for (int64_t b = 0; b < blocks; b++, rec += Q4_RECORD)
        acc = _mm_fmadd_ps(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(rec + 72))), _mm_set1_ps(sumx[b]), acc);
    _mm_storeu_ps(out, acc);
#else
    for (int t = 0; t < QUAD; t++) out[t] = 0.0f;
    for (int64_t b = 0; b < blocks; b++, rec += Q4_RECORD)
        for (int t = 0; t < QUAD; t++) {
            uint16_t m;
            memcpy(&m, rec + 72 + 2 * t, sizeof m);
            out[t] = fmaf(half_to_float(m), sumx[b], out[t]);
        }
#endif
}

/* Row `row`'s 4 outputs of a quad, from their 8 lanes each: the lanes' fixed tree, then the offset term. */
static void store(const job_t *j, int64_t row, int64_t quad, const float lanes[QUAD][8]) {
    float offset[QUAD];
    offsets(j, row, quad, offset);
    for (int t = 0; t < QUAD; t++) {
        const int64_t o = quad * QUAD + t;
        if (o >= j->w.out) return; /* the last quad's padding */
        const float v = sum8(lanes[t]) + offset[t];
        put_y(j, row, o, v);
    }
}

/* Output t's codes in the block record rec as 16-bit integers, inputs 0-15 and 16-31. A q4 byte widened
 * to 16 bits holds input j in its low nibble and j + 16 in its high one: one mask and one shift split it. */
#ifdef MATMUL_AVX2
static inline __attribute__((always_inline)) void codes16(const uint8_t *rec, int t, __m256i *lo, __m256i *hi) {
    const __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(rec + 16 * t)));
    *lo = _mm256_and_si256(q, _mm256_set1_epi16(0x0f));
    *hi = _mm256_srli_epi16(q, 4);
}
#else
static inline void codes16(const uint8_t *rec, int t, int16_t c[GROUP]) {
    for (int i = 0; i < 16; i++) {
        c[i] = rec[16 * t + i] & 0x0f;
        c[i + 16] = rec[16 * t + i] >> 4;
    }
}
#endif

/* The block's scales for the quad's 4 outputs and one row: d * sx. */
static inline __attribute__((always_inline)) void block_scales(const uint8_t *rec, float sx, float out[QUAD]) {
#ifdef MATMUL_AVX2
    _mm_storeu_ps(out, _mm_mul_ps(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(rec + 64))), _mm_set1_ps(sx)));
#else
    for (int t = 0; t < QUAD; t++) {
        uint16_t d;
        memcpy(&d, rec + 64 + 2 * t, sizeof d);
        out[t] = half_to_float(d) * sx;
    }
#endif
}

/* Rows r0 .. r0 + RT - 1 against the 4 outputs of one quad: one 8-lane fp32 accumulator each. */
#ifdef MATMUL_AVX2
#define DEFINE_TILE(RT)                                                                     \
static void tile_q4_##RT(const job_t *j, int64_t r0, int64_t quad) {                             \
    const int64_t in = j->w.in, blocks = in / GROUP;                                                   \
    __m256 acc[RT][QUAD];                                                                              \
    for (int r = 0; r < RT; r++)                                                                       \
        for (int t = 0; t < QUAD; t++) acc[r][t] = _mm256_setzero_ps();                                \
    const uint8_t *rec = record(&j->w, quad, 0);                                                       \
        for (int64_t b = 0; b < blocks; b++, rec += Q4_RECORD) {                                                \
        PREFETCH(rec);                                                                                 \
        float scale[RT][QUAD];                                                                         \
        for (int r = 0; r < RT; r++) block_scales(rec, j->sx[(r0 + r) * blocks + b], scale[r]);   \
        for (int t = 0; t < QUAD; t++) {                                                               \
            __m256i lo, hi;                                                                            \
            codes16(rec, t, &lo, &hi);                                                            \
            for (int r = 0; r < RT; r++) {                                                             \
                const int16_t *xq = j->xq + (r0 + r) * in + b * GROUP;                                 \
                const __m256i sum = _mm256_add_epi32(                                                  \
                    _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xq)),                    \
                    _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 16))));            \
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_broadcast_ss(&scale[r][t]), acc[r][t]); \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
    for (int r = 0; r < RT; r++) {                                                                     \
        float lanes[QUAD][8];                                                                          \
        for (int t = 0; t < QUAD; t++) _mm256_storeu_ps(lanes[t], acc[r][t]);                          \
        store(j, r0 + r, quad, lanes);                                                                 \
    }                                                                                                  \
}
#else
#define DEFINE_TILE(RT)                                                                     \
static void tile_q4_##RT(const job_t *j, int64_t r0, int64_t quad) {                             \
    const int64_t in = j->w.in, blocks = in / GROUP;                                                   \
    for (int r = 0; r < RT; r++) {                                                                     \
        float lanes[QUAD][8] = {{0}};                                                                  \
        for (int t = 0; t < QUAD; t++) {                                                               \
            for (int64_t b = 0; b < blocks; b++) {                                                     \
                const uint8_t *rec = record(&j->w, quad, b);                                           \
                int16_t c[GROUP];                                                                      \
                codes16(rec, t, c);                                                               \
                const int16_t *xq = j->xq + (r0 + r) * in + b * GROUP;                                 \
                float scales[QUAD];                                                                    \
                block_scales(rec, j->sx[(r0 + r) * blocks + b], scales);                          \
                const float scale = scales[t];                                                         \
                for (int l = 0; l < 8; l++) {                                                          \
                    const int32_t sum = (int32_t)c[2 * l] * xq[2 * l] + (int32_t)c[2 * l + 1] * xq[2 * l + 1] \
                        + (int32_t)c[16 + 2 * l] * xq[16 + 2 * l] + (int32_t)c[17 + 2 * l] * xq[17 + 2 * l]; \
                    lanes[t][l] = fmaf((float)sum, scale, lanes[t][l]);                                \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
        store(j, r0 + r, quad, lanes);                                                                 \
    }                                                                                                  \
}
#endif
#ifdef MATMUL_AVX512
/* The same sums with two outputs of the quad in one 16-lane register: lanes 0-7 output 2p, lanes 8-15
 * output 2p + 1, each lane l the AVX2 path's lane l (inputs 2l, 2l + 1 by one product, 16 + 2l, 17 + 2l by
 * the other, summed exactly in int32), scaled and accumulated by the same single-rounding steps in the
 * same block order: the same bits, with a fused product-sum (VNNI) where the CPU has one. */
/* Outputs 2p, 2p + 1: 32 code bytes, each input j and j + 16. */
static inline __attribute__((always_inline)) void pair_codes(const uint8_t *rec, int p, __m512i *lo, __m512i *hi) {
    const __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(rec + 32 * p)));
    *lo = _mm512_and_si512(q, _mm512_set1_epi16(0x0f));
    *hi = _mm512_srli_epi16(q, 4);
}

/* The pair's per-output factor of the block scale: d, fp16 in the record. */
static inline __attribute__((always_inline)) __m512 pair_d(const uint8_t *rec, int p) {
    const __m128 d = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(rec + 64))); /* the quad's 4 d */
    const __m512 dd = _mm512_castps128_ps512(d);
    return _mm512_permutexvar_ps(_mm512_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p,
                                                   2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1,
                                                   2 * p + 1, 2 * p + 1), dd);
}

#define DEFINE_TILE512(RT)                                                                  \
static void tile_q4_##RT(const job_t *j, int64_t r0, int64_t quad) {                             \
    const int64_t in = j->w.in, blocks = in / GROUP;                                                   \
    __m512 acc[RT][2];                                                                                 \
    for (int r = 0; r < RT; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();                          \
    const uint8_t *rec = record(&j->w, quad, 0);                                                       \
        for (int64_t b = 0; b < blocks; b++, rec += Q4_RECORD) {                                                \
        PREFETCH(rec);                                                                                 \
        __m512i lo[2], hi[2];                                                                          \
        __m512 d[2];                                                                                   \
        for (int p = 0; p < 2; p++) {                                                                  \
            pair_codes(rec, p, &lo[p], &hi[p]);                                                   \
            d[p] = pair_d(rec, p);                                                                \
        }                                                                                              \
        for (int r = 0; r < RT; r++) {                                                                 \
            const int16_t *xq = j->xq + (r0 + r) * in + b * GROUP;                                     \
            const __m512i xlo = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)xq));      \
            const __m512i xhi = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(xq + 16))); \
            const __m512 sx = _mm512_set1_ps(j->sx[(r0 + r) * blocks + b]);                            \
            for (int p = 0; p < 2; p++) {                                                              \
                const __m512i sum = DPWSSD(_mm512_madd_epi16(lo[p], xlo), hi[p], xhi);                 \
                const __m512 scale = _mm512_mul_ps(d[p], sx);                                          \
                acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[r][p]);                \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
    for (int r = 0; r < RT; r++) {                                                                     \
        float lanes[QUAD][8];                                                                          \
        for (int p = 0; p < 2; p++) {                                                                  \
            _mm256_storeu_ps(lanes[2 * p], _mm512_castps512_ps256(acc[r][p]));                        \
            _mm256_storeu_ps(lanes[2 * p + 1], _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][p]), 1)));                  \
        }                                                                                              \
        store(j, r0 + r, quad, lanes);                                                                 \
    }                                                                                                  \
}
/* 32 vector registers: up to 16 accumulators (8 rows x 2 output pairs), the quad's codes and d, one
 * row's x, temporaries. */
DEFINE_TILE512(8)
DEFINE_TILE512(4)
DEFINE_TILE512(2)
DEFINE_TILE512(1)
#else
/* 16 vector registers: up to 12 accumulators (3 rows x 4 outputs), one output's codes, temporaries. */
DEFINE_TILE(3)
DEFINE_TILE(2)
DEFINE_TILE(1)
#endif
DEFINE_QUADS(q4)

static int matmul(weight_t w, const void *x, int x_bf16, int64_t x_stride, int64_t rows, void *y, int y_bf16,
                  int64_t y_stride, int64_t threads) {
    if (w.in % GROUP || w.in <= 0 || w.out <= 0 || rows < 0) return -EINVAL;
    if (!rows) return 0;
    const int64_t blocks = w.in / GROUP;
    int16_t *xq = malloc((size_t)(rows * w.in) * sizeof(int16_t));
    float *sx = malloc((size_t)(2 * rows * blocks) * sizeof(float));
    if (!xq || !sx) {
        free(xq);
        free(sx);
        return -ENOMEM;
    }
    const size_t elem = x_bf16 ? 2 : 4;
#pragma omp parallel for num_threads((int)threads) if (threads > 1 && rows > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        quantize_row((const char *)x + (size_t)(r * x_stride) * elem, x_bf16, w.in, XQ_MAX, xq + r * w.in,
                     sx + r * blocks, sx + (rows + r) * blocks);
    job_t j = {w, xq, sx, sx + rows * blocks, NULL, NULL, rows, y, y_stride, y_bf16, NULL};
    const int err = run_quads(quads_q4, &j, threads);
    free(xq);
    free(sx);
    return err;
}

/* y [rows, out] = x [rows, in] @ W^T, W in GGUF Q4 blocks, packed as above. Returns 0, or a negative errno. */
int q4_matmul(const void *x, int x_bf16, int64_t x_stride, int64_t rows, const uint8_t *packed, int64_t out,
              int64_t in, void *y, int y_bf16, int64_t y_stride, int64_t threads) {
    weight_t w = {FORMAT_Q4, packed, NULL, out, in};
    return matmul(w, x, x_bf16, x_stride, rows, y, y_bf16, y_stride, threads);
}
