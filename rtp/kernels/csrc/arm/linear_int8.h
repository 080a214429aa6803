/* The NEON path's linears over block-quantized weights (Q4_1 and its repacks, Q8_0, q8_1, q8_16) with x's rows
 * as integers, as the avx2 twin (csrc/avx2/linear_int8.c, whose header says why 15 bits): each 32 values of a
 * row get a scale (their largest magnitude / 16256) and are rounded (nearest even) to 15-bit q = 128 h + l,
 * kept as two int8 halves h in [-127, 127] and l in [-64, 63]. A block's products q_w . h and q_w . l are
 * signed 8-bit dot products: SDOT (vdotq_s32) where the compiler targets it (__ARM_FEATURE_DOTPROD,
 * ARMv8.2-A's optional dot product, on every Armv8.4+ core), else widening multiplies and pairwise adds
 * that give the same int32 lanes (neon_dot_s8), so the two forms give the same bits. This file is the body
 * of both: linear_int8.c compiles it as the build targets (the neon path's rtp_linear_*_neon),
 * linear_int8_dotprod.c for ARMv8.2-A + dot product (the dotprod path's rtp_linear_*_dotprod), so one build
 * carries both and the CPU's HWCAP picks (arm/platform.c). NEON_VARIANT names the exported functions.
 * Unlike x86's vpmaddubsw
 * (unsigned times signed), SDOT takes both sides signed: Q8's weights need no |q| and sign trick.
 *
 * y[i][j] = sum_b d_w[j][b] d_x[i][b] (q_w . q_x)_b  +  sum_b m[j][b] s_x[i][b]  (+ bias)
 * where s_x[i][b] = d_x[i][b] sum(q_x)_b (the offset term of Q4_1 and q8_1, w = d q + m).
 * The first sum keeps 4 lanes (lane l: the block's products 4 l .. 4 l + 3 and 16 + 4 l .. 16 + 4 l + 3,
 * exact in int32 and in fp32 since 8 products stay below 2^24, scaled, in block order), the second 4 lanes
 * over the blocks, then the tail blocks in order; the lanes are added in one fixed order (neon_hsum). Nothing
 * depends on M, the tile or the thread count: a row's bits are its own. q8_16's two scales a block apply to
 * the dot products of each half of it (lanes of 4 products), one FMA each. */
#include <math.h>
#include <omp.h>

#include "int8_blocks.h"
#include "neon.h"
#include "scratch.h"


/* acc + the signed byte products of a and b, lane l adding products 4 l .. 4 l + 3 (SDOT's lanes). Without
 * SDOT: the products as int16 (|a b| <= 2^14), pairs added to int32 (SADDLP), then pairs of those (ADDP):
 * the same four sums, exactly. */
static inline __attribute__((always_inline)) int32x4_t neon_dot_s8(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(acc, a, b);
#else
    int16x8_t lo = vmull_s8(vget_low_s8(a), vget_low_s8(b)), hi = vmull_high_s8(a, b);
    return vaddq_s32(acc, vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi)));
#endif
}

/* Eight int32 vectors (32 values in order) as 32 int8 (each fits: the callers' values are in range). */
static inline void store_bytes(int8_t *dst, const int32x4_t v[8]) {
    for (int half = 0; half < 2; half++) {
        const int32x4_t *u = v + 4 * half;
        int16x8_t a = vcombine_s16(vmovn_s32(u[0]), vmovn_s32(u[1]));
        int16x8_t b = vcombine_s16(vmovn_s32(u[2]), vmovn_s32(u[3]));
        vst1q_s8(dst + 16 * half, vcombine_s8(vmovn_s16(a), vmovn_s16(b)));
    }
}

