/* The avx512 path's linears (AVX-512 with VNNI and without BF16: Intel Cascade Lake to Ice Lake servers,
 * Tiger Lake): block-quantized weights with 16 outputs in the lanes of a vector.
 *
 * x's rows are integer blocks as the avx2 path takes them (avx2/int8_rows.h: 15-bit q = 128 h + l a value, a
 * scale a block of 32). The avx2 kernels hold one weight row's block in a vector and reduce it across lanes; at
 * several rows they are bound by that work (13 vector ops a block and row; 512-bit vectors, which Intel issues
 * on two ports where it issues 256-bit ones on three, did not shorten it: measured). Here a record holds 16
 * output rows' block interleaved by 4 bytes (BlockQuantized.lane_layout), so one vpdpbusd multiplies 4 values
 * of x (broadcast) into 16 outputs' int32 sums: 16 of them a block and row for both halves of x, no
 * reduction, and the block's scales applied to 16 outputs at once.
 *
 * y[i][n] = sum_b (d_w[n][b] d_x[i][b]) (q_w . q_x)_b  +  sum_b m[n][b] s_x[i][b]  (+ bias)
 * Each sum runs over the blocks in order in one fp32 lane per output; the integer products are exact; nothing
 * depends on the batch, the rows' places in it or the threads: a row's bits are its own. (They are not the
 * avx2 path's, which sums 8 lanes a block: each ISA path has its own bits.)
 *
 * vpdpbusd multiplies unsigned by signed bytes: Q4_1's nibbles are unsigned as they are; the int8 kinds are
 * stored plus 128 (as unsigned) and 128 times x's integer sum over the block (or half block, for q8_16's two
 * scales) is taken off the int32 sum, which leaves it exact. */
#if defined(__x86_64__) /* x86-64 only */
#include "avx2/int8_rows.h"
#include "cpu_kernels.h"
#include "int8_blocks.h"
#include "scratch.h"
#include "tile_blocks.h"

#include <immintrin.h>
#include <omp.h>

#define LANES_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define MR 4           /* rows a pass over a record column */
#define ROW_CHUNK 64   /* rows whose integer blocks stay in L1/L2 while every record column passes over them */

/* Records: per 16 output rows and block of 32, kind 0 (Q4_1 and its repacks): 4 x 64 bytes, vector v lane n
 * the bytes 4v..4v+3 of row n's 16 nibble bytes (low nibble: value 4v + t, high: 16 + 4v + t), then d and m
 * (16 fp32 each); kinds 1 (q8_0), 2 (q8_1), 3 (q8_16): 8 x 64 bytes, vector g lane n row n's values
 * 4g..4g+3 plus 128, then d (q8_16: the first halves' 16, then the second halves' 16), then m (q8_1): a tile
 * record's bytes in another order, so its size is record_bytes (tile_blocks.h). */

LANES_TARGET static inline __m512i bcast4(const int8_t *p) { return _mm512_set1_epi32(*(const int32_t *)p); }

