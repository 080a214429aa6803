/* Vector math of the avx2 path (eight fp32 lanes): the exponential, tanh, SiLU-and-mul and
 * GELU(tanh)-and-mul, with the accuracy of the avx512bf16 path's (csrc/vec_math.h) so that both meet
 * the same tolerances. AVX2 has neither scalef nor masks: 2^n is built in the exponent field and
 * selections are blends. */
#ifndef RTP_AVX2_MATH_H
#define RTP_AVX2_MATH_H

#include "avx2.h"

AVX2_TARGET static inline __m256 avx2_abs(__m256 x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }

/* exp(x) for x <= 0, max rel. error about 2e-7 (NaN gives exp(-87), as the other path's). Cody-Waite
 * reduction x = n ln2 + r with ln2 in two parts, so r keeps its digits, then a degree-7 polynomial.
 * The clamp at -87 keeps n >= -126, where 2^n is still a normal number and its exponent field
 * (n + 127) is positive. */
AVX2_TARGET static inline __m256 avx2_exp(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

/* g * sigmoid(z) * u, the sigmoid from e = exp(-|z|) <= 1, which neither overflows nor loses the tail
 * (1 / (1 + exp(-z)) would overflow for z far below 0). */
AVX2_TARGET static inline __m256 avx2_times_sigmoid_mul(__m256 g, __m256 z, __m256 u) {
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 e = avx2_exp(_mm256_sub_ps(_mm256_setzero_ps(), avx2_abs(z)));
    __m256 num = _mm256_blendv_ps(e, one, _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_GE_OQ));
    __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
    return _mm256_mul_ps(_mm256_mul_ps(g, sig), u);
}

/* silu(g) * u. */
AVX2_TARGET static inline __m256 avx2_silu_mul(__m256 g, __m256 u) { return avx2_times_sigmoid_mul(g, g, u); }

/* gelu(g) * u, tanh-approximated (torch's approximate="tanh"): 0.5 g (1 + tanh(y)) is g sigmoid(2 y),
 * y = sqrt(2 / pi) (g + 0.044715 g^3); the sigmoid keeps the digits 1 + tanh(y) loses where tanh(y)
 * nears -1 (a gate below about -4). */
AVX2_TARGET static inline __m256 avx2_gelu_tanh_mul(__m256 g, __m256 u) {
    __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    __m256 y2 = _mm256_mul_ps(_mm256_set1_ps(2.0f * 0.7978845608028654f),
                              _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715f), cube)));
    return avx2_times_sigmoid_mul(g, y2, u);
}

/* tanh(x), max rel. error about 3e-7, NaN kept. Below |x| = 0.625, x + x^3 P(x^2) (Cephes' tanhf
 * minimax polynomial), since (1 - e) / (1 + e) would lose a small x's digits to cancellation; above,
 * that quotient with e = exp(-2|x|) <= 0.29 and x's sign put back. */
AVX2_TARGET static inline __m256 avx2_tanh(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    __m256 a = avx2_abs(x), z = _mm256_mul_ps(x, x);
    __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.06390887954e-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.37397155531e-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.33314422036e-1f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.33332819422e-1f));
    __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
    __m256 e = avx2_exp(_mm256_mul_ps(a, _mm256_set1_ps(-2.0f)));
    __m256 big = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    big = _mm256_or_ps(big, _mm256_and_ps(x, sign));
    __m256 r = _mm256_blendv_ps(big, small, _mm256_cmp_ps(a, _mm256_set1_ps(0.625f), _CMP_LT_OQ));
    return _mm256_blendv_ps(r, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

#endif
