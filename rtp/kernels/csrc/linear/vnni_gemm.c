/* Linear layers over Q4_1 and Q8_0 blocks with int8 activations and AVX-512 VNNI (vpdpbusd), on a CPU
 * without AMX (--activation-dtype int8).
 *
 * avx_gemm.c dequantizes every weight tile to bf16 and multiplies with vdpbf16ps: 32 products an
 * instruction, and a tile's dequantization (about 10 vector ops a row of 32 weights, on the ports the
 * products use) shared only by the rows of the step. Here the weights are never dequantized. With each
 * row of x quantized per k block of 32 as dx qx (qx int8, dx = absmax / 127, as llama.cpp's Q8
 * activations), a block's dot product with weights d q + m (Q4_1: q a nibble) is
 *     d dx (q . qx) + m dx sum(qx)
 * and q . qx is integer: vpdpbusd multiplies 4 unsigned bytes by 4 signed bytes a lane, 64 products an
 * instruction, at the rate vdpbf16ps runs 32 on AMD Zen 5 (both 2 a cycle, measured). Q8_0's weights
 * d q are signed: the operands hold q + 128 (unsigned), and 128 sum(qx) comes off the integer sum, exactly.
 *
 * Layout: the lanes are a tile's 16 output features; vector g of a block holds each feature's weights
 * 4g..4g+3 as bytes, the operand of one vpdpbusd against the row's activations 4g..4g+3, broadcast.
 * A Q4_1 record's nibbles (16 features x 16 bytes, byte j holding weight j low and j + 16 high) become
 * those 8 vectors by a 16 x 4-dword transpose and a mask; a Q8_0 record's bytes (16 x 32) by a 16 x 8-dword
 * transpose. Once per tile, for every row of the call. A row's block sum is then scaled into its fp32
 * sum: acc = fma(float(q . qx), d dx, acc), and for Q4_1 acc = fma(m, dx sum(qx), acc), blocks in order.
 *
 * Numerics: x is rounded to int8 per block of 32 (an error up to 1/254 of the block's largest value, where
 * bf16 rounds each element to 8 bits of mantissa); the products and the block sums are exact; the fp32
 * sums run block by block in order, so a row's bits do not depend on the rows beside it.
 * tools/bench_fidelity.py --activation-dtype int8 measures what it does to greedy output.
 *
 * Measured on AMD Zen 5 (SmolLM2's four layer shapes against avx_gemm.c, alternated in one process):
 * 1.41x at 2,048 and 64 rows, 1.55x at 16, 2.2x at 2-4. A scale per 16 values (two integer sums a block)
 * ran 5-12 % slower for a greedy-fidelity change inside that metric's noise; rows blocked to stay in L2
 * across units ran no faster (docs/benchmarks.md).
 */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include "cpu_kernels.h"
#include "prefetch.h"
#include "scratch.h"
#include "tile_blocks.h"

#include <immintrin.h>
#include <omp.h>

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,fma")))

#define OPERANDS 10 /* vectors a block: 8 of weight bytes, the 16 features' d, their m (Q4_1) */
#define CHUNK 8        /* rows a pass over a column: 8 vpdpbusd chains in flight, each 4 cycles long */

/* The calling thread's quantized rows, shared by the team; each thread's column of weight operands. */
static __thread rtp_scratch quantized_rows_scratch, operand_scratch;

/* Row x (K values, fp32 or bf16) as int8 per block of 32: q (K bytes), dx (the block's scale, absmax / 127),
 * cx = dx sum(q) and s128 = 128 sum(q), one of each per block. */
