/* What rtp's linear kernels over weight records in tile order share (amx_linear.c: AMX, decode
 * rows; amx_gemm.c: AMX, prompt rows; avx_gemm.c: AVX-512 BF16, any rows on a CPU without AMX):
 * the records, their dequantization into bf16 tiles, a 16 x 16 transpose, the GEMMs' epilogues, and
 * the pair-tile product loop (which prefill_attention.c's AVX-512 products use too). One definition,
 * so that all three multiply exactly the same bf16 weights. The helpers need AVX-512 BF16 only, so
 * that the kernels built for AMX and the one built without it both inline them. */
#ifndef RTP_TILE_BLOCKS_H
#define RTP_TILE_BLOCKS_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "vec_math.h"

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

/* The weights in tile order (rtp/kernels/quant.py, BlockQuantized.tile_layout): for each group
 * of 16 output rows and k block, one contiguous record: kind 0, Q4_1: the 16 rows' 16 quant
 * bytes, then their 16 d, then their 16 m (fp32): 384 bytes. 1, Q8_0: 16 x 32 quant bytes, 16 d:
 * 576. 2, Q8_1: 16 x 32 quant bytes, 16 d, 16 m: 640. 3, Q8 with a scale per 16 weights: 16 x 32
 * quant bytes, then each row's two scales (16 x 2 fp32): 640. 4, bf16: the 16 x 32 weights
 * themselves, 1024 (a bf16 checkpoint's dense layers).
 * Read front to back, the weights are one sequential stream for the hardware prefetcher;
 * in GGUF's row order a tile gathered from 16 rows x 3 arrays, 48 streams, and stalled. */
static inline int64_t record_bytes(int kind) { return kind == 0 ? 384 : kind == 1 ? 576 : kind == 4 ? 1024 : 640; }

/* One 16 x 32 weight tile from its record, as bf16 rows of 64 bytes.
 * Q4_1: a row has only 16 distinct weights, q * d + m for q = 0..15, so they are computed once
 * per row (the same fp32 then bf16 values as dequantizing each weight) and vpermw looks the
 * 32 nibbles up in that table: 7 vector ops a row where converting each nibble took 13, and
 * the dequantization shares the vector ports with the AMX loads. */
RTP_VEC_TARGET static inline void dequant_tile(int kind, const uint8_t *rec, uint16_t *tile) {
    if (kind == 4) { /* bf16: the record is the tile */
        for (int64_t r = 0; r < 16; r++)
            _mm512_store_si512((void *)(tile + r * 32), _mm512_load_si512((const void *)(rec + r * 64)));
        return;
    }
    const float *d = (const float *)(rec + (kind == 0 ? 256 : 512));
    const float *mn = d + 16;
    if (kind == 0) {
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (int64_t r = 0; r < 16; r++) {
            __m512 w = _mm512_add_ps(_mm512_mul_ps(iota, _mm512_set1_ps(d[r])), _mm512_set1_ps(mn[r]));
            __m512i table = (__m512i)_mm512_cvtne2ps_pbh(w, w); /* words 16-31 repeat 0-15 */
            /* byte j holds weight j (low nibble) and weight j + 16 (high nibble). vpermw reads the
             * low 5 bits of each index, so a whole byte indexes its low nibble: the repeated
             * table makes bit 4 a don't-care. */
            __m256i bytes = _mm256_cvtepu8_epi16(_mm_load_si128((const __m128i *)(rec + r * 16)));
            __m512i index = _mm512_inserti64x4(_mm512_castsi256_si512(bytes), _mm256_srli_epi16(bytes, 4), 1);
            _mm512_store_si512((void *)(tile + r * 32), _mm512_permutexvar_epi16(index, table));
        }
        return;
    }
    for (int64_t r = 0; r < 16; r++) { /* the int8 kinds: 32 signed bytes, as q * d (+ m) */
        __m512 d_lo = _mm512_set1_ps(kind == 3 ? d[2 * r] : d[r]), d_hi = _mm512_set1_ps(kind == 3 ? d[2 * r + 1] : d[r]);
        const int8_t *q = (const int8_t *)rec + r * 32;
        __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i *)q))), d_lo);
        __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i *)(q + 16)))), d_hi);
        if (kind == 2) {
            lo = _mm512_add_ps(lo, _mm512_set1_ps(mn[r]));
            hi = _mm512_add_ps(hi, _mm512_set1_ps(mn[r]));
        }
        _mm512_store_si512((void *)(tile + r * 32), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* Rows [m0, m0 + rows) of x (bf16, or fp32 rounded to nearest even) as bf16 rows of K (amx_gemm.c's A
 * operand, avx_gemm.c's few rows). */
RTP_VEC_TARGET static inline void copy_rows_bf16(const void *x, int x_fp32, int64_t ldx, int64_t m0, int64_t rows,
                                                 int64_t K, uint16_t *dst) {
    for (int64_t m = 0; m < rows; m++) {
        uint16_t *d = dst + m * K;
        if (!x_fp32) {
            memcpy(d, (const uint16_t *)x + (m0 + m) * ldx, (size_t)K * 2);
            continue;
        }
        const float *s = (const float *)x + (m0 + m) * ldx;
        for (int64_t k = 0; k < K; k += 16)
            _mm256_store_si256((__m256i *)(d + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + k)));
    }
}

/* v rounded to bf16 (nearest even) and widened back. */
RTP_VEC_TARGET static inline __m512 round_bf16(__m512 v) {
    __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}

/* The 16 x 16 matrix of uint32 at in (rows of 16) transposed into out. */
RTP_VEC_TARGET static inline void transpose16x16(const uint32_t *in, uint32_t *out) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512((const void *)(in + 16 * i));
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
    for (int i = 0; i < 16; i++) _mm512_store_si512((void *)(out + 16 * i), r[i]);
}

