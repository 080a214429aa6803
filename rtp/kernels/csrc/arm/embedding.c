#if defined(__aarch64__)
/* The embedding lookup of the NEON path (its contract: csrc/embedding.c; the avx2 twin:
 * csrc/avx2/embedding.c): out fp32 rows = table[ids[t]], times scale unless it is 1, the product rounded to
 * the table's dtype as torch rounds a bf16 row times a scalar (the fp32 product of two bf16 values is
 * exact, so one rounding is torch's bf16 product). */
#include "neon.h"

static void scale_row(float *o, int64_t H, float scale, int round_bf16) {
    const float32x4_t s = vdupq_n_f32(scale);
    int64_t c = 0;
    for (; c + 4 <= H; c += 4) {
        float32x4_t v = vmulq_f32(vld1q_f32(o + c), s);
        if (round_bf16) /* to bf16 and back: the widening is exact */
            v = vreinterpretq_f32_u32(vshll_n_u16(neon_round_bf16x4(v), 16));
        vst1q_f32(o + c, v);
    }
    for (; c < H; c++) {
        float v = o[c] * scale;
        o[c] = round_bf16 ? rtp_bf16_to_f32(rtp_f32_to_bf16(v)) : v;
    }
}

void rtp_embed_rows_neon(const void *table, int table_bf16, int64_t ldt, const int32_t *ids, float *out,
                         int64_t ldo, int64_t T, int64_t H, float scale) {
    for (int64_t t = 0; t < T; t++) {
        float *o = out + t * ldo;
        if (table_bf16) {
            const uint16_t *row = (const uint16_t *)table + (int64_t)ids[t] * ldt;
            int64_t c = 0;
            for (; c + 8 <= H; c += 8) {
                float32x4_t lo, hi;
                neon_load_bf16x8(row + c, &lo, &hi);
                vst1q_f32(o + c, lo);
                vst1q_f32(o + c + 4, hi);
            }
            for (; c < H; c++) o[c] = rtp_bf16_to_f32(row[c]);
        } else {
            memcpy(o, (const float *)table + (int64_t)ids[t] * ldt, (size_t)H * sizeof(float));
        }
        if (scale != 1.0f) scale_row(o, H, scale, table_bf16);
    }
}
#endif
