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

/* RMSNorm of n values of the model dtype, in place: (x * (1 / sqrt(mean(x^2) + eps))) * w rounded to the
 * dtype, the sum of squares in LANES lanes and sum_lanes (n a multiple of LANES), as add_rms_norm's. */
#define DEFINE_NORM_IN_PLACE(NAME, T, LOAD, STORE)                                                      \
static inline void NAME(T *x, const float *w, int64_t n, float eps) {                                  \
    float lanes[LANES] = {0};                                                                          \
    for (int64_t d0 = 0; d0 < n; d0 += LANES)                                                          \
        for (int l = 0; l < LANES; l++) {                                                              \
            const float v = LOAD(x[d0 + l]);                                                           \
            lanes[l] += v * v;                                                                         \
        }                                                                                              \
    const float inv = 1.0f / sqrtf(sum_lanes(lanes) / (float)n + eps);                                 \
    for (int64_t d = 0; d < n; d++) x[d] = STORE((LOAD(x[d]) * inv) * w[d]);                           \
}

/* out [rows, dim] = RMSNorm(x) * w in the model dtype (a sublayer's output before the residual add: Gemma's
 * post norms); out may be x. */
#define DEFINE_RMS_NORM(NAME, T, NORM)                                                                  \
int NAME(const T *x, const float *w, int64_t rows, int64_t dim, float eps, T *out) {                  \
    if (dim % LANES) return -1;                                                                        \
    for (int64_t r = 0; r < rows; r++) {                                                               \
        if (out != x) memcpy(out + r * dim, x + r * dim, sizeof(T) * (size_t)dim);                     \
        NORM(out + r * dim, w, dim, eps);                                                              \
    }                                                                                                  \
    return 0;                                                                                          \
}

/* qkv [rows, (heads + 2 kv_heads) * dim], model dtype, each row in place: + bias (where given: q, k and v,
 * rounded to the dtype as torch's add), then RMSNorm of every q head by q_norm and every k head by k_norm
 * (where given, eps; rounded to the dtype), then the rotation of the q and k heads at the row's position (HF's
 * rotate_half: x * cos + rotate_half(x) * sin, each product rounded to the dtype as torch does); then the row's
 * K and V (adjacent in qkv, as in a cache slot) are copied into kv at slots[row]. */
#define DEFINE_ROPE_KV_WRITE(NAME, T, LOAD, STORE, NORM)                                                \
int NAME(T *qkv, const T *bias, const float *q_norm, const float *k_norm, float eps, const T *cos,     \
         const T *sin, const int64_t *positions, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, \
         T *kv, const int64_t *slots) {                                                                \
    const int64_t half = dim / 2, width = (heads + 2 * kv_heads) * dim, slot_width = 2 * kv_heads * dim; \
    if (dim % 2 || dim > 512 || ((q_norm || k_norm) && dim % LANES)) return -1;                        \
    for (int64_t r = 0; r < rows; r++) {                                                               \
        T *row = qkv + r * width;                                                                      \
        if (bias)                                                                                      \
            for (int64_t d = 0; d < width; d++) row[d] = STORE(LOAD(row[d]) + LOAD(bias[d]));          \
        const T *c = cos + positions[r] * dim, *s = sin + positions[r] * dim;                          \
        for (int64_t hd = 0; hd < heads + kv_heads; hd++) {                                            \
            T *x = row + hd * dim;                                                                     \
            const float *norm = hd < heads ? q_norm : k_norm;                                          \
            if (norm) NORM(x, norm, dim, eps);                                                         \
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

/* gate_up as silu_mul's -> out: gelu_tanh(gate) * up, GELU's tanh approximation (Gemma's GeGLU, torch's
 * F.gelu(approximate="tanh")): 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), rounded to the dtype before
 * the product; tanh_portable, so that every build gives the same bits. */
#define DEFINE_GELU_TANH_MUL(NAME, T, LOAD, STORE)                                                      \
int NAME(const T *restrict gate_up, int64_t rows, int64_t width, T *restrict out, int64_t threads) {  \
    _Pragma("omp parallel for num_threads((int)threads) if (threads > 1 && rows > 1)")                 \
    for (int64_t r = 0; r < rows; r++) {                                                               \
        const T *g = gate_up + r * 2 * width, *u = g + width;                                          \
        for (int64_t d = 0; d < width; d++) {                                                          \
            const float x = LOAD(g[d]);                                                                \
            const float inner = 0.7978845608028654f * (x + 0.044715f * (x * x * x));                   \
            const float gelu = 0.5f * x * (1.0f + tanh_portable(inner));                               \
            out[r * width + d] = STORE(LOAD(STORE(gelu)) * LOAD(u[d]));                                \
        }                                                                                              \
    }                                                                                                  \
    return 0;                                                                                          \
}

DEFINE_ADD_RMS_NORM(add_rms_norm_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_ADD_RMS_NORM(add_rms_norm_f32, float, LOAD_F32, STORE_F32)
DEFINE_NORM_IN_PLACE(norm_in_place_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_NORM_IN_PLACE(norm_in_place_f32, float, LOAD_F32, STORE_F32)
DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, norm_in_place_bf16)
DEFINE_RMS_NORM(rms_norm_f32, float, norm_in_place_f32)
DEFINE_ROPE_KV_WRITE(rope_kv_write_bf16, uint16_t, bf16_to_f32, f32_to_bf16, norm_in_place_bf16)
DEFINE_ROPE_KV_WRITE(rope_kv_write_f32, float, LOAD_F32, STORE_F32, norm_in_place_f32)
DEFINE_SILU_MUL(silu_mul_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_SILU_MUL(silu_mul_f32, float, LOAD_F32, STORE_F32)
DEFINE_GELU_TANH_MUL(gelu_tanh_mul_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_GELU_TANH_MUL(gelu_tanh_mul_f32, float, LOAD_F32, STORE_F32)
