/* The one matmul entry (hn_matmul): a weight of any packed format (hn_weight_t) multiplied by the kernel its
 * format and unit name, for callers that hold weights of several formats (the layer stack, layers.c: a GGUF
 * file's Q4_K_M layers mix Q4_K and Q6_K matrices, even within a fused wqkv: HN_PARTS).
 */
#include <errno.h>
#include <stddef.h>

#include "handoff_native.h"

/* The Q4 kernels by their Q4_KERNEL_* number. */
static q4_matmul_fn *q4_kernel(int64_t unit) {
    switch (unit) {
    case Q4_KERNEL_INT: return q4_matmul;
    case Q4_KERNEL_BF16DOT: return q4_matmul_bf16dot;
    case Q4_KERNEL_F32: return q4_matmul_f32;
    case Q4_KERNEL_AMX: return q4_matmul_amx;
    case Q4_KERNEL_VNNI: return q4_matmul_vnni;
    case Q4_KERNEL_AVX2: return q4_matmul_avx2;
    }
    return NULL;
}

int hn_matmul(const hn_weight_t *w, const void *x, int x_bf16, int64_t x_stride, int64_t rows, void *y, int y_bf16,
              int64_t y_stride, int64_t threads) {
    if (!w) return -EINVAL;
    if (w->format == HN_PARTS) { /* each part into its columns of y (its rows' results do not depend on it) */
        const hn_weight_t *parts = (const hn_weight_t *)w->packed;
        int64_t out = 0;
        for (int64_t i = 0; i < w->unit; i++) {
            if (parts[i].format == HN_PARTS || parts[i].in != w->in) return -EINVAL;
            out += parts[i].out;
        }
        if (out != w->out) return -EINVAL;
        out = 0;
        for (int64_t i = 0; i < w->unit; i++) {
            const int err = hn_matmul(&parts[i], x, x_bf16, x_stride, rows, (char *)y + out * (y_bf16 ? 2 : 4), y_bf16,
                                      y_stride, threads);
            if (err) return err;
            out += parts[i].out;
        }
        return 0;
    }
    if (w->format == HN_Q4) {
        q4_matmul_fn *const fn = q4_kernel(w->unit);
        return fn ? fn(x, x_bf16, x_stride, rows, w->packed, w->out, w->in, y, y_bf16, y_stride, threads) : -EINVAL;
    }
    return kq_matmul(w->format, w->unit, x, x_bf16, x_stride, rows, w->packed, w->out, w->in, y, y_bf16, y_stride,
                     threads);
}
