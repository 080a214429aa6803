/* The memory-bandwidth probe (not a model op: called directly, never recorded). */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "cpu_kernels.h"

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

/* A streaming read of `bytes` bytes (a multiple of 256, 64-byte aligned) on every thread, each its
 * share front to back, folded into one word so nothing is optimised away: the memory bandwidth the
 * roofline of tools/bench_roofline.py sets the steps' bytes against. */
TARGET uint64_t rtp_stream_read(const void *buf, int64_t bytes) {
    int64_t n = bytes / 256;
    uint64_t folded = 0;
#pragma omp parallel reduction(^ : folded)
    {
        __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            const __m512i *p = (const __m512i *)((const uint8_t *)buf + i * 256);
            a = _mm512_xor_si512(a, _mm512_load_si512(p));
            b = _mm512_xor_si512(b, _mm512_load_si512(p + 1));
            c = _mm512_xor_si512(c, _mm512_load_si512(p + 2));
            d = _mm512_xor_si512(d, _mm512_load_si512(p + 3));
        }
        __m512i all = _mm512_xor_si512(_mm512_xor_si512(a, b), _mm512_xor_si512(c, d));
        uint64_t words[8] __attribute__((aligned(64)));
        _mm512_store_si512((void *)words, all);
        for (int k = 0; k < 8; k++) folded ^= words[k];
    }
    return folded;
}
#endif
