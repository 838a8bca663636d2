/* Decode's weight matmuls (common/engine/native.py): y = x @ W^T for a few activation rows, W kept packed
 * with the model file's codes.
 *
 *   q4:  GGUF Q4_0 / Q4_1 blocks of 32 inputs, w = q * d + m (q in 0..15; d, m fp16, exact from the file).
 *   q8:  the LM head, w = code * scale[o] (code int8, scale fp32).
 *
 * Layout: outputs in quads (4 consecutive outputs; the last quad padded with zero weights), a quad's
 * blocks interleaved, so that the 4 outputs a tile computes together are one sequential stream (4
 * separate row streams ran at a third of the speed: a 1-row LM head took 7.0 against 3.5 ms on one core):
 *   q4:  [quads, in / 32, 80] bytes: per block the 4 outputs' 16 code bytes (byte j: input j in the low
 *        nibble, j + 16 in the high one, as GGUF stores them), then 4 fp16 d, then 4 fp16 m;
 *   q8:  [quads, in / 32, 4, 32] int8 codes, and scale [quads * 4] fp32.
 *
 * The products are integer, as llama.cpp's are: each activation row is quantized per block of 32 inputs
 * to 16-bit integers (x ~ xq * sx, |xq| <= 32767: 15 bits of the block's largest value, where bf16 keeps
 * 8 of each element), multiplied with the weights' integer codes by vpmaddwd and summed exactly in int32;
 * only then is a block's sum scaled (d * sx) and accumulated in fp32. Q4_1's offset m enters through the
 * block's exact fp32 sum of x: sum_b m_b * sum(x_b). Why not torch's int4 kernel: it takes bf16
 * activations, rounds the file's fp16 scales to bf16, and costs ~12x one row's time at 32 rows; its int8
 * counterpart (torch._int_mm) has no fast path on AVX2-only hosts. q8, whose codes share one scale an
 * output, quantizes a row whole instead, so that each output is a single exact integer sum (the LM head
 * section below).
 *
 * Two float kernels for q4 follow the integer ones. The bf16 dot kernel (AVX512_BF16) multiplies the codes
 * themselves, exact as bf16 numbers, with bf16 x: cheaper than the integer kernel at one row and 1.6x
 * faster at 32. The fp32 kernel (any AVX2 CPU) dequantizes a block once for every row of a batch, so a
 * row costs about the products alone, where the integer kernel pays its products and the per-block
 * scaling again for every row; at one row the integer kernel is the cheaper of those two
 * (native.matmuls_mode picks per CPU). Last, the int8 digit kernels (AVX2, AVX512_VNNI, AMX_INT8; the
 * default on every AVX2 CPU): the integer kernel's exact products with x's 16-bit integers split into two
 * bytes, by vpmaddubsw, vpdpbusd or the tile unit with the same bits, reading weights packed in their own
 * order (pack_q4's digits layout).
 *
 * Invariant 4 (a row's result never depends on the other rows): a row is quantized alone, and every
 * (row, output) pair runs the same operations in the same order whatever the batch, the tiling or the
 * thread: per block an exact integer sum into 8 lanes (lane l: inputs 2l, 2l + 1, 16 + 2l, 17 + 2l),
 * then one fused multiply-add per lane, blocks in order; then a fixed tree over the lanes, and the
 * offset term's blocks in order. The AVX2 path and the portable C path compute the same bits; built
 * without -ffast-math so the compiler keeps that order.
 *
 * Threads: the outputs' quads are split between the threads of an OpenMP team, torch's (see run()).
 */
#define _GNU_SOURCE /* syscall(), for arch_prctl (the AMX tile state): -std=c11 alone leaves it undeclared */
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define MATMUL_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define MATMUL_AVX512 1 /* two outputs a 16-lane register: the AVX2 path's lanes and order, half the work */
#endif
#endif

#include "bf16.h"

#define GROUP 32
#define QUAD 4
#define Q4_RECORD 80 /* bytes of one block of a quad: 4 x 16 codes, 4 d, 4 m */
#define Q8_RECORD 128
#define XQ_MAX 32767.0f
#define SPLIT_QUADS 2  /* quads are split between threads in multiples of this */
/* A matmul streams its weights once, each thread one contiguous range (then the others' tails: run_parts).
 * The hardware prefetcher alone kept a 1-row matmul at ~80 % of a plain read of the same bytes (66 MB of
 * 1.1 MB weights, cold, 2 threads: 1.35-1.39 against 1.06-1.16 ms); asking for the bytes this far ahead as
 * each block is read brought it to 1.24-1.27 ms (5,120 and 8,000 bytes ahead the best of 640-20,480). A
 * prefetch past the end of the weights is harmless: it never faults. */
#define PREFETCH_AHEAD 6144
#define PREFETCH(rec) __builtin_prefetch((const char *)(rec) + PREFETCH_AHEAD, 0, 3)

enum { FORMAT_Q4 = 0, FORMAT_Q8 = 1, FORMAT_Q4_BF16DOT = 2, FORMAT_Q4_F32 = 3, FORMAT_Q4_VNNI = 4, FORMAT_Q4_AMX = 5 };

typedef struct {
    int format;
    const uint8_t *packed; /* the layout above */
    const float *scale;    /* q8: [quads * 4] */
    int64_t out, in;       /* out: the real outputs (the last quad may hold fewer) */
} weight_t;

typedef struct {
    weight_t w;
    const int16_t *xq; /* [rows, in]: x / sx, rounded */
    const float *sx;   /* [rows, in / 32]; q8: [rows] */
    const float *sumx; /* [rows, in / 32]: the exact fp32 sum of each block of x (bf16 dot: BF16DOT_SUMS a block) */
    const uint16_t *xb; /* q4 by the bf16 dot: [rows, in], x in bf16 */
    const float *xf;    /* q4 in fp32: [rows, in] */
    int64_t rows;
    void *y;           /* [rows, y_stride] of fp32 or bf16 */
    int64_t y_stride;
    int y_bf16;
    const int8_t *xd;   /* q4 by int8 digits: [rows, in / 32, 64] */
} job_t;

