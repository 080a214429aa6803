/* Sampling-side kernels over fp32 logits: greedy argmax and a grammar's token bitmask. Called
 * directly (not kernel calls: they run outside a step's CPU graph, in the sampler), so they are not
 * in the op table and dispatch on the selected ISA path themselves: the avx512bf16 bodies are here,
 * the avx2 ones in avx2/sampling.c. */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "cpu_kernels.h"

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

/* ---------------------------------------------------------------------------------------------
 * Greedy sampling: out[t] = the index of row t's maximum, the first one on ties, or of its first
 * NaN if it has one (NumPy's argmax, which the sampler used before). x fp32 [T, N], row stride
 * ldx; N < 2^31. Each lane keeps the best value and index of its column stripe (strict >, so the
 * earliest wins), then the lanes with the row's maximum give the smallest index. Rows run in
 * parallel: a batch-64 step's logits are 12.6 MB, which one thread read at about 10 GB/s.
 * ------------------------------------------------------------------------------------------- */
TARGET static void argmax_rows_avx512(const float *x, int64_t ldx, int64_t T, int64_t N, int64_t *out) {
#pragma omp parallel for schedule(static) if (T >= 4)
    for (int64_t t = 0; t < T; t++) {
        const float *r = x + t * ldx;
        const __m512i step = _mm512_set1_epi32(16);
        __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i best_idx = idx;
        __m512 best = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        for (int64_t c = 0; c < N; c += 16) {
            __mmask16 k = N - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - c)) - 1);
            __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, r + c);
            __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
            best = _mm512_mask_mov_ps(best, gt, v);
            best_idx = _mm512_mask_mov_epi32(best_idx, gt, idx);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            idx = _mm512_add_epi32(idx, step);
        }
        if (nan) {
            int64_t i = 0;
            while (r[i] == r[i]) i++;
            out[t] = i;
            continue;
        }
        __mmask16 top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(_mm512_reduce_max_ps(best)), _CMP_EQ_OQ);
        out[t] = _mm512_mask_reduce_min_epi32(top, best_idx);
    }
}

/* Structured outputs: logits x fp32 [rows of ldx] get -inf wherever the row's token bitmask
 * (int32 words, bit j of word w = token 32w + j allowed; llguidance's and xgrammar's layout)
 * has a 0. Only the R rows listed in `rows` are touched; mask row i belongs to x row rows[i].
 * A word of all ones (every token allowed) is skipped, so the cost follows what the grammar
 * forbids, and each 16-token half of a word is one masked store. */
TARGET static void apply_token_bitmask_avx512(float *x, int64_t ldx, const int32_t *mask, int64_t ldm,
                                    const int64_t *rows, int64_t R, int64_t N) {
    const int64_t words = (N + 31) / 32;
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
#pragma omp parallel for schedule(static) if (R >= 4)
    for (int64_t i = 0; i < R; i++) {
        float *r = x + rows[i] * ldx;
        const int32_t *m = mask + i * ldm;
        for (int64_t w = 0; w < words; w++) {
            uint32_t bits = (uint32_t)m[w];
            if (bits == 0xffffffffu) continue;
            int64_t base = w * 32;
            int64_t left = N - base;
            for (int half = 0; half < 2 && left > half * 16; half++) {
                __mmask16 forbid = (__mmask16)(~(bits >> (16 * half)) & 0xffffu);
                int64_t n = left - half * 16;
                if (n < 16) forbid &= (__mmask16)((1u << n) - 1);  /* never past the vocabulary */
                _mm512_mask_storeu_ps(r + base + 16 * half, forbid, ninf);
            }
        }
    }
}

/* The exported entry points: callers (rtp/kernels/cpu_kernels.py) call them only where some path is selected. */
void rtp_argmax_rows(const float *x, int64_t ldx, int64_t T, int64_t N, int64_t *out) {
    if (rtp_isa >= RTP_ISA_AVX512BF16) argmax_rows_avx512(x, ldx, T, N, out);
    else rtp_argmax_rows_avx2(x, ldx, T, N, out);
}

void rtp_apply_token_bitmask(float *x, int64_t ldx, const int32_t *mask, int64_t ldm, const int64_t *rows,
                             int64_t R, int64_t N) {
    if (rtp_isa >= RTP_ISA_AVX512BF16) apply_token_bitmask_avx512(x, ldx, mask, ldm, rows, R, N);
    else rtp_apply_token_bitmask_avx2(x, ldx, mask, ldm, rows, R, N);
}
#endif
