/* Linear layers over Q4_1 blocks with int8 activations and AVX-512 VNNI (vpdpbusd), on a CPU without AMX.
 *
 * avx_gemm.c dequantizes every weight tile to bf16 and multiplies with vdpbf16ps: 32 products an
 * instruction, and a tile's dequantization (about 10 vector ops a row of 32 weights, on the ports the
 * products use) shared only by the rows of the step. Here the weights are never dequantized: a Q4_1
 * weight is d q + m with q a nibble, so with each row of x quantized per k block of 32 as dx qx (qx int8,
 * dx = absmax / 127, as llama.cpp's Q8_1 activations), a block's dot product is
 *     d dx (q . qx) + m dx sum(qx)
 * and q . qx is integer: vpdpbusd multiplies 4 unsigned bytes by 4 signed bytes a lane, 64 products an
 * instruction, at the rate vdpbf16ps runs 32 on AMD Zen 5 (both 2 a cycle, measured). A tile's nibbles
 * become the instructions' operands with 16 shuffles and masks, once per tile for every row.
 *
 * Layout: the lanes are a tile's 16 output features. A record's nibbles (16 features x 16 bytes, byte j
 * holding weight j low and weight j + 16 high) are transposed as 16 x 4 dwords so that vector i holds
 * each feature's bytes 4i..4i+3; its low nibbles are the weights 4i..4i+3, its high nibbles 16 + 4i..,
 * each group of 4 the operand of one vpdpbusd against the row's 4 activations of that group, broadcast.
 * A row's block sum is then scaled into its fp32 sum by d dx (a vector: d per feature) and the m term
 * added: acc = fma(float(q . qx), d dx, acc); acc = fma(m, dx sum(qx), acc), blocks in order.
 *
 * Numerics: x is rounded to int8 per block of 32 (relative error up to 1/254 of the block's largest
 * value), where the bf16 kernels round each element to 8 bits of mantissa; the products and the block
 * sums are exact; the fp32 sums then run block by block in order. A row's bits do not depend on the rows
 * beside it. tools/bench_fidelity.py measures what it does to greedy output.
 */
#include "cpu_kernels.h"
#include "prefetch.h"
#include "scratch.h"
#include "tile_blocks.h"

#include <immintrin.h>
#include <omp.h>
#include <string.h>

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,fma")))

#define Q4_1_BYTES 384 /* a Q4_1 record: 16 x 16 nibble bytes, 16 d, 16 m (tile_blocks.h) */
#define CHUNK 8        /* rows a pass over a column: 8 vpdpbusd chains in flight, each 4 cycles long */

/* The calling thread's quantized rows, shared by the team; each thread's column of weight operands. */
static __thread rtp_scratch quantized_rows_scratch, operand_scratch;

/* Row x (K values, fp32 or bf16) as int8 per block of 32: q (K bytes), dx (the block's scale, absmax / 127)
 * and cx = dx sum(q), one of each per block. */
VNNI_TARGET static void quantize_row(const void *x, int x_fp32, int64_t K, int8_t *q, float *dx, float *cx) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t kb = 0; kb < K / 32; kb++) {
        __m512 lo, hi;
        if (x_fp32) {
            lo = _mm512_loadu_ps((const float *)x + 32 * kb);
            hi = _mm512_loadu_ps((const float *)x + 32 * kb + 16);
        } else {
            const uint16_t *s = (const uint16_t *)x + 32 * kb;
            lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)s)), 16));
            hi = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s + 16))), 16));
        }
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
        float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
        __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)(q + 32 * kb), _mm512_cvtepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(q + 32 * kb + 16), _mm512_cvtepi32_epi8(qhi));
        dx[kb] = d;
        cx[kb] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    }
}

/* The nk records of a Q4_1 column as vpdpbusd operands: per block, 8 vectors, vector g holding each
 * feature's weights 4g..4g+3 as bytes (above). */
