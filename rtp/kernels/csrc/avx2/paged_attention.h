/* The avx2 path's attention of a run of consecutive query tokens over one kv head of the paged cache:
 * the core that decode_attention.c (one token a row) and prefill_attention.c (tiles of a prompt chunk)
 * both call, so that a query gets the same bits from either kernel.
 *
 * Layout: K and V rows of slot s (= block_tables[pos / block_size] * block_size + pos % block_size), kv
 * head h at s * tok_bytes + h * head_bytes of their cache, D bf16 values, or D int8 values q standing for
 * scale * q with one fp32 scale per (slot, kv head) at [s * hkv + h] of k_scales / v_scales. Queries and
 * outputs bf16, a token's G = H / Hkv query heads of kv head h at [(token * H + h * G + g) * D].
 *
 * Numerics, fp32 throughout: q and the K/V rows widened exactly (int8 converted exactly, its scale applied
 * to the score and to the probability instead of to the row), score = (q . k) * (k_scale * scale), then
 * softcap * tanh(score / softcap) where softcap > 0, an online softmax, output rounded once to bf16.
 *
 * Determinism: a query's bits depend only on its own q, its position and its sequence's keys. Its keys go
 * in steps of ATTN_KEYS aligned to absolute key positions (never to where its chunk or tile starts); within
 * a step every operation on its row runs in one fixed order whatever else shares the step: each score is
 * the same chain of FMAs and the same lane-sum tree, its probabilities are summed in ascending key order and
 * its outputs accumulated in ascending key order. Rows attended together only share the loads of K and V.
 * The callers never split one query's keys between threads. */
#ifndef RTP_AVX2_PAGED_ATTENTION_H
#define RTP_AVX2_PAGED_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "avx2.h"
#include "avx2_math.h"
#include "cpu_kernels.h"

#define ATTN_KEYS 32 /* keys per online-softmax step: K and V of a step widened once for every row */
#define ATTN_ROWS 16 /* (token, query head) rows attended together: one kv head's 16 query heads at most */
#define ATTN_MAX_DIM RTP_MAX_HEAD_DIM

typedef struct {
    const char *k, *v;
    int64_t tok_bytes, head_bytes; /* between slots, between kv heads of a slot */
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

/* cap * tanh(s / cap) (Gemma 2's logit softcapping), tanh as the final logits' softcap takes it. */
AVX2_TARGET static inline __m256 avx2_softcap(__m256 s, __m256 inv_cap, __m256 cap) {
    return _mm256_mul_ps(cap, avx2_tanh(_mm256_mul_ps(s, inv_cap)));
}

/* Lane i = the sum of v[i]'s lanes, each as ((x0+x1)+(x2+x3)) + ((x4+x5)+(x6+x7)): the same tree for every
 * lane, so a score's bits do not depend on which lane of the eight it is computed in. */
AVX2_TARGET static inline __m256 avx2_sum8x8(const __m256 *v) {
    __m256 h0 = _mm256_hadd_ps(v[0], v[1]), h1 = _mm256_hadd_ps(v[2], v[3]);
    __m256 h2 = _mm256_hadd_ps(v[4], v[5]), h3 = _mm256_hadd_ps(v[6], v[7]);
    __m256 g0 = _mm256_hadd_ps(h0, h1), g1 = _mm256_hadd_ps(h2, h3);
    return _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
}


/* Which lanes of keys [j0, j0 + 8) lie in [lo, hi] (step-relative indices). */
AVX2_TARGET static inline __m256 avx2_key_lanes(int64_t j0, int64_t lo, int64_t hi) {
    __m256i idx = _mm256_add_epi32(_mm256_set1_epi32((int)j0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i ge = _mm256_cmpgt_epi32(idx, _mm256_set1_epi32((int)lo - 1));
    __m256i le = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)hi + 1), idx);
    return _mm256_castsi256_ps(_mm256_and_si256(ge, le));
}