/* Row x (fp32 or bf16, K values) as integer blocks. */
static void quantize_row(const void *x, int x_fp32, int64_t K, int8_t *h, int8_t *l, float *d, float *s) {
    for (int64_t b = 0; b < K / 32; b++) {
        float32x4_t v[8];
        for (int t = 0; t < 8; t++)
            v[t] = x_fp32 ? vld1q_f32((const float *)x + 32 * b + 4 * t)
                          : neon_load_bf16x4((const uint16_t *)x + 32 * b + 4 * t);
        float32x4_t amax = vabsq_f32(v[0]);
        for (int t = 1; t < 8; t++) amax = vmaxq_f32(amax, vabsq_f32(v[t]));
        float top = neon_hmax(amax);
        float32x4_t inv = vdupq_n_f32(top > 0.0f ? X_STEPS / top : 0.0f);
        int32x4_t hi[8], lo[8], sum = vdupq_n_s32(0);
        for (int t = 0; t < 8; t++) {
            int32x4_t q = vcvtnq_s32_f32(vmulq_f32(v[t], inv));           /* nearest even, |q| <= 16256 */
            hi[t] = vshrq_n_s32(vaddq_s32(q, vdupq_n_s32(64)), 7);         /* round(q / 128), ties up */
            lo[t] = vsubq_s32(q, vshlq_n_s32(hi[t], 7));                   /* in [-64, 63] */
            sum = vaddq_s32(sum, q);
        }
        store_bytes(h + 32 * b, hi);
        store_bytes(l + 32 * b, lo);
        d[b] = top / X_STEPS;
        s[b] = d[b] * (float)vaddvq_s32(sum); /* the block's sum of q: exact in int32 */
    }
}

/* Block b of a weight row as two 16-byte halves (weights 0-15, 16-31), signed: Q4_1's nibbles (0..15) as
 * they are, the int8 kinds' q as stored. */
static inline __attribute__((always_inline)) void weight_bytes(int kind, const uint8_t *row, int64_t b,
                                                               int8x16_t w[2]) {
    if (kind == Q_NIBBLES) {
        uint8x16_t v = vld1q_u8(row + 16 * b);
        w[0] = vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0f)));
        w[1] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
    } else {
        w[0] = vld1q_s8((const int8_t *)row + 32 * b);
        w[1] = vld1q_s8((const int8_t *)row + 32 * b + 16);
    }
}

/* q_w . (128 h + l) over one 16-value half, lane l its products 4 l .. 4 l + 3 (exact in int32). */
static inline __attribute__((always_inline)) int32x4_t half_dot(int8x16_t w, int8x16_t h, int8x16_t l) {
    int32x4_t ph = neon_dot_s8(vdupq_n_s32(0), w, h), pl = neon_dot_s8(vdupq_n_s32(0), w, l);
    return vmlaq_n_s32(pl, ph, 128);
}

/* out[i0 + i][j0 + j] for MR rows of x and weight rows j0 + j (j < nr <= NR; the rest repeat the last). Always
 * inlined into the tile_* functions with constant MR, NR and kind, so the accumulators are registers. */
