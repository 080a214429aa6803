#if defined(__aarch64__)
/* The NEON path's attention of a run of consecutive query tokens over one kv head of the paged cache: the core
 * that decode_attention.c (one token a row) and prefill_attention.c (tiles of a prompt chunk) both call, so
 * that a query gets the same bits from either kernel. A port of csrc/avx2/paged_attention.h: the same layout,
 * steps, online softmax and determinism, with 4-lane vectors.
 *
 * Layout: K and V rows of slot s (= block_tables[pos / block_size] * block_size + pos % block_size), kv head h
 * at s * tok_bytes + h * head_bytes of their cache, D bf16 values, or D int8 values q standing for scale * q
 * with one fp32 scale per (slot, kv head) at [s * hkv + h] of k_scales / v_scales. Queries and outputs bf16,
 * a token's G = H / Hkv query heads of kv head h at [(token * H + h * G + g) * D]. D a multiple of 32.
 *
 * Numerics, fp32 throughout: q and the K/V rows widened exactly (int8 converted exactly, its scale applied to
 * the score and to the probability instead of to the row), score = (q . k) * (k_scale * scale), then
 * softcap * tanh(score / softcap) where softcap > 0, an online softmax, output rounded once to bf16.
 *
 * Determinism: a query's bits depend only on its own q, its position and its sequence's keys. Its keys go in
 * steps of ATTN_KEYS aligned to absolute key positions (never to where its chunk or tile starts); within a
 * step every operation on its row runs in one fixed order whatever else shares the step: each score is the
 * same chain of FMAs and the same lane-sum tree, its probabilities are summed in ascending key order (two
 * 4-lane sums, then neon_hsum2) and its outputs accumulated in ascending key order. Rows attended together
 * only share the loads of K and V. The callers never split one query's keys between threads. */
#ifndef RTP_NEON_PAGED_ATTENTION_H
#define RTP_NEON_PAGED_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "neon.h"
#include "neon_math.h"

#define ATTN_KEYS 32 /* keys per online-softmax step: K and V of a step widened once for every row */
#define ATTN_ROWS 16 /* (token, query head) rows attended together: one kv head's 16 query heads at most */
#define ATTN_GROUP 8 /* keys scored together: eight FMA chains over the head dim */
#define ATTN_MAX_DIM RTP_MAX_HEAD_DIM

typedef struct {
    const char *k, *v;
    int64_t tok_bytes, head_bytes;    /* between slots, between kv heads of a slot */
    const float *k_scales, *v_scales; /* int8 caches: fp32 [slots, hkv]; bf16: NULL */
    int64_t hkv, block_size, D;
    float scale, softcap;
    int64_t window; /* > 0: a query at position p sees keys [p - window + 1, p] */
} paged_kv;

typedef struct {
    const uint16_t *q; /* token 0's first query head of the kv head */
    uint16_t *out;
    int64_t token_stride; /* elements between consecutive tokens of q and of out (H * D) */
    int64_t first_pos;    /* token 0's position; token t is at first_pos + t and sees keys up to it */
    int64_t tokens, G;    /* tokens * G <= ATTN_ROWS */
} query_run;

/* Denormals flushed to zero (FPCR.FZ, bit 24: inputs and results, as x86's FTZ and DAZ) from here until
 * neon_restore_fpcr: a probability far below its row's max times a small value is denormal, and many cores
 * take a slow path on one. */
static inline uint64_t neon_flush_denormals(void) {
    uint64_t old;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(old));
    __asm__ __volatile__("msr fpcr, %0" : : "r"(old | (UINT64_C(1) << 24)));
    return old;
}
static inline void neon_restore_fpcr(uint64_t old) { __asm__ __volatile__("msr fpcr, %0" : : "r"(old)); }

/* cap * tanh(s / cap) (Gemma 2's logit softcapping), as the avx2 path takes it (s times 1 / cap). */
static inline float32x4_t neon_softcap(float32x4_t s, float32x4_t inv_cap, float32x4_t cap) {
    return vmulq_f32(cap, neon_tanh(vmulq_f32(s, inv_cap)));
}

