/* Linear layers over GGUF blocks on a CPU without AMX (AMD Zen 4: AVX-512 BF16), for every batch of 2
 * rows or more (quant.py's TILE_MIN_ROWS): decode batches, prefill chunks and mixed steps alike, from the same
 * weight records in tile order the AMX kernels read (tile_blocks.h), so that such a CPU needs no dense
 * bf16 copy of the weights either, and every step's linears are rtp kernels a CPU graph replays.
 *
 * The product is vdpbf16ps: per lane, acc += a pair of bf16 times a pair of bf16, in fp32. The roles are
 * those of amx_linear.c (out^T = W x^T):
 *   - the rows of x are the lanes: x is packed once per call, 16 rows at a time, into pair tiles
 *     (k block kb, row r: the pairs (x[m][32 kb + 2 r], x[m][32 kb + 2 r + 1]) of its 16 rows m), shared
 *     by both threads;
 *   - a weight tile is dequantized as it lies (dequant_tile: 16 output features of 32 bf16 each), and
 *     each of its pairs is broadcast from memory into the product with one x vector: 16 accumulators
 *     (one per output feature of the tile) take 16 products per x vector loaded, so the loop is bound by
 *     the products, not the loads, and no weight is ever transposed;
 *   - a thread dequantizes each weight column (16 features, all k) once per call and runs every group
 *     of 16 rows over it, x coming from L2 or L3 at 4 bytes a product-cycle;
 *   - the 16 x 16 sums are transposed once into output rows, for the epilogue (bias, bf16 rounding, and
 *     for an MLP's interleaved gate and up tiles silu(gate) * up, as amx_gemm.c).
 *
 * Numerics: the same bf16 weights as the AMX kernels (dequant_tile), x rounded to bf16 (nearest even),
 * products exact, sums in fp32, a chain per k block and then the blocks' sums (column_product; in another
 * order than AMX's, so not bit-equal to it); a row's bits do not depend on the rows beside it; glu rounds
 * gate and up to bf16 before silu * up as the other kernels do.
 */
#include "cpu_kernels.h"
#include "prefetch.h"
#include "scratch.h"
#include "tile_blocks.h"
#include "vec_math.h"

#include <immintrin.h>
#include <omp.h>
#include <string.h>

/* The calling thread's packed rows, shared by the team; each thread's dequantized weight column. */
static __thread rtp_scratch packed_rows_scratch, column_scratch;

/* Rows [16 g, 16 g + 16) of x (zero past M) as nk pair tiles of 16 x 16 uint32 (above). */
RTP_VEC_TARGET static void pack_group(const void *x, int x_fp32, int64_t ldx, int64_t M, int64_t g, int64_t nk,
                                      uint32_t *dst) {
    uint32_t rows[16 * 16] __attribute__((aligned(64)));
    int64_t valid = M - 16 * g < 16 ? M - 16 * g : 16;
    for (int64_t kb = 0; kb < nk; kb++) {
        for (int64_t m = 0; m < 16; m++) {
            __m512i v = _mm512_setzero_si512();
            if (m < valid) {
                int64_t at = (16 * g + m) * ldx + 32 * kb;
                if (x_fp32) {
                    const float *s = (const float *)x + at;
                    v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + 16), _mm512_loadu_ps(s));
                } else {
                    v = _mm512_loadu_si512((const void *)((const uint16_t *)x + at));
                }
            }
            _mm512_store_si512((void *)(rows + 16 * m), v);
        }
        transpose16x16(rows, dst + kb * 256);
    }
}

/* c [16 rows][16 features] = one group's packed rows xg times one dequantized weight column w (nk tiles of
 * 16 features x 16 pairs). V is the lane type (16 lanes, or 8 for a group of at most 8 rows, below).
 *
 * Each k block's 32 products are summed in a chain of their own, then added to the row's sum: at
 * K = 576 a row's result takes 18 additions of block sums after chains of 16, as AMX's tile product
 * sums a block per instruction, where one chain through every k took 288 roundings (and lost the
 * greedy-fidelity test to transformers' bf16, 4 of its prompts against 5). The running sums wait in
 * L1 (t) between blocks, so the block's 16 chains and the x vector have the registers; at 2,048 rows
 * as fast as one chain, within the run-to-run spread (0.91-1.04x oneDNN either way, alternated). */
