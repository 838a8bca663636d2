/* A decode step's whole layer stack in one call (common/engine/native, Llama.forward): the same kernels the
 * model otherwise calls one by one from Python (attention.c, rowwise.c, matmul_q4_*.c), in the same order on
 * the same buffers, so the bits are the same; only the ~9 Python calls a layer are gone (docs/benchmarks.md,
 * "Figures behind the code": The layer stack in one call).
 *
 * Per layer, with h the fp32 residual [rows, hidden] and `delta` the last sublayer's output:
 *   x = RMSNorm(h += delta) * attn_norm;  qkv = x @ wqkv;  rotary + K/V write;  o = attention(q, cache)
 *   x = RMSNorm(h += o @ wo) * mlp_norm;   delta = silu(x @ w1) * (x @ w3) @ w2
 * and h += delta after the last layer. The weights are packed for one of the Q4 kernels, which multiplies
 * them: integer, bf16 dot, fp32, or int8 digits by AMX, VNNI or AVX2 (q4_kernel, numbered in
 * handoff_native.h; the model's choice: native/choice.py).
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>

#include "handoff_native.h"

#define DEFINE_DECODE_LAYERS(NAME, T, IS_BF16, ADD_RMS_NORM, ROPE_KV_WRITE, ATTENTION, SILU_MUL)        \
int NAME(float *h, int64_t rows, int64_t num_layers, void *const *weights, T *kv, int64_t layer_stride, \
         const T *cos, const T *sin, const int64_t *positions, const int64_t *slots, const int64_t *table,  \
         int64_t table_stride, const int64_t *lens, int64_t block, int64_t heads, int64_t kv_heads,     \
         int64_t head_dim, int64_t hidden, int64_t ffn, float eps, float attn_scale, int64_t threads,   \
         int64_t attn_threads, int64_t q4_kernel) {                                                    \
    q4_matmul_fn *const q4 = q4_kernel == Q4_KERNEL_BF16DOT ? q4_matmul_bf16dot                        \
                             : q4_kernel == Q4_KERNEL_F32 ? q4_matmul_f32                              \
                             : q4_kernel == Q4_KERNEL_AMX ? q4_matmul_amx                              \
                             : q4_kernel == Q4_KERNEL_VNNI ? q4_matmul_vnni                            \
                             : q4_kernel == Q4_KERNEL_AVX2 ? q4_matmul_avx2 : q4_matmul;               \
    const int64_t qkv_width = (heads + 2 * kv_heads) * head_dim, q_width = heads * head_dim;           \
    const int64_t widest = 2 * ffn > qkv_width ? 2 * ffn : qkv_width;                                  \
    /* x, delta [rows, hidden]; wide (qkv or gate_up) [rows, widest]; o [rows, q_width]; act [rows, ffn] */ \
    T *buf = malloc(sizeof(T) * (size_t)(rows * (2 * hidden + widest + q_width + ffn)));               \
    if (!buf) return -ENOMEM;                                                                          \
    T *x = buf, *delta = x + rows * hidden, *wide = delta + rows * hidden, *o = wide + rows * widest;  \
    T *act = o + rows * q_width;                                                                       \
    int err = 0, have_delta = 0;                                                                       \
    for (int64_t i = 0; i < num_layers && !err; i++) {                                                 \
        void *const *w = weights + i * LAYER_POINTERS;                                                 \
        T *layer_kv = kv + i * layer_stride;                                                           \
        err = ADD_RMS_NORM(h, have_delta ? delta : NULL, w[0], rows, hidden, eps, x);                  \
        if (!err) err = q4(x, IS_BF16, hidden, rows, w[1], qkv_width, hidden, wide, IS_BF16, qkv_width, threads); \
        if (!err) err = ROPE_KV_WRITE(wide, cos, sin, positions, rows, heads, kv_heads, head_dim, layer_kv, slots); \
        if (!err) err = ATTENTION(wide, qkv_width, layer_kv, table, table_stride, lens, block, heads, kv_heads, \
                                  head_dim, attn_scale, o, rows, attn_threads);                        \
        if (!err) err = q4(o, IS_BF16, q_width, rows, w[2], hidden, q_width, delta, IS_BF16, hidden, threads); \
        if (!err) err = ADD_RMS_NORM(h, delta, w[3], rows, hidden, eps, x);                            \
        if (!err) err = q4(x, IS_BF16, hidden, rows, w[4], 2 * ffn, hidden, wide, IS_BF16, 2 * ffn, threads); \
        if (!err) err = SILU_MUL(wide, rows, ffn, act, threads);                                       \
        if (!err) err = q4(act, IS_BF16, ffn, rows, w[5], hidden, ffn, delta, IS_BF16, hidden, threads); \
        have_delta = 1;                                                                                \
    }                                                                                                  \
    if (!err && have_delta) err = ADD_RMS_NORM(h, delta, NULL, rows, hidden, eps, NULL);               \
    free(buf);                                                                                         \
    return err;                                                                                        \
}

DEFINE_DECODE_LAYERS(decode_layers_bf16, uint16_t, 1, add_rms_norm_bf16, rope_kv_write_bf16, decode_attention_bf16,
                     silu_mul_bf16)
DEFINE_DECODE_LAYERS(decode_layers_f32, float, 0, add_rms_norm_f32, rope_kv_write_f32, decode_attention_f32,
                     silu_mul_f32)
