/* The native decode library's interface (common/engine/native): every function it exports, and every
 * number Python must agree with it on. Every .c file includes it. Python reads the integer #defines below
 * from this file (native/header.py) and never restates them, so a layout changed here changes both sides.
 *
 * Functions return 0 or a negative errno: -EINVAL (arguments refused), -ENOMEM, -ENOSYS (a kernel this build
 * or CPU lacks); attention and the row-wise ops answer -1 for arguments they refuse and -2 when out of memory.
 * Attention, the row-wise ops and the layer stack come in the model's two dtypes: _bf16 (uint16_t holding bf16
 * bits) and _f32.
 */
#ifndef HANDOFF_NATIVE_H
#define HANDOFF_NATIVE_H

#include <stdint.h>

/* ---- The packed weights' layouts (native/packing.py writes them, the matmuls read them) */

#define GROUP 32         /* inputs a block: a GGUF Q4 block, and a q8 record's codes of one output */
#define QUAD 4           /* outputs packed together, their blocks interleaved: one sequential stream a tile */
#define Q4_RECORD 80     /* bytes of one block of a quad (quads layout): 4 x 16 code bytes, 4 fp16 d, 4 fp16 m */
#define Q8_RECORD 128    /* bytes of one block of a q8 quad: 4 x 32 int8 codes */
#define DIGIT_OUTPUTS 16 /* the int8 digit kernels' group of outputs: one register of 16 int32 / fp32 */
#define DIGIT_RECORD 320 /* bytes of one block of a group (digits layout): 256 of codes, 16 fp16 d, 16 fp16 m */

/* The GGUF K-quants and Q8_0, packed for the int8 digit kernels (matmul_kquants.c) as pack_quant lays them
 * out: [groups of DIGIT_OUTPUTS outputs, blocks, record], a record one block (QK_K inputs; Q8_0: GROUP) of a
 * group's 16 rows: their 16 blocks of the file, field by field in the file's order, each field's bytes
 * interleaved across the 16 outputs KQ_WORD bytes at a time for the codes and high bits (so that 64 bytes
 * of a field are one register of 16 dwords, dword n output n's 4 bytes, as vpdpbusd takes them), 2 for an
 * fp16, 1 for the scales. Nothing is widened, and nothing added but Q6_K's padding: a record is the 16 blocks'
 * bytes, moved.
 *
 *   Q8_0 (34-byte blocks of 32 inputs): 16 fp16 d, then 8 chunks of 64 codes (chunk k: inputs 4k .. 4k + 3).
 *   Q4_K (144-byte blocks of 256): 16 fp16 d, 16 fp16 dmin, 12 x 16 bytes of the 6-bit scales and mins as
 *     GGUF packs them (byte 16b + n: output n's byte b), then 32 chunks of codes (chunk 8c + k: the low
 *     nibbles inputs 64c + 4k .. + 3, the high ones those + 32: sub-blocks 2c and 2c + 1).
 *   Q5_K (176): d, dmin, the scales, 8 chunks of fifth bits (chunk k, bit i of a byte: sub-block i's input
 *     4k + t), then the codes as Q4_K's.
 *   Q6_K (210): 32 chunks of the low 4 bits (chunk 16h + k: inputs 128h + 4k .. + 3 in the low nibbles, those
 *     + 64 in the high ones), 16 of the top 2 (chunk 8h + k, bits 2p, 2p + 1: input 128h + 32p + 4k + t's),
 *     16 x 16 int8 scales (byte 16i + n: output n's of sub-block i), 16 fp16 d, then 32 bytes of zeros, so that
 *     every record, and every chunk in it, starts a cache line (16 x 210 is 52.5 lines: every other record's
 *     chunks straddled two, which cost a one-row step more than the 1 % more bytes). */