/* Lane i = the sum of v[i]'s lanes, each as (x0+x1) + (x2+x3) (ADDP twice): the same tree for every lane, so
 * a score's bits do not depend on which lane of the four it is computed in. */
static inline float32x4_t neon_sum4x4(const float32x4_t *v) {
    return vpaddq_f32(vpaddq_f32(v[0], v[1]), vpaddq_f32(v[2], v[3]));
}

/* All ones in the lanes of keys [j0, j0 + 4) that lie in [lo, hi] (step-relative indices). */
static inline uint32x4_t neon_key_lanes(int64_t j0, int64_t lo, int64_t hi) {
    const int32_t step[4] = {0, 1, 2, 3};
    int32x4_t idx = vaddq_s32(vdupq_n_s32((int32_t)j0), vld1q_s32(step));
    return vandq_u32(vcgeq_s32(idx, vdupq_n_s32((int32_t)lo)), vcleq_s32(idx, vdupq_n_s32((int32_t)hi)));
}

/* D values of a cache row as fp32 (exact for bf16 and for int8). */
static inline void widen_row(const char *row, int int8, int64_t D, float *dst) {
    if (int8) {
        for (int64_t c = 0; c < D; c += 8) {
            int16x8_t w = vmovl_s8(vld1_s8((const int8_t *)row + c));
            vst1q_f32(dst + c, vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))));
            vst1q_f32(dst + c + 4, vcvtq_f32_s32(vmovl_high_s16(w)));
        }
    } else {
        for (int64_t c = 0; c < D; c += 8) {
            float32x4_t lo, hi;
            neon_load_bf16x8((const uint16_t *)row + c, &lo, &hi);
            vst1q_f32(dst + c, lo);
            vst1q_f32(dst + c + 4, hi);
        }
    }
}

/* Keys [k0 + lo, k0 + hi] of kv head h widened into the step's buffers (row j = key k0 + j), with each key's
 * k_scale * scale and v_scale (bf16: scale and 1). K rows of the 8-key groups around them that hold no key
 * are zeroed: their scores are computed, and masked, with the group's. */
static void load_step(const paged_kv *kv, const int32_t *table, int64_t h, int64_t k0, int64_t lo, int64_t hi,
                      float (*kf)[ATTN_MAX_DIM], float (*vf)[ATTN_MAX_DIM], float *kscale, float *vscale) {
    int int8 = kv->k_scales != NULL;
    int64_t D = kv->D;
    for (int64_t j = lo / ATTN_GROUP * ATTN_GROUP; j < lo; j++) {
        memset(kf[j], 0, (size_t)D * sizeof(float));
        kscale[j] = vscale[j] = 0.0f;
    }
    for (int64_t j = hi + 1; j < (hi / ATTN_GROUP + 1) * ATTN_GROUP; j++) {
        memset(kf[j], 0, (size_t)D * sizeof(float));
        kscale[j] = vscale[j] = 0.0f;
    }
    for (int64_t j = lo; j <= hi; j++) {
        int64_t pos = k0 + j, blk = pos / kv->block_size;
        int64_t slot = (int64_t)table[blk] * kv->block_size + (pos - blk * kv->block_size);
        int64_t at = slot * kv->tok_bytes + h * kv->head_bytes;
        widen_row(kv->k + at, int8, D, kf[j]);
        widen_row(kv->v + at, int8, D, vf[j]);
        kscale[j] = int8 ? kv->k_scales[slot * kv->hkv + h] * kv->scale : kv->scale;
        vscale[j] = int8 ? kv->v_scales[slot * kv->hkv + h] : 1.0f;
    }
}

/* The scores of one row against keys [j0, j0 + 8) of the step, into dst[0..7]: eight independent FMA chains
 * over the head dim (enough to keep the FMA pipes busy), then one lane-sum tree per four keys. */
static inline void score8(const float *q, float (*kf)[ATTN_MAX_DIM], int64_t j0, int64_t D, float *dst) {
    float32x4_t acc[8];
    float32x4_t qc = vld1q_f32(q);
    for (int i = 0; i < 8; i++) acc[i] = vmulq_f32(qc, vld1q_f32(kf[j0 + i]));
    for (int64_t c = 4; c < D; c += 4) {
        qc = vld1q_f32(q + c);
        for (int i = 0; i < 8; i++) acc[i] = vfmaq_f32(acc[i], qc, vld1q_f32(kf[j0 + i] + c));
    }
    vst1q_f32(dst, neon_sum4x4(acc));
    vst1q_f32(dst + 4, neon_sum4x4(acc + 4));
}