#define COLUMN_PRODUCT(NAME, V, TILE_PRODUCT, ZERO, ADD, LOAD, STORE)                                   \
    RTP_VEC_TARGET static void NAME(const uint32_t *w, const uint32_t *xg, int64_t nk, float *c) {      \
        float t[256] __attribute__((aligned(64))) = {0};                                                  \
        for (int64_t kb = 0; kb < nk; kb++) {                                                            \
            V blk[16];                                                                                   \
            for (int n = 0; n < 16; n++) blk[n] = ZERO();                                                \
            TILE_PRODUCT(blk, xg + kb * 256, w + kb * 256, 16);                                          \
            for (int n = 0; n < 16; n++) STORE(t + 16 * n, ADD(LOAD(t + 16 * n), blk[n]));               \
        }                                                                                                \
        transpose16x16((const uint32_t *)t, (uint32_t *)c);                                              \
    }

COLUMN_PRODUCT(column_product, __m512, pair_tile_product, _mm512_setzero_ps, _mm512_add_ps, _mm512_load_ps,
               _mm512_store_ps)
/* A group of at most 8 rows: the same products on the lower 8 lanes, so each row's sums are the same
 * bits as in a full group. A decode step of 2-8 rows: SmolLM2's qkv 0.071 -> 0.046 ms. */
COLUMN_PRODUCT(column_product8, __m256, pair_tile_product8, _mm256_setzero_ps, _mm256_add_ps, _mm256_load_ps,
               _mm256_store_ps)

/* The nk weight tiles of one record column, dequantized as they lie (rows of 16 features; amx_gemm.c's
 * dequant_column transposes them into AMX's B layout instead). */
RTP_VEC_TARGET static void dequant_rows_column(int kind, const uint8_t *recs, int64_t nk, uint32_t *w) {
    int64_t rb = record_bytes(kind);
    for (int64_t kb = 0; kb < nk; kb++) dequant_tile(kind, recs + kb * rb, (uint16_t *)(w + kb * 256));
}

/* rtp_linear_amx's contract (amx_linear.c), for any number of rows, without AMX. */
RTP_VEC_TARGET int rtp_gemm_avx(const void *x, int64_t ldx, int x_fp32, int kind, const uint8_t *weights,
                                const float *bias, void *out, int64_t ldo, int out_bf16, int64_t M, int64_t N,
                                int64_t K, int glu) {
    if (glu && (!out_bf16 || N % 32)) return 0;
    int64_t nk = K / 32, ngroups = (M + 15) / 16, ntiles = N / 16, rb = record_bytes(kind);
    int64_t units = glu ? ntiles / 2 : ntiles; /* output tiles of 16 features: one weight tile each, or a pair */
    int64_t unit_bytes = (glu ? 2 : 1) * nk * rb;
    uint32_t *xp = rtp_scratch_get(&packed_rows_scratch, (size_t)(ngroups * nk) * 1024);
    if (!xp) return 0;
    int ok = 1;
#pragma omp parallel
    {
        uint32_t *w = rtp_scratch_get(&column_scratch, (size_t)(glu ? 2 : 1) * (size_t)nk * 1024);
        if (!w) {
#pragma omp atomic write
            ok = 0;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < ngroups; g++) pack_group(x, x_fp32, ldx, M, g, nk, xp + g * nk * 256);
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            if (!w) continue;
            int64_t n0 = 16 * u;
            const uint8_t *recs = weights + u * unit_bytes; /* the unit's one or two record columns */
            float c[2][256] __attribute__((aligned(64)));
            /* the next unit's records into L2 while this one computes: a decode step streams every
             * weight from memory once, and the hardware prefetcher does not run a column ahead */
            if (u + 1 < units)
                for (int64_t off = 0; off < unit_bytes; off += 64) rtp_prefetch_l2(recs + unit_bytes + off);
            dequant_rows_column(kind, recs, nk, w);
            if (glu) dequant_rows_column(kind, recs + nk * rb, nk, w + nk * 256);
            for (int64_t g = 0; g < ngroups; g++) {
                const uint32_t *xg = xp + g * nk * 256;
                int64_t valid = M - 16 * g < 16 ? M - 16 * g : 16;
                void (*product)(const uint32_t *, const uint32_t *, int64_t, float *) =
                    valid <= 8 ? column_product8 : column_product;
                product(w, xg, nk, c[0]);
                if (glu) {
                    product(w + nk * 256, xg, nk, c[1]);
                    store_glu_rows(c[0], c[1], 16 * g, valid, n0, bias, bias ? bias + N / 2 : NULL, out, ldo);
                } else {
                    store_rows(c[0], 16 * g, valid, n0, bias, out, ldo, out_bf16);
                }
            }
        }
    }
    return ok;
}
