/* Linear over small int8 weights (q8_1, q8_16, and Q8_0 rows in bf16), for one request's rows. */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "small_batch.h"

/* ---------------------------------------------------------------------------------------------
 * Linear over small int8 weights, for one request's rows: q8_1 (w = d q + m, q in 0..31: Q5_1 and
 * Q5_K repacked) and q8_16 (w = d_g q, q in -32..31, a scale per 16 weights: Q6_K repacked).
 * Where rtp_linear_q8 widens each weight to fp32 and multiplies it (compute-bound: as slow as
 * bf16 weights at one row), here u = q + 128 + offset lies in [128, 256) for both kinds, so it is
 * a bf16 exactly and its bits are q + offset + 0x4300: a sign extension and an add build 32 weights, one
 * dot instruction multiplies them with bf16 x, and the offsets come back out through the
 * groups' sums of x (as rtp_linear_q4_1 does with 128 + q):
 *   sum_k x w = sum_g d_g (x . u)_g + sum_g (m_g - (128 + offset) d_g) sum_g x
 * qs int8 [N, K]; d fp32 [N, K / group] (group 32 or 16); m fp32 [N, K / 32] or NULL; offset 0 (q8_1)
 * or 32 (q8_16). x bf16 (a fp32 row is rounded to bf16 as it is read).
 * Q8_0's q spans all of int8, more than bf16's 7 mantissa bits hold, so with offset U8_SPLIT it is
 * split q = 16 h + l (h = q >> 4 in -8..7, l = q & 15): bf16(128 + l) has bits l + 0x4300 and
 * bf16(2048 + 16 (h + 8)) has bits h + 8 + 0x4500 (the step of [2048, 4096) is 16), so two dot
 * instructions into one sum multiply x by q + 2304 exactly (offset 2176: 128 + offset = 2304 comes
 * back out as above). Four instructions build 32 weights where widening them to fp32 took six, only
 * one of them on the shuffle port: one row of the 0.50 B Q8_0 shape (tools/bench_quant.py) 38.6 -> 29.5 ms.
 * ------------------------------------------------------------------------------------------- */
