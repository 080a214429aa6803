/* RMSNorm kernels: the residual add + RMSNorm every layer runs twice, RMSNorm of any rows (Gemma's
 * post-attention and post-feedforward norms, taken over a block's bf16 output: rtp_add_rms_norm takes
 * the fp32 residual stream only), and the q/k norm of every head inside the fused qkv output, in place
 * (Gemma 3, Qwen3: before RoPE, so rtp_rope_store_kv then runs unchanged).
 *
 * fp32 inside, each value rounded once to its output dtype (bf16 round-to-nearest-even, as torch
 * rounds). rms_norm and qk_rms_norm take any width: a row's last partial vector is masked. Rows are
 * independent, so a call recorded over R rows replays over fewer (its rows word, kernel_calls.c).
 */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "cpu_kernels.h"
#include "vec_math.h"

#define TARGET RTP_VEC_TARGET

/* ---------------------------------------------------------------------------------------------
 * Residual add + RMSNorm, one pass over each row (the two ops every layer runs twice):
 *   residual[t] += delta[t]              (delta NULL: skip; fp32 or bf16)
 *   out[t] = residual[t] * rsqrt(mean(residual[t]^2) + eps) * weight      (fp32 or bf16 out)
 * residual fp32 [T, H] row stride ldr; weight fp32 or bf16 [H]; H a multiple of 16.
 * ------------------------------------------------------------------------------------------- */
TARGET void rtp_add_rms_norm(float *residual, int64_t ldr, const void *delta, int delta_bf16, int64_t ldd,
                             const void *weight, int weight_bf16, float eps, void *out, int out_bf16,
                             int64_t ldo, int64_t T, int64_t H) {
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++) {
        float *r = residual + t * ldr;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t c = 0; c < H; c += 16) {
            __m512 v = _mm512_loadu_ps(r + c);
            if (delta) {
                __m512 dv = delta_bf16 ? bf16x16_to_f32((const uint16_t *)delta + t * ldd + c)
                                       : _mm512_loadu_ps((const float *)delta + t * ldd + c);
                v = _mm512_add_ps(v, dv);
                _mm512_storeu_ps(r + c, v);
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)H + eps);
        __m512 iv = _mm512_set1_ps(inv);
        for (int64_t c = 0; c < H; c += 16) {
            __m512 w = weight_bf16 ? bf16x16_to_f32((const uint16_t *)weight + c) : _mm512_loadu_ps((const float *)weight + c);
            __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(r + c), iv), w);
            if (out_bf16)
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + t * ldo + c), (__m256i)_mm512_cvtneps_pbh(y));
            else
                _mm512_storeu_ps((float *)out + t * ldo + c, y);
        }
    }
}

/* dst = src * rsqrt(mean(src^2) + eps) * weight over n values, as rtp's RMSNorm (and
 * rtp_add_rms_norm) computes it; dst may be src (every value is read before it is written). */
TARGET static inline void rms_norm_row(const void *src, int src_bf16, const void *weight, int weight_bf16,
                                       float eps, void *dst, int dst_bf16, int64_t n) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t c = 0; c < n; c += 16) {
        __m512 v = load16(src, src_bf16, c, lanes(n - c));
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)n + eps));
    for (int64_t c = 0; c < n; c += 16) {
        __mmask16 k = lanes(n - c);
        __m512 y = _mm512_mul_ps(_mm512_mul_ps(load16(src, src_bf16, c, k), inv), load16(weight, weight_bf16, c, k));
        store16(dst, dst_bf16, c, k, y);
    }
}

/* out [T, H] (row stride ldo, bf16 or fp32) = rmsnorm(x [T, H] (row stride ldx, bf16 or fp32)) * weight
 * (fp32 or bf16 [H]). Strides count elements of each array's own dtype. */
TARGET void rtp_rms_norm(const void *x, int64_t ldx, int x_bf16, const void *weight, int weight_bf16, float eps,
                         void *out, int64_t ldo, int out_bf16, int64_t T, int64_t H) {
    const int64_t xsize = x_bf16 ? 2 : 4, osize = out_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++)
        rms_norm_row((const char *)x + t * ldx * xsize, x_bf16, weight, weight_bf16, eps,
                     (char *)out + t * ldo * osize, out_bf16, H);
}

/* In place over qkv bf16 [T, (H + 2 Hkv) D] (row stride ldq): each of the H q heads (D values each)
 * normed with q_weight, each of the Hkv k heads after them with k_weight (both fp32, or both bf16,
 * [D]); the v heads untouched. */
TARGET void rtp_qk_rms_norm(uint16_t *qkv, int64_t ldq, const void *q_weight, const void *k_weight, int weight_bf16,
                            float eps, int64_t T, int64_t H, int64_t Hkv, int64_t D) {
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H + Hkv; h++) {
            uint16_t *head = qkv + t * ldq + h * D;
            rms_norm_row(head, 1, h < H ? q_weight : k_weight, weight_bf16, eps, head, 1, D);
        }
}
#endif
