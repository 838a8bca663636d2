/* The int8 digit kernels for the GGUF K-quants and Q8_0 (kq_matmul): Q4_K, Q5_K, Q6_K and Q8_0 weights
 * multiplied as the file stores them (pack_quant's records, handoff_native.h), by the AVX2 unit on any AVX2
 * CPU or the AVX512_VNNI one, with the same bits.
 *
 * As the Q4 digit kernels (matmul_q4_digits.c, whose preparation this shares: digits_prepare), each row of x
 * is quantized per block of 32 inputs to integers xq = 256 hi + lo (|xq| <= XD_MAX: two signed bytes), with
 * its scale sx and its exact fp32 sum sumx; and per (row, output, block of 32 inputs, or Q6_K's sub-block of
 * 16) the sum S of the file's integer codes q times xq is exact in int32, whichever instructions compute it:
 *   Q4_K, Q5_K: q in 0..15, 0..31 (w = d sc q - dmin m);
 *   Q6_K: q = u - 32 with u in 0..63 (w = d sc q): S = sum u xq - 32 sum xq;
 *   Q8_0: q in -128..127 (w = d q): by VNNI as u = q + 128, S = sum u xq - 128 sum xq; by AVX2 in 16 bits.
 * Then per row and output, in fp32, its blocks in order (Q6_K: its two sub-blocks of a block in turn), the
 * same operations on every unit:
 *   acc = fma((float)S, D * sx, acc), D = d * sc (exact: an fp16 times a 6- or 8-bit integer; Q8_0: d);
 *   Q4_K, Q5_K: accm = fma(-(dmin * m), sumx, accm) (exact too: the min through the block's sum of x, as
 *   Q4_1's offset);
 * and y = acc + accm (accm 0 for Q6_K and Q8_0). |S| < 2^24 for Q4_K and Q6_K, so (float)S is exact; Q5_K's
 * and Q8_0's largest sums round in that conversion, the same way on every unit. A row's result thus depends
 * on its own x alone, whatever the batch, the tiling or the thread (invariant 4: same prompt, parameters and
 * seed, same tokens), and the AVX2 and AVX-512 hosts of a pool give it the same bits.
 *
 * The units. The vector unit (vpdpbusd) takes a block's 16 outputs x 32 inputs as 8 registers w[k] of 16
 * dwords (dword n: output n's codes of inputs 4k .. 4k + 3, a byte each, unsigned), decoded once a tile of
 * rows: a record's 64-byte chunks are such registers as stored, the nibbles and high bits one mask or shift
 * away. The AVX2 unit takes each register as two halves of 8 outputs and multiplies by vpmaddubsw (codes
 * times a signed digit, pairs summed in 16 bits: at most 2 x 128 x the largest code, 3,840 for Q4_K, 7,936
 * for Q5_K, 16,128 for Q6_K, so it adds 8, 4 and 2 such products before vpmaddwd widens them: nothing
 * saturates or wraps: 16-bit codes times xq by vpmaddwd were slower, docs/benchmarks.md, "Figures behind the
 * code": K-quant AVX2, bytes by vpmaddubsw); Q8_0's codes (255 x 128 x 2 would saturate) it widens to 16 bits
 * and multiplies with xq itself by vpmaddwd. There is no plain C kernel: a library without these units
 * (-ENOSYS) leaves the weight to the model's dense path.
 *
 * Code: a tile of 1-4 rows of one format is one function per unit and tile height, its blocks' shifts
 * immediates: the VNNI unit compiles a record's 8 blocks apart, the AVX2 unit a run of those that share their
 * chunks (kq_run) and loops over the runs (but for Q5_K): about half the code, a few percent slower
 * (docs/benchmarks.md, "Figures behind the code": K-quant tiles, blocks compiled apart). A K-quant tile asks
 * for its record's lines PREFETCH_AHEAD bytes ahead at the record's start; Q8_0's small records (544 bytes, one
 * block) are left to the hardware prefetcher, which ran faster (docs/benchmarks.md, "Figures behind the code":
 * K-quant prefetch, a record's lines at once).
 */
#include "matmul_digits.h"

#ifdef MATMUL_DIGITS

/* Where a record's fields start: the file's field offsets times 16 (handoff_native.h). */
#define Q8_0_CODES 32
#define K_DMIN 32   /* Q4_K, Q5_K: d at 0 */
#define K_SCALES 64 /* 12 x 16 bytes */
#define Q4_K_CODES 256
#define Q5_K_HIGH 256
#define Q5_K_CODES 768
#define Q6_K_HIGH 2048 /* Q6_K: the low 4 bits at 0 */
#define Q6_K_SCALES 3072
#define Q6_K_D 3328
#define CHUNK 64     /* bytes of a chunk: 16 outputs x KQ_WORD */
#define BLOCK_SUBS 8 /* blocks of 32 inputs a super-block */