/* ------------------------------------------------------------------------------------- conversions */

static inline float half_to_float(uint16_t h) { /* exact, subnormals included */
#ifdef MATMUL_AVX2
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) u = sign | 0x7f800000u | (man << 13);
    else if (exp) u = sign | ((exp + 112u) << 23) | (man << 13);
    else if (!man) u = sign;
    else { /* subnormal: man * 2^-24 */
        int e = -1;
        uint32_t m = man;
        do { m <<= 1; e++; } while (!(m & 0x400u));
        u = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

static inline float sum8(const float *l) { /* a fixed tree over the 8 lanes */
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* One row of x, [in] fp32 or bf16 -> xq (|xq| <= limit), and per block sx and sum(x). Each row alone: its quantization
 * never depends on the other rows. A block's sum has one fixed order, the one 8-lane vectors give: lane l
 * adds inputs l, 8 + l, 16 + l and 24 + l in turn, then sum8's tree over the lanes. */
static void quantize_row(const void *x, int x_bf16, int64_t in, float limit, int16_t *xq, float *sx, float *sumx) {
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

static inline int64_t quads(const weight_t *w) { return (w->out + QUAD - 1) / QUAD; }

/* Bytes of one block of a quad, and of a quad's every block. */
static inline int64_t record_size(const weight_t *w) { return w->format == FORMAT_Q8 ? Q8_RECORD : Q4_RECORD; }
static inline int64_t quad_bytes(const weight_t *w) { return (w->in / GROUP) * record_size(w); }

static inline const uint8_t *record(const weight_t *w, int64_t quad, int64_t b) {
    return w->packed + (quad * (w->in / GROUP) + b) * record_size(w);
}

/* Output o of row `row`, in y's dtype. */
static inline void put_y(const job_t *j, int64_t row, int64_t o, float v) {
    if (j->y_bf16) ((uint16_t *)j->y)[row * j->y_stride + o] = f32_to_bf16(v);
    else ((float *)j->y)[row * j->y_stride + o] = v;
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

/* ------------------------------------------------------------------------------------- the products */

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
#ifdef __AVX512VNNI__
#define DPWSSD(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#else
#define DPWSSD(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif
/* 32 vector registers: up to 16 accumulators (8 rows x 2 output pairs), the quad's codes and d, one
 * row's x, temporaries. */
DEFINE_TILE512(8)
DEFINE_TILE512(4)
DEFINE_TILE512(2)
DEFINE_TILE512(1)
/* A quad's rows in tiles of 8, 4, 2, 1: its codes unpacked once a tile (q4 here, q8 below). */
#define DEFINE_QUADS(NAME)                                                                             \
static void quads_##NAME(const job_t *j, int64_t q_begin, int64_t q_end) {                             \
    for (int64_t q = q_begin; q < q_end; q++) {                                                        \
        int64_t r = 0;                                                                                 \
        for (; r + 8 <= j->rows; r += 8) tile_##NAME##_8(j, r, q);                                     \
        if (j->rows - r >= 4) { tile_##NAME##_4(j, r, q); r += 4; }                                    \
        if (j->rows - r >= 2) { tile_##NAME##_2(j, r, q); r += 2; }                                    \
        if (j->rows - r == 1) tile_##NAME##_1(j, r, q);                                                \
    }                                                                                                  \
}
#else
/* 16 vector registers: up to 12 accumulators (3 rows x 4 outputs), one output's codes, temporaries. */
DEFINE_TILE(3)
DEFINE_TILE(2)
DEFINE_TILE(1)
/* A quad's rows in tiles of 3, 2, 1: its codes unpacked once a tile (q4 here, q8 below). */
#define DEFINE_QUADS(NAME)                                                                             \
static void quads_##NAME(const job_t *j, int64_t q_begin, int64_t q_end) {                             \
    for (int64_t q = q_begin; q < q_end; q++) {                                                        \
        int64_t r = 0;                                                                                 \
        for (; r + 3 <= j->rows; r += 3) tile_##NAME##_3(j, r, q);                                     \
        if (j->rows - r == 2) tile_##NAME##_2(j, r, q);                                                \
        else if (j->rows - r == 1) tile_##NAME##_1(j, r, q);                                           \
    }                                                                                                  \
}
#endif
DEFINE_QUADS(q4)

/* ------------------------------------------------------------------------------------- the LM head (q8) */

/* q8 quantizes an activation row whole, where q4 takes it by blocks: xq = rint(x / s), s = max |x| / 32767, 15
 * bits of the row's largest value against the weights' 8 bits of theirs. One scale a row, so each (row,
 * output) is one exact integer sum over all its inputs, sum xq w, and the output (float)sum * s * scale[o]:
 * no scaling per block (at 32 rows the head took 7.4-8.3 ms against 10.3-12.0 with it), and the same
 * integer however the sum is split, so that any tiling, any batch and every build (AVX-512, AVX2, plain C)
 * give a row the same bits (invariant 4). The LM head's logits are approximate by design: the fp32
 * refinement recomputes the best of each row. */

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
 * are one stream, which the hardware prefetcher follows: with PREFETCH's hint as well, a one-row step took
 * 1.05-1.10x as long (AVX2-only Zen 3 VM, three runs of 600 alternating steps; no change at 8 and 32 rows). */
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

static void quads_q8(const job_t *j, int64_t q_begin, int64_t q_end) {
    for (int64_t q = q_begin; q < q_end; q++)
        for (int64_t r = 0; r < j->rows; r++) tile_q8_1(j, r, q);
}
#endif


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
 * instructions a block of a quad at any batch size, about half the old one-row cost.
 *
 * A (row, output)'s operations and their order do not depend on the rows beside it: invariant 4. */
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

static int run_quads(const job_t *j, int64_t q_begin, int64_t q_end) {
#ifdef MATMUL_BF16DOT
    if (j->w.format == FORMAT_Q4_BF16DOT) return quads_bf16dot(j, q_begin, q_end);
#endif
    if (j->w.format == FORMAT_Q4_F32) return quads_f32(j, q_begin, q_end);
    if (j->w.format == FORMAT_Q4) quads_q4(j, q_begin, q_end);
    else quads_q8(j, q_begin, q_end);
    return 0;
}

/* ------------------------------------------------------------------------------------- threads */

static void part_range(int64_t part, int64_t parts, int64_t unit, int64_t n, int64_t *begin, int64_t *end) {
    const int64_t units = (n + unit - 1) / unit;
    *begin = units * part / parts * unit;
    *end = units * (part + 1) / parts * unit;
    if (*end > n) *end = n;
    if (*begin > n) *begin = n;
}

typedef int (*range_fn)(const job_t *, int64_t, int64_t);

/* What is left of one thread's part: [front, back) of its work units, both ends in one word, so that its
 * owner (from the front) and a thief (from the back) never take the same unit. */
typedef struct {
    _Alignas(64) _Atomic uint64_t span; /* front in the low 32 bits, back in the high 32 */
} part_t;
#define MAX_PARTS 64
#define STEAL_BYTES 32768 /* about this many bytes of weights a take (8 KiB to 64 KiB: the same within 1 %) */

/* Takes up to `chunk` units from the front (from_back 0) or the back of *p into [*b, *e); 0 when empty. */
static int take(part_t *p, int64_t chunk, int from_back, int64_t *b, int64_t *e) {
    uint64_t s = atomic_load_explicit(&p->span, memory_order_relaxed);
    for (;;) {
        const int64_t front = (int64_t)(uint32_t)s, back = (int64_t)(s >> 32);
        if (front >= back) return 0;
        const int64_t n = back - front < chunk ? back - front : chunk;
        const int64_t nf = from_back ? front : front + n, nb = from_back ? back - n : back;
        if (atomic_compare_exchange_weak_explicit(&p->span, &s, (uint64_t)nb << 32 | (uint64_t)nf,
                                                  memory_order_relaxed, memory_order_relaxed)) {
            *b = from_back ? nb : front;
            *e = from_back ? back : nf;
            return 1;
        }
    }
}

/* n units of work (groups or quads; `unit` of them the split's granularity, `chunk` a take) on an OpenMP team:
 * the library is linked against the libgomp torch has loaded (same soname), so these are torch's own intra-op
 * threads, already spinning after torch's last op (a pool of our own beside them made the two fight for the
 * cores: a 1-row step took 38.7 against 16.4 ms with torch's threads told not to spin). Each thread streams
 * its own contiguous part, `chunk` units at a time from the front; one that runs out takes what is left of
 * the others' from their back, a chunk at a time. With the parts fixed, the faster of two threads had
 * waited for the other at the end of each of a step's 120 matmuls: 0.39-0.55 ms of a one-row step's 2.4-2.5 ms
 * in them (Zen 3 VM, AVX2 only, two vCPUs that get uneven time); taking each other's tails, a step took
 * 0.98-0.99x as long at 1 row, 0.98x at 8 and 32 (medians, in-process alternation; docs/benchmarks.md).
 * Which thread computes a unit never changes its bits. */
static int run_parts(range_fn fn, const job_t *j, int64_t n, int64_t unit, int64_t chunk, int64_t threads) {
    const int64_t units = (n + unit - 1) / unit;
    if (threads > units) threads = units;
    if (threads > MAX_PARTS) threads = MAX_PARTS;
    if (threads <= 1) return fn(j, 0, n);
    part_t parts[MAX_PARTS];
    for (int64_t p = 0; p < threads; p++) {
        int64_t begin, end;
        part_range(p, threads, unit, n, &begin, &end);
        atomic_init(&parts[p].span, (uint64_t)end << 32 | (uint64_t)begin);
    }
    int err = 0;
#pragma omp parallel num_threads((int)threads) reduction(| : err)
    {
        const int64_t me = omp_get_thread_num();
        int64_t b, e;
        while (!err && take(&parts[me], chunk, 0, &b, &e)) err |= fn(j, b, e);
        /* then the others' (a team smaller than asked leaves parts with no owner: these take them too) */
        for (int64_t k = 1; k < threads && !err; k++)
            while (!err && take(&parts[(me + k) % threads], chunk, 1, &b, &e)) err |= fn(j, b, e);
    }
    return err;
}

/* Chunks of about STEAL_BYTES of weights, in whole units. */
static int64_t steal_chunk(int64_t unit_bytes, int64_t unit) {
    const int64_t units = STEAL_BYTES / (unit_bytes * unit);
    return (units > 1 ? units : 1) * unit;
}

static int run(const job_t *j, int64_t threads) {
    return run_parts(run_quads, j, quads(&j->w), SPLIT_QUADS, steal_chunk(quad_bytes(&j->w), SPLIT_QUADS), threads);
}

/* q4 by int8 digits (q4_matmul_avx2 on any AVX2 CPU; q4_matmul_vnni where the CPU has AVX512_VNNI;
 * q4_matmul_amx where it also has AMX_INT8 and the OS grants the tile state). The integer kernel's exact
 * products, by the byte dot instructions: each row is quantized per block to 16-bit integers as there
 * (|xq| <= XD_MAX), and xq = 256 hi + lo split into two signed bytes; the codes (0-15) times each digit sum
 * exactly in int32, S = 256 S_hi + S_lo (|S| < 2^24, so exact in fp32 too). Then per block, in order, acc += S * (d * sx) and accm += m * sum(x_b), in fp32 over a
 * group's 16 outputs, and y = acc + accm.
 *
 * Two units, one result. The vector kernel (vpdpbusd) takes a block's 16 outputs x 32 inputs as 8 registers
 * of 16 dwords (dword n: output n's codes of 4 inputs), so a row costs 16 instructions a block with no
 * reduction across lanes; the tile kernel (tdpbssd) stores the same 8 registers as the B tile and does 16
 * rows per instruction. The integer sums are exact whatever the unit's order, and the fp32 steps after them
 * are the same instructions in the same order, so both give the same bits: q4_matmul_amx takes a batch of
 * fewer than AMX_MIN_ROWS rows to the vector kernel (too few rows to share the tile unit's fixed cost a
 * block: B stored and loaded, C stored and read back) and a larger one to the tiles, and invariant 4 holds
 * across the switch (a row's result does not depend on the batch's size). */
/* The digit kernel's units; DIGITS_AMX is q4_matmul_amx's choice: the vector unit below AMX_MIN_ROWS rows, the
 * tiles from there. */
typedef enum { DIGITS_AVX2, DIGITS_VNNI, DIGITS_TILES, DIGITS_AMX } digit_unit_t;
#if defined(MATMUL_AVX2) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define MATMUL_DIGITS 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define DIGIT_OUTPUTS 16 /* a group: 4 quads, one register of 16 int32 / fp32 */
#define DIGIT_QUADS (DIGIT_OUTPUTS / QUAD)
#define XD_MAX 32639.0f  /* 127 * 256 + 127: both digits of every |xq| <= XD_MAX fit a signed byte */
#define XD_BLOCK 64      /* a row's bytes a block: its 32 high digits, then its 32 low ones */
#define DIGIT_RECORD 320 /* a group's bytes a block (pack_q4's digits layout): 256 of codes, 16 d, 16 m */
#define AMX_ROWS 16      /* a tile's rows */
/* Below this many rows q4_matmul_amx runs the vector kernel: the tiles cost the same up to 16 rows (a tile
 * padded with zero rows), the vector kernel a row's worth more with each row; the 120 matmuls of a SmolLM2
 * step on the Intel VM cross there (docs/benchmarks.md). */
#define AMX_MIN_ROWS 13
#define ARCH_REQ_XCOMP_PERM 0x1023 /* arch_prctl: ask for a dynamically enabled state component */
#define XFEATURE_XTILEDATA 18
/* A group's blocks are one stream (with the 4 quads' records apart, as the other kernels read them, a one-row
 * step in the engine took 4.0-4.2 ms against the bf16 dot kernel's 3.7-3.8), its lines asked for PREFETCH_AHEAD
 * bytes ahead into L2 (prefetcht1) rather than L1: a one-row pass of a step's 120 matmuls, cold (the weights
 * evicted from the Intel VM's 480 MiB L3 before each pass), 4.32-4.42 against 5.01-5.11 ms, three
 * alternating runs each. */
#define DIGIT_PREFETCH(p) __builtin_prefetch((const char *)(p) + PREFETCH_AHEAD, 0, 2)

typedef int32_t __attribute__((may_alias, aligned(1))) dword_t; /* four digits, read as one broadcast */

/* Row r's digits: xq (|xq| <= XD_MAX) -> [blocks, hi 32 | lo 32] (lo = xq's low byte, signed; hi = (xq - lo)
 * / 256). AVX2 only: it runs before the CPU's AVX-512 is asked about. */
static void digits_row(const int16_t *xq, int64_t in, int8_t *xd) {
    for (int64_t b = 0; b < in / GROUP; b++, xd += XD_BLOCK) {
        __m256i hi[2], lo[2];
        for (int h = 0; h < 2; h++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(xq + b * GROUP + 16 * h));
            lo[h] = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8);
            hi[h] = _mm256_srai_epi16(_mm256_sub_epi16(v, lo[h]), 8);
        }
        /* packs interleaves 128-bit halves; the permute puts them back (no value saturates) */
        _mm256_storeu_si256((__m256i *)xd, _mm256_permute4x64_epi64(_mm256_packs_epi16(hi[0], hi[1]), 0xd8));
        _mm256_storeu_si256((__m256i *)(xd + GROUP), _mm256_permute4x64_epi64(_mm256_packs_epi16(lo[0], lo[1]), 0xd8));
    }
}

typedef struct {
    int8_t *xd; /* [x_rows, blocks, XD_BLOCK]: rows past `rows` zero */
    float *sx;  /* [x_rows, blocks] scales, then [x_rows, blocks] sums of x (rows past `rows` zero) */
} digits_t;

/* Row r of x quantized and split into its digits. */
static void digits_prepare_row(const void *x, int x_bf16, int64_t x_stride, size_t elem, int64_t r, int64_t x_rows,
                               int64_t in, int16_t *xq, digits_t *out) {
    const int64_t blocks = in / GROUP;
    quantize_row((const char *)x + (size_t)(r * x_stride) * elem, x_bf16, in, XD_MAX, xq + r * in,
                 out->sx + r * blocks, out->sx + (x_rows + r) * blocks);
    digits_row(xq + r * in, in, out->xd + r * in * 2);
}

/* x's rows quantized and split (x_rows >= rows: the zero rows a tile pads with). */
static int digits_prepare(const void *x, int x_bf16, int64_t x_stride, int64_t rows, int64_t x_rows, int64_t in,
                          int64_t threads, digits_t *out) {
    const int64_t blocks = in / GROUP;
    int16_t *xq = malloc((size_t)(rows * in) * sizeof *xq);
    out->xd = calloc((size_t)(x_rows * in * 2), 1);
    out->sx = calloc((size_t)(2 * x_rows * blocks), sizeof *out->sx);
    if (!xq || !out->xd || !out->sx) {
        free(xq);
        free(out->xd);
        free(out->sx);
        return -ENOMEM;
    }
    const size_t elem = x_bf16 ? 2 : 4;
    if (threads > 1 && rows > 1) {
#pragma omp parallel for num_threads((int)threads) schedule(static)
        for (int64_t r = 0; r < rows; r++) digits_prepare_row(x, x_bf16, x_stride, elem, r, x_rows, in, xq, out);
    } else { /* no OpenMP region at all: an if(0) one still cost 0.2-0.6 us a call, 120 calls a step */
        for (int64_t r = 0; r < rows; r++) digits_prepare_row(x, x_bf16, x_stride, elem, r, x_rows, in, xq, out);
    }
    free(xq);
    return 0;
}

/* The AVX2 unit (any CPU this build runs on): the same exact sums by vpmaddubsw, whose pairs (codes 0-15
 * times a signed digit, |pair| <= 3840) add in 16 bits over a block's 8 dwords of 4 inputs (<= 30720, no
 * wrap), widened by vpmaddwd; then the same fp32 steps as digit_scale, 8 outputs a register. A block's two
 * halves (outputs 0-7, 8-15) share each broadcast of a row's digits: with the halves one after the other
 * over the blocks (fewer registers live), a 32-row matmul in cache took 1.27x as long (AMD VM, AVX2 build), a
 * one-row one 1.12x (Zen 3, AVX2 only); the halves one after the other within each block, the broadcasts read
 * again for the second so that nothing spills, 1.3x there. On that host one row is held by these
 * instructions and the memory alike: the weights in cache went 7-21 % faster, and with half the byte
 * products (8-bit activations, not kept) the step from memory went no faster (docs/benchmarks.md). */
static inline void digit_store_avx2(const job_t *j, int64_t row, int64_t o, __m256 acc, __m256 accm) {
    const __m256 v = _mm256_add_ps(acc, accm);
    const int64_t real = j->w.out - o;
    if (real <= 0) return;
    if (!j->y_bf16) {
        float *y = (float *)j->y + row * j->y_stride + o;
        if (real >= 8) {
            _mm256_storeu_ps(y, v);
        } else {
            float t[8];
            _mm256_storeu_ps(t, v);
            memcpy(y, t, (size_t)real * sizeof *t);
        }
        return;
    }
    /* f32_to_bf16's rounding and NaN, 8 at once (digit_store's, lane for lane) */
    const __m256i u = _mm256_castps_si256(v);
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                                              _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i b = _mm256_blendv_epi8(rounded, quiet, nan);
    /* 8 dwords < 2^16 -> 8 words: packus within 128-bit lanes, then the lanes' low halves together */
    const __m128i w = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08));
    uint16_t *y = (uint16_t *)j->y + row * j->y_stride + o;
    if (real >= 8) {
        _mm_storeu_si128((__m128i *)y, w);
    } else {
        uint16_t t[8];
        _mm_storeu_si128((__m128i *)t, w);
        memcpy(y, t, (size_t)real * sizeof *t);
    }
}