VNNI_TARGET static void quantize_row(const void *x, int x_fp32, int64_t K, int8_t *q, float *dx, float *cx,
                                     int32_t *s128) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t kb = 0; kb < K / 32; kb++) {
        __m512 lo, hi;
        if (x_fp32) {
            lo = _mm512_loadu_ps((const float *)x + 32 * kb);
            hi = _mm512_loadu_ps((const float *)x + 32 * kb + 16);
        } else {
            lo = bf16x16_to_f32((const uint16_t *)x + 32 * kb);
            hi = bf16x16_to_f32((const uint16_t *)x + 32 * kb + 16);
        }
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
        float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
        __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)(q + 32 * kb), _mm512_cvtepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(q + 32 * kb + 16), _mm512_cvtepi32_epi8(qhi));
        int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        dx[kb] = d;
        cx[kb] = d * (float)sum;
        s128[kb] = 128 * sum;
    }
}

/* The nk records of a column as vpdpbusd operands, OPERANDS vectors a block (above). kind 0: Q4_1
 * (records of 384 bytes: 16 x 16 nibble bytes, 16 d, 16 m); 1: Q8_0 (576: 16 x 32 bytes, 16 d). */
VNNI_TARGET static void column_operands(int kind, const uint8_t *recs, int64_t nk, __m512i *w) {
    int64_t rb = record_bytes(kind);
    const __m512i idx01 = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
    const __m512i idx23 = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
    for (int64_t kb = 0; kb < nk; kb++) {
        __m512i *o = w + OPERANDS * kb;
        if (kind == 0) {
            const uint8_t *rec = recs + kb * rb;
            /* z[a] lane 4 j + i: feature 4 a + j's dword i */
            __m512i z0 = _mm512_loadu_si512((const void *)rec), z1 = _mm512_loadu_si512((const void *)(rec + 64));
            __m512i z2 = _mm512_loadu_si512((const void *)(rec + 128)), z3 = _mm512_loadu_si512((const void *)(rec + 192));
            /* t0: features 0-7's dwords 0, then their dwords 1; t1: dwords 2 and 3; t2, t3: features 8-15 */
            __m512i t0 = _mm512_permutex2var_epi32(z0, idx01, z1), t1 = _mm512_permutex2var_epi32(z0, idx23, z1);
            __m512i t2 = _mm512_permutex2var_epi32(z2, idx01, z3), t3 = _mm512_permutex2var_epi32(z2, idx23, z3);
            __m512i v[4] = {_mm512_shuffle_i64x2(t0, t2, 0x44), _mm512_shuffle_i64x2(t0, t2, 0xEE),
                            _mm512_shuffle_i64x2(t1, t3, 0x44), _mm512_shuffle_i64x2(t1, t3, 0xEE)};
            const __m512i nibble = _mm512_set1_epi8(0x0F);
            for (int i = 0; i < 4; i++) {
                o[i] = _mm512_and_si512(v[i], nibble);
                o[4 + i] = _mm512_and_si512(_mm512_srli_epi16(v[i], 4), nibble);
            }
            o[8] = _mm512_loadu_si512((const void *)(rec + 256));
            o[9] = _mm512_loadu_si512((const void *)(rec + 320));
        } else {
            const uint8_t *rec = recs + kb * rb;
            /* z[a] lanes 0-7: feature 2 a's dwords 0-7, lanes 8-15: feature 2 a + 1's. Then, for each four
             * features 4 b..4 b + 3 (z[2 b], z[2 b + 1]), lo[b] lane 4 g + j: feature 4 b + j's dword g < 4,
             * hi[b] the same for dwords 4-7 */
            const __m512i lo_idx = _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27);
            const __m512i hi_idx = _mm512_setr_epi32(4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31);
            /* pairs of four-feature groups: lane 8 h + 4 p + j of the result, for dword g = 2 h' + h of the
             * group (h' picks the result), feature 4 p + j */
            const __m512i g01 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
            const __m512i g23 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
            __m512i lo[4], hi[4];
            for (int b = 0; b < 4; b++) {
                __m512i za = _mm512_loadu_si512((const void *)(rec + 128 * b));
                __m512i zb = _mm512_loadu_si512((const void *)(rec + 128 * b + 64));
                lo[b] = _mm512_permutex2var_epi32(za, lo_idx, zb);
                hi[b] = _mm512_permutex2var_epi32(za, hi_idx, zb);
            }
            /* features 0-7 and 8-15 of dwords (0, 1), (2, 3), (4, 5), (6, 7): lanes 8 h + f' */
            __m512i f07[4] = {_mm512_permutex2var_epi32(lo[0], g01, lo[1]), _mm512_permutex2var_epi32(lo[0], g23, lo[1]),
                              _mm512_permutex2var_epi32(hi[0], g01, hi[1]), _mm512_permutex2var_epi32(hi[0], g23, hi[1])};
            __m512i f8f[4] = {_mm512_permutex2var_epi32(lo[2], g01, lo[3]), _mm512_permutex2var_epi32(lo[2], g23, lo[3]),
                              _mm512_permutex2var_epi32(hi[2], g01, hi[3]), _mm512_permutex2var_epi32(hi[2], g23, hi[3])};
            const __m512i bias = _mm512_set1_epi8((char)0x80); /* q + 128: the unsigned operand */
            for (int p = 0; p < 4; p++) {
                o[2 * p] = _mm512_xor_si512(_mm512_shuffle_i64x2(f07[p], f8f[p], 0x44), bias);
                o[2 * p + 1] = _mm512_xor_si512(_mm512_shuffle_i64x2(f07[p], f8f[p], 0xEE), bias);
            }
            o[8] = _mm512_loadu_si512((const void *)(rec + 512));
        }
    }
}

