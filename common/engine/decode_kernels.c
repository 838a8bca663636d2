/* The decode step's native kernels (common/engine/native.py). First, decode attention that reads the
 * paged K/V cache in place.
 *
 * One query per row, each row attending to positions 0 .. len-1 of its own sequence through its block
 * table. The eager path gathers every row's context into a padded copy, widens it to fp32 and calls
 * SDPA: three passes over the context's bytes plus a mask. This reads each K and V row once, where it
 * lies, and accumulates in fp32.
 *
 * Invariant 4 (a row's result never depends on the other rows): a work item is one (row, KV head) pair
 * and reads nothing of other rows; every sum runs in a fixed order that depends only on the row's own
 * length (16 fixed lanes over head_dim, then a fixed tree; positions in order), never on addresses or
 * on how the items are split between threads. Built without -ffast-math for that reason: the compiler
 * may not reassociate a sum. exp is a polynomial in plain C so that it vectorizes without libmvec.
 *
 * Layouts (elements, not bytes):
 *   q     [rows, heads, dim], row stride q_stride, head stride dim
 *   kv    one layer: [slots, 2, kv_heads, dim], contiguous (K then V of a slot side by side)
 *   table [rows, table_stride] block ids; slot of position p = table[p / block] * block + p % block
 *   out   [rows, heads, dim], contiguous
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define MAX_GROUP 16

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* exp(x) for x <= 0 (scores minus their maximum): 2^n * p(r), |r| <= ln2 / 2, about 2 ulp. */
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) return 0.0f;
    /* x * log2(e) rounded to an integer: adding and removing 1.5 * 2^23 leaves no fraction (|x| < 2^22) */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187045e-06f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

static inline float sum_lanes(const float *l) { /* a fixed tree over the 16 lanes */
    float a[8];
    for (int i = 0; i < 8; i++) a[i] = l[i] + l[i + 8];
    for (int i = 0; i < 4; i++) a[i] = a[i] + a[i + 4];
    return (a[0] + a[2]) + (a[1] + a[3]);
}

