/* The embedding lookup of the avx2 path (its contract: csrc/embedding.c): out fp32 rows = table[ids[t]],
 * times scale unless it is 1, the product rounded to the table's dtype as torch rounds a bf16 row times
 * a scalar (the fp32 product of two bf16 values is exact, so one rounding is torch's bf16 product). */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include "avx2.h"
#include "cpu_kernels.h"

AVX2_TARGET static void scale_row(float *o, int64_t H, float scale, int round_bf16) {
    const __m256 s = _mm256_set1_ps(scale);
    int64_t c = 0;
    for (; c + 8 <= H; c += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(o + c), s);
        if (round_bf16) {
            uint16_t rounded[8];
            avx2_store_bf16x8(rounded, v);
            v = avx2_load_bf16x8(rounded);
        }
        _mm256_storeu_ps(o + c, v);
    }
    for (; c < H; c++) {
        float v = o[c] * scale;
        o[c] = round_bf16 ? rtp_bf16_to_f32(rtp_f32_to_bf16(v)) : v;
    }
}

AVX2_TARGET void rtp_embed_rows_avx2(const void *table, int table_bf16, int64_t ldt, const int32_t *ids, float *out,
                                     int64_t ldo, int64_t T, int64_t H, float scale) {
    for (int64_t t = 0; t < T; t++) {
        float *o = out + t * ldo;
        if (table_bf16) {
            const uint16_t *row = (const uint16_t *)table + (int64_t)ids[t] * ldt;
            int64_t c = 0;
            for (; c + 8 <= H; c += 8) _mm256_storeu_ps(o + c, avx2_load_bf16x8(row + c));
            for (; c < H; c++) o[c] = rtp_bf16_to_f32(row[c]);
        } else {
            memcpy(o, (const float *)table + (int64_t)ids[t] * ldt, (size_t)H * sizeof(float));
        }
        if (scale != 1.0f) scale_row(o, H, scale, table_bf16);
    }
}
#endif
