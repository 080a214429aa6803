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

/* W_F32: weight rows a thread dequantized into its scratch once, for every group of rows of a chunk */
enum { W_Q4_1, W_INT8, W_BF16, W_F32 };

/* The weights of one call: the layout of each kind (quant.py's BlockQuantized). */
typedef struct {
    int kind;
    const uint8_t *q;  /* W_Q4_1: [N, K / 2] (byte t of a block: weight t low, weight t + 16 high); W_INT8: int8
                          [N, K]; W_BF16: bf16 [N, ldw] */
    const float *d;    /* a scale per 2^group_shift weights: [N, K >> group_shift] (Q4_1: per 32) */
    const float *m;    /* an offset per 32 weights [N, K / 32], or NULL */
    int64_t row_bytes, K;
    int group_shift;
} weights;

/* One weight row's arrays (the tiles address them once, not per vector: a division per vector, K / group,
 * had cost more than the whole product). */
typedef struct {
    const uint8_t *q;
    const float *d, *m;
} weight_row;

static inline weight_row row_of(const weights *w, int64_t j) {
    weight_row r = {w->q + j * w->row_bytes, w->d + j * (w->K >> w->group_shift), w->m ? w->m + j * (w->K / 32) : 0};
    return r;
}

/* Block b (weights [32 b, 32 b + 32)) of a weight row as four vectors of fp32: one load of its 16 or 32 bytes. */
AVX2_TARGET static inline __attribute__((always_inline)) void weight_block(int kind, int group_shift, weight_row r,
                                                                           int64_t b, __m256 w[4]) {
    if (kind == W_F32) {
        for (int s = 0; s < 4; s++) w[s] = _mm256_loadu_ps((const float *)r.q + 32 * b + 8 * s);
        return;
    }
    if (kind == W_BF16) {
        for (int s = 0; s < 4; s++) w[s] = avx2_load_bf16x8((const uint16_t *)r.q + 32 * b + 8 * s);
        return;
    }
    __m256i q[4];
    if (kind == W_Q4_1) {
        const __m128i nibble = _mm_set1_epi8(0x0f);
        __m128i v = _mm_loadu_si128((const __m128i *)(r.q + 16 * b));
        __m128i lo = _mm_and_si128(v, nibble), hi = _mm_and_si128(_mm_srli_epi16(v, 4), nibble);
        q[0] = _mm256_cvtepu8_epi32(lo);
        q[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
        q[2] = _mm256_cvtepu8_epi32(hi);
        q[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
    } else {
        __m128i v0 = _mm_loadu_si128((const __m128i *)(r.q + 32 * b)),
                v1 = _mm_loadu_si128((const __m128i *)(r.q + 32 * b + 16));
        q[0] = _mm256_cvtepi8_epi32(v0);
        q[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(v0, 8));
        q[2] = _mm256_cvtepi8_epi32(v1);
        q[3] = _mm256_cvtepi8_epi32(_mm_srli_si128(v1, 8));
    }
    for (int s = 0; s < 4; s++) {
        __m256 d = _mm256_broadcast_ss(r.d + ((32 * b + 8 * s) >> group_shift));
        w[s] = r.m ? _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[s]), d, _mm256_broadcast_ss(r.m + b))
                   : _mm256_mul_ps(_mm256_cvtepi32_ps(q[s]), d);
    }
}

/* out[i][j] for MR_ rows from x (fp32 rows of K at x + i K) and NR_ weight rows from j0; nr of them real
 * (the rest repeat the last and are not stored). One copy per weight kind (KIND_), so that the inner loop
 * holds no branch on it. A block's four vectors of one weight row at a time, each into its MR_ rows. */
#define TILE(MR_, NR_, KIND_)                                                                                      \
    AVX2_TARGET static void tile_##MR_##_##NR_##_##KIND_(const weights *w, const float *x, int64_t j0, int64_t nr, \
                                                         const float *bias, void *out, int64_t ldo, int out_bf16) {\
        __m256 acc[MR_][NR_];                                                                                    \
        weight_row rows[NR_];                                                                                     \
        const int64_t K = w->K;                                                                                   \
        const int shift = w->group_shift;                                                                         \
        for (int j = 0; j < NR_; j++) rows[j] = row_of(w, j0 + (j < nr ? j : nr - 1));                            \
        for (int i = 0; i < MR_; i++)                                                                             \
            for (int j = 0; j < NR_; j++) acc[i][j] = _mm256_setzero_ps();                                        \
        for (int64_t b = 0; b < K / 32; b++)                                                                      \
            for (int j = 0; j < NR_; j++) {                                                                       \
                __m256 wv[4];                                                                                     \
                weight_block(KIND_, shift, rows[j], b, wv);                                                       \
                for (int i = 0; i < MR_; i++)                                                                     \
                    for (int s = 0; s < 4; s++)                                                                   \
                        acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * K + 32 * b + 8 * s), wv[s], acc[i][j]); \
            }                                                                                                     \
        for (int i = 0; i < MR_; i++)                                                                             \
            for (int j = 0; j < nr; j++) {                                                                        \
                float y = avx2_hsum(acc[i][j]) + (bias ? bias[j0 + j] : 0.0f);                                    \
                if (out_bf16) ((uint16_t *)out)[i * ldo + j0 + j] = avx2_f32_to_bf16(y);                          \
                else ((float *)out)[i * ldo + j0 + j] = y;                                                        \
            }                                                                                                     \
    }