#define DEFINE_ATTENTION(NAME, T, LOAD, STORE)                                                          \
int NAME(const T *q, int64_t q_stride, const T *kv, const int64_t *table, int64_t table_stride,        \
         const int64_t *lens, int64_t block, int64_t heads, int64_t kv_heads, int64_t dim, float scale, \
         T *out, int64_t item_begin, int64_t item_end) {                                               \
    int64_t group = heads / kv_heads;                                                                  \
    if (group > MAX_GROUP || dim % LANES || dim > 256) return -1;                                      \
    int64_t longest = 0;                                                                               \
    for (int64_t it = item_begin; it < item_end; it++)                                                 \
        if (lens[it / kv_heads] > longest) longest = lens[it / kv_heads];                              \
    float *scores = malloc(sizeof(float) * (size_t)(group * (longest ? longest : 1)));                 \
    if (!scores) return -2;                                                                            \
    const int64_t slot_stride = 2 * kv_heads * dim;                                                    \
    float qf[MAX_GROUP * 256], acc[MAX_GROUP * 256], top[MAX_GROUP], inv[MAX_GROUP];                   \
    for (int64_t it = item_begin; it < item_end; it++) {                                               \
        const int64_t row = it / kv_heads, h = it % kv_heads, len = lens[row];                         \
        const int64_t *blocks = table + row * table_stride;                                            \
        for (int64_t g = 0; g < group; g++) {                                                          \
            const T *qh = q + row * q_stride + (h * group + g) * dim;                                  \
            for (int64_t d = 0; d < dim; d++) qf[g * dim + d] = LOAD(qh[d]) * scale;                   \
            top[g] = -INFINITY;                                                                        \
        }                                                                                              \
        for (int64_t p = 0; p < len; p++) { /* scores: q . k of every position */                     \
            const T *k = kv + (blocks[p / block] * block + p % block) * slot_stride + h * dim;         \
            for (int64_t g = 0; g < group; g++) {                                                      \
                float lanes[LANES] = {0};                                                              \
                for (int64_t d0 = 0; d0 < dim; d0 += LANES)                                            \
                    for (int l = 0; l < LANES; l++) lanes[l] += qf[g * dim + d0 + l] * LOAD(k[d0 + l]); \
                float s = sum_lanes(lanes);                                                            \
                scores[g * len + p] = s;                                                               \
                if (s > top[g]) top[g] = s;                                                            \
            }                                                                                          \
        }                                                                                              \
        for (int64_t g = 0; g < group; g++) { /* softmax weights, positions in order */                \
            float *sg = scores + g * len, total = 0.0f;                                                \
            for (int64_t p = 0; p < len; p++) sg[p] = exp_nonpositive(sg[p] - top[g]);                 \
            for (int64_t p = 0; p < len; p++) total += sg[p];                                          \
            inv[g] = total > 0.0f ? 1.0f / total : 0.0f;                                               \
        }                                                                                              \
        memset(acc, 0, sizeof(float) * (size_t)(group * dim));                                         \
        for (int64_t p = 0; p < len; p++) { /* the weighted sum of V, positions in order */          \
            const T *v = kv + (blocks[p / block] * block + p % block) * slot_stride + (kv_heads + h) * dim; \
            for (int64_t g = 0; g < group; g++) {                                                      \
                const float w = scores[g * len + p];                                                   \
                for (int64_t d = 0; d < dim; d++) acc[g * dim + d] += w * LOAD(v[d]);                  \
            }                                                                                          \
        }                                                                                              \
        for (int64_t g = 0; g < group; g++) {                                                          \
            T *o = out + (row * heads + h * group + g) * dim;                                          \
            for (int64_t d = 0; d < dim; d++) o[d] = STORE(acc[g * dim + d] * inv[g]);                 \
        }                                                                                              \
    }                                                                                                  \
    free(scores);                                                                                      \
    return 0;                                                                                          \
}

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
DEFINE_ATTENTION(decode_attention_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_ATTENTION(decode_attention_f32, float, LOAD_F32, STORE_F32)

/* ---- The small row-wise ops around a decode layer's matmuls, fused: one call each instead of 5-10
 * torch ops (about 40 us of a 1-row step's 50 each, most of it per-op overhead). Rows are independent
 * and every sum has a fixed order, as above. */

/* h [rows, dim] fp32 residual += delta (model dtype, or NULL), then out = RMSNorm(h) * w in the model
 * dtype: (h * (1 / sqrt(mean(h^2) + eps))) * w, as F.rms_norm. */
#define DEFINE_ADD_RMS_NORM(NAME, T, LOAD, STORE)                                                       \
int NAME(float *h, const T *delta, const float *w, int64_t rows, int64_t dim, float eps, T *out) {    \
    if (dim % LANES) return -1;                                                                        \
    for (int64_t r = 0; r < rows; r++) {                                                               \
        float *x = h + r * dim;                                                                        \
        if (delta)                                                                                     \
            for (int64_t d = 0; d < dim; d++) x[d] += LOAD(delta[r * dim + d]);                        \
        float lanes[LANES] = {0};                                                                      \
        for (int64_t d0 = 0; d0 < dim; d0 += LANES)                                                    \
            for (int l = 0; l < LANES; l++) lanes[l] += x[d0 + l] * x[d0 + l];                         \
        const float inv = 1.0f / sqrtf(sum_lanes(lanes) / (float)dim + eps);                           \
        for (int64_t d = 0; d < dim; d++) out[r * dim + d] = STORE((x[d] * inv) * w[d]);               \
    }                                                                                                  \
    return 0;                                                                                          \
}

/* qkv [rows, (heads + 2 kv_heads) * dim], model dtype: rotate the q and k heads in place at each row's
 * position (HF's rotate_half: x * cos + rotate_half(x) * sin, each product rounded to the dtype as torch
 * does), then copy the row's K and V (adjacent in qkv, as in a cache slot) into kv at slots[row]. */
#define DEFINE_ROPE_KV_WRITE(NAME, T, LOAD, STORE)                                                      \
int NAME(T *qkv, const T *cos, const T *sin, const int64_t *positions, int64_t rows, int64_t heads,   \
         int64_t kv_heads, int64_t dim, T *kv, const int64_t *slots) {                                 \
    const int64_t half = dim / 2, width = (heads + 2 * kv_heads) * dim, slot_width = 2 * kv_heads * dim; \
    if (dim % 2 || dim > 512) return -1;                                                               \
    for (int64_t r = 0; r < rows; r++) {                                                               \
        T *row = qkv + r * width;                                                                      \
        const T *c = cos + positions[r] * dim, *s = sin + positions[r] * dim;                          \
        for (int64_t hd = 0; hd < heads + kv_heads; hd++) {                                            \
            T *x = row + hd * dim;                                                                     \
            float rotated[512];                                                                        \
            for (int64_t d = 0; d < half; d++) {                                                       \
                rotated[d] = -LOAD(x[d + half]);                                                       \
                rotated[d + half] = LOAD(x[d]);                                                        \
            }                                                                                          \
            for (int64_t d = 0; d < dim; d++) {                                                        \
                const float a = LOAD(STORE(LOAD(x[d]) * LOAD(c[d])));                                  \
                const float b = LOAD(STORE(rotated[d] * LOAD(s[d])));                                  \
                x[d] = STORE(a + b);                                                                   \
            }                                                                                          \
        }                                                                                              \
        memcpy(kv + slots[r] * slot_width, row + heads * dim, sizeof(T) * (size_t)slot_width);         \
    }                                                                                                  \
    return 0;                                                                                          \
}

/* gate_up [rows, 2 * width] model dtype -> out [rows, width]: silu(gate) * up, silu rounded to the dtype
 * before the product as F.silu(gate) * up does. */
#define DEFINE_SILU_MUL(NAME, T, LOAD, STORE)                                                           \
int NAME(const T *gate_up, int64_t rows, int64_t width, T *out) {                                     \
    for (int64_t r = 0; r < rows; r++) {                                                               \
        const T *g = gate_up + r * 2 * width, *u = g + width;                                          \
        for (int64_t d = 0; d < width; d++) {                                                          \
            const float x = LOAD(g[d]);                                                                \
            const float e = exp_nonpositive(x < 0.0f ? x : -x); /* exp(-|x|) <= 1 */                 \
            const float sig = x < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e);                           \
            out[r * width + d] = STORE(LOAD(STORE(x * sig)) * LOAD(u[d]));                             \
        }                                                                                              \
    }                                                                                                  \
    return 0;                                                                                          \
}

DEFINE_ADD_RMS_NORM(add_rms_norm_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_ADD_RMS_NORM(add_rms_norm_f32, float, LOAD_F32, STORE_F32)
DEFINE_ROPE_KV_WRITE(rope_kv_write_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_ROPE_KV_WRITE(rope_kv_write_f32, float, LOAD_F32, STORE_F32)
DEFINE_SILU_MUL(silu_mul_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_SILU_MUL(silu_mul_f32, float, LOAD_F32, STORE_F32)
