#if defined(__aarch64__)
/* RoPE + KV-cache write of the NEON path (its contract: csrc/rope_kv.c; the avx2 twin: csrc/avx2/rope_kv.c):
 * rotate q and k (rotate-half, the first `rot` dims of each head, fp32), write q out and k, v into the
 * paged cache at their slots, bf16, or int8 with one fp32 scale a (slot, kv head) and K times the
 * normalized Hadamard matrix where the head dim is a power of two. A slot outside [0, num_slots) is not
 * written (it would land in whatever memory lies near the cache) and the call returns 0.
 *
 * Every value is computed as torch computes it (rtp.models.rotary, rtp.models.attention's hadamard and
 * quantize_kv), so the results are their bits, as the other paths'. */
#include <math.h>
#include <omp.h>

#include "neon.h"

#define MAX_DIM RTP_MAX_HEAD_DIM

/* rot / 2 a multiple of 16 (the contract), so every vector is whole. */
static inline void rope_head(const uint16_t *x, const float *cs, int64_t rot, int64_t D, uint16_t *dst) {
    int64_t half = rot / 2;
    for (int64_t i = 0; i < half; i += 8) {
        float32x4_t x1[2], x2[2];
        neon_load_bf16x8(x + i, &x1[0], &x1[1]);
        neon_load_bf16x8(x + half + i, &x2[0], &x2[1]);
        float32x4_t a[2], b[2];
        for (int s = 0; s < 2; s++) {
            float32x4_t c = vld1q_f32(cs + i + 4 * s), sn = vld1q_f32(cs + half + i + 4 * s);
            /* separate products, as torch computes x1 * cos - x2 * sin (no fused multiply-add) */
            a[s] = vsubq_f32(vmulq_f32(x1[s], c), vmulq_f32(x2[s], sn));
            b[s] = vaddq_f32(vmulq_f32(x2[s], c), vmulq_f32(x1[s], sn));
        }
        neon_store_bf16x8(dst + i, a[0], a[1]);
        neon_store_bf16x8(dst + half + i, b[0], b[1]);
    }
    if (rot < D) memcpy(dst + rot, x + rot, (size_t)(D - rot) * sizeof(uint16_t));
}

/* Eight fp32 (two vectors) to int8 at dst, rounded to nearest even (torch.round) and saturated. */
static inline void store_int8x8(int8_t *dst, float32x4_t lo, float32x4_t hi) {
    int16x8_t w = vcombine_s16(vqmovn_s32(vcvtnq_s32_f32(lo)), vqmovn_s32(vcvtnq_s32_f32(hi)));
    vst1_s8(dst, vqmovn_s16(w));
}

/* One row of D fp32 (D a multiple of 8) into the int8 cache: symmetric absmax / 127, a row of zeros stored
 * as zeros with scale 0 (rtp.models.attention.quantize_kv, the same numbers). */
static inline void quantize_head_f32(const float *x, int64_t D, int8_t *dst, float *scale) {
    float32x4_t mx = vdupq_n_f32(0.0f);
    for (int64_t c = 0; c < D; c += 4) mx = vmaxq_f32(mx, vabsq_f32(vld1q_f32(x + c)));
    float amax = neon_hmax(mx);
    float32x4_t inv = vdupq_n_f32(amax > 0.0f ? 127.0f / amax : 0.0f);
    *scale = amax / 127.0f;
    for (int64_t c = 0; c < D; c += 8)
        store_int8x8(dst + c, vmulq_f32(vld1q_f32(x + c), inv), vmulq_f32(vld1q_f32(x + c + 4), inv));
}

/* bf16 -> fp32 for D values (a multiple of 8; exact). */
static inline void widen_head(const uint16_t *x, int64_t D, float *out) {
    for (int64_t c = 0; c < D; c += 8) {
        float32x4_t lo, hi;
        neon_load_bf16x8(x + c, &lo, &hi);
        vst1q_f32(out + c, lo);
        vst1q_f32(out + c + 4, hi);
    }
}

/* A bf16 row as quantize_head_f32 (bf16 to fp32 is exact). */
static inline void quantize_head(const uint16_t *x, int64_t D, int8_t *dst, float *scale) {
    float wide[MAX_DIM];
    widen_head(x, D, wide);
    quantize_head_f32(wide, D, dst, scale);
}

/* Why the int8 cache holds K times the Hadamard matrix: csrc/rope_kv.c. x: D fp32 in place (a power of two,
 * 16 or more). The butterflies run in rtp.models.attention.hadamard's order (a + b, a - b per pair, strides
 * 1, 2, 4, ...), then times (float)(1 / sqrt(D)), so both give the same bits. Strides 1 and 2 pair lanes of
 * one vector (TRN1/TRN2 put each pair's two values side by side; the 64-bit halves are stride 2's pairs),
 * the rest pair whole vectors. */
static inline void hadamard_rows(float *x, int64_t D) {
    float32x4_t v[MAX_DIM / 4];
    const int64_t n = D / 4;
    for (int64_t j = 0; j < n; j++) v[j] = vld1q_f32(x + j * 4);
    for (int64_t j = 0; j < n; j++) {
        float32x4_t a = vtrn1q_f32(v[j], v[j]), b = vtrn2q_f32(v[j], v[j]); /* lanes 0 0 2 2, 1 1 3 3 */
        v[j] = vtrn1q_f32(vaddq_f32(a, b), vsubq_f32(a, b));                 /* a0+b0, a0-b0, a2+b2, a2-b2 */
        float32x2_t lo = vget_low_f32(v[j]), hi = vget_high_f32(v[j]);
        v[j] = vcombine_f32(vadd_f32(lo, hi), vsub_f32(lo, hi));
    }
    for (int64_t h = 1; h < n; h *= 2)
        for (int64_t j = 0; j < n; j++)
            if (!(j & h)) {
                float32x4_t a = v[j], b = v[j + h];
                v[j] = vaddq_f32(a, b);
                v[j + h] = vsubq_f32(a, b);
            }
    const float32x4_t s = vdupq_n_f32((float)(1.0 / sqrt((double)D)));
    for (int64_t j = 0; j < n; j++) vst1q_f32(x + j * 4, vmulq_f32(v[j], s));
}

static inline int rotates_kv(int64_t D) { return D >= 16 && (D & (D - 1)) == 0; }

/* bf16 row -> fp32, rotated (hadamard_rows). */
static inline void hadamard_bf16(const uint16_t *x, int64_t D, float *out) {
    widen_head(x, D, out);
    hadamard_rows(out, D);
}

int rtp_rope_store_kv_neon(const uint16_t *qkv, int64_t ldq, const int32_t *positions, const float *cos_sin,
                           int64_t rot, uint16_t *q_out, void *k_cache, void *v_cache, int64_t tok_stride,
                           const int64_t *slots, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t num_slots,
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
                for (int64_t h = 0; h < H; h++) { /* q times the matrix too, so the scores stay q.k */
                    uint16_t *qh = q_out + (t * H + h) * D;
                    hadamard_bf16(qh, D, spread);
                    for (int64_t c = 0; c < D; c += 8)
                        neon_store_bf16x8(qh + c, vld1q_f32(spread + c), vld1q_f32(spread + c + 4));
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