#define U8_SPLIT 2176
TARGET static inline __attribute__((always_inline)) void u8_tile(
        const uint16_t *x, int64_t ldx, const float *xsum, const int8_t *qs, const float *d, const float *mn,
        int group, int offset, int64_t K, const float *bias, void *out, int64_t ldo, int out_bf16, int64_t m0,
        const int mr, int64_t n0, int64_t nr, const int NR_, const int split) {
    int64_t nb = K / QK, ng = K / group, per = QK / group;
    __m512 acc[MR_MAX][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR_; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t rows[NR];
    for (int j = 0; j < NR_; j++) rows[j] = n0 + (j < nr ? j : 0);
    int64_t ahead = n0 + PREFETCH_TILES * NR_;
    const __m512i bias_bits = _mm512_set1_epi16((short)(0x4300 + offset)); /* bf16(128 + t) = 0x4300 + t */
    for (int64_t b = 0; b < nb; b++) {
        prefetch_part(qs + ahead * K, NR_ * K, b, nb);
        prefetch_part(d + ahead * ng, NR_ * ng * 4, b, nb);
        __m512bh xv[MR_MAX];
        for (int i = 0; i < mr; i++) xv[i] = (__m512bh)_mm512_loadu_si512(x + (m0 + i) * ldx + b * QK);
        for (int j = 0; j < NR_; j++) {
            __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(qs + rows[j] * K + b * QK)));
            const float *dr = d + rows[j] * ng + b * per;
            if (split) {
                __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(v, _mm512_set1_epi16(0x000f),
                                                                  _mm512_set1_epi16(0x4300), 0xEA);
                __m512bh hi = (__m512bh)_mm512_add_epi16(_mm512_srai_epi16(v, 4), _mm512_set1_epi16(0x4508));
                __m512 scale = _mm512_set1_ps(dr[0]);
                for (int i = 0; i < mr; i++)
                    acc[i][j] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xv[i], lo),
                                                                 xv[i], hi), scale, acc[i][j]);
                continue;
            }
            __m512bh wv = (__m512bh)_mm512_add_epi16(v, bias_bits);
            /* lanes 0-7 sum weights 0-15, lanes 8-15 weights 16-31: a scale per 16 is a two-valued vector */
            __m512 scale = per == 1 ? _mm512_set1_ps(dr[0])
                                    : _mm512_mask_blend_ps((__mmask16)0xff00, _mm512_set1_ps(dr[0]), _mm512_set1_ps(dr[1]));
            for (int i = 0; i < mr; i++)
                acc[i][j] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xv[i], wv), scale, acc[i][j]);
        }
    }
    for (int j = 0; j < nr; j++) {
        const float *dr = d + (n0 + j) * ng, *mr_ = mn ? mn + (n0 + j) * nb : NULL;
        for (int i = 0; i < mr; i++) {
            const float *xs = xsum + (m0 + i) * ng;
            __m512 v = acc[i][j];
            for (int64_t g = 0; g < ng; g += 16) {
                __mmask16 k = ng - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (ng - g)) - 1);
                __m512 off = _mm512_mul_ps(_mm512_set1_ps(-(128.0f + (float)offset)), _mm512_maskz_loadu_ps(k, dr + g));
                if (mr_) off = _mm512_add_ps(off, _mm512_maskz_loadu_ps(k, mr_ + g)); /* group 32: m per group */
                v = _mm512_fmadd_ps(off, _mm512_maskz_loadu_ps(k, xs + g), v);
            }
            float y = _mm512_reduce_add_ps(v) + (bias ? bias[n0 + j] : 0.0f);
            store_out(out, (m0 + i) * ldo + n0 + j, out_bf16, y);
        }
    }
}

/* Returns 0, computing nothing, when the sums of a large batch could not be allocated. */
TARGET int rtp_linear_u8(const void *x, int64_t ldx, int x_fp32, const int8_t *qs, const float *d, const float *mn,
                         int group, int offset, const float *bias, void *out, int64_t ldo, int out_bf16, int64_t M,
                         int64_t N, int64_t K) {
    int64_t ng = K / group;
    const int split = offset == U8_SPLIT;
    float stack[16384];
    uint16_t xstack[8192];
    float *xsum = M * ng <= 16384 ? stack : (float *)malloc((size_t)(M * ng) * sizeof(float));
    uint16_t *xb = NULL;
    int64_t ldb = ldx;
    if (x_fp32) { /* rounded to bf16 once, as the weights' dot takes it */
        xb = M * K <= 8192 ? xstack : (uint16_t *)malloc((size_t)(M * K) * 2);
        ldb = K;
    }
    if (!xsum || (x_fp32 && !xb)) {
        if (xsum != stack) free(xsum);
        if (xb != xstack) free(xb);
        return 0;
    }
    const uint16_t *xr = x_fp32 ? xb : (const uint16_t *)x;
    if (x_fp32)
        for (int64_t i = 0; i < M; i++)
            for (int64_t k = 0; k < K; k += 16)
                _mm256_storeu_si256((__m256i *)(xb + i * K + k),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps((const float *)x + i * ldx + k)));
    group_sums(xr, ldb, M, K, group, xsum); /* the sums of the bf16 rows the dot reads */
#define U8_TILE(m0, mr, n0, nr, NR_) \
    u8_tile(xr, ldb, xsum, qs, d, mn, group, offset, K, bias, out, ldo, out_bf16, m0, mr, n0, nr, NR_, split)
    FOR_EACH_TILE(M, N, U8_TILE);
#undef U8_TILE
    if (xsum != stack) free(xsum);
    if (xb && xb != xstack) free(xb);
    return 1;
}
#endif