/* acc + w . (the 4 bytes at a, broadcast): vpdpbusd with the broadcast folded into its memory operand
 * (m32bcst), which GCC 12 does not do for this instruction (it emitted a vpbroadcastd before every
 * product). AMD Zen 4, SmolLM2's four layer shapes at 2,048 rows, 30 layers, two threads, alternated
 * with the build before 11 times: median 866 against 911 ms (best 825 against 852), the same bits. */
VNNI_TARGET static inline __m512i dpbusd_bcst(__m512i acc, __m512i w, const int8_t *a) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)a));
    return acc;
}

/* c[r][16] = rows r < R of the quantized x (q at row stride K; dx, cx, s128 at stride nk) times one column
 * of operands w. Q8: Q8_0's operands (q + 128: 128 sum(qx) off the integer sums), else Q4_1's (the m term).
 * R and Q8 constants per copy, so the chains stay in registers. */
#define COLUMN_ROWS(R, Q8)                                                                                          \
    VNNI_TARGET static void column_rows_##R##_##Q8(const __m512i *w, int64_t nk, const int8_t *q, int64_t K,       \
                                                   const float *dx, const float *cx, const int32_t *s128,          \
                                                   float *c) {                                                      \
        __m512 acc[R];                                                                                              \
        _Pragma("GCC unroll 8") for (int r = 0; r < (R); r++) acc[r] = _mm512_setzero_ps();                       \
        for (int64_t kb = 0; kb < nk; kb++) {                                                                       \
            const __m512i *o = w + OPERANDS * kb;                                                                   \
            __m512i ia[R];                                                                                          \
            _Pragma("GCC unroll 8") for (int r = 0; r < (R); r++)                                                  \
                ia[r] = (Q8) ? _mm512_set1_epi32(-s128[r * nk + kb]) : _mm512_setzero_si512();                      \
            _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) {                                                  \
                __m512i wg = _mm512_load_si512((const void *)(o + g));                                              \
                _Pragma("GCC unroll 8") for (int r = 0; r < (R); r++)                                              \
                    ia[r] = dpbusd_bcst(ia[r], wg, q + r * K + 32 * kb + 4 * g);                                   \
            }                                                                                                       \
            __m512 dv = _mm512_load_ps((const float *)(o + 8)), mv = _mm512_load_ps((const float *)(o + 9));       \
            _Pragma("GCC unroll 8") for (int r = 0; r < (R); r++) {                                                \
                __m512 s = _mm512_mul_ps(dv, _mm512_set1_ps(dx[r * nk + kb]));                                      \
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r]), s, acc[r]);                                     \
                if (!(Q8)) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(cx[r * nk + kb]), acc[r]);                   \
            }                                                                                                       \
        }                                                                                                           \
        _Pragma("GCC unroll 8") for (int r = 0; r < (R); r++) _mm512_store_ps(c + 16 * r, acc[r]);                \
    }
