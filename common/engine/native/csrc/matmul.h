/* What decode's weight matmuls share (matmul_*.c): y = x @ W^T for a few activation rows, W kept packed
 * with the model file's codes.
 *
 *   q4:  GGUF Q4_0 / Q4_1 blocks of 32 inputs, w = q * d + m (q in 0..15; d, m fp16, exact from the file).
 *   q8:  the LM head, w = code * scale[o] (code int8, scale fp32).
 *
 * Layout: outputs in quads (4 consecutive outputs; the last quad padded with zero weights), a quad's blocks
 * interleaved, so that the 4 outputs a tile computes together are one sequential stream (4 separate row
 * streams ran far slower: docs/benchmarks.md, "Figures behind the code": Quads: one stream a tile):
 *   q4:  [quads, in / 32, 80] bytes: per block the 4 outputs' 16 code bytes (byte j: input j in the low
 *        nibble, j + 16 in the high one, as GGUF stores them), then 4 fp16 d, then 4 fp16 m;
 *   q8:  [quads, in / 32, 4, 32] int8 codes, and scale [quads * 4] fp32.
 * (handoff_native.h has the numbers; the int8 digit kernels read q4 in an order of their own.)
 *
 * One file a kernel family: the integer kernel (matmul_q4_int.c), the bf16 dot kernel (matmul_q4_bf16dot.c),
 * the fp32 kernel (matmul_q4_f32.c), the int8 digit kernels (matmul_q4_digits.c), the int8 LM head
 * (matmul_q8_head.c); native/choice.py picks the Q4 kernel per CPU. Each keeps a (row, output)'s operations
 * and their order independent of the batch, the tiling and the thread (its file says how), as invariant 4
 * (same inputs, same tokens) needs, and the library is built without -ffast-math so that the compiler
 * keeps that order.
 *
 * Threads: the outputs' quads (or groups) are split between the threads of an OpenMP team, torch's
 * (run_parts, matmul_threads.c).
 */
#ifndef HANDOFF_MATMUL_H
#define HANDOFF_MATMUL_H

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
#include "handoff_native.h"

#define HIDDEN __attribute__((visibility("hidden"))) /* shared by the library's files, not exported */

#define XQ_MAX 32767.0f
#define SPLIT_QUADS 2  /* quads are split between threads in multiples of this */
/* A matmul streams its weights once, each thread one contiguous range (then the others' tails: run_parts).
 * The hardware prefetcher alone left a 1-row matmul well short of a plain read of the same bytes; asking for
 * the bytes this far ahead as each block is read closes most of the gap, and this distance measured best
 * (docs/benchmarks.md, "Figures behind the code": Weight prefetch distance). A prefetch past the end of the
 * weights is harmless: it never faults. */
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
    const int32_t *xq_sums; /* the K-quants and Q8_0 by int8 digits: [rows, in / 16], sums of xq */
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

/* One row of x, [in] fp32 or bf16 -> xq (|xq| <= limit), and per block sx and sum(x): the integer kernels'
 * quantization (matmul_q4_int.c). */
HIDDEN void quantize_row(const void *x, int x_bf16, int64_t in, float limit, int16_t *xq, float *sx, float *sumx);

/* ------------------------------------------------------------------------------------- the packed weights */

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

/* ------------------------------------------------------------------------------------- tiles */

#ifdef MATMUL_AVX512
#ifdef __AVX512VNNI__
#define DPWSSD(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#else
#define DPWSSD(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif
/* A quad's rows in tiles of 8, 4, 2, 1: its codes unpacked once a tile (the q4 integer kernel, the q8 head). */
#define DEFINE_QUADS(NAME)                                                                             \
static int quads_##NAME(const job_t *j, int64_t q_begin, int64_t q_end) {                              \
    for (int64_t q = q_begin; q < q_end; q++) {                                                        \
        int64_t r = 0;                                                                                 \
        for (; r + 8 <= j->rows; r += 8) tile_##NAME##_8(j, r, q);                                     \
        if (j->rows - r >= 4) { tile_##NAME##_4(j, r, q); r += 4; }                                    \
        if (j->rows - r >= 2) { tile_##NAME##_2(j, r, q); r += 2; }                                    \
        if (j->rows - r == 1) tile_##NAME##_1(j, r, q);                                                \
    }                                                                                                  \
    return 0;                                                                                          \
}
#else
/* A quad's rows in tiles of 3, 2, 1: its codes unpacked once a tile (the q4 integer kernel, the q8 head). */
#define DEFINE_QUADS(NAME)                                                                             \
static int quads_##NAME(const job_t *j, int64_t q_begin, int64_t q_end) {                              \
    for (int64_t q = q_begin; q < q_end; q++) {                                                        \
        int64_t r = 0;                                                                                 \
        for (; r + 3 <= j->rows; r += 3) tile_##NAME##_3(j, r, q);                                     \
        if (j->rows - r == 2) tile_##NAME##_2(j, r, q);                                                \
        else if (j->rows - r == 1) tile_##NAME##_1(j, r, q);                                           \
    }                                                                                                  \
    return 0;                                                                                          \
}
#endif

/* ------------------------------------------------------------------------------------- threads */

/* A kernel's work units [begin, end) of a job: quads, or the digit kernels' groups. 0, or a negative errno. */
typedef int (*range_fn)(const job_t *, int64_t, int64_t);

/* n units of fn's work on `threads` threads of torch's OpenMP team (matmul_threads.c). */
HIDDEN int run_parts(range_fn fn, const job_t *j, int64_t n, int64_t unit, int64_t chunk, int64_t threads);
/* Chunks of about STEAL_BYTES of weights, in whole units. */
HIDDEN int64_t steal_chunk(int64_t unit_bytes, int64_t unit);

/* A quads kernel over all of j's quads. */
static inline int run_quads(range_fn fn, const job_t *j, int64_t threads) {
    return run_parts(fn, j, quads(&j->w), SPLIT_QUADS, steal_chunk(quad_bytes(&j->w), SPLIT_QUADS), threads);
}

#endif
