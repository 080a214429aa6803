#if defined(__aarch64__)
/* What the kernels of the Arm64 NEON path share. Written for ARMv8.2-A, they need only ARMv8.0-A's Advanced
 * SIMD; the integer linears use the dot-product instructions where the compiler targets them
 * (__ARM_FEATURE_DOTPROD, e.g. -march=armv8.2-a+dotprod) and plain NEON otherwise.
 *
 * This is the avx2 path (csrc/avx2/) ported to AArch64: each kernel here has the prototype of its _avx2
 * twin with the suffix _neon (arm_kernels.h declares them all) and the same contract: the same layouts,
 * the same rounding of what it writes (bf16 outputs rounded to nearest even, NaN kept NaN), rows
 * independent of each other, the same OpenMP parallelisation. Numerics need not be the other paths' bits,
 * only their tolerances; within this path a row's bits depend on the row alone.
 *
 * NEON vectors are 128 bits: four fp32 lanes where AVX2 has eight. Where the avx2 code keeps one 8-lane
 * chain this path mostly keeps two 4-lane chains (the same eight partial sums), which also gives the
 * FMA pipes of an Arm core enough independent work.
 *
 * Like every kernel file, these are built with -ffp-contract=off (setup.py): arm_neon.h's vmulq_f32 and
 * vaddq_f32 are plain C vector operations that GCC would otherwise fuse into one FMA, and some results
 * must round each product on its own, as torch does (RoPE's x1 cos - x2 sin, which the tests hold to
 * torch's bits). */
#ifndef RTP_NEON_H
#define RTP_NEON_H

#include <arm_neon.h>
#include <stdint.h>
#include <string.h>

#include "arm_kernels.h"
#include "bf16.h"


/* Four bf16 at p as fp32 (exact: a bf16 is the top half of its fp32). */
static inline float32x4_t neon_load_bf16x4(const uint16_t *p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}

/* Eight bf16 at p as two fp32 vectors (values 0-3, 4-7): one 128-bit load. */
static inline void neon_load_bf16x8(const uint16_t *p, float32x4_t *lo, float32x4_t *hi) {
    uint16x8_t v = vld1q_u16(p);
    *lo = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(v), 16));
    *hi = vreinterpretq_f32_u32(vshll_high_n_u16(v, 16));
}

/* Four fp32 rounded to bf16, nearest even (NaN stays NaN): ARMv8.2-A has no bf16 convert (BFCVTN is
 * ARMv8.6), so the scalar rule above, four lanes at a time. vaddhn keeps the high half of u + bias, which
 * is the rounded value's bits; a NaN would round into the infinities, so it takes its quieted top half. */
static inline uint16x4_t neon_round_bf16x4(float32x4_t v) {
    uint32x4_t u = vreinterpretq_u32_f32(v);
    uint32x4_t bias = vaddq_u32(vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1)), vdupq_n_u32(0x7fff));
    uint16x4_t rounded = vaddhn_u32(u, bias);
    uint16x4_t nan = vorr_u16(vshrn_n_u32(u, 16), vdup_n_u16(0x40));
    uint16x4_t is_num = vmovn_u32(vceqq_f32(v, v)); /* all ones where v is not NaN */
    return vbsl_u16(is_num, rounded, nan);
}

static inline void neon_store_bf16x4(uint16_t *p, float32x4_t v) { vst1_u16(p, neon_round_bf16x4(v)); }

static inline void neon_store_bf16x8(uint16_t *p, float32x4_t lo, float32x4_t hi) {
    vst1q_u16(p, vcombine_u16(neon_round_bf16x4(lo), neon_round_bf16x4(hi)));
}

/* The sum of v's four lanes, in one fixed order: (0+1) + (2+3) (FADDP twice). */
static inline float neon_hsum(float32x4_t v) {
    float32x4_t p = vpaddq_f32(v, v);
    return vgetq_lane_f32(vpaddq_f32(p, p), 0);
}

/* The sum of eight partial sums kept in two vectors (lane l of a and b): a + b lane-wise, then neon_hsum. */
static inline float neon_hsum2(float32x4_t a, float32x4_t b) { return neon_hsum(vaddq_f32(a, b)); }

/* The largest of v's four lanes (exact, so its order does not matter; NaN lanes are not expected). */
static inline float neon_hmax(float32x4_t v) { return vmaxvq_f32(v); }

#endif
#endif