/* The n weight tiles of a record column from recs on as B tiles (1 KiB each: row r holds the 16 features'
 * pair r), the layout of AMX's B operand (amx_gemm.c) and of avx_gemm.c's few-row loop. */
RTP_VEC_TARGET static inline void dequant_b_tiles(int kind, const uint8_t *recs, int64_t n, uint32_t *b) {
    uint16_t rows[16 * 32] __attribute__((aligned(64)));
    int64_t rb = record_bytes(kind);
    for (int64_t kb = 0; kb < n; kb++) {
        dequant_tile(kind, recs + kb * rb, rows);
        transpose16x16((const uint32_t *)rows, b + kb * 256);
    }
}

/* The epilogues of the GEMMs (amx_gemm.c, avx_gemm.c), whose sums come out as 16 rows of 16 fp32 at
 * c + 16 j: output rows m0 + j of features [n0, n0 + 16) for j < valid, in the output's dtype, the
 * bias (if any) added. */
RTP_VEC_TARGET static inline void store_rows(const float *c, int64_t m0, int64_t valid, int64_t n0, const float *bias,
                                             void *out, int64_t ldo, int out_bf16) {
    __m512 b = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    for (int64_t j = 0; j < valid; j++) {
        __m512 v = _mm512_add_ps(_mm512_load_ps(c + 16 * j), b);
        if (out_bf16)
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + (m0 + j) * ldo + n0), (__m256i)_mm512_cvtneps_pbh(v));
        else
            _mm512_storeu_ps((float *)out + (m0 + j) * ldo + n0, v);
    }
}

/* An MLP's gate and up sums (cg, cu, as store_rows' c) into bf16 rows of silu(gate + bias_g) * (up + bias_u),
 * gate and up rounded to bf16 first as the decode kernels round them. */
RTP_VEC_TARGET static inline void store_glu_rows(const float *cg, const float *cu, int64_t m0, int64_t valid,
                                                 int64_t n0, const float *bias_g, const float *bias_u, uint16_t *out,
                                                 int64_t ldo) {
    __m512 bg = bias_g ? _mm512_loadu_ps(bias_g + n0) : _mm512_setzero_ps();
    __m512 bu = bias_u ? _mm512_loadu_ps(bias_u + n0) : _mm512_setzero_ps();
    for (int64_t j = 0; j < valid; j++) {
        __m512 g = round_bf16(_mm512_add_ps(_mm512_load_ps(cg + 16 * j), bg));
        __m512 u = round_bf16(_mm512_add_ps(_mm512_load_ps(cu + 16 * j), bu));
        _mm256_storeu_si256((__m256i *)(out + (m0 + j) * ldo + n0), (__m256i)_mm512_cvtneps_pbh(silu_mul_ps(g, u)));
    }
}

/* The product loop of the kernels that multiply packed pair tiles with AVX-512 BF16 dot instructions
 * (avx_gemm.c's weight columns, prefill_attention.c's scores and values): acc[i] += the sum over the
 * tile's 16 rows r of row r (16 lanes, a pair of bf16 each) times the pair b[i * stride + r], broadcast.
 * Each row loaded feeds 16 products, one per accumulator, so the loop is bound by the products, not
 * the loads. pair_tile_product8 runs the same products on the lower 8 lanes (256-bit vectors: AMD
 * Zen 4 issues two a cycle against one of 512 bits), with the same bits in those lanes. */
#define RTP_PAIR_TILE_PRODUCT(NAME, V, BH, LOAD, BCAST, DOT)                                                  \
    RTP_VEC_TARGET static inline __attribute__((always_inline)) void NAME(V acc[16], const uint32_t *tile,    \
                                                                          const uint32_t *b, int64_t stride) { \
        _Pragma("GCC unroll 16") for (int r = 0; r < 16; r++) {                                               \
            BH t = (BH)LOAD((const void *)(tile + 16 * r));                                                   \
            _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++)                                             \
                acc[i] = DOT(acc[i], t, (BH)BCAST((int)b[i * stride + r]));                                   \
        }                                                                                                     \
    }
RTP_VEC_TARGET static inline __m256i rtp_load256(const void *p) { return _mm256_load_si256((const __m256i *)p); }
RTP_PAIR_TILE_PRODUCT(pair_tile_product, __m512, __m512bh, _mm512_load_si512, _mm512_set1_epi32, _mm512_dpbf16_ps)
RTP_PAIR_TILE_PRODUCT(pair_tile_product8, __m256, __m256bh, rtp_load256, _mm256_set1_epi32, _mm256_dpbf16_ps)
#undef RTP_PAIR_TILE_PRODUCT

#endif