#define COLUMN_ROWS_BOTH(R) COLUMN_ROWS(R, 0) COLUMN_ROWS(R, 1)
COLUMN_ROWS_BOTH(1) COLUMN_ROWS_BOTH(2) COLUMN_ROWS_BOTH(3) COLUMN_ROWS_BOTH(4) COLUMN_ROWS_BOTH(5)
COLUMN_ROWS_BOTH(6) COLUMN_ROWS_BOTH(7) COLUMN_ROWS_BOTH(8)
#undef COLUMN_ROWS_BOTH
#undef COLUMN_ROWS

VNNI_TARGET static void column_rows(int64_t R, int q8, const __m512i *w, int64_t nk, const int8_t *q, int64_t K,
                                    const float *dx, const float *cx, const int32_t *s128, float *c) {
    switch (R * 2 + (q8 != 0)) {
#define ROWS(r)                                                                  \
    case 2 * r: column_rows_##r##_0(w, nk, q, K, dx, cx, s128, c); break;     \
    case 2 * r + 1: column_rows_##r##_1(w, nk, q, K, dx, cx, s128, c); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
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

/* rtp_gemm_avx's contract (avx_gemm.c) for Q4_1 (kind 0) or Q8_0 (kind 1) records, x's rows as int8
 * (above). Returns 0 where it cannot run (no memory for its scratch; an MLP whose output is not bf16). */
VNNI_TARGET int rtp_gemm_vnni(const void *x, int64_t ldx, int x_fp32, int kind, const uint8_t *weights,
                              const float *bias, void *out, int64_t ldo, int out_bf16, int64_t M, int64_t N,
                              int64_t K, int glu) {
    if ((glu && (!out_bf16 || N % 32)) || (kind != 0 && kind != 1)) return 0;
    int64_t nk = K / 32, units = glu ? N / 32 : N / 16, cols = glu ? 2 : 1;
    int64_t col_bytes = nk * record_bytes(kind), unit_bytes = cols * col_bytes, esize = x_fp32 ? 4 : 2;
    /* per row: K int8, then nk each of dx, cx and s128 */
    size_t row_bytes = (size_t)K + 3 * (size_t)nk * sizeof(float);
    char *rows = rtp_scratch_get(&quantized_rows_scratch, (size_t)M * row_bytes);
    if (!rows) return 0;
    int8_t *q = (int8_t *)rows;
    float *dx = (float *)(rows + (size_t)M * K), *cx = dx + M * nk;
    int32_t *s128 = (int32_t *)(cx + M * nk);
    int ok = 1;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            quantize_row((const char *)x + m * ldx * esize, x_fp32, K, q + m * K, dx + m * nk, cx + m * nk,
                         s128 + m * nk);
        __m512i *w = rtp_scratch_get(&operand_scratch, (size_t)(cols * nk * OPERANDS) * sizeof(__m512i));
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
            for (int64_t col = 0; col < cols; col++)
                column_operands(kind, recs + col * col_bytes, nk, w + col * nk * OPERANDS);
            float c[2][CHUNK * 16] __attribute__((aligned(64)));
            for (int64_t m0 = 0; m0 < M; m0 += CHUNK) {
                int64_t R = M - m0 < CHUNK ? M - m0 : CHUNK;
                for (int64_t col = 0; col < cols; col++)
                    column_rows(R, kind == 1, w + col * nk * OPERANDS, nk, q + m0 * K, K, dx + m0 * nk, cx + m0 * nk,
                                s128 + m0 * nk, c[col]);
                if (glu)
                    store_glu_rows(c[0], c[1], m0, R, 16 * u, bias, bias ? bias + N / 2 : NULL, out, ldo);
                else
                    store_rows(c[0], m0, R, 16 * u, bias, out, ldo, out_bf16);
            }
        }
    }
    return ok;
}
#endif