/* One row's online-softmax update over its keys [lo, hi] of the step: its running max m and sum l move, its
 * probabilities (times the keys' v_scale) go to prob[lo..hi]; returns the factor its output accumulators take
 * before this step's values are added. */
static float softmax_step(const float *q, float (*kf)[ATTN_MAX_DIM], const float *kscale, const float *vscale,
                          int64_t lo, int64_t hi, int64_t D, float softcap, float *m, float *l, float *prob) {
    const float32x4_t neg_inf = vdupq_n_f32(-INFINITY);
    const float32x4_t cap = vdupq_n_f32(softcap), inv_cap = vdupq_n_f32(softcap > 0.0f ? 1.0f / softcap : 0.0f);
    float scores[ATTN_KEYS];
    float32x4_t mx = neg_inf;
    for (int64_t j0 = lo / ATTN_GROUP * ATTN_GROUP; j0 <= hi; j0 += ATTN_GROUP) {
        score8(q, kf, j0, D, scores + j0);
        for (int64_t j = j0; j < j0 + ATTN_GROUP; j += 4) {
            float32x4_t s = vmulq_f32(vld1q_f32(scores + j), vld1q_f32(kscale + j));
            if (softcap > 0.0f) s = neon_softcap(s, inv_cap, cap);
            s = vbslq_f32(neon_key_lanes(j, lo, hi), s, neg_inf);
            vst1q_f32(scores + j, s);
            mx = vmaxq_f32(mx, s);
        }
    }
    float m_old = *m, m_new = neon_hmax(mx);
    if (m_new < m_old) m_new = m_old;
    float corr = m_old == -INFINITY ? 0.0f : vgetq_lane_f32(neon_exp(vdupq_n_f32(m_old - m_new)), 0);
    float32x4_t mv = vdupq_n_f32(m_new), sum[2] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
    for (int64_t j0 = lo / ATTN_GROUP * ATTN_GROUP; j0 <= hi; j0 += ATTN_GROUP)
        for (int s = 0; s < 2; s++) {
            int64_t j = j0 + 4 * s;
            float32x4_t p = neon_exp(vsubq_f32(vld1q_f32(scores + j), mv));
            p = vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(p), neon_key_lanes(j, lo, hi)));
            sum[s] = vaddq_f32(sum[s], p);
            vst1q_f32(prob + j, vmulq_f32(p, vld1q_f32(vscale + j)));
        }
    float step_sum = neon_hsum2(sum[0], sum[1]);
    *l = *l * corr + step_sum;
    *m = m_new;
    return corr;
}

/* out = out * corr + sum over keys j in [lo, hi], ascending, of prob[j] * V[j], for one row or for two rows of
 * one token (rows b non-NULL): eight vectors (32 dims) at a time, so each V load feeds both rows. */
static void accumulate_values(float (*vf)[ATTN_MAX_DIM], int64_t lo, int64_t hi, int64_t D, float *out_a,
                              const float *prob_a, float corr_a, float *out_b, const float *prob_b, float corr_b) {
    for (int64_t c = 0; c < D; c += 32) {
        float32x4_t a[8], b[8];
        for (int i = 0; i < 8; i++) a[i] = vmulq_n_f32(vld1q_f32(out_a + c + 4 * i), corr_a);
        if (out_b) {
            for (int i = 0; i < 8; i++) b[i] = vmulq_n_f32(vld1q_f32(out_b + c + 4 * i), corr_b);
            for (int64_t j = lo; j <= hi; j++) {
                float32x4_t pa = vdupq_n_f32(prob_a[j]), pb = vdupq_n_f32(prob_b[j]);
                for (int i = 0; i < 8; i++) {
                    float32x4_t v = vld1q_f32(vf[j] + c + 4 * i);
                    a[i] = vfmaq_f32(a[i], pa, v);
                    b[i] = vfmaq_f32(b[i], pb, v);
                }
            }
            for (int i = 0; i < 8; i++) vst1q_f32(out_b + c + 4 * i, b[i]);
        } else {
            for (int64_t j = lo; j <= hi; j++) {
                float32x4_t pa = vdupq_n_f32(prob_a[j]);
                for (int i = 0; i < 8; i++) a[i] = vfmaq_f32(a[i], pa, vld1q_f32(vf[j] + c + 4 * i));
            }
        }
        for (int i = 0; i < 8; i++) vst1q_f32(out_a + c + 4 * i, a[i]);
    }
}

