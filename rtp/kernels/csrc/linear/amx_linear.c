/* Linear layers over GGUF blocks (Q4_1, Q8_0) with Intel AMX, for batches of decode rows.
 *
 * Decode on this machine is bound by the bytes of weights read per step: bf16 weights are
 * 2.4x the bytes of Q4_1 blocks. The AVX-512 kernels in q4_1.c (and beside it) read the blocks but
 * their multiply work grows with the rows, so past a few rows oneDNN's bf16 GEMM wins. Here
 * the blocks are dequantized once per step into 16 x 32 bf16 tiles in L1 and every row of
 * the batch is multiplied on the AMX unit. At 64 rows the kernel does about 1.07 TFLOP/s
 * (tools/bench_decode_step.py), bound by the vector ports the dequantization shares with the
 * tile loads, not by the blocks' bytes: with the weights in L2 the dequantization alone and
 * the tile work alone add up to the whole.
 *
 * The roles are swapped (out^T = W x^T): a weight tile is the AMX "A" operand, whose rows
 * are exactly one GGUF block each (32 consecutive k of one output feature), so the weights
 * need no transposition; the activations, small and reused by every weight tile, are laid
 * out once per call in AMX's pair-interleaved "B" layout.
 *
 * With glu set the weights are an MLP's gate and up projections, their 16-row tiles interleaved
 * (gate tile j, then up tile j: BlockQuantized.tile_layout(glu=True)), and the output is
 * silu(gate) * up, computed as the tiles of a pair leave the accumulators: the gate_up product
 * is never written out and read back by a separate SiLU-and-mul pass.
 *
 * Numerics: each weight is dequantized as (float)q * d (+ m) in fp32, separately rounded
 * (-ffp-contract=off), then rounded to bf16 (nearest even): the same bf16 weights the
 * model holds. Products are exact in fp32 and accumulated in fp32; out fp32 or bf16.
 */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include "cpu_kernels.h"
#include "tile_blocks.h"
#include "amx_tiles.h"
#include "prefetch.h"
#include "scratch.h"
#include "vec_math.h"

#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
/* More rows than this go to amx_gemm.c: a pass here is MT_MAX row tiles, and from 80 rows on the GEMM,
 * dequantizing each weight tile once for all rows, was as fast or faster on every SmolLM2 shape. */
#define RTP_AMX_GEMM_MIN_ROWS 64
#define MT_MAX 4 /* row tiles (of 16) per pass: C tiles 0-3, A tile 4, B tile 5 */

int rtp_amx_supported(void) {
    static int state = -1; /* -1 not probed yet */
    if (state >= 0) return state;
    unsigned a, b, c, d;
    int has = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 24)) && (d & (1u << 22));
    /* Linux hands out the AMX register state only on request (once per process). */
    state = has && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
            && rtp_cpu_kernels_supported();
    return state;
}


/* x rows [m0, m0 + 16) of k block kb in the B layout: row r = the pairs (x[m][2r], x[m][2r+1])
 * of m = m0..m0+15 (zero past M); x bf16, or fp32 rounded to bf16 here (nearest even). */
AMX_TARGET static inline void pack_rows(const void *x, int x_fp32, int64_t ldx, int64_t M, int64_t m0, int64_t kb,
                                        uint32_t *tile) {
    int64_t valid = M - m0 < 16 ? M - m0 : 16;
    __mmask16 mask = (__mmask16)((1u << valid) - 1);
    __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if (x_fp32) {
        __m512i index = _mm512_mullo_epi32(lanes, _mm512_set1_epi32((int)ldx));
        const float *base = (const float *)x + m0 * ldx + kb * 32;
        for (int64_t r = 0; r < 16; r++) {
            __m512 even = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, index, base + 2 * r, 4);
            __m512 odd = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, index, base + 2 * r + 1, 4);
            __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(even));
            __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(odd));
            _mm512_store_si512((void *)(tile + r * 16), _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
        return;
    }
    __m512i index = _mm512_mullo_epi32(lanes, _mm512_set1_epi32((int)(ldx / 2)));
    const uint32_t *base = (const uint32_t *)((const uint16_t *)x + m0 * ldx + kb * 32);
    for (int64_t r = 0; r < 16; r++)
        _mm512_store_si512((void *)(tile + r * 16),
                           _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, index, base + r, 4));
}

/* out[m, n0..n0+15] = tile column m (+ bias), for the valid rows of one row tile */
AMX_TARGET static inline void store_tile(const float *c, int64_t M, int64_t m0, int64_t n0, const float *bias,
                                         void *out, int64_t ldo, int out_bf16) {
    __m512i index = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    __m512 b = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    int64_t valid = M - m0 < 16 ? M - m0 : 16;
    for (int64_t j = 0; j < valid; j++) {
        __m512 v = _mm512_add_ps(_mm512_i32gather_ps(index, c + j, 4), b);
        int64_t m = m0 + j;
        if (out_bf16)
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + m * ldo + n0), (__m256i)_mm512_cvtneps_pbh(v));
        else
            _mm512_storeu_ps((float *)out + m * ldo + n0, v);
    }
}

/* One tile pair's silu(gate) * up, in place in the gate tile (still 16 features x 16 rows: the
 * activation is elementwise, so it runs before the transposing store). Gate and up (+ their
 * biases) are rounded to bf16 first, as the gate_up output is when the two steps run apart,
 * so the result is the same bits. */
