/* Linear layers over GGUF blocks with Intel AMX, for prompt-sized batches (prefill chunks and
 * mixed steps): a GEMM from the blocks, with no bf16 copy of the weights kept beside them.
 *
 * amx_linear.c serves decode batches (up to a few tiles of rows): there every weight tile is
 * dequantized for one pass over all the rows, and the activations are packed into AMX's pair
 * layout. With hundreds of rows the roles swap back to a GEMM's:
 *   - the activations are the "A" operand, loaded as they lie (16 rows of 32 bf16, the row
 *     stride of x): no packing;
 *   - each weight tile is dequantized once per call into the "B" layout (row r: the pairs
 *     (w[n][2r], w[n][2r + 1]) of its 16 output features: dequant_tile's rows, transposed as
 *     16 x 16 pairs), and kept, per thread, for every chunk of BM rows: its cost is spread over
 *     all the rows of the call;
 *   - 2 x 2 register blocking: two row tiles meet two weight tiles (four accumulators, each
 *     loaded tile used twice), over all k blocks (in slices of KSLICE past 24 blocks, below), the
 *     row tiles with the streaming hint so that the weight tiles stay in L1 (tile_block);
 *   - the accumulators are rows of outputs, so the epilogue (bias, bf16 rounding, and for an
 *     MLP's interleaved gate and up tiles silu(gate) * up) writes output rows directly.
 * The rows are walked in chunks of BM so that a chunk of x stays in L2 while every weight tile of
 * the thread passes over it; the threads split the weight tiles (each reads every chunk).
 *
 * Numerics: the same bf16 weights as amx_linear.c (dequant_tile), products exact, sums in fp32;
 * glu rounds gate and up to bf16 before silu * up as the decode kernel does.
 */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include "cpu_kernels.h"
#include "tile_blocks.h"
#include "amx_tiles.h"
#include "scratch.h"
#include "vec_math.h"

#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* Rows per chunk: 16 row tiles. A chunk of x at K = 1,536 is 768 KiB, in L2 while every weight tile
 * of the thread passes over it; 128 and 512 measured slower at 2,048 rows, one chunk of all the rows
 * (x from L3) half the speed. Issuing a block's products before the previous block's epilogue, so
 * that the two might overlap, measured no faster: this machine's tile unit and vector ports do not
 * overlap (prefill_attention.c saw the same). */
#define BM 256

/* K blocks per slice, where a unit's two weight columns would not fit L1 beside a block's rows
 * (down_proj, K = 1,536: 96 KiB a column pair). The unit then walks the chunk once per slice of
 * K, each slice's weight tiles (32 KiB) staying in L1 for all of the chunk's row tiles, the partial
 * sums kept in a buffer between slices: one thread's tile loop 1.85 -> 2.35 TFLOP/s at K = 1,536,
 * the GEMM at 2,048 rows 2.64-2.85 -> 2.86-3.01 (A/B alternated). Slicing K = 576 (18 blocks,
 * whose columns fit) cost 7-30 % in the loop: each slice loads and stores the accumulators again. */
#define KSLICE 16

/* This thread's weight tiles, rows and parked sums (scratch.h). */
static __thread rtp_scratch weight_scratch, rows_scratch, acc_scratch;

/* Up to 2 x 2 output tiles: row tiles at a (and a + 16 rows, when two_m), weight tiles b0 (and b1,
 * when two_n), over k blocks [k0, k1); the fp32 sums start from zero (k0 == 0) or from c, and go to
 * c[0] (a x b0), c[1] (a x b1), c[2], c[3].
 *
 * The row tiles load with the streaming hint (tileloaddt1): each is used by this block alone, and
 * loaded the ordinary way they pushed the weight tiles, which every block of the chunk reuses, out
 * of L1 (a block's weights and rows at K = 576 are 72 KiB against L1's 48). Measured on gate_up at
 * 2,048 rows: 2.2 -> 2.9 TFLOP/s without the SiLU epilogue. */
