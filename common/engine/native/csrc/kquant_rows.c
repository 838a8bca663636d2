/* Rows of a packed K-quant or Q8_0 weight dequantized to fp32 (kq_dequant_rows): the embedding's rows of a
 * step's tokens and the LM head's rows of each row's best logits (their exact refinement), read from the
 * packed records the matmuls stream (handoff_native.h), so that a decode worker keeps no dense copy of such a
 * matrix. The values are gguf.quants.dequantize's, bit for bit, and llama.cpp's dequantize_row_*:
 *   Q8_0: q * d;  Q4_K, Q5_K: (d * sc) * q - dmin * m;  Q6_K: (d * sc) * (q - 32)
 * each product or difference rounded once in fp32 (d * sc, dmin * m and (d * sc) * q of Q4_K / Q5_K are exact,
 * so a contracted fma gives the same bits). Plain C: the same in every build.
 */
#include "matmul.h"

/* Byte i of output n's field whose bytes start at `field` of a record: the 16 outputs take turns, `word` bytes
 * at a time (handoff_native.h). */
static inline uint8_t field_byte(const uint8_t *field, int n, int i, int word) {
    return field[(i / word) * DIGIT_OUTPUTS * word + n * word + i % word];
}

static inline float field_half(const uint8_t *field, int n) {
    return half_to_float((uint16_t)(field[2 * n] | field[2 * n + 1] << 8));
}

/* Output n's block of a record (QK_K inputs; Q8_0: GROUP) into y. */
static void dequant_block(int64_t format, const uint8_t *rec, int n, float *y) {
    if (format == HN_Q8_0) {
        const float d = field_half(rec, n);
        for (int i = 0; i < GROUP; i++) y[i] = (float)(int8_t)field_byte(rec + 32, n, i, KQ_WORD) * d;
        return;
    }
    if (format == HN_Q6_K) {
        const float d = field_half(rec + 3328, n);
        for (int v = 0; v < QK_K; v++) {
            const int h = v / 128, r = v % 128;
            const int low = field_byte(rec, n, 64 * h + r % 64, KQ_WORD) >> 4 * (r / 64) & 15;
            const int top = field_byte(rec + 2048, n, 32 * h + r % 32, KQ_WORD) >> 2 * (r / 32) & 3;
            const float dsc = d * (float)(int8_t)field_byte(rec + 3072, n, v / 16, 1);
            y[v] = dsc * (float)((low | top << 4) - 32);
        }
        return;
    }
    /* Q4_K, Q5_K: d, dmin, the 12 scale bytes, (Q5_K: 32 bytes of fifth bits,) 128 of nibbles */
    const float d = field_half(rec, n), dmin = field_half(rec + 32, n);
    uint8_t q[12];
    for (int b = 0; b < 12; b++) q[b] = field_byte(rec + 64, n, b, 1);
    const uint8_t *codes = rec + (format == HN_Q4_K ? 256 : 768);
    for (int sub = 0; sub < 8; sub++) {
        const int sc = sub < 4 ? q[sub] & 63 : (q[sub + 4] & 0xf) | (q[sub - 4] >> 6) << 4;
        const int m = sub < 4 ? q[sub + 4] & 63 : (q[sub + 4] >> 4) | (q[sub] >> 6) << 4;
        const float dsc = d * (float)sc, dm = dmin * (float)m;
        for (int l = 0; l < 32; l++) {
            int c = field_byte(codes, n, 32 * (sub / 2) + l, KQ_WORD) >> 4 * (sub & 1) & 15;
            if (format == HN_Q5_K) c |= (field_byte(rec + 256, n, l, KQ_WORD) >> sub & 1) << 4;
            y[32 * sub + l] = dsc * (float)c - dm;
        }
    }
}

int kq_dequant_rows(int64_t format, const uint8_t *packed, int64_t out, int64_t in, const int64_t *ids, int64_t n,
                    float *y, int64_t threads) {
    const int64_t block = format == HN_Q8_0 ? GROUP : QK_K;
    const int64_t record = format == HN_Q8_0 ? Q8_0_RECORD : format == HN_Q4_K ? Q4_K_RECORD
                           : format == HN_Q5_K ? Q5_K_RECORD : Q6_K_RECORD;
    if (format < HN_Q8_0 || format > HN_Q6_K || in <= 0 || in % block || out <= 0 || n < 0) return -EINVAL;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= out) return -EINVAL;
    const int64_t blocks = in / block;
    /* a few rows (a step's tokens, the best logits) are one thread's work; a prompt's embedding rows are not */
#pragma omp parallel for num_threads((int)threads) schedule(static) if (threads > 1 && n * in >= (1 << 18))
    for (int64_t i = 0; i < n; i++) {
        const int64_t g = ids[i] / DIGIT_OUTPUTS;
        const int n_in_group = (int)(ids[i] % DIGIT_OUTPUTS);
        for (int64_t b = 0; b < blocks; b++)
            dequant_block(format, packed + (g * blocks + b) * record, n_in_group, y + i * in + b * block);
    }
    return 0;
}
