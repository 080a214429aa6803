#if defined(__aarch64__)
/* The NEON path's linear over dense bf16 weights (a safetensors checkpoint's layers, a GGUF's F16/BF16 ones):
 * x [M, K] (bf16, or fp32 rounded to bf16 as the other paths read it) times W [N, K], for every batch, K a
 * multiple of 32 (rtp_linear_bf16's contract: csrc/linear/bf16.c; the avx2 twin: csrc/avx2/linear.c).
 * Block-quantized weights take linear_int8.c.
 *
 * ARMv8.2-A has no bf16 product (BFDOT and BFMMLA are ARMv8.6), so the weights are widened to fp32 (exact:
 * a shift) and multiplied with FMA. The lanes run along K: output (i, j) keeps two 4-lane chains, lane l of
 * chain s summing x[i][8 t + 4 s + l] w[j][8 t + 4 s + l] for t in order, and the eight lanes are added in
 * one fixed order at the end (neon_hsum2). So a row's result does not depend on M, on the tile it lands in,
 * nor on the thread count.
 *
 * Tiles: NR weight rows meet MR rows of x (at most 16 accumulators of NEON's 32 registers, so they stay in
 * registers beside the loads); one or two rows (a decode step) take 4 weight rows at once, so eight chains
 * keep the FMA pipes busy. Past four rows each tile's weight rows are widened once into the thread's
 * scratch and read by every group of rows (the same values, so the same bits). x is widened once per call
 * and walked in chunks of ROW_CHUNK rows, whose fp32 rows stay in L2 while every weight row passes over
 * them. */
#include <omp.h>

#include "neon.h"
#include "scratch.h"

enum { W_BF16, W_F32 }; /* W_F32: weight rows a thread widened into its scratch */

/* Eight values of a weight row from k on, as fp32. */
static inline __attribute__((always_inline)) void weight8(int kind, const void *row, int64_t k, float32x4_t w[2]) {
    if (kind == W_F32) {
        w[0] = vld1q_f32((const float *)row + k);
        w[1] = vld1q_f32((const float *)row + k + 4);
    } else {
        neon_load_bf16x8((const uint16_t *)row + k, &w[0], &w[1]);
    }
}

/* out[i][j0 + j] for MR rows of x (fp32 rows of K) and weight rows j0 + j (j < nr <= NR; the rest repeat the
 * last), w rows ldw elements apart. Always inlined into the tile_* functions below with constant MR, NR and
 * kind, so its loops unroll and the accumulators are registers. */
static inline __attribute__((always_inline)) void tile(const int MR, const int NR, const int kind, const void *w,
                                                       int64_t ldw, int64_t K, const float *x, int64_t j0,
                                                       int64_t nr, const float *bias, void *out, int64_t ldo,
                                                       int out_bf16) {
    float32x4_t acc[4][4][2];
    const char *rows[4];
    const size_t esize = kind == W_F32 ? 4 : 2;
#pragma GCC unroll 4
    for (int j = 0; j < NR; j++) rows[j] = (const char *)w + (j0 + (j < nr ? j : nr - 1)) * ldw * esize;
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
        for (int j = 0; j < NR; j++) acc[i][j][0] = acc[i][j][1] = vdupq_n_f32(0.0f);
    for (int64_t k = 0; k < K; k += 8)
#pragma GCC unroll 4
        for (int j = 0; j < NR; j++) {
            float32x4_t wv[2];
            weight8(kind, rows[j], k, wv);
#pragma GCC unroll 4
            for (int i = 0; i < MR; i++)
#pragma GCC unroll 2
                for (int s = 0; s < 2; s++)
                    acc[i][j][s] = vfmaq_f32(acc[i][j][s], vld1q_f32(x + i * K + k + 4 * s), wv[s]);
        }
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
        for (int j = 0; j < NR; j++) {
            if (j >= nr) continue; /* constant bounds: acc stays in registers */
            float y = neon_hsum2(acc[i][j][0], acc[i][j][1]) + (bias ? bias[j0 + j] : 0.0f);
            if (out_bf16) ((uint16_t *)out)[i * ldo + j0 + j] = rtp_f32_to_bf16(y);
            else ((float *)out)[i * ldo + j0 + j] = y;
        }
}

