/* CPU kernels for the decode step: what eager PyTorch and oneDNN leave on the table here.
 *
 * A decode step at a small batch is a stream of weights: every weight is read once
 * and used for a handful of rows, so the bytes read set the pace (about 17 GB/s on
 * this 2-core VM). The linear kernels multiply a GGUF checkpoint's Q4_1 / Q8_0
 * blocks in place (0.6-1.1 bytes per weight instead of bf16's 2); the paged
 * attention kernel reads each row's KV blocks where they lie (no gather copy) with
 * an online softmax in fp32; two small fused kernels (residual add + RMSNorm, RoPE +
 * KV-cache write) replace a dozen eager ops each.
 *
 * Plain C with AVX-512 BF16 intrinsics and OpenMP; no Python, no torch. The
 * functions are compiled for avx512bf16 and only called after
 * rtp_cpu_kernels_supported() said yes. OpenMP resolves to the libgomp that
 * torch already loaded (same soname), so both share one thread pool.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"
#include "scratch.h"
#include "prefetch.h"
#include "vec_math.h"

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

int rtp_cpu_kernels_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512bf16");
}

/* Round-to-nearest-even fp32 -> bf16, as torch does. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* One output element of a linear, in its dtype. */
static inline void store_out(void *out, int64_t at, int out_bf16, float v) {
    if (out_bf16) ((uint16_t *)out)[at] = f32_to_bf16(v);
    else ((float *)out)[at] = v;
}

/* Tiles of the quantized linears: NR weight rows meet MR activation rows (16 accumulators)
 * while the rows sit in L1, so each weight byte is read from memory once per call. */
#define NR 4
#define MR 4
/* Batches of 5 or 6 rows go in one pass over the weights, two weight rows a tile (the accumulators
 * still fit the registers), where a second pass of 1-2 rows unpacked every block again: Q4_1 at
 * 3072 x 576, 5 rows, 165 -> 151 us; the LM head's Q8_0, 5 rows, 1.84 -> 1.67 ms. At 7-8 rows two
 * passes of 4 were as fast or faster (8 rows: 2.27 against 2.48 ms). */
#define MR_MAX 6

/* ---------------------------------------------------------------------------------------------
 * Linear over GGUF block-quantized weights, repacked at load into plain arrays:
 *   Q4_1: qs uint8 [N, K/2] (block of 32: byte j holds weight j low, weight j+16 high),
 *         d, m fp32 [N, K/32]; weight = d * q + m, q in 0..15.
 *   Q8_0: qs int8 [N, K], d fp32 [N, K/32]; weight = d * q (and the other int8 kinds: rtp_linear_q8).
 * Scales are fp32 (the file's fp16 values, exactly): a broadcast straight from memory costs
 * no shuffle-port work, and the vector ports, not memory, bound these loops on AMD Zen 4 (the
 * same time from L2 as from DRAM); Q4_1's loop spreads four blocks' scales with one permute.
 * The checkpoint's exact weights, at 0.625 (Q4_1) or 1.06 (Q8_0) bytes each instead of
 * bf16's 2: a small-batch step reads a third of the bytes. Q4_1 takes bf16 activations
 * (q is exact in bf16: one dot instruction per block, the scales applied in fp32, four blocks a multiply-add);
 * Q8_0 takes fp32 activations (the final hidden state feeding the LM head).
 * K is a multiple of 32. out is fp32 or bf16 [M, N] (row stride ldo).
 * ------------------------------------------------------------------------------------------- */
#define QK 32
#define PREFETCH_TILES 4

/* Prefetch part `step` of `steps` of the bytes [p, p + n) (harmless past the end of an array:
 * prefetches never fault). */
TARGET static inline void prefetch_part(const void *p, int64_t n, int64_t step, int64_t steps) {
    int64_t lines = (n + 63) / 64, per = (lines + steps - 1) / steps;
    const char *c = (const char *)p;
    for (int64_t l = step * per; l < (step + 1) * per && l < lines; l++) rtp_prefetch_l1(c + l * 64);
}

/* Q4_1's one-row loop takes four blocks of a weight row at once: their 64 quant bytes in one load, the
 * low and the high nibbles masked out (3 ops), and each nibble widened into the bf16 of 128 + q by
 * interleaving it with the byte 0x43 (bf16(128)'s high byte: with 128's exponent, bf16's 7 mantissa bits
 * hold q exactly), 4 unpacks for the 128 weights. An unpack works within 128-bit lanes, so lane L of
 * each product vector holds block L's weights: (unpacklo, unpackhi) of the low nibbles weights 0-7 and
 * 8-15, of the high nibbles 16-23 and 24-31. x is permuted once per call into the same order (x4_blocks),
 * so the four dot products chain into one vector whose fp32 lane 4 L + j sums block L's pairs j, j + 4,
 * j + 8 and j + 12 (exact products, summed in order), and one multiply-add by the four blocks' scales
 * (lanes 4 L to 4 L + 3: d of block L) takes them into the running sums.
 * Per block: 1.75 vector ops to build the weights, 1 dot product and a quarter of a multiply-add, where
 * widening each block alone (zero-extend, shift, mask) and scaling each block's dot product took 5.
 * AMD Zen 4, one thread, a 3,072 x 576 matrix in L2 (a /tmp harness, minimum of 200): 1.44 -> 1.11 ns a
 * block; 3,072 x 1,536: 1.40 -> 0.94; from memory (30 matrices): 1.68 -> 1.13. The loop was bound by its
 * vector ops, not by memory: the same time from L2 as from DRAM. */
#define Q4_GROUP 4 /* blocks a step */

/* Row x (K bf16) in x4_blocks order: xp[128 g + 32 k + 8 L + w] = x[32 (4 g + L) + 8 k + w] for the
 * groups g of four blocks, zeros past the last block (so a group of fewer blocks adds nothing). */
TARGET static void x4_blocks(const uint16_t *x, int64_t K, uint16_t *xp) {
    int64_t nb = K / QK, ng = (nb + Q4_GROUP - 1) / Q4_GROUP;
    for (int64_t g = 0; g < ng; g++)
        for (int64_t L = 0; L < Q4_GROUP; L++)
            for (int64_t k = 0; k < 4; k++) {
                uint16_t *dst = xp + g * 128 + k * 32 + L * 8;
                if (g * Q4_GROUP + L < nb) memcpy(dst, x + (g * Q4_GROUP + L) * QK + k * 8, 16);
                else memset(dst, 0, 16);
            }
}

TARGET static inline __attribute__((always_inline)) void q4_1_tile(
        const uint16_t *xp, int64_t ldxp, const float *xsum, const uint8_t *qs, const float *d,
        const float *mn, int64_t K, const float *bias, void *out, int64_t ldo, int out_bf16,
        int64_t m0, const int mr, int64_t n0, int64_t nr, const int NR_) {
    int64_t nb = K / QK, ng = (nb + Q4_GROUP - 1) / Q4_GROUP;
    __m512 acc[MR_MAX][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR_; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t rows[NR];
    for (int j = 0; j < NR_; j++) rows[j] = n0 + (j < nr ? j : 0);
    const __m512i nibble = _mm512_set1_epi8(0x0f), bf16_128 = _mm512_set1_epi8(0x43);
    const __m512i scale_lanes = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    /* a later tile's bytes, spread over this tile's steps: the hardware prefetcher alone
     * leaves the loop waiting on memory (it ran at half its in-cache speed without) */
    int64_t ahead = n0 + PREFETCH_TILES * NR_;
    for (int64_t g = 0; g < ng; g++) {
        prefetch_part(qs + ahead * (K / 2), NR_ * (K / 2), g, ng);
        prefetch_part(d + ahead * nb, NR_ * nb * 4, g, ng);
        prefetch_part(mn + ahead * nb, NR_ * nb * 4, g, ng);
        int64_t blocks = nb - g * Q4_GROUP < Q4_GROUP ? nb - g * Q4_GROUP : Q4_GROUP;
        __mmask64 qmask = blocks == Q4_GROUP ? ~(__mmask64)0 : ((__mmask64)1 << (16 * blocks)) - 1;
        __mmask8 dmask = (__mmask8)((1u << blocks) - 1);
        for (int j = 0; j < NR_; j++) {
            __m512i v = _mm512_maskz_loadu_epi8(qmask, qs + rows[j] * (K / 2) + g * (Q4_GROUP * QK / 2));
            __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
            __m512bh w0 = (__m512bh)_mm512_unpacklo_epi8(lo, bf16_128), w1 = (__m512bh)_mm512_unpackhi_epi8(lo, bf16_128);
            __m512bh w2 = (__m512bh)_mm512_unpacklo_epi8(hi, bf16_128), w3 = (__m512bh)_mm512_unpackhi_epi8(hi, bf16_128);
            __m512 scale = _mm512_permutexvar_ps(
                scale_lanes, _mm512_castps128_ps512(_mm_maskz_loadu_ps(dmask, d + rows[j] * nb + g * Q4_GROUP)));
            for (int i = 0; i < mr; i++) {
                const uint16_t *xg = xp + (m0 + i) * ldxp + g * 128;
                __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), w0, (__m512bh)_mm512_loadu_si512(xg));
                dot = _mm512_dpbf16_ps(dot, w1, (__m512bh)_mm512_loadu_si512(xg + 32));
                dot = _mm512_dpbf16_ps(dot, w2, (__m512bh)_mm512_loadu_si512(xg + 64));
                dot = _mm512_dpbf16_ps(dot, w3, (__m512bh)_mm512_loadu_si512(xg + 96));
                acc[i][j] = _mm512_fmadd_ps(dot, scale, acc[i][j]);
            }
        }
    }
    /* sum_b d_b * sum(x (128 + q)) + sum_b (m_b - 128 d_b) * sum(x)_b = sum(x (d q + m)) */
    for (int j = 0; j < nr; j++) {
        const float *dr = d + (n0 + j) * nb, *mr_ = mn + (n0 + j) * nb;
        for (int i = 0; i < mr; i++) {
            const float *xs = xsum + (m0 + i) * nb;
            __m512 v = acc[i][j];
            for (int64_t b = 0; b < nb; b += 16) {
                __mmask16 k = nb - b >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (nb - b)) - 1);
                __m512 off = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), _mm512_maskz_loadu_ps(k, dr + b),
                                              _mm512_maskz_loadu_ps(k, mr_ + b));
                v = _mm512_fmadd_ps(off, _mm512_maskz_loadu_ps(k, xs + b), v);
            }
            float y = _mm512_reduce_add_ps(v) + (bias ? bias[n0 + j] : 0.0f);
            store_out(out, (m0 + i) * ldo + n0 + j, out_bf16, y);
        }
    }
}

