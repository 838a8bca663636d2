/* The int8 LM head (q8_matmul), on its quads layout (matmul.h).
 *
 * q8 quantizes an activation row whole, where q4 takes it by blocks: xq = rint(x / s), s = max |x| / 32767,
 * 15 bits of the row's largest value against the weights' 8 bits of theirs. One scale a row, so each (row,
 * output) is one exact integer sum over all its inputs, sum xq w, and the output (float)sum * s * scale[o]:
 * no scaling per block (docs/benchmarks.md, "Figures behind the code": LM head: one scale a row), and the
 * same integer however the sum is split, so that any tiling, any batch and every build (AVX-512, AVX2, plain
 * C) give a row the same bits, as invariant 4 (same inputs, same tokens) needs. The LM head's logits
 * are approximate by design: the fp32 refinement recomputes the best of each row. */
#include "matmul.h"

/* Blocks summed in int32 lanes before int64: a lane holds 4 inputs a block, 256 a chunk, at most
 * 256 x 32767 x 128 = 1.07e9, and two lanes' sum (the AVX-512 reduction adds two first) < 2^31. */
#define Q8_CHUNK 64

/* One row [in] (fp32 or bf16) -> xq [in] and s. A NaN or an infinity makes s NaN, so that every output of the
 * row is NaN, as a float product's would be. */
static void quantize_row_q8(const void *x, int x_bf16, int64_t in, int16_t *xq, float *s_out) {
    float amax = 0.0f;
    int finite = 1;
    for (int64_t k = 0; k < in; k++) {
        const float v = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
        finite &= isfinite(v) != 0;
        amax = fabsf(v) > amax ? fabsf(v) : amax;
    }
    const float s = amax / XQ_MAX;
    *s_out = finite ? s : NAN;
    if (!finite || !(s > 0.0f)) { /* not finite, or all zeros (or too small for s) */
        memset(xq, 0, (size_t)in * sizeof *xq);
        return;
    }
    for (int64_t k = 0; k < in; k++) {
        const float v = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
        xq[k] = (int16_t)fminf(fmaxf(rintf(v / s), -XQ_MAX), XQ_MAX); /* rintf: to nearest even */
    }
}

/* Row `row`'s 4 outputs of a quad from their exact sums. */
static void store_q8(const job_t *j, int64_t row, int64_t quad, const int64_t sums[QUAD]) {
    for (int t = 0; t < QUAD; t++) {
        const int64_t o = quad * QUAD + t;
        if (o >= j->w.out) return; /* the last quad's padding */
        put_y(j, row, o, (float)sums[t] * j->sx[row] * j->w.scale[o]);
    }
}

#ifdef MATMUL_AVX512
/* Two outputs of the quad a register: lanes 0-7 output 2p, lanes 8-15 output 2p + 1, 4 inputs a block each.
 * Its 16 lanes' sums go to the quad's 4 outputs' int64 sums: two 128-bit lanes added in int32 (s[0] holds
 * output 0, 0, 1, 1; s[1] 2, 2, 3, 3), then 4 each in int64. */
static inline __attribute__((always_inline)) void add_sums_q8(const __m512i s[2], int64_t sums[QUAD]) {
    const __m512i a = _mm512_add_epi32(_mm512_shuffle_i32x4(s[0], s[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_i32x4(s[0], s[1], _MM_SHUFFLE(3, 1, 3, 1)));
    int32_t lanes[16];
    _mm512_storeu_si512(lanes, a);
    for (int t = 0; t < QUAD; t++)
        sums[t] += (int64_t)lanes[4 * t] + lanes[4 * t + 1] + lanes[4 * t + 2] + lanes[4 * t + 3];
}

/* A batch: the quad's codes widened to 16 bits once a block for up to 8 rows, times xq by 16-bit products
 * (VNNI's fused vpdpwssd where the CPU has it): per row and block 2 loads and 4 instructions. Lane l of
 * output t: inputs 2l, 2l + 1 (codes lo) and 16 + 2l, 17 + 2l (hi). */
static inline __attribute__((always_inline)) void pair_codes_q8(const uint8_t *rec, int p, __m512i *lo, __m512i *hi) {
    const uint8_t *a = rec + 64 * p, *b = a + 32; /* outputs 2p, 2p + 1: 32 int8 codes each */
    *lo = _mm512_cvtepi8_epi16(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)), _mm_loadu_si128((const __m128i *)b), 1));
    *hi = _mm512_cvtepi8_epi16(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(a + 16))), _mm_loadu_si128((const __m128i *)(b + 16)), 1));
}