static inline __attribute__((always_inline)) int64_t kq_record(int fmt) {
    return fmt == HN_Q8_0 ? Q8_0_RECORD : fmt == HN_Q4_K ? Q4_K_RECORD : fmt == HN_Q5_K ? Q5_K_RECORD : Q6_K_RECORD;
}

/* Blocks of 32 inputs a record: 1 for Q8_0, a super-block's 8 for the K-quants. */
static inline __attribute__((always_inline)) int kq_subs(int fmt) { return fmt == HN_Q8_0 ? 1 : BLOCK_SUBS; }

/* A record's blocks as runs of this many, block sub = run * per + at: those that share their code chunks and
 * differ only in which bits of them they take (Q4_K, Q5_K: the low or the high nibbles; Q6_K: a half's 4
 * blocks, the low or high nibbles of its two chunk rows and a different pair of top bits each). The kernels
 * compile a run's blocks apart (`at` a constant: every shift an immediate) and loop over the runs. */
static inline __attribute__((always_inline)) int kq_run(int fmt) {
    return fmt == HN_Q8_0 ? 1 : fmt == HN_Q6_K ? 4 : 2;
}

/* The bits of every byte of v at bit `from` moved to bit `to` (the bits around them left for a mask): a
 * 16-bit shift, which moves no bit in or out of its byte at the distances used here (4 at most). */
static inline __attribute__((always_inline)) __m256i move_bits_avx2(__m256i v, int from, int to) {
    return to >= from ? _mm256_slli_epi16(v, to - from) : _mm256_srli_epi16(v, from - to);
}

/* Q4_K, Q5_K: the 16 outputs' 6-bit scales (sc) and mins (mn) of sub-blocks 2i (128-bit lane 0) and 2i + 1
 * (lane 1) in sc[i] and mn[i], a byte an output: GGUF's get_scale_min_k4, 16 outputs at once, on the record's
 * 12 x 16 scale bytes (byte 16b + n: output n's byte b), two of them a register. */
static inline __attribute__((always_inline)) void kq_scale_bytes(const uint8_t *s, __m256i sc[4], __m256i mn[4]) {
    __m256i y[6];
    for (int i = 0; i < 6; i++) y[i] = _mm256_loadu_si256((const __m256i *)(s + 32 * i));
    const __m256i m63 = _mm256_set1_epi8(63), m15 = _mm256_set1_epi8(15), m48 = _mm256_set1_epi8(0x30);
    for (int i = 0; i < 2; i++) {
        /* sub-blocks 0-3: bytes 0-3 (scales), 4-7 (mins), low 6 bits */
        sc[i] = _mm256_and_si256(y[i], m63);
        mn[i] = _mm256_and_si256(y[2 + i], m63);
        /* 4-7: the low 4 bits from bytes 8-11 (scale low nibble, min high nibble), the top 2 from bytes 0-7 */
        sc[2 + i] = _mm256_or_si256(_mm256_and_si256(y[4 + i], m15), _mm256_and_si256(_mm256_srli_epi16(y[i], 2), m48));
        mn[2 + i] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(y[4 + i], 4), m15),
                                    _mm256_and_si256(_mm256_srli_epi16(y[2 + i], 2), m48));
    }
}

/* Sub-block `sub`'s 16 bytes of kq_scale_bytes' registers. */
static inline __attribute__((always_inline)) __m128i sub_bytes(const __m256i v[4], int sub) {
    return sub & 1 ? _mm256_extracti128_si256(v[sub >> 1], 1) : _mm256_castsi256_si128(v[sub >> 1]);
}

/* ------------------------------------------------------------------------------------- the AVX2 unit */

/* Half h (outputs 8h .. 8h + 7) of code register k (inputs 4k .. 4k + 3) of block run * kq_run + at: 8 dwords
 * of 4 unsigned codes. Q5_K's fifth bits of pair `run` come shifted right by 2 run (`down`, its count). */
