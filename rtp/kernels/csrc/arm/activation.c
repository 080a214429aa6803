#if defined(__aarch64__)
/* Activations of the NEON path over rows of a [gate | up] or logits tensor: SiLU-and-mul, GELU(tanh)-and-
 * mul and final logit softcapping (their contracts: csrc/activation.c; the avx2 twins:
 * csrc/avx2/activation.c). fp32 inside, each value rounded once to its output dtype; each value's result
 * depends on its own inputs alone. */
#include <omp.h>

#include "neon.h"
#include "neon_math.h"
#include "neon_rows.h"

/* I a multiple of 16 (the other paths' contract), so every vector here is whole: eight values a step,
 * one 128-bit load of bf16 each for gate and up. */
void rtp_silu_mul_neon(const uint16_t *x, int64_t ldx, uint16_t *out, int64_t ldo, int64_t T, int64_t I) {
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = x + t * ldx, *u = g + I;
        uint16_t *o = out + t * ldo;
        for (int64_t c = 0; c < I; c += 8) {
            float32x4_t g0, g1, u0, u1;
            neon_load_bf16x8(g + c, &g0, &g1);
            neon_load_bf16x8(u + c, &u0, &u1);
            neon_store_bf16x8(o + c, neon_silu_mul(g0, u0), neon_silu_mul(g1, u1));
        }
    }
}

/* Any I: whole vectors of four, then the row's partial last one. */
void rtp_gelu_tanh_mul_neon(const uint16_t *x, int64_t ldx, uint16_t *out, int64_t ldo, int64_t T, int64_t I) {
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = x + t * ldx, *u = g + I;
        uint16_t *o = out + t * ldo;
        for (int64_t c = 0; c < I; c += 4)
            neon_store4(o, 1, c, I - c, neon_gelu_tanh_mul(neon_load4(g, 1, c, I - c), neon_load4(u, 1, c, I - c)));
    }
}

/* A row of logits is a whole vocabulary (262144 for Gemma 3), so its columns are shared out in chunks as
 * well as its rows. */
#define SOFTCAP_CHUNK 4096

void rtp_softcap_neon(float *x, int64_t ldx, float cap, int64_t T, int64_t N) {
    const int64_t per_row = (N + SOFTCAP_CHUNK - 1) / SOFTCAP_CHUNK;
    const float32x4_t c = vdupq_n_f32(cap);
#pragma omp parallel for schedule(static) if (T * N >= 65536)
    for (int64_t task = 0; task < T * per_row; task++) {
        float *r = x + (task / per_row) * ldx;
        int64_t c0 = (task % per_row) * SOFTCAP_CHUNK, c1 = c0 + SOFTCAP_CHUNK < N ? c0 + SOFTCAP_CHUNK : N;
        for (int64_t j = c0; j < c1; j += 4) {
            /* the same order as torch's tanh(x / cap) * cap: a division, then a product */
            float32x4_t y = vmulq_f32(neon_tanh(vdivq_f32(neon_load4(r, 0, j, c1 - j), c)), c);
            neon_store4(r, 0, j, c1 - j, y);
        }
    }
}
#endif
