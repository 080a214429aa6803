/* x's rows as integer blocks (int8_blocks.h) with AVX2: what the avx2 path's linears (linear_int8.c) and the
 * avx512 path's (avx512/linear_lanes.c) multiply. */
#ifndef RTP_INT8_ROWS_H
#define RTP_INT8_ROWS_H

#include "avx2/avx2.h"
#include "int8_blocks.h"

/* 8 int32 lanes of 4 vectors as 32 int8 in order. */
AVX2_TARGET static inline __m256i pack_bytes(const __m256i v[4]) {
    /* packs work within 128-bit lanes: (0 1 | 2 3) -> the 8-value groups in the order 0 2 1 3 */
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Row x (fp32 or bf16, K values) as integer blocks: q = 128 h + l, d the scale and s = d * sum(q) per 32 values,
 * and where qsum16 is not NULL the integer sum of q per 16 values (two a block). */
AVX2_TARGET static inline void quantize_row(const void *x, int x_fp32, int64_t K, int8_t *h, int8_t *l, float *d, float *s,
                                            int32_t *qsum16) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i half = _mm256_set1_epi32(64);
    for (int64_t b = 0; b < K / 32; b++) {
        __m256 v[4];
        for (int t = 0; t < 4; t++)
            v[t] = x_fp32 ? _mm256_loadu_ps((const float *)x + 32 * b + 8 * t)
                          : avx2_load_bf16x8((const uint16_t *)x + 32 * b + 8 * t);
        __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        float top = avx2_hmax(amax);
        __m256 inv = _mm256_set1_ps(top > 0.0f ? X_STEPS / top : 0.0f);
        __m256i hi[4], lo[4], sum = _mm256_setzero_si256();
        for (int t = 0; t < 4; t++) {
            __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], inv)); /* nearest even, |q| <= 16256 */
            hi[t] = _mm256_srai_epi32(_mm256_add_epi32(q, half), 7);   /* round(q / 128), ties up */
            lo[t] = _mm256_sub_epi32(q, _mm256_slli_epi32(hi[t], 7)); /* in [-64, 63] */
            sum = _mm256_add_epi32(sum, q);
        }
        _mm256_storeu_si256((__m256i *)(h + 32 * b), pack_bytes(hi));
        _mm256_storeu_si256((__m256i *)(l + 32 * b), pack_bytes(lo));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        d[b] = top / X_STEPS;
        s[b] = d[b] * (float)_mm_cvtsi128_si32(s4); /* the block's sum of q: exact in int32 */
        if (qsum16) { /* per 16: the lanes of the first two vectors, then of the last two (pack_bytes' order) */
            int32_t half[2] = {0, 0};
            int32_t lanes[8];
            for (int t = 0; t < 4; t++) {
                _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi32(_mm256_slli_epi32(hi[t], 7), lo[t]));
                for (int e = 0; e < 8; e++) half[t / 2] += lanes[e];
            }
            qsum16[2 * b] = half[0];
            qsum16[2 * b + 1] = half[1];
        }
    }
}

#endif