static inline __attribute__((always_inline)) void tile(const int MR, const int NR, const int kind,
                                                       const int8_weights *w, int8_rows x, int64_t i0, int64_t j0,
                                                       int64_t nr, const float *bias, void *out, int64_t ldo,
                                                       int out_bf16) {
    const int64_t K = w->K, nb = K / 32, per_row = kind == Q_NIBBLES ? K / 2 : K;
    const int64_t dn = kind == Q_SIGNED16 ? 2 * nb : nb;
    float32x4_t acc[4][4];
    const uint8_t *q[4];
    const float *d[4];
#pragma GCC unroll 4
    for (int j = 0; j < NR; j++) {
        int64_t r = j0 + (j < nr ? j : nr - 1);
        q[j] = w->q + r * per_row;
        d[j] = w->d + r * dn;
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
        for (int j = 0; j < NR; j++) acc[i][j] = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < nb; b++)
#pragma GCC unroll 4
        for (int j = 0; j < NR; j++) {
            int8x16_t wq[2];
            weight_bytes(kind, q[j], b, wq);
#pragma GCC unroll 4
            for (int i = 0; i < MR; i++) {
                const int8_t *xh = x.h + (i0 + i) * K + 32 * b, *xl = x.l + (i0 + i) * K + 32 * b;
                int32x4_t p0 = half_dot(wq[0], vld1q_s8(xh), vld1q_s8(xl));
                int32x4_t p1 = half_dot(wq[1], vld1q_s8(xh + 16), vld1q_s8(xl + 16));
                float dx = x.d[(i0 + i) * nb + b];
                if (kind == Q_SIGNED16) { /* a scale per half */
                    acc[i][j] = vfmaq_n_f32(acc[i][j], vcvtq_f32_s32(p0), d[j][2 * b] * dx);
                    acc[i][j] = vfmaq_n_f32(acc[i][j], vcvtq_f32_s32(p1), d[j][2 * b + 1] * dx);
                } else { /* 8 products a lane: below 2^24, so the conversion is exact */
                    acc[i][j] = vfmaq_n_f32(acc[i][j], vcvtq_f32_s32(vaddq_s32(p0, p1)), d[j][b] * dx);
                }
            }
        }
    /* constant bounds (j < nr tested inside): an array indexed by a runtime bound would live on the stack */
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
        for (int j = 0; j < NR; j++) {
            if (j >= nr) continue;
            float y = neon_hsum(acc[i][j]);
            if (w->m) { /* the offsets' term: 4 blocks a vector, then the rest in order */
                const float *mr = w->m + (j0 + j) * nb, *s = x.s + (i0 + i) * nb;
                float32x4_t t = vdupq_n_f32(0.0f);
                int64_t b = 0;
                for (; b + 4 <= nb; b += 4) t = vfmaq_f32(t, vld1q_f32(mr + b), vld1q_f32(s + b));
                float tail = 0.0f;
                for (; b < nb; b++) tail = fmaf(mr[b], s[b], tail);
                y += neon_hsum(t) + tail;
            }
            y += bias ? bias[j0 + j] : 0.0f;
            if (out_bf16) ((uint16_t *)out)[(i0 + i) * ldo + j0 + j] = rtp_f32_to_bf16(y);
            else ((float *)out)[(i0 + i) * ldo + j0 + j] = y;
        }
}

typedef void (*int8_tile)(const int8_weights *, int8_rows, int64_t, int64_t, int64_t, const float *, void *, int64_t,
                          int);

#define TILE(MR_, NR_, KIND_)                                                                                    \
    static void tile_##MR_##_##NR_##_##KIND_(const int8_weights *w, int8_rows x, int64_t i0, int64_t j0,         \
                                             int64_t nr, const float *bias, void *out, int64_t ldo, int out_bf16) { \
        tile(MR_, NR_, KIND_, w, x, i0, j0, nr, bias, out, ldo, out_bf16);                                       \
    }
#define TILES(KIND_) TILE(1, 4, KIND_) TILE(2, 4, KIND_) TILE(3, 2, KIND_) TILE(4, 2, KIND_)
TILES(Q_NIBBLES) TILES(Q_SIGNED) TILES(Q_SIGNED16)
#undef TILES
#undef TILE

/* [kind][rows - 1], and the weight rows each takes at a time */
static const int TILE_NR[4] = {4, 4, 2, 2};
static const int8_tile TILE_FOR[3][4] = {
    {tile_1_4_Q_NIBBLES, tile_2_4_Q_NIBBLES, tile_3_2_Q_NIBBLES, tile_4_2_Q_NIBBLES},
    {tile_1_4_Q_SIGNED, tile_2_4_Q_SIGNED, tile_3_2_Q_SIGNED, tile_4_2_Q_SIGNED},
    {tile_1_4_Q_SIGNED16, tile_2_4_Q_SIGNED16, tile_3_2_Q_SIGNED16, tile_4_2_Q_SIGNED16},
};