#define DEFINE_TILE_AVX2(RT)                                                                           \
static void tile_avx2_##RT(const job_t *j, int64_t r0, int64_t g) {                                    \
    const int64_t blocks = j->w.in / GROUP;                                                            \
    const uint8_t *group = j->w.packed + g * blocks * DIGIT_RECORD;                                    \
    const __m256i nibble = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);                        \
    __m256 acc[RT][2], accm[RT][2];                                                                    \
    for (int r = 0; r < RT; r++) acc[r][0] = acc[r][1] = accm[r][0] = accm[r][1] = _mm256_setzero_ps(); \
    for (int64_t b = 0; b < blocks; b++) {                                                             \
        const uint8_t *rec = group + b * DIGIT_RECORD;                                                 \
        for (int line = 0; line < DIGIT_RECORD; line += 64) DIGIT_PREFETCH(rec + line);                \
        __m256i hi[RT][2], lo[RT][2];                                                                  \
        for (int r = 0; r < RT; r++) hi[r][0] = hi[r][1] = lo[r][0] = lo[r][1] = _mm256_setzero_si256(); \
        for (int k = 0; k < 4; k++) {                                                                  \
            __m256i wl[2], wh[2];                                                                      \
            for (int h = 0; h < 2; h++) {                                                              \
                const __m256i c = _mm256_loadu_si256((const __m256i *)(rec + 64 * k + 32 * h));        \
                wl[h] = _mm256_and_si256(c, nibble);                                                   \
                wh[h] = _mm256_and_si256(_mm256_srli_epi16(c, 4), nibble);                             \
            }                                                                                          \
            for (int r = 0; r < RT; r++) {                                                             \
                const dword_t *xd = (const dword_t *)(j->xd + ((r0 + r) * blocks + b) * XD_BLOCK);     \
                const __m256i xh0 = _mm256_set1_epi32(xd[k]), xh1 = _mm256_set1_epi32(xd[k + 4]);      \
                const __m256i xl0 = _mm256_set1_epi32(xd[8 + k]), xl1 = _mm256_set1_epi32(xd[12 + k]); \
                for (int h = 0; h < 2; h++) {                                                          \
                    hi[r][h] = _mm256_add_epi16(hi[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(wl[h], xh0), \
                                                                           _mm256_maddubs_epi16(wh[h], xh1))); \
                    lo[r][h] = _mm256_add_epi16(lo[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(wl[h], xl0), \
                                                                           _mm256_maddubs_epi16(wh[h], xl1))); \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
        for (int h = 0; h < 2; h++) {                                                                  \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 256 + 16 * h)));  \
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 288 + 16 * h)));  \
            for (int r = 0; r < RT; r++) {                                                             \
                const int64_t at = (r0 + r) * blocks + b;                                              \
                const __m256i s = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(hi[r][h], ones), 8), \
                                                   _mm256_madd_epi16(lo[r][h], ones));                 \
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s),                                     \
                                            _mm256_mul_ps(d, _mm256_set1_ps(j->sx[at])), acc[r][h]);   \
                accm[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(j->sumx[at]), accm[r][h]);              \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
    for (int r = 0; r < RT; r++)                                                                       \
        for (int h = 0; h < 2; h++) digit_store_avx2(j, r0 + r, g * DIGIT_OUTPUTS + 8 * h, acc[r][h], accm[r][h]); \
}
DEFINE_TILE_AVX2(4)
DEFINE_TILE_AVX2(3)
DEFINE_TILE_AVX2(2)
DEFINE_TILE_AVX2(1)

