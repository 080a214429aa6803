/* Prefill attention over the paged KV cache: causal, grouped-query, varlen, flash-attention style.
 *
 * A prefill step packs several sequences' chunks into one batch of query tokens; each chunk
 * attends to its sequence's cached prefix and to itself, causally. torch's CPU flash attention
 * ran these at about 140 GFLOP/s here (a third of a 2048-token step); the AMX unit multiplies
 * bf16 tiles at several TFLOP/s, so the scores and the weighted values go to the tiles and the
 * fp32 online softmax between them runs on AVX-512.
 *
 * Two phases inside one parallel region:
 *   pack     each (sequence, kv head)'s keys and values, read from their blocks once, into the
 *            layouts the tile products want (below), zero past the context: O(L D) work that
 *            every query block of the sequence then reuses from L2, and the reason any
 *            block size works;
 *   attend   one task per (sequence, kv head, block of QB query tokens), its G = H / Hkv query
 *            heads together (G x QB / 16 tiles of 16 rows), so each packed key and value tile is
 *            loaded once for all of them. Per step of KB keys: S = Q K^T (tiles) -> row max, p =
 *            exp(scale (s - m)), running sum and rescale of O (fp32, AVX-512) -> P rounded to
 *            bf16 -> O += P V (tiles). Tasks run longest first (dynamic schedule): a causal
 *            task's cost grows with its position. With Gemma 2's softcap, S -> cap tanh(scale S /
 *            cap) in a pass of its own (cap_scores) before the softmax.
 *
 * Layouts (uint32 = a pair of bf16):
 *   K^T   per key tile j (16 keys) and dimension step s (32 dims): 16 x 16 uint32, row r, column n
 *         = K[16 j + n][32 s + 2r, +1]: the AMX "B" operand of Q K^T (pairs along the reduced dim).
 *   V     per key step t (32 keys) and dimension tile c (16 dims): 16 x 16 uint32, row r, column d
 *         = (V[32 t + 2r][16 c + d], V[32 t + 2r + 1][16 c + d]): the "B" operand of P V.
 * Q is copied per task into [G QT][16][D] bf16 (zero rows past the chunk): the "A" operand as is.
 *
 * Where the time went (one thread, one 2048-token prompt, SmolLM2's 9/3 heads of 64, tasks of 16
 * tokens and 128-key steps: 11.5 ms; in a 2-thread profile with the 32 / 256 below the softmax is 43 %,
 * Q K^T 31 % and the rest, P V included, 26 %):
 * the tile products about 6 ms, three times their rate in a loop of their own (K/V tiles come
 * from L2: 1.1 ms of it), the exponentials 2.8 ms, the rest (max pass, packing, copies) 2.6 ms.
 * The tile unit and the vector ports do not overlap on this machine: 4 products and 16 exp
 * vectors interleaved in one loop took 39.5 ns, against 22.4 and 24.1 ns alone; running the
 * products in slices between softmax rows (a queue of resumable units) gained 3 %, so the
 * simple order below stays.
 *
 * Numerics as torch's flash attention on bf16 inputs: products exact, sums in fp32, scale
 * applied to the fp32 scores, softmax in fp32, probabilities rounded to bf16 for P V, output
 * divided by the fp32 sum and rounded to bf16 once. Without AMX (amx = 0) the same loops run
 * the products with AVX-512 BF16 dot instructions over the same packed layouts.
 */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include "cpu_kernels.h"
#include "amx_tiles.h"
#include "vec_math.h"
#include "scratch.h"
#include "tile_blocks.h"

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#define AVX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

/* Query tokens per task (QT tiles of rows per query head) and keys per online-softmax step. 16 and
 * 128 before; 32 and 256 measured 12-13 % faster on SmolLM2's 2,048- and 512-token prompts with the
 * kernel in a loop of its own (A/B alternated three times against 32/128, 32/192, 64/128, 64/256, all
 * of them between), 7-9 % in the model's prefill step, 2-10 % in tools/bench_prefill_attention.py
 * (which alternates it with SDPA): twice the rows share each K and V tile load, and each step's max,
 * rescale and sums serve twice the keys. The cost: a task computes up to 31 hidden keys past its
 * first rows, and scratch of 280 KiB a thread. */
#define QB 32
#define QT (QB / 16)
#define KB 256

