/* Linear layers over GGUF blocks on a CPU without AMX (AMD Zen 4 and 5: AVX-512 BF16), for every batch of 2
 * rows or more (quant.py's TILE_MIN_ROWS): decode batches, prefill chunks and mixed steps alike, from the same
 * weight records in tile order the AMX kernels read (tile_blocks.h), so that such a CPU needs no dense
 * bf16 copy of the weights either, and every step's linears are rtp kernels a CPU graph replays.
 *
 * The product is vdpbf16ps: per lane, acc += a pair of bf16 times a pair of bf16, in fp32. Two loops:
 *   - more than FEW_ROWS rows: the roles of amx_linear.c (out^T = W x^T): the rows of x are the lanes.
 *     x is packed once per call, 16 rows at a time, into pair tiles (k block kb, row r: the pairs
 *     (x[m][32 kb + 2 r], x[m][32 kb + 2 r + 1]) of its 16 rows m), shared by both threads; a weight tile is
 *     dequantized as it lies (dequant_tile: 16 output features of 32 bf16 each), and each of its pairs is
 *     broadcast from memory into the product with one x vector: 16 accumulators (one per output feature)
 *     take 16 products per x vector loaded, so the loop is bound by the products, not the loads, and no
 *     weight is ever transposed. A thread dequantizes each weight column (16 features, all k) once per
 *     call and runs every group of 16 rows over it, x coming from L2 or L3 at 4 bytes a product-cycle; the
 *     16 x 16 sums are transposed once into output rows for the epilogue (bias, bf16 rounding, and for an
 *     MLP's interleaved gate and up tiles silu(gate) * up, as amx_gemm.c). Up to 32 rows (tile_by_tile)
 *     each weight tile is dequantized and multiplied at once instead, the same products in the same order;
 *     past 32, full groups go in pairs (column_product2), each broadcast weight pair feeding both.
 *   - up to FEW_ROWS rows (decode steps of a few requests): the weights are the lanes (gemm_few_rows,
 *     below), since with rows in the lanes most lanes would be empty while every weight is still
 *     dequantized.
 *
 * Numerics: the same bf16 weights as the AMX kernels (dequant_tile), x rounded to bf16 (nearest even),
 * products exact, sums in fp32, a chain per k block and then the blocks' sums (column_product; in another
 * order than AMX's, so not bit-equal to it); a row's bits do not depend on the rows beside it, nor on
 * which of the two loops ran (tests/kernels/test_cpu_kernels.py); glu rounds
 * gate and up to bf16 before silu * up as the other kernels do.
 */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
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

/* t [16 features][16 rows] += one k block of a group's packed rows (xkb: 16 pairs x 16 rows) times one
 * dequantized weight tile w (16 features x 16 pairs). V is the lane type (16 lanes, or 8 for a group of at
 * most 8 rows, below).
 *
 * Each k block's 32 products are summed in a chain of their own, then added to the row's sum: at
 * K = 576 a row's result takes 18 additions of block sums after chains of 16, as AMX's tile product
 * sums a block per instruction, where one chain through every k took 288 roundings (and lost the
 * greedy-fidelity test to transformers' bf16, 4 of its prompts against 5). The running sums wait in
 * L1 (t) between blocks, so the block's 16 chains and the x vector have the registers; at 2,048 rows
 * as fast as one chain, within the run-to-run spread (0.91-1.04x oneDNN either way, alternated). */
#define BLOCK_PRODUCT(NAME, V, TILE_PRODUCT, ZERO, ADD, LOAD, STORE)                                   \
    RTP_VEC_TARGET static inline __attribute__((always_inline)) void NAME(const uint32_t *w,             \
                                                                          const uint32_t *xkb, float *t) { \
        V blk[16];                                                                                       \
        for (int n = 0; n < 16; n++) blk[n] = ZERO();                                                    \
        TILE_PRODUCT(blk, xkb, w, 16);                                                                   \
        for (int n = 0; n < 16; n++) STORE(t + 16 * n, ADD(LOAD(t + 16 * n), blk[n]));                   \
    }
BLOCK_PRODUCT(block_product, __m512, pair_tile_product, _mm512_setzero_ps, _mm512_add_ps, _mm512_load_ps,
              _mm512_store_ps)