/* A vector unit's groups g_begin .. g_end - 1 (one thread's part), rows in tiles of 4, then 3, 2 or 1. */
#define DEFINE_DIGIT_GROUPS(UNIT)                                                                      \
static int groups_##UNIT(const job_t *j, int64_t g_begin, int64_t g_end) {                             \
    for (int64_t g = g_begin; g < g_end; g++) {                                                        \
        int64_t r = 0;                                                                                 \
        for (; r + 4 <= j->rows; r += 4) tile_##UNIT##_4(j, r, g);                                     \
        switch (j->rows - r) {                                                                         \
        case 3: tile_##UNIT##_3(j, r, g); break;                                                       \
        case 2: tile_##UNIT##_2(j, r, g); break;                                                       \
        case 1: tile_##UNIT##_1(j, r, g); break;                                                       \
        }                                                                                              \
    }                                                                                                  \
    return 0;                                                                                          \
}
DEFINE_DIGIT_GROUPS(avx2)

/* AVX512_VNNI (with F and BW) and the AVX-512 state enabled by the OS, asked of this CPU once. */
static int cpu_has_vnni(void) {
    static int has = -1;
    if (has < 0) {
        __builtin_cpu_init();
        has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
              __builtin_cpu_supports("avx512vnni");
    }
    return has;
}