/* Tiles (amx_tiles.h, 8 configured): 0-3 accumulators, 4-5 A operands, 6-7 B operands. */

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* seqs: int32 [nseq][4] = query start (token index into q / out), query count, context length
 * (keys, this chunk included), offset of the sequence's block ids in `tables`. */
typedef struct {
    int64_t q_start, n, ctx, table_off;
    int64_t pack_off; /* elements of the K (and V) pack before this sequence's */
    int64_t padded;   /* context rounded up to a value step (32 keys): the last one P V reads */
} seq_info;

/* ---- pack ------------------------------------------------------------------------------------ */

/* An int8 cache's row of D values (D a multiple of 16) as bf16: q * its scale, rounded once. The
 * tile products then run as over a bf16 cache. */
AVX_TARGET static inline void dequantize_row(const int8_t *src, float scale, int64_t D, uint16_t *dst) {
    __m512 s = _mm512_set1_ps(scale);
    for (int64_t c = 0; c < D; c += 16) {
        __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + c))));
        _mm256_storeu_si256((__m256i *)(dst + c), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(x, s)));
    }
}

/* Keys and values [32 t, 32 t + 32) of one kv head into their packed tiles; from an int8 cache
 * (k_scales not NULL: fp32 [slots, Hkv]) dequantized to bf16 on the way. */
