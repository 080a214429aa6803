/* Linear over Q4_1 blocks (q4_1: Q4_1, Q4_0 and Q4_K repacked), for one request's rows. */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "small_batch.h"

/* Q4_1's one-row loop takes four blocks of a weight row at once: their 64 quant bytes in one load, the
 * low and the high nibbles masked out (3 ops), and each nibble widened into the bf16 of 128 + q by
 * interleaving it with the byte 0x43 (bf16(128)'s high byte: with 128's exponent, bf16's 7 mantissa bits
 * hold q exactly), 4 unpacks for the 128 weights. An unpack works within 128-bit lanes, so lane L of
 * each product vector holds block L's weights: (unpacklo, unpackhi) of the low nibbles weights 0-7 and
 * 8-15, of the high nibbles 16-23 and 24-31. x is permuted once per call into the same order (x4_blocks),
 * so the four dot products chain into one vector whose fp32 lane 4 L + j sums block L's pairs j, j + 4,
 * j + 8 and j + 12 (exact products, summed in order), and one multiply-add by the four blocks' scales
 * (lanes 4 L to 4 L + 3: d of block L) takes them into the running sums.
 * Per block: 1.75 vector ops to build the weights, 1 dot product and a quarter of a multiply-add, where
 * widening each block alone (zero-extend, shift, mask) and scaling each block's dot product took 5.
 * AMD Zen 4, one thread, a 3,072 x 576 matrix in L2 (a /tmp harness, minimum of 200): 1.44 -> 1.11 ns a
 * block; 3,072 x 1,536: 1.40 -> 0.94; from memory (30 matrices): 1.68 -> 1.13. The loop was bound by its
 * vector ops, not by memory: the same time from L2 as from DRAM. */
#define Q4_GROUP 4 /* blocks a step */

/* Row x (K bf16) in x4_blocks order: xp[128 g + 32 k + 8 L + w] = x[32 (4 g + L) + 8 k + w] for the
 * groups g of four blocks, zeros past the last block (so a group of fewer blocks adds nothing). */
TARGET static void x4_blocks(const uint16_t *x, int64_t K, uint16_t *xp) {
    int64_t nb = K / QK, ng = (nb + Q4_GROUP - 1) / Q4_GROUP;
    for (int64_t g = 0; g < ng; g++)
        for (int64_t L = 0; L < Q4_GROUP; L++)
            for (int64_t k = 0; k < 4; k++) {
                uint16_t *dst = xp + g * 128 + k * 32 + L * 8;
                if (g * Q4_GROUP + L < nb) memcpy(dst, x + (g * Q4_GROUP + L) * QK + k * 8, 16);
                else memset(dst, 0, 16);
            }
}