/* AMX_INT8 and AMX_TILE (CPUID leaf 7: EDX bits 25, 24) beside VNNI, and the kernel's leave to use the tile
 * data (arch_prctl, Linux 5.16 and later; once a process, for all its threads), asked once. */
static int amx_ready(void) {
    static int ready = -1;
    if (ready < 0) {
        unsigned a, b, c, d;
        ready = cpu_has_vnni() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 25 & 1) && (d >> 24 & 1) &&
                syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return ready;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,amx-tile,amx-int8")

/* Block b of group g (pack_q4's digits layout: 320 bytes a block): w[k] dword n = output n's codes of inputs
 * 4k .. 4k + 3, a byte each (k < 4: chunk k's low nibbles; k >= 4: chunk k - 4's high nibbles, inputs 16 +
 * ...); its 16 d and 16 m in fp32. */
static inline __attribute__((always_inline)) void digit_codes(const job_t *j, int64_t g, int64_t b, __m512i w[8],
                                                              __m512 *d, __m512 *m) {
    const uint8_t *rec = j->w.packed + (g * (j->w.in / GROUP) + b) * DIGIT_RECORD;
    for (int line = 0; line < DIGIT_RECORD; line += 64) DIGIT_PREFETCH(rec + line);
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    for (int k = 0; k < 4; k++) {
        const __m512i c = _mm512_loadu_si512(rec + 64 * k);
        w[k] = _mm512_and_si512(c, nibble);
        w[k + 4] = _mm512_and_si512(_mm512_srli_epi16(c, 4), nibble);
    }
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 256)));
    *m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 288)));
}