#define QK_K 256        /* inputs a K-quant super-block */
#define KQ_WORD 4       /* bytes of a code field an output takes in turn: dword n of a chunk */
#define Q8_0_RECORD 544 /* 16 x 34 */
#define Q4_K_RECORD 2304 /* 16 x 144 */
#define Q5_K_RECORD 2816 /* 16 x 176 */
#define Q6_K_RECORD 3392 /* 16 x 210 + 32 */

/* ---- Weight formats of the one matmul entry, hn_matmul (matmul_dispatch.c) */

#define HN_Q4 0   /* GGUF Q4_0 / Q4_1 as pack_q4 lays them out for the Q4 kernel `unit` (a Q4_KERNEL_*) */
#define HN_Q8_0 1 /* pack_quant's layouts above; `unit` one of the int8 digit kernel's: Q4_KERNEL_AVX2, _VNNI */
#define HN_Q4_K 2 /* (_AMX runs the VNNI unit: the same bits) */
#define HN_Q5_K 3
#define HN_Q6_K 4
/* Row segments of other weights, one after the other, each of its own format: a fused matrix whose parts the
 * file stores in different formats (a Q4_K_M file's attn_q and attn_k in Q4_K, attn_v in Q6_K). `packed`
 * points to an array of `unit` hn_weight_t (none of them parts), each of `in` inputs, their outputs adding up
 * to `out`. */
#define HN_PARTS 5

/* ---- The Q4 kernels, numbered for an HN_Q4 weight's unit (native/choice.py's Q4_INDEX) */

#define Q4_KERNEL_INT 0     /* q4_matmul */
#define Q4_KERNEL_BF16DOT 1 /* q4_matmul_bf16dot */
#define Q4_KERNEL_F32 2     /* q4_matmul_f32 */
#define Q4_KERNEL_AMX 3     /* q4_matmul_amx */
#define Q4_KERNEL_VNNI 4    /* q4_matmul_vnni */
#define Q4_KERNEL_AVX2 5    /* q4_matmul_avx2 */

/* ---- The shapes attention and the row-wise ops take (native/bindings.py's DecodeKernels.supports) */

#define LANES 16            /* their sums' fixed lanes: head_dim and hidden are multiples of it */
#define MAX_HEADS_PER_KV 16 /* query heads sharing one KV head */
#define MAX_HEADS 256
#define MAX_HEAD_DIM 256

/* ---- refine_top's limits */

#define REFINE_MAX 1024 /* the largest k */
#define REFINE_LANES 8  /* its dot products' lanes: dim is a multiple of it */

/* ---- Attention over the paged cache (attention.c): row r's query attends to its positions max(0, lens[r] -
 * window) .. lens[r] - 1 (window 0: from 0), scores q . k * scale, soft-capped to tanh(s / softcap) * softcap
 * where softcap > 0. */

int decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *kv, const int64_t *table,
                          int64_t table_stride, const int64_t *lens, int64_t block, int64_t heads, int64_t kv_heads,
                          int64_t dim, float scale, int64_t window, float softcap, uint16_t *out, int64_t rows,
                          int64_t threads);
int decode_attention_f32(const float *q, int64_t q_stride, const float *kv, const int64_t *table,
                         int64_t table_stride, const int64_t *lens, int64_t block, int64_t heads, int64_t kv_heads,
                         int64_t dim, float scale, int64_t window, float softcap, float *out, int64_t rows,
                         int64_t threads);

/* ---- The row-wise ops around the matmuls (rowwise.c) */

int add_rms_norm_bf16(float *h, const uint16_t *delta, const float *w, int64_t rows, int64_t dim, float eps,
                      uint16_t *out);
int add_rms_norm_f32(float *h, const float *delta, const float *w, int64_t rows, int64_t dim, float eps, float *out);
int rms_norm_bf16(const uint16_t *x, const float *w, int64_t rows, int64_t dim, float eps, uint16_t *out);
int rms_norm_f32(const float *x, const float *w, int64_t rows, int64_t dim, float eps, float *out);
/* bias, q_norm and k_norm may be NULL (none) */
int rope_kv_write_bf16(uint16_t *qkv, const uint16_t *bias, const float *q_norm, const float *k_norm, float eps,
                       const uint16_t *cos, const uint16_t *sin, const int64_t *positions, int64_t rows, int64_t heads,
                       int64_t kv_heads, int64_t dim, uint16_t *kv, const int64_t *slots);