AMX_TARGET static void tile_block(const uint16_t *a, int64_t lda, int two_m, const uint32_t *b0,
                                  const uint32_t *b1, int two_n, int64_t k0, int64_t k1, float *c) {
    if (k0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_loadd(0, c, 64);
        _tile_loadd(1, c + 256, 64);
        _tile_loadd(2, c + 512, 64);
        _tile_loadd(3, c + 768, 64);
    }
    for (int64_t kb = k0; kb < k1; kb++) {
        _tile_stream_loadd(4, a + kb * 32, lda * 2);
        _tile_loadd(6, b0 + kb * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_n) {
            _tile_loadd(7, b1 + kb * 256, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (two_m) {
            _tile_stream_loadd(5, a + 16 * lda + kb * 32, lda * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (two_n) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
}

/* rtp_linear_amx's contract (amx_linear.c), for any number of rows. */
AMX_TARGET int rtp_gemm_amx(const void *x, int64_t ldx, int x_fp32, int kind, const uint8_t *weights,
                            const float *bias, void *out, int64_t ldo, int out_bf16, int64_t M, int64_t N, int64_t K,
                            int glu) {
    if (glu && (!out_bf16 || N % 32)) return 0;
    int64_t nk = K / 32, ntiles = N / 16, rb = record_bytes(kind);
    int64_t units = (ntiles + 1) / 2; /* two weight tiles each (glu: gate and up); the last may be one */
    int64_t nchunks = (M + BM - 1) / BM;
    int keep = nchunks > 1; /* weights dequantized once for every chunk, else per unit */
    int ok = 1;
#pragma omp parallel
    {
        int nth = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t u0 = units * me / nth, u1 = units * (me + 1) / nth;
        size_t wbytes = (size_t)(keep ? u1 - u0 : 1) * 2 * (size_t)nk * 1024;
        uint32_t *wb = rtp_scratch_get(&weight_scratch, wbytes);
        int copy_any = x_fp32 || M % 16 || ldx % 2;
        uint16_t *xb = copy_any ? rtp_scratch_get(&rows_scratch, (size_t)BM * K * 2) : NULL;
        /* the accumulators of one unit: of the chunk's every row-tile pair when K is sliced, else one */
        int64_t nslices = nk > 24 ? (nk + KSLICE - 1) / KSLICE : 1;
        float *cacc = rtp_scratch_get(&acc_scratch, (size_t)(nslices > 1 ? BM / 32 : 1) * 4096);
        if (!wb || (copy_any && !xb) || !cacc) {
#pragma omp atomic write
            ok = 0;
        } else {
            rtp_configure_tiles(8);
            for (int64_t c = 0; c < nchunks; c++) {
                int64_t m0 = c * BM, rows = M - m0 < BM ? M - m0 : BM, nmt = (rows + 15) / 16;
                const uint16_t *xa = (const uint16_t *)x + m0 * ldx;
                int64_t lda = ldx;
                if (x_fp32 || rows % 16 || ldx % 2) {
                    copy_rows_bf16(x, x_fp32, ldx, m0, rows, K, xb);
                    memset(xb + rows * K, 0, (size_t)((nmt * 16 - rows) * K) * 2); /* whole row tiles */
                    xa = xb;
                    lda = K;
                }
                for (int64_t u = u0; u < u1; u++) {
                    uint32_t *w = wb + (keep ? u - u0 : 0) * 2 * nk * 256;
                    int two_n = 2 * u + 1 < ntiles;
                    if (c == 0 || !keep) {
                        dequant_b_tiles(kind, weights + 2 * u * nk * rb, nk, w);
                        if (two_n) dequant_b_tiles(kind, weights + (2 * u + 1) * nk * rb, nk, w + nk * 256);
                    }
                    for (int64_t sl = 0; sl < nslices; sl++) {
                        int64_t k0 = nk * sl / nslices, k1 = nk * (sl + 1) / nslices, last = sl == nslices - 1;
                        for (int64_t mt = 0; mt < nmt; mt += 2) {
                            int two_m = mt + 1 < nmt;
                            float *acc = cacc + (nslices > 1 ? mt / 2 * 1024 : 0);
                            tile_block(xa + mt * 16 * lda, lda, two_m, w, w + nk * 256, two_n, k0, k1, acc);
                            if (!last) continue;
                            for (int64_t h = 0; h <= two_m; h++) {
                                int64_t r0 = (mt + h) * 16, valid = rows - r0 < 16 ? rows - r0 : 16;
                                const float *c0 = acc + h * 512, *c1 = c0 + 256;
                                if (glu) {
                                    store_glu_rows(c0, c1, m0 + r0, valid, u * 16, bias, bias ? bias + N / 2 : NULL,
                                                   out, ldo);
                                    continue;
                                }
                                store_rows(c0, m0 + r0, valid, 2 * u * 16, bias, out, ldo, out_bf16);
                                if (two_n)
                                    store_rows(c1, m0 + r0, valid, (2 * u + 1) * 16, bias, out, ldo, out_bf16);
                            }
                        }
                    }
                }
            }
            _tile_release();
        }
    }
    return ok;
}
#endif
