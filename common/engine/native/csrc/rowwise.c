/* The small row-wise ops around a decode layer's matmuls (common/engine/native), fused: one call each instead
 * of 5-10 torch ops, whose time was mostly per-op overhead (docs/benchmarks.md, "Figures behind the code":
 * Row-wise ops fused). Rows are independent and every sum has a fixed order, as in attention.c. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "float_math.h"
#include "handoff_native.h"

/* h [rows, dim] fp32 residual += delta (model dtype, or NULL), then out = RMSNorm(h) * w in the model
 * dtype: (h * (1 / sqrt(mean(h^2) + eps))) * w, as F.rms_norm; out NULL: the add alone. */
#define DEFINE_ADD_RMS_NORM(NAME, T, LOAD, STORE)                                                       \
int NAME(float *h, const T *delta, const float *w, int64_t rows, int64_t dim, float eps, T *out) {    \
    if (dim % LANES) return -1;                                                                        \
    for (int64_t r = 0; r < rows; r++) {                                                               \
        float *x = h + r * dim;                                                                        \
        if (delta)                                                                                     \
            for (int64_t d = 0; d < dim; d++) x[d] += LOAD(delta[r * dim + d]);                        \
        if (!out) continue;                                                                            \
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
 * before the product as F.silu(gate) * up does. Rows split between `threads` (torch's OpenMP team). */
#define DEFINE_SILU_MUL(NAME, T, LOAD, STORE)                                                           \
int NAME(const T *restrict gate_up, int64_t rows, int64_t width, T *restrict out, int64_t threads) {  \
    _Pragma("omp parallel for num_threads((int)threads) if (threads > 1 && rows > 1)")                 \
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
