/* RMSNorm kernels of the avx2 path: the residual add + RMSNorm, RMSNorm of any rows and the in-place
 * q/k norm per head (their contracts: csrc/norm.c). fp32 inside, each value rounded once to its output
 * dtype. A row's sum of squares runs in one fixed order (eight lanes, then avx2_hsum), so its bits
 * depend on the row alone, never on the other rows or the thread count. */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include <math.h>
#include <omp.h>

#include "avx2.h"
#include "avx2_rows.h"
#include "cpu_kernels.h"

/* H a multiple of 16 (the other path's contract), so every vector here is whole. */
AVX2_TARGET void rtp_add_rms_norm_avx2(float *residual, int64_t ldr, const void *delta, int delta_bf16, int64_t ldd,
                                       const void *weight, int weight_bf16, float eps, void *out, int out_bf16,
                                       int64_t ldo, int64_t T, int64_t H) {
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++) {
        float *r = residual + t * ldr;
        __m256 ss = _mm256_setzero_ps();
        for (int64_t c = 0; c < H; c += 8) {
            __m256 v = _mm256_loadu_ps(r + c);
            if (delta) {
                __m256 dv = delta_bf16 ? avx2_load_bf16x8((const uint16_t *)delta + t * ldd + c)
                                       : _mm256_loadu_ps((const float *)delta + t * ldd + c);
                v = _mm256_add_ps(v, dv);
                _mm256_storeu_ps(r + c, v);
            }
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        __m256 inv = _mm256_set1_ps(1.0f / sqrtf(avx2_hsum(ss) / (float)H + eps));
        for (int64_t c = 0; c < H; c += 8) {
            __m256 y = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(r + c), inv), avx2_load8(weight, weight_bf16, c, 8));
            avx2_store8((char *)out + t * ldo * (out_bf16 ? 2 : 4), out_bf16, c, 8, y);
        }
    }
}

/* dst = src * rsqrt(mean(src^2) + eps) * weight over n values (any n); dst may be src, since the
 * second pass reads each vector before it writes it. */
AVX2_TARGET static inline void rms_norm_row(const void *src, int src_bf16, const void *weight, int weight_bf16,
                                            float eps, void *dst, int dst_bf16, int64_t n) {
    __m256 ss = _mm256_setzero_ps();
    for (int64_t c = 0; c < n; c += 8) {
        __m256 v = avx2_load8(src, src_bf16, c, n - c);
        ss = _mm256_fmadd_ps(v, v, ss);
    }
    __m256 inv = _mm256_set1_ps(1.0f / sqrtf(avx2_hsum(ss) / (float)n + eps));
    for (int64_t c = 0; c < n; c += 8) {
        __m256 y = _mm256_mul_ps(_mm256_mul_ps(avx2_load8(src, src_bf16, c, n - c), inv),
                                 avx2_load8(weight, weight_bf16, c, n - c));
        avx2_store8(dst, dst_bf16, c, n - c, y);
    }
}

AVX2_TARGET void rtp_rms_norm_avx2(const void *x, int64_t ldx, int x_bf16, const void *weight, int weight_bf16,
                                   float eps, void *out, int64_t ldo, int out_bf16, int64_t T, int64_t H) {
    const int64_t xsize = x_bf16 ? 2 : 4, osize = out_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++)
        rms_norm_row((const char *)x + t * ldx * xsize, x_bf16, weight, weight_bf16, eps,
                     (char *)out + t * ldo * osize, out_bf16, H);
}

AVX2_TARGET void rtp_qk_rms_norm_avx2(uint16_t *qkv, int64_t ldq, const void *q_weight, const void *k_weight,
                                      int weight_bf16, float eps, int64_t T, int64_t H, int64_t Hkv, int64_t D) {
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H + Hkv; h++) {
            uint16_t *head = qkv + t * ldq + h * D;
            rms_norm_row(head, 1, h < H ? q_weight : k_weight, weight_bf16, eps, head, 1, D);
        }
}
#endif