/* Every tile of an [M, N] product over one request's rows, TILE(m0, mr, n0, nr, NR_) each with mr and NR_
 * literals so each always-inline tile kernel is compiled for its row count: 5-6 rows in one pass two
 * weight rows a tile, any other M in passes of up to MR rows over NR weight rows. Shared by every
 * small-batch linear below. */
#define FOR_EACH_TILE(M, N, TILE)                                                                           \
    do {                                                                                                    \
        if ((M) > MR && (M) <= MR_MAX) {                                                                    \
            int64_t tiles_ = ((N) + 1) / 2;                                                                 \
            _Pragma("omp parallel for schedule(static)")                                                    \
            for (int64_t t_ = 0; t_ < tiles_; t_++) {                                                       \
                int64_t n0_ = t_ * 2, nr_ = (N) - n0_ < 2 ? (N) - n0_ : 2;                                  \
                if ((M) == 5) TILE(0, 5, n0_, nr_, 2);                                                      \
                else TILE(0, 6, n0_, nr_, 2);                                                               \
            }                                                                                               \
        } else {                                                                                            \
            int64_t tiles_ = ((N) + NR - 1) / NR;                                                           \
            _Pragma("omp parallel for schedule(static)")                                                    \
            for (int64_t t_ = 0; t_ < tiles_; t_++) {                                                       \
                int64_t n0_ = t_ * NR, nr_ = (N) - n0_ < NR ? (N) - n0_ : NR;                               \
                for (int64_t m0_ = 0; m0_ < (M); m0_ += MR) {                                               \
                    switch ((M) - m0_ < MR ? (M) - m0_ : MR) {                                              \
                    case 1: TILE(m0_, 1, n0_, nr_, NR); break;                                              \
                    case 2: TILE(m0_, 2, n0_, nr_, NR); break;                                              \
                    case 3: TILE(m0_, 3, n0_, nr_, NR); break;                                              \
                    default: TILE(m0_, 4, n0_, nr_, NR); break;                                             \
                    }                                                                                       \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
    } while (0)

/* xsum [M, K / group] = each bf16 row's sums over groups of `group` (16 or 32) weights: what the
 * kernels that build weights with an offset (128 + q, ...) take back out. */
TARGET static void group_sums(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, int group, float *xsum) {
    int64_t ng = K / group;
    for (int64_t i = 0; i < M; i++)
        for (int64_t g = 0; g < ng; g++) {
            __m512 v = bf16x16_to_f32(x + i * ldx + g * group);
            if (group == 32) v = _mm512_add_ps(v, bf16x16_to_f32(x + i * ldx + g * group + 16));
            xsum[i * ng + g] = _mm512_reduce_add_ps(v);
        }
}

/* Returns 0, computing nothing, when the sums of a large batch could not be allocated. */
TARGET int rtp_linear_q4_1(const uint16_t *x, int64_t ldx, const uint8_t *qs, const float *d,
                           const float *mn, const float *bias, void *out, int64_t ldo,
                           int out_bf16, int64_t M, int64_t N, int64_t K) {
    int64_t nb = K / QK, ldxp = (nb + Q4_GROUP - 1) / Q4_GROUP * 128;
    /* per-block sums of each activation row, and the rows in x4_blocks order: on the stack up to
     * 64 and 32 KiB */
    float stack[16384];
    uint16_t stack_xp[16384] __attribute__((aligned(64)));
    float *xsum = M * nb <= 16384 ? stack : (float *)malloc((size_t)(M * nb) * sizeof(float));
    uint16_t *xp = M * ldxp <= 16384 ? stack_xp : (uint16_t *)malloc((size_t)(M * ldxp) * sizeof(uint16_t));
    if (!xsum || !xp) {
        if (xsum != stack) free(xsum);
        if (xp != stack_xp) free(xp);
        return 0;
    }
    group_sums(x, ldx, M, K, QK, xsum);
    for (int64_t i = 0; i < M; i++) x4_blocks(x + i * ldx, K, xp + i * ldxp);
#define Q4_1_TILE(m0, mr, n0, nr, NR_) q4_1_tile(xp, ldxp, xsum, qs, d, mn, K, bias, out, ldo, out_bf16, m0, mr, n0, nr, NR_)
    FOR_EACH_TILE(M, N, Q4_1_TILE);
#undef Q4_1_TILE
    if (xsum != stack) free(xsum);
    if (xp != stack_xp) free(xp);
    return 1;
}

/* ---------------------------------------------------------------------------------------------
 * Linear over small int8 weights, for one request's rows: q8_1 (w = d q + m, q in 0..31: Q5_1 and
 * Q5_K repacked) and q8_16 (w = d_g q, q in -32..31, a scale per 16 weights: Q6_K repacked).
 * Where rtp_linear_q8 widens each weight to fp32 and multiplies it (compute-bound: as slow as
 * bf16 weights at one row), here u = q + 128 + offset lies in [128, 256) for both kinds, so it is
 * a bf16 exactly and its bits are q + offset + 0x4300: a sign extension and an add build 32 weights, one
 * dot instruction multiplies them with bf16 x, and the offsets come back out through the
 * groups' sums of x (as rtp_linear_q4_1 does with 128 + q):
 *   sum_k x w = sum_g d_g (x . u)_g + sum_g (m_g - (128 + offset) d_g) sum_g x
 * qs int8 [N, K]; d fp32 [N, K / group] (group 32 or 16); m fp32 [N, K / 32] or NULL; offset 0 (q8_1)
 * or 32 (q8_16). x bf16 (a fp32 row is rounded to bf16 as it is read).
 * Q8_0's q spans all of int8, more than bf16's 7 mantissa bits hold, so with offset U8_SPLIT it is
 * split q = 16 h + l (h = q >> 4 in -8..7, l = q & 15): bf16(128 + l) has bits l + 0x4300 and
 * bf16(2048 + 16 (h + 8)) has bits h + 8 + 0x4500 (the step of [2048, 4096) is 16), so two dot
 * instructions into one sum multiply x by q + 2304 exactly (offset 2176: 128 + offset = 2304 comes
 * back out as above). Four instructions build 32 weights where widening them to fp32 took six, only
 * one of them on the shuffle port: one row of the 0.50 B Q8_0 shape (tools/bench_quant.py) 38.6 -> 29.5 ms.
 * ------------------------------------------------------------------------------------------- */
#define U8_SPLIT 2176
TARGET static inline __attribute__((always_inline)) void u8_tile(
        const uint16_t *x, int64_t ldx, const float *xsum, const int8_t *qs, const float *d, const float *mn,
        int group, int offset, int64_t K, const float *bias, void *out, int64_t ldo, int out_bf16, int64_t m0,
        const int mr, int64_t n0, int64_t nr, const int NR_, const int split) {
    int64_t nb = K / QK, ng = K / group, per = QK / group;
    __m512 acc[MR_MAX][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR_; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t rows[NR];
    for (int j = 0; j < NR_; j++) rows[j] = n0 + (j < nr ? j : 0);
    int64_t ahead = n0 + PREFETCH_TILES * NR_;
    const __m512i bias_bits = _mm512_set1_epi16((short)(0x4300 + offset)); /* bf16(128 + t) = 0x4300 + t */
    for (int64_t b = 0; b < nb; b++) {
        prefetch_part(qs + ahead * K, NR_ * K, b, nb);
        prefetch_part(d + ahead * ng, NR_ * ng * 4, b, nb);
        __m512bh xv[MR_MAX];
        for (int i = 0; i < mr; i++) xv[i] = (__m512bh)_mm512_loadu_si512(x + (m0 + i) * ldx + b * QK);
        for (int j = 0; j < NR_; j++) {
            __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(qs + rows[j] * K + b * QK)));
            const float *dr = d + rows[j] * ng + b * per;
            if (split) {
                __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(v, _mm512_set1_epi16(0x000f),
                                                                  _mm512_set1_epi16(0x4300), 0xEA);
                __m512bh hi = (__m512bh)_mm512_add_epi16(_mm512_srai_epi16(v, 4), _mm512_set1_epi16(0x4508));
                __m512 scale = _mm512_set1_ps(dr[0]);
                for (int i = 0; i < mr; i++)
                    acc[i][j] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xv[i], lo),
                                                                 xv[i], hi), scale, acc[i][j]);
                continue;
            }
            __m512bh wv = (__m512bh)_mm512_add_epi16(v, bias_bits);
            /* lanes 0-7 sum weights 0-15, lanes 8-15 weights 16-31: a scale per 16 is a two-valued vector */
            __m512 scale = per == 1 ? _mm512_set1_ps(dr[0])
                                    : _mm512_mask_blend_ps((__mmask16)0xff00, _mm512_set1_ps(dr[0]), _mm512_set1_ps(dr[1]));
            for (int i = 0; i < mr; i++)
                acc[i][j] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xv[i], wv), scale, acc[i][j]);
        }
    }
    for (int j = 0; j < nr; j++) {
        const float *dr = d + (n0 + j) * ng, *mr_ = mn ? mn + (n0 + j) * nb : NULL;
        for (int i = 0; i < mr; i++) {
            const float *xs = xsum + (m0 + i) * ng;
            __m512 v = acc[i][j];
            for (int64_t g = 0; g < ng; g += 16) {
                __mmask16 k = ng - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (ng - g)) - 1);
                __m512 off = _mm512_mul_ps(_mm512_set1_ps(-(128.0f + (float)offset)), _mm512_maskz_loadu_ps(k, dr + g));
                if (mr_) off = _mm512_add_ps(off, _mm512_maskz_loadu_ps(k, mr_ + g)); /* group 32: m per group */
                v = _mm512_fmadd_ps(off, _mm512_maskz_loadu_ps(k, xs + g), v);
            }
            float y = _mm512_reduce_add_ps(v) + (bias ? bias[n0 + j] : 0.0f);
            store_out(out, (m0 + i) * ldo + n0 + j, out_bf16, y);
        }
    }
}

/* Returns 0, computing nothing, when the sums of a large batch could not be allocated. */
TARGET int rtp_linear_u8(const void *x, int64_t ldx, int x_fp32, const int8_t *qs, const float *d, const float *mn,
                         int group, int offset, const float *bias, void *out, int64_t ldo, int out_bf16, int64_t M,
                         int64_t N, int64_t K) {
    int64_t ng = K / group;
    const int split = offset == U8_SPLIT;
    float stack[16384];
    uint16_t xstack[8192];
    float *xsum = M * ng <= 16384 ? stack : (float *)malloc((size_t)(M * ng) * sizeof(float));
    uint16_t *xb = NULL;
    int64_t ldb = ldx;
    if (x_fp32) { /* rounded to bf16 once, as the weights' dot takes it */
        xb = M * K <= 8192 ? xstack : (uint16_t *)malloc((size_t)(M * K) * 2);
        ldb = K;
    }
    if (!xsum || (x_fp32 && !xb)) {
        if (xsum != stack) free(xsum);
        if (xb != xstack) free(xb);
        return 0;
    }
    const uint16_t *xr = x_fp32 ? xb : (const uint16_t *)x;
    if (x_fp32)
        for (int64_t i = 0; i < M; i++)
            for (int64_t k = 0; k < K; k += 16)
                _mm256_storeu_si256((__m256i *)(xb + i * K + k),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps((const float *)x + i * ldx + k)));
    group_sums(xr, ldb, M, K, group, xsum); /* the sums of the bf16 rows the dot reads */
