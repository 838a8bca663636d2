/* hn_matmul: one weight matmul whatever the weight's packed format (hn_weight_t, handoff_native.h), so that the
 * layer stack (layers.c) names each matrix by its descriptor. HN_Q4: the Q4 kernel its unit numbers. */
#include <errno.h>
#include <stdint.h>

#include "handoff_native.h"

static q4_matmul_fn *q4_kernel(int64_t unit) {
    switch (unit) {
    case Q4_KERNEL_INT: return q4_matmul;
    case Q4_KERNEL_BF16DOT: return q4_matmul_bf16dot;
    case Q4_KERNEL_F32: return q4_matmul_f32;
    case Q4_KERNEL_AMX: return q4_matmul_amx;
    case Q4_KERNEL_VNNI: return q4_matmul_vnni;
    case Q4_KERNEL_AVX2: return q4_matmul_avx2;
    default: return 0;
    }
}

int hn_matmul(const hn_weight_t *w, const void *x, int x_bf16, int64_t x_stride, int64_t rows, void *y, int y_bf16,
              int64_t y_stride, int64_t threads) {
    if (w->format == HN_Q4) {
        q4_matmul_fn *const kernel = q4_kernel(w->unit);
        if (!kernel) return -EINVAL;
        return kernel(x, x_bf16, x_stride, rows, w->packed, w->out, w->in, y, y_bf16, y_stride, threads);
    }
    return -EINVAL;
}