#define TILES(KIND_) TILE(1, 4, KIND_) TILE(2, 4, KIND_) TILE(3, 2, KIND_) TILE(4, 2, KIND_)
TILES(W_Q4_1) TILES(W_INT8) TILES(W_BF16) TILES(W_F32)
#undef TILES
#undef TILE

typedef void (*tile_fn)(const weights *, const float *, int64_t, int64_t, const float *, void *, int64_t, int);
/* [kind][rows - 1]: the tile for 1, 2, 3 and 4 rows */
static const tile_fn TILE_FOR[4][4] = {
    {tile_1_4_W_Q4_1, tile_2_4_W_Q4_1, tile_3_2_W_Q4_1, tile_4_2_W_Q4_1},
    {tile_1_4_W_INT8, tile_2_4_W_INT8, tile_3_2_W_INT8, tile_4_2_W_INT8},
    {tile_1_4_W_BF16, tile_2_4_W_BF16, tile_3_2_W_BF16, tile_4_2_W_BF16},
    {tile_1_4_W_F32, tile_2_4_W_F32, tile_3_2_W_F32, tile_4_2_W_F32},
};

/* Weight rows [j0, j0 + nr) as fp32 rows of K at f: each weight exactly as weight_block gives it to the tiles,
 * so a row's products are the same bits whichever form the tile read. */
AVX2_TARGET static void dequantize_rows(const weights *w, int64_t j0, int64_t nr, float *f) {
    for (int64_t j = 0; j < nr; j++) {
        weight_row r = row_of(w, j0 + j);
        for (int64_t b = 0; b < w->K / 32; b++) {
            __m256 v[4];
            switch (w->kind) {
            case W_Q4_1: weight_block(W_Q4_1, w->group_shift, r, b, v); break;
            case W_INT8: weight_block(W_INT8, w->group_shift, r, b, v); break;
            default: weight_block(W_BF16, w->group_shift, r, b, v); break;
            }
            for (int s = 0; s < 4; s++) _mm256_storeu_ps(f + j * w->K + 32 * b + 8 * s, v[s]);
        }
    }
}

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
        /* a decode step's one or two rows: four weight rows a tile; more: two, four rows at a time */
        int64_t per = rows <= 2 ? 4 : 2, tiles = (N + per - 1) / per;
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            int64_t j0 = per * t, nr = N - j0 < per ? N - j0 : per, i = 0;
            /* more than one group of rows: the tile's weight rows dequantized once, then read by every group */
            const weights *src = w;
            weights panel;
            if (rows > 4) {
                static __thread rtp_scratch panel_scratch;
                float *f = rtp_scratch_get(&panel_scratch, (size_t)(per * K) * sizeof(float));
                if (f) {
                    dequantize_rows(w, j0, nr, f);
                    panel = (weights){.kind = W_F32, .q = (const uint8_t *)f, .row_bytes = 4 * K, .K = K};
                    src = &panel;
                }
            }
            const tile_fn *tiles_of = TILE_FOR[src->kind];
            /* the tiles index weight rows, bias and output columns alike from `at` (the panel's rows from 0) */
            int64_t at = src == w ? j0 : 0;
            const float *b = bias ? bias + (j0 - at) : NULL;
            char *o = oc + (j0 - at) * esize;
            for (; i + 4 <= rows; i += 4) tiles_of[3](src, xc + i * K, at, nr, b, o + i * ldo * esize, ldo, out_bf16);
            if (rows > i) tiles_of[rows - i - 1](src, xc + i * K, at, nr, b, o + i * ldo * esize, ldo, out_bf16);
        }
    }
    return 1;
}

/* Dense bf16 weights; x bf16, or fp32 rounded to bf16 as rtp_linear_bf16 reads it. */
AVX2_TARGET void rtp_linear_bf16_avx2(const void *x, int64_t ldx, int x_fp32, const uint16_t *w16, int64_t ldw,
                                      const float *bias, void *out, int64_t ldo, int out_bf16, int64_t rows, int64_t n,
                                      int64_t k) {
    weights w = {.kind = W_BF16, .q = (const uint8_t *)w16, .d = NULL, .m = NULL, .row_bytes = 2 * ldw, .K = k,
                 .group_shift = 5};
    linear(&w, x, ldx, x_fp32, 1, bias, out, ldo, out_bf16, rows, n);
}
