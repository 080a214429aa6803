/* One value between bf16 and fp32, in plain C: what every ISA path's kernels use where they convert a single
 * value (a row's sum, a gate, an element past the last full vector). The widening is exact (a bf16 is the top
 * half of its fp32); the narrowing rounds to nearest even, as torch does, and keeps NaN a (quiet) NaN. */
#ifndef RTP_BF16_H
#define RTP_BF16_H

#include <stdint.h>
#include <string.h>

static inline float rtp_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t rtp_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#endif
