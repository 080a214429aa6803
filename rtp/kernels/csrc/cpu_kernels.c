/* CPU kernels for the decode step: what eager PyTorch and oneDNN leave on the table here.
 *
 * A decode step at a small batch is a stream of weights: every weight is read once
 * and used for a handful of rows, so the bytes read set the pace (about 17 GB/s on
 * this 2-core VM). The linear kernels multiply a GGUF checkpoint's Q4_1 / Q8_0
 * blocks in place (0.6-1.1 bytes per weight instead of bf16's 2); two small fused
 * kernels (residual add + RMSNorm, RoPE + KV-cache write) replace a dozen eager ops
 * each. The paged decode attention kernel lives in decode_attention.c.
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
#define MAX_DIM RTP_MAX_HEAD_DIM

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
