/* The avx2 path's linears over block-quantized weights (Q4_1 and its repacks, Q8_0, q8_1, q8_16) with x's rows
 * as integers: each 32 values of a row get a scale (their largest magnitude / 16256) and are rounded (nearest
 * even) to 15-bit q = 128 h + l, kept as two int8 halves h in [-127, 127] and l in [-64, 63], so a block's 32
 * products are two vpmaddubsw and two vpmaddwd (h's weighted by 128), exact in int32. AVX2 has no bf16
 * product; in fp32 a weight cost a widening, a convert and a multiply-add before its product, and a one-row
 * decode step ran at 0.36x llama.cpp. One int8 part, as llama.cpp's Q8 activations, is cheaper again but
 * coarser than bf16 x: greedy output then matched the fp32 reference less often than transformers' bf16
 * (tests/engine/test_engine.py, 4 of 8 prompts against 5); 15 bits are finer than bf16's 8.
 *
 * y[i][j] = sum_b d_w[j][b] d_x[i][b] (q_w . q_x)_b  +  sum_b m[j][b] s_x[i][b]  (+ bias)
 * where s_x[i][b] = d_x[i][b] sum(q_x)_b (the offset term of Q4_1 and q8_1, w = d q + m).
 * The first sum keeps 8 lanes (lane l: the block's products 4 l .. 4 l + 3, scaled, in block order), the
 * second 8 lanes over the blocks, then the tail blocks in order; the lanes are added in one fixed order
 * (avx2_hsum). Nothing depends on M, the tile or the thread count: a row's bits are its own.
 *
 * vpmaddubsw multiplies unsigned by signed bytes: Q4_1's nibbles are the unsigned side as they are; the int8
 * kinds take |q_w| against q_x with q_w's sign. Its int16 pair sums
 * stay below 2^15: |q_w| <= 128 and |q_x| <= 127. q8_16's two scales a block go to the lanes of each
 * half (lanes 0-3 hold weights 0-15). */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include "avx2.h"
#include "cpu_kernels.h"
#include "scratch.h"
#include "avx2/int8_rows.h"

#include <math.h>
#include <omp.h>

/* Block b of a weight row as 32 bytes: Q4_1's nibbles widened to bytes, the int8 kinds' q as stored (callers
 * take |q| and q's sign for vpmaddubsw). */
AVX2_TARGET static inline __attribute__((always_inline)) __m256i weight_bytes(int kind, const uint8_t *row, int64_t b) {
    if (kind == Q_NIBBLES) {
        const __m128i nibble = _mm_set1_epi8(0x0f);
        __m128i v = _mm_loadu_si128((const __m128i *)(row + 16 * b));
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), nibble), _mm_and_si128(v, nibble));
    }
    return _mm256_loadu_si256((const __m256i *)(row + 32 * b));
}

/* One block's 8 lane sums of q_w . (128 h + l), exact in int32, as fp32. For the signed kinds wu is |q_w| and
 * h, l carry q_w's sign already. */
AVX2_TARGET static inline __attribute__((always_inline)) __m256 block_dot(__m256i wu, __m256i h, __m256i l) {
    __m256i ph = _mm256_maddubs_epi16(wu, h), pl = _mm256_maddubs_epi16(wu, l);
    __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(ph, _mm256_set1_epi16(128)), _mm256_madd_epi16(pl, _mm256_set1_epi16(1)));
    return _mm256_cvtepi32_ps(sum);
}