#define U8_TILE(m0, mr, n0, nr, NR_) \
    u8_tile(xr, ldb, xsum, qs, d, mn, group, offset, K, bias, out, ldo, out_bf16, m0, mr, n0, nr, NR_, split)
    FOR_EACH_TILE(M, N, U8_TILE);
#undef U8_TILE
    if (xsum != stack) free(xsum);
    if (xb && xb != xstack) free(xb);
    return 1;
}

/* ---------------------------------------------------------------------------------------------
 * Linear over dense bf16 weights [N, K] (row stride ldw), for one request's rows: a bf16
 * checkpoint's (or a GGUF's F16/BF16/F32 tensor's) weights as the model holds them, one dot
 * instruction per 32 weights and row, sums in fp32. x bf16, or fp32 (x_fp32: rounded to bf16 as it
 * is read, as the AMX kernel does). Without it such a layer went to oneDNN, which a CPU graph
 * cannot replay, so every step of a bf16 model ran eagerly.
 * ------------------------------------------------------------------------------------------- */
TARGET static inline __attribute__((always_inline)) void bf16_tile(
        const void *x, int x_fp32, int64_t ldx, const uint16_t *w, int64_t ldw, int64_t K, const float *bias,
        void *out, int64_t ldo, int out_bf16, int64_t m0, const int mr, int64_t n0, int64_t nr, const int NR_) {
    int64_t nb = K / QK;
    __m512 acc[MR_MAX][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR_; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t rows[NR];
    for (int j = 0; j < NR_; j++) rows[j] = n0 + (j < nr ? j : 0);
    int64_t ahead = n0 + PREFETCH_TILES * NR_;
    for (int64_t b = 0; b < nb; b++) {
        for (int j = 0; j < NR_; j++) rtp_prefetch_l1(w + (ahead + j) * ldw + b * QK);
        __m512bh xv[MR_MAX];
        for (int i = 0; i < mr; i++) {
            if (x_fp32) {
                const float *xr = (const float *)x + (m0 + i) * ldx + b * QK;
                xv[i] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + 16), _mm512_loadu_ps(xr));
            } else {
                xv[i] = (__m512bh)_mm512_loadu_si512((const uint16_t *)x + (m0 + i) * ldx + b * QK);
            }
        }
        for (int j = 0; j < NR_; j++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(w + rows[j] * ldw + b * QK);
            for (int i = 0; i < mr; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++)
            store_out(out, (m0 + i) * ldo + n0 + j, out_bf16,
                      _mm512_reduce_add_ps(acc[i][j]) + (bias ? bias[n0 + j] : 0.0f));
}

/* out [M, N] = x [M, K] @ W^T (+ bias), W bf16 [N, K] (row stride ldw); K a multiple of 32. */
TARGET void rtp_linear_bf16(const void *x, int64_t ldx, int x_fp32, const uint16_t *w, int64_t ldw,
                            const float *bias, void *out, int64_t ldo, int out_bf16, int64_t M, int64_t N, int64_t K) {
#define BF16_TILE(m0, mr, n0, nr, NR_) bf16_tile(x, x_fp32, ldx, w, ldw, K, bias, out, ldo, out_bf16, m0, mr, n0, nr, NR_)
    FOR_EACH_TILE(M, N, BF16_TILE);
#undef BF16_TILE
}

/* ---------------------------------------------------------------------------------------------
 * Linear over Q4_K's own super-blocks (256 weights: eight blocks of 32, w = (d sc) q - (dmin mn)),
 * for one request's rows: the bytes of a Q4_K file's weights, 0.59 a weight where the q4_1
 * repack reads 0.75 (a one-row step is bound by them). Layout (rtp/kernels/quant.py, q4_k):
 *   qs  uint8 [N, K/2]: per super-block 128 bytes, block pair p in bytes 32p .. 32p + 31 (low
 *       nibble: block 2p's weight i, high: block 2p + 1's), GGUF's order;
 *   scm uint8 [N, K/256, 16]: the eight 6-bit scales, then the eight mins, unpacked;
 *   dd  fp32 [N, K/256, 2]: d and dmin.
 * The weights are the file's exactly (d sc and dmin mn are exact in fp32); per row and block a
 * dot of x against 128 + q (as rtp_linear_q4_1), scaled by d sc, and the blocks' sums of x
 * against -(dmin mn) - 128 d sc, eight blocks at once.
 * ------------------------------------------------------------------------------------------- */
#define QKK 256

TARGET static inline __attribute__((always_inline)) void q4_k_tile(
        const uint16_t *x, int64_t ldx, const float *xsum, const uint8_t *qs, const uint8_t *scm, const float *dd,
        int64_t K, const float *bias, void *out, int64_t ldo, int out_bf16, int64_t m0, const int mr, int64_t n0,
        int64_t nr, const int NR_) {
    int64_t ns = K / QKK, nb = K / QK;
    __m512 acc[MR_MAX][NR];
    __m256 off[MR_MAX][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR_; j++) {
            acc[i][j] = _mm512_setzero_ps();
            off[i][j] = _mm256_setzero_ps();
        }
    int64_t rows[NR];
    for (int j = 0; j < NR_; j++) rows[j] = n0 + (j < nr ? j : 0);
    int64_t ahead = n0 + PREFETCH_TILES * NR_;
    const __m512i lo_mask = _mm512_set1_epi16(0x000f), bf128 = _mm512_set1_epi16(0x4300);
    for (int64_t sb = 0; sb < ns; sb++) {
        prefetch_part(qs + ahead * (K / 2), NR_ * (K / 2), sb, ns);
        for (int j = 0; j < NR_; j++) {
            const float *dr = dd + (rows[j] * ns + sb) * 2;
            /* d sc for the eight blocks, then dmin mn */
            __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                         _mm_loadu_si128((const __m128i *)(scm + (rows[j] * ns + sb) * 16)))),
                                     _mm512_mask_blend_ps((__mmask16)0xff00, _mm512_set1_ps(dr[0]), _mm512_set1_ps(dr[1])));
            float scale[16] __attribute__((aligned(64)));
            _mm512_store_ps(scale, v);
            __m256 dsc = _mm512_castps512_ps256(v), dmm = _mm512_extractf32x8_ps(v, 1);
            /* per block: -(dmin mn) - 128 d sc, against the block's sum of x */
            __m256 o = _mm256_fnmadd_ps(_mm256_set1_ps(128.0f), dsc, _mm256_sub_ps(_mm256_setzero_ps(), dmm));
            for (int i = 0; i < mr; i++)
                off[i][j] = _mm256_fmadd_ps(o, _mm256_loadu_ps(xsum + (m0 + i) * nb + sb * 8), off[i][j]);
            const uint8_t *q = qs + rows[j] * (K / 2) + sb * 128;
            for (int p = 0; p < 4; p++) {
                __m512i v16 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * p)));
                __m512bh w0 = (__m512bh)_mm512_ternarylogic_epi32(v16, lo_mask, bf128, 0xEA);
                __m512bh w1 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v16, 4), lo_mask, bf128, 0xEA);
                __m512 s0 = _mm512_set1_ps(scale[2 * p]), s1 = _mm512_set1_ps(scale[2 * p + 1]);
                const int64_t b0 = sb * 8 + 2 * p;
                for (int i = 0; i < mr; i++) {
                    const uint16_t *xr = x + (m0 + i) * ldx + b0 * QK;
                    __m512bh x0 = (__m512bh)_mm512_loadu_si512(xr), x1 = (__m512bh)_mm512_loadu_si512(xr + QK);
                    acc[i][j] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), x0, w0), s0, acc[i][j]);
                    acc[i][j] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), x1, w1), s1, acc[i][j]);
                }
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float t[8], y = _mm512_reduce_add_ps(acc[i][j]);
            _mm256_storeu_ps(t, off[i][j]);
            for (int e = 0; e < 8; e++) y += t[e];
            store_out(out, (m0 + i) * ldo + n0 + j, out_bf16, y + (bias ? bias[n0 + j] : 0.0f));
        }
}

/* out [M, N] = x [M, K] bf16 @ W^T for W in Q4_K's super-blocks (above); K a multiple of 256. Returns 0,
 * computing nothing, when the sums of a large batch could not be allocated. */
TARGET int rtp_linear_q4_k(const uint16_t *x, int64_t ldx, const uint8_t *qs, const uint8_t *scm, const float *dd,
                           const float *bias, void *out, int64_t ldo, int out_bf16, int64_t M, int64_t N, int64_t K) {
    int64_t nb = K / QK;
    float stack[16384];
    float *xsum = M * nb <= 16384 ? stack : (float *)malloc((size_t)(M * nb) * sizeof(float));
    if (!xsum) return 0;
    group_sums(x, ldx, M, K, QK, xsum);
#define Q4_K_TILE(m0, mr, n0, nr, NR_) q4_k_tile(x, ldx, xsum, qs, scm, dd, K, bias, out, ldo, out_bf16, m0, mr, n0, nr, NR_)
    FOR_EACH_TILE(M, N, Q4_K_TILE);
#undef Q4_K_TILE
    if (xsum != stack) free(xsum);
    return 1;
}

TARGET static inline __attribute__((always_inline)) void q8_tile(
        const float *x, int64_t ldx, const int8_t *qs, const float *d, const float *mn, int group, int64_t K,
        const float *bias, void *out, int64_t ldo, int out_bf16, int64_t m0, const int mr, int64_t n0, int64_t nr,
        const int NR_) {
    int64_t nb = K / QK, ng = K / group, per = QK / group; /* scales a row, and a block */
    __m512 acc[MR_MAX][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR_; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t rows[NR];
    for (int j = 0; j < NR_; j++) rows[j] = n0 + (j < nr ? j : 0);
    int64_t ahead = n0 + PREFETCH_TILES * NR_;
    for (int64_t b = 0; b < nb; b++) {
        prefetch_part(qs + ahead * K, NR_ * K, b, nb);
        prefetch_part(d + ahead * ng, NR_ * ng * 4, b, nb);
        if (mn) prefetch_part(mn + ahead * nb, NR_ * nb * 4, b, nb);
        for (int j = 0; j < NR_; j++) {
            const int8_t *q = qs + rows[j] * K + b * QK;
            const float *dr = d + rows[j] * ng + b * per;
            /* the exact fp32 weights: q * d (+ m), each product and sum rounded once */
            __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))),
                                      _mm512_set1_ps(dr[0]));
            __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))),
                                      _mm512_set1_ps(dr[per - 1]));
            if (mn) {
                __m512 m = _mm512_set1_ps(mn[rows[j] * nb + b]);
                w0 = _mm512_add_ps(w0, m);
                w1 = _mm512_add_ps(w1, m);
            }
            for (int i = 0; i < mr; i++) {
                const float *xr = x + (m0 + i) * ldx + b * QK;
                acc[i][j] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), w0, acc[i][j]);
                acc[i][j] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), w1, acc[i][j]);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float v = _mm512_reduce_add_ps(acc[i][j]) + (bias ? bias[n0 + j] : 0.0f);
            store_out(out, (m0 + i) * ldo + n0 + j, out_bf16, v);
        }
}