#define ROW_CHUNK 64 /* rows whose int8 blocks stay in L1/L2 while every weight row passes over them */

static int linear_int8(const int8_weights *w, const void *x, int64_t ldx, int x_fp32, const float *bias, void *out,
                       int64_t ldo, int out_bf16, int64_t M, int64_t N) {
    static __thread rtp_scratch q_scratch, scale_scratch;
    int64_t K = w->K, nb = K / 32;
    int8_t *q = rtp_scratch_get(&q_scratch, (size_t)(2 * M * K));
    float *ds = rtp_scratch_get(&scale_scratch, (size_t)(2 * M * nb) * sizeof(float));
    if (!q || !ds) return 0;
    for (int64_t i = 0; i < M; i++)
        quantize_row((const char *)x + i * ldx * (x_fp32 ? 4 : 2), x_fp32, K, q + i * K, q + (M + i) * K, ds + i * nb,
                     ds + (M + i) * nb);
    int8_rows rows = {q, q + M * K, ds, ds + M * nb};
    const int8_tile *tiles_of = TILE_FOR[w->kind];
    int64_t tiles = (N + 3) / 4;
    for (int64_t m0 = 0; m0 < M; m0 += ROW_CHUNK) {
        int64_t m1 = M - m0 < ROW_CHUNK ? M : m0 + ROW_CHUNK;
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            int64_t j0 = 4 * t, nr = N - j0 < 4 ? N - j0 : 4;
            for (int64_t i = m0; i < m1; i += 4) {
                int r = m1 - i < 4 ? (int)(m1 - i) : 4, step = TILE_NR[r - 1];
                for (int64_t j = 0; j < nr; j += step)
                    tiles_of[r - 1](w, rows, i, j0 + j, nr - j < step ? nr - j : step, bias, out, ldo, out_bf16);
            }
        }
    }
    return 1;
}

int NEON_VARIANT(rtp_linear_q4_1)(const uint16_t *x, int64_t ldx, const uint8_t *qs, const float *d, const float *m,
                         const float *bias, void *out, int64_t ldo, int out_bf16, int64_t rows, int64_t n, int64_t k) {
    int8_weights w = {.kind = Q_NIBBLES, .q = qs, .d = d, .m = m, .K = k};
    return linear_int8(&w, x, ldx, 0, bias, out, ldo, out_bf16, rows, n);
}

/* int8 weights (Q8_0, Q8_1 as q8, a scale per 16): signed, with a scale per `group` and an offset per 32 or none. */
void NEON_VARIANT(rtp_linear_q8)(const float *x, int64_t ldx, const int8_t *qs, const float *d, const float *mn, int group,
                        const float *bias, void *out, int64_t ldo, int out_bf16, int64_t rows, int64_t n, int64_t k) {
    int8_weights w = {.kind = group == 16 ? Q_SIGNED16 : Q_SIGNED, .q = (const uint8_t *)qs, .d = d, .m = mn, .K = k};
    linear_int8(&w, x, ldx, 1, bias, out, ldo, out_bf16, rows, n); /* the op returns nothing, as its other variants */
}

/* The same weights with x bf16 or fp32; `offset` is the avx512bf16 kernel's encoding of q in bf16, not part of the
 * weights' value. Every int8 kind is taken as signed: q8_1 holds Q8_0's q too (BlockQuantized.as_kind). */
int NEON_VARIANT(rtp_linear_u8)(const void *x, int64_t ldx, int x_fp32, const int8_t *qs, const float *d, const float *mn,
                       int group, int offset, const float *bias, void *out, int64_t ldo, int out_bf16, int64_t rows,
                       int64_t n, int64_t k) {
    (void)offset;
    int8_weights w = {.kind = group == 16 ? Q_SIGNED16 : Q_SIGNED, .q = (const uint8_t *)qs, .d = d, .m = mn, .K = k};
    return linear_int8(&w, x, ldx, x_fp32, bias, out, ldo, out_bf16, rows, n);
}