static inline __attribute__((always_inline)) __m256i kq_codes_avx2(int fmt, const uint8_t *rec, int run, int at, int k,
                                                                   int h, __m128i down) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    const int chunk = CHUNK * k + 32 * h;
    if (fmt == HN_Q4_K || fmt == HN_Q5_K) {
        /* blocks 2 run and 2 run + 1 share chunks 8 run .. 8 run + 7: the low nibbles, then the high ones */
        const __m256i c = _mm256_loadu_si256((const __m256i *)(rec + (fmt == HN_Q4_K ? Q4_K_CODES : Q5_K_CODES) +
                                                                512 * run + chunk));
        const __m256i w = _mm256_and_si256(at ? _mm256_srli_epi16(c, 4) : c, low);
        if (fmt == HN_Q4_K) return w;
        /* bit 2 run + at of the fifth bits: at bit `at` once shifted down by 2 run, then to bit 4 */
        const __m256i high = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(rec + Q5_K_HIGH + chunk)), down);
        return _mm256_or_si256(w, _mm256_and_si256(move_bits_avx2(high, at, 4), _mm256_set1_epi8(0x10)));
    }
    /* Q6_K: half `run`, its block at = 2 nib + x: chunks 16 run + 8x + k, the low or the high nibbles (nib), and
     * the top two bits at 2 at of chunk 8 run + k */
    const int nib = at >> 1, x = at & 1;
    const __m256i c = _mm256_loadu_si256((const __m256i *)(rec + 1024 * run + 512 * x + chunk));
    const __m256i top = _mm256_loadu_si256((const __m256i *)(rec + Q6_K_HIGH + 512 * run + chunk));
    return _mm256_or_si256(_mm256_and_si256(nib ? _mm256_srli_epi16(c, 4) : c, low),
                           _mm256_and_si256(move_bits_avx2(top, 2 * at, 4), _mm256_set1_epi8(0x30)));
}

/* A block's fp32 step for one row and half: acc = fma((float)S, D * sx, acc). */
static inline __attribute__((always_inline)) __m256 kq_scale_avx2(__m256i s, __m256 d, float sx, __m256 acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(sx)), acc);
}

/* A tile's rows of x: each row's digits, 16-bit integers, scales, sums of x and sums of xq, from block 0. */
typedef struct {
    const int8_t *xd[4];
    const int16_t *xq[4];
    const float *sx[4], *sumx[4];
    const int32_t *xq_sums[4];
} tile_rows_t;

static inline __attribute__((always_inline)) tile_rows_t tile_rows(const job_t *j, int64_t r0, const int RT) {
    const int64_t xblocks = j->w.in / GROUP;
    tile_rows_t t;
    for (int r = 0; r < RT; r++) {
        t.xd[r] = j->xd + (r0 + r) * xblocks * XD_BLOCK;
        t.xq[r] = j->xq ? j->xq + (r0 + r) * j->w.in : NULL;
        t.sx[r] = j->sx + (r0 + r) * xblocks;
        t.sumx[r] = j->sumx + (r0 + r) * xblocks;
        t.xq_sums[r] = j->xq_sums ? j->xq_sums + (r0 + r) * 2 * xblocks : NULL;
    }
    return t;
}

/* The 16 outputs' D (d * sc: of the block, or of Q6_K's two sub-blocks) and -M (-(dmin * m), Q4_K and Q5_K)
 * of block `sub` of a record, half h (8 outputs) of each; d and -dmin as the record's fp16 give them. */
static inline __attribute__((always_inline)) void kq_block_scales_avx2(int fmt, const uint8_t *rec, int sub,
                                                                       const __m256 d[2], const __m256 mind[2],
                                                                       const __m256i scb[4], const __m256i mnb[4],
                                                                       __m256 dd[2][2], __m256 mm[2]) {
    for (int h = 0; h < 2; h++) {
        if (fmt == HN_Q8_0) {
            dd[0][h] = d[h];
        } else if (fmt == HN_Q6_K) {
            for (int i = 0; i < 2; i++) {
                const __m128i sc = _mm_loadl_epi64((const __m128i *)(rec + Q6_K_SCALES + 16 * (2 * sub + i) + 8 * h));
                dd[i][h] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d[h]);
            }
        } else {
            const __m128i sc = sub_bytes(scb, sub), mn = sub_bytes(mnb, sub);
            dd[0][h] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h ? _mm_srli_si128(sc, 8) : sc)), d[h]);
            mm[h] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h ? _mm_srli_si128(mn, 8) : mn)), mind[h]);
        }
    }
}

/* A record's d (Q8_0, Q6_K: its only scale) and -dmin, and the K-quants' scale and min bytes. */
static inline __attribute__((always_inline)) void kq_record_scales_avx2(int fmt, const uint8_t *rec, __m256 d[2],
                                                                        __m256 mind[2], __m256i scb[4],
                                                                        __m256i mnb[4]) {
    for (int h = 0; h < 2; h++) {
        d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + (fmt == HN_Q6_K ? Q6_K_D : 0) + 16 * h)));
        mind[h] = d[h];
        if (fmt == HN_Q4_K || fmt == HN_Q5_K) /* -dmin: the mins subtract */
            mind[h] = _mm256_cvtph_ps(_mm_xor_si128(_mm_loadu_si128((const __m128i *)(rec + K_DMIN + 16 * h)),
                                                    _mm_set1_epi16((short)0x8000)));
    }
    if (fmt == HN_Q4_K || fmt == HN_Q5_K) kq_scale_bytes(rec + K_SCALES, scb, mnb);
}