/* int8 blocks of 32: Q8_0 (one d a block, mn NULL: w = d q), Q8_1 (w = d q + m: Q5_1 and Q5_K repacked)
 * and Q8 with a scale for each 16 weights (group 16: Q6_K repacked); d fp32 [N, K / group], mn fp32
 * [N, K / 32] or NULL. x fp32. */
TARGET void rtp_linear_q8(const float *x, int64_t ldx, const int8_t *qs, const float *d, const float *mn,
                          int group, const float *bias, void *out, int64_t ldo, int out_bf16,
                          int64_t M, int64_t N, int64_t K) {
#define Q8_TILE(m0, mr, n0, nr, NR_) q8_tile(x, ldx, qs, d, mn, group, K, bias, out, ldo, out_bf16, m0, mr, n0, nr, NR_)
    FOR_EACH_TILE(M, N, Q8_TILE);
#undef Q8_TILE
}

/* ---------------------------------------------------------------------------------------------
 * Decode attention over the paged KV cache: one query token per row.
 * q bf16 [B, H, D] contiguous, D a multiple of 32; k_cache / v_cache bf16 with token stride `tok_stride`
 * (elements between consecutive slots; slot = block * block_size + offset) and head
 * stride D; block_tables int32 [B, ldt]; seq_lens int32 [B]; out bf16 [B, H, D].
 * Each (row, kv head) task keeps its G = H / Hkv query heads' running max, sum and
 * output in fp32 (online softmax), one block of keys at a time. A row of length 0
 * (bucket padding) writes zeros. window > 0 limits each row to its last `window` keys.
 * ------------------------------------------------------------------------------------------- */

#define MAX_GROUP 16
#define MAX_DIM 256
#define KEYS 16  /* keys scored at once (one vector of scores) */
#define SPAN 256 /* keys per online-softmax update */
#define AHEAD 2   /* chunks of keys ahead that whole tokens are prefetched (attend_task's `whole`) */

/* Sixteen vectors in, one out: lane i = the sum of v[i]'s 16 lanes. A transposing tree
 * (31 shuffles for 16 sums) instead of 16 horizontal reductions (64 shuffles, each a
 * dependency chain): the scores of a block of keys come out as one vector. */
TARGET static inline __m512 sum16x16(const __m512 *v) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; i++)  /* 128-bit quarters: [v2i(q0+q2), v2i(q1+q3), v2i+1(q0+q2), v2i+1(q1+q3)] */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  /* quarter j holds four partial sums of key 4i + j */
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    __m512 y0 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
    __m512 y1 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
    __m512d a = _mm512_castps_pd(y0), b = _mm512_castps_pd(y1);
    /* lane 4j + e now holds the sum of key 4e + j */
    __m512 z = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, z);
}

/* 32 bf16 at p as two fp32 vectors without a shuffle: the even elements (2j -> lane j)
 * and the odd ones. Keys and values are read this way; the query and the output use
 * the same split layout, so nothing is reordered per key. */