VNNI_TARGET static void column_operands(const uint8_t *recs, int64_t nk, __m512i *w) {
    const __m512i idx01 = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
    const __m512i idx23 = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t kb = 0; kb < nk; kb++) {
        const uint8_t *rec = recs + kb * Q4_1_BYTES;
        /* z[a] lane 4 j + i: feature 4 a + j's dword i */
        __m512i z0 = _mm512_loadu_si512((const void *)rec), z1 = _mm512_loadu_si512((const void *)(rec + 64));
        __m512i z2 = _mm512_loadu_si512((const void *)(rec + 128)), z3 = _mm512_loadu_si512((const void *)(rec + 192));
        /* t0: features 0-7's dwords 0, then their dwords 1; t1: dwords 2 and 3; t2, t3: features 8-15 */
        __m512i t0 = _mm512_permutex2var_epi32(z0, idx01, z1), t1 = _mm512_permutex2var_epi32(z0, idx23, z1);
        __m512i t2 = _mm512_permutex2var_epi32(z2, idx01, z3), t3 = _mm512_permutex2var_epi32(z2, idx23, z3);
        __m512i v[4] = {_mm512_shuffle_i64x2(t0, t2, 0x44), _mm512_shuffle_i64x2(t0, t2, 0xEE),
                        _mm512_shuffle_i64x2(t1, t3, 0x44), _mm512_shuffle_i64x2(t1, t3, 0xEE)};
        for (int i = 0; i < 4; i++) {
            w[8 * kb + i] = _mm512_and_si512(v[i], nibble);
            w[8 * kb + 4 + i] = _mm512_and_si512(_mm512_srli_epi16(v[i], 4), nibble);
        }
    }
}

/* c[r][16] = rows r < R of the quantized x (q at row stride K, dx / cx at stride nk) times one column
 * (operands w, records recs for d and m). R a constant per copy, so the chains stay in registers. */
#define COLUMN_ROWS(R)                                                                                              \
    VNNI_TARGET static void column_rows_##R(const __m512i *w, const uint8_t *recs, int64_t nk, const int8_t *q,    \
                                            int64_t K, const float *dx, const float *cx, float *c) {               \
        __m512 acc[R];                                                                                              \
        _Pragma("GCC unroll 8") for (int r = 0; r < (R); r++) acc[r] = _mm512_setzero_ps();                       \
        for (int64_t kb = 0; kb < nk; kb++) {                                                                       \
            const float *dm = (const float *)(recs + kb * Q4_1_BYTES + 256);                                        \
            __m512i ia[R];                                                                                          \
            _Pragma("GCC unroll 8") for (int r = 0; r < (R); r++) ia[r] = _mm512_setzero_si512();                 \
            _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) {                                                  \
                __m512i wg = _mm512_load_si512((const void *)(w + 8 * kb + g));                                     \
                _Pragma("GCC unroll 8") for (int r = 0; r < (R); r++) {                                            \
                    int32_t a;                                                                                      \
                    memcpy(&a, q + r * K + 32 * kb + 4 * g, 4);                                                     \
                    ia[r] = _mm512_dpbusd_epi32(ia[r], wg, _mm512_set1_epi32(a));                                  \
                }                                                                                                   \
            }                                                                                                       \
            __m512 dv = _mm512_loadu_ps(dm), mv = _mm512_loadu_ps(dm + 16);                                        \
            _Pragma("GCC unroll 8") for (int r = 0; r < (R); r++) {                                                \
                __m512 s = _mm512_mul_ps(dv, _mm512_set1_ps(dx[r * nk + kb]));                                      \
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r]), s, acc[r]);                                     \
                acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(cx[r * nk + kb]), acc[r]);                              \
            }                                                                                                       \
        }                                                                                                           \
        _Pragma("GCC unroll 8") for (int r = 0; r < (R); r++) _mm512_store_ps(c + 16 * r, acc[r]);                \
    }
COLUMN_ROWS(1) COLUMN_ROWS(2) COLUMN_ROWS(3) COLUMN_ROWS(4) COLUMN_ROWS(5) COLUMN_ROWS(6) COLUMN_ROWS(7)
COLUMN_ROWS(8)
#undef COLUMN_ROWS

