/* The fp32 Q4 kernel (q4_matmul_f32), on the quads layout (matmul.h), any AVX2 CPU: it dequantizes a block once
 * for every row of a batch, so a row costs about the products alone, where the integer kernel pays its
 * products and the per-block scaling again for every row; at one row the integer kernel is the cheaper of
 * those two (native/choice.py picks per CPU). */
#include "matmul.h"

/* q4 in fp32 (q4_matmul_f32): each block of a quad's weights dequantized once, w = fma(q, d, m) in fp32,
 * into registers (1-2 rows) or a buffer every row of a batch reads, and each row's fp32 x multiplied with
 * it by FMAs into 8 lanes per (row, output) (lane l: inputs l, 8 + l, 16 + l, 24 + l, in that order; blocks
 * in order), then sum8's tree. */
#ifdef MATMUL_AVX2
/* The quad's 4 d and 4 m of a block record, in fp32 (exact). */
static inline __attribute__((always_inline)) void scales_f32(const uint8_t *rec, float d[QUAD], float m[QUAD]) {
    _mm_storeu_ps(d, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(rec + 64))));
    _mm_storeu_ps(m, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(rec + 72))));
}

static inline __attribute__((always_inline)) void dequant_f32(const uint8_t *rec, int t, const float *dt,
                                                               const float *mt, __m256 w[4]) {
    const __m128i b = _mm_loadu_si128((const __m128i *)(rec + 16 * t));
    const __m256i q0 = _mm256_cvtepu8_epi32(b), q1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    const __m256i mask = _mm256_set1_epi32(0x0f);
    const __m256 d = _mm256_broadcast_ss(dt), m = _mm256_broadcast_ss(mt);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q0, mask)), d, m);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q1, mask)), d, m);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)), d, m);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4)), d, m);
}

static inline void store_f32(const job_t *j, int64_t row, int64_t quad, int t, __m256 acc) {
    const int64_t o = quad * QUAD + t;
    if (o >= j->w.out) return;
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    put_y(j, row, o, sum8(lanes));
}