TARGET static inline void bf16x32_split(const uint16_t *p, __m512 *even, __m512 *odd) {
    __m512i x = _mm512_loadu_si512((const void *)p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
}

/* An int8 cache (rtp/engine/kv_cache.py, --kv-cache-dtype int8) holds each token's K and V rows of
 * every kv head as D int8 values q with one fp32 scale s per (token, kv head): the row is s * q
 * (symmetric absmax / 127, written by rtp_rope_store_kv). Decode attention multiplies the int8
 * values as they are and applies the scales once per key: a key's score is s_k * (q . k_int8),
 * and a value's probability p becomes p * s_v before the value row is accumulated. (Rounding the
 * query to int16 for vpmaddwd products was no faster in a noisy A/B here, so it stays out.) */
typedef struct {
    const char *k, *v;       /* K and V rows of slot s, kv head h: at s * tok_bytes + h * head_bytes */
    int64_t tok_bytes, head_bytes;
    const float *ks, *vs;    /* int8 caches: their scales, slot s, kv head h at s * hkv + h; else NULL */
    int64_t hkv, block_size;
} kv_view;

/* 16 int8 at p as 16 fp32 (exact). */
TARGET static inline __m512 i8x16_to_f32(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* Addresses of the K and V rows of keys [t0, min(t0 + KEYS, len)) of kv head h, and with an int8
 * cache their scales (0 past the last key): one division per call, not one per key. Returns
 * their count. */
static inline __attribute__((always_inline)) int64_t key_rows(const kv_view *kv, const int32_t *table, int64_t h,
                                                              int64_t t0, int64_t len, const char **kp,
                                                              const char **vp, float *ks, float *vs, const int I8) {
    int64_t n = len - t0 < KEYS ? len - t0 : KEYS;
    if (n <= 0) return 0;
    int64_t blk = t0 / kv->block_size, off = t0 - blk * kv->block_size, head = h * kv->head_bytes;
    /* within a block the slots run on: a key's rows are the last key's plus a token, and the block
     * table is read (and the slot multiplied out) once a block rather than once a key. The same
     * addresses; on AMD Zen 4 (tools/bench_decode_attention.py, alternated three times) 64 rows x
     * 1,024 keys from memory 2.32-2.39 -> 2.12-2.23 ms a layer, 4 x 256 on one thread from L2
     * 0.053-0.054 -> 0.050-0.052 */
    int64_t slot = 0, at = 0; /* at: the key's rows' byte offset in the K and V caches */
    for (int64_t i = 0; i < n; i++, slot++, at += kv->tok_bytes) {
        if (i == 0 || off == 0) { /* the first key, or a block's first slot */
            slot = (int64_t)table[blk] * kv->block_size + off;
            at = slot * kv->tok_bytes + head;
        }
        kp[i] = kv->k + at;
        vp[i] = kv->v + at;
        if (I8) {
            ks[i] = kv->ks[slot * kv->hkv + h];
            vs[i] = kv->vs[slot * kv->hkv + h];
        }
        if (++off == kv->block_size) {
            off = 0;
            blk++;
        }
    }
    if (I8)
        for (int64_t i = n; i < KEYS; i++) ks[i] = vs[i] = 0.0f;
    return n;
}

/* Prefetch the `bytes` bytes of a K or V row. */
TARGET static inline void prefetch_row(const char *row, int64_t bytes, int hint_l2) {
    for (int64_t c = 0; c < bytes; c += 64) {
        if (hint_l2) rtp_prefetch_l2(row + c);
        else rtp_prefetch_l1(row + c);
    }
}

/* The 32 elements of chunk c of a K or V row as two fp32 vectors: for bf16 the even/odd split
 * below, for int8 (I8) elements 0-15 and 16-31 as they lie (a sign extension converts them in
 * order as cheaply). The query and the output use the same layout as the keys and values. */
TARGET static inline __attribute__((always_inline)) void row_chunk(const char *row, int64_t c, __m512 *lo,
                                                                   __m512 *hi, const int I8) {
    if (I8) {
        *lo = i8x16_to_f32((const int8_t *)row + 32 * c);
        *hi = i8x16_to_f32((const int8_t *)row + 32 * c + 16);
    } else {
        bf16x32_split((const uint16_t *)row + 32 * c, lo, hi);
    }
}

/* Long rows: a row past RTP_ATTN_PART keys is attended in parts of at most that many keys, as tasks of their
 * own so one long row keeps every thread busy, each part's state written as RTP_ATTN_PART_FLOATS(G, D)
 * floats per kv head (m and l of its G query heads, base 2, padded to 16 floats; then their G x D
 * unnormalized outputs in dim order), then merged. Parts are set by positions alone, so a row's
 * output does not depend on its batch (speculative verification relies on it). */
#define RTP_ATTN_PART 512
#define RTP_ATTN_PART_OUT(G) ((2 * (G) + 15) / 16 * 16)  /* where a part's outputs start */
#define RTP_ATTN_PART_FLOATS(G, D) (RTP_ATTN_PART_OUT(G) + (G) * (D))
/* The parts of a row of len keys past RTP_ATTN_PART: as many as it takes at most RTP_ATTN_PART keys each,
 * made even (so that the parts of a lone row split evenly over two threads) and of equal size: a row of
 * 700 keys goes 350 + 350 rather than 512 + 188, of 1,100 275 x 4. Set by the row's length alone. */
static inline int64_t attention_parts(int64_t len) {
    int64_t n = (len + RTP_ATTN_PART - 1) / RTP_ATTN_PART;
    return n > 1 ? n + n % 2 : n;
}
static inline int64_t attention_part_keys(int64_t len) {
    int64_t n = attention_parts(len);
    return n > 1 ? (len + n - 1) / n : RTP_ATTN_PART;
}

/* The first key a row of len keys attends (window 0: no sliding window). */
static inline int64_t window_start(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

/* The next task's keys, streamed into L2 while this task computes. A row's K and V rows of every kv head
 * (768 bytes a token for SmolLM2) are read from memory by its first kv head and from L2 by the others, so
 * with each task pulling its own tokens, memory sat idle through two thirds of every task and the first
 * head's loop waited on it. Each thread claims its next task before it starts the current one
 * (rtp_paged_decode_attention_bf16) and spreads the next task's tokens over the current task's score loops,
 * at the pace of its key visits, so the next task finds them in L2 and memory streams throughout. */
typedef struct {
    const int32_t *table;   /* the next task's block table */
    int64_t start, at, end; /* the next task's first token, the next to prefetch, one past its last */
    int64_t visits, done;   /* this task's key visits (kv heads x keys), and those made so far */
} key_stream;

/* Prefetch the next task's tokens [s->at, upto) into L2: every kv head's K and V rows (and an int8
 * cache's scales). */
TARGET static inline void stream_tokens(key_stream *s, const kv_view *kv, int64_t upto) {
    if (upto > s->end) upto = s->end;
    for (; s->at < upto; s->at++) {
        int64_t blk = s->at / kv->block_size;
        int64_t slot = (int64_t)s->table[blk] * kv->block_size + (s->at - blk * kv->block_size);
        for (int64_t c = 0; c < kv->tok_bytes; c += 64) {
            rtp_prefetch_l2(kv->k + slot * kv->tok_bytes + c);
            rtp_prefetch_l2(kv->v + slot * kv->tok_bytes + c);
        }
        if (kv->ks) {
            rtp_prefetch_l2(kv->ks + slot * kv->hkv);
            rtp_prefetch_l2(kv->vs + slot * kv->hkv);
        }
    }
}

/* One (row, kv head) task. Always inlined into call sites with constant G, NC and I8, so the
 * compiler unrolls the head and dimension loops and keeps the accumulators in registers
 * (with them as variables every accumulator lived on the stack: 3x slower).
 *
 * The K/V stream is prefetched a key at a time among the math, never in bursts: a burst of a
 * chunk's 32 lines outran the core's 16 line-fill buffers and stalled everything behind it
 * (40 % of the kernel's samples sat on prefetch instructions). The dot products, long on
 * math, carry the next chunk's K rows and this chunk's V rows; the values pass, short on math,
 * carries the next kv head's K rows of the same keys (next_head: the task goes on to it). */
TARGET static inline __attribute__((always_inline)) void attend_task(
        const uint16_t *q, const kv_view *kv, const int32_t *table, int64_t len, int64_t k_lo, int64_t k_hi,
        uint16_t *o, float *part, int64_t b, int64_t h, int64_t H, int64_t D, float scale, int64_t window, float softcap,
        const int64_t G, const int64_t NC, int next_head, int whole_tokens, key_stream *stream, const int I8,
        __m512 *acc) {
    int64_t first = window_start(len, window);
    if (first < k_lo) first = k_lo; /* a part of a long row (RTP_ATTN_PART): its keys alone */
    int64_t row_bytes = kv->head_bytes;
    /* With whole_tokens, the task's first of several kv heads streams whole tokens (every head's K and
     * V rows) into L2, AHEAD chunks of keys on; the other heads then find them there. On AMD Zen 4,
     * where a chunk's math is shorter than a trip to DRAM, 64 rows at 256 keys: 1.13-1.19 -> 0.82-0.85
     * ms a layer (AHEAD 1: 0.89-0.92, 4: 0.93-0.98), 4 rows at 2,048: 0.67 -> 0.43 ms; 16 rows at
     * 2,048 unchanged. Not measured on the Intel AMX machine, where prefetch bursts outran the line fill
     * buffers (above): off there (rtp_paged_decode_attention_bf16) until they are. */
    int whole = whole_tokens && next_head && h == 0;
    const __m512 capv = _mm512_set1_ps(softcap), inv_capv = _mm512_set1_ps(softcap > 0.0f ? 1.0f / softcap : 0.0f);
    /* The query: for a bf16 cache as it lies, 32 bf16 a chunk, whose dot products with a key's row take
     * vdpbf16ps (two exact products a lane, summed in fp32; the scale goes on the summed scores); for
     * an int8 cache (I8) scaled fp32 in the keys' layout (row_chunk), for fp32 FMAs. The output
     * accumulators are in the values' layout (row_chunk). */
    __m512bh qb[MAX_GROUP][MAX_DIM / 32];
    __m512 qe[MAX_GROUP][MAX_DIM / 32], qo[MAX_GROUP][MAX_DIM / 32];
    /* The output accumulators stay in registers only when GCC can split them into scalars: acc is the
     * caller's 2 G NC vectors, sized for the constant G and NC it inlines this with (arrays sized for
     * MAX_GROUP and MAX_DIM, 16 KiB, were past its limit), every loop over g that touches them is
     * unrolled (constant indices), and no libm call sits in the span loop (below). Before, every FMA
     * of the values pass loaded and stored its accumulator on the stack: from L2, one thread, 16 rows x
     * 512 keys 0.39-0.41 -> 0.27-0.28 ms; 64 rows x 256 keys from memory 1.29-1.32 -> 1.01 ms. */
#define AE(g, c) acc[(g) * NC + (c)]
#define AO(g, c) acc[(G + (g)) * NC + (c)]
    float m[MAX_GROUP], l[MAX_GROUP];
    const __m512 scalev = _mm512_set1_ps(scale);
    #pragma GCC unroll 16
    for (int64_t g = 0; g < G; g++) {
        const uint16_t *qr = q + (b * H + h * G + g) * D;
        for (int64_t c = 0; c < NC; c++) {
            if (I8) {
                qe[g][c] = _mm512_mul_ps(bf16x16_to_f32(qr + 32 * c), scalev);
                qo[g][c] = _mm512_mul_ps(bf16x16_to_f32(qr + 32 * c + 16), scalev);
            } else {
                qb[g][c] = (__m512bh)_mm512_loadu_si512((const void *)(qr + 32 * c));
            }
            AE(g, c) = AO(g, c) = _mm512_setzero_ps();
        }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    /* Keys go in spans of SPAN: all scores of a span first (16 at a time), then one softmax
     * update per span (max, exp and sum as whole-vector passes), then the values. An update
     * per 16 keys spent more time in its reduction chains than in the dot products. */
    for (int64_t s0 = first; s0 < k_hi; s0 += SPAN) {
        int64_t ns = k_hi - s0 < SPAN ? k_hi - s0 : SPAN;
        int64_t nch = (ns + KEYS - 1) / KEYS;
        __m512 sc[MAX_GROUP][SPAN / KEYS]; /* scores, then probabilities; 0 past the end */
        const char *kp[KEYS], *vp[KEYS], *nkp[KEYS], *nvp[KEYS];
        float ks[KEYS], vs[KEYS], nks[KEYS], nvs[KEYS]; /* int8: the keys' K and V scales */
        key_rows(kv, table, h, s0, s0 + ns, kp, vp, ks, vs, I8);
        for (int64_t ch = 0; ch < nch; ch++) {
            int64_t nt = ns - ch * KEYS < KEYS ? ns - ch * KEYS : KEYS;
            int64_t nn = key_rows(kv, table, h, s0 + (ch + 1) * KEYS, s0 + ns, nkp, nvp, nks, nvs, I8);
            const char *fkp[KEYS], *fvp[KEYS];
            int64_t nf = whole ? key_rows(kv, table, 0, s0 + (ch + AHEAD) * KEYS, k_hi, fkp, fvp, NULL, NULL, 0) : 0;
            /* the next task's tokens this chunk streams: its share of them by this task's key visits */
            int64_t from = 0, quota = 0;
            if (stream) {
                int64_t total = stream->end - stream->start;
                stream->done += nt;
                from = stream->at;
                quota = (stream->done * total + stream->visits - 1) / stream->visits - (from - stream->start);
            }
            /* per key and query head a vector of partial dot products, summed 16 at once */
            __m512 part[MAX_GROUP][KEYS];
            for (int64_t i = 0; i < KEYS; i++) {
                if (i < nn) prefetch_row(nkp[i], row_bytes, 0);
                if (i < nt) prefetch_row(vp[i], row_bytes, 0);
                if (i < nf) {
                    prefetch_row(fkp[i], kv->tok_bytes, 1);
                    prefetch_row(fvp[i], kv->tok_bytes, 1);
                }
                if (quota > 0) stream_tokens(stream, kv, from + quota * (i + 1) / KEYS);
                if (i >= nt) {
                    for (int64_t g = 0; g < G; g++) part[g][i] = _mm512_setzero_ps();
                    continue;
                }
                if (!I8) {
                    __m512bh kr[MAX_DIM / 32];
                    for (int64_t c = 0; c < NC; c++) kr[c] = (__m512bh)_mm512_loadu_si512((const void *)(kp[i] + 64 * c));
                    for (int64_t g = 0; g < G; g++) {
                        __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), kr[0], qb[g][0]);
                        for (int64_t c = 1; c < NC; c++) d = _mm512_dpbf16_ps(d, kr[c], qb[g][c]);
                        part[g][i] = d;
                    }
                    continue;
                }
                __m512 ke[MAX_DIM / 32], ko[MAX_DIM / 32];
                for (int64_t c = 0; c < NC; c++) row_chunk(kp[i], c, &ke[c], &ko[c], I8);
                for (int64_t g = 0; g < G; g++) {
                    __m512 d = _mm512_mul_ps(qe[g][0], ke[0]);
                    d = _mm512_fmadd_ps(qo[g][0], ko[0], d);
                    for (int64_t c = 1; c < NC; c++) {
                        d = _mm512_fmadd_ps(qe[g][c], ke[c], d);
                        d = _mm512_fmadd_ps(qo[g][c], ko[c], d);
                    }
                    part[g][i] = d;
                }
            }
            __mmask16 valid = (__mmask16)((1u << nt) - 1);
            for (int64_t g = 0; g < G; g++) {
                __m512 s = sum16x16(part[g]);
                /* int8: each key's scale, once per score; bf16: the softmax scale */
                s = _mm512_mul_ps(s, I8 ? _mm512_loadu_ps(ks) : scalev);
                if (softcap > 0.0f) /* Gemma 2: cap * tanh(s / cap), 16 scores at once, before the mask */
                    s = softcap_ps(_mm512_mul_ps(s, inv_capv), capv);
                sc[g][ch] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, s);
            }
            memcpy(kp, nkp, sizeof(kp));
            memcpy(vp, nvp, sizeof(vp));
            if (I8) memcpy(ks, nks, sizeof(ks));
        }
        __mmask16 last = (__mmask16)((1u << (ns - (nch - 1) * KEYS)) - 1);
        #pragma GCC unroll 16
        for (int64_t g = 0; g < G; g++) {
            /* no call to libm here (expf, fmaxf): a call clobbers every vector register, and with one
             * in the span loop GCC kept the value accumulators on the stack, a load and a store
             * around every FMA of the values pass */
            __m512 mx = _mm512_set1_ps(m[g]);
            for (int64_t ch = 0; ch < nch; ch++) mx = _mm512_max_ps(mx, sc[g][ch]);
            float mnew = _mm512_reduce_max_ps(mx);
            /* the first span: exp_ps(-inf) is e^-87, and it scales zeros */
            __m512 cv = exp_ps(_mm512_set1_ps(m[g] - mnew)), mv = _mm512_set1_ps(mnew), sum = _mm512_setzero_ps();
            float corr = _mm512_cvtss_f32(cv);
            for (int64_t ch = 0; ch < nch; ch++) {
                __m512 p = exp_ps(_mm512_sub_ps(sc[g][ch], mv));
                if (ch == nch - 1) p = _mm512_maskz_mov_ps(last, p);
                sc[g][ch] = p;
                sum = _mm512_add_ps(sum, p);
            }
            l[g] = l[g] * corr + _mm512_reduce_add_ps(sum);
            m[g] = mnew;
            for (int64_t c = 0; c < NC; c++) {
                AE(g, c) = _mm512_mul_ps(AE(g, c), cv);
                AO(g, c) = _mm512_mul_ps(AO(g, c), cv);
            }
        }
        /* values: each read once, accumulated into all G outputs */
        key_rows(kv, table, h, s0, s0 + ns, kp, vp, ks, vs, I8);
        for (int64_t ch = 0; ch < nch; ch++) {
            int64_t nt = ns - ch * KEYS < KEYS ? ns - ch * KEYS : KEYS;
            key_rows(kv, table, h, s0 + (ch + 1) * KEYS, s0 + ns, nkp, nvp, nks, nvs, I8);
            if (I8) /* p s_v: the value scales ride on the probabilities, 16 at once */
                for (int64_t g = 0; g < G; g++) sc[g][ch] = _mm512_mul_ps(sc[g][ch], _mm512_loadu_ps(vs));
            for (int64_t i = 0; i < nt; i++) {
                if (next_head) prefetch_row(kv->k + (vp[i] - kv->v) + row_bytes, row_bytes, 1);
                __m512 ve[MAX_DIM / 32], vo[MAX_DIM / 32];
                for (int64_t c = 0; c < NC; c++) row_chunk(vp[i], c, &ve[c], &vo[c], I8);
                #pragma GCC unroll 16
                for (int64_t g = 0; g < G; g++) {
                    __m512 pi = _mm512_set1_ps(((const float *)&sc[g][ch])[i]);
                    for (int64_t c = 0; c < NC; c++) {
                        AE(g, c) = _mm512_fmadd_ps(pi, ve[c], AE(g, c));
                        AO(g, c) = _mm512_fmadd_ps(pi, vo[c], AO(g, c));
                    }
                }
            }
            memcpy(vp, nvp, sizeof(vp));
            if (I8) memcpy(vs, nvs, sizeof(vs));
        }
    }
    /* back to element order (bf16: interleave even and odd lanes), round to bf16 */
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    if (part) { /* a part's state (RTP_ATTN_PART, above): m in base 2, the sums, the outputs unnormalized */
        int64_t at = RTP_ATTN_PART_OUT(G);
        #pragma GCC unroll 16
        for (int64_t g = 0; g < G; g++) {
            part[g] = m[g] * 1.44269504088896341f;
            part[G + g] = l[g];
            for (int64_t c = 0; c < NC; c++) {
                _mm512_storeu_ps(part + at + g * D + 32 * c,
                                 I8 ? AE(g, c) : _mm512_permutex2var_ps(AE(g, c), lo, AO(g, c)));
                _mm512_storeu_ps(part + at + g * D + 32 * c + 16,
                                 I8 ? AO(g, c) : _mm512_permutex2var_ps(AE(g, c), hi, AO(g, c)));
            }
        }
        return;
    }
    #pragma GCC unroll 16
    for (int64_t g = 0; g < G; g++) {
        __m512 inv = _mm512_set1_ps(1.0f / l[g]);
        for (int64_t c = 0; c < NC; c++) {
            __m512 e = _mm512_mul_ps(AE(g, c), inv), od = _mm512_mul_ps(AO(g, c), inv);
            __m256bh r0 = _mm512_cvtneps_pbh(I8 ? e : _mm512_permutex2var_ps(e, lo, od));
            __m256bh r1 = _mm512_cvtneps_pbh(I8 ? od : _mm512_permutex2var_ps(e, hi, od));
            _mm256_storeu_si256((__m256i *)(o + g * D + 32 * c), (__m256i)r0);
            _mm256_storeu_si256((__m256i *)(o + g * D + 32 * c + 16), (__m256i)r1);
        }
    }
#undef AE
#undef AO
}

/* The calling thread's buffer for long rows' parts (scratch.h). */
static __thread rtp_scratch parts_scratch;

/* The parts [p_lo, p_hi) of one (row, kv head) merged into its G output rows (bf16): every part's sums
 * and outputs rescaled to the largest running max. acc: D floats of scratch. */
TARGET static void merge_attention_parts(const float *parts, int64_t part_stride, int64_t p_lo, int64_t p_hi,
                                         int64_t G, int64_t D, float *acc, uint16_t *out) {
    int64_t at = RTP_ATTN_PART_OUT(G);
    for (int64_t g = 0; g < G; g++) {
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t p = p_lo; p < p_hi; p++) mx = fmaxf(mx, parts[p * part_stride + g]);
        memset(acc, 0, (size_t)D * sizeof(float));
        for (int64_t p = p_lo; p < p_hi; p++) {
            const float *st = parts + p * part_stride;
            float f = exp2f(st[g] - mx);
            sum += st[G + g] * f;
            __m512 fv = _mm512_set1_ps(f);
            for (int64_t d = 0; d < D; d += 16)
                _mm512_storeu_ps(acc + d,
                                 _mm512_fmadd_ps(_mm512_loadu_ps(st + at + g * D + d), fv, _mm512_loadu_ps(acc + d)));
        }
        __m512 inv = _mm512_set1_ps(1.0f / sum);
        for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i *)(out + g * D + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + d), inv)));
    }
}

