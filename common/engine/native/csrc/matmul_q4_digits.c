/* The int8 digit Q4 kernels: q4_matmul_avx2 on any AVX2 CPU (the default there); q4_matmul_vnni where the CPU
 * has AVX512_VNNI; q4_matmul_amx where it also has AMX_INT8 and the OS grants the tile state. The integer
 * kernel's exact products (matmul_q4_int.c), by the byte dot instructions: each row is quantized per block to
 * 16-bit integers as there (|xq| <= XD_MAX), and xq = 256 hi + lo split into two signed bytes; the codes
 * (0-15) times each digit sum exactly in int32, S = 256 S_hi + S_lo (|S| < 2^24, so exact in fp32 too). Then
 * per block, in order, acc += S * (d * sx) and accm += m * sum(x_b), in fp32 over a group's 16 outputs, and
 * y = acc + accm. The weights are packed in an order of their own (pack_q4's digits layout: DIGIT_OUTPUTS
 * outputs a group, DIGIT_RECORD bytes a block).
 *
 * Two units, one result. The vector kernel (vpdpbusd) takes a block's 16 outputs x 32 inputs as 8 registers
 * of 16 dwords (dword n: output n's codes of 4 inputs), so a row costs 16 instructions a block with no
 * reduction across lanes; the tile kernel (tdpbssd) stores the same 8 registers as the B tile and does 16
 * rows per instruction. The integer sums are exact whatever the unit's order, and the fp32 steps after them
 * are the same instructions in the same order, so both give the same bits: q4_matmul_amx takes a batch of
 * fewer than AMX_MIN_ROWS rows to the vector kernel (too few rows to share the tile unit's fixed cost a
 * block: B stored and loaded, C stored and read back) and a larger one to the tiles, and invariant 4 (same
 * inputs, same tokens) holds across the switch: a row's result does not depend on the batch's size.
 */
#define _GNU_SOURCE /* syscall(), for arch_prctl (the AMX tile state): -std=c11 alone leaves it undeclared */
#include "matmul_digits.h"

/* The digit kernel's units; DIGITS_AMX is q4_matmul_amx's choice: the vector unit below AMX_MIN_ROWS rows, the
 * tiles from there. */
typedef enum { DIGITS_AVX2, DIGITS_VNNI, DIGITS_TILES, DIGITS_AMX } digit_unit_t;
#ifdef MATMUL_DIGITS
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_ROWS 16      /* a tile's rows */
/* Below this many rows q4_matmul_amx runs the vector kernel: the tiles cost the same up to 16 rows (a tile
 * padded with zero rows), the vector kernel a row's worth more with each row; the 120 matmuls of a SmolLM2
 * step on the Intel VM cross there (docs/benchmarks.md). */
#define AMX_MIN_ROWS 13
#define ARCH_REQ_XCOMP_PERM 0x1023 /* arch_prctl: ask for a dynamically enabled state component */
#define XFEATURE_XTILEDATA 18

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

/* Row r of x quantized and split into its digits (xq: [rows, in], the row's integers), with the sums of its
 * integers where asked. */
static void digits_prepare_row(const void *x, int x_bf16, int64_t x_stride, size_t elem, int64_t r, int64_t x_rows,
                               int64_t in, int16_t *xq, digits_t *out) {
    const int64_t blocks = in / GROUP;
    int16_t *q = xq + r * in;
    quantize_row((const char *)x + (size_t)(r * x_stride) * elem, x_bf16, in, XD_MAX, q, out->sx + r * blocks,
                 out->sx + (x_rows + r) * blocks);
    digits_row(q, in, out->xd + r * in * 2);
    if (out->xq_sums) {
        int32_t *sums = out->xq_sums + r * (in / XQ_SUMS);
        for (int64_t s = 0; s < in / XQ_SUMS; s++) {
            int32_t t = 0;
            for (int i = 0; i < XQ_SUMS; i++) t += q[s * XQ_SUMS + i];
            sums[s] = t;
        }
    }
}

int digits_prepare(const void *x, int x_bf16, int64_t x_stride, int64_t rows, int64_t x_rows, int64_t in,
                   int64_t threads, int want, digits_t *out) {
    const int64_t blocks = in / GROUP;
    int16_t *xq = malloc((size_t)(rows * in) * sizeof *xq);
    out->xd = calloc((size_t)(x_rows * in * 2), 1);
    out->sx = calloc((size_t)(2 * x_rows * blocks), sizeof *out->sx);
    out->xq = want & DIGITS_KEEP_XQ ? xq : NULL;
    out->xq_sums = want & DIGITS_XQ_SUMS ? malloc((size_t)(rows * (in / XQ_SUMS)) * sizeof *out->xq_sums) : NULL;
    if (!xq || !out->xd || !out->sx || (want & DIGITS_XQ_SUMS && !out->xq_sums)) {
        free(xq);
        out->xq = NULL;
        digits_free(out);
        return -ENOMEM;
    }
    const size_t elem = x_bf16 ? 2 : 4;
    if (threads > 1 && rows > 1) {
#pragma omp parallel for num_threads((int)threads) schedule(static)
        for (int64_t r = 0; r < rows; r++) digits_prepare_row(x, x_bf16, x_stride, elem, r, x_rows, in, xq, out);
    } else {
        /* no OpenMP region at all: an if(0) one still costs its setup, 120 calls a step (docs/benchmarks.md,
         * "Figures behind the code": Digit preparation without an OpenMP region) */
        for (int64_t r = 0; r < rows; r++) digits_prepare_row(x, x_bf16, x_stride, elem, r, x_rows, in, xq, out);
    }
    if (!out->xq) free(xq);
    return 0;
}

void digits_free(digits_t *d) {
    free(d->xd);
    free(d->sx);
    free(d->xq);
    free(d->xq_sums);
    d->xd = NULL, d->sx = NULL, d->xq = NULL, d->xq_sums = NULL;
}

/* The AVX2 unit (any CPU this build runs on): the same exact sums by vpmaddubsw, whose pairs (codes 0-15
 * times a signed digit, |pair| <= 3840) add in 16 bits over a block's 8 dwords of 4 inputs (<= 30720, no
 * wrap), widened by vpmaddwd; then the same fp32 steps as digit_scale, 8 outputs a register. A block's two
 * halves (outputs 0-7, 8-15) share each broadcast of a row's digits: both other orders ran slower, the halves
 * one after the other over the blocks (fewer registers live) and one after the other within each block (the
 * broadcasts read again for the second, so that nothing spills). One row is held by these instructions and
 * the memory alike: the weights in cache ran faster, and half the byte products (8-bit activations, not kept)
 * made the step from memory no faster (docs/benchmarks.md, "Figures behind the code": Digit kernels' AVX2
 * unit: a block's halves share the broadcasts). */
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


int cpu_has_vnni(void) {
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
    const int err0 = digits_prepare(x, x_bf16, x_stride, rows, x_rows, in, threads, 0, &dg);
    if (err0) return err0;
    const job_t j = {.w = {tiles ? FORMAT_Q4_AMX : FORMAT_Q4_VNNI, packed, NULL, out, in}, .sx = dg.sx,
                     .sumx = dg.sx + x_rows * blocks, .rows = rows, .y = y, .y_stride = y_stride, .y_bf16 = y_bf16,
                     .xd = dg.xd};
    const int err = run_groups(tiles ? groups_amx : unit == DIGITS_VNNI ? groups_vnni : groups_avx2, &j, threads);
    digits_free(&dg);
    return err;
}
#endif

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