/* vpmaddubsw products a 16-bit sum takes before vpmaddwd widens it: 2 x 128 x the largest code, 3,840 (Q4_K),
 * 7,936 (Q5_K), 16,128 (Q6_K), times this many stays below 2^15. */
static inline __attribute__((always_inline)) int kq_widen_every(int fmt) {
    return fmt == HN_Q4_K ? 8 : fmt == HN_Q5_K ? 4 : 2;
}

/* Block sub = run * kq_run + at of record `rec` (the b-th block of the rows) for rows r0 .. r0 + RT - 1 (RT <= 4)
 * of a group, the K-quants: the unsigned codes times the digits by vpmaddubsw, summed in 16 bits
 * kq_widen_every products at a time, then in 32 (Q6_K's - 32 sum xq at the end of each sub-block). */
static inline __attribute__((always_inline)) void kq_block_avx2(const uint8_t *rec, int run, int at, int64_t b,
                                                                const tile_rows_t *x, const __m256 d[2],
                                                                const __m256 mind[2], const __m256i scb[4],
                                                                const __m256i mnb[4], __m256 acc[4][2],
                                                                __m256 accm[4][2],
                                                                const int fmt, const int RT) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m128i down = _mm_cvtsi32_si128(2 * run);
    const int widen = kq_widen_every(fmt), sub = run * kq_run(fmt) + at;
    __m256 dd[2][2], mm[2];
    kq_block_scales_avx2(fmt, rec, sub, d, mind, scb, mnb, dd, mm);
    __m256i s32[4][2], hi[4][2], lo[4][2];
    for (int r = 0; r < RT; r++)
        for (int h = 0; h < 2; h++) s32[r][h] = hi[r][h] = lo[r][h] = _mm256_setzero_si256();
    for (int k = 0; k < 8; k++) {
        const __m256i w0 = kq_codes_avx2(fmt, rec, run, at, k, 0, down);
        const __m256i w1 = kq_codes_avx2(fmt, rec, run, at, k, 1, down);
        for (int r = 0; r < RT; r++) {
            const dword_t *xd = (const dword_t *)(x->xd[r] + b * XD_BLOCK);
            const __m256i xh = _mm256_set1_epi32(xd[k]), xl = _mm256_set1_epi32(xd[8 + k]);
            hi[r][0] = _mm256_add_epi16(hi[r][0], _mm256_maddubs_epi16(w0, xh));
            hi[r][1] = _mm256_add_epi16(hi[r][1], _mm256_maddubs_epi16(w1, xh));
            lo[r][0] = _mm256_add_epi16(lo[r][0], _mm256_maddubs_epi16(w0, xl));
            lo[r][1] = _mm256_add_epi16(lo[r][1], _mm256_maddubs_epi16(w1, xl));
        }
        if ((k + 1) % widen) continue;
        for (int r = 0; r < RT; r++)
            for (int h = 0; h < 2; h++) {
                const __m256i wide = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(hi[r][h], ones), 8),
                                                      _mm256_madd_epi16(lo[r][h], ones));
                s32[r][h] = _mm256_add_epi32(s32[r][h], wide);
                hi[r][h] = lo[r][h] = _mm256_setzero_si256();
            }
        if (fmt != HN_Q6_K || k % 4 != 3) continue;
        /* Q6_K: sub-block 2 b + k / 4 (inputs 16 (k / 4) .. + 15 of the block) done: its - 32 sum xq */
        for (int r = 0; r < RT; r++) {
            const __m256i bias = _mm256_set1_epi32(32 * x->xq_sums[r][2 * b + k / 4]);
            for (int h = 0; h < 2; h++) {
                acc[r][h] = kq_scale_avx2(_mm256_sub_epi32(s32[r][h], bias), dd[k / 4][h], x->sx[r][b], acc[r][h]);
                s32[r][h] = _mm256_setzero_si256();
            }
        }
    }
    if (fmt == HN_Q6_K) return;
    for (int r = 0; r < RT; r++)
        for (int h = 0; h < 2; h++) {
            acc[r][h] = kq_scale_avx2(s32[r][h], dd[0][h], x->sx[r][b], acc[r][h]);
            accm[r][h] = _mm256_fmadd_ps(mm[h], _mm256_set1_ps(x->sumx[r][b]), accm[r][h]);
        }
}