/* Decode attention's tasks: the short rows' (row, or row and kv head) first, then the long rows' parts
 * (RTP_ATTN_PART), each row's kv heads split alike. */
typedef struct {
    const int32_t *seq_lens;
    int64_t B, per_row, Hkv, nparts, short_tasks, window;
} attention_tasks;

typedef struct {
    int run;           /* whether the task attends keys; if not and zero, its row is empty: zeros out */
    int zero;
    int64_t b, h0, h1; /* its row and kv heads [h0, h1) */
    int64_t p;         /* its part of a long row, or -1 */
    int64_t len, k_lo, k_hi;
    int64_t first;     /* its first key: k_lo, or later where a sliding window starts later */
} attention_task;

static inline attention_task attention_task_at(const attention_tasks *ts, int64_t task) {
    attention_task t = {0};
    int64_t long_part = task >= ts->short_tasks, u = long_part ? task - ts->short_tasks : task;
    int64_t p = long_part ? u % ts->nparts : -1, ru = long_part ? u / ts->nparts : u;
    t.b = ru / ts->per_row;
    t.h0 = ts->per_row == 1 ? 0 : ru % ts->per_row;
    t.h1 = ts->per_row == 1 ? ts->Hkv : t.h0 + 1;
    t.p = p;
    t.len = ts->seq_lens[t.b];
    int64_t keys = attention_part_keys(t.len);
    t.k_lo = long_part ? p * keys : 0;
    if (!long_part) {
        if (ts->nparts && t.len > RTP_ATTN_PART) return t;
        if (t.len <= 0) {
            t.zero = t.h0 == 0;
            return t;
        }
    } else if (t.len <= RTP_ATTN_PART || t.k_lo >= t.len || t.k_lo + keys <= window_start(t.len, ts->window)) {
        return t; /* no keys of the row in this part */
    }
    t.k_hi = p >= 0 && t.k_lo + keys < t.len ? t.k_lo + keys : t.len;
    t.first = window_start(t.len, ts->window);
    if (t.first < t.k_lo) t.first = t.k_lo;
    t.run = 1;
    return t;
}

/* k_scales / v_scales NULL: bf16 caches; else int8 caches (kv_view above), the scales fp32 [slots, Hkv]
 * (token stride Hkv). tok_stride counts the cache's elements either way. softcap > 0: each scaled
 * score becomes softcap * tanh(score / softcap) before the softmax (Gemma 2's attention logit
 * softcapping); 0: none, and the test on it sits outside the dot products' loops. */