AVX_TARGET static void pack_step(const void *k_cache, const void *v_cache, int64_t tok_stride,
                                 const float *k_scales, const float *v_scales, int64_t Hkv,
                                 const int32_t *table, int64_t block_size, int64_t ctx, int64_t head,
                                 int64_t D, int64_t t, uint32_t *kp, uint32_t *vp) {
    uint16_t rows[32 * 256] __attribute__((aligned(64))); /* the 32 keys' K rows, zero past ctx */
    uint16_t vrows[32 * 256] __attribute__((aligned(64))); /* int8: their V rows, dequantized */
    const uint16_t *vrow[32];
    for (int64_t i = 0; i < 32; i++) {
        int64_t pos = 32 * t + i;
        if (pos < ctx) {
            int64_t slot = (int64_t)table[pos / block_size] * block_size + pos % block_size;
            int64_t at = slot * tok_stride + head * D;
            if (k_scales) {
                dequantize_row((const int8_t *)k_cache + at, k_scales[slot * Hkv + head], D, rows + i * D);
                dequantize_row((const int8_t *)v_cache + at, v_scales[slot * Hkv + head], D, vrows + i * D);
                vrow[i] = vrows + i * D;
            } else {
                memcpy(rows + i * D, (const uint16_t *)k_cache + at, (size_t)D * 2);
                vrow[i] = (const uint16_t *)v_cache + at;
            }
        } else {
            memset(rows + i * D, 0, (size_t)D * 2);
            vrow[i] = NULL;
        }
    }
    int64_t ns = D / 32, half = D / 2;
    __m512i index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                       _mm512_set1_epi32((int)half));
    for (int64_t j = 0; j < 2; j++) { /* K^T: a 16 x 16 transpose of uint32 per dimension step */
        const uint32_t *base = (const uint32_t *)(rows + 16 * j * D);
        for (int64_t s = 0; s < ns; s++) {
            uint32_t *tile = kp + ((2 * t + j) * ns + s) * 256;
            for (int64_t r = 0; r < 16; r++)
                _mm512_store_si512((void *)(tile + r * 16), _mm512_i32gather_epi32(index, base + 16 * s + r, 4));
        }
    }
    int64_t nc = D / 16;
    for (int64_t r = 0; r < 16; r++) { /* V: keys 2r and 2r + 1 interleaved */
        const uint16_t *a = vrow[2 * r], *b = vrow[2 * r + 1];
        for (int64_t c = 0; c < nc; c++) {
            __m512i lo = a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(a + 16 * c)))
                           : _mm512_setzero_si512();
            __m512i hi = b ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + 16 * c)))
                           : _mm512_setzero_si512();
            _mm512_store_si512((void *)(vp + ((t * nc + c) * 16 + r) * 16), _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

/* ---- the two products, on tiles -------------------------------------------------------------- */

/* Tile registers are not renamed: a load into a tile waits until every product reading it is
 * done. So both products work in 2 x 2 blocks, two A and two B tiles feeding four accumulators,
 * and each tile is reloaded only after the other products of its step have been queued. */

/* S[g rows][16 j + n] = Q_g K^T for key tiles [j0, j0 + nt) of the step (nt <= 4). */
AMX_TARGET static void scores_amx(const uint16_t *qbuf, int64_t G, int64_t D, const uint32_t *kp, int64_t j0,
                                  int64_t nt, float *sbuf) {
    int64_t ns = D / 32;
    for (int64_t g = 0; g < G; g += 2) {
        int rows2 = g + 1 < G;
        const uint16_t *a = qbuf + g * 16 * D;
        float *s = sbuf + g * 16 * KB;
        for (int64_t j = 0; j < nt; j += 2) {
            int cols2 = j + 1 < nt;
            const uint32_t *b = kp + (j0 + j) * ns * 256;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t st = 0; st < ns; st++) {
                _tile_loadd(4, a + 32 * st, D * 2);
                _tile_loadd(6, b + st * 256, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (cols2) {
                    _tile_loadd(7, b + (ns + st) * 256, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (rows2) {
                    _tile_loadd(5, a + 16 * D + 32 * st, D * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    if (cols2) _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, s + 16 * j, KB * 4);
            if (cols2) _tile_stored(1, s + 16 * j + 16, KB * 4);
            if (rows2) {
                _tile_stored(2, s + 16 * KB + 16 * j, KB * 4);
                if (cols2) _tile_stored(3, s + 16 * KB + 16 * j + 16, KB * 4);
            }
        }
    }
}

/* O[g rows] += P_g V over value steps [t0, t0 + nsteps) (nsteps <= KB / 32). */
AMX_TARGET static void values_amx(const uint16_t *pbuf, int64_t G, int64_t D, const uint32_t *vp, int64_t t0,
                                  int64_t nsteps, float *obuf) {
    int64_t nc = D / 16; /* even: D is a multiple of 32 */
    for (int64_t g = 0; g < G; g += 2) {
        int rows2 = g + 1 < G;
        const uint16_t *a = pbuf + g * 16 * KB;
        for (int64_t c = 0; c < nc; c += 2) {
            float *o = obuf + g * 16 * D + 16 * c;
            _tile_loadd(0, o, D * 4);
            _tile_loadd(1, o + 16, D * 4);
            if (rows2) {
                _tile_loadd(2, o + 16 * D, D * 4);
                _tile_loadd(3, o + 16 * D + 16, D * 4);
            }
            for (int64_t t = 0; t < nsteps; t++) {
                const uint32_t *b = vp + ((t0 + t) * nc + c) * 256;
                _tile_loadd(4, a + 32 * t, KB * 2);
                _tile_loadd(6, b, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_loadd(7, b + 256, 64);
                _tile_dpbf16ps(1, 4, 7);
                if (rows2) {
                    _tile_loadd(5, a + 16 * KB + 32 * t, KB * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, o, D * 4);
            _tile_stored(1, o + 16, D * 4);
            if (rows2) {
                _tile_stored(2, o + 16 * D, D * 4);
                _tile_stored(3, o + 16 * D + 16, D * 4);
            }
        }
    }
}

/* ---- the same products with AVX-512 BF16 dot instructions (no AMX) ---------------------------- */

/* Both register-block a row tile's 16 rows (pair_tile_product, tile_blocks.h): each packed K (or V) row
 * loaded feeds 16 dot products, one per query row, whose other operand (a pair of q, or of P) is
 * broadcast from memory; so the loops are bound by the products, not the loads. One K or V load per
 * product, as a row at a time did, ran at a third of the rate (AMD Zen 4: 2,048-token prompt 38.5 ms a
 * layer, 125 GFLOP/s). */

/* D is a constant in each copy (scores_avx switches on it): with a run-time stride GCC computed the 256
 * broadcast addresses i * half + r of a tile product up front and spilled them to the stack, and the
 * reloads, not the products, set the pace (2,048-token prompt, AMD Zen 5, one thread: scores_avx 3.8x the
 * time of values_avx, whose stride is the constant KB / 2). */
AVX_TARGET static inline __attribute__((always_inline)) void scores_avx_d(const uint16_t *qbuf, int64_t G,
                                                                          const int64_t D, const uint32_t *kp,
                                                                          int64_t j0, int64_t nt, float *sbuf) {
    const int64_t ns = D / 32, half = D / 2;
    for (int64_t g = 0; g < G; g++) {
        const uint32_t *qg = (const uint32_t *)(qbuf + g * 16 * D); /* row i's pair (s, r): qg[i half + 16 s + r] */
        float *sg = sbuf + g * 16 * KB;
        for (int64_t j = 0; j < nt; j++) {
            __m512 acc[16];
            for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
            for (int64_t st = 0; st < ns; st++)
                pair_tile_product(acc, kp + ((j0 + j) * ns + st) * 256, qg + 16 * st, half);
            for (int i = 0; i < 16; i++) _mm512_storeu_ps(sg + i * KB + 16 * j, acc[i]);
        }
    }
}

AVX_TARGET static void scores_avx(const uint16_t *qbuf, int64_t G, int64_t D, const uint32_t *kp, int64_t j0,
                                  int64_t nt, float *sbuf) {
    switch (D) { /* a multiple of 32, at most 256 */
#define SCORES_D(d) case d: scores_avx_d(qbuf, G, d, kp, j0, nt, sbuf); break;
        SCORES_D(32) SCORES_D(64) SCORES_D(96) SCORES_D(128) SCORES_D(160) SCORES_D(192) SCORES_D(224) SCORES_D(256)
#undef SCORES_D
    default: scores_avx_d(qbuf, G, D, kp, j0, nt, sbuf); /* unreachable for the D the caller allows */
    }
}

AVX_TARGET static void values_avx(const uint16_t *pbuf, int64_t G, int64_t D, const uint32_t *vp, int64_t t0,
                                  int64_t nsteps, float *obuf) {
    int64_t nc = D / 16;
    for (int64_t g = 0; g < G; g++) {
        const uint32_t *pg = (const uint32_t *)(pbuf + g * 16 * KB); /* row i's pair (t, r): pg[i KB / 2 + 16 t + r] */
        for (int64_t c = 0; c < nc; c++) {
            float *o = obuf + g * 16 * D + 16 * c;
            __m512 acc[16];
            for (int i = 0; i < 16; i++) acc[i] = _mm512_loadu_ps(o + i * D);
            for (int64_t t = 0; t < nsteps; t++)
                pair_tile_product(acc, vp + ((t0 + t) * nc + c) * 256, pg + 16 * t, KB / 2);
            for (int i = 0; i < 16; i++) _mm512_storeu_ps(o + i * D, acc[i]);
        }
    }
}

/* ---- softmax ----------------------------------------------------------------------------------- */

/* Sixteen vectors in, one out: lane i = the max (or sum) of v[i]'s lanes, by a transposing tree
 * (30 shuffles for all sixteen, against eight dependent steps each for lone reductions). */
AVX_TARGET static inline __m512 reduce16(const __m512 *v, int is_max) {
#define OP(a, b) (is_max ? _mm512_max_ps(a, b) : _mm512_add_ps(a, b))
    __m512 w[8], x[4];
    for (int i = 0; i < 8; i++) /* per 128-bit quarter: partial results of v[2i] and v[2i + 1] */
        w[i] = OP(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        x[i] = OP(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88), _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    __m512 y0 = OP(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
    __m512 y1 = OP(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
    __m512d a = _mm512_castps_pd(y0), b = _mm512_castps_pd(y1);
    __m512 z = OP(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
#undef OP
    /* lane 4j + e holds row 4e + j */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
}

/* Which of keys [k, k + 16) a row sees, when it sees keys [lo, hi]. */
AVX_TARGET static inline __mmask16 visible(int64_t k, int64_t lo, int64_t hi) {
    if (k >= lo && k + 15 <= hi) return 0xffff;
    if (k > hi || k + 15 < lo) return 0;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 key = _mm512_add_ps(iota, _mm512_set1_ps((float)k));
    return _mm512_cmp_ps_mask(key, _mm512_set1_ps((float)hi), _CMP_LE_OQ)
         & _mm512_cmp_ps_mask(key, _mm512_set1_ps((float)lo), _CMP_GE_OQ);
}

/* The 16 rows of one query head's tile for keys [k0, k0 + KB) (the first nt key tiles
 * computed): row i (position pos0 + i, rows < `rows`) sees keys [pos - window + 1, pos]
 * (from 0 without a window). Updates the rows' running max m and sum l (16 each), rescales
 * their O rows when the max moved, and writes P (bf16, 0 where hidden; whole value steps of
 * 32 keys, since P V reads them whole). Rows that see every computed key, nearly all of them,
 * take a loop with no masks: this loop, not the tile products, sets the kernel's pace. */
AVX_TARGET static void softmax_tile(const float *s, int64_t nt, int64_t k0, int64_t pos0, int64_t rows,
                                    int64_t window, float scale2, float *m, float *l, float *o, int64_t D,
                                    uint16_t *p) {
    __m512 acc[16];
    uint32_t full = 0;
    for (int64_t i = 0; i < 16; i++) {
        int64_t pos = pos0 + i, lo = window > 0 ? pos - window + 1 : 0;
        const float *si = s + i * KB;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        if (i < rows && k0 >= lo && k0 + 16 * nt - 1 <= pos) {
            full |= 1u << i;
            for (int64_t j = 0; j < nt; j++) mx = _mm512_max_ps(mx, _mm512_loadu_ps(si + 16 * j));
        } else if (i < rows) {
            for (int64_t j = 0; j < nt; j++)
                mx = _mm512_mask_max_ps(mx, visible(k0 + 16 * j, lo, pos), mx, _mm512_loadu_ps(si + 16 * j));
        }
        acc[i] = mx;
    }
    __m512 sc = _mm512_set1_ps(scale2), one = _mm512_set1_ps(1.0f);
    __m512 mold = _mm512_loadu_ps(m), mstep = reduce16(acc, 1);
    /* The exact running max, never a stale one: the row's largest probability is then exactly
     * 1 in bf16, and in a peaked row that one term is most of the output (a max kept within 8
     * units of the true one, to rescale O less often, doubled the error against fp32). */
    __mmask16 grow = _mm512_cmp_ps_mask(mstep, mold, _CMP_GT_OQ);
    __m512 mnew = _mm512_mask_mov_ps(mold, grow, mstep);
    /* rows that had seen keys and whose max moved: their sum and O shrink by corr */
    __mmask16 moved = grow & _mm512_cmp_ps_mask(mold, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    __m512 corr = _mm512_mask_mov_ps(one, moved, exp2_ps(_mm512_mul_ps(_mm512_sub_ps(mold, mnew), sc)));
    float bias[16] __attribute__((aligned(64)));
    _mm512_store_ps(bias, _mm512_mul_ps(mnew, sc));
    _mm512_storeu_ps(m, mnew);
    int64_t cols = (nt + 1) / 2 * 2; /* P columns written, in vectors: whole value steps */
    for (int64_t i = 0; i < 16; i++) {
        const float *si = s + i * KB;
        uint16_t *pi = p + i * KB;
        __m512 b = _mm512_set1_ps(bias[i]), sum = _mm512_setzero_ps();
        if (full >> i & 1) {
            for (int64_t j = 0; j + 1 < nt; j += 2) {
                __m512 e0 = exp2_ps(_mm512_fmsub_ps(_mm512_loadu_ps(si + 16 * j), sc, b));
                __m512 e1 = exp2_ps(_mm512_fmsub_ps(_mm512_loadu_ps(si + 16 * j + 16), sc, b));
                sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
                _mm512_storeu_si512((void *)(pi + 16 * j), (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
            }
            if (nt & 1) {
                __m512 e0 = exp2_ps(_mm512_fmsub_ps(_mm512_loadu_ps(si + 16 * (nt - 1)), sc, b));
                sum = _mm512_add_ps(sum, e0);
                _mm512_storeu_si512((void *)(pi + 16 * (nt - 1)),
                                    (__m512i)_mm512_cvtne2ps_pbh(_mm512_setzero_ps(), e0));
            }
        } else if (i < rows) {
            int64_t pos = pos0 + i, lo = window > 0 ? pos - window + 1 : 0;
            for (int64_t j = 0; j < cols; j += 2) {
                __mmask16 v0 = j < nt ? visible(k0 + 16 * j, lo, pos) : 0;
                __mmask16 v1 = j + 1 < nt ? visible(k0 + 16 * j + 16, lo, pos) : 0;
                __m512 e0 = _mm512_setzero_ps(), e1 = _mm512_setzero_ps();
                if (v0) e0 = _mm512_maskz_mov_ps(v0, exp2_ps(_mm512_fmsub_ps(_mm512_loadu_ps(si + 16 * j), sc, b)));
                if (v1) e1 = _mm512_maskz_mov_ps(v1, exp2_ps(_mm512_fmsub_ps(_mm512_loadu_ps(si + 16 * j + 16), sc, b)));
                sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
                _mm512_storeu_si512((void *)(pi + 16 * j), (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
            }
        }
        acc[i] = sum;
    }
    _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), corr, reduce16(acc, 0)));
    if (moved) {
        float cf[16] __attribute__((aligned(64)));
        _mm512_store_ps(cf, corr);
        for (int64_t i = 0; i < 16; i++) {
            if (!(moved >> i & 1)) continue;
            __m512 cv = _mm512_set1_ps(cf[i]);
            for (int64_t c = 0; c < D; c += 16)
                _mm512_storeu_ps(o + i * D + c, _mm512_mul_ps(_mm512_loadu_ps(o + i * D + c), cv));
        }
    }
}

/* Gemma 2's attention logit softcapping over one step's raw scores (q . k, [G][16][KB], rows < `rows`
 * and nt key tiles): s -> softcap * tanh(s scale / softcap), scaled as torch scales them. A pass of its
 * own, so that softmax_tile's loops stay as they are and a model without a cap pays nothing; the
 * capped scores come back already scaled (the caller's scale2 is then log2 e alone). */
AVX_TARGET static void cap_scores(float *s, int64_t G, int64_t rows, int64_t nt, float scale, float softcap) {
    const __m512 yv = _mm512_set1_ps(scale / softcap), cv = _mm512_set1_ps(softcap);
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < rows; i++) {
            float *si = s + (g * 16 + i) * KB;
            for (int64_t j = 0; j < nt; j++)
                _mm512_storeu_ps(si + 16 * j, softcap_ps(_mm512_mul_ps(_mm512_loadu_ps(si + 16 * j), yv), cv));
        }
}

/* ---- one task ---------------------------------------------------------------------------------- */

typedef struct {
    uint16_t *q;   /* [G QT][16][D] bf16: row tile g QT + h holds query head g's rows 16 h .. */
    float *s;      /* two buffers of [G QT][16][KB] fp32: a step's scores while the next one's are made */
    uint16_t *p;   /* [G QT][16][KB] bf16 */
    float *o;      /* [G QT][16][D] fp32 */
    float *m, *l;  /* [G QT][16] */
} scratch;

AMX_TARGET static inline void scores(const scratch *w, int64_t G, int64_t D, const uint32_t *kp, int64_t k0,
                                     int64_t last_pos, int amx, float *s) {
    int64_t keys = last_pos + 1 - k0 < KB ? last_pos + 1 - k0 : KB, nt = (keys + 15) / 16;
    if (amx) scores_amx(w->q, G, D, kp, k0 / 16, nt, s);
    else scores_avx(w->q, G, D, kp, k0 / 16, nt, s);
}

AMX_TARGET static void attend(const uint16_t *q, uint16_t *out, const seq_info *sq, int64_t kvh, int64_t qb,
                              const uint32_t *kp, const uint32_t *vp, int64_t H, int64_t G, int64_t D,
                              float scale, int64_t window, float softcap, int amx, scratch *w) {
    int64_t i0 = qb * QB, rows = sq->n - i0 < QB ? sq->n - i0 : QB;
    int64_t first_pos = sq->ctx - sq->n + i0, last_pos = first_pos + rows - 1;
    /* row tile t = g * QT + h: query head g's rows [16 h, 16 h + 16) of the block */
    int64_t R = G * QT, rows16 = rows < 16 ? rows : 16;
    for (int64_t t = 0; t < R; t++) {
        int64_t head = kvh * G + t / QT, r0 = 16 * (t % QT); /* r0: the tile's first row in the block */
        for (int64_t i = 0; i < 16; i++) {
            int64_t row = r0 + i;
            uint16_t *dst = w->q + (t * 16 + i) * D;
            if (row < rows) memcpy(dst, q + ((sq->q_start + i0 + row) * H + head) * D, (size_t)D * 2);
            else memset(dst, 0, (size_t)D * 2);
        }
    }
    memset(w->o, 0, (size_t)(R * 16 * D) * sizeof(float));
    memset(w->p, 0, (size_t)(R * 16 * KB) * sizeof(uint16_t)); /* rows past the chunk stay 0 */
    for (int64_t r = 0; r < R * 16; r++) {
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
    /* exponents in base 2; capped scores (cap_scores) come scaled already */
    float scale2 = (softcap > 0.0f ? 1.0f : scale) * 1.44269504088896341f;
    int64_t start = window > 0 && first_pos - window + 1 > 0 ? (first_pos - window + 1) / KB * KB : 0;
    float *sb[2] = {w->s, w->s + R * 16 * KB};
    scores(w, R, D, kp, start, last_pos, amx, sb[0]);
    for (int64_t k0 = start, b = 0; k0 <= last_pos; k0 += KB, b++) {
        int64_t keys = last_pos + 1 - k0 < KB ? last_pos + 1 - k0 : KB;
        int64_t nt = (keys + 15) / 16, nsteps = (keys + 31) / 32;
        float *s = sb[b & 1];
        if (softcap > 0.0f) cap_scores(s, R, rows16, nt, scale, softcap);
        for (int64_t t = 0; t < R; t++) {
            int64_t r0 = 16 * (t % QT), trows = rows - r0 < 16 ? rows - r0 : 16;
            if (trows <= 0) continue;
            softmax_tile(s + t * 16 * KB, nt, k0, first_pos + r0, trows, window, scale2, w->m + t * 16,
                         w->l + t * 16, w->o + t * 16 * D, D, w->p + t * 16 * KB);
        }
        /* the next step's scores go to the tiles between the writes of P and O and the tile loads
         * that read them: a tile load right behind vector stores to its lines waits for them */
        if (k0 + KB <= last_pos) scores(w, R, D, kp, k0 + KB, last_pos, amx, sb[(b + 1) & 1]);
        if (amx) values_amx(w->p, R, D, vp, k0 / 32, nsteps, w->o);
        else values_avx(w->p, R, D, vp, k0 / 32, nsteps, w->o);
    }
    for (int64_t t = 0; t < R; t++)
        for (int64_t i = 0, r0 = 16 * (t % QT); i < 16 && r0 + i < rows; i++) {
            int64_t r = t * 16 + i, row = r0 + i;
            __m512 inv = _mm512_set1_ps(1.0f / w->l[r]);
            uint16_t *dst = out + ((sq->q_start + i0 + row) * H + kvh * G + t / QT) * D;
            for (int64_t c = 0; c < D; c += 16)
                _mm256_storeu_si256((__m256i *)(dst + c),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(w->o + r * D + c), inv)));
        }
}

/* ---- entry ------------------------------------------------------------------------------------- */

/* Kept from call to call (scratch.h): the calling thread's sequences, tasks and K/V packs (1.5 MiB
 * for SmolLM2's 2,048-token chunk), and each thread's task scratch ([G QB] rows of q, scores, P, O). */
static __thread rtp_scratch info_scratch, task_scratch, pack_scratch, work_scratch;

typedef struct {
    int32_t seq, qb;
    int64_t cost;
} task;

static int longest_first(const void *a, const void *b) {
    int64_t x = ((const task *)a)->cost, y = ((const task *)b)->cost;
    return (x < y) - (x > y);
}

/* q bf16 [T, H, D] contiguous; k_cache / v_cache bf16, slot s of kv head h at s * tok_stride + h * D, or
 * int8 with fp32 scales k_scales / v_scales [slots, Hkv] (NULL: bf16; rtp_rope_store_kv writes both).
 * The sequences are rows [first_row, first_row + nseq) of a step plan (rtp/runtime/step_plan.pyx), read
 * as the plan holds them, so a captured call replays any step: row r's query tokens are
 * [qsl[r], qsl[r + 1]) of q and out, it attends to seq_lens[r] keys (its chunk's own included,
 * already in the cache), and its block ids are block_tables[r * ldt ...]. out bf16 [T, H, D]: rows of
 * tokens outside every sequence are left alone. D a multiple of 32, at most 256; H / Hkv at most 16.
 * window > 0: each token sees its last `window` positions. amx: use the tiles (the caller checked
 * rtp_amx_supported()). softcap > 0: each scaled score becomes softcap * tanh(score / softcap) before
 * the mask and the softmax (Gemma 2); 0: none. Returns 0 when scratch memory could not be had. */
AMX_TARGET int rtp_prefill_attention_bf16(const uint16_t *q, const void *k_cache, const void *v_cache,
                                          int64_t tok_stride, const int32_t *qsl, const int32_t *seq_lens,
                                          const int32_t *tables, int64_t ldt, int64_t first_row, int64_t nseq,
                                          uint16_t *out, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                                          float scale, int64_t window, int amx, const float *k_scales,
                                          const float *v_scales, float softcap) {
    if (nseq <= 0) return 1;
    int64_t G = H / Hkv;
    seq_info *info = rtp_scratch_get(&info_scratch, sizeof(seq_info) * (size_t)nseq);
    if (!info) return 0;
    int64_t pack = 0, ntasks = 0, nsteps = 0;
    for (int64_t i = 0; i < nseq; i++) {
        seq_info *sq = &info[i];
        int64_t r = first_row + i;
        sq->q_start = qsl[r];
        sq->n = qsl[r + 1] - qsl[r];
        sq->ctx = seq_lens[r];
        sq->table_off = r * ldt;
        if (sq->n <= 0 || sq->ctx <= 0) sq->n = sq->ctx = 0;
        sq->padded = round_up(sq->ctx, 32);
        sq->pack_off = pack;
        pack += sq->padded * D * Hkv;
        ntasks += (sq->n + QB - 1) / QB;
        nsteps += sq->padded / 32 * Hkv;
    }
    uint16_t *kpack = rtp_scratch_get(&pack_scratch, (size_t)pack * 4); /* K then V */
    task *tasks = rtp_scratch_get(&task_scratch, sizeof(task) * (size_t)ntasks);
    if (!kpack || !tasks) return 0;
    uint16_t *vpack = kpack + pack;
    int64_t nt = 0;
    for (int64_t i = 0; i < nseq; i++)
        for (int64_t qb = 0; qb * QB < info[i].n; qb++) {
            int64_t last = info[i].ctx - info[i].n + (qb + 1) * QB;
            int64_t first = window > 0 && last - QB - window > 0 ? last - QB - window : 0;
            tasks[nt++] = (task){(int32_t)i, (int32_t)qb, last - first};
        }
    qsort(tasks, (size_t)ntasks, sizeof(task), longest_first);
    int failed = 0;
#pragma omp parallel
    {
        unsigned csr = rtp_flush_denormals();
        /* pack: tasks (sequence, kv head, step of 32 keys), flattened */
#pragma omp for schedule(static)
        for (int64_t u = 0; u < nsteps; u++) {
            int64_t i = 0, rest = u;
            while (rest >= info[i].padded / 32 * Hkv) rest -= info[i++].padded / 32 * Hkv;
            const seq_info *sq = &info[i];
            int64_t h = rest / (sq->padded / 32), t = rest % (sq->padded / 32);
            int64_t off = sq->pack_off + h * sq->padded * D;
            pack_step(k_cache, v_cache, tok_stride, k_scales, v_scales, Hkv, tables + sq->table_off, block_size,
                      sq->ctx, h, D, t, (uint32_t *)(kpack + off), (uint32_t *)(vpack + off));
        }
        scratch w = {0};
        size_t rowsz = (size_t)(G * QB);
        char *mem = rtp_scratch_get(&work_scratch, rowsz * ((size_t)D * 6 + KB * 10 + 8));
        if (!mem) {
#pragma omp atomic write
            failed = 1;
        } else {
            w.q = (uint16_t *)mem;
            w.s = (float *)(mem + rowsz * D * 2);
            w.p = (uint16_t *)((char *)w.s + rowsz * KB * 8);
            w.o = (float *)((char *)w.p + rowsz * KB * 2);
            w.m = w.o + rowsz * D;
            w.l = w.m + rowsz;
        }
        if (amx && mem) rtp_configure_tiles(8);
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < ntasks * Hkv; u++) {
            if (!mem) continue;
            const task *tk = &tasks[u / Hkv];
            const seq_info *sq = &info[tk->seq];
            int64_t h = u % Hkv, off = sq->pack_off + h * sq->padded * D;
            attend(q, out, sq, h, tk->qb, (const uint32_t *)(kpack + off), (const uint32_t *)(vpack + off), H, G, D,
                   scale, window, softcap, amx, &w);
        }
        if (amx && mem) _tile_release();
        rtp_restore_denormals(csr);
    }
    return !failed;
}
#endif