/* Rows r0 .. r0 + RT - 1 (RT <= 4) of group g, the K-quants: a record's blocks in runs (kq_run), a run's blocks
 * compiled apart; Q5_K's runs too, so that its fifth bits' shifts are immediates (docs/benchmarks.md, "Figures
 * behind the code": K-quant tiles, blocks compiled apart). */
static inline __attribute__((always_inline)) void kq_tile_avx2(const job_t *j, int64_t r0, int64_t g, const int fmt,
                                                               const int RT) {
    const int64_t supers = j->w.in / QK_K, rec_bytes = kq_record(fmt);
    const uint8_t *rec = j->w.packed + g * supers * rec_bytes;
    const tile_rows_t x = tile_rows(j, r0, RT);
    const int runs = BLOCK_SUBS / kq_run(fmt);
    __m256 acc[4][2], accm[4][2];
    for (int r = 0; r < RT; r++) acc[r][0] = acc[r][1] = accm[r][0] = accm[r][1] = _mm256_setzero_ps();
    for (int64_t s = 0; s < supers; s++, rec += rec_bytes) {
        for (int line = 0; line < rec_bytes; line += 64) DIGIT_PREFETCH(rec + line);
        __m256 d[2], mind[2];
        __m256i scb[4], mnb[4];
        kq_record_scales_avx2(fmt, rec, d, mind, scb, mnb);
        if (fmt == HN_Q5_K) {
#pragma GCC unroll 4
            for (int run = 0; run < runs; run++)
#pragma GCC unroll 4
                for (int at = 0; at < kq_run(fmt); at++)
                    kq_block_avx2(rec, run, at, s * BLOCK_SUBS + run * kq_run(fmt) + at, &x, d, mind, scb, mnb, acc,
                                  accm, fmt, RT);
        } else {
            for (int run = 0; run < runs; run++)
#pragma GCC unroll 4
                for (int at = 0; at < kq_run(fmt); at++)
                    kq_block_avx2(rec, run, at, s * BLOCK_SUBS + run * kq_run(fmt) + at, &x, d, mind, scb, mnb, acc,
                                  accm, fmt, RT);
        }
    }
    for (int r = 0; r < RT; r++)
        for (int h = 0; h < 2; h++) digit_store_avx2(j, r0 + r, g * DIGIT_OUTPUTS + 8 * h, acc[r][h], accm[r][h]);
}

/* Rows r0 .. r0 + RT - 1 of group g, Q8_0: the codes widened to 16 bits (a vpmaddubsw pair of 8-bit codes
 * would saturate) times xq itself by vpmaddwd, a register's lanes pairs of inputs (4 outputs x 2 pairs), the
 * pairs added when the block is done. */
static inline __attribute__((always_inline)) void q8_0_tile_avx2(const job_t *j, int64_t r0, int64_t g, const int RT) {
    const int64_t blocks = j->w.in / GROUP;
    const uint8_t *rec = j->w.packed + g * blocks * Q8_0_RECORD;
    const tile_rows_t x = tile_rows(j, r0, RT);
    __m256 acc[4][2];
    for (int r = 0; r < RT; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++, rec += Q8_0_RECORD) {
        __m256i sum[4][2][2]; /* [row][half][outputs 0-3, 4-7 of the half]: lane 2n + p, pair p of output n */
        for (int r = 0; r < RT; r++)
            for (int h = 0; h < 2; h++) sum[r][h][0] = sum[r][h][1] = _mm256_setzero_si256();
        for (int k = 0; k < 8; k++) {
            __m256i w[2][2];
            for (int h = 0; h < 2; h++) {
                const __m256i c = _mm256_loadu_si256((const __m256i *)(rec + Q8_0_CODES + CHUNK * k + 32 * h));
                w[h][0] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(c));
                w[h][1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(c, 1));
            }
            for (int r = 0; r < RT; r++) {
                int64_t four;
                memcpy(&four, x.xq[r] + b * GROUP + 4 * k, sizeof four);
                const __m256i xk = _mm256_set1_epi64x(four); /* inputs 4k .. 4k + 3: pairs 0, 1 alternating */
                for (int h = 0; h < 2; h++)
                    for (int q = 0; q < 2; q++)
                        sum[r][h][q] = _mm256_add_epi32(sum[r][h][q], _mm256_madd_epi16(w[h][q], xk));
            }
        }
        __m256 d[2];
        for (int h = 0; h < 2; h++) d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 16 * h)));
        for (int r = 0; r < RT; r++)
            for (int h = 0; h < 2; h++) {
                /* hadd: outputs 0, 1, 4, 5 | 2, 3, 6, 7 of the half; the permute puts them in order */
                const __m256i s32 = _mm256_permute4x64_epi64(_mm256_hadd_epi32(sum[r][h][0], sum[r][h][1]), 0xd8);
                acc[r][h] = kq_scale_avx2(s32, d[h], x.sx[r][b], acc[r][h]);
            }
    }
    for (int r = 0; r < RT; r++)
        for (int h = 0; h < 2; h++)
            digit_store_avx2(j, r0 + r, g * DIGIT_OUTPUTS + 8 * h, acc[r][h], _mm256_setzero_ps());
}

