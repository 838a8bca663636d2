/* What attention.c and rowwise.c share: exp over the non-positive numbers and tanh built on it, the fixed tree
 * over LANES lanes that their sums end in, and fp32's identity load and store beside bf16's (bf16.h). */
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

/* tanh(y) in plain operations (exp_nonpositive, a polynomial, selects), so that the scalar loops and the
 * vectorised AVX2 / AVX-512 ones give the same bits: libm's tanhf and its vector version (libmvec) need not.
 * |y| < 0.3: the odd Taylor polynomial to y^11 (the next term is under 1e-8 of y there); above, (1 - e) /
 * (1 + e) with e = exp(-2|y|) <= 0.55, a few ulp. NaN stays NaN, +-inf gives +-1. */
static inline float tanh_portable(float y) {
    const float a = y < 0.0f ? -y : y;
    const float e = exp_nonpositive(-2.0f * a);
    const float large = (1.0f - e) / (1.0f + e);
    const float a2 = a * a;
    float p = -8.86323552e-3f; /* -1382 / 155925 */
    p = p * a2 + 2.18694885e-2f; /* 62 / 2835 */
    p = p * a2 - 5.39682540e-2f; /* -17 / 315 */
    p = p * a2 + 1.33333333e-1f; /* 2 / 15 */
    p = p * a2 - 3.33333333e-1f; /* -1 / 3 */
    const float small = a + a * a2 * p;
    const float t = a < 0.3f ? small : large;
    return y < 0.0f ? -t : t;
}

static inline float sum_lanes(const float *l) { /* a fixed tree over the 16 lanes */
    float a[8];
    for (int i = 0; i < 8; i++) a[i] = l[i] + l[i + 8];
    for (int i = 0; i < 4; i++) a[i] = a[i] + a[i + 4];
    return (a[0] + a[2]) + (a[1] + a[3]);
}

#endif
