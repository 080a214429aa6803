/* What the linears for one request's rows share (q4_1.c, q4_k.c, u8.c, bf16.c, q8.c).
 *
 * A decode step at a small batch is a stream of weights: every weight is read once
 * and used for a handful of rows, so the bytes read set the pace (about 17 GB/s on
 * this 2-core VM). These kernels multiply a checkpoint's blocks in place (0.6-1.1 bytes
 * per weight instead of bf16's 2), each in tiles of NR weight rows and up to MR_MAX rows
 * of x (FOR_EACH_TILE), compiled for avx512bf16 and only called after
 * rtp_cpu_kernels_supported() said yes.
 */
#ifndef RTP_LINEAR_SMALL_BATCH_H
#define RTP_LINEAR_SMALL_BATCH_H

#include <immintrin.h>
#include <stdint.h>

#include "prefetch.h"
#include "vec_math.h"

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

/* One output element of a linear, in its dtype. */
static inline void store_out(void *out, int64_t at, int out_bf16, float v) {
    if (out_bf16) ((uint16_t *)out)[at] = rtp_f32_to_bf16(v);
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
TARGET static inline void group_sums(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, int group, float *xsum) {
    int64_t ng = K / group;
    for (int64_t i = 0; i < M; i++)
        for (int64_t g = 0; g < ng; g++) {
            __m512 v = bf16x16_to_f32(x + i * ldx + g * group);
            if (group == 32) v = _mm512_add_ps(v, bf16x16_to_f32(x + i * ldx + g * group + 16));
            xsum[i * ng + g] = _mm512_reduce_add_ps(v);
        }
}

#endif
