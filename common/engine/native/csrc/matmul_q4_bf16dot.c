/* The bf16 dot Q4 kernel (q4_matmul_bf16dot), on the quads layout (matmul.h), for CPUs with AVX512_BF16: the
 * file's codes themselves, exact as bf16 numbers, times bf16 x: cheaper than the integer kernel at one row
 * and faster at 32 (docs/benchmarks.md, "Figures behind the code": bf16 dot kernel against the integer
 * kernel). */
#include "matmul.h"

/* GCC compiles it into every AVX2 build, the portable one an image ships included, for the AVX-512 BF16
 * subset only; q4_matmul_bf16dot runs it where the CPU at hand has the instructions (cpu_has_bf16dot).
 * Another compiler builds it where -march already has them. */
#if defined(MATMUL_AVX2) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
#define MATMUL_BF16DOT_TARGET 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")
#endif
#if defined(MATMUL_BF16DOT_TARGET) || (defined(MATMUL_AVX512) && defined(__AVX512BF16__))
#define MATMUL_BF16DOT 1
/* q4 with the bf16 dot instruction (q4_matmul_bf16dot, where the CPU has AVX512_BF16). The file's codes
 * are used as integers, not dequantized: a code byte's nibble q becomes the bf16 number 128 + q by one
 * byte interleave (bits 0x43 0x0q: exponent 2^7, mantissa q, exact), so a quad's 32 x 4 weights take 8
 * instructions whatever the rows, and vdpbf16ps multiplies them with the row's bf16 x exactly (8-bit
 * significands) and sums in fp32. Per block and output, 4 lanes (lane l: inputs 2l, 2l + 1, 8 + 2l, 9 + 2l,
 * 16 + 2l, 17 + 2l, 24 + 2l, 25 + 2l) start from -128 * (the lane's sum of x), so they end at the lane's
 * sum of q x; then the block scale, acc += d * lane, and the offset, accm += m * (the lane's sum of x),
 * blocks in order, and a fixed tree over the 4 lanes of acc + accm. Against dequantizing (w = d q + m
 * rounded to bf16, as torch's int4 kernel does) the weights keep their exact value and a row costs 6
 * instructions a block of a quad at any batch size.
 *
 * A (row, output)'s operations and their order do not depend on the rows beside it: invariant 4 (same inputs,
 * same tokens). */
#define BF16DOT_LANES 4 /* fp32 lanes per output and block: a 128-bit lane of the 512-bit register */
#define BF16DOT_SUMS (2 * BF16DOT_LANES) /* a row's floats a block: its lane sums, then -128 times them */

/* The quad's 4 x 32 weights of a block as 128 + q in bf16: w[k] holds inputs 8k .. 8k + 7 of output t in
 * its 128-bit lane t (byte j of a code: input j in the low nibble, j + 16 in the high one). */
static inline __attribute__((always_inline)) void unpack_bf16(const uint8_t *rec, __m512bh w[4]) {
    const __m512i c = _mm512_loadu_si512(rec), nibble = _mm512_set1_epi8(0x0f), exp128 = _mm512_set1_epi8(0x43);
    const __m512i lo = _mm512_and_si512(c, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), nibble);
    w[0] = (__m512bh)_mm512_unpacklo_epi8(lo, exp128);
    w[1] = (__m512bh)_mm512_unpackhi_epi8(lo, exp128);
    w[2] = (__m512bh)_mm512_unpacklo_epi8(hi, exp128);
    w[3] = (__m512bh)_mm512_unpackhi_epi8(hi, exp128);
}

/* The quad's 4 d and 4 m (fp16, side by side at `at`), exact in fp32, each spread over its output's 4 lanes:
 * one conversion for both. */
static inline __attribute__((always_inline)) void spread_bf16dot(const uint8_t *at, __m512 *d, __m512 *m) {
    const __m512 eight = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)at)));
    *d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), eight);
    *m = _mm512_permutexvar_ps(_mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7), eight);
}

/* One row's block sums: sumx [blocks, 8]: the lane's sum of x, in fp32 in input order (x bf16, so each term
 * is exact), then -128 times it (exact too: the dot products' starting value, computed once a row). */
static void lane_sums_bf16dot(const uint16_t *x, int64_t in, float *sumx) {
    for (int64_t b = 0; b < in / GROUP; b++)
        for (int l = 0; l < BF16DOT_LANES; l++) {
            float s = 0.0f;
            for (int k = 0; k < 4; k++) {
                const uint16_t *p = x + b * GROUP + 8 * k + 2 * l;
                s += bf16_to_f32(p[0]);
                s += bf16_to_f32(p[1]);
            }
            sumx[b * BF16DOT_SUMS + l] = s;
            sumx[b * BF16DOT_SUMS + BF16DOT_LANES + l] = s * -128.0f;
        }
}

