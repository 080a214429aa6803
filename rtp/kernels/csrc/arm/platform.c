#if defined(__aarch64__)
/* What the x86-64 build's cpu_features.c, stream_read.c, sampling.c and the AMX / VNNI probes give the
 * rest of rtp, for AArch64: the ISA path (neon, which every AArch64 CPU runs, or dotprod; ops.py's
 * ISA_FAMILIES),
 * the units it lacks, the bandwidth probe, and the two sampling kernels called directly (their NEON
 * bodies in sampling.c). kernel_ops.c dispatches the ops to their _neon variants on rtp_isa. */
#include <omp.h>
#include <stdint.h>
#include <sys/auxv.h>

#include "cpu_kernels.h"

#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1 << 1)
#endif
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif

int rtp_isa = RTP_ISA_NONE;

int rtp_cpu_kernels_supported(void) { return 0; } /* the avx512bf16 path: x86-64 only */
int rtp_amx_supported(void) { return 0; }
int rtp_vnni_supported(void) { return 0; }

/* NEON (every AArch64 core), and the dot product (ARMv8.2-A's option: Graviton 2 on, Ampere Altra, Apple
 * M1 on) whose SDOT the int8 linears of the dotprod path take (arm/linear_int8_dotprod.c). */
int rtp_cpu_isa(void) {
    unsigned long hwcap = getauxval(AT_HWCAP);
    if (!(hwcap & HWCAP_ASIMD)) return RTP_ISA_NONE;
    return (hwcap & HWCAP_ASIMDDP) ? RTP_ISA_DOTPROD : RTP_ISA_NEON;
}

int rtp_select_isa(int most) {
    int have = rtp_cpu_isa();
    rtp_isa = most < have ? most : have;
    return rtp_isa;
}

void rtp_argmax_rows(const float *x, int64_t ldx, int64_t T, int64_t N, int64_t *out) {
    rtp_argmax_rows_neon(x, ldx, T, N, out);
}

void rtp_apply_token_bitmask(float *x, int64_t ldx, const int32_t *mask, int64_t ldm, const int64_t *rows,
                             int64_t R, int64_t N) {
    rtp_apply_token_bitmask_neon(x, ldx, mask, ldm, rows, R, N);
}

/* A streaming read of `bytes` bytes (a multiple of 256, 64-byte aligned) on every thread, folded into
 * one word: the memory bandwidth tools/bench_roofline.py measures (plain C; the compiler vectorizes it). */
uint64_t rtp_stream_read(const void *buf, int64_t bytes) {
    const uint64_t *p = (const uint64_t *)buf;
    int64_t n = bytes / 8;
    uint64_t folded = 0;
#pragma omp parallel for schedule(static) reduction(^ : folded)
    for (int64_t i = 0; i < n; i++) folded ^= p[i];
    return folded;
}
#endif
