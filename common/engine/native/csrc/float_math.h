/* What attention.c and rowwise.c share: exp over the non-positive numbers, the fixed tree over LANES lanes
 * that their sums end in, and fp32's identity load and store beside bf16's (bf16.h). */
#ifndef HANDOFF_FLOAT_MATH_H
#define HANDOFF_FLOAT_MATH_H

#include <stdint.h>
#include <string.h>

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)

/* exp(x) for x <= 0 (scores minus their maximum): 2^n * p(r), |r| <= ln2 / 2, about 2 ulp. */
static inline float exp_nonpositive(float x_in) {
    /* Branch-free (selects, which -fno-trapping-math lets GCC blend: native/build.py's FLAGS) so that loops over it
     * vectorize. */
    const float x = x_in < -87.0f ? -87.0f : x_in;
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
    return x_in < -87.0f ? 0.0f : p * scale;
}

static inline float sum_lanes(const float *l) { /* a fixed tree over the 16 lanes */
    float a[8];
    for (int i = 0; i < 8; i++) a[i] = l[i] + l[i + 8];
    for (int i = 0; i < 4; i++) a[i] = a[i] + a[i + 4];
    return (a[0] + a[2]) + (a[1] + a[3]);
}

#endif