TARGET void rtp_paged_decode_attention_bf16(
        const uint16_t *q, const void *k_cache, const void *v_cache, int64_t tok_stride,
        const int32_t *block_tables, int64_t ldt, const int32_t *seq_lens, uint16_t *out,
        int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size, float scale, int64_t window,
        const float *k_scales, const float *v_scales, float softcap) {
    int64_t G = H / Hkv;
    int64_t nc = D / 32; /* D is a multiple of 32, at most MAX_DIM */
    int i8 = k_scales != NULL;
    int64_t esize = i8 ? 1 : 2;
    const kv_view kv = {(const char *)k_cache, (const char *)v_cache, tok_stride * esize, D * esize,
                        k_scales, v_scales, Hkv, block_size};
    /* rows past RTP_ATTN_PART keys: a task per (row, part), or (row, kv head, part) as short rows
     * split, merged after. tools/bench_decode_step.py at context 2,048: one row's attention
     * 2.72-2.84 -> 2.20-2.28 ms, 16 rows' 43.5-44.7 -> 40.3-41.4 ms; an int8 cache's one row
     * 2.24-2.36 -> 1.98-2.05 ms. (Both products on AMX tiles, P as bf16 hi + lo for fidelity, measured
     * no faster with the same parts: 2.14-2.17 and 42.5-43.7 ms. The KV reads bound it.) */
    int64_t max_long = 0, units = 0; /* units: the rows and long rows' parts, the tasks of whole rows */
    for (int64_t b = 0; b < B; b++) {
        if (seq_lens[b] > RTP_ATTN_PART && seq_lens[b] > max_long) max_long = seq_lens[b];
        units += seq_lens[b] > RTP_ATTN_PART ? attention_parts(seq_lens[b]) : 1;
    }
    int64_t nparts = attention_parts(max_long), part_stride = RTP_ATTN_PART_FLOATS(G, D);
    int64_t row_stride = Hkv * nparts * part_stride;
    float *parts = nparts ? rtp_scratch_get(&parts_scratch, (size_t)(B * row_stride) * sizeof(float)) : NULL;
    if (!parts) { /* no memory for the parts: whole rows, as short ones */
        nparts = 0;
        units = B;
    }
    int whole_tokens = !rtp_amx_supported(); /* attend_task's token prefetch: measured on AMD Zen 4 only */
    /* One task per row (or part of a long row), its kv heads in turn: a token's K (and V) row of all
     * heads is one contiguous run, so the row's blocks stream through whole (a task per head read a
     * third of each run and got 9 GB/s from DRAM; per row, more). With fewer such tasks than threads,
     * one task per (row, kv head) instead, or a lone row would leave threads idle. Where the tokens
     * are streamed (whole_tokens), a task per row wins as soon as every thread has one: on AMD Zen 4,
     * alternated in one process, 30 layers from memory, 1.31-1.78x at 1-3 rows of 256-4,096 keys (one
     * row of 2,048 keys 0.195 -> 0.121 ms a layer; 2 rows of 256 0.029 -> 0.021), the same bits; a
     * lone short row stays split by head (1.2-1.4x faster so). On the Intel AMX machine, where nothing is
     * streamed and this rule is not measured, a task per row from two rows per thread, as before. */
    int64_t per_row = (whole_tokens ? units < omp_get_max_threads() : B < 2 * omp_get_max_threads()) ? Hkv : 1;
    int64_t short_tasks = B * per_row;
    /* a task streams the next one's tokens (key_stream) where tasks are whole rows, as whole_tokens */
    int stream_next = whole_tokens && per_row == 1;
    int64_t ntasks = short_tasks + B * per_row * nparts, next_task = 0;
    const attention_tasks tasks = {seq_lens, B, per_row, Hkv, nparts, short_tasks, window};
#pragma omp parallel
    {
        unsigned csr = rtp_flush_denormals();
        /* dynamic scheduling a task at a time, each thread one claim ahead, so that it knows its next task */
        int64_t cur = __atomic_fetch_add(&next_task, 1, __ATOMIC_RELAXED);
        int streamed = 0; /* whether cur's tokens were streamed by the task before */
        while (cur < ntasks) {
            int64_t nxt = __atomic_fetch_add(&next_task, 1, __ATOMIC_RELAXED);
            attention_task t = attention_task_at(&tasks, cur), following = {0};
            if (nxt < ntasks) following = attention_task_at(&tasks, nxt);
            key_stream ks = {0}, *stream = NULL;
            if (stream_next && t.run && following.run) {
                ks.start = ks.at = following.first;
                ks.end = following.k_hi;
                ks.visits = (t.h1 - t.h0) * (t.k_hi - t.first);
                ks.table = block_tables + following.b * ldt;
                if (ks.end > ks.start && ks.visits > 0) stream = &ks;
            }
            if (!t.run && t.zero) memset(out + t.b * H * D, 0, (size_t)(H * D) * sizeof(uint16_t));
            for (int64_t h = t.h0; t.run && h < t.h1; h++) {
                int64_t b = t.b, len = t.len, k_lo = t.k_lo, k_hi = t.k_hi, p = t.p;
                const int32_t *table = block_tables + b * ldt;
                uint16_t *o = out + (b * H + h * G) * D;
                float *part = p >= 0 ? parts + b * row_stride + (h * nparts + p) * part_stride : NULL;
                int whole = whole_tokens && !streamed; /* a streamed task's tokens are in L2 already */
/* each call site holds its accumulators (attend_task's acc), sized for its constant G and NC */
#define ATTEND_WITH(g, n, ACC_VECTORS)                                                                          \
    do {                                                                                                        \
        __m512 acc[ACC_VECTORS];                                                                                \
        if (i8)                                                                                                 \
            attend_task(q, &kv, table, len, k_lo, k_hi, o, part, b, h, H, D, scale, window, softcap, g, n,      \
                        h + 1 < t.h1, whole, stream, 1, acc);                                                   \
        else                                                                                                    \
            attend_task(q, &kv, table, len, k_lo, k_hi, o, part, b, h, H, D, scale, window, softcap, g, n,      \
                        h + 1 < t.h1, whole, stream, 0, acc);                                                   \
    } while (0)
#define ATTEND(g, n) ATTEND_WITH(g, n, 2 * (g) * (n))
                /* head_dim 64 or 128 with the usual group sizes get their own unrolled copy */
                switch (G * 16 + nc) {
                case 1 * 16 + 2: ATTEND(1, 2); break;
                case 2 * 16 + 2: ATTEND(2, 2); break;
                case 3 * 16 + 2: ATTEND(3, 2); break;
                case 4 * 16 + 2: ATTEND(4, 2); break;
                case 5 * 16 + 2: ATTEND(5, 2); break;
                case 6 * 16 + 2: ATTEND(6, 2); break;
                case 8 * 16 + 2: ATTEND(8, 2); break;
                case 1 * 16 + 4: ATTEND(1, 4); break;
                case 2 * 16 + 4: ATTEND(2, 4); break;
                case 4 * 16 + 4: ATTEND(4, 4); break;
                case 6 * 16 + 4: ATTEND(6, 4); break;
                case 8 * 16 + 4: ATTEND(8, 4); break;
                default: ATTEND_WITH(G, nc, 2 * MAX_GROUP * (MAX_DIM / 32)); break;
                }
            }
#undef ATTEND
#undef ATTEND_WITH
            streamed = stream != NULL;
            cur = nxt;
        }
#pragma omp barrier
        if (nparts) {
            float acc[MAX_DIM] __attribute__((aligned(64)));
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < B * Hkv; task++) {
                int64_t b = task / Hkv, h = task % Hkv, len = seq_lens[b];
                if (len <= RTP_ATTN_PART) continue;
                /* the parts holding the row's keys: those the part loop above did not skip */
                int64_t keys = attention_part_keys(len);
                int64_t p_lo = window_start(len, window) / keys, p_hi = (len + keys - 1) / keys;
                merge_attention_parts(parts + b * row_stride + h * nparts * part_stride, part_stride, p_lo, p_hi, G, D,
                                      acc, out + (b * H + h * G) * D);
            }
        }
        rtp_restore_denormals(csr);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Residual add + RMSNorm, one pass over each row (the two ops every layer runs twice):
 *   residual[t] += delta[t]              (delta NULL: skip; fp32 or bf16)
 *   out[t] = residual[t] * rsqrt(mean(residual[t]^2) + eps) * weight      (fp32 or bf16 out)
 * residual fp32 [T, H] row stride ldr; weight fp32 or bf16 [H]; H a multiple of 16.
 * ------------------------------------------------------------------------------------------- */
TARGET void rtp_add_rms_norm(float *residual, int64_t ldr, const void *delta, int delta_bf16, int64_t ldd,
                             const void *weight, int weight_bf16, float eps, void *out, int out_bf16,
                             int64_t ldo, int64_t T, int64_t H) {
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++) {
        float *r = residual + t * ldr;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t c = 0; c < H; c += 16) {
            __m512 v = _mm512_loadu_ps(r + c);
            if (delta) {
                __m512 dv = delta_bf16 ? bf16x16_to_f32((const uint16_t *)delta + t * ldd + c)
                                       : _mm512_loadu_ps((const float *)delta + t * ldd + c);
                v = _mm512_add_ps(v, dv);
                _mm512_storeu_ps(r + c, v);
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)H + eps);
        __m512 iv = _mm512_set1_ps(inv);
        for (int64_t c = 0; c < H; c += 16) {
            __m512 w = weight_bf16 ? bf16x16_to_f32((const uint16_t *)weight + c) : _mm512_loadu_ps((const float *)weight + c);
            __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(r + c), iv), w);
            if (out_bf16)
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + t * ldo + c), (__m256i)_mm512_cvtneps_pbh(y));
            else
                _mm512_storeu_ps((float *)out + t * ldo + c, y);
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * After the qkv projection: rotate q and k (RoPE, rotate-half convention, the first `rot`
 * dims of each head, in fp32), write q out and k, v into the paged cache at slot_mapping.
 *   qkv bf16 [T, (H + 2 Hkv) * D] row stride ldq; positions int32 [T];
 *   cos_sin fp32 [max_position, rot] (cos in the first half of a row, sin in the second);
 *   q_out bf16 [T, H, D]; k_cache / v_cache bf16, token stride tok_stride, head stride D,
 *   num_slots slots each; or int8 (k_scales / v_scales not NULL, fp32 [num_slots, Hkv]): each
 *   (token, kv head) row x, rounded to bf16 as the bf16 cache would hold it, is stored as
 *   q = round(x * 127 / absmax(x)) with the scale absmax(x) / 127 (all zeros: q 0, scale 0).
 * rot / 2 is a multiple of 16. The only kernel that stores at addresses taken from data: a slot
 * outside [0, num_slots) would land in whatever memory lies near the cache (weights, another
 * layer's blocks), so its K and V are not written and the call returns 0 (else 1).
 * ------------------------------------------------------------------------------------------- */
TARGET static inline void rope_head(const uint16_t *x, const float *cs, int64_t rot, int64_t D,
                                    uint16_t *dst) {
    int64_t half = rot / 2;
    for (int64_t i = 0; i < half; i += 16) {
        __m512 x1 = bf16x16_to_f32(x + i), x2 = bf16x16_to_f32(x + half + i);
        __m512 c = _mm512_loadu_ps(cs + i), s = _mm512_loadu_ps(cs + half + i);
        /* separate products, as torch computes x1 * cos - x2 * sin (no fused multiply-add) */
        __m512 a = _mm512_sub_ps(_mm512_mul_ps(x1, c), _mm512_mul_ps(x2, s));
        __m512 b = _mm512_add_ps(_mm512_mul_ps(x2, c), _mm512_mul_ps(x1, s));
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(a));
        _mm256_storeu_si256((__m256i *)(dst + half + i), (__m256i)_mm512_cvtneps_pbh(b));
    }
    if (rot < D) memcpy(dst + rot, x + rot, (size_t)(D - rot) * sizeof(uint16_t));
}

/* One row of D bf16 (D a multiple of 16) into the int8 cache: symmetric absmax / 127. */
TARGET static inline void quantize_head(const uint16_t *x, int64_t D, int8_t *dst, float *scale) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(bf16x16_to_f32(x + c)));
    float amax = _mm512_reduce_max_ps(mx);
    __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    *scale = amax / 127.0f;
    for (int64_t c = 0; c < D; c += 16) /* round to nearest even, as torch.round */
        _mm_storeu_si128((__m128i *)(dst + c),
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(bf16x16_to_f32(x + c), inv))));
}

/* An int8 cache holds K times the normalized Sylvester Hadamard matrix H (D a power of two), and q
 * is rotated alike, so every score q.k is what it was: the rotation spreads a head's few large
 * channels over all D, so one absmax scale a row loses far less (SmolLM2-135M: the KL of its
 * next-token distributions from an int8 cache's to an fp32 one's 1.4e-3 -> 3.1e-4). x: D fp32 in
 * place, D a multiple of 16 and a power of two. The butterflies run in the order of
 * rtp.models.attention.hadamard (a + b, a - b per pair, the strides 1, 2, 4, ...), then times
 * (float)(1 / sqrt(D)): the same bits. Within a vector a pair is a lane and its partner lane^h. */
TARGET static inline void hadamard_rows(float *x, int64_t D) {
    __m512 v[MAX_DIM / 16];
    const int64_t n = D / 16;
    for (int64_t j = 0; j < n; j++) v[j] = _mm512_loadu_ps(x + j * 16);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int h = 1; h < 16; h *= 2) {
        const __m512i partner = _mm512_xor_si512(lane, _mm512_set1_epi32(h));
        const __mmask16 upper = _mm512_test_epi32_mask(lane, _mm512_set1_epi32(h)); /* lanes i + h */
        for (int64_t j = 0; j < n; j++) {
            __m512 p = _mm512_permutexvar_ps(partner, v[j]);
            v[j] = _mm512_mask_blend_ps(upper, _mm512_add_ps(v[j], p), _mm512_sub_ps(p, v[j]));
        }
    }
    for (int64_t h = 1; h < n; h *= 2)
        for (int64_t j = 0; j < n; j++)
            if (!(j & h)) {
                __m512 a = v[j], b = v[j + h];
                v[j] = _mm512_add_ps(a, b);
                v[j + h] = _mm512_sub_ps(a, b);
            }
    const __m512 s = _mm512_set1_ps((float)(1.0 / sqrt((double)D)));
    for (int64_t j = 0; j < n; j++) _mm512_storeu_ps(x + j * 16, _mm512_mul_ps(v[j], s));
}