VNNI_TARGET static void column_rows(int64_t R, const __m512i *w, const uint8_t *recs, int64_t nk, const int8_t *q,
                                    int64_t K, const float *dx, const float *cx, float *c) {
    switch (R) {
    case 1: column_rows_1(w, recs, nk, q, K, dx, cx, c); break;
    case 2: column_rows_2(w, recs, nk, q, K, dx, cx, c); break;
    case 3: column_rows_3(w, recs, nk, q, K, dx, cx, c); break;
    case 4: column_rows_4(w, recs, nk, q, K, dx, cx, c); break;
    case 5: column_rows_5(w, recs, nk, q, K, dx, cx, c); break;
    case 6: column_rows_6(w, recs, nk, q, K, dx, cx, c); break;
    case 7: column_rows_7(w, recs, nk, q, K, dx, cx, c); break;
    default: column_rows_8(w, recs, nk, q, K, dx, cx, c); break;
    }
}

int rtp_vnni_supported(void) {
    static int supported = -1; /* the CPU's answer does not change: asked once */
    if (supported < 0) {
        __builtin_cpu_init();
        supported = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bf16");
    }
    return supported;
}

/* rtp_gemm_avx's contract (avx_gemm.c) for Q4_1 records, x's rows as int8 (above). Returns 0 where it
 * cannot run (no memory for its scratch; an MLP whose output is not bf16). */
VNNI_TARGET int rtp_gemm_vnni(const void *x, int64_t ldx, int x_fp32, const uint8_t *weights, const float *bias,
                              void *out, int64_t ldo, int out_bf16, int64_t M, int64_t N, int64_t K, int glu) {
    if (glu && (!out_bf16 || N % 32)) return 0;
    int64_t nk = K / 32, units = glu ? N / 32 : N / 16, cols = glu ? 2 : 1;
    int64_t unit_bytes = cols * nk * Q4_1_BYTES, esize = x_fp32 ? 4 : 2;
    /* per row: K int8, then nk dx and nk cx */
    size_t row_bytes = (size_t)K + 2 * (size_t)nk * sizeof(float);
    char *rows = rtp_scratch_get(&quantized_rows_scratch, (size_t)M * row_bytes);
    if (!rows) return 0;
    int8_t *q = (int8_t *)rows;
    float *dx = (float *)(rows + (size_t)M * K), *cx = dx + M * nk;
    int ok = 1;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            quantize_row((const char *)x + m * ldx * esize, x_fp32, K, q + m * K, dx + m * nk, cx + m * nk);
        __m512i *w = rtp_scratch_get(&operand_scratch, (size_t)(cols * nk * 8) * sizeof(__m512i));
        if (!w) {
#pragma omp atomic write
            ok = 0;
        }
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            if (!w) continue;
            const uint8_t *recs = weights + u * unit_bytes;
            if (u + 1 < units) /* the next unit's records into L2, as avx_gemm.c */
                for (int64_t off = 0; off < unit_bytes; off += 64) rtp_prefetch_l2(recs + unit_bytes + off);
            for (int64_t col = 0; col < cols; col++) column_operands(recs + col * nk * Q4_1_BYTES, nk, w + col * nk * 8);
            float c[2][CHUNK * 16] __attribute__((aligned(64)));
            for (int64_t m0 = 0; m0 < M; m0 += CHUNK) {
                int64_t R = M - m0 < CHUNK ? M - m0 : CHUNK;
                for (int64_t col = 0; col < cols; col++)
                    column_rows(R, w + col * nk * 8, recs + col * nk * Q4_1_BYTES, nk, q + m0 * K, K, dx + m0 * nk,
                                cx + m0 * nk, c[col]);
                if (glu)
                    store_glu_rows(c[0], c[1], m0, R, 16 * u, bias, bias ? bias + N / 2 : NULL, out, ldo);
                else
                    store_rows(c[0], m0, R, 16 * u, bias, out, ldo, out_bf16);
            }
        }
    }
    return ok;
}
