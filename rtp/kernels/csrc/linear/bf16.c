/* Linear over dense bf16 weights, for one request's rows. */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "small_batch.h"

/* ---------------------------------------------------------------------------------------------
 * Linear over dense bf16 weights [N, K] (row stride ldw), for one request's rows: a bf16
 * checkpoint's (or a GGUF's F16/BF16/F32 tensor's) weights as the model holds them, one dot
 * instruction per 32 weights and row, sums in fp32. x bf16, or fp32 (x_fp32: rounded to bf16 as it
 * is read, as the AMX kernel does). Without it such a layer went to oneDNN, which a CPU graph
 * cannot replay, so every step of a bf16 model ran eagerly.
 * ------------------------------------------------------------------------------------------- */
TARGET static inline __attribute__((always_inline)) void bf16_tile(
        const void *x, int x_fp32, int64_t ldx, const uint16_t *w, int64_t ldw, int64_t K, const float *bias,
        void *out, int64_t ldo, int out_bf16, int64_t m0, const int mr, int64_t n0, int64_t nr, const int NR_) {
    int64_t nb = K / QK;
    __m512 acc[MR_MAX][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR_; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t rows[NR];
    for (int j = 0; j < NR_; j++) rows[j] = n0 + (j < nr ? j : 0);
    int64_t ahead = n0 + PREFETCH_TILES * NR_;
    for (int64_t b = 0; b < nb; b++) {
        for (int j = 0; j < NR_; j++) rtp_prefetch_l1(w + (ahead + j) * ldw + b * QK);
        __m512bh xv[MR_MAX];
        for (int i = 0; i < mr; i++) {
            if (x_fp32) {
                const float *xr = (const float *)x + (m0 + i) * ldx + b * QK;
                xv[i] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + 16), _mm512_loadu_ps(xr));
            } else {
                xv[i] = (__m512bh)_mm512_loadu_si512((const uint16_t *)x + (m0 + i) * ldx + b * QK);
            }
        }
        for (int j = 0; j < NR_; j++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(w + rows[j] * ldw + b * QK);
            for (int i = 0; i < mr; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++)
            store_out(out, (m0 + i) * ldo + n0 + j, out_bf16,
                      _mm512_reduce_add_ps(acc[i][j]) + (bias ? bias[n0 + j] : 0.0f));
}

/* out [M, N] = x [M, K] @ W^T (+ bias), W bf16 [N, K] (row stride ldw); K a multiple of 32. */
TARGET void rtp_linear_bf16(const void *x, int64_t ldx, int x_fp32, const uint16_t *w, int64_t ldw,
                            const float *bias, void *out, int64_t ldo, int out_bf16, int64_t M, int64_t N, int64_t K) {
#define BF16_TILE(m0, mr, n0, nr, NR_) bf16_tile(x, x_fp32, ldx, w, ldw, K, bias, out, ldo, out_bf16, m0, mr, n0, nr, NR_)
    FOR_EACH_TILE(M, N, BF16_TILE);
#undef BF16_TILE
}
#endif