int rope_kv_write_f32(float *qkv, const float *bias, const float *q_norm, const float *k_norm, float eps,
                      const float *cos, const float *sin, const int64_t *positions, int64_t rows, int64_t heads,
                      int64_t kv_heads, int64_t dim, float *kv, const int64_t *slots);
int silu_mul_bf16(const uint16_t *gate_up, int64_t rows, int64_t width, uint16_t *out, int64_t threads);
int silu_mul_f32(const float *gate_up, int64_t rows, int64_t width, float *out, int64_t threads);
int gelu_tanh_mul_bf16(const uint16_t *gate_up, int64_t rows, int64_t width, uint16_t *out, int64_t threads);
int gelu_tanh_mul_f32(const float *gate_up, int64_t rows, int64_t width, float *out, int64_t threads);

/* ---- The weight matmuls: y [rows, out] (y_stride apart, fp32 or bf16) = x [rows, in] (x_stride apart,
 * fp32 or bf16) @ W^T, W packed as above; `threads` of torch's OpenMP team. */

/* The Q4 kernels: one signature, W in the quads layout (int, bf16dot, f32) or the digits one (the rest). */
typedef int q4_matmul_fn(const void *x, int x_bf16, int64_t x_stride, int64_t rows, const uint8_t *packed,
                         int64_t out, int64_t in, void *y, int y_bf16, int64_t y_stride, int64_t threads);
q4_matmul_fn q4_matmul;           /* integer products (matmul_q4_int.c) */
q4_matmul_fn q4_matmul_bf16dot;   /* the bf16 dot instruction (matmul_q4_bf16dot.c) */
q4_matmul_fn q4_matmul_f32;       /* fp32 products (matmul_q4_f32.c) */
q4_matmul_fn q4_matmul_avx2;      /* integer products by int8 digits, AVX2 unit (matmul_q4_digits.c) */
q4_matmul_fn q4_matmul_vnni;      /* the same bits by AVX512_VNNI */
q4_matmul_fn q4_matmul_amx;       /* the same bits by AMX tiles from AMX_MIN_ROWS rows, VNNI below */
q4_matmul_fn q4_matmul_amx_tiles; /* the same bits by AMX tiles at any batch (for the tests) */

/* One weight matrix, packed: its format (HN_*), the kernel unit that multiplies it, its bytes, q8's scales. */
typedef struct {
    int64_t format;
    int64_t unit;
    const uint8_t *packed;
    const float *scale; /* NULL but for the int8 LM head */
    int64_t out, in;
} hn_weight_t;

/* y = x @ W^T for W of any packed format, by the kernel its format and unit name (matmul_dispatch.c). */
int hn_matmul(const hn_weight_t *w, const void *x, int x_bf16, int64_t x_stride, int64_t rows, void *y, int y_bf16,
              int64_t y_stride, int64_t threads);

/* The K-quant and Q8_0 kernels (matmul_kquants.c): format HN_Q8_0 .. HN_Q6_K, unit Q4_KERNEL_AVX2 or _VNNI
 * (_AMX: the VNNI unit). -ENOSYS where this build or CPU lacks the unit. */
int kq_matmul(int64_t format, int64_t unit, const void *x, int x_bf16, int64_t x_stride, int64_t rows,
              const uint8_t *packed, int64_t out, int64_t in, void *y, int y_bf16, int64_t y_stride, int64_t threads);

/* Rows ids[0 .. n - 1] of a packed K-quant or Q8_0 weight, dequantized to fp32 into y [n, in]: the values
 * gguf.quants.dequantize gives, bit for bit, in every build (kquant_rows.c). */
int kq_dequant_rows(int64_t format, const uint8_t *packed, int64_t out, int64_t in, const int64_t *ids, int64_t n,
                    float *y, int64_t threads);