/* ------------------------------------------------------------------------------------- the AVX-512 unit */

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")

static inline __attribute__((always_inline)) __m512i move_bits_512(__m512i v, int from, int to) {
    return to >= from ? _mm512_slli_epi16(v, (unsigned)(to - from)) : _mm512_srli_epi16(v, (unsigned)(from - to));
}

/* The 8 code registers of block `sub` = run * kq_run + at (w[k] dword n: output n's codes of inputs 4k .. 4k + 3,
 * unsigned): kq_codes_avx2's, 16 outputs at once; Q8_0's as u = q + 128. (The VNNI tile unrolls all 8 blocks of
 * a record, so every shift is an immediate.) */
static inline __attribute__((always_inline)) void kq_codes_512(int fmt, const uint8_t *rec, int run, int at,
                                                               __m512i w[8]) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int k = 0; k < 8; k++) {
        const int chunk = CHUNK * k;
        if (fmt == HN_Q8_0) {
            w[k] = _mm512_xor_si512(_mm512_loadu_si512(rec + Q8_0_CODES + chunk), _mm512_set1_epi8((char)0x80));
        } else if (fmt == HN_Q4_K || fmt == HN_Q5_K) {
            const __m512i c = _mm512_loadu_si512(rec + (fmt == HN_Q4_K ? Q4_K_CODES : Q5_K_CODES) + 512 * run + chunk);
            w[k] = _mm512_and_si512(at ? _mm512_srli_epi16(c, 4) : c, low);
            if (fmt == HN_Q5_K) /* bit 2 run + at of the fifth bits */
                w[k] = _mm512_or_si512(w[k], _mm512_and_si512(move_bits_512(_mm512_loadu_si512(rec + Q5_K_HIGH + chunk),
                                                                            2 * run + at, 4), _mm512_set1_epi8(0x10)));
        } else {
            const int nib = at >> 1, x = at & 1;
            const __m512i c = _mm512_loadu_si512(rec + 1024 * run + 512 * x + chunk);
            const __m512i top = _mm512_loadu_si512(rec + Q6_K_HIGH + 512 * run + chunk);
            w[k] = _mm512_or_si512(_mm512_and_si512(nib ? _mm512_srli_epi16(c, 4) : c, low),
                                   _mm512_and_si512(move_bits_512(top, 2 * at, 4), _mm512_set1_epi8(0x30)));
        }
    }
}

/* acc + the products of w's bytes with the 4 signed bytes at x, in every dword: vpdpbusd with x broadcast from
 * memory within the instruction, which GCC does not fold itself (docs/benchmarks.md, "Figures behind the code":
 * K-quant VNNI, the digits broadcast within vpdpbusd). */
static inline __attribute__((always_inline)) __m512i dpbusd_bcst(__m512i acc, __m512i w, const dword_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
    return acc;
}

/* One row's exact sum over w[k0 .. k0 + n - 1] (n = 8: a block; 4: a Q6_K sub-block), two chains a digit. */
static inline __attribute__((always_inline)) __m512i digit_sum_512(const __m512i *w, const dword_t *xd, int k0, int n) {
    __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
    for (int k = k0; k < k0 + n; k += 2) {
        h0 = dpbusd_bcst(h0, w[k], xd + k);
        h1 = dpbusd_bcst(h1, w[k + 1], xd + k + 1);
        l0 = dpbusd_bcst(l0, w[k], xd + 8 + k);
        l1 = dpbusd_bcst(l1, w[k + 1], xd + 9 + k);
    }
    return _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), 8), _mm512_add_epi32(l0, l1));
}

/* A block's fp32 step for one row: acc = fma((float)S, D * sx, acc) (kq_scale_avx2's, 16 outputs at once). */
static inline __attribute__((always_inline)) __m512 kq_scale_512(__m512i s, __m512 d, float sx, __m512 acc) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(sx)), acc);
}

/* Block sub = run * kq_run + at of record `rec` (the b-th block of the rows) for rows r0 .. r0 + RT - 1 (RT <= 4)
 * of a group: d the record's d (Q8_0: the block's), mind its -dmin, scb and mnb its scale and min bytes. */
