/* What the kernels of the avx2 ISA path share (csrc/cpu_features.c: AVX2, FMA and F16C; AMD Zen 1-3,
 * Intel Haswell to Alder Lake, and the AVX-512 CPUs without BF16 for now).
 *
 * Each kernel here has the prototype of its avx512bf16 variant with the suffix _avx2 (the op table,
 * rtp/kernels/ops.py, names both) and the same contract: the same layouts, the same rounding of what it
 * writes (bf16 outputs rounded to nearest even), rows independent of each other. Numerics need not be
 * the other path's bits (the ISA path is outside the determinism guarantee), only its tolerances. */
#ifndef RTP_AVX2_H
#define RTP_AVX2_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include "bf16.h"
#include "denormals.h"

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))


/* Eight bf16 at p as fp32 (exact). */
AVX2_TARGET static inline __m256 avx2_load_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Eight fp32 rounded to bf16 (nearest even; NaN stays NaN) and stored at p. */
AVX2_TARGET static inline void avx2_store_bf16x8(uint16_t *p, __m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128((__m128i *)p, packed);
}

/* The sum of v's eight lanes, in one fixed order: (0+4)+(2+6) + (1+5)+(3+7). */
AVX2_TARGET static inline float avx2_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The largest of v's eight lanes (exact, so its order does not matter). */
AVX2_TARGET static inline float avx2_hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

#endif
