/* Denormals flushed to zero (FTZ) and read as zero (DAZ) in this thread (x86-64's MXCSR), from
 * rtp_flush_denormals() until rtp_restore_denormals(its result). Every vector operation on a denormal takes a
 * microcode assist, and below 1e-38 nothing shows in a bf16 output. Attention runs so: a probability far below
 * its row's max (a peaked softmax, a long context) times a small value is denormal (measured: queries 100x
 * larger made decode attention 6.5x slower, 0.10 -> 0.66 ms for 16 rows of 256 keys). The int8 linears (avx2,
 * avx512 lanes) run so: a block of x whose values all lie below 2e-34 has a denormal scale (a down projection
 * of such rows took 3.4 ms where normal ones took 69 us). Each OpenMP thread sets its own. (AArch64's FPCR:
 * arm/paged_attention.h.) */
#ifndef RTP_DENORMALS_H
#define RTP_DENORMALS_H

#include <immintrin.h>

static inline unsigned rtp_flush_denormals(void) {
    unsigned old = _mm_getcsr();
    _mm_setcsr(old | 0x8040u); /* FTZ (bit 15) | DAZ (bit 6) */
    return old;
}

static inline void rtp_restore_denormals(unsigned old) { _mm_setcsr(old); }

#endif
