/* Activations, each over rows of a [gate | up] or logits tensor:
 *   silu_mul        out bf16 [T, I] = silu(x[:, :I]) * x[:, I:], x bf16 [T, 2I] (row stride ldx);
 *                   in fp32, rounded once; I a multiple of 16 (the MLP's SiLU-and-mul)
 *   gelu_tanh_mul   GELU(tanh)-and-mul, the GeGLU beside rtp_silu_mul (same [gate | up] layout);
 *   softcap         cap * tanh(x / cap) over fp32 logits, in place (final_logit_softcapping).
 *
 * fp32 inside, each value rounded once to its output dtype (bf16 round-to-nearest-even, as torch
 * rounds). gelu_tanh_mul and softcap take any width: a row's last partial vector is masked. Rows are
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

TARGET void rtp_silu_mul(const uint16_t *x, int64_t ldx, uint16_t *out, int64_t ldo, int64_t T, int64_t I) {
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = x + t * ldx, *u = g + I;
        uint16_t *o = out + t * ldo;
        for (int64_t c = 0; c < I; c += 16) {
            __m512 y = silu_mul_ps(bf16x16_to_f32(g + c), bf16x16_to_f32(u + c));
            _mm256_storeu_si256((__m256i *)(o + c), (__m256i)_mm512_cvtneps_pbh(y));
        }
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
#endif
