/* RoPE + KV-cache write of the avx2 path (its contract: csrc/rope_kv.c): rotate q and k (rotate-half,
 * the first `rot` dims of each head, fp32), write q out and k, v into the paged cache at their slots,
 * bf16, or int8 with one fp32 scale a (slot, kv head) and K times the normalized Hadamard matrix where
 * the head dim is a power of two. A slot outside [0, num_slots) is not written (it would land in
 * whatever memory lies near the cache) and the call returns 0. */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include <math.h>
#include <omp.h>

#include "avx2.h"
#include "cpu_kernels.h"

#define MAX_DIM RTP_MAX_HEAD_DIM

/* rot / 2 a multiple of 16 (the contract), so every vector is whole. */
AVX2_TARGET static inline void rope_head(const uint16_t *x, const float *cs, int64_t rot, int64_t D, uint16_t *dst) {
    int64_t half = rot / 2;
    for (int64_t i = 0; i < half; i += 8) {
        __m256 x1 = avx2_load_bf16x8(x + i), x2 = avx2_load_bf16x8(x + half + i);
        __m256 c = _mm256_loadu_ps(cs + i), s = _mm256_loadu_ps(cs + half + i);
        /* separate products, as torch computes x1 * cos - x2 * sin (no fused multiply-add) */
        __m256 a = _mm256_sub_ps(_mm256_mul_ps(x1, c), _mm256_mul_ps(x2, s));
        __m256 b = _mm256_add_ps(_mm256_mul_ps(x2, c), _mm256_mul_ps(x1, s));
        avx2_store_bf16x8(dst + i, a);
        avx2_store_bf16x8(dst + half + i, b);
    }
    if (rot < D) memcpy(dst + rot, x + rot, (size_t)(D - rot) * sizeof(uint16_t));
}

AVX2_TARGET static inline float max_lane(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* Eight fp32 to int8 at dst, rounded to nearest even (torch.round) and saturated. */
AVX2_TARGET static inline void store_int8x8(int8_t *dst, __m256 v) {
    __m256i i = _mm256_cvtps_epi32(v);
    __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64((__m128i *)dst, _mm_packs_epi16(w, w));
}

/* One row of D fp32 (D a multiple of 8) into the int8 cache: symmetric absmax / 127, a row of zeros
 * stored as zeros with scale 0 (rtp.models.attention.quantize_kv, the same numbers). */
AVX2_TARGET static inline void quantize_head_f32(const float *x, int64_t D, int8_t *dst, float *scale) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 mx = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + c)));
    float amax = max_lane(mx);
    __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    *scale = amax / 127.0f;
    for (int64_t c = 0; c < D; c += 8) store_int8x8(dst + c, _mm256_mul_ps(_mm256_loadu_ps(x + c), inv));
}

/* A bf16 row as quantize_head_f32 (bf16 to fp32 is exact). */
AVX2_TARGET static inline void quantize_head(const uint16_t *x, int64_t D, int8_t *dst, float *scale) {
    float wide[MAX_DIM];
    for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(wide + c, avx2_load_bf16x8(x + c));
    quantize_head_f32(wide, D, dst, scale);
}

/* Why the int8 cache holds K times the Hadamard matrix: csrc/rope_kv.c. x: D fp32 in place (a power of
 * two, 16 or more). The butterflies run in rtp.models.attention.hadamard's order (a + b, a - b per
 * pair, strides 1, 2, 4, ...), then times (float)(1 / sqrt(D)), so both give the same bits. Strides
 * below 8 pair lanes of one vector (the partner lane^h comes from a permute, and the upper lane of a
 * pair, the blend's set bits, takes partner - itself); the rest pair whole vectors. */