/* A group of at most 8 rows: the same products on the lower 8 lanes, so each row's sums are the same
 * bits as in a full group: the last group of a batch past FEW_ROWS rows (21 rows: 16 + 5). Batches of
 * 2-8 rows take the few-row loop below (as this loop, SmolLM2's qkv at 2 rows took 0.046-0.071 ms). */
BLOCK_PRODUCT(block_product8, __m256, pair_tile_product8, _mm256_setzero_ps, _mm256_add_ps, _mm256_load_ps,
              _mm256_store_ps)
#undef BLOCK_PRODUCT

/* c [16 rows][16 features] = one group's products over a whole dequantized column w: every k block into
 * the running sums t in order, then t transposed. One function per lane width: where both widths shared a
 * function, GCC loaded the weight pairs both would broadcast once, ahead of the branch between them, and
 * spilled them to the stack (1.7x slower at 2,048 rows). */
#define COLUMN_PRODUCT(NAME, BLOCK)                                                                       \
    RTP_VEC_TARGET static void NAME(const uint32_t *w, const uint32_t *xg, int64_t nk, float *c) {       \
        float t[256] __attribute__((aligned(64))) = {0};                                                  \
        for (int64_t kb = 0; kb < nk; kb++) BLOCK(w + kb * 256, xg + kb * 256, t);                       \
        transpose16x16((const uint32_t *)t, (uint32_t *)c);                                              \
    }
COLUMN_PRODUCT(column_product, block_product)
COLUMN_PRODUCT(column_product8, block_product8)
#undef COLUMN_PRODUCT

/* Two full groups over one column, into their running sums t0 and t1 (column_product's t): each broadcast
 * weight pair feeds both groups' products, in two halves of 8 features (16 accumulators, two x vectors),
 * where column_product loads a broadcast for every product. Each accumulator is still one (row, feature)'s
 * chain over the block's 16 pairs from zero, added to its running sum block after block: the same bits as
 * column_product. Not inlined, its sums behind pointers: inlined into the unit loop, GCC spilled it (2.2-2.6x
 * slower). SmolLM2's 120 layer linears, 30 layers' weights from memory, alternated in one process four times:
 * 1.10-1.18x at 64 rows, 1.09-1.23x at 256, 1.05-1.15x at 2,048; a 2,048-token prefill step 1,047 / 957 ->
 * 925 / 872 ms (alternated twice). */
RTP_VEC_TARGET static __attribute__((noinline)) void column_product2(const uint32_t *w, const uint32_t *xg0,
                                                                     const uint32_t *xg1, int64_t nk, float *t0,
                                                                     float *t1) {
    for (int64_t kb = 0; kb < nk; kb++) {
        const uint32_t *wk = w + kb * 256, *x0 = xg0 + kb * 256, *x1 = xg1 + kb * 256;
        for (int h = 0; h < 16; h += 8) {
            __m512 a0[8], a1[8];
            _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) a0[i] = a1[i] = _mm512_setzero_ps();
            _Pragma("GCC unroll 16") for (int r = 0; r < 16; r++) {
                __m512bh v0 = (__m512bh)_mm512_load_si512((const void *)(x0 + 16 * r));
                __m512bh v1 = (__m512bh)_mm512_load_si512((const void *)(x1 + 16 * r));
                _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) {
                    __m512bh b = (__m512bh)_mm512_set1_epi32((int)wk[(h + i) * 16 + r]);
                    a0[i] = _mm512_dpbf16_ps(a0[i], v0, b);
                    a1[i] = _mm512_dpbf16_ps(a1[i], v1, b);
                }
            }
            _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) {
                _mm512_store_ps(t0 + 16 * (h + i), _mm512_add_ps(_mm512_load_ps(t0 + 16 * (h + i)), a0[i]));
                _mm512_store_ps(t1 + 16 * (h + i), _mm512_add_ps(_mm512_load_ps(t1 + 16 * (h + i)), a1[i]));
            }
        }
    }
}

/* One k block of one group, called per (tile, group) by tile_by_tile: not inlined there, for the reason
 * above (the weight pairs, the same for every group, would be loaded once and spilled). */
RTP_VEC_TARGET static __attribute__((noinline)) void tile_product(const uint32_t *w, const uint32_t *xkb, float *t) {
    block_product(w, xkb, t);
}
RTP_VEC_TARGET static __attribute__((noinline)) void tile_product8(const uint32_t *w, const uint32_t *xkb, float *t) {
    block_product8(w, xkb, t);
}

/* The nk weight tiles of one record column, dequantized as they lie (rows of 16 features; dequant_b_tiles,
 * tile_blocks.h, transposes them into B layout instead). */