TARGET static inline __attribute__((always_inline)) void q4_1_tile(
        const uint16_t *xp, int64_t ldxp, const float *xsum, const uint8_t *qs, const float *d,
        const float *mn, int64_t K, const float *bias, void *out, int64_t ldo, int out_bf16,
        int64_t m0, const int mr, int64_t n0, int64_t nr, const int NR_) {
    int64_t nb = K / QK, ng = (nb + Q4_GROUP - 1) / Q4_GROUP;
    __m512 acc[MR_MAX][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR_; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t rows[NR];
    for (int j = 0; j < NR_; j++) rows[j] = n0 + (j < nr ? j : 0);
    const __m512i nibble = _mm512_set1_epi8(0x0f), bf16_128 = _mm512_set1_epi8(0x43);
    const __m512i scale_lanes = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    /* a later tile's bytes, spread over this tile's steps: the hardware prefetcher alone
     * leaves the loop waiting on memory (it ran at half its in-cache speed without) */
    int64_t ahead = n0 + PREFETCH_TILES * NR_;
    for (int64_t g = 0; g < ng; g++) {
        prefetch_part(qs + ahead * (K / 2), NR_ * (K / 2), g, ng);
        prefetch_part(d + ahead * nb, NR_ * nb * 4, g, ng);
        prefetch_part(mn + ahead * nb, NR_ * nb * 4, g, ng);
        int64_t blocks = nb - g * Q4_GROUP < Q4_GROUP ? nb - g * Q4_GROUP : Q4_GROUP;
        __mmask64 qmask = blocks == Q4_GROUP ? ~(__mmask64)0 : ((__mmask64)1 << (16 * blocks)) - 1;
        __mmask8 dmask = (__mmask8)((1u << blocks) - 1);
        for (int j = 0; j < NR_; j++) {
            __m512i v = _mm512_maskz_loadu_epi8(qmask, qs + rows[j] * (K / 2) + g * (Q4_GROUP * QK / 2));
            __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
            __m512bh w0 = (__m512bh)_mm512_unpacklo_epi8(lo, bf16_128), w1 = (__m512bh)_mm512_unpackhi_epi8(lo, bf16_128);
            __m512bh w2 = (__m512bh)_mm512_unpacklo_epi8(hi, bf16_128), w3 = (__m512bh)_mm512_unpackhi_epi8(hi, bf16_128);
            __m512 scale = _mm512_permutexvar_ps(
                scale_lanes, _mm512_castps128_ps512(_mm_maskz_loadu_ps(dmask, d + rows[j] * nb + g * Q4_GROUP)));
            for (int i = 0; i < mr; i++) {
                const uint16_t *xg = xp + (m0 + i) * ldxp + g * 128;
                __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), w0, (__m512bh)_mm512_loadu_si512(xg));
                dot = _mm512_dpbf16_ps(dot, w1, (__m512bh)_mm512_loadu_si512(xg + 32));
                dot = _mm512_dpbf16_ps(dot, w2, (__m512bh)_mm512_loadu_si512(xg + 64));
                dot = _mm512_dpbf16_ps(dot, w3, (__m512bh)_mm512_loadu_si512(xg + 96));
                acc[i][j] = _mm512_fmadd_ps(dot, scale, acc[i][j]);
            }
        }
    }
    /* sum_b d_b * sum(x (128 + q)) + sum_b (m_b - 128 d_b) * sum(x)_b = sum(x (d q + m)) */
    for (int j = 0; j < nr; j++) {
        const float *dr = d + (n0 + j) * nb, *mr_ = mn + (n0 + j) * nb;
        for (int i = 0; i < mr; i++) {
            const float *xs = xsum + (m0 + i) * nb;
            __m512 v = acc[i][j];
            for (int64_t b = 0; b < nb; b += 16) {
                __mmask16 k = nb - b >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (nb - b)) - 1);
                __m512 off = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), _mm512_maskz_loadu_ps(k, dr + b),
                                              _mm512_maskz_loadu_ps(k, mr_ + b));
                v = _mm512_fmadd_ps(off, _mm512_maskz_loadu_ps(k, xs + b), v);
            }
            float y = _mm512_reduce_add_ps(v) + (bias ? bias[n0 + j] : 0.0f);
            store_out(out, (m0 + i) * ldo + n0 + j, out_bf16, y);
        }
    }
}

/* Returns 0, computing nothing, when the sums of a large batch could not be allocated. */
TARGET int rtp_linear_q4_1(const uint16_t *x, int64_t ldx, const uint8_t *qs, const float *d,
                           const float *mn, const float *bias, void *out, int64_t ldo,
                           int out_bf16, int64_t M, int64_t N, int64_t K) {
    int64_t nb = K / QK, ldxp = (nb + Q4_GROUP - 1) / Q4_GROUP * 128;
    /* per-block sums of each activation row, and the rows in x4_blocks order: on the stack up to
     * 64 and 32 KiB */
    float stack[16384];
    uint16_t stack_xp[16384] __attribute__((aligned(64)));
    float *xsum = M * nb <= 16384 ? stack : (float *)malloc((size_t)(M * nb) * sizeof(float));
    uint16_t *xp = M * ldxp <= 16384 ? stack_xp : (uint16_t *)malloc((size_t)(M * ldxp) * sizeof(uint16_t));
    if (!xsum || !xp) {
        if (xsum != stack) free(xsum);
        if (xp != stack_xp) free(xp);
        return 0;
    }
    group_sums(x, ldx, M, K, QK, xsum);
    for (int64_t i = 0; i < M; i++) x4_blocks(x + i * ldx, K, xp + i * ldxp);
#define Q4_1_TILE(m0, mr, n0, nr, NR_) q4_1_tile(xp, ldxp, xsum, qs, d, mn, K, bias, out, ldo, out_bf16, m0, mr, n0, nr, NR_)
    FOR_EACH_TILE(M, N, Q4_1_TILE);
#undef Q4_1_TILE
    if (xsum != stack) free(xsum);
    if (xp != stack_xp) free(xp);
    return 1;
}
#endif
