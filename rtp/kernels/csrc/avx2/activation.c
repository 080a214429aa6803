/* Activations of the avx2 path over rows of a [gate | up] or logits tensor: SiLU-and-mul, GELU(tanh)-
 * and-mul and final logit softcapping (their contracts: csrc/activation.c). fp32 inside, each value
 * rounded once to its output dtype; each value's result depends on its own inputs alone. */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include <omp.h>

#include "avx2.h"
#include "avx2_math.h"
#include "avx2_rows.h"
#include "cpu_kernels.h"

/* I a multiple of 16 (the other path's contract), so every vector here is whole. */
AVX2_TARGET void rtp_silu_mul_avx2(const uint16_t *x, int64_t ldx, uint16_t *out, int64_t ldo, int64_t T,
                                   int64_t I) {
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = x + t * ldx, *u = g + I;
        uint16_t *o = out + t * ldo;
        for (int64_t c = 0; c < I; c += 8)
            avx2_store_bf16x8(o + c, avx2_silu_mul(avx2_load_bf16x8(g + c), avx2_load_bf16x8(u + c)));
    }
}

AVX2_TARGET void rtp_gelu_tanh_mul_avx2(const uint16_t *x, int64_t ldx, uint16_t *out, int64_t ldo, int64_t T,
                                        int64_t I) {
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = x + t * ldx, *u = g + I;
        uint16_t *o = out + t * ldo;
        for (int64_t c = 0; c < I; c += 8)
            avx2_store8(o, 1, c, I - c, avx2_gelu_tanh_mul(avx2_load8(g, 1, c, I - c), avx2_load8(u, 1, c, I - c)));
    }
}

/* A row of logits is a whole vocabulary (262144 for Gemma 3), so its columns are shared out in
 * chunks as well as its rows. */
#define SOFTCAP_CHUNK 4096

AVX2_TARGET void rtp_softcap_avx2(float *x, int64_t ldx, float cap, int64_t T, int64_t N) {
    const int64_t per_row = (N + SOFTCAP_CHUNK - 1) / SOFTCAP_CHUNK;
    const __m256 c = _mm256_set1_ps(cap);
#pragma omp parallel for schedule(static) if (T * N >= 65536)
    for (int64_t task = 0; task < T * per_row; task++) {
        float *r = x + (task / per_row) * ldx;
        int64_t c0 = (task % per_row) * SOFTCAP_CHUNK, c1 = c0 + SOFTCAP_CHUNK < N ? c0 + SOFTCAP_CHUNK : N;
        for (int64_t j = c0; j < c1; j += 8) {
            /* the same order as torch's tanh(x / cap) * cap: a division, then a product */
            __m256 y = _mm256_mul_ps(avx2_tanh(_mm256_div_ps(avx2_load8(r, 0, j, c1 - j), c)), c);
            avx2_store8(r, 0, j, c1 - j, y);
        }
    }
}
#endif
