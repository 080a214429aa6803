/* Scratch memory a thread keeps from call to call.
 *
 * The kernels run every step, on OpenMP's threads, which live as long as the process: a fresh
 * allocation per call above glibc's mmap threshold (128 KiB at first) would map and page-fault
 * fresh memory on every call, and the hot path allocates nothing per step. So each buffer is a
 * thread-local rtp_scratch that only ever grows. */
#ifndef RTP_SCRATCH_H
#define RTP_SCRATCH_H

#include <stddef.h>
#include <stdlib.h>

typedef struct {
    void *p;
    size_t bytes;
} rtp_scratch;

/* At least `bytes` (64-byte aligned) of this thread's buffer s, NULL when memory ran out. The
 * contents do not survive growing. */
static inline void *rtp_scratch_get(rtp_scratch *s, size_t bytes) {
    if (bytes > s->bytes || !s->p) {
        free(s->p);
        size_t rounded = (bytes + 63) / 64 * 64;
        s->p = aligned_alloc(64, rounded > 0 ? rounded : 64);
        s->bytes = s->p ? bytes : 0;
    }
    return s->p;
}

#endif