RTP_VEC_TARGET static void dequant_rows_column(int kind, const uint8_t *recs, int64_t nk, uint32_t *w) {
    int64_t rb = record_bytes(kind);
    for (int64_t kb = 0; kb < nk; kb++) dequant_tile(kind, recs + kb * rb, (uint16_t *)(w + kb * 256));
}

/* ---- a few rows: the weights in the lanes ------------------------------------------------------------
 * With x's rows in the lanes, a decode step of 2 rows used 2 of each product's 16 lanes and still paid
 * every weight's dequantization: 12.2 ms a SmolLM2 step on AMD Zen 5, against 3.5 ms for one row on the
 * one-row kernel. Up to FEW_ROWS rows the roles turn: a dequantized tile is transposed into 16 vectors of
 * the 16 features' pair r (amx_gemm.c's B layout) and each row's pair r is broadcast into it, so the lanes
 * are the tile's 16 output features and a row costs 16 products a tile. Each lane runs the sequence the
 * rows-in-lanes loop runs for that row and feature (a chain of 16 pair products per k block from zero,
 * added to the running sum; the products are exact, so which operand is broadcast does not matter): the
 * same bits, and a row's result still does not depend on how many rows share its step. A SmolLM2 decode step
 * at context 256 (the replayed CPU graph, alternated twice with the rows-in-lanes build, same half hour):
 * 2 rows 12.8-16.2 -> 7.1-9.3 ms, 4 rows 14.0-14.7 -> 9.5-12.5, 8 rows 14.2-15.9 -> 12.0-12.8; at 16 the
 * rows-in-lanes loop stays (17-19 ms either way). */
#define FEW_ROWS 8

/* The sums of M rows (lanes: 16 features) through the GEMMs' epilogues (tile_blocks.h), which read rows of
 * 16 fp32 from memory: one definition of the bias, the rounding and silu * up for every loop. */
RTP_VEC_TARGET static inline __attribute__((always_inline)) void few_rows_store(const __m512 *tg, const __m512 *tu,
                                                                               const int M, const int glu,
                                                                               int64_t n0, int64_t N,
                                                                               const float *bias, void *out,
                                                                               int64_t ldo, int out_bf16) {
    float cg[FEW_ROWS * 16] __attribute__((aligned(64))), cu[FEW_ROWS * 16] __attribute__((aligned(64)));
    for (int m = 0; m < M; m++) {
        _mm512_store_ps(cg + 16 * m, tg[m]);
        if (glu) _mm512_store_ps(cu + 16 * m, tu[m]);
    }
    if (glu)
        store_glu_rows(cg, cu, 0, M, n0, bias, bias ? bias + N / 2 : NULL, out, ldo);
    else
        store_rows(cg, 0, M, n0, bias, out, ldo, out_bf16);
}

/* Copies per (M rows, NB k blocks at a time, GLU) with their arrays sized exactly: GCC keeps such arrays in
 * registers, where one sized for the largest case went to the stack with every broadcast beside it.
 *   few_blocks_M_NB_GLU: tg[m] (lanes: the tile's 16 features) += NB k blocks of row m in order, for rows
 *     whose pairs are at x + m ldp, the blocks' B tiles at wg (and an MLP's up tiles at wu, into tu). The
 *     NB x M chains run side by side, since a product waits for the one before it in its chain; each
 *     broadcast row pair feeds the gate and the up product.
 *   few_unit_M_GLU: one unit (16 output features, or an MLP's 16 gate and 16 up features) over the rows of
 *     bf16 pairs xp (row m at xp + m K / 2), NB blocks at a time and the last nk % NB one by one, into out
 *     as rtp_gemm_avx's epilogues store it. */
