/* Linear over int8 blocks with fp32 activations (Q8_0, Q8_1, Q8 a scale per 16): the exact fp32
 * weights, for one request's rows (the LM head's fp32 input). */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "small_batch.h"

TARGET static inline __attribute__((always_inline)) void q8_tile(
        const float *x, int64_t ldx, const int8_t *qs, const float *d, const float *mn, int group, int64_t K,
        const float *bias, void *out, int64_t ldo, int out_bf16, int64_t m0, const int mr, int64_t n0, int64_t nr,
        const int NR_) {
    int64_t nb = K / QK, ng = K / group, per = QK / group; /* scales a row, and a block */
    __m512 acc[MR_MAX][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR_; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t rows[NR];
    for (int j = 0; j < NR_; j++) rows[j] = n0 + (j < nr ? j : 0);
    int64_t ahead = n0 + PREFETCH_TILES * NR_;
    for (int64_t b = 0; b < nb; b++) {
        prefetch_part(qs + ahead * K, NR_ * K, b, nb);
        prefetch_part(d + ahead * ng, NR_ * ng * 4, b, nb);
        if (mn) prefetch_part(mn + ahead * nb, NR_ * nb * 4, b, nb);
        for (int j = 0; j < NR_; j++) {
            const int8_t *q = qs + rows[j] * K + b * QK;
            const float *dr = d + rows[j] * ng + b * per;
            /* the exact fp32 weights: q * d (+ m), each product and sum rounded once */
            __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))),
                                      _mm512_set1_ps(dr[0]));
            __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))),
                                      _mm512_set1_ps(dr[per - 1]));
            if (mn) {
                __m512 m = _mm512_set1_ps(mn[rows[j] * nb + b]);
                w0 = _mm512_add_ps(w0, m);
                w1 = _mm512_add_ps(w1, m);
            }
            for (int i = 0; i < mr; i++) {
                const float *xr = x + (m0 + i) * ldx + b * QK;
                acc[i][j] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), w0, acc[i][j]);
                acc[i][j] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), w1, acc[i][j]);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float v = _mm512_reduce_add_ps(acc[i][j]) + (bias ? bias[n0 + j] : 0.0f);
            store_out(out, (m0 + i) * ldo + n0 + j, out_bf16, v);
        }
}

/* int8 blocks of 32: Q8_0 (one d a block, mn NULL: w = d q), Q8_1 (w = d q + m: Q5_1 and Q5_K repacked)
 * and Q8 with a scale for each 16 weights (group 16: Q6_K repacked); d fp32 [N, K / group], mn fp32
 * [N, K / 32] or NULL. x fp32. */
TARGET void rtp_linear_q8(const float *x, int64_t ldx, const int8_t *qs, const float *d, const float *mn,
                          int group, const float *bias, void *out, int64_t ldo, int out_bf16,
                          int64_t M, int64_t N, int64_t K) {
#define Q8_TILE(m0, mr, n0, nr, NR_) q8_tile(x, ldx, qs, d, mn, group, K, bias, out, ldo, out_bf16, m0, mr, n0, nr, NR_)
    FOR_EACH_TILE(M, N, Q8_TILE);
#undef Q8_TILE
}
#endif