AMX_TARGET static inline void silu_mul_tile(float *cg, const float *cu, int64_t n0, const float *bias_g,
                                            const float *bias_u) {
    for (int64_t r = 0; r < 16; r++) {
        __m512 g = _mm512_load_ps(cg + r * 16), u = _mm512_load_ps(cu + r * 16);
        if (bias_g) {
            g = _mm512_add_ps(g, _mm512_set1_ps(bias_g[n0 + r]));
            u = _mm512_add_ps(u, _mm512_set1_ps(bias_u[n0 + r]));
        }
        _mm512_store_ps(cg + r * 16, silu_mul_ps(round_bf16(g), round_bf16(u)));
    }
}

/* One pass of up to MT_MAX row tiles over weight rows n0..n0+15: the tile indices of the AMX
 * instructions are immediates, hence the unrolled cases. */
AMX_TARGET static void tile_pass(int kind, const uint8_t *recs, int64_t nk, const uint32_t *xt, int64_t mt0,
                                 int64_t nmt, uint16_t *wtile, float *cbuf) {
    int64_t rb = record_bytes(kind);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < nk; kb++) {
        const uint8_t *rec = recs + kb * rb;
        for (int64_t off = 0; off < rb; off += 64) rtp_prefetch_l1(rec + 4 * rb + off);
        dequant_tile(kind, rec, wtile);
        _tile_loadd(4, wtile, 64);
        const uint32_t *b = xt + (mt0 * nk + kb) * 256; /* tiles ordered [row tile][k block] */
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (nmt > 1) {
            _tile_loadd(5, b + nk * 256, 64);
            _tile_dpbf16ps(1, 4, 5);
        }
        if (nmt > 2) {
            _tile_loadd(5, b + 2 * nk * 256, 64);
            _tile_dpbf16ps(2, 4, 5);
        }
        if (nmt > 3) {
            _tile_loadd(5, b + 3 * nk * 256, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, cbuf, 64);
    _tile_stored(1, cbuf + 256, 64);
    _tile_stored(2, cbuf + 512, 64);
    _tile_stored(3, cbuf + 768, 64);
}

/* This thread's packed activations (scratch.h; the 64-row down projection packs 192 KiB). */
static __thread rtp_scratch packed_scratch;

/* out [M, N] = x [M, K] bf16 (row stride ldx, even) or fp32 (x_fp32) @ W^T, W [N, K] as GGUF blocks in tile
 * order (kind 0 Q4_1, 1 Q8_0; records above, 64-byte aligned). N a multiple of 16, K of 32.
 * glu: W holds gate and up interleaved by tiles (N = 2 I, I a multiple of 16; bias, if any, is
 * [gate I | up I] as the layer has it) and out bf16 [M, I] = silu(gate) * up.
 * Returns 0 when the scratch memory could not be had, or for glu with an fp32 output. */
AMX_TARGET int rtp_linear_amx(const void *x, int64_t ldx, int x_fp32, int kind, const uint8_t *weights,
                              const float *bias, void *out, int64_t ldo, int out_bf16,
                              int64_t M, int64_t N, int64_t K, int glu) {
    if (glu && (!out_bf16 || N % 32)) return 0;
    kind = rtp_record_kind(kind); /* int8 rows: the same records, multiplied in bf16 on AMX */
    if (M > RTP_AMX_GEMM_MIN_ROWS) return rtp_gemm_amx(x, ldx, x_fp32, kind, weights, bias, out, ldo, out_bf16, M, N, K, glu);
    int64_t nk = K / 32, nmt = (M + 15) / 16, ntiles = N / 16, rb = record_bytes(kind);
    int64_t steps = glu ? ntiles / 2 : ntiles; /* output tiles: one weight tile each, or a pair */
    int ok = 1;
#pragma omp parallel
    {
        /* Each thread packs the whole batch for itself: every weight tile meets every row, and
         * tiles one core packed and the other read cost more than packing twice (measured). */
        uint32_t *xt = (uint32_t *)rtp_scratch_get(&packed_scratch, (size_t)(nmt * nk) * 1024);
        if (xt)
            for (int64_t i = 0; i < nmt * nk; i++) pack_rows(x, x_fp32, ldx, M, (i / nk) * 16, i % nk, xt + i * 256);
        else {
#pragma omp atomic write
            ok = 0;
        }
        uint16_t wtile[16 * 32] __attribute__((aligned(64)));
        float cbuf[2][MT_MAX * 256] __attribute__((aligned(64)));
        rtp_configure_tiles(6);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < steps; t++) {
            if (!xt) continue;
            int64_t n0 = t * 16;
            for (int64_t mt0 = 0; mt0 < nmt; mt0 += MT_MAX) {
                int64_t cnt = nmt - mt0 < MT_MAX ? nmt - mt0 : MT_MAX;
                if (!glu) {
                    tile_pass(kind, weights + t * nk * rb, nk, xt, mt0, cnt, wtile, cbuf[0]);
                    for (int64_t j = 0; j < cnt; j++)
                        store_tile(cbuf[0] + j * 256, M, (mt0 + j) * 16, n0, bias, out, ldo, out_bf16);
                    continue;
                }
                tile_pass(kind, weights + 2 * t * nk * rb, nk, xt, mt0, cnt, wtile, cbuf[0]);
                tile_pass(kind, weights + (2 * t + 1) * nk * rb, nk, xt, mt0, cnt, wtile, cbuf[1]);
                for (int64_t j = 0; j < cnt; j++) {
                    silu_mul_tile(cbuf[0] + j * 256, cbuf[1] + j * 256, n0, bias, bias ? bias + N / 2 : NULL);
                    store_tile(cbuf[0] + j * 256, M, (mt0 + j) * 16, n0, NULL, out, ldo, 1);
                }
            }
        }
        _tile_release();
    }
    return ok;
}
#endif