/* Attend every row of `run` (tokens x G query heads of kv head h) over its keys in the cache of the sequence
 * whose block ids are `table`, and write its bf16 outputs. About 100 KiB of stack. */
static void attend_query_run(const paged_kv *kv, const int32_t *table, int64_t h, const query_run *run) {
    float qf[ATTN_ROWS][ATTN_MAX_DIM] __attribute__((aligned(16)));
    float acc[ATTN_ROWS][ATTN_MAX_DIM] __attribute__((aligned(16)));
    float kf[ATTN_KEYS][ATTN_MAX_DIM] __attribute__((aligned(16)));
    float vf[ATTN_KEYS][ATTN_MAX_DIM] __attribute__((aligned(16)));
    float prob[ATTN_ROWS][ATTN_KEYS] __attribute__((aligned(16)));
    float kscale[ATTN_KEYS] __attribute__((aligned(16))), vscale[ATTN_KEYS] __attribute__((aligned(16)));
    float m[ATTN_ROWS], l[ATTN_ROWS], corr[ATTN_ROWS];
    int64_t D = kv->D, G = run->G, T = run->tokens;
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < G; g++) {
            int64_t r = t * G + g;
            widen_row((const char *)(run->q + t * run->token_stride + g * D), 0, D, qf[r]);
            memset(acc[r], 0, (size_t)D * sizeof(float));
            m[r] = -INFINITY;
            l[r] = 0.0f;
        }
#define FIRST_KEY(pos) (kv->window > 0 && (pos) - kv->window + 1 > 0 ? (pos) - kv->window + 1 : 0)
    int64_t first_key = FIRST_KEY(run->first_pos), last_key = run->first_pos + T - 1;
    for (int64_t k0 = first_key / ATTN_KEYS * ATTN_KEYS; k0 <= last_key; k0 += ATTN_KEYS) {
        int64_t lo = first_key > k0 ? first_key - k0 : 0;
        int64_t hi = last_key < k0 + ATTN_KEYS - 1 ? last_key - k0 : ATTN_KEYS - 1;
        load_step(kv, table, h, k0, lo, hi, kf, vf, kscale, vscale);
        for (int64_t t = 0; t < T; t++) {
            int64_t pos = run->first_pos + t, own_first = FIRST_KEY(pos);
            int64_t tlo = own_first > k0 ? own_first - k0 : 0;
            int64_t thi = pos < k0 + ATTN_KEYS - 1 ? pos - k0 : ATTN_KEYS - 1;
            if (tlo > thi) continue; /* none of its keys in this step */
            for (int64_t g = 0; g < G; g++) {
                int64_t r = t * G + g;
                corr[r] = softmax_step(qf[r], kf, kscale, vscale, tlo, thi, D, kv->softcap, &m[r], &l[r], prob[r]);
            }
            for (int64_t g = 0; g < G; g += 2) {
                int64_t r = t * G + g;
                int pair = g + 1 < G;
                accumulate_values(vf, tlo, thi, D, acc[r], prob[r], corr[r], pair ? acc[r + 1] : NULL,
                                  pair ? prob[r + 1] : NULL, pair ? corr[r + 1] : 0.0f);
            }
        }
    }
#undef FIRST_KEY
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < G; g++) {
            int64_t r = t * G + g;
            float inv = 1.0f / l[r];
            uint16_t *dst = run->out + t * run->token_stride + g * D;
            for (int64_t c = 0; c < D; c += 8)
                neon_store_bf16x8(dst + c, vmulq_n_f32(vld1q_f32(acc[r] + c), inv),
                                  vmulq_n_f32(vld1q_f32(acc[r] + c + 4), inv));
        }
}

#endif
#endif
