/* The sampler's kernels on the avx2 path (their contracts: csrc/sampling.c, whose exported functions
 * dispatch here): greedy argmax and a grammar's token bitmask over fp32 logits. */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include <math.h>
#include <omp.h>

#include "avx2.h"
#include "avx2_rows.h"
#include "cpu_kernels.h"

/* out[t] = the index of row t's maximum, the first on ties, or of its first NaN (NumPy's argmax).
 * Each lane keeps the best value and index of its column stripe (strict >, so a stripe's earliest
 * wins), then among the lanes holding the row's maximum the smallest index is the first. */
AVX2_TARGET void rtp_argmax_rows_avx2(const float *x, int64_t ldx, int64_t T, int64_t N, int64_t *out) {
#pragma omp parallel for schedule(static) if (T >= 4)
    for (int64_t t = 0; t < T; t++) {
        const float *r = x + t * ldx;
        const __m256 ninf = _mm256_set1_ps(-INFINITY);
        __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), best_idx = idx;
        __m256 best = ninf, nan = _mm256_setzero_ps();
        for (int64_t c = 0; c < N; c += 8) {
            __m256 v = N - c >= 8 ? _mm256_loadu_ps(r + c)
                                  : _mm256_blendv_ps(ninf, avx2_load8(r, 0, c, N - c),
                                                     _mm256_castsi256_ps(avx2_lanes(N - c)));
            __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
            best = _mm256_blendv_ps(best, v, gt);
            best_idx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_idx), _mm256_castsi256_ps(idx), gt));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            idx = _mm256_add_epi32(idx, _mm256_set1_epi32(8));
        }
        if (_mm256_movemask_ps(nan)) {
            int64_t i = 0;
            while (r[i] == r[i]) i++;
            out[t] = i;
            continue;
        }
        float top = best[0];
        for (int l = 1; l < 8; l++) top = best[l] > top ? best[l] : top;
        int32_t lane_idx[8];
        _mm256_storeu_si256((__m256i *)lane_idx, best_idx);
        int64_t first = INT64_MAX;
        for (int l = 0; l < 8; l++)
            if (best[l] == top && lane_idx[l] < first) first = lane_idx[l];
        out[t] = first;
    }
}

/* x[rows[i]] gets -inf wherever mask row i (int32 words, bit j of word w = token 32w + j allowed) has
 * a 0. A word of all ones is skipped, so the cost follows what the grammar forbids; each eight-token
 * part of a word is one masked store, never past the vocabulary. */
AVX2_TARGET void rtp_apply_token_bitmask_avx2(float *x, int64_t ldx, const int32_t *mask, int64_t ldm,
                                              const int64_t *rows, int64_t R, int64_t N) {
    const int64_t words = (N + 31) / 32;
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
#pragma omp parallel for schedule(static) if (R >= 4)
    for (int64_t i = 0; i < R; i++) {
        float *r = x + rows[i] * ldx;
        const int32_t *m = mask + i * ldm;
        for (int64_t w = 0; w < words; w++) {
            uint32_t bits = (uint32_t)m[w];
            if (bits == 0xffffffffu) continue;
            for (int part = 0; part < 4 && w * 32 + part * 8 < N; part++) {
                int64_t at = w * 32 + part * 8;
                __m256i allowed = _mm256_and_si256(_mm256_set1_epi32((int)((bits >> (8 * part)) & 0xffu)), bit);
                __m256i forbid = _mm256_andnot_si256(_mm256_cmpeq_epi32(allowed, bit), avx2_lanes(N - at));
                _mm256_maskstore_ps(r + at, forbid, ninf);
            }
        }
    }
}
#endif