#define FEW_BLOCKS(M, NB, GLU)                                                                                   \
    RTP_VEC_TARGET static inline __attribute__((always_inline)) void few_blocks_##M##_##NB##_##GLU(              \
        const uint32_t *wg, const uint32_t *wu, const uint32_t *x, int64_t ldp, __m512 *tg, __m512 *tu) {        \
        __m512 ag[(M) * (NB)], au[(M) * (NB)];                                                                   \
        _Pragma("GCC unroll 16") for (int i = 0; i < (M) * (NB); i++) ag[i] = au[i] = _mm512_setzero_ps();      \
        _Pragma("GCC unroll 16") for (int r = 0; r < 16; r++)                                                   \
            _Pragma("GCC unroll 8") for (int b = 0; b < (NB); b++) {                                            \
                __m512bh g = (__m512bh)_mm512_load_si512((const void *)(wg + 256 * b + 16 * r));                 \
                __m512bh u = (__m512bh)_mm512_load_si512((const void *)((GLU) ? wu + 256 * b + 16 * r : wg));    \
                _Pragma("GCC unroll 8") for (int m = 0; m < (M); m++) {                                         \
                    __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[m * ldp + 16 * b + r]);                     \
                    ag[b * (M) + m] = _mm512_dpbf16_ps(ag[b * (M) + m], g, xv);                                  \
                    if (GLU) au[b * (M) + m] = _mm512_dpbf16_ps(au[b * (M) + m], u, xv);                          \
                }                                                                                                \
            }                                                                                                    \
        _Pragma("GCC unroll 8") for (int b = 0; b < (NB); b++)                                                  \
            _Pragma("GCC unroll 8") for (int m = 0; m < (M); m++) {                                             \
                tg[m] = _mm512_add_ps(tg[m], ag[b * (M) + m]);                                                   \
                if (GLU) tu[m] = _mm512_add_ps(tu[m], au[b * (M) + m]);                                          \
            }                                                                                                    \
    }

#define FEW_UNIT(M, NB, GLU)                                                                                     \
    RTP_VEC_TARGET static void few_unit_##M##_##GLU(int kind, const uint8_t *recs, int64_t nk, const uint32_t *xp, \
                                                    int64_t n0, int64_t N, const float *bias, void *out,         \
                                                    int64_t ldo, int out_bf16) {                                 \
        uint32_t wg[(NB) * 256] __attribute__((aligned(64))), wu[(GLU) ? (NB) * 256 : 16] __attribute__((aligned(64))); \
        int64_t rb = record_bytes(kind), ldp = nk * 16, kb = 0;                                                  \
        __m512 tg[M], tu[M];                                                                                     \
        _Pragma("GCC unroll 8") for (int m = 0; m < (M); m++) tg[m] = tu[m] = _mm512_setzero_ps();              \
        for (; kb + (NB) <= nk; kb += (NB)) {                                                                    \
            dequant_b_tiles(kind, recs + kb * rb, (NB), wg);                                                            \
            if (GLU) dequant_b_tiles(kind, recs + (nk + kb) * rb, (NB), wu);                                         \
            few_blocks_##M##_##NB##_##GLU(wg, wu, xp + kb * 16, ldp, tg, tu);                                    \
        }                                                                                                        \
        for (; kb < nk; kb++) {                                                                                  \
            dequant_b_tiles(kind, recs + kb * rb, 1, wg);                                                               \
            if (GLU) dequant_b_tiles(kind, recs + (nk + kb) * rb, 1, wu);                                            \
            few_blocks_##M##_1_##GLU(wg, wu, xp + kb * 16, ldp, tg, tu);                                         \
        }                                                                                                        \
        few_rows_store(tg, tu, M, GLU, n0, N, bias, out, ldo, out_bf16);                                         \
    }

/* NB for each M: chains of M x NB (x 2 with GLU) products, 8 to 16 (NB = 1 also serves every tail). */
FEW_BLOCKS(1, 1, 0) FEW_BLOCKS(1, 1, 1) FEW_BLOCKS(1, 8, 0) FEW_BLOCKS(1, 4, 1) FEW_UNIT(1, 8, 0) FEW_UNIT(1, 4, 1)
FEW_BLOCKS(2, 1, 0) FEW_BLOCKS(2, 1, 1) FEW_BLOCKS(2, 4, 0) FEW_BLOCKS(2, 2, 1) FEW_UNIT(2, 4, 0) FEW_UNIT(2, 2, 1)
FEW_BLOCKS(3, 1, 0) FEW_BLOCKS(3, 1, 1) FEW_BLOCKS(3, 4, 0) FEW_BLOCKS(3, 2, 1) FEW_UNIT(3, 4, 0) FEW_UNIT(3, 2, 1)
FEW_BLOCKS(4, 1, 0) FEW_BLOCKS(4, 1, 1) FEW_BLOCKS(4, 2, 0) FEW_BLOCKS(4, 2, 1) FEW_UNIT(4, 2, 0) FEW_UNIT(4, 2, 1)
FEW_BLOCKS(5, 1, 0) FEW_BLOCKS(5, 1, 1) FEW_BLOCKS(5, 2, 0) FEW_UNIT(5, 2, 0) FEW_UNIT(5, 1, 1)
FEW_BLOCKS(6, 1, 0) FEW_BLOCKS(6, 1, 1) FEW_BLOCKS(6, 2, 0) FEW_UNIT(6, 2, 0) FEW_UNIT(6, 1, 1)
FEW_BLOCKS(7, 1, 0) FEW_BLOCKS(7, 1, 1) FEW_UNIT(7, 1, 0) FEW_UNIT(7, 1, 1)
FEW_BLOCKS(8, 1, 0) FEW_BLOCKS(8, 1, 1) FEW_UNIT(8, 1, 0) FEW_UNIT(8, 1, 1)
#undef FEW_UNIT
#undef FEW_BLOCKS