/* The int8 LM head: codes [quads, in / GROUP, QUAD, GROUP], scale [quads * QUAD] (matmul_q8_head.c). */
int q8_matmul(const void *x, int x_bf16, int64_t x_stride, int64_t rows, const int8_t *packed, const float *scale,
              int64_t out, int64_t in, void *y, int y_bf16, int64_t y_stride, int64_t threads);

/* ---- A decode step's whole layer stack in one call (layers.c) */

#define HN_ACT_SILU 0      /* the MLP's gate: silu (Llama, Mistral, Qwen, Phi-3) */
#define HN_ACT_GELU_TANH 1 /* tanh-approximated GELU (Gemma's GeGLU) */

/* One layer: what every family's layer is made of (families.py); an optional part is NULL (or 0) where the
 * family has none. Norm weights are fp32 and as the model multiplies by them (Gemma's 1 + w already added);
 * bqkv, cos and sin are in the model's dtype. */
typedef struct {
    hn_weight_t wqkv, wo, w13, w2;   /* [(heads + 2 kv_heads) head_dim, hidden], [hidden, heads head_dim],
                                        [2 ffn, hidden] (gate, then up), [hidden, ffn] */
    const float *attn_norm;          /* [hidden], before attention */
    const float *mlp_norm;           /* [hidden], before the MLP */
    const float *attn_post_norm;     /* [hidden]: attention's output normed before the residual add (Gemma) */
    const float *mlp_post_norm;      /* [hidden]: the MLP's output, the same */
    const void *bqkv;                /* [(heads + 2 kv_heads) head_dim]: the q, k, v projections' bias (Qwen 2) */
    const float *q_norm, *k_norm;    /* [head_dim]: RMSNorm of every q and k head before the rotation (Qwen 3,
                                        Gemma 3) */
    const void *cos, *sin;           /* [positions, head_dim]: this layer's rotary tables */
    int64_t window;                  /* a row attends to its last `window` positions (itself included); 0: all */
} hn_layer_t;

/* What every layer shares. */
typedef struct {
    int64_t heads, kv_heads, head_dim, hidden, ffn;
    int64_t activation;              /* HN_ACT_* */
    float eps;                       /* every RMSNorm's */
    float attn_scale;                /* scores = q . k * attn_scale */
    float attn_softcap;              /* scores -> tanh(scores / cap) * cap (Gemma 2); 0: none */
} hn_model_t;

/* sizeof the structs above (0: hn_weight_t, 1: hn_layer_t, 2: hn_model_t), so that Python's ctypes mirrors
 * can check theirs; -1 for another `which`. */
int64_t hn_struct_bytes(int64_t which);

/* Every layer of a decode step on the fp32 residual h [rows, hidden], in place, through kv [layers, slots, 2,
 * kv_heads, head_dim] (layer_stride elements a layer); positions, slots, table and lens as rope_kv_write and
 * decode_attention take them. */
int decode_layers_bf16(float *h, int64_t rows, int64_t num_layers, const hn_layer_t *layers, const hn_model_t *model,
                       uint16_t *kv, int64_t layer_stride, const int64_t *positions, const int64_t *slots,
                       const int64_t *table, int64_t table_stride, const int64_t *lens, int64_t block,
                       int64_t threads, int64_t attn_threads);
int decode_layers_f32(float *h, int64_t rows, int64_t num_layers, const hn_layer_t *layers, const hn_model_t *model,
                      float *kv, int64_t layer_stride, const int64_t *positions, const int64_t *slots,
                      const int64_t *table, int64_t table_stride, const int64_t *lens, int64_t block,
                      int64_t threads, int64_t attn_threads);

/* ---- The logits after the LM head (logits.c) */

int refine_top(float *logits, int64_t rows, int64_t vocab, const float *hidden, const float *head, int64_t dim,
               int64_t k, int64_t threads);
int argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out, int64_t threads);

#endif
