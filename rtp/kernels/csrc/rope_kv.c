/* RoPE + KV-cache write: the op after every qkv projection (below). */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"
#include "vec_math.h"

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#define MAX_DIM RTP_MAX_HEAD_DIM

/* ---------------------------------------------------------------------------------------------
 * After the qkv projection: rotate q and k (RoPE, rotate-half convention, the first `rot`
 * dims of each head, in fp32), write q out and k, v into the paged cache at slot_mapping.
 *   qkv bf16 [T, (H + 2 Hkv) * D] row stride ldq; positions int32 [T];
 *   cos_sin fp32 [max_position, rot] (cos in the first half of a row, sin in the second);
 *   q_out bf16 [T, H, D]; k_cache / v_cache bf16, token stride tok_stride, head stride D,
 *   num_slots slots each; or int8 (k_scales / v_scales not NULL, fp32 [num_slots, Hkv]): each
 *   (token, kv head) row x, rounded to bf16 as the bf16 cache would hold it, is stored as
 *   q = round(x * 127 / absmax(x)) with the scale absmax(x) / 127 (all zeros: q 0, scale 0).
 * rot / 2 is a multiple of 16. The only kernel that stores at addresses taken from data: a slot
 * outside [0, num_slots) would land in whatever memory lies near the cache (weights, another
 * layer's blocks), so its K and V are not written and the call returns 0 (else 1).
 * ------------------------------------------------------------------------------------------- */
TARGET static inline void rope_head(const uint16_t *x, const float *cs, int64_t rot, int64_t D,
                                    uint16_t *dst) {
    int64_t half = rot / 2;
    for (int64_t i = 0; i < half; i += 16) {
        __m512 x1 = bf16x16_to_f32(x + i), x2 = bf16x16_to_f32(x + half + i);
        __m512 c = _mm512_loadu_ps(cs + i), s = _mm512_loadu_ps(cs + half + i);
        /* separate products, as torch computes x1 * cos - x2 * sin (no fused multiply-add) */
        __m512 a = _mm512_sub_ps(_mm512_mul_ps(x1, c), _mm512_mul_ps(x2, s));
        __m512 b = _mm512_add_ps(_mm512_mul_ps(x2, c), _mm512_mul_ps(x1, s));
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(a));
        _mm256_storeu_si256((__m256i *)(dst + half + i), (__m256i)_mm512_cvtneps_pbh(b));
    }
    if (rot < D) memcpy(dst + rot, x + rot, (size_t)(D - rot) * sizeof(uint16_t));
}

/* One row of D bf16 (D a multiple of 16) into the int8 cache: symmetric absmax / 127. */
TARGET static inline void quantize_head(const uint16_t *x, int64_t D, int8_t *dst, float *scale) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(bf16x16_to_f32(x + c)));
    float amax = _mm512_reduce_max_ps(mx);
    __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    *scale = amax / 127.0f;
    for (int64_t c = 0; c < D; c += 16) /* round to nearest even, as torch.round */
        _mm_storeu_si128((__m128i *)(dst + c),
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(bf16x16_to_f32(x + c), inv))));
}

/* An int8 cache holds K times the normalized Sylvester Hadamard matrix H (D a power of two), and q
 * is rotated alike, so every score q.k is what it was: the rotation spreads a head's few large
 * channels over all D, so one absmax scale a row loses far less (SmolLM2-135M: the KL of its
 * next-token distributions from an int8 cache's to an fp32 one's 1.4e-3 -> 3.1e-4). x: D fp32 in
 * place, D a multiple of 16 and a power of two. The butterflies run in the order of
 * rtp.models.attention.hadamard (a + b, a - b per pair, the strides 1, 2, 4, ...), then times
 * (float)(1 / sqrt(D)): the same bits. Within a vector a pair is a lane and its partner lane^h. */
TARGET static inline void hadamard_rows(float *x, int64_t D) {
    __m512 v[MAX_DIM / 16];
    const int64_t n = D / 16;
    for (int64_t j = 0; j < n; j++) v[j] = _mm512_loadu_ps(x + j * 16);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int h = 1; h < 16; h *= 2) {
        const __m512i partner = _mm512_xor_si512(lane, _mm512_set1_epi32(h));
        const __mmask16 upper = _mm512_test_epi32_mask(lane, _mm512_set1_epi32(h)); /* lanes i + h */
        for (int64_t j = 0; j < n; j++) {
            __m512 p = _mm512_permutexvar_ps(partner, v[j]);
            v[j] = _mm512_mask_blend_ps(upper, _mm512_add_ps(v[j], p), _mm512_sub_ps(p, v[j]));
        }
    }
    for (int64_t h = 1; h < n; h *= 2)
        for (int64_t j = 0; j < n; j++)
            if (!(j & h)) {
                __m512 a = v[j], b = v[j + h];
                v[j] = _mm512_add_ps(a, b);
                v[j + h] = _mm512_sub_ps(a, b);
            }
    const __m512 s = _mm512_set1_ps((float)(1.0 / sqrt((double)D)));
    for (int64_t j = 0; j < n; j++) _mm512_storeu_ps(x + j * 16, _mm512_mul_ps(v[j], s));
}

TARGET static inline int rotates_kv(int64_t D) { return D >= 16 && (D & (D - 1)) == 0; }

/* bf16 row -> fp32, rotated (hadamard_rows). */
TARGET static inline void hadamard_bf16(const uint16_t *x, int64_t D, float *out) {
    for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(out + c, bf16x16_to_f32(x + c));
    hadamard_rows(out, D);
}

/* One row of D fp32 into the int8 cache, as quantize_head. */
TARGET static inline void quantize_head_f32(const float *x, int64_t D, int8_t *dst, float *scale) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(x + c)));
    float amax = _mm512_reduce_max_ps(mx);
    __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    *scale = amax / 127.0f;
    for (int64_t c = 0; c < D; c += 16)
        _mm_storeu_si128((__m128i *)(dst + c),
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + c), inv))));
}

TARGET int rtp_rope_store_kv(const uint16_t *qkv, int64_t ldq, const int32_t *positions,
                             const float *cos_sin, int64_t rot, uint16_t *q_out, void *k_cache,
                             void *v_cache, int64_t tok_stride, const int64_t *slots,
                             int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t num_slots,
                             float *k_scales, float *v_scales) {
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
                for (int64_t h = 0; h < H; h++) { /* q times H too: the scores stay q.k */
                    uint16_t *qh = q_out + (t * H + h) * D;
                    hadamard_bf16(qh, D, spread);
                    for (int64_t c = 0; c < D; c += 16)
                        _mm256_storeu_si256((__m256i *)(qh + c),
                                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(spread + c)));
                }
            for (int64_t h = 0; h < Hkv; h++) {
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