#define DEFINE_TILE_Q8(RT)                                                                             \
static void tile_q8_##RT(const job_t *j, int64_t r0, int64_t quad) {                                   \
    const int64_t in = j->w.in, blocks = in / GROUP;                                                   \
    int64_t sums[RT][QUAD] = {{0}};                                                                    \
    for (int64_t b0 = 0; b0 < blocks; b0 += Q8_CHUNK) {                                                \
        const int64_t b1 = b0 + Q8_CHUNK < blocks ? b0 + Q8_CHUNK : blocks;                            \
        __m512i acc[RT][2];                                                                            \
        for (int r = 0; r < RT; r++) acc[r][0] = acc[r][1] = _mm512_setzero_si512();                   \
        const uint8_t *rec = record(&j->w, quad, b0);                                                  \
        for (int64_t b = b0; b < b1; b++, rec += Q8_RECORD) {                                          \
            PREFETCH(rec);                                                                             \
            __m512i lo[2], hi[2];                                                                      \
            for (int p = 0; p < 2; p++) pair_codes_q8(rec, p, &lo[p], &hi[p]);                        \
            for (int r = 0; r < RT; r++) {                                                             \
                const int16_t *xq = j->xq + (r0 + r) * in + b * GROUP;                                 \
                const __m512i xlo = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)xq));  \
                const __m512i xhi = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(xq + 16))); \
                for (int p = 0; p < 2; p++) acc[r][p] = DPWSSD(DPWSSD(acc[r][p], lo[p], xlo), hi[p], xhi); \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < RT; r++) add_sums_q8(acc[r], sums[r]);                                     \
    }                                                                                                  \
    for (int r = 0; r < RT; r++) store_q8(j, r0 + r, quad, sums[r]);                                   \
}
DEFINE_TILE_Q8(8)
DEFINE_TILE_Q8(4)
DEFINE_TILE_Q8(2)
DEFINE_TILE_Q8(1)
DEFINE_QUADS(q8)
#elif defined(MATMUL_AVX2)
/* An output's 32 codes widened to 16 bits, times xq by vpmaddwd: 8 int32 lanes an output. A quad's records
 * are one stream, which the hardware prefetcher follows: PREFETCH's hint as well made a one-row step slower
 * (docs/benchmarks.md, "Figures behind the code": LM head on AVX2: no prefetch hint). */
#define DEFINE_TILE_Q8(RT)                                                                             \
static void tile_q8_##RT(const job_t *j, int64_t r0, int64_t quad) {                                   \
    const int64_t in = j->w.in, blocks = in / GROUP;                                                   \
    int64_t sums[RT][QUAD] = {{0}};                                                                    \
    for (int64_t b0 = 0; b0 < blocks; b0 += Q8_CHUNK) {                                                \
        const int64_t b1 = b0 + Q8_CHUNK < blocks ? b0 + Q8_CHUNK : blocks;                            \
        __m256i acc[RT][QUAD];                                                                         \
        for (int r = 0; r < RT; r++)                                                                   \
            for (int t = 0; t < QUAD; t++) acc[r][t] = _mm256_setzero_si256();                         \
        const uint8_t *rec = record(&j->w, quad, b0);                                                  \
        for (int64_t b = b0; b < b1; b++, rec += Q8_RECORD) {                                          \
            for (int t = 0; t < QUAD; t++) {                                                           \
                const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(rec + 32 * t))); \
                const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(rec + 32 * t + 16))); \
                for (int r = 0; r < RT; r++) {                                                         \
                    const int16_t *xq = j->xq + (r0 + r) * in + b * GROUP;                             \
                    acc[r][t] = _mm256_add_epi32(acc[r][t], _mm256_add_epi32(                          \
                        _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xq)),                \
                        _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 16)))));       \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < RT; r++)                                                                   \
            for (int t = 0; t < QUAD; t++) {                                                           \
                int32_t lanes[8];                                                                      \
                _mm256_storeu_si256((__m256i *)lanes, acc[r][t]);                                      \
                for (int i = 0; i < 8; i++) sums[r][t] += lanes[i];                                    \
            }                                                                                          \
    }                                                                                                  \
    for (int r = 0; r < RT; r++) store_q8(j, r0 + r, quad, sums[r]);                                   \
}
DEFINE_TILE_Q8(3)
DEFINE_TILE_Q8(2)
DEFINE_TILE_Q8(1)
DEFINE_QUADS(q8)
#else
static void tile_q8_1(const job_t *j, int64_t row, int64_t quad) {
    const int64_t in = j->w.in, blocks = in / GROUP;
    int64_t sums[QUAD] = {0};
    const int16_t *xq = j->xq + row * in;
    const uint8_t *rec = record(&j->w, quad, 0);
    for (int64_t b = 0; b < blocks; b++, rec += Q8_RECORD)
        for (int t = 0; t < QUAD; t++)
            for (int i = 0; i < GROUP; i++) sums[t] += (int32_t)(int8_t)rec[32 * t + i] * xq[b * GROUP + i];
    store_q8(j, row, quad, sums);
}

static int quads_q8(const job_t *j, int64_t q_begin, int64_t q_end) {
    for (int64_t q = q_begin; q < q_end; q++)
        for (int64_t r = 0; r < j->rows; r++) tile_q8_1(j, r, q);
    return 0;
}
#endif

/* y [rows, out] = x [rows, in] @ (codes * scale[:, None])^T, codes int8 packed as above, x quantized by rows
 * (above). */
int q8_matmul(const void *x, int x_bf16, int64_t x_stride, int64_t rows, const int8_t *packed, const float *scale,
              int64_t out, int64_t in, void *y, int y_bf16, int64_t y_stride, int64_t threads) {
    if (in % GROUP || in <= 0 || out <= 0 || rows < 0) return -EINVAL;
    if (!rows) return 0;
    int16_t *xq = malloc((size_t)(rows * in) * sizeof *xq);
    float *sx = malloc((size_t)rows * sizeof *sx);
    if (!xq || !sx) {
        free(xq);
        free(sx);
        return -ENOMEM;
    }
    const size_t elem = x_bf16 ? 2 : 4;
    for (int64_t r = 0; r < rows; r++)
        quantize_row_q8((const char *)x + (size_t)(r * x_stride) * elem, x_bf16, in, xq + r * in, sx + r);
    job_t j = {{FORMAT_Q8, (const uint8_t *)packed, scale, out, in}, xq, sx, NULL, NULL, NULL, rows, y, y_stride,
               y_bf16, NULL};
    const int err = run_quads(quads_q8, &j, threads);
    free(xq);
    free(sx);
    return err;
}
