/* A decode step's whole layer stack in one call (common/engine/native, Llama.forward): the same kernels the
 * model otherwise calls one by one from Python (attention.c, rowwise.c, hn_matmul), in the same order on the
 * same buffers, so the bits are the same; only the ~9 Python calls a layer are gone (docs/benchmarks.md,
 * "Figures behind the code": The layer stack in one call).
 *
 * Per layer (hn_layer_t; what a family leaves out is NULL), with h the fp32 residual [rows, hidden] and
 * `delta` the last sublayer's output:
 *   x = RMSNorm(h += delta) * attn_norm;  qkv = x @ wqkv (+ bqkv; q, k heads RMSNormed by q_norm, k_norm)
 *   rotary by the layer's cos / sin + K/V write;  o = attention(q, cache; the layer's window, soft-cap)
 *   o = o @ wo (RMSNormed by attn_post_norm);  x = RMSNorm(h += o) * mlp_norm
 *   delta = act(x @ w1) * (x @ w3) @ w2 (RMSNormed by mlp_post_norm), act silu or tanh-GELU
 * and h += delta after the last layer. Every matrix goes through hn_matmul, in whatever format it is packed.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>

#include "handoff_native.h"

int64_t hn_struct_bytes(int64_t which) {
    return which == 0 ? (int64_t)sizeof(hn_weight_t)
           : which == 1 ? (int64_t)sizeof(hn_layer_t)
           : which == 2 ? (int64_t)sizeof(hn_model_t) : -1;
}

static int shaped(const hn_weight_t *w, int64_t out, int64_t in) { return w->out == out && w->in == in; }

#define DEFINE_DECODE_LAYERS(NAME, T, IS_BF16, ADD_RMS_NORM, RMS_NORM, ROPE_KV_WRITE, ATTENTION, SILU_MUL,  \
                             GELU_TANH_MUL)                                                            \
int NAME(float *h, int64_t rows, int64_t num_layers, const hn_layer_t *layers, const hn_model_t *m, T *kv, \
         int64_t layer_stride, const int64_t *positions, const int64_t *slots, const int64_t *table,   \
         int64_t table_stride, const int64_t *lens, int64_t block, int64_t threads, int64_t attn_threads) { \
    const int64_t heads = m->heads, kv_heads = m->kv_heads, head_dim = m->head_dim, hidden = m->hidden;  \
    const int64_t ffn = m->ffn, qkv_width = (heads + 2 * kv_heads) * head_dim, q_width = heads * head_dim; \
    const int64_t widest = 2 * ffn > qkv_width ? 2 * ffn : qkv_width;                                  \
    const float eps = m->eps;                                                                          \
    if (m->activation != HN_ACT_SILU && m->activation != HN_ACT_GELU_TANH) return -EINVAL;             \
    int (*const act_mul)(const T *, int64_t, int64_t, T *, int64_t) =                                  \
        m->activation == HN_ACT_GELU_TANH ? GELU_TANH_MUL : SILU_MUL;                                  \
    for (int64_t i = 0; i < num_layers; i++) {                                                         \
        const hn_layer_t *l = layers + i;                                                              \
        if (!shaped(&l->wqkv, qkv_width, hidden) || !shaped(&l->wo, hidden, q_width)                   \
            || !shaped(&l->w13, 2 * ffn, hidden) || !shaped(&l->w2, hidden, ffn))                      \
            return -EINVAL;                                                                            \
    }                                                                                                  \
    /* x, delta [rows, hidden]; wide (qkv or gate_up) [rows, widest]; o [rows, q_width]; act [rows, ffn] */ \
    T *buf = malloc(sizeof(T) * (size_t)(rows * (2 * hidden + widest + q_width + ffn)));               \
    if (!buf) return -ENOMEM;                                                                          \
    T *x = buf, *delta = x + rows * hidden, *wide = delta + rows * hidden, *o = wide + rows * widest;  \
    T *act = o + rows * q_width;                                                                       \
    int err = 0, have_delta = 0;                                                                       \
    for (int64_t i = 0; i < num_layers && !err; i++) {                                                 \
        const hn_layer_t *l = layers + i;                                                              \
        T *layer_kv = kv + i * layer_stride;                                                           \
        err = ADD_RMS_NORM(h, have_delta ? delta : NULL, l->attn_norm, rows, hidden, eps, x);          \
        if (!err) err = hn_matmul(&l->wqkv, x, IS_BF16, hidden, rows, wide, IS_BF16, qkv_width, threads); \
        if (!err) err = ROPE_KV_WRITE(wide, l->bqkv, l->q_norm, l->k_norm, eps, l->cos, l->sin, positions, rows, \
                                      heads, kv_heads, head_dim, layer_kv, slots);                     \
        if (!err) err = ATTENTION(wide, qkv_width, layer_kv, table, table_stride, lens, block, heads, kv_heads, \
                                  head_dim, m->attn_scale, l->window, m->attn_softcap, o, rows, attn_threads); \
        if (!err) err = hn_matmul(&l->wo, o, IS_BF16, q_width, rows, delta, IS_BF16, hidden, threads); \
        if (!err && l->attn_post_norm) err = RMS_NORM(delta, l->attn_post_norm, rows, hidden, eps, delta); \
        if (!err) err = ADD_RMS_NORM(h, delta, l->mlp_norm, rows, hidden, eps, x);                     \
        if (!err) err = hn_matmul(&l->w13, x, IS_BF16, hidden, rows, wide, IS_BF16, 2 * ffn, threads); \
        if (!err) err = act_mul(wide, rows, ffn, act, threads);                                        \
        if (!err) err = hn_matmul(&l->w2, act, IS_BF16, ffn, rows, delta, IS_BF16, hidden, threads);   \
        if (!err && l->mlp_post_norm) err = RMS_NORM(delta, l->mlp_post_norm, rows, hidden, eps, delta); \
        have_delta = 1;                                                                                \
    }                                                                                                  \
    if (!err && have_delta) err = ADD_RMS_NORM(h, delta, NULL, rows, hidden, eps, NULL);               \
    free(buf);                                                                                         \
    return err;                                                                                        \
}

DEFINE_DECODE_LAYERS(decode_layers_bf16, uint16_t, 1, add_rms_norm_bf16, rms_norm_bf16, rope_kv_write_bf16,
                     decode_attention_bf16, silu_mul_bf16, gelu_tanh_mul_bf16)
DEFINE_DECODE_LAYERS(decode_layers_f32, float, 0, add_rms_norm_f32, rms_norm_f32, rope_kv_write_f32,
                     decode_attention_f32, silu_mul_f32, gelu_tanh_mul_f32)
