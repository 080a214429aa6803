/* Linear over Q4_K's own super-blocks, for one request's rows. */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "small_batch.h"

/* ---------------------------------------------------------------------------------------------
 * Linear over Q4_K's own super-blocks (256 weights: eight blocks of 32, w = (d sc) q - (dmin mn)),
 * for one request's rows: the bytes of a Q4_K file's weights, 0.59 a weight where the q4_1
 * repack reads 0.75 (a one-row step is bound by them). Layout (rtp/kernels/quant.py, q4_k):
 *   qs  uint8 [N, K/2]: per super-block 128 bytes, block pair p in bytes 32p .. 32p + 31 (low
 *       nibble: block 2p's weight i, high: block 2p + 1's), GGUF's order;
 *   scm uint8 [N, K/256, 16]: the eight 6-bit scales, then the eight mins, unpacked;
 *   dd  fp32 [N, K/256, 2]: d and dmin.
 * The weights are the file's exactly (d sc and dmin mn are exact in fp32); per row and block a
 * dot of x against 128 + q (as rtp_linear_q4_1), scaled by d sc, and the blocks' sums of x
 * against -(dmin mn) - 128 d sc, eight blocks at once.
 * ------------------------------------------------------------------------------------------- */
#define QKK 256

TARGET static inline __attribute__((always_inline)) void q4_k_tile(
        const uint16_t *x, int64_t ldx, const float *xsum, const uint8_t *qs, const uint8_t *scm, const float *dd,
        int64_t K, const float *bias, void *out, int64_t ldo, int out_bf16, int64_t m0, const int mr, int64_t n0,
        int64_t nr, const int NR_) {
    int64_t ns = K / QKK, nb = K / QK;
    __m512 acc[MR_MAX][NR];
    __m256 off[MR_MAX][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR_; j++) {
            acc[i][j] = _mm512_setzero_ps();
            off[i][j] = _mm256_setzero_ps();
        }
    int64_t rows[NR];
    for (int j = 0; j < NR_; j++) rows[j] = n0 + (j < nr ? j : 0);
    int64_t ahead = n0 + PREFETCH_TILES * NR_;
    const __m512i lo_mask = _mm512_set1_epi16(0x000f), bf128 = _mm512_set1_epi16(0x4300);
    for (int64_t sb = 0; sb < ns; sb++) {
        prefetch_part(qs + ahead * (K / 2), NR_ * (K / 2), sb, ns);
        for (int j = 0; j < NR_; j++) {
            const float *dr = dd + (rows[j] * ns + sb) * 2;
            /* d sc for the eight blocks, then dmin mn */
            __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                         _mm_loadu_si128((const __m128i *)(scm + (rows[j] * ns + sb) * 16)))),
                                     _mm512_mask_blend_ps((__mmask16)0xff00, _mm512_set1_ps(dr[0]), _mm512_set1_ps(dr[1])));
            float scale[16] __attribute__((aligned(64)));
            _mm512_store_ps(scale, v);
            __m256 dsc = _mm512_castps512_ps256(v), dmm = _mm512_extractf32x8_ps(v, 1);
            /* per block: -(dmin mn) - 128 d sc, against the block's sum of x */
            __m256 o = _mm256_fnmadd_ps(_mm256_set1_ps(128.0f), dsc, _mm256_sub_ps(_mm256_setzero_ps(), dmm));
            for (int i = 0; i < mr; i++)
                off[i][j] = _mm256_fmadd_ps(o, _mm256_loadu_ps(xsum + (m0 + i) * nb + sb * 8), off[i][j]);
            const uint8_t *q = qs + rows[j] * (K / 2) + sb * 128;
            for (int p = 0; p < 4; p++) {
                __m512i v16 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * p)));
                __m512bh w0 = (__m512bh)_mm512_ternarylogic_epi32(v16, lo_mask, bf128, 0xEA);
                __m512bh w1 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v16, 4), lo_mask, bf128, 0xEA);
                __m512 s0 = _mm512_set1_ps(scale[2 * p]), s1 = _mm512_set1_ps(scale[2 * p + 1]);
                const int64_t b0 = sb * 8 + 2 * p;
                for (int i = 0; i < mr; i++) {
                    const uint16_t *xr = x + (m0 + i) * ldx + b0 * QK;
                    __m512bh x0 = (__m512bh)_mm512_loadu_si512(xr), x1 = (__m512bh)_mm512_loadu_si512(xr + QK);
                    acc[i][j] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), x0, w0), s0, acc[i][j]);
                    acc[i][j] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), x1, w1), s1, acc[i][j]);
                }
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float t[8], y = _mm512_reduce_add_ps(acc[i][j]);
            _mm256_storeu_ps(t, off[i][j]);
            for (int e = 0; e < 8; e++) y += t[e];
            store_out(out, (m0 + i) * ldo + n0 + j, out_bf16, y + (bias ? bias[n0 + j] : 0.0f));
        }
}

/* out [M, N] = x [M, K] bf16 @ W^T for W in Q4_K's super-blocks (above); K a multiple of 256. Returns 0,
 * computing nothing, when the sums of a large batch could not be allocated. */
TARGET int rtp_linear_q4_k(const uint16_t *x, int64_t ldx, const uint8_t *qs, const uint8_t *scm, const float *dd,
                           const float *bias, void *out, int64_t ldo, int out_bf16, int64_t M, int64_t N, int64_t K) {
    int64_t nb = K / QK;
    float stack[16384];
    float *xsum = M * nb <= 16384 ? stack : (float *)malloc((size_t)(M * nb) * sizeof(float));
    if (!xsum) return 0;
    group_sums(x, ldx, M, K, QK, xsum);
#define Q4_K_TILE(m0, mr, n0, nr, NR_) q4_k_tile(x, ldx, xsum, qs, scm, dd, K, bias, out, ldo, out_bf16, m0, mr, n0, nr, NR_)
    FOR_EACH_TILE(M, N, Q4_K_TILE);
#undef Q4_K_TILE
    if (xsum != stack) free(xsum);
    return 1;
}
#endif
