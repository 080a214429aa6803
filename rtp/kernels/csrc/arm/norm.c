#if defined(__aarch64__)
/* RMSNorm kernels of the NEON path: the residual add + RMSNorm, RMSNorm of any rows and the in-place q/k
 * norm per head (their contracts: csrc/norm.c; the avx2 twins: csrc/avx2/norm.c). fp32 inside, each value
 * rounded once to its output dtype. A row's sum of squares runs in one fixed order (two 4-lane chains over
 * eight values a step, a partial tail into the first, then neon_hsum2), so its bits depend on the row
 * alone, never on the other rows or the thread count. */
#include <math.h>
#include <omp.h>

#include "neon.h"
#include "neon_rows.h"

/* The bf16 or fp32 value vector at c of a row. */
static inline float32x4_t load_any(const void *p, int bf16, int64_t c) {
    return bf16 ? neon_load_bf16x4((const uint16_t *)p + c) : vld1q_f32((const float *)p + c);
}

/* H a multiple of 16 (the other paths' contract), so every vector here is whole. */
void rtp_add_rms_norm_neon(float *residual, int64_t ldr, const void *delta, int delta_bf16, int64_t ldd,
                           const void *weight, int weight_bf16, float eps, void *out, int out_bf16, int64_t ldo,
                           int64_t T, int64_t H) {
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++) {
        float *r = residual + t * ldr;
        const void *dr = delta ? (const char *)delta + t * ldd * (delta_bf16 ? 2 : 4) : NULL;
        float32x4_t ss[2] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
        for (int64_t c = 0; c < H; c += 8)
            for (int s = 0; s < 2; s++) {
                float32x4_t v = vld1q_f32(r + c + 4 * s);
                if (dr) { /* the residual add is exact fp32, as torch's */
                    v = vaddq_f32(v, load_any(dr, delta_bf16, c + 4 * s));
                    vst1q_f32(r + c + 4 * s, v);
                }
                ss[s] = vfmaq_f32(ss[s], v, v);
            }
        float32x4_t inv = vdupq_n_f32(1.0f / sqrtf(neon_hsum2(ss[0], ss[1]) / (float)H + eps));
        void *o = (char *)out + t * ldo * (out_bf16 ? 2 : 4);
        for (int64_t c = 0; c < H; c += 4) {
            float32x4_t y = vmulq_f32(vmulq_f32(vld1q_f32(r + c), inv), load_any(weight, weight_bf16, c));
            neon_store4(o, out_bf16, c, 4, y);
        }
    }
}

/* dst = src * rsqrt(mean(src^2) + eps) * weight over n values (any n); dst may be src, since the second
 * pass reads each vector before it writes it. */
static inline void rms_norm_row(const void *src, int src_bf16, const void *weight, int weight_bf16, float eps,
                                void *dst, int dst_bf16, int64_t n) {
    float32x4_t ss[2] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
    int64_t c = 0;
    for (; c + 8 <= n; c += 8)
        for (int s = 0; s < 2; s++) {
            float32x4_t v = load_any(src, src_bf16, c + 4 * s);
            ss[s] = vfmaq_f32(ss[s], v, v);
        }
    for (; c < n; c += 4) { /* the tail: zeros past n add nothing */
        float32x4_t v = neon_load4(src, src_bf16, c, n - c);
        ss[0] = vfmaq_f32(ss[0], v, v);
    }
    float32x4_t inv = vdupq_n_f32(1.0f / sqrtf(neon_hsum2(ss[0], ss[1]) / (float)n + eps));
    for (c = 0; c < n; c += 4) {
        float32x4_t y = vmulq_f32(vmulq_f32(neon_load4(src, src_bf16, c, n - c), inv),
                                  neon_load4(weight, weight_bf16, c, n - c));
        neon_store4(dst, dst_bf16, c, n - c, y);
    }
}

void rtp_rms_norm_neon(const void *x, int64_t ldx, int x_bf16, const void *weight, int weight_bf16, float eps,
                       void *out, int64_t ldo, int out_bf16, int64_t T, int64_t H) {
    const int64_t xsize = x_bf16 ? 2 : 4, osize = out_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++)
        rms_norm_row((const char *)x + t * ldx * xsize, x_bf16, weight, weight_bf16, eps,
                     (char *)out + t * ldo * osize, out_bf16, H);
}

void rtp_qk_rms_norm_neon(uint16_t *qkv, int64_t ldq, const void *q_weight, const void *k_weight, int weight_bf16,
                          float eps, int64_t T, int64_t H, int64_t Hkv, int64_t D) {
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H + Hkv; h++) {
            uint16_t *head = qkv + t * ldq + h * D;
            rms_norm_row(head, 1, h < H ? q_weight : k_weight, weight_bf16, eps, head, 1, D);
        }
}
#endif
