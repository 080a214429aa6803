/* Row-wise kernels beyond the Llama topology's, so that Gemma's steps run on rtp's kernels alone
 * and replay as CPU graphs (rtp/kernels/cpu_graph.py):
 *   rms_norm        RMSNorm of any rows, bf16 or fp32 in and out: Gemma's post-attention and
 *                   post-feedforward norms, taken over a block's bf16 output (rtp_add_rms_norm
 *                   takes the fp32 residual stream only);
 *   qk_rms_norm     the RMSNorm of every q and k head inside the fused qkv output, in place
 *                   (Gemma 3, Qwen3: before RoPE, so rtp_rope_store_kv then runs unchanged);
 *   gelu_tanh_mul   GELU(tanh)-and-mul, the GeGLU beside rtp_silu_mul (same [gate | up] layout);
 *   softcap         cap * tanh(x / cap) over fp32 logits, in place (final_logit_softcapping).
 *
 * fp32 inside, each value rounded once to its output dtype (bf16 round-to-nearest-even, as torch
 * rounds). Any width works: a row's last partial vector is masked. Rows are independent, so a
 * call recorded over R rows replays over fewer (its rows word, kernel_calls.c).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "cpu_kernels.h"
#include "vec_math.h"

#define TARGET RTP_VEC_TARGET

/* The lanes of a vector that lie within the `left` values still to go. */
TARGET static inline __mmask16 lanes(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

/* Values at..at+15 of a bf16 or fp32 array as fp32 (lanes outside k: 0, nothing read there). */
TARGET static inline __m512 load16(const void *p, int bf16, int64_t at, __mmask16 k) {
    if (bf16) {
        __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t *)p + at);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(k, (const float *)p + at);
}

TARGET static inline void store16(void *p, int bf16, int64_t at, __mmask16 k, __m512 v) {
    if (bf16) _mm256_mask_storeu_epi16((uint16_t *)p + at, k, (__m256i)_mm512_cvtneps_pbh(v));
    else _mm512_mask_storeu_ps((float *)p + at, k, v);
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

/* out bf16 [T, I] (row stride ldo) = gelu_tanh(x[:, :I]) * x[:, I:] for x bf16 [T, 2I] (row stride ldx). */
TARGET void rtp_gelu_tanh_mul(const uint16_t *x, int64_t ldx, uint16_t *out, int64_t ldo, int64_t T, int64_t I) {
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = x + t * ldx, *u = g + I;
        uint16_t *o = out + t * ldo;
        for (int64_t c = 0; c < I; c += 16) {
            __mmask16 k = lanes(I - c);
            store16(o, 1, c, k, gelu_tanh_mul_ps(load16(g, 1, c, k), load16(u, 1, c, k)));
        }
    }
}

/* x fp32 [T, N] (row stride ldx), in place: cap * tanh(x / cap), as torch's tanh(x / cap) * cap. One
 * row of logits is a whole vocabulary (262144 for Gemma 3): its columns are shared out in chunks. */
#define SOFTCAP_CHUNK 4096

TARGET void rtp_softcap(float *x, int64_t ldx, float cap, int64_t T, int64_t N) {
    const int64_t per_row = (N + SOFTCAP_CHUNK - 1) / SOFTCAP_CHUNK;
    const __m512 c = _mm512_set1_ps(cap);
#pragma omp parallel for schedule(static) if (T * N >= 65536)
    for (int64_t task = 0; task < T * per_row; task++) {
        float *r = x + (task / per_row) * ldx;
        int64_t c0 = (task % per_row) * SOFTCAP_CHUNK, c1 = c0 + SOFTCAP_CHUNK < N ? c0 + SOFTCAP_CHUNK : N;
        for (int64_t j = c0; j < c1; j += 16) {
            __mmask16 k = lanes(c1 - j);
            __m512 v = _mm512_maskz_loadu_ps(k, r + j);
            _mm512_mask_storeu_ps(r + j, k, _mm512_mul_ps(tanh_ps(_mm512_div_ps(v, c)), c));
        }
    }
}