/* Rows [i0, i0 + mr) (mr <= MR) times one record column (outputs n0..n0+15), into out. */
LANES_TARGET static void column_rows(int kind, const uint8_t *col, int64_t K, int8_rows x, int64_t i0, int mr,
                                     int64_t n0, const float *bias, void *out, int64_t ldo, int out_bf16) {
    const int64_t rb = record_bytes(kind), nb = K / 32;
    __m512 acc[MR], off[MR];
    for (int i = 0; i < MR; i++) acc[i] = off[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *rec = col + b * rb;
        __m512i w[8];
        if (kind == 0) {
            const __m512i nibble = _mm512_set1_epi8(0x0f);
            for (int v = 0; v < 4; v++) {
                __m512i q = _mm512_load_si512((const void *)(rec + 64 * v));
                w[v] = _mm512_and_si512(q, nibble);
                w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(q, 4), nibble);
            }
        } else {
            for (int g = 0; g < 8; g++) w[g] = _mm512_load_si512((const void *)(rec + 64 * g));
        }
        const float *dw = (const float *)(rec + (kind == 0 ? 256 : 512));
        __m512 d0 = _mm512_load_ps(dw), d1 = kind == 3 ? _mm512_load_ps(dw + 16) : d0;
        __m512 m = kind == 0 || kind == 2 ? _mm512_load_ps(dw + 16) : _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++) {
            if (i >= mr) break;
            const int64_t r = i0 + i;
            const int8_t *h = x.h + r * K + 32 * b, *l = x.l + r * K + 32 * b;
            __m512i h0 = _mm512_setzero_si512(), l0 = h0, h1 = h0, l1 = h0; /* values 0-15, 16-31 */
#pragma GCC unroll 4
            for (int g = 0; g < 4; g++) {
                h0 = _mm512_dpbusd_epi32(h0, w[g], bcast4(h + 4 * g));
                l0 = _mm512_dpbusd_epi32(l0, w[g], bcast4(l + 4 * g));
                h1 = _mm512_dpbusd_epi32(h1, w[g + 4], bcast4(h + 16 + 4 * g));
                l1 = _mm512_dpbusd_epi32(l1, w[g + 4], bcast4(l + 16 + 4 * g));
            }
            __m512i s0 = _mm512_add_epi32(_mm512_slli_epi32(h0, 7), l0);
            __m512i s1 = _mm512_add_epi32(_mm512_slli_epi32(h1, 7), l1);
            if (kind != 0) { /* the stored + 128, taken off: exact */
                s0 = _mm512_sub_epi32(s0, _mm512_set1_epi32(128 * x.qsum[r * 2 * nb + 2 * b]));
                s1 = _mm512_sub_epi32(s1, _mm512_set1_epi32(128 * x.qsum[r * 2 * nb + 2 * b + 1]));
            }
            __m512 dx = _mm512_set1_ps(x.d[r * nb + b]);
            if (kind == 3) {
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(d0, dx), acc[i]);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(d1, dx), acc[i]);
            } else {
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_mul_ps(d0, dx), acc[i]);
            }
            if (kind == 0 || kind == 2) off[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s[r * nb + b]), off[i]);
        }
    }
    __m512 bv = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    for (int i = 0; i < mr; i++) {
        __m512 y = _mm512_add_ps(_mm512_add_ps(acc[i], off[i]), bv);
        if (out_bf16) { /* nearest even, NaN kept NaN (rtp_f32_to_bf16, 16 at once) */
            __m512i u = _mm512_castps_si512(y);
            __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
            r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q),
                                      _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + (i0 + i) * ldo + n0), _mm512_cvtepi32_epi16(r));
        } else {
            _mm512_storeu_ps((float *)out + (i0 + i) * ldo + n0, y);
        }
    }
}

/* out [M, N] = x [M, K] (bf16 or fp32, row stride ldx) @ W^T (+ bias) for W's records in lane order (kind as
 * above; N a multiple of 16, K of 32). Returns 0 without AVX-512 VNNI, for other shapes, or when scratch
 * memory ran out. */
LANES_TARGET int rtp_linear_lanes(const void *x, int64_t ldx, int x_fp32, int kind, const uint8_t *weights,
                                  const float *bias, void *out, int64_t ldo, int out_bf16, int64_t M, int64_t N,
                                  int64_t K) {
    static __thread rtp_scratch q_scratch, scale_scratch, sum_scratch;
    if (!rtp_vnni_supported() || N % 16 || K % 32 || kind < 0 || kind > 3) return 0;
    if (M <= 0) return 1;
    int64_t nb = K / 32;
    int8_t *q = rtp_scratch_get(&q_scratch, (size_t)(2 * M * K));
    float *ds = rtp_scratch_get(&scale_scratch, (size_t)(2 * M * nb) * sizeof(float));
    int32_t *qsum = rtp_scratch_get(&sum_scratch, (size_t)(2 * M * nb) * sizeof(int32_t));
    if (!q || !ds || !qsum) return 0;
    unsigned csr = rtp_flush_denormals(); /* as the avx2 linears (denormals.h), in each thread */
    for (int64_t i = 0; i < M; i++)
        quantize_row(x_fp32 ? (const void *)((const float *)x + i * ldx) : (const void *)((const uint16_t *)x + i * ldx),
                     x_fp32, K, q + i * K, q + (M + i) * K, ds + i * nb, ds + (M + i) * nb, qsum + i * 2 * nb);
    int8_rows rows = {q, q + M * K, ds, ds + M * nb, qsum};
    int64_t units = N / 16, rb = record_bytes(kind);
    for (int64_t m0 = 0; m0 < M; m0 += ROW_CHUNK) {
        int64_t m1 = M - m0 < ROW_CHUNK ? M : m0 + ROW_CHUNK;
#pragma omp parallel
        {
            unsigned thread_csr = rtp_flush_denormals();
#pragma omp for schedule(static)
            for (int64_t u = 0; u < units; u++)
                for (int64_t i = m0; i < m1; i += MR)
                    column_rows(kind, weights + u * nb * rb, K, rows, i, m1 - i < MR ? (int)(m1 - i) : MR, 16 * u,
                                bias, out, ldo, out_bf16);
            rtp_restore_denormals(thread_csr);
        }
    }
    rtp_restore_denormals(csr);
    return 1;
}
#endif