/* One block's exact sums S of a row into its accumulators: the step both kernels share, so the same bits. */
static inline __attribute__((always_inline)) void digit_scale(__m512i s, __m512 d, __m512 m, float sx, float sumx,
                                                              __m512 *acc, __m512 *accm) {
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(sx)), *acc);
    *accm = _mm512_fmadd_ps(m, _mm512_set1_ps(sumx), *accm);
}

/* Row `row`'s 16 outputs of a group, y = acc + accm, in y's dtype (f32_to_bf16's rounding and NaN, 16 at once). */
static inline __attribute__((always_inline)) void digit_store(const job_t *j, int64_t row, int64_t q0, __m512 acc,
                                                              __m512 accm) {
    const __m512 v = _mm512_add_ps(acc, accm);
    const int64_t o = q0 * QUAD, real = j->w.out - o;
    const __mmask16 keep = real >= DIGIT_OUTPUTS ? (__mmask16)0xffff : (__mmask16)((1u << real) - 1);
    if (!j->y_bf16) {
        _mm512_mask_storeu_ps((float *)j->y + row * j->y_stride + o, keep, v);
        return;
    }
    const __m512i u = _mm512_castps_si512(v);
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                              _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i b = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_mask_storeu_epi16((uint16_t *)j->y + row * j->y_stride + o, keep, _mm512_cvtepi32_epi16(b));
}

#define DEFINE_TILE_VNNI(RT)                                                                           \
static void tile_vnni_##RT(const job_t *j, int64_t r0, int64_t g) {                                    \
    const int64_t blocks = j->w.in / GROUP;                                                            \
    const float *sx = j->sx, *sumx = j->sumx;                                                          \
    __m512 acc[RT], accm[RT];                                                                          \
    for (int r = 0; r < RT; r++) acc[r] = accm[r] = _mm512_setzero_ps();                               \
    for (int64_t b = 0; b < blocks; b++) {                                                             \
        __m512i w[8];                                                                                  \
        __m512 d, m;                                                                                   \
        digit_codes(j, g, b, w, &d, &m);                                                               \
        for (int r = 0; r < RT; r++) {                                                                 \
            const int64_t at = (r0 + r) * blocks + b;                                                  \
            const dword_t *xd = (const dword_t *)(j->xd + at * XD_BLOCK);                              \
            __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;                            \
            for (int k = 0; k < 8; k += 2) {                                                           \
                h0 = _mm512_dpbusd_epi32(h0, w[k], _mm512_set1_epi32(xd[k]));                          \
                h1 = _mm512_dpbusd_epi32(h1, w[k + 1], _mm512_set1_epi32(xd[k + 1]));                  \
                l0 = _mm512_dpbusd_epi32(l0, w[k], _mm512_set1_epi32(xd[8 + k]));                      \
                l1 = _mm512_dpbusd_epi32(l1, w[k + 1], _mm512_set1_epi32(xd[9 + k]));                  \
            }                                                                                          \
            const __m512i s = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), 8),         \
                                               _mm512_add_epi32(l0, l1));                              \
            digit_scale(s, d, m, sx[at], sumx[at], &acc[r], &accm[r]);                                 \
        }                                                                                              \
    }                                                                                                  \
    for (int r = 0; r < RT; r++) digit_store(j, r0 + r, g * DIGIT_QUADS, acc[r], accm[r]);             \
}
DEFINE_TILE_VNNI(4)
DEFINE_TILE_VNNI(3)
DEFINE_TILE_VNNI(2)
DEFINE_TILE_VNNI(1)