#define DEFINE_TILE_BF16DOT(RT)                                                                        \
static void tile_bf16dot_##RT(const job_t *j, int64_t r0, int64_t quad) {                             \
    const int64_t in = j->w.in, blocks = in / GROUP;                                                   \
    __m512 acc[RT], accm[RT];                                                                          \
    for (int r = 0; r < RT; r++) acc[r] = accm[r] = _mm512_setzero_ps();                               \
    const uint8_t *rec = record(&j->w, quad, 0);                                                       \
    for (int64_t b = 0; b < blocks; b++, rec += Q4_RECORD) {                                           \
        __m512bh w[4];                                                                                 \
        PREFETCH(rec);                                                                                 \
        unpack_bf16(rec, w);                                                                           \
        __m512 d, m;                                                                                   \
        spread_bf16dot(rec + 64, &d, &m);                                                              \
        for (int r = 0; r < RT; r++) {                                                                 \
            const uint16_t *x = j->xb + (r0 + r) * in + b * GROUP;                                     \
            const float *at = j->sumx + ((r0 + r) * blocks + b) * BF16DOT_SUMS;                        \
            const __m512 sums = _mm512_broadcast_f32x4(_mm_loadu_ps(at));                              \
            __m512 t = _mm512_broadcast_f32x4(_mm_loadu_ps(at + BF16DOT_LANES)); /* -128 sums */       \
            for (int k = 0; k < 4; k++)                                                                \
                t = _mm512_dpbf16_ps(t, w[k], (__m512bh)_mm512_broadcast_i32x4(                        \
                                                  _mm_loadu_si128((const __m128i *)(x + 8 * k))));     \
            acc[r] = _mm512_fmadd_ps(t, d, acc[r]);                                                    \
            accm[r] = _mm512_fmadd_ps(sums, m, accm[r]);                                               \
        }                                                                                              \
    }                                                                                                  \
    for (int r = 0; r < RT; r++) {                                                                     \
        float v[QUAD * BF16DOT_LANES];                                                                 \
        _mm512_storeu_ps(v, _mm512_add_ps(acc[r], accm[r]));                                           \
        for (int t = 0; t < QUAD && quad * QUAD + t < j->w.out; t++) {                                 \
            const float *l = v + t * BF16DOT_LANES;                                                    \
            put_y(j, r0 + r, quad * QUAD + t, (l[0] + l[2]) + (l[1] + l[3]));                          \
        }                                                                                              \
    }                                                                                                  \
}
DEFINE_TILE_BF16DOT(8)
DEFINE_TILE_BF16DOT(4)
DEFINE_TILE_BF16DOT(3)
DEFINE_TILE_BF16DOT(2)
DEFINE_TILE_BF16DOT(1)

static int quads_bf16dot(const job_t *j, int64_t q_begin, int64_t q_end) {
    for (int64_t q = q_begin; q < q_end; q++) {
        int64_t r = 0;
        for (; r + 8 <= j->rows; r += 8) tile_bf16dot_8(j, r, q);
        if (r + 4 <= j->rows) tile_bf16dot_4(j, r, q), r += 4;
        switch (j->rows - r) {
        case 3: tile_bf16dot_3(j, r, q); break;
        case 2: tile_bf16dot_2(j, r, q); break;
        case 1: tile_bf16dot_1(j, r, q); break;
        }
    }
    return 0;
}
#ifdef MATMUL_BF16DOT_TARGET
#pragma GCC pop_options
#endif

/* AVX512_BF16 and the AVX-512 state enabled by the OS, asked of this CPU once. */
static int cpu_has_bf16dot(void) {
    static int has = -1;
    if (has < 0) {
        __builtin_cpu_init();
        has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
              __builtin_cpu_supports("avx512bf16");
    }
    return has;
}
#endif

/* y [rows, out] = x [rows, in] @ W^T as q4_matmul, by the bf16 dot instruction (MATMUL_BF16DOT above): x
 * rounded to bf16 (to nearest even, as torch's conversion) where it is fp32. -ENOSYS where this build has
 * no bf16 dot kernel (not an AVX2 build, or a compiler too old) or the CPU has no AVX512_BF16. */
int q4_matmul_bf16dot(const void *x, int x_bf16, int64_t x_stride, int64_t rows, const uint8_t *packed,
                      int64_t out, int64_t in, void *y, int y_bf16, int64_t y_stride, int64_t threads) {
#ifdef MATMUL_BF16DOT
    if (!cpu_has_bf16dot()) return -ENOSYS;
    if (in % GROUP || in <= 0 || out <= 0 || rows < 0) return -EINVAL;
    if (!rows) return 0;
    const int64_t blocks = in / GROUP;
    uint16_t *xb = NULL;
    float *sums = malloc((size_t)(rows * blocks * BF16DOT_SUMS) * sizeof *sums);
    if (!sums || ((!x_bf16 || x_stride != in) && !(xb = malloc((size_t)(rows * in) * sizeof *xb)))) {
        free(sums);
        return -ENOMEM;
    }
    const uint16_t *xr = xb ? xb : (const uint16_t *)x;
#pragma omp parallel for num_threads((int)threads) if (threads > 1 && rows > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (xb)
            for (int64_t k = 0; k < in; k++)
                xb[r * in + k] = x_bf16 ? ((const uint16_t *)x)[r * x_stride + k]
                                        : f32_to_bf16(((const float *)x)[r * x_stride + k]);
        lane_sums_bf16dot(xr + r * in, in, sums + r * blocks * BF16DOT_SUMS);
    }
    job_t j = {{FORMAT_Q4_BF16DOT, packed, NULL, out, in}, NULL, NULL, sums, xr, NULL, rows, y, y_stride, y_bf16, NULL};
    const int err = run_quads(quads_bf16dot, &j, threads);
    free(xb);
    free(sums);
    return err;
#else
    (void)x, (void)x_bf16, (void)x_stride, (void)rows, (void)packed, (void)out, (void)in, (void)y, (void)y_bf16,
        (void)y_stride, (void)threads;
    return -ENOSYS;
#endif
}