typedef void (*tile_fn)(const void *, int64_t, int64_t, const float *, int64_t, int64_t, const float *, void *, int64_t,
                        int);

#define TILE(MR_, NR_, KIND_)                                                                                     \
    static void tile_##MR_##_##NR_##_##KIND_(const void *w, int64_t ldw, int64_t K, const float *x, int64_t j0,   \
                                             int64_t nr, const float *bias, void *out, int64_t ldo, int out_bf16) { \
        tile(MR_, NR_, KIND_, w, ldw, K, x, j0, nr, bias, out, ldo, out_bf16);                                    \
    }
#define TILES(KIND_) TILE(1, 4, KIND_) TILE(2, 4, KIND_) TILE(3, 2, KIND_) TILE(4, 2, KIND_)
TILES(W_BF16) TILES(W_F32)
#undef TILES
#undef TILE

/* [kind][rows - 1], and the weight rows each takes at a time */
static const int TILE_NR[4] = {4, 4, 2, 2};
static const tile_fn TILE_FOR[2][4] = {
    {tile_1_4_W_BF16, tile_2_4_W_BF16, tile_3_2_W_BF16, tile_4_2_W_BF16},
    {tile_1_4_W_F32, tile_2_4_W_F32, tile_3_2_W_F32, tile_4_2_W_F32},
};

#define ROW_CHUNK 64

/* Dense bf16 weights; x bf16, or fp32 rounded to bf16 as rtp_linear_bf16 reads it. */
void rtp_linear_bf16_neon(const void *x, int64_t ldx, int x_fp32, const uint16_t *w16, int64_t ldw,
                          const float *bias, void *out, int64_t ldo, int out_bf16, int64_t M, int64_t N, int64_t K) {
    static __thread rtp_scratch rows_scratch;
    float *xf = rtp_scratch_get(&rows_scratch, (size_t)(M * K) * sizeof(float));
    if (!xf) return; /* the op returns nothing, as its other variants */
    for (int64_t i = 0; i < M; i++)
        for (int64_t k = 0; k < K; k++) {
            float v = x_fp32 ? ((const float *)x)[i * ldx + k] : rtp_bf16_to_f32(((const uint16_t *)x)[i * ldx + k]);
            xf[i * K + k] = x_fp32 ? rtp_bf16_to_f32(rtp_f32_to_bf16(v)) : v;
        }
    size_t esize = out_bf16 ? 2 : 4;
    int64_t tiles = (N + 3) / 4;
    for (int64_t m0 = 0; m0 < M; m0 += ROW_CHUNK) {
        int64_t rows = M - m0 < ROW_CHUNK ? M - m0 : ROW_CHUNK;
        const float *xc = xf + m0 * K;
        char *oc = (char *)out + m0 * ldo * esize;
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            int64_t j0 = 4 * t, nr = N - j0 < 4 ? N - j0 : 4;
            /* several groups of rows: the tile's weight rows widened once, read by every group */
            const void *w = w16;
            int64_t ld = ldw, at = j0;
            int kind = W_BF16;
            if (rows > 4) {
                static __thread rtp_scratch panel_scratch;
                float *f = rtp_scratch_get(&panel_scratch, (size_t)(4 * K) * sizeof(float));
                if (f) {
                    for (int64_t j = 0; j < nr; j++)
                        for (int64_t k = 0; k < K; k += 8) {
                            float32x4_t lo, hi;
                            neon_load_bf16x8(w16 + (j0 + j) * ldw + k, &lo, &hi);
                            vst1q_f32(f + j * K + k, lo);
                            vst1q_f32(f + j * K + k + 4, hi);
                        }
                    w = f, ld = K, at = 0, kind = W_F32;
                }
            }
            /* the tiles index weight rows, bias and output columns alike from `at` (the panel's rows from 0) */
            const float *b = bias ? bias + (j0 - at) : NULL;
            char *o = oc + (j0 - at) * esize;
            for (int64_t i = 0; i < rows; i += 4) {
                int r = rows - i < 4 ? (int)(rows - i) : 4, step = TILE_NR[r - 1];
                for (int64_t j = 0; j < nr; j += step)
                    TILE_FOR[kind][r - 1](w, ld, K, xc + i * K, at + j, nr - j < step ? nr - j : step, b,
                                          o + i * ldo * esize, ldo, out_bf16);
            }
        }
    }
}
#endif