/* rtp_gemm_avx for M <= FEW_ROWS: x rounded into bf16 rows once, then the units split over the threads. */
RTP_VEC_TARGET static int gemm_few_rows(const void *x, int64_t ldx, int x_fp32, int kind, const uint8_t *weights,
                                        const float *bias, void *out, int64_t ldo, int out_bf16, int64_t M,
                                        int64_t N, int64_t K, int glu) {
    int64_t nk = K / 32, units = glu ? N / 32 : N / 16, unit_bytes = (glu ? 2 : 1) * nk * record_bytes(kind);
    uint16_t *xb = rtp_scratch_get(&packed_rows_scratch, (size_t)(M * K) * 2);
    if (!xb) return 0;
    copy_rows_bf16(x, x_fp32, ldx, 0, M, K, xb);
    const uint32_t *xp = (const uint32_t *)xb;
#pragma omp parallel for schedule(static)
    for (int64_t u = 0; u < units; u++) {
        const uint8_t *recs = weights + u * unit_bytes;
        if (u + 1 < units) /* as in rtp_gemm_avx: the next unit's records into L2 */
            for (int64_t off = 0; off < unit_bytes; off += 64) rtp_prefetch_l2(recs + unit_bytes + off);
        switch (M * 2 + (glu != 0)) {
#define FEW(m)                                                                                       \
    case 2 * m: few_unit_##m##_0(kind, recs, nk, xp, 16 * u, N, bias, out, ldo, out_bf16); break; \
    case 2 * m + 1: few_unit_##m##_1(kind, recs, nk, xp, 16 * u, N, bias, out, ldo, out_bf16); break;
            FEW(1) FEW(2) FEW(3) FEW(4) FEW(5) FEW(6) FEW(7) FEW(8)
#undef FEW
        }
    }
    return 1;
}

/* A unit for a batch of at most TILE_BY_TILE_GROUPS groups (a decode step of up to 32 rows): each weight tile
 * is dequantized into L1 and multiplied by every group at once, where the loop below dequantizes the whole
 * column first and then runs each group over it. The same products and the same order of sums (each k
 * block's chain added to the group's running sum t, block after block), so the same bits; but the next
 * tile's dequantization (vector shuffles and converts) now lies within reach of the out-of-order core while
 * this tile's products (the FMA ports) run, where a column dequantized up front left the products waiting:
 * a cost a prefill chunk spreads over its 128 groups and a decode step of 16 rows pays in full. SmolLM2's
 * linears at 16 rows, 30 layers' weights from memory (AMD Zen 5, alternated three times): 14.5-15.5 ->
 * 13.2-13.4 ms. Against the column loop with its paired groups (column_product2), alternated in one process
 * four times: 1.07-1.16x faster at 17 and 24 rows, 1.01-1.07x at 32; past 32 the pairs win (at 64 rows the
 * unpaired column loop had already measured level with this one). */
