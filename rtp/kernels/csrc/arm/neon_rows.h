#if defined(__aarch64__)
/* Row access for the NEON path's kernels that take any width: a row's last vector may hold fewer than
 * four values, and nothing past them may be read (the row can end at the end of a mapping) or written
 * (the next row, or another tensor, can start there). NEON has no masked loads or stores, so a partial
 * vector goes through a four-value buffer. */
#ifndef RTP_NEON_ROWS_H
#define RTP_NEON_ROWS_H

#include "neon.h"

/* Values at..at+3 of a bf16 or fp32 array as fp32, only the first `count` read (the rest 0). */
static inline float32x4_t neon_load4(const void *p, int bf16, int64_t at, int64_t count) {
    if (count >= 4) return bf16 ? neon_load_bf16x4((const uint16_t *)p + at) : vld1q_f32((const float *)p + at);
    if (bf16) {
        uint16_t part[4] = {0};
        memcpy(part, (const uint16_t *)p + at, (size_t)count * sizeof(uint16_t));
        return neon_load_bf16x4(part);
    }
    float part[4] = {0};
    memcpy(part, (const float *)p + at, (size_t)count * sizeof(float));
    return vld1q_f32(part);
}

/* v into values at..at+3 of a bf16 (rounded to nearest even) or fp32 array, only the first `count`. */
static inline void neon_store4(void *p, int bf16, int64_t at, int64_t count, float32x4_t v) {
    if (count >= 4) {
        if (bf16) neon_store_bf16x4((uint16_t *)p + at, v);
        else vst1q_f32((float *)p + at, v);
        return;
    }
    if (bf16) {
        uint16_t part[4];
        neon_store_bf16x4(part, v);
        memcpy((uint16_t *)p + at, part, (size_t)count * sizeof(uint16_t));
        return;
    }
    float part[4];
    vst1q_f32(part, v);
    memcpy((float *)p + at, part, (size_t)count * sizeof(float));
}

#endif
#endif
