#if defined(__aarch64__)
/* Vector math of the NEON path (four fp32 lanes): the exponential, tanh, SiLU-and-mul and GELU(tanh)-and-
 * mul, the same polynomials and reductions as the avx2 path's (csrc/avx2/avx2_math.h), so that all paths
 * meet the same tolerances. Like AVX2, NEON has no scalef: 2^n is built in the exponent field, and
 * selections are bit selects (vbslq) on compare masks. */
#ifndef RTP_NEON_MATH_H
#define RTP_NEON_MATH_H

#include "neon.h"

/* exp(x) for x <= 0, max rel. error about 2e-7 (NaN gives exp(-87), as the other paths'). Cody-Waite
 * reduction x = n ln2 + r with ln2 in two parts, so r keeps its digits, then a degree-7 polynomial.
 * The clamp at -87 keeps n >= -126, where 2^n is still a normal number and its exponent field (n + 127)
 * is positive. FMAXNM, not FMAX: it gives the number, -87, for a NaN lane (FMAX would keep the NaN). */
static inline float32x4_t neon_exp(float32x4_t x) {
    x = vmaxnmq_f32(x, vdupq_n_f32(-87.0f));
    float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f))); /* nearest even */
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));                  /* x - n ln2_hi */
    r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));                           /* - n ln2_lo */
    float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
    p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
    p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
    p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), p, vmulq_f32(r, r));
    int32x4_t two_n = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23); /* n is whole: exact */
    return vmulq_f32(p, vreinterpretq_f32_s32(two_n));
}

/* g * sigmoid(z) * u, the sigmoid from e = exp(-|z|) <= 1, which neither overflows nor loses the tail
 * (1 / (1 + exp(-z)) would overflow for z far below 0). */
static inline float32x4_t neon_times_sigmoid_mul(float32x4_t g, float32x4_t z, float32x4_t u) {
    const float32x4_t one = vdupq_n_f32(1.0f);
    float32x4_t e = neon_exp(vnegq_f32(vabsq_f32(z)));
    float32x4_t num = vbslq_f32(vcgezq_f32(z), one, e); /* z >= 0: 1 / (1 + e), else e / (1 + e) */
    float32x4_t sig = vdivq_f32(num, vaddq_f32(one, e));
    return vmulq_f32(vmulq_f32(g, sig), u);
}

/* silu(g) * u. */
static inline float32x4_t neon_silu_mul(float32x4_t g, float32x4_t u) { return neon_times_sigmoid_mul(g, g, u); }

/* gelu(g) * u, tanh-approximated (torch's approximate="tanh"): 0.5 g (1 + tanh(y)) is g sigmoid(2 y),
 * y = sqrt(2 / pi) (g + 0.044715 g^3); the sigmoid keeps the digits 1 + tanh(y) loses where tanh(y) nears
 * -1 (a gate below about -4). */
static inline float32x4_t neon_gelu_tanh_mul(float32x4_t g, float32x4_t u) {
    float32x4_t cube = vmulq_f32(vmulq_f32(g, g), g);
    float32x4_t y2 = vmulq_f32(vdupq_n_f32(2.0f * 0.7978845608028654f),
                               vaddq_f32(g, vmulq_f32(vdupq_n_f32(0.044715f), cube)));
    return neon_times_sigmoid_mul(g, y2, u);
}

/* tanh(x), max rel. error about 3e-7, NaN kept. Below |x| = 0.625, x + x^3 P(x^2) (Cephes' tanhf minimax
 * polynomial), since (1 - e) / (1 + e) would lose a small x's digits to cancellation; above, that quotient
 * with e = exp(-2|x|) <= 0.29 and x's sign put back. */
static inline float32x4_t neon_tanh(float32x4_t x) {
    const float32x4_t one = vdupq_n_f32(1.0f);
    float32x4_t a = vabsq_f32(x), z = vmulq_f32(x, x);
    float32x4_t p = vdupq_n_f32(-5.70498872745e-3f);
    p = vfmaq_f32(vdupq_n_f32(2.06390887954e-2f), p, z);
    p = vfmaq_f32(vdupq_n_f32(-5.37397155531e-2f), p, z);
    p = vfmaq_f32(vdupq_n_f32(1.33314422036e-1f), p, z);
    p = vfmaq_f32(vdupq_n_f32(-3.33332819422e-1f), p, z);
    float32x4_t small = vfmaq_f32(x, vmulq_f32(p, z), x);
    float32x4_t e = neon_exp(vmulq_f32(a, vdupq_n_f32(-2.0f)));
    float32x4_t big = vdivq_f32(vsubq_f32(one, e), vaddq_f32(one, e));
    /* |big| with x's sign bit: the select takes the sign bit from x, the rest from big */
    big = vbslq_f32(vdupq_n_u32(0x80000000u), x, big);
    float32x4_t r = vbslq_f32(vcltq_f32(a, vdupq_n_f32(0.625f)), small, big);
    return vbslq_f32(vceqq_f32(x, x), r, x); /* a NaN lane: x itself */
}

#endif
#endif