/* D values of a cache row as fp32 (exact for bf16 and for int8). */
AVX2_TARGET static inline void widen_row(const char *row, int int8, int64_t D, float *dst) {
    if (int8) {
        for (int64_t c = 0; c < D; c += 8) {
            __m128i b = _mm_loadl_epi64((const __m128i *)(row + c));
            _mm256_store_ps(dst + c, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
        }
    } else {
        for (int64_t c = 0; c < D; c += 8) _mm256_store_ps(dst + c, avx2_load_bf16x8((const uint16_t *)row + c));
    }
}

/* Keys [k0 + lo, k0 + hi] of kv head h widened into the step's buffers (row j = key k0 + j), with each key's
 * k_scale * scale and v_scale (bf16: scale and 1). K rows of the 8-key groups around them that hold no key
 * are zeroed: their scores are computed, and masked, with the group's. */
AVX2_TARGET static void load_step(const paged_kv *kv, const int32_t *table, int64_t h, int64_t k0, int64_t lo,
                                  int64_t hi, float (*kf)[ATTN_MAX_DIM], float (*vf)[ATTN_MAX_DIM], float *kscale,
                                  float *vscale) {
    int int8 = kv->k_scales != NULL;
    int64_t D = kv->D;
    for (int64_t j = lo / 8 * 8; j < lo; j++) {
        memset(kf[j], 0, (size_t)D * sizeof(float));
        kscale[j] = vscale[j] = 0.0f;
    }
    for (int64_t j = hi + 1; j < (hi / 8 + 1) * 8; j++) {
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

/* The scores of one row against keys [j0, j0 + 8) of the step: eight independent FMA chains over the
 * head dim (enough to keep both FMA ports busy), then one lane-sum tree. */
AVX2_TARGET static inline __m256 score8(const float *q, float (*kf)[ATTN_MAX_DIM], int64_t j0, int64_t D) {
    __m256 acc[8];
    __m256 qc = _mm256_load_ps(q);
    for (int i = 0; i < 8; i++) acc[i] = _mm256_mul_ps(qc, _mm256_load_ps(kf[j0 + i]));
    for (int64_t c = 8; c < D; c += 8) {
        qc = _mm256_load_ps(q + c);
        for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(qc, _mm256_load_ps(kf[j0 + i] + c), acc[i]);
    }
    return avx2_sum8x8(acc);
}

/* One row's online-softmax update over its keys [lo, hi] of the step: its running max m and sum l move,
 * its probabilities (times the keys' v_scale) go to prob[lo..hi]; returns the factor its output
 * accumulators take before this step's values are added. */
AVX2_TARGET static float softmax_step(const float *q, float (*kf)[ATTN_MAX_DIM], const float *kscale,
                                      const float *vscale, int64_t lo, int64_t hi, int64_t D, float softcap,
                                      float *m, float *l, float *prob) {
    const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
    const __m256 cap = _mm256_set1_ps(softcap), inv_cap = _mm256_set1_ps(softcap > 0.0f ? 1.0f / softcap : 0.0f);
    float scores[ATTN_KEYS] __attribute__((aligned(32)));
    __m256 mx = neg_inf;
    for (int64_t j0 = lo / 8 * 8; j0 <= hi; j0 += 8) {
        __m256 s = _mm256_mul_ps(score8(q, kf, j0, D), _mm256_load_ps(kscale + j0));
        if (softcap > 0.0f) s = avx2_softcap(s, inv_cap, cap);
        s = _mm256_blendv_ps(neg_inf, s, avx2_key_lanes(j0, lo, hi));
        _mm256_store_ps(scores + j0, s);
        mx = _mm256_max_ps(mx, s);
    }
    float m_old = *m, m_new = avx2_hmax(mx);
    if (m_new < m_old) m_new = m_old;
    float corr = m_old == -INFINITY ? 0.0f
                                    : _mm256_cvtss_f32(avx2_exp(_mm256_set1_ps(m_old - m_new)));
    __m256 mv = _mm256_set1_ps(m_new), sum = _mm256_setzero_ps();
    for (int64_t j0 = lo / 8 * 8; j0 <= hi; j0 += 8) {
        __m256 p = avx2_exp(_mm256_sub_ps(_mm256_load_ps(scores + j0), mv));
        p = _mm256_and_ps(p, avx2_key_lanes(j0, lo, hi));
        sum = _mm256_add_ps(sum, p);
        _mm256_store_ps(prob + j0, _mm256_mul_ps(p, _mm256_load_ps(vscale + j0)));
    }
    float step_sum = avx2_hsum(sum);
    *l = *l * corr + step_sum;
    *m = m_new;
    return corr;
}

/* out = out * corr + sum over keys j in [lo, hi], ascending, of prob[j] * V[j], for one row or for two rows
 * of one token (rows b non-NULL): four vectors of dims at a time, so each V load feeds both rows. */
AVX2_TARGET static void accumulate_values(float (*vf)[ATTN_MAX_DIM], int64_t lo, int64_t hi, int64_t D,
                                          float *out_a, const float *prob_a, float corr_a, float *out_b,
                                          const float *prob_b, float corr_b) {
    const __m256 ca = _mm256_set1_ps(corr_a), cb = _mm256_set1_ps(corr_b);
    for (int64_t c = 0; c < D; c += 32) {
        __m256 a[4], b[4];
        for (int i = 0; i < 4; i++) a[i] = _mm256_mul_ps(_mm256_load_ps(out_a + c + 8 * i), ca);
        if (out_b) {
            for (int i = 0; i < 4; i++) b[i] = _mm256_mul_ps(_mm256_load_ps(out_b + c + 8 * i), cb);
            for (int64_t j = lo; j <= hi; j++) {
                __m256 pa = _mm256_broadcast_ss(prob_a + j), pb = _mm256_broadcast_ss(prob_b + j);
                for (int i = 0; i < 4; i++) {
                    __m256 v = _mm256_load_ps(vf[j] + c + 8 * i);
                    a[i] = _mm256_fmadd_ps(pa, v, a[i]);
                    b[i] = _mm256_fmadd_ps(pb, v, b[i]);
                }
            }
            for (int i = 0; i < 4; i++) _mm256_store_ps(out_b + c + 8 * i, b[i]);
        } else {
            for (int64_t j = lo; j <= hi; j++) {
                __m256 pa = _mm256_broadcast_ss(prob_a + j);
                for (int i = 0; i < 4; i++) a[i] = _mm256_fmadd_ps(pa, _mm256_load_ps(vf[j] + c + 8 * i), a[i]);
            }
        }
        for (int i = 0; i < 4; i++) _mm256_store_ps(out_a + c + 8 * i, a[i]);
    }
}

/* Attend every row of `run` (tokens x G query heads of kv head h) over its keys in the cache of the
 * sequence whose block ids are `table`, and write its bf16 outputs. About 100 KiB of stack. */
AVX2_TARGET static void attend_query_run(const paged_kv *kv, const int32_t *table, int64_t h, const query_run *run) {
    float qf[ATTN_ROWS][ATTN_MAX_DIM] __attribute__((aligned(32)));
    float acc[ATTN_ROWS][ATTN_MAX_DIM] __attribute__((aligned(32)));
    float kf[ATTN_KEYS][ATTN_MAX_DIM] __attribute__((aligned(32)));
    float vf[ATTN_KEYS][ATTN_MAX_DIM] __attribute__((aligned(32)));
    float prob[ATTN_ROWS][ATTN_KEYS] __attribute__((aligned(32)));
    float kscale[ATTN_KEYS] __attribute__((aligned(32))), vscale[ATTN_KEYS] __attribute__((aligned(32)));
    float m[ATTN_ROWS], l[ATTN_ROWS], corr[ATTN_ROWS];
    int64_t D = kv->D, G = run->G, T = run->tokens;
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < G; g++) {
            int64_t r = t * G + g;
            const uint16_t *src = run->q + t * run->token_stride + g * D;
            for (int64_t c = 0; c < D; c += 8) _mm256_store_ps(qf[r] + c, avx2_load_bf16x8(src + c));
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
            __m256 inv = _mm256_set1_ps(1.0f / l[r]);
            uint16_t *dst = run->out + t * run->token_stride + g * D;
            for (int64_t c = 0; c < D; c += 8) avx2_store_bf16x8(dst + c, _mm256_mul_ps(_mm256_load_ps(acc[r] + c), inv));
        }
}

#endif
