/* The linears of the avx2 path: x [M, K] times a weight [N, K] kept as the checkpoint stored it (Q4_1,
 * the int8 kinds, dense bf16), for every batch: decode rows, prompt chunks and mixed steps alike.
 *
 * Each weight is dequantized to its exact fp32 value as it is read (q d + m, one rounding: the fp32 weight
 * the avx512bf16 one-row kernels multiply), 8 at a time, and multiplied into fp32 accumulators with FMA.
 * The lanes run along K: output (i, j) keeps one 8-lane chain, lane l summing x[i][8 t + l] w[j][8 t + l]
 * for t in order, and the chain's lanes are added in one fixed order at the end (avx2_hsum). So a row's
 * result does not depend on M, on which tile it lands in, nor on the thread count: the determinism the
 * engine promises holds on this path by construction, for every batch size.
 *
 * Tiles: NR_ weight rows meet MR_ rows of x, the NR_ dequantized vectors shared by the MR_ rows and each x
 * vector by the NR_ weight rows; one row (a lone stream's decode) takes 4 weight rows at once, so that four
 * chains keep the FMA units busy while the next weights are unpacked. x is widened to fp32 once per call
 * (scratch kept by each thread) and walked in chunks of ROW_CHUNK rows, whose fp32 rows stay in L2 while
 * every weight row passes over them. */
#include "avx2.h"
#include "cpu_kernels.h"
#include "scratch.h"

#include <omp.h>

enum { W_Q4_1, W_INT8, W_BF16 };

/* The weights of one call: the layout of each kind (quant.py's BlockQuantized). */
typedef struct {
    int kind;
    const uint8_t *q4;   /* W_Q4_1: [N, K / 2], byte t of a block: weight t (low nibble), weight t + 16 (high) */
    const int8_t *q8;    /* W_INT8: [N, K] */
    const uint16_t *w16; /* W_BF16: [N, ldw] */
    const float *d;      /* a scale per `group` weights: [N, K / group] (Q4_1: group 32) */
    const float *m;      /* an offset per 32 weights [N, K / 32], or NULL */
    int64_t ldw, group, K;
} weights;

/* Weights [8 s, 8 s + 8) of block b of weight row j, as fp32. */
AVX2_TARGET static inline __attribute__((always_inline)) __m256 weight8(const weights *w, int64_t j, int64_t b,
                                                                         int s) {
    int64_t k = 32 * b + 8 * s;
    if (w->kind == W_BF16) return avx2_load_bf16x8(w->w16 + j * w->ldw + k);
    __m256 q;
    if (w->kind == W_Q4_1) {
        uint64_t bytes;
        memcpy(&bytes, w->q4 + j * (w->K / 2) + 16 * b + 8 * (s & 1), 8);
        if (s >= 2) bytes >>= 4;
        bytes &= 0x0f0f0f0f0f0f0f0full;
        q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)bytes)));
    } else {
        int64_t bytes;
        memcpy(&bytes, w->q8 + j * w->K + k, 8);
        q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(bytes)));
    }
    __m256 d = _mm256_broadcast_ss(w->d + j * (w->K / w->group) + k / w->group);
    if (!w->m) return _mm256_mul_ps(q, d);
    return _mm256_fmadd_ps(q, d, _mm256_broadcast_ss(w->m + j * (w->K / 32) + b));
}

/* out[i][j] for MR_ rows from x (fp32 rows of K at x + i K) and NR_ weight rows from j0; nr of them real
 * (the rest repeat the last and are not stored). */
#define TILE(MR_, NR_)                                                                                               \
    AVX2_TARGET static void tile_##MR_##_##NR_(const weights *w, const float *x, int64_t j0, int64_t nr,            \
                                                const float *bias, void *out, int64_t ldo, int out_bf16) {         \
        __m256 acc[MR_][NR_];                                                                                    \
        int64_t rows[NR_];                                                                                        \
        for (int j = 0; j < NR_; j++) rows[j] = j0 + (j < nr ? j : nr - 1);                                       \
        for (int i = 0; i < MR_; i++)                                                                             \
            for (int j = 0; j < NR_; j++) acc[i][j] = _mm256_setzero_ps();                                        \
        for (int64_t b = 0; b < w->K / 32; b++)                                                                   \
            for (int s = 0; s < 4; s++) {                                                                         \
                __m256 wv[NR_];                                                                                   \
                for (int j = 0; j < NR_; j++) wv[j] = weight8(w, rows[j], b, s);                                  \
                for (int i = 0; i < MR_; i++) {                                                                   \
                    __m256 xv = _mm256_loadu_ps(x + i * w->K + 32 * b + 8 * s);                                   \
                    for (int j = 0; j < NR_; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);              \
                }                                                                                                 \
            }                                                                                                     \
        for (int i = 0; i < MR_; i++)                                                                             \
            for (int j = 0; j < nr; j++) {                                                                        \
                float y = avx2_hsum(acc[i][j]) + (bias ? bias[j0 + j] : 0.0f);                                    \
                if (out_bf16) ((uint16_t *)out)[i * ldo + j0 + j] = avx2_f32_to_bf16(y);                          \
                else ((float *)out)[i * ldo + j0 + j] = y;                                                        \
            }                                                                                                     \
    }
TILE(1, 4) TILE(2, 4) TILE(3, 2) TILE(4, 2)
#undef TILE

#define ROW_CHUNK 64