#define TILE_BY_TILE_GROUPS 2
RTP_VEC_TARGET static void tile_by_tile(int kind, const uint8_t *recs, int64_t nk, const uint32_t *xp, int64_t M,
                                        int64_t ngroups, int glu, int64_t n0, int64_t N, const float *bias,
                                        void *out, int64_t ldo, int out_bf16) {
    float t[2][TILE_BY_TILE_GROUPS][256] __attribute__((aligned(64)));
    uint32_t w[2][256] __attribute__((aligned(64)));
    float c[2][256] __attribute__((aligned(64)));
    int64_t rb = record_bytes(kind);
    memset(t, 0, sizeof(t[0][0]) * (size_t)ngroups);
    if (glu) memset(t[1], 0, sizeof(t[1][0]) * (size_t)ngroups);
    for (int64_t kb = 0; kb < nk; kb++) {
        dequant_tile(kind, recs + kb * rb, (uint16_t *)w[0]);
        if (glu) dequant_tile(kind, recs + (nk + kb) * rb, (uint16_t *)w[1]);
        for (int64_t g = 0; g < ngroups; g++) {
            const uint32_t *xkb = xp + (g * nk + kb) * 256;
            void (*product)(const uint32_t *, const uint32_t *, float *) =
                M - 16 * g <= 8 ? tile_product8 : tile_product;
            product(w[0], xkb, t[0][g]);
            if (glu) product(w[1], xkb, t[1][g]);
        }
    }
    for (int64_t g = 0; g < ngroups; g++) {
        int64_t valid = M - 16 * g < 16 ? M - 16 * g : 16;
        transpose16x16((const uint32_t *)t[0][g], (uint32_t *)c[0]);
        if (glu) {
            transpose16x16((const uint32_t *)t[1][g], (uint32_t *)c[1]);
            store_glu_rows(c[0], c[1], 16 * g, valid, n0, bias, bias ? bias + N / 2 : NULL, out, ldo);
        } else {
            store_rows(c[0], 16 * g, valid, n0, bias, out, ldo, out_bf16);
        }
    }
}

/* rtp_linear_amx's contract (amx_linear.c), for any number of rows, without AMX. */
RTP_VEC_TARGET int rtp_gemm_avx(const void *x, int64_t ldx, int x_fp32, int kind, const uint8_t *weights,
                                const float *bias, void *out, int64_t ldo, int out_bf16, int64_t M, int64_t N,
                                int64_t K, int glu) {
    if (glu && (!out_bf16 || N % 32)) return 0;
    if (rtp_record_kind(kind) != kind) { /* x's rows as int8 (vnni_gemm.c), or in bf16 without VNNI */
        kind = rtp_record_kind(kind);
        if (rtp_vnni_supported())
            return rtp_gemm_vnni(x, ldx, x_fp32, kind, weights, bias, out, ldo, out_bf16, M, N, K, glu);
    }
    if (M <= FEW_ROWS) return gemm_few_rows(x, ldx, x_fp32, kind, weights, bias, out, ldo, out_bf16, M, N, K, glu);
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
            float c[2][256] __attribute__((aligned(64))), pair_t[2][256] __attribute__((aligned(64)));
            float pair_c[4][256] __attribute__((aligned(64)));
            /* the next unit's records into L2 while this one computes: a decode step streams every
             * weight from memory once, and the hardware prefetcher does not run a column ahead */
            if (u + 1 < units)
                for (int64_t off = 0; off < unit_bytes; off += 64) rtp_prefetch_l2(recs + unit_bytes + off);
            if (ngroups <= TILE_BY_TILE_GROUPS) {
                tile_by_tile(kind, recs, nk, xp, M, ngroups, glu, n0, N, bias, out, ldo, out_bf16);
                continue;
            }
            dequant_rows_column(kind, recs, nk, w);
            if (glu) dequant_rows_column(kind, recs + nk * rb, nk, w + nk * 256);
            int64_t g = 0;
            for (; g + 2 <= M / 16; g += 2) { /* pairs of full groups */
                const uint32_t *xg = xp + g * nk * 256;
                for (int part = 0; part < (glu ? 2 : 1); part++) {
                    memset(pair_t, 0, sizeof(pair_t));
                    column_product2(w + part * nk * 256, xg, xg + nk * 256, nk, pair_t[0], pair_t[1]);
                    transpose16x16((const uint32_t *)pair_t[0], (uint32_t *)pair_c[part]);
                    transpose16x16((const uint32_t *)pair_t[1], (uint32_t *)pair_c[2 + part]);
                }
                for (int j = 0; j < 2; j++) { /* pair_c: group g gate/plain, g up, g + 1 gate/plain, g + 1 up */
                    if (glu)
                        store_glu_rows(pair_c[2 * j], pair_c[2 * j + 1], 16 * (g + j), 16, n0, bias,
                                       bias ? bias + N / 2 : NULL, out, ldo);
                    else
                        store_rows(pair_c[2 * j], 16 * (g + j), 16, n0, bias, out, ldo, out_bf16);
                }
            }
            for (; g < ngroups; g++) {
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
#endif