#define TILE(MR_, NR_, KIND_)                                                                                      \
    AVX2_TARGET static void tile_##MR_##_##NR_##_##KIND_(const int8_weights *w, int8_rows x, int64_t i0,          \
                                                         int64_t j0, int64_t nr, const float *bias, void *out,     \
                                                         int64_t ldo, int out_bf16) {                              \
        const int64_t K = w->K, nb = K / 32, per_row = KIND_ == Q_NIBBLES ? K / 2 : K;                             \
        const int64_t dn = KIND_ == Q_SIGNED16 ? 2 * nb : nb;                                                             \
        __m256 acc[MR_][NR_];                                                                                    \
        const uint8_t *q[NR_];                                                                                    \
        const float *d[NR_];                                                                                      \
        for (int j = 0; j < NR_; j++) {                                                                           \
            int64_t r = j0 + (j < nr ? j : nr - 1);                                                               \
            q[j] = w->q + r * per_row;                                                                            \
            d[j] = w->d + r * dn;                                                                                 \
        }                                                                                                         \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR_; i++)                                                  \
            _Pragma("GCC unroll 16") for (int j = 0; j < NR_; j++) acc[i][j] = _mm256_setzero_ps();                                        \
        for (int64_t b = 0; b < nb; b++)                                                                          \
            _Pragma("GCC unroll 16") for (int j = 0; j < NR_; j++) {                                            \
                __m256i wq = weight_bytes(KIND_, q[j], b);                                                     \
                __m256i wu = KIND_ == Q_NIBBLES ? wq : _mm256_abs_epi8(wq);                                       \
                __m256 dw = KIND_ == Q_SIGNED16 ? _mm256_set_m128(_mm_broadcast_ss(d[j] + 2 * b + 1), _mm_broadcast_ss(d[j] + 2 * b)) \
                                       : _mm256_broadcast_ss(d[j] + b);                                           \
                _Pragma("GCC unroll 16") for (int i = 0; i < MR_; i++) {                                        \
                    __m256i xh = _mm256_loadu_si256((const __m256i *)(x.h + (i0 + i) * K + 32 * b));              \
                    __m256i xl = _mm256_loadu_si256((const __m256i *)(x.l + (i0 + i) * K + 32 * b));              \
                    if (KIND_ != Q_NIBBLES) xh = _mm256_sign_epi8(xh, wq), xl = _mm256_sign_epi8(xl, wq);         \
                    __m256 scale = _mm256_mul_ps(dw, _mm256_broadcast_ss(x.d + (i0 + i) * nb + b));               \
                    acc[i][j] = _mm256_fmadd_ps(block_dot(wu, xh, xl), scale, acc[i][j]);                         \
                }                                                                                                 \
            }                                                                                                     \
        /* constant bounds (j < nr tested inside): an array indexed by a runtime bound would live on the stack */ \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR_; i++)                                                  \
            _Pragma("GCC unroll 16") for (int j = 0; j < NR_; j++) {                                            \
                if (j >= nr) continue;                                                                            \
                float y = avx2_hsum(acc[i][j]);                                                                   \
                if (w->m) { /* the offsets' term: 8 blocks a vector, then the rest in order */                    \
                    const float *mr = w->m + (j0 + j) * nb, *s = x.s + (i0 + i) * nb;                             \
                    __m256 t = _mm256_setzero_ps();                                                               \
                    int64_t b = 0;                                                                                \
                    for (; b + 8 <= nb; b += 8) t = _mm256_fmadd_ps(_mm256_loadu_ps(mr + b), _mm256_loadu_ps(s + b), t); \
                    float tail = 0.0f;                                                                            \
                    for (; b < nb; b++) tail = fmaf(mr[b], s[b], tail);                                           \
                    y += avx2_hsum(t) + tail;                                                                     \
                }                                                                                                 \
                y += bias ? bias[j0 + j] : 0.0f;                                                                  \
                if (out_bf16) ((uint16_t *)out)[(i0 + i) * ldo + j0 + j] = rtp_f32_to_bf16(y);                   \
                else ((float *)out)[(i0 + i) * ldo + j0 + j] = y;                                                 \
            }                                                                                                     \
    }
/* at most 12 accumulators: with 16 (4 x 4) GCC kept them on the stack, a load and a store around each product */
#define TILES(KIND_) TILE(1, 4, KIND_) TILE(2, 4, KIND_) TILE(3, 2, KIND_) TILE(4, 2, KIND_)
TILES(Q_NIBBLES) TILES(Q_SIGNED) TILES(Q_SIGNED16)
#undef TILES
#undef TILE

typedef void (*int8_tile)(const int8_weights *, int8_rows, int64_t, int64_t, int64_t, const float *, void *, int64_t,
                          int);
/* [kind][rows - 1], and the weight rows each takes at a time */
static const int TILE_NR[4] = {4, 4, 2, 2};
static const int8_tile TILE_FOR[3][4] = {
    {tile_1_4_Q_NIBBLES, tile_2_4_Q_NIBBLES, tile_3_2_Q_NIBBLES, tile_4_2_Q_NIBBLES},
    {tile_1_4_Q_SIGNED, tile_2_4_Q_SIGNED, tile_3_2_Q_SIGNED, tile_4_2_Q_SIGNED},
    {tile_1_4_Q_SIGNED16, tile_2_4_Q_SIGNED16, tile_3_2_Q_SIGNED16, tile_4_2_Q_SIGNED16},
};

