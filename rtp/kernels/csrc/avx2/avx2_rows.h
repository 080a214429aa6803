/* Row access for the avx2 path's kernels that take any width: a row's last vector may hold fewer
 * than eight values, and nothing past them may be read (the row can end at the end of a mapping)
 * or written (the next row, or another tensor, can start there). AVX2 masks only 32-bit lanes,
 * so bf16 tails go through an eight-value buffer. */
#ifndef RTP_AVX2_ROWS_H
#define RTP_AVX2_ROWS_H

#include "avx2.h"

/* All-ones in the lanes below `count` (count clamped to 0..8). */
AVX2_TARGET static inline __m256i avx2_lanes(int64_t count) {
    int c = count < 0 ? 0 : count > 8 ? 8 : (int)count;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* Values at..at+7 of a bf16 or fp32 array as fp32, only the first `count` read (the rest 0). */
AVX2_TARGET static inline __m256 avx2_load8(const void *p, int bf16, int64_t at, int64_t count) {
    if (count >= 8)
        return bf16 ? avx2_load_bf16x8((const uint16_t *)p + at) : _mm256_loadu_ps((const float *)p + at);
    if (!bf16) return _mm256_maskload_ps((const float *)p + at, avx2_lanes(count));
    uint16_t part[8] = {0};
    memcpy(part, (const uint16_t *)p + at, (size_t)count * sizeof(uint16_t));
    return avx2_load_bf16x8(part);
}

/* v into values at..at+7 of a bf16 (rounded to nearest even) or fp32 array, only the first `count`. */
AVX2_TARGET static inline void avx2_store8(void *p, int bf16, int64_t at, int64_t count, __m256 v) {
    if (count >= 8) {
        if (bf16) avx2_store_bf16x8((uint16_t *)p + at, v);
        else _mm256_storeu_ps((float *)p + at, v);
        return;
    }
    if (!bf16) {
        _mm256_maskstore_ps((float *)p + at, avx2_lanes(count), v);
        return;
    }
    uint16_t part[8];
    avx2_store_bf16x8(part, v);
    memcpy((uint16_t *)p + at, part, (size_t)count * sizeof(uint16_t));
}

#endif
