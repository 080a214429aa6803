/* Software prefetches the compiler keeps.
 *
 * GCC 12 at -O3 deleted every _mm_prefetch of rtp's linear kernels, and those of decode
 * attention too unless -fwrapv happened to be on (Python's build flags add it): a loop whose
 * only effect is __builtin_prefetch counts as dead code. An asm volatile with the line as a
 * memory operand is never removed or moved past other volatile asm; it reads nothing, so
 * any address is fine (prefetches never fault). */
#ifndef RTP_PREFETCH_H
#define RTP_PREFETCH_H

static inline __attribute__((always_inline)) void rtp_prefetch_l1(const void *p) {
    __asm__ volatile("prefetcht0 %0" : : "m"(*(const char *)p));
}

static inline __attribute__((always_inline)) void rtp_prefetch_l2(const void *p) {
    __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)p));
}

#endif
