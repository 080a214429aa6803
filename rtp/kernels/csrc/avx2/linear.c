/* The avx2 path's linear over dense bf16 weights (a safetensors checkpoint's layers, a GGUF's F16/BF16 ones):
 * x [M, K] (bf16, or fp32 rounded to bf16 as the other path reads it) times W [N, K], for every batch.
 * Block-quantized weights take linear_int8.c.
 *
 * The weights are widened to fp32 (exact) and multiplied with FMA. The lanes run along K: output (i, j) keeps
 * one 8-lane chain, lane l summing x[i][8 t + l] w[j][8 t + l] for t in order, and the lanes are added in
 * one fixed order at the end (avx2_hsum). So a row's result does not depend on M, on the tile it lands in,
 * nor on the thread count.
 *
 * Tiles: NR_ weight rows meet MR_ rows of x (at most 8 accumulators, which stay in registers); one or two
 * rows (a decode step) take 4 weight rows at once, so four chains keep the FMA units busy. Past four rows each
 * tile's weight rows are widened once into the thread's scratch and read by every group of rows (the same
 * values, so the same bits). x is widened once per call and walked in chunks of ROW_CHUNK rows, whose fp32
 * rows stay in L2 while every weight row passes over them. */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include "avx2.h"
#include "cpu_kernels.h"
#include "scratch.h"

#include <omp.h>

enum { W_BF16, W_F32 }; /* W_F32: weight rows a thread widened into its scratch */

/* Weight row j's block b (values [32 b, 32 b + 32)) as four fp32 vectors. */
AVX2_TARGET static inline __attribute__((always_inline)) void weight_block(int kind, const void *row, int64_t b,
                                                                           __m256 w[4]) {
    for (int s = 0; s < 4; s++)
        w[s] = kind == W_F32 ? _mm256_loadu_ps((const float *)row + 32 * b + 8 * s)
                             : avx2_load_bf16x8((const uint16_t *)row + 32 * b + 8 * s);
}

/* out[i][j0 + j] for MR_ rows of x (fp32 rows of K) and weight rows j0 + j (j < nr <= NR_; the rest repeat
 * the last), w rows ldw elements apart. */
#define TILE(MR_, NR_, KIND_)                                                                                      \
    AVX2_TARGET static void tile_##MR_##_##NR_##_##KIND_(const void *w, int64_t ldw, int64_t K, const float *x,    \
                                                         int64_t j0, int64_t nr, const float *bias, void *out,     \
                                                         int64_t ldo, int out_bf16) {                              \
        __m256 acc[MR_][NR_];                                                                                    \
        const char *rows[NR_];                                                                                    \
        size_t esize = KIND_ == W_F32 ? 4 : 2;                                                                    \
        _Pragma("GCC unroll 16") for (int j = 0; j < NR_; j++)                                                    \
            rows[j] = (const char *)w + (j0 + (j < nr ? j : nr - 1)) * ldw * esize;                                \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR_; i++)                                                    \
            _Pragma("GCC unroll 16") for (int j = 0; j < NR_; j++) acc[i][j] = _mm256_setzero_ps();               \
        for (int64_t b = 0; b < K / 32; b++)                                                                      \
            _Pragma("GCC unroll 16") for (int j = 0; j < NR_; j++) {                                              \
                __m256 wv[4];                                                                                     \
                weight_block(KIND_, rows[j], b, wv);                                                              \
                _Pragma("GCC unroll 16") for (int i = 0; i < MR_; i++)                                            \
                    _Pragma("GCC unroll 4") for (int s = 0; s < 4; s++)                                           \
                        acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * K + 32 * b + 8 * s), wv[s], acc[i][j]); \
            }                                                                                                     \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR_; i++)                                                    \
            _Pragma("GCC unroll 16") for (int j = 0; j < NR_; j++) {                                              \
                if (j >= nr) continue; /* constant bounds: acc stays in registers */                              \
                float y = avx2_hsum(acc[i][j]) + (bias ? bias[j0 + j] : 0.0f);                                    \
                if (out_bf16) ((uint16_t *)out)[i * ldo + j0 + j] = rtp_f32_to_bf16(y);                          \
                else ((float *)out)[i * ldo + j0 + j] = y;                                                        \
            }                                                                                                     \
    }
#define TILES(KIND_) TILE(1, 4, KIND_) TILE(2, 4, KIND_) TILE(3, 2, KIND_) TILE(4, 2, KIND_)
TILES(W_BF16) TILES(W_F32)
#undef TILES
#undef TILE

typedef void (*tile_fn)(const void *, int64_t, int64_t, const float *, int64_t, int64_t, const float *, void *, int64_t,
                        int);
/* [kind][rows - 1], and the weight rows each takes at a time */
static const int TILE_NR[4] = {4, 4, 2, 2};
static const tile_fn TILE_FOR[2][4] = {
    {tile_1_4_W_BF16, tile_2_4_W_BF16, tile_3_2_W_BF16, tile_4_2_W_BF16},
    {tile_1_4_W_F32, tile_2_4_W_F32, tile_3_2_W_F32, tile_4_2_W_F32},
};

#define ROW_CHUNK 64

/* Dense bf16 weights; x bf16, or fp32 rounded to bf16 as rtp_linear_bf16 reads it. */
AVX2_TARGET void rtp_linear_bf16_avx2(const void *x, int64_t ldx, int x_fp32, const uint16_t *w16, int64_t ldw,
                                      const float *bias, void *out, int64_t ldo, int out_bf16, int64_t M, int64_t N,
                                      int64_t K) {
    static __thread rtp_scratch rows_scratch;
    float *xf = rtp_scratch_get(&rows_scratch, (size_t)(M * K) * sizeof(float));
    if (!xf) return; /* the op returns nothing, as its other variant */
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
                        for (int64_t k = 0; k < K; k += 8)
                            _mm256_storeu_ps(f + j * K + k, avx2_load_bf16x8(w16 + (j0 + j) * ldw + k));
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
