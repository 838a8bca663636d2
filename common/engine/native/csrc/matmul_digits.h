/* What the int8 digit kernels share (matmul_q4_digits.c: GGUF Q4_0 / Q4_1; matmul_kquants.c: the K-quants and
 * Q8_0): x's rows quantized per block of 32 inputs to 16-bit integers xq (|xq| <= XD_MAX) and each split into
 * two signed bytes, xq = 256 hi + lo, so that the byte dot instructions (vpdpbusd, vpmaddubsw, AMX's
 * tdpbssd) multiply them with the file's codes exactly; and the stores of a group's 16 outputs. Built by
 * GCC 11 or later for an AVX2 target (MATMUL_DIGITS); the AVX-512 parts are compiled for those instructions
 * alone (target pragmas) and run where the CPU has them (cpu_has_vnni).
 */
#ifndef HANDOFF_MATMUL_DIGITS_H
#define HANDOFF_MATMUL_DIGITS_H

#include "matmul.h"

#if defined(MATMUL_AVX2) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define MATMUL_DIGITS 1
#define DIGIT_QUADS (DIGIT_OUTPUTS / QUAD) /* a group's quads */
#define XD_MAX 32639.0f  /* 127 * 256 + 127: both digits of every |xq| <= XD_MAX fit a signed byte */
#define XD_BLOCK 64      /* a row's bytes a block: its 32 high digits, then its 32 low ones */
#define XQ_SUMS 16       /* inputs an entry of digits_t's xq_sums */
/* A group's blocks are one stream (with the 4 quads' records apart, as the other kernels read them, a one-row
 * step was slower than the bf16 dot kernel's), its lines asked for PREFETCH_AHEAD bytes ahead into L2
 * (prefetcht1) rather than L1, which a cold one-row pass ran faster with (docs/benchmarks.md,
 * "Figures behind the code": Digit kernels: one stream, prefetched into L2). */
#define DIGIT_PREFETCH(p) __builtin_prefetch((const char *)(p) + PREFETCH_AHEAD, 0, 2)

typedef int32_t __attribute__((may_alias, aligned(1))) dword_t; /* four digits, read as one broadcast */

/* What digits_prepare asks for beyond the digits, scales and sums of x. */
enum { DIGITS_KEEP_XQ = 1, DIGITS_XQ_SUMS = 2 };

typedef struct {
    int8_t *xd;       /* [x_rows, blocks, XD_BLOCK]: rows past `rows` zero */
    float *sx;        /* [x_rows, blocks] scales, then [x_rows, blocks] sums of x (rows past `rows` zero) */
    int16_t *xq;      /* DIGITS_KEEP_XQ: [rows, in], the integers the digits split */
    int32_t *xq_sums; /* DIGITS_XQ_SUMS: [rows, in / XQ_SUMS], their exact sums */
} digits_t;

/* x's rows quantized and split (x_rows >= rows: the zero rows a tile pads with), with what `want` asks for
 * (DIGITS_*). 0 or -ENOMEM; digits_free releases it. */
HIDDEN int digits_prepare(const void *x, int x_bf16, int64_t x_stride, int64_t rows, int64_t x_rows, int64_t in,
                          int64_t threads, int want, digits_t *out);
HIDDEN void digits_free(digits_t *d);

/* AVX512_VNNI (with F and BW) and the AVX-512 state enabled by the OS, asked of this CPU once. */
HIDDEN int cpu_has_vnni(void);

/* Row `row`'s 8 outputs o .. o + 7, y = acc + accm, in y's dtype (those past w.out not written). */
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

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
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
#pragma GCC pop_options
#endif

#endif
