/* Vector math rtp's kernels share (AVX-512, fp32): bf16 conversions, masked row access, the
 * exponentials of softmax arguments, SiLU-and-mul, tanh and GELU(tanh)-and-mul. One definition, so
 * that the fused MLP epilogue of the AMX linear (linear/amx_linear.c) and the separate SiLU-and-mul
 * kernel (activation.c) agree bit for bit. */
#ifndef RTP_VEC_MATH_H
#define RTP_VEC_MATH_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "denormals.h"

#define RTP_VEC_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

/* 16 bf16 at p as fp32 (exact). */
RTP_VEC_TARGET static inline __m512 bf16x16_to_f32(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}


/* The lanes of a vector that lie within the `left` values still to go. */
RTP_VEC_TARGET static inline __mmask16 lanes(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

/* Values at..at+15 of a bf16 or fp32 array as fp32 (lanes outside k: 0, nothing read there). */
RTP_VEC_TARGET static inline __m512 load16(const void *p, int bf16, int64_t at, __mmask16 k) {
    if (bf16) {
        __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t *)p + at);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(k, (const float *)p + at);
}

RTP_VEC_TARGET static inline void store16(void *p, int bf16, int64_t at, __mmask16 k, __m512 v) {
    if (bf16) _mm256_mask_storeu_epi16((uint16_t *)p + at, k, (__m256i)_mm512_cvtneps_pbh(v));
    else _mm512_mask_storeu_ps((float *)p + at, k, v);
}

/* exp(x) for x <= 0 (softmax arguments), max rel. error about 2e-7. */
RTP_VEC_TARGET static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* 2^t for the softmax's arguments of the attention kernels on tiles (already in base 2, at most
 * 0, finite: -inf gives NaN): relative error under 5e-5, far below the bf16 rounding (2e-3) the
 * probabilities get next; the sum's error, the same fraction, is below the output's bf16
 * rounding too. Far below -126 the scale step flushes to 0. */
RTP_VEC_TARGET static inline __m512 exp2_ps(__m512 t) {
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n); /* [-0.5, 0.5] */
    __m512 p = _mm512_set1_ps(9.6181291e-3f); /* (ln 2)^k / k!, k = 4 .. 0 */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* silu(g) * u. The sigmoid comes from e = exp(-|g|) <= 1, which neither overflows nor loses
 * the tail. */
RTP_VEC_TARGET static inline __m512 silu_mul_ps(__m512 g, __m512 u) {
    __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ), e,
                                      _mm512_set1_ps(1.0f));
    __m512 sig = _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    return _mm512_mul_ps(_mm512_mul_ps(g, sig), u);
}

/* tanh(x), max rel. error about 3e-7, NaN kept: below |x| = 0.625 x + x^3 P(x^2) (a minimax
 * polynomial, the one Cephes' tanhf uses), where (1 - e) / (1 + e) would lose the digits of a small
 * x to cancellation; above it that quotient with e = exp(-2|x|) <= 0.29, the sign put back. */
RTP_VEC_TARGET static inline __m512 tanh_ps(__m512 x) {
    __m512 a = _mm512_abs_ps(x), z = _mm512_mul_ps(x, x);
    __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.06390887954e-2f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-5.37397155531e-2f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.33314422036e-1f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-3.33332819422e-1f));
    __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), x, x);
    __m512 e = exp_ps(_mm512_mul_ps(a, _mm512_set1_ps(-2.0f)));
    __m512 big = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.0f), e), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    big = _mm512_or_ps(big, _mm512_and_ps(x, _mm512_set1_ps(-0.0f)));
    __m512 r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0.625f), _CMP_LT_OQ), big, small);
    return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}

/* cap * tanh(y), attention logit softcapping (y the score over cap): no division, absolute error
 * about cap * 3e-7. The softmax that follows needs the scores' absolute accuracy, not tanh's relative
 * one near 0, so (1 - e) / (1 + e) with e = exp(-2|y|) serves for every y, its reciprocal from
 * rcp14 and one Newton step. tanh_ps (two divisions and a polynomial) took as long as the rest of
 * the prefill attention kernel together. */
RTP_VEC_TARGET static inline __m512 softcap_ps(__m512 y, __m512 cap) {
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 e = exp_ps(_mm512_mul_ps(_mm512_abs_ps(y), _mm512_set1_ps(-2.0f)));
    __m512 d = _mm512_add_ps(one, e), r = _mm512_rcp14_ps(d);
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
    __m512 t = _mm512_mul_ps(_mm512_sub_ps(one, e), r);
    return _mm512_mul_ps(cap, _mm512_or_ps(t, _mm512_and_ps(y, _mm512_set1_ps(-0.0f))));
}

/* gelu(g) * u, tanh-approximated: torch's gelu(approximate="tanh"), 0.5 g (1 + tanh(y)) with
 * y = sqrt(2 / pi) (g + 0.044715 g^3), as g sigmoid(2 y), the same function: where tanh(y) nears -1
 * (a gate below about -4) 1 + tanh(y) keeps only the few digits fp32 has left below 1, while the
 * sigmoid, from e = exp(-|2 y|) <= 1 as silu_mul_ps's, keeps them all. */
RTP_VEC_TARGET static inline __m512 gelu_tanh_mul_ps(__m512 g, __m512 u) {
    __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    __m512 y2 = _mm512_mul_ps(_mm512_set1_ps(2.0f * 0.7978845608028654f),
                              _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(0.044715f), cube)));
    __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(y2)));
    __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(y2, _mm512_setzero_ps(), _CMP_GE_OQ), e,
                                      _mm512_set1_ps(1.0f));
    __m512 sig = _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    return _mm512_mul_ps(_mm512_mul_ps(g, sig), u);
}

#endif