TARGET static inline int rotates_kv(int64_t D) { return D >= 16 && (D & (D - 1)) == 0; }

/* bf16 row -> fp32, rotated (hadamard_rows). */
TARGET static inline void hadamard_bf16(const uint16_t *x, int64_t D, float *out) {
    for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(out + c, bf16x16_to_f32(x + c));
    hadamard_rows(out, D);
}

/* One row of D fp32 into the int8 cache, as quantize_head. */
TARGET static inline void quantize_head_f32(const float *x, int64_t D, int8_t *dst, float *scale) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(x + c)));
    float amax = _mm512_reduce_max_ps(mx);
    __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    *scale = amax / 127.0f;
    for (int64_t c = 0; c < D; c += 16)
        _mm_storeu_si128((__m128i *)(dst + c),
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + c), inv))));
}

TARGET int rtp_rope_store_kv(const uint16_t *qkv, int64_t ldq, const int32_t *positions,
                             const float *cos_sin, int64_t rot, uint16_t *q_out, void *k_cache,
                             void *v_cache, int64_t tok_stride, const int64_t *slots,
                             int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t num_slots,
                             float *k_scales, float *v_scales) {
    int bad = 0;
#pragma omp parallel for schedule(static) if (T >= 16) reduction(| : bad)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *row = qkv + t * ldq;
        const float *cs = cos_sin + (int64_t)positions[t] * rot;
        for (int64_t h = 0; h < H; h++) rope_head(row + h * D, cs, rot, D, q_out + (t * H + h) * D);
        int64_t slot = slots[t];
        if (slot < 0 || slot >= num_slots) {
            bad = 1;
            continue;
        }
        if (k_scales) {
            int8_t *kd = (int8_t *)k_cache + slot * tok_stride, *vd = (int8_t *)v_cache + slot * tok_stride;
            uint16_t rotated[MAX_DIM];
            float spread[MAX_DIM];
            const int spread_k = rotates_kv(D);
            if (spread_k)
                for (int64_t h = 0; h < H; h++) { /* q times H too: the scores stay q.k */
                    uint16_t *qh = q_out + (t * H + h) * D;
                    hadamard_bf16(qh, D, spread);
                    for (int64_t c = 0; c < D; c += 16)
                        _mm256_storeu_si256((__m256i *)(qh + c),
                                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(spread + c)));
                }
            for (int64_t h = 0; h < Hkv; h++) {
                rope_head(row + (H + h) * D, cs, rot, D, rotated);
                if (spread_k) {
                    hadamard_bf16(rotated, D, spread);
                    quantize_head_f32(spread, D, kd + h * D, k_scales + slot * Hkv + h);
                } else {
                    quantize_head(rotated, D, kd + h * D, k_scales + slot * Hkv + h);
                }
                quantize_head(row + (H + Hkv + h) * D, D, vd + h * D, v_scales + slot * Hkv + h);
            }
            continue;
        }
        uint16_t *kd = (uint16_t *)k_cache + slot * tok_stride, *vd = (uint16_t *)v_cache + slot * tok_stride;
        for (int64_t h = 0; h < Hkv; h++) rope_head(row + (H + h) * D, cs, rot, D, kd + h * D);
        memcpy(vd, row + (H + Hkv) * D, (size_t)(Hkv * D) * sizeof(uint16_t));
    }
    return !bad;
}

/* ---------------------------------------------------------------------------------------------
 * The first and the middle op of a layer stack, so that a decode step runs on these kernels
 * alone (rtp/kernels/cpu_graph.py replays it without Python):
 *   embed_rows: out fp32 [T, H] (row stride ldo) = table[ids[t]] (bf16 or fp32, row stride ldt),
 *               times scale unless it is 1 (Gemma's sqrt(hidden_size)), the product rounded to the
 *               table's dtype as torch rounds a bf16 row times a scalar (the fp32 product of two
 *               bf16 values is exact, so one rounding gives torch's bf16 product)
 *   silu_mul:   out bf16 [T, I] = silu(x[:, :I]) * x[:, I:], x bf16 [T, 2I] (row stride ldx);
 *               in fp32, rounded once; I a multiple of 16.
 * ------------------------------------------------------------------------------------------- */
TARGET static void scale_row(float *o, int64_t H, float scale, int round_bf16) {
    const __m512 s = _mm512_set1_ps(scale);
    int64_t c = 0;
    for (; c + 16 <= H; c += 16) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(o + c), s);
        if (round_bf16)
            v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
        _mm512_storeu_ps(o + c, v);
    }
    for (; c < H; c++) {
        float v = o[c] * scale;
        if (round_bf16) {
            uint32_t u = (uint32_t)f32_to_bf16(v) << 16;
            memcpy(&v, &u, 4);
        }
        o[c] = v;
    }
}

TARGET void rtp_embed_rows(const void *table, int table_bf16, int64_t ldt, const int32_t *ids, float *out,
                           int64_t ldo, int64_t T, int64_t H, float scale) {
    for (int64_t t = 0; t < T; t++) {
        float *o = out + t * ldo;
        if (table_bf16) {
            const uint16_t *row = (const uint16_t *)table + (int64_t)ids[t] * ldt;
            int64_t c = 0;
            for (; c + 16 <= H; c += 16) _mm512_storeu_ps(o + c, bf16x16_to_f32(row + c));
            for (; c < H; c++) {
                uint32_t u = (uint32_t)row[c] << 16;
                memcpy(o + c, &u, 4);
            }
        } else {
            memcpy(o, (const float *)table + (int64_t)ids[t] * ldt, (size_t)H * sizeof(float));
        }
        if (scale != 1.0f) scale_row(o, H, scale, table_bf16);
    }
}

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

/* ---------------------------------------------------------------------------------------------
 * Greedy sampling: out[t] = the index of row t's maximum, the first one on ties, or of its first
 * NaN if it has one (NumPy's argmax, which the sampler used before). x fp32 [T, N], row stride
 * ldx; N < 2^31. Each lane keeps the best value and index of its column stripe (strict >, so the
 * earliest wins), then the lanes with the row's maximum give the smallest index. Rows run in
 * parallel: a batch-64 step's logits are 12.6 MB, which one thread read at about 10 GB/s.
 * ------------------------------------------------------------------------------------------- */
TARGET void rtp_argmax_rows(const float *x, int64_t ldx, int64_t T, int64_t N, int64_t *out) {
#pragma omp parallel for schedule(static) if (T >= 4)
    for (int64_t t = 0; t < T; t++) {
        const float *r = x + t * ldx;
        const __m512i step = _mm512_set1_epi32(16);
        __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i best_idx = idx;
        __m512 best = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        for (int64_t c = 0; c < N; c += 16) {
            __mmask16 k = N - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - c)) - 1);
            __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, r + c);
            __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
            best = _mm512_mask_mov_ps(best, gt, v);
            best_idx = _mm512_mask_mov_epi32(best_idx, gt, idx);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            idx = _mm512_add_epi32(idx, step);
        }
        if (nan) {
            int64_t i = 0;
            while (r[i] == r[i]) i++;
            out[t] = i;
            continue;
        }
        __mmask16 top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(_mm512_reduce_max_ps(best)), _CMP_EQ_OQ);
        out[t] = _mm512_mask_reduce_min_epi32(top, best_idx);
    }
}

/* Structured outputs: logits x fp32 [rows of ldx] get -inf wherever the row's token bitmask
 * (int32 words, bit j of word w = token 32w + j allowed; llguidance's and xgrammar's layout)
 * has a 0. Only the R rows listed in `rows` are touched; mask row i belongs to x row rows[i].
 * A word of all ones (every token allowed) is skipped, so the cost follows what the grammar
 * forbids, and each 16-token half of a word is one masked store. */
TARGET void rtp_apply_token_bitmask(float *x, int64_t ldx, const int32_t *mask, int64_t ldm,
                                    const int64_t *rows, int64_t R, int64_t N) {
    const int64_t words = (N + 31) / 32;
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
#pragma omp parallel for schedule(static) if (R >= 4)
    for (int64_t i = 0; i < R; i++) {
        float *r = x + rows[i] * ldx;
        const int32_t *m = mask + i * ldm;
        for (int64_t w = 0; w < words; w++) {
            uint32_t bits = (uint32_t)m[w];
            if (bits == 0xffffffffu) continue;
            int64_t base = w * 32;
            int64_t left = N - base;
            for (int half = 0; half < 2 && left > half * 16; half++) {
                __mmask16 forbid = (__mmask16)(~(bits >> (16 * half)) & 0xffffu);
                int64_t n = left - half * 16;
                if (n < 16) forbid &= (__mmask16)((1u << n) - 1);  /* never past the vocabulary */
                _mm512_mask_storeu_ps(r + base + 16 * half, forbid, ninf);
            }
        }
    }
}

/* out row i = src row idx[i] (row_bytes each; strides in bytes): the rows of a step that sample,
 * gathered for the LM head inside a captured step graph. */
void rtp_gather_rows(const void *src, int64_t src_stride, const int32_t *idx, int64_t n, void *out,
                     int64_t out_stride, int64_t row_bytes) {
    for (int64_t i = 0; i < n; i++)
        memcpy((char *)out + i * out_stride, (const char *)src + (int64_t)idx[i] * src_stride, (size_t)row_bytes);
}

/* A streaming read of `bytes` bytes (a multiple of 256, 64-byte aligned) on every thread, each its
 * share front to back, folded into one word so nothing is optimised away: the memory bandwidth the
 * roofline of tools/bench_roofline.py sets the steps' bytes against. */
TARGET uint64_t rtp_stream_read(const void *buf, int64_t bytes) {
    int64_t n = bytes / 256;
    uint64_t folded = 0;
#pragma omp parallel reduction(^ : folded)
    {
        __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            const __m512i *p = (const __m512i *)((const uint8_t *)buf + i * 256);
            a = _mm512_xor_si512(a, _mm512_load_si512(p));
            b = _mm512_xor_si512(b, _mm512_load_si512(p + 1));
            c = _mm512_xor_si512(c, _mm512_load_si512(p + 2));
            d = _mm512_xor_si512(d, _mm512_load_si512(p + 3));
        }
        __m512i all = _mm512_xor_si512(_mm512_xor_si512(a, b), _mm512_xor_si512(c, d));
        uint64_t words[8] __attribute__((aligned(64)));
        _mm512_store_si512((void *)words, all);
        for (int k = 0; k < 8; k++) folded ^= words[k];
    }
    return folded;
}