DEFINE_DIGIT_GROUPS(vnni)

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config_t;

/* Tiles 0, 1: C of the high and the low digits ([m rows, 16 int32]); 2, 3: A, those digits of m rows of a
 * block; 4: B, a block's codes of 16 outputs ([8 rows of 4 inputs, 16 outputs x 4 bytes]). 16 rows a tile
 * (x padded with zero rows to a multiple of 16). Loaded by every thread at the
 * start of every call: torch's own AMX kernels (oneDNN) share these threads and load their own between ours. */
static void amx_configure(void) {
    amx_config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = c.rows[1] = c.rows[2] = c.rows[3] = AMX_ROWS;
    c.colsb[0] = c.colsb[1] = DIGIT_OUTPUTS * 4;
    c.colsb[2] = c.colsb[3] = GROUP;
    c.rows[4] = GROUP / 4;
    c.colsb[4] = DIGIT_OUTPUTS * 4;
    _tile_loadconfig(&c);
}

/* A group's blocks unpacked once for all its rows: per block the B tile (8 rows of 64 bytes), then its 16 d
 * and its 16 m, in fp32. */
typedef struct {
    __m512i b[8];
    __m512 d, m;
} amx_block_t;

/* The tile operations of block b for 16 rows of x starting at `a` (the block's digits of the first), into
 * c (C of the high digits, then of the low). */
static inline __attribute__((always_inline)) void amx_products(const amx_block_t *blk, const int8_t *a,
                                                               int64_t x_stride, int32_t *c) {
    _tile_loadd(4, blk->b, DIGIT_OUTPUTS * 4);
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, a, x_stride);
    _tile_loadd(3, a + GROUP, x_stride);
    _tile_dpbssd(0, 2, 4);
    _tile_dpbssd(1, 3, 4);
    _tile_stored(0, c, DIGIT_OUTPUTS * 4);
    _tile_stored(1, c + AMX_ROWS * DIGIT_OUTPUTS, DIGIT_OUTPUTS * 4);
}

/* Rows r0 .. r0 + RT - 1 of a group (x padded with zero rows to a multiple of 16, so all RT exist), `count`
 * of them real: first the offset term, blocks in order; then the products, the tile unit one block ahead of
 * the scaling (two C buffers), each row's acc in a register. */
#define DEFINE_AMX_ROWS(RT)                                                                            \
static void amx_rows_##RT(const job_t *j, const amx_block_t *blk, int64_t r0, int count, int64_t q0,   \
                          int32_t (*c)[2 * AMX_ROWS * DIGIT_OUTPUTS]) {                                \
    const int64_t blocks = j->w.in / GROUP, x_stride = blocks * XD_BLOCK;                              \
    const float *sx = j->sx + r0 * blocks, *sumx = j->sumx + r0 * blocks;                              \
    const int8_t *xd = j->xd + r0 * x_stride;                                                          \
    __m512 acc[RT], accm[RT];                                                                          \
    for (int r = 0; r < RT; r++) acc[r] = accm[r] = _mm512_setzero_ps();                               \
    for (int64_t b = 0; b < blocks; b++)                                                               \
        for (int r = 0; r < RT; r++)                                                                   \
            accm[r] = _mm512_fmadd_ps(blk[b].m, _mm512_set1_ps(sumx[r * blocks + b]), accm[r]);        \
    amx_products(&blk[0], xd, x_stride, c[0]);                                                         \
    for (int64_t b = 0; b < blocks; b++) {                                                             \
        if (b + 1 < blocks) amx_products(&blk[b + 1], xd + (b + 1) * XD_BLOCK, x_stride, c[(b + 1) & 1]); \
        const int32_t *cb = c[b & 1];                                                                  \
        for (int r = 0; r < RT; r++) {                                                                 \
            const __m512i s = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(cb + 16 * r), 8),   \
                                               _mm512_load_si512(cb + AMX_ROWS * DIGIT_OUTPUTS + 16 * r)); \
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s),                                            \
                                     _mm512_mul_ps(blk[b].d, _mm512_set1_ps(sx[r * blocks + b])), acc[r]); \
        }                                                                                              \
    }                                                                                                  \
    for (int r = 0; r < count; r++) digit_store(j, r0 + r, q0, acc[r], accm[r]);                       \
}
DEFINE_AMX_ROWS(16)
DEFINE_AMX_ROWS(8)

/* j->xd's, j->sx's and j->sumx's rows are padded with zero rows to a multiple of 16 (matmul_digits). */
static int groups_amx(const job_t *j, int64_t g_begin, int64_t g_end) {
    const int64_t rows = j->rows, blocks = j->w.in / GROUP;
    amx_block_t *blk = aligned_alloc(64, (size_t)blocks * sizeof *blk);
    if (!blk) return -ENOMEM;
    __attribute__((aligned(64))) int32_t c[2][2 * AMX_ROWS * DIGIT_OUTPUTS];
    amx_configure();
    for (int64_t g = g_begin; g < g_end; g++) {
        const int64_t q0 = g * DIGIT_QUADS;
        for (int64_t b = 0; b < blocks; b++) digit_codes(j, g, b, blk[b].b, &blk[b].d, &blk[b].m);
        for (int64_t r0 = 0; r0 < rows; r0 += AMX_ROWS) {
            const int count = (int)(rows - r0 < AMX_ROWS ? rows - r0 : AMX_ROWS);
            if (count <= 8) amx_rows_8(j, blk, r0, count, q0, c);
            else amx_rows_16(j, blk, r0, count, q0, c);
        }
    }
    _tile_release();
    free(blk);
    return 0;
}
#pragma GCC pop_options