static inline __attribute__((always_inline)) void kq_block_vnni(const uint8_t *rec, int run, int at, int64_t b,
                                                                const tile_rows_t *x, __m512 d, __m512 mind,
                                                                const __m256i scb[4], const __m256i mnb[4],
                                                                __m512 acc[4], __m512 accm[4], const int fmt,
                                                                const int RT) {
    const int sub = run * kq_run(fmt) + at;
    __m512i w[8];
    kq_codes_512(fmt, rec, run, at, w);
    __m512 dd[2] = {d, d}, mm = d;
    if (fmt == HN_Q6_K) {
        for (int i = 0; i < 2; i++)
            dd[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(rec + Q6_K_SCALES + 16 * (2 * sub + i))))), d);
    } else if (fmt != HN_Q8_0) {
        dd[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sub_bytes(scb, sub))), d);
        mm = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sub_bytes(mnb, sub))), mind);
    }
    for (int r = 0; r < RT; r++) {
        const dword_t *xd = (const dword_t *)(x->xd[r] + b * XD_BLOCK);
        const float sx = x->sx[r][b];
        if (fmt == HN_Q6_K) { /* its two sub-blocks in turn, each less 32 sum xq */
            for (int i = 0; i < 2; i++) {
                const __m512i bias = _mm512_set1_epi32(32 * x->xq_sums[r][2 * b + i]);
                acc[r] = kq_scale_512(_mm512_sub_epi32(digit_sum_512(w, xd, 4 * i, 4), bias), dd[i], sx, acc[r]);
            }
        } else if (fmt == HN_Q8_0) { /* less 128 sum xq */
            const __m512i bias = _mm512_set1_epi32(128 * (x->xq_sums[r][2 * b] + x->xq_sums[r][2 * b + 1]));
            acc[r] = kq_scale_512(_mm512_sub_epi32(digit_sum_512(w, xd, 0, 8), bias), d, sx, acc[r]);
        } else {
            acc[r] = kq_scale_512(digit_sum_512(w, xd, 0, 8), dd[0], sx, acc[r]);
            accm[r] = _mm512_fmadd_ps(mm, _mm512_set1_ps(x->sumx[r][b]), accm[r]);
        }
    }
}

/* Rows r0 .. r0 + RT - 1 (RT <= 4) of group g: a record's blocks all compiled apart, every shift an immediate
 * (a loop over kq_run's runs was slower here: docs/benchmarks.md, "Figures behind the code": K-quant tiles,
 * blocks compiled apart). */
static inline __attribute__((always_inline)) void kq_tile_vnni(const job_t *j, int64_t r0, int64_t g, const int fmt,
                                                               const int RT) {
    const int subs = kq_subs(fmt);
    const int64_t records = j->w.in / (GROUP * subs), rec_bytes = kq_record(fmt);
    const uint8_t *rec = j->w.packed + g * records * rec_bytes;
    const tile_rows_t x = tile_rows(j, r0, RT);
    __m512 acc[4], accm[4];
    for (int r = 0; r < RT; r++) acc[r] = accm[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < records; s++, rec += rec_bytes) {
        if (fmt != HN_Q8_0) /* Q8_0: the hardware prefetcher alone */
            for (int line = 0; line < rec_bytes; line += 64) DIGIT_PREFETCH(rec + line);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + (fmt == HN_Q6_K ? Q6_K_D : 0))));
        __m512 mind = d;
        __m256i scb[4], mnb[4];
        if (fmt == HN_Q4_K || fmt == HN_Q5_K) { /* -dmin: the mins subtract */
            mind = _mm512_cvtph_ps(_mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(rec + K_DMIN)),
                                                    _mm256_set1_epi16((short)0x8000)));
            kq_scale_bytes(rec + K_SCALES, scb, mnb);
        }
#pragma GCC unroll 8
        for (int run = 0; run < subs / kq_run(fmt); run++)
#pragma GCC unroll 4
            for (int at = 0; at < kq_run(fmt); at++)
                kq_block_vnni(rec, run, at, s * subs + run * kq_run(fmt) + at, &x, d, mind, scb, mnb, acc, accm, fmt,
                              RT);
    }
    for (int r = 0; r < RT; r++) digit_store(j, r0 + r, g * DIGIT_QUADS, acc[r], accm[r]);
}