/* x rows as fp32 (bf16 widened exactly; fp32 as it is, or rounded to bf16 first where the other path's
 * kernel multiplies bf16 x), then every tile. Returns 0 when the scratch could not be had. */
AVX2_TARGET static int linear(const weights *w, const void *x, int64_t ldx, int x_fp32, int round_x,
                              const float *bias, void *out, int64_t ldo, int out_bf16, int64_t M, int64_t N) {
    static __thread rtp_scratch rows_scratch;
    int64_t K = w->K;
    float *xf = rtp_scratch_get(&rows_scratch, (size_t)(M * K) * sizeof(float));
    if (!xf) return 0;
    for (int64_t i = 0; i < M; i++)
        for (int64_t k = 0; k < K; k++) {
            float v = x_fp32 ? ((const float *)x)[i * ldx + k] : avx2_bf16_to_f32(((const uint16_t *)x)[i * ldx + k]);
            xf[i * K + k] = x_fp32 && round_x ? avx2_bf16_to_f32(avx2_f32_to_bf16(v)) : v;
        }
    size_t esize = out_bf16 ? 2 : 4;
    for (int64_t m0 = 0; m0 < M; m0 += ROW_CHUNK) {
        int64_t rows = M - m0 < ROW_CHUNK ? M - m0 : ROW_CHUNK;
        const float *xc = xf + m0 * K;
        char *oc = (char *)out + m0 * ldo * esize;
        if (rows == 1 || rows == 2) { /* a decode step's few rows: four weight rows a tile */
            int64_t tiles = (N + 3) / 4;
#pragma omp parallel for schedule(static)
            for (int64_t t = 0; t < tiles; t++) {
                int64_t nr = N - 4 * t < 4 ? N - 4 * t : 4;
                if (rows == 1) tile_1_4(w, xc, 4 * t, nr, bias, oc, ldo, out_bf16);
                else tile_2_4(w, xc, 4 * t, nr, bias, oc, ldo, out_bf16);
            }
            continue;
        }
        int64_t tiles = (N + 1) / 2;
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            int64_t nr = N - 2 * t < 2 ? N - 2 * t : 2, i = 0;
            for (; i + 4 <= rows; i += 4)
                tile_4_2(w, xc + i * K, 2 * t, nr, bias, oc + i * ldo * esize, ldo, out_bf16);
            if (rows - i == 3) tile_3_2(w, xc + i * K, 2 * t, nr, bias, oc + i * ldo * esize, ldo, out_bf16);
            else if (rows - i == 2) {
                tile_2_4(w, xc + i * K, 2 * t, nr, bias, oc + i * ldo * esize, ldo, out_bf16);
            } else if (rows - i == 1) {
                tile_1_4(w, xc + i * K, 2 * t, nr, bias, oc + i * ldo * esize, ldo, out_bf16);
            }
        }
    }
    return 1;
}

AVX2_TARGET int rtp_linear_q4_1_avx2(const uint16_t *x, int64_t ldx, const uint8_t *qs, const float *d,
                                     const float *m, const float *bias, void *out, int64_t ldo, int out_bf16,
                                     int64_t rows, int64_t n, int64_t k) {
    weights w = {.kind = W_Q4_1, .q4 = qs, .d = d, .m = m, .group = 32, .K = k};
    return linear(&w, x, ldx, 0, 0, bias, out, ldo, out_bf16, rows, n);
}

/* x fp32, multiplied unrounded (the LM head's input), as rtp_linear_q8 does. */
AVX2_TARGET void rtp_linear_q8_avx2(const float *x, int64_t ldx, const int8_t *qs, const float *d, const float *mn,
                                    int group, const float *bias, void *out, int64_t ldo, int out_bf16, int64_t rows,
                                    int64_t n, int64_t k) {
    weights w = {.kind = W_INT8, .q8 = qs, .d = d, .m = mn, .group = group, .K = k};
    linear(&w, x, ldx, 1, 0, bias, out, ldo, out_bf16, rows, n); /* the op returns nothing: as its other variant */
}

/* The same int8 weights with x bf16 (or fp32 rounded to bf16 as rtp_linear_u8 reads it); `offset` is that
 * kernel's encoding of q in bf16, not part of the weights' value, so nothing here needs it. */
AVX2_TARGET int rtp_linear_u8_avx2(const void *x, int64_t ldx, int x_fp32, const int8_t *qs, const float *d,
                                   const float *mn, int group, int offset, const float *bias, void *out, int64_t ldo,
                                   int out_bf16, int64_t rows, int64_t n, int64_t k) {
    (void)offset;
    weights w = {.kind = W_INT8, .q8 = qs, .d = d, .m = mn, .group = group, .K = k};
    return linear(&w, x, ldx, x_fp32, 1, bias, out, ldo, out_bf16, rows, n);
}

/* Dense bf16 weights; x bf16, or fp32 rounded to bf16 as rtp_linear_bf16 reads it. */
AVX2_TARGET void rtp_linear_bf16_avx2(const void *x, int64_t ldx, int x_fp32, const uint16_t *w16, int64_t ldw,
                                      const float *bias, void *out, int64_t ldo, int out_bf16, int64_t rows, int64_t n,
                                      int64_t k) {
    weights w = {.kind = W_BF16, .w16 = w16, .ldw = ldw, .group = 32, .K = k};
    linear(&w, x, ldx, x_fp32, 1, bias, out, ldo, out_bf16, rows, n);
}