static int run_groups(range_fn fn, const job_t *j, int64_t threads) {
    const int64_t groups = (quads(&j->w) + DIGIT_QUADS - 1) / DIGIT_QUADS;
    return run_parts(fn, j, groups, 1, steal_chunk((j->w.in / GROUP) * DIGIT_RECORD, 1), threads);
}

/* unit: DIGITS_AVX2, DIGITS_VNNI or DIGITS_TILES. */
static int matmul_digits(digit_unit_t unit, const void *x, int x_bf16, int64_t x_stride, int64_t rows,
                         const uint8_t *packed, int64_t out, int64_t in, void *y, int y_bf16, int64_t y_stride,
                         int64_t threads) {
    if (in % GROUP || in <= 0 || out <= 0 || rows < 0) return -EINVAL;
    if (!rows) return 0;
    const int64_t blocks = in / GROUP, tiles = unit == DIGITS_TILES;
    const int64_t x_rows = tiles ? (rows + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS : rows;
    digits_t dg;
    const int err0 = digits_prepare(x, x_bf16, x_stride, rows, x_rows, in, threads, &dg);
    if (err0) return err0;
    const job_t j = {.w = {tiles ? FORMAT_Q4_AMX : FORMAT_Q4_VNNI, packed, NULL, out, in}, .sx = dg.sx,
                     .sumx = dg.sx + x_rows * blocks, .rows = rows, .y = y, .y_stride = y_stride, .y_bf16 = y_bf16,
                     .xd = dg.xd};
    const int err = run_groups(tiles ? groups_amx : unit == DIGITS_VNNI ? groups_vnni : groups_avx2, &j, threads);
    free(dg.xd);
    free(dg.sx);
    return err;
}
#endif

/* ------------------------------------------------------------------------------------- entry points */

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
    const int err = run(&j, threads);
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

/* y [rows, out] = x [rows, in] @ (codes * scale[:, None])^T, codes int8 packed as above, x quantized by rows
 * (the LM head above). */
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
    const int err = run(&j, threads);
    free(xq);
    free(sx);
    return err;
}

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
    const int err = run(&j, threads);
    free(xb);
    free(sums);
    return err;
#else
    (void)x, (void)x_bf16, (void)x_stride, (void)rows, (void)packed, (void)out, (void)in, (void)y, (void)y_bf16,
        (void)y_stride, (void)threads;
    return -ENOSYS;
#endif
}

/* y [rows, out] = x [rows, in] @ W^T as q4_matmul, in fp32: the file's weights dequantized once a block for
 * all rows (fma(q, d, m) in fp32) times x in fp32 (bf16 x widened exactly), fp32 sums (q4 in fp32 above). */
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
    const int err = run(&j, threads);
    free(xf);
    return err;
}

/* The int8 digit kernels' entry points (MATMUL_DIGITS above). -ENOSYS where this build has no such kernel or
 * the CPU (AVX512_VNNI; AMX_INT8 for the tiles, DIGITS_AMX included) or the OS (the tile state) does not offer
 * the unit. */
static int digits_entry(digit_unit_t unit, const void *x, int x_bf16, int64_t x_stride, int64_t rows,
                        const uint8_t *packed, int64_t out, int64_t in, void *y, int y_bf16, int64_t y_stride,
                        int64_t threads) {
#ifdef MATMUL_DIGITS
    if (unit == DIGITS_VNNI ? !cpu_has_vnni() : unit != DIGITS_AVX2 && !amx_ready()) return -ENOSYS;
    if (unit == DIGITS_AMX) unit = rows >= AMX_MIN_ROWS ? DIGITS_TILES : DIGITS_VNNI;
    return matmul_digits(unit, x, x_bf16, x_stride, rows, packed, out, in, y, y_bf16, y_stride, threads);
#else
    (void)unit, (void)x, (void)x_bf16, (void)x_stride, (void)rows, (void)packed, (void)out, (void)in, (void)y,
        (void)y_bf16, (void)y_stride, (void)threads;
    return -ENOSYS;
#endif
}

/* y [rows, out] = x [rows, in] @ W^T as q4_matmul_vnni, with the same bits, by AVX2 alone (any CPU an AVX2
 * build runs on). */
int q4_matmul_avx2(const void *x, int x_bf16, int64_t x_stride, int64_t rows, const uint8_t *packed, int64_t out,
                   int64_t in, void *y, int y_bf16, int64_t y_stride, int64_t threads) {
    return digits_entry(DIGITS_AVX2, x, x_bf16, x_stride, rows, packed, out, in, y, y_bf16, y_stride, threads);
}

/* y [rows, out] = x [rows, in] @ W^T as q4_matmul, by int8 digits on the vector unit (weights in pack_q4's
 * digits layout). */
int q4_matmul_vnni(const void *x, int x_bf16, int64_t x_stride, int64_t rows, const uint8_t *packed, int64_t out,
                   int64_t in, void *y, int y_bf16, int64_t y_stride, int64_t threads) {
    return digits_entry(DIGITS_VNNI, x, x_bf16, x_stride, rows, packed, out, in, y, y_bf16, y_stride, threads);
}

/* The same bits as q4_matmul_vnni, by AMX tiles from AMX_MIN_ROWS rows on. */
int q4_matmul_amx(const void *x, int x_bf16, int64_t x_stride, int64_t rows, const uint8_t *packed, int64_t out,
                  int64_t in, void *y, int y_bf16, int64_t y_stride, int64_t threads) {
    return digits_entry(DIGITS_AMX, x, x_bf16, x_stride, rows, packed, out, in, y, y_bf16, y_stride, threads);
}

/* q4_matmul_amx with the tiles at any batch size: the tests' proof that both units give the same bits. */
int q4_matmul_amx_tiles(const void *x, int x_bf16, int64_t x_stride, int64_t rows, const uint8_t *packed,
                        int64_t out, int64_t in, void *y, int y_bf16, int64_t y_stride, int64_t threads) {
    return digits_entry(DIGITS_TILES, x, x_bf16, x_stride, rows, packed, out, in, y, y_bf16, y_stride, threads);
}