#define ROW_CHUNK 64 /* rows whose int8 blocks stay in L1/L2 while every weight row passes over them */

AVX2_TARGET static int linear_int8(const int8_weights *w, const void *x, int64_t ldx, int x_fp32, const float *bias,
                                   void *out, int64_t ldo, int out_bf16, int64_t M, int64_t N) {
    static __thread rtp_scratch q_scratch, scale_scratch;
    int64_t K = w->K, nb = K / 32;
    int8_t *q = rtp_scratch_get(&q_scratch, (size_t)(2 * M * K));
    float *ds = rtp_scratch_get(&scale_scratch, (size_t)(2 * M * nb) * sizeof(float));
    if (!q || !ds) return 0;
    unsigned csr = rtp_flush_denormals(); /* each thread's own, below: a row's bits do not depend on the thread */
    for (int64_t i = 0; i < M; i++)
        quantize_row(x_fp32 ? (const void *)((const float *)x + i * ldx) : (const void *)((const uint16_t *)x + i * ldx),
                     x_fp32, K, q + i * K, q + (M + i) * K, ds + i * nb, ds + (M + i) * nb, NULL);
    int8_rows rows = {q, q + M * K, ds, ds + M * nb};
    const int8_tile *tile = TILE_FOR[w->kind];
    int64_t tiles = (N + 3) / 4;
    for (int64_t m0 = 0; m0 < M; m0 += ROW_CHUNK) {
        int64_t m1 = M - m0 < ROW_CHUNK ? M : m0 + ROW_CHUNK;
#pragma omp parallel
        {
            unsigned thread_csr = rtp_flush_denormals();
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; t++) {
                int64_t j0 = 4 * t, nr = N - j0 < 4 ? N - j0 : 4;
                for (int64_t i = m0; i < m1; i += 4) {
                    int r = m1 - i < 4 ? (int)(m1 - i) : 4, step = TILE_NR[r - 1];
                    for (int64_t j = 0; j < nr; j += step)
                        tile[r - 1](w, rows, i, j0 + j, nr - j < step ? nr - j : step, bias, out, ldo, out_bf16);
                }
            }
            rtp_restore_denormals(thread_csr);
        }
    }
    rtp_restore_denormals(csr);
    return 1;
}

AVX2_TARGET int rtp_linear_q4_1_avx2(const uint16_t *x, int64_t ldx, const uint8_t *qs, const float *d,
                                     const float *m, const float *bias, void *out, int64_t ldo, int out_bf16,
                                     int64_t rows, int64_t n, int64_t k) {
    int8_weights w = {.kind = Q_NIBBLES, .q = qs, .d = d, .m = m, .K = k};
    return linear_int8(&w, x, ldx, 0, bias, out, ldo, out_bf16, rows, n);
}

/* int8 weights (Q8_0, Q8_1 as q8, a scale per 16): signed, with a scale per `group` and an offset per 32 or none. */
AVX2_TARGET void rtp_linear_q8_avx2(const float *x, int64_t ldx, const int8_t *qs, const float *d, const float *mn,
                                    int group, const float *bias, void *out, int64_t ldo, int out_bf16, int64_t rows,
                                    int64_t n, int64_t k) {
    int8_weights w = {.kind = group == 16 ? Q_SIGNED16 : Q_SIGNED, .q = (const uint8_t *)qs, .d = d, .m = mn, .K = k};
    linear_int8(&w, x, ldx, 1, bias, out, ldo, out_bf16, rows, n); /* the op returns nothing, as its other variant */
}

/* The same weights with x bf16 or fp32; `offset` is the avx512bf16 kernel's encoding of q in bf16, not part of
 * the weights' value. Every int8 kind is taken as signed: q8_1 holds Q8_0's q too (BlockQuantized.as_kind). */
AVX2_TARGET int rtp_linear_u8_avx2(const void *x, int64_t ldx, int x_fp32, const int8_t *qs, const float *d,
                                   const float *mn, int group, int offset, const float *bias, void *out, int64_t ldo,
                                   int out_bf16, int64_t rows, int64_t n, int64_t k) {
    (void)offset;
    int8_weights w = {.kind = group == 16 ? Q_SIGNED16 : Q_SIGNED, .q = (const uint8_t *)qs, .d = d, .m = mn, .K = k};
    return linear_int8(&w, x, ldx, x_fp32, bias, out, ldo, out_bf16, rows, n);
}
#endif