/* One unit's groups g_begin .. g_end - 1 of one format (one thread's part), rows in tiles of 4, then 3, 2 or 1. */
#define DEFINE_KQ_GROUPS(NAME, TILE, ...)                                                             \
static int NAME(const job_t *j, int64_t g_begin, int64_t g_end) {                                    \
    for (int64_t g = g_begin; g < g_end; g++) {                                                      \
        int64_t r = 0;                                                                               \
        for (; r + 4 <= j->rows; r += 4) TILE(j, r, g, __VA_ARGS__ 4);                               \
        switch (j->rows - r) {                                                                       \
        case 3: TILE(j, r, g, __VA_ARGS__ 3); break;                                                 \
        case 2: TILE(j, r, g, __VA_ARGS__ 2); break;                                                 \
        case 1: TILE(j, r, g, __VA_ARGS__ 1); break;                                                 \
        }                                                                                            \
    }                                                                                                \
    return 0;                                                                                        \
}
DEFINE_KQ_GROUPS(q8_0_vnni, kq_tile_vnni, HN_Q8_0,)
DEFINE_KQ_GROUPS(q4_k_vnni, kq_tile_vnni, HN_Q4_K,)
DEFINE_KQ_GROUPS(q5_k_vnni, kq_tile_vnni, HN_Q5_K,)
DEFINE_KQ_GROUPS(q6_k_vnni, kq_tile_vnni, HN_Q6_K,)
#pragma GCC pop_options

DEFINE_KQ_GROUPS(q8_0_avx2, q8_0_tile_avx2,)
DEFINE_KQ_GROUPS(q4_k_avx2, kq_tile_avx2, HN_Q4_K,)
DEFINE_KQ_GROUPS(q5_k_avx2, kq_tile_avx2, HN_Q5_K,)
DEFINE_KQ_GROUPS(q6_k_avx2, kq_tile_avx2, HN_Q6_K,)

static range_fn kq_groups(int64_t format, int vnni) {
    switch (format) {
    case HN_Q8_0: return vnni ? q8_0_vnni : q8_0_avx2;
    case HN_Q4_K: return vnni ? q4_k_vnni : q4_k_avx2;
    case HN_Q5_K: return vnni ? q5_k_vnni : q5_k_avx2;
    case HN_Q6_K: return vnni ? q6_k_vnni : q6_k_avx2;
    }
    return NULL;
}
#endif

int kq_matmul(int64_t format, int64_t unit, const void *x, int x_bf16, int64_t x_stride, int64_t rows,
              const uint8_t *packed, int64_t out, int64_t in, void *y, int y_bf16, int64_t y_stride, int64_t threads) {
#ifdef MATMUL_DIGITS
    const int64_t block = format == HN_Q8_0 ? GROUP : QK_K;
    if (format < HN_Q8_0 || format > HN_Q6_K || in <= 0 || in % block || out <= 0 || rows < 0) return -EINVAL;
    if (unit != Q4_KERNEL_AVX2 && unit != Q4_KERNEL_VNNI && unit != Q4_KERNEL_AMX) return -EINVAL;
    const int vnni = unit != Q4_KERNEL_AVX2; /* AMX hosts run the VNNI unit: the same bits */
    if (vnni && !cpu_has_vnni()) return -ENOSYS;
    if (!rows) return 0;
    /* the digits, with the sums of xq where a code's offset subtracts them (Q6_K's - 32, Q8_0's - 128 on the
     * VNNI unit); Q8_0 on the AVX2 unit: xq itself */
    const int want = format == HN_Q8_0 ? (vnni ? DIGITS_XQ_SUMS : DIGITS_KEEP_XQ)
                                       : format == HN_Q6_K ? DIGITS_XQ_SUMS : 0;
    digits_t dg;
    const int err0 = digits_prepare(x, x_bf16, x_stride, rows, rows, in, threads, want, &dg);
    if (err0) return err0;
    const job_t j = {.w = {.packed = packed, .out = out, .in = in}, .xq = dg.xq, .sx = dg.sx,
                     .sumx = dg.sx + rows * (in / GROUP), .rows = rows, .y = y, .y_stride = y_stride, .y_bf16 = y_bf16,
                     .xd = dg.xd, .xq_sums = dg.xq_sums};
    const int64_t groups = (out + DIGIT_OUTPUTS - 1) / DIGIT_OUTPUTS;
    const int64_t group_bytes = in / block * kq_record((int)format);
    const int err = run_parts(kq_groups(format, vnni), &j, groups, 1, steal_chunk(group_bytes, 1), threads);
    digits_free(&dg);
    return err;
#else
    (void)format, (void)unit, (void)x, (void)x_bf16, (void)x_stride, (void)rows, (void)packed, (void)out, (void)in,
        (void)y, (void)y_bf16, (void)y_stride, (void)threads;
    return -ENOSYS;
#endif
}