AVX2_TARGET static inline void hadamard_rows(float *x, int64_t D) {
    __m256 v[MAX_DIM / 8];
    const int64_t n = D / 8;
    for (int64_t j = 0; j < n; j++) v[j] = _mm256_loadu_ps(x + j * 8);
    for (int64_t j = 0; j < n; j++) {
        __m256 p = _mm256_permute_ps(v[j], 0xb1); /* lanes 1 0 3 2 ... */
        v[j] = _mm256_blend_ps(_mm256_add_ps(v[j], p), _mm256_sub_ps(p, v[j]), 0xaa);
        p = _mm256_permute_ps(v[j], 0x4e); /* lanes 2 3 0 1 ... */
        v[j] = _mm256_blend_ps(_mm256_add_ps(v[j], p), _mm256_sub_ps(p, v[j]), 0xcc);
        p = _mm256_permute2f128_ps(v[j], v[j], 0x01); /* the other half */
        v[j] = _mm256_blend_ps(_mm256_add_ps(v[j], p), _mm256_sub_ps(p, v[j]), 0xf0);
    }
    for (int64_t h = 1; h < n; h *= 2)
        for (int64_t j = 0; j < n; j++)
            if (!(j & h)) {
                __m256 a = v[j], b = v[j + h];
                v[j] = _mm256_add_ps(a, b);
                v[j + h] = _mm256_sub_ps(a, b);
            }
    const __m256 s = _mm256_set1_ps((float)(1.0 / sqrt((double)D)));
    for (int64_t j = 0; j < n; j++) _mm256_storeu_ps(x + j * 8, _mm256_mul_ps(v[j], s));
}

static inline int rotates_kv(int64_t D) { return D >= 16 && (D & (D - 1)) == 0; }

/* bf16 row -> fp32, rotated (hadamard_rows). */
AVX2_TARGET static inline void hadamard_bf16(const uint16_t *x, int64_t D, float *out) {
    for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(out + c, avx2_load_bf16x8(x + c));
    hadamard_rows(out, D);
}

AVX2_TARGET int rtp_rope_store_kv_avx2(const uint16_t *qkv, int64_t ldq, const int32_t *positions,
                                       const float *cos_sin, int64_t rot, uint16_t *q_out, void *k_cache,
                                       void *v_cache, int64_t tok_stride, const int64_t *slots, int64_t T,
                                       int64_t H, int64_t Hkv, int64_t D, int64_t num_slots, float *k_scales,
                                       float *v_scales) {
    int bad = 0;
#pragma omp parallel for schedule(static) if (T >= 16) reduction(| : bad)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *row = qkv + t * ldq;
        const float *cs = cos_sin + (int64_t)positions[t] * rot;
        for (int64_t h = 0; h < H; h++) rope_head(row + h * D, cs, rot, D, q_out + (t * H + h) * D);
        int64_t slot = slots[t];
        if (slot < 0 || slot >= num_slots) {
            bad = 1;
            continue;
        }
        if (k_scales) {
            int8_t *kd = (int8_t *)k_cache + slot * tok_stride, *vd = (int8_t *)v_cache + slot * tok_stride;
            uint16_t rotated[MAX_DIM];
            float spread[MAX_DIM];
            const int spread_k = rotates_kv(D);
            if (spread_k)
                for (int64_t h = 0; h < H; h++) { /* q times the matrix too, so the scores stay q.k */
                    uint16_t *qh = q_out + (t * H + h) * D;
                    hadamard_bf16(qh, D, spread);
                    for (int64_t c = 0; c < D; c += 8) avx2_store_bf16x8(qh + c, _mm256_loadu_ps(spread + c));
                }
            for (int64_t h = 0; h < Hkv; h++) {
                /* K rounded to bf16 after RoPE first, as a bf16 cache would hold it */
                rope_head(row + (H + h) * D, cs, rot, D, rotated);
                if (spread_k) {
                    hadamard_bf16(rotated, D, spread);
                    quantize_head_f32(spread, D, kd + h * D, k_scales + slot * Hkv + h);
                } else {
                    quantize_head(rotated, D, kd + h * D, k_scales + slot * Hkv + h);
                }
                quantize_head(row + (H + Hkv + h) * D, D, vd + h * D, v_scales + slot * Hkv + h);
            }
            continue;
        }
        uint16_t *kd = (uint16_t *)k_cache + slot * tok_stride, *vd = (uint16_t *)v_cache + slot * tok_stride;
        for (int64_t h = 0; h < Hkv; h++) rope_head(row + (H + h) * D, cs, rot, D, kd + h * D);
        memcpy(vd, row + (H + Hkv) * D, (size_t)(Hkv * D) * sizeof(uint16_t));
    }
    return !bad;
}
#endif
