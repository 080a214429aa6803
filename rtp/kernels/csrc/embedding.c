/* Rows looked up by index: the embedding (the first op of a layer stack, so that a decode step
 * runs on rtp's kernels alone: rtp/kernels/cpu_graph.py replays it without Python) and the gather
 * of a step's sampling rows for the LM head.
 *   embed_rows: out fp32 [T, H] (row stride ldo) = table[ids[t]] (bf16 or fp32, row stride ldt),
 *               times scale unless it is 1 (Gemma's sqrt(hidden_size)), the product rounded to the
 *               table's dtype as torch rounds a bf16 row times a scalar (the fp32 product of two
 *               bf16 values is exact, so one rounding gives torch's bf16 product)
 */
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"

#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/embedding.c) */
#include <immintrin.h>

#include "vec_math.h"

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

TARGET static void scale_row(float *o, int64_t H, float scale, int round_bf16) {
    const __m512 s = _mm512_set1_ps(scale);
    int64_t c = 0;
    for (; c + 16 <= H; c += 16) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(o + c), s);
        if (round_bf16)
            v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
        _mm512_storeu_ps(o + c, v);
    }
    for (; c < H; c++) {
        float v = o[c] * scale;
        if (round_bf16) {
            uint32_t u = (uint32_t)rtp_f32_to_bf16(v) << 16;
            memcpy(&v, &u, 4);
        }
        o[c] = v;
    }
}

TARGET void rtp_embed_rows(const void *table, int table_bf16, int64_t ldt, const int32_t *ids, float *out,
                           int64_t ldo, int64_t T, int64_t H, float scale) {
    for (int64_t t = 0; t < T; t++) {
        float *o = out + t * ldo;
        if (table_bf16) {
            const uint16_t *row = (const uint16_t *)table + (int64_t)ids[t] * ldt;
            int64_t c = 0;
            for (; c + 16 <= H; c += 16) _mm512_storeu_ps(o + c, bf16x16_to_f32(row + c));
            for (; c < H; c++) {
                uint32_t u = (uint32_t)row[c] << 16;
                memcpy(o + c, &u, 4);
            }
        } else {
            memcpy(o, (const float *)table + (int64_t)ids[t] * ldt, (size_t)H * sizeof(float));
        }
        if (scale != 1.0f) scale_row(o, H, scale, table_bf16);
    }
}

#endif

/* out row i = src row idx[i] (row_bytes each; strides in bytes): the rows of a step that sample,
 * gathered for the LM head inside a captured step graph. */
void rtp_gather_rows(const void *src, int64_t src_stride, const int32_t *idx, int64_t n, void *out,
                     int64_t out_stride, int64_t row_bytes) {
    for (int64_t i = 0; i < n; i++)
        memcpy((char *)out + i * out_stride, (const char *)src + (int64_t)idx[i] * src_stride, (size_t)row_bytes);
}

