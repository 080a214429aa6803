/* Vector math rtp's kernels share (AVX-512, fp32): the exponential of softmax arguments and
 * SiLU-and-mul. One definition, so that the fused MLP epilogue of the AMX linear
 * (amx_linear.c) and the separate SiLU-and-mul kernel (cpu_kernels.c) agree bit for bit. */
#ifndef RTP_VEC_MATH_H
#define RTP_VEC_MATH_H

#include <immintrin.h>

#define RTP_VEC_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

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

/* silu(g) * u. The sigmoid comes from e = exp(-|g|) <= 1, which neither overflows nor loses
 * the tail. */
RTP_VEC_TARGET static inline __m512 silu_mul_ps(__m512 g, __m512 u) {
    __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ), e,
                                      _mm512_set1_ps(1.0f));
    __m512 sig = _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    return _mm512_mul_ps(_mm512_mul_ps(g, sig), u);
}

#endif
