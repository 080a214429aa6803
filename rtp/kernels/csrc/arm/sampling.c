#if defined(__aarch64__)
/* The sampler's kernels on the NEON path (their contracts: csrc/sampling.c; the avx2 twins:
 * csrc/avx2/sampling.c): greedy argmax and a grammar's token bitmask over fp32 logits. */
#include <math.h>
#include <omp.h>

#include "neon.h"

/* out[t] = the index of row t's maximum, the first on ties, or of its first NaN (NumPy's argmax). Each lane
 * keeps the best value and index of its column stripe (strict >, so a stripe's earliest wins), then among
 * the lanes holding the row's maximum the smallest index is the first. A NaN never compares greater, so
 * the lanes only note that one was seen; the row is then searched for its first NaN. */
void rtp_argmax_rows_neon(const float *x, int64_t ldx, int64_t T, int64_t N, int64_t *out) {
#pragma omp parallel for schedule(static) if (T >= 4)
    for (int64_t t = 0; t < T; t++) {
        const float *r = x + t * ldx;
        const float32x4_t ninf = vdupq_n_f32(-INFINITY);
        const int32_t start[4] = {0, 1, 2, 3};
        int32x4_t idx = vld1q_s32(start), best_idx = idx;
        float32x4_t best = ninf;
        uint32x4_t ordered = vdupq_n_u32(0xffffffffu); /* all ones while no NaN was seen in the lane */
        for (int64_t c = 0; c < N; c += 4) {
            float32x4_t v;
            if (N - c >= 4) {
                v = vld1q_f32(r + c);
            } else { /* past the row's end: -inf, which never wins */
                float part[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
                memcpy(part, r + c, (size_t)(N - c) * sizeof(float));
                v = vld1q_f32(part);
            }
            uint32x4_t gt = vcgtq_f32(v, best);
            best = vbslq_f32(gt, v, best);
            best_idx = vbslq_s32(gt, idx, best_idx);
            ordered = vandq_u32(ordered, vceqq_f32(v, v));
            idx = vaddq_s32(idx, vdupq_n_s32(4));
        }
        if (vminvq_u32(ordered) == 0) {
            int64_t i = 0;
            while (r[i] == r[i]) i++;
            out[t] = i;
            continue;
        }
        float top = neon_hmax(best);
        float lanes[4];
        int32_t lane_idx[4];
        vst1q_f32(lanes, best);
        vst1q_s32(lane_idx, best_idx);
        int64_t first = INT64_MAX;
        for (int l = 0; l < 4; l++)
            if (lanes[l] == top && lane_idx[l] < first) first = lane_idx[l];
        out[t] = first;
    }
}

/* x[rows[i]] gets -inf wherever mask row i (int32 words, bit j of word w = token 32w + j allowed) has a 0.
 * A word of all ones is skipped, so the cost follows what the grammar forbids. NEON has no masked store,
 * and a load-select-store would write back the allowed values too (a race where two listed rows are the
 * same row), so only -inf is ever written: a word of all zeros as eight vector stores, a mixed word token by
 * token over its zero bits; never past the vocabulary. */
void rtp_apply_token_bitmask_neon(float *x, int64_t ldx, const int32_t *mask, int64_t ldm, const int64_t *rows,
                                  int64_t R, int64_t N) {
    const int64_t words = (N + 31) / 32;
    const float32x4_t ninf = vdupq_n_f32(-INFINITY);
#pragma omp parallel for schedule(static) if (R >= 4)
    for (int64_t i = 0; i < R; i++) {
        float *r = x + rows[i] * ldx;
        const int32_t *m = mask + i * ldm;
        for (int64_t w = 0; w < words; w++) {
            uint32_t bits = (uint32_t)m[w];
            if (bits == 0xffffffffu) continue;
            float *at = r + w * 32;
            if (bits == 0 && w * 32 + 32 <= N) {
                for (int s = 0; s < 8; s++) vst1q_f32(at + 4 * s, ninf);
                continue;
            }
            uint32_t forbid = ~bits;
            if (N - w * 32 < 32) forbid &= (1u << (N - w * 32)) - 1; /* the last word: tokens below N only */
            for (; forbid; forbid &= forbid - 1) at[__builtin_ctz(forbid)] = -INFINITY;
        }
    }
}
#endif