/* 1 or 2 rows against a quad: the weights dequantized in registers (buf NULL) or read from the buffer. */
#define DEFINE_TILE_F32(RT)                                                                            \
static void tile_f32_##RT(const job_t *j, int64_t r0, int64_t quad, const __m256 *buf) {              \
    const int64_t in = j->w.in, blocks = in / GROUP;                                                   \
    __m256 acc[RT][QUAD];                                                                              \
    for (int r = 0; r < RT; r++)                                                                       \
        for (int t = 0; t < QUAD; t++) acc[r][t] = _mm256_setzero_ps();                                \
    const uint8_t *rec = record(&j->w, quad, 0);                                                       \
    for (int64_t b = 0; b < blocks; b++, rec += Q4_RECORD) {                                           \
        float d[QUAD], m[QUAD];                                                                        \
        if (!buf) {                                                                                    \
            PREFETCH(rec);                                                                             \
            scales_f32(rec, d, m);                                                                     \
        }                                                                                              \
        for (int t = 0; t < QUAD; t++) {                                                               \
            __m256 w[4];                                                                               \
            if (buf) for (int k = 0; k < 4; k++) w[k] = buf[(b * QUAD + t) * 4 + k];                   \
            else dequant_f32(rec, t, d + t, m + t, w);                                                 \
            for (int r = 0; r < RT; r++) {                                                             \
                const float *x = j->xf + (r0 + r) * in + b * GROUP;                                    \
                for (int k = 0; k < 4; k++) acc[r][t] = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(x + 8 * k), acc[r][t]); \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
    for (int r = 0; r < RT; r++)                                                                       \
        for (int t = 0; t < QUAD; t++) store_f32(j, r0 + r, quad, t, acc[r][t]);                       \
}
DEFINE_TILE_F32(2)
DEFINE_TILE_F32(1)

/* 3 rows against a quad, from the buffer: per block and 8 inputs k, each row's x loaded once and each
 * output's w once, for 12 FMAs (the same FMAs, in the same order per (row, output), as above). */
static void tile_f32_3(const job_t *j, int64_t r0, int64_t quad, const __m256 *buf) {
    const int64_t in = j->w.in, blocks = in / GROUP;
    __m256 acc[3][QUAD];
    for (int r = 0; r < 3; r++)
        for (int t = 0; t < QUAD; t++) acc[r][t] = _mm256_setzero_ps();
    const float *x0 = j->xf + r0 * in;
    for (int64_t b = 0; b < blocks; b++) {
        for (int k = 0; k < 4; k++) {
            __m256 x[3];
            for (int r = 0; r < 3; r++) x[r] = _mm256_loadu_ps(x0 + r * in + b * GROUP + 8 * k);
            for (int t = 0; t < QUAD; t++) {
                const __m256 w = buf[(b * QUAD + t) * 4 + k];
                for (int r = 0; r < 3; r++) acc[r][t] = _mm256_fmadd_ps(w, x[r], acc[r][t]);
            }
        }
    }
    for (int r = 0; r < 3; r++)
        for (int t = 0; t < QUAD; t++) store_f32(j, r0 + r, quad, t, acc[r][t]);
}

static int quads_f32(const job_t *j, int64_t q_begin, int64_t q_end) {
    const int64_t blocks = j->w.in / GROUP;
    __m256 *buf = NULL;
    if (j->rows > 2 && !(buf = aligned_alloc(32, (size_t)(blocks * QUAD * 4) * sizeof *buf))) return -ENOMEM;
    for (int64_t q = q_begin; q < q_end; q++) {
        if (buf) {
            const uint8_t *rec = record(&j->w, q, 0);
            for (int64_t b = 0; b < blocks; b++, rec += Q4_RECORD) {
                float d[QUAD], m[QUAD];
                PREFETCH(rec);
                scales_f32(rec, d, m);
                for (int t = 0; t < QUAD; t++) dequant_f32(rec, t, d + t, m + t, buf + (b * QUAD + t) * 4);
            }
        }
        int64_t r = 0;
        for (; r + 3 <= j->rows; r += 3) tile_f32_3(j, r, q, buf);
        if (j->rows - r == 2) tile_f32_2(j, r, q, buf);
        else if (j->rows - r == 1) tile_f32_1(j, r, q, buf);
    }
    free(buf);
    return 0;
}
#else
static int quads_f32(const job_t *j, int64_t q_begin, int64_t q_end) {
    const int64_t in = j->w.in, blocks = in / GROUP;
    for (int64_t q = q_begin; q < q_end; q++)
        for (int t = 0; t < QUAD && q * QUAD + t < j->w.out; t++)
            for (int64_t r = 0; r < j->rows; r++) {
                float lanes[8] = {0};
                const uint8_t *rec = record(&j->w, q, 0);
                for (int64_t b = 0; b < blocks; b++, rec += Q4_RECORD) {
                    uint16_t dh, mh;
                    memcpy(&dh, rec + 64 + 2 * t, sizeof dh);
                    memcpy(&mh, rec + 72 + 2 * t, sizeof mh);
                    const float d = half_to_float(dh), m = half_to_float(mh);
                    const float *x = j->xf + r * in + b * GROUP;
                    for (int k = 0; k < 4; k++)
                        for (int l = 0; l < 8; l++) {
                            const int i = 8 * k + l; /* byte i % 16: input i in the low nibble, i + 16 high */
                            const uint8_t byte = rec[16 * t + (i & 15)];
                            const float w = fmaf((float)(i < 16 ? byte & 0x0f : byte >> 4), d, m);
                            lanes[l] = fmaf(w, x[i], lanes[l]);
                        }
                }
                const float v = sum8(lanes);
                const int64_t o = q * QUAD + t;
                put_y(j, r, o, v);
            }
    return 0;
}
#endif

/* y [rows, out] = x [rows, in] @ W^T as q4_matmul, in fp32: the file's weights dequantized once a block for
 * all rows (fma(q, d, m) in fp32) times x in fp32 (bf16 x widened exactly), fp32 sums (above). */
int q4_matmul_f32(const void *x, int x_bf16, int64_t x_stride, int64_t rows, const uint8_t *packed,
                  int64_t out, int64_t in, void *y, int y_bf16, int64_t y_stride, int64_t threads) {
    if (in % GROUP || in <= 0 || out <= 0 || rows < 0) return -EINVAL;
    if (!rows) return 0;
    float *xf = NULL;
    if (x_bf16 || x_stride != in) {
        if (!(xf = malloc((size_t)(rows * in) * sizeof *xf))) return -ENOMEM;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t k = 0; k < in; k++)
                xf[r * in + k] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[r * x_stride + k])
                                        : ((const float *)x)[r * x_stride + k];
    }
    job_t j = {{FORMAT_Q4_F32, packed, NULL, out, in}, NULL, NULL, NULL, NULL, xf ? xf : (const float *)x,
               rows, y, y_stride, y_bf16, NULL};
    const int err = run_quads(quads_f32, &j, threads);
    free(xf);
    return err;
}
