/* Which of rtp's kernel paths this CPU runs (its ISA path), chosen once at start-up.
 *
 * The kernels are plain C with intrinsics and OpenMP (no Python, no torch), each compiled for its path
 * through target attributes, so one build carries every path and imports on any x86. The paths, lowest
 * first (RTP_ISA_* in cpu_kernels.h):
 *   avx2        AVX2, FMA and F16C: AMD Zen 1-3, Intel Haswell to Alder Lake (csrc/avx2/)
 *   avx512      AVX-512 F/BW/VL/DQ without BF16 (Intel Skylake-SP to Ice Lake): its linears in lane order on
 *               VNNI where the CPU has it (Cascade Lake on: csrc/avx512/), the avx2 kernels for the rest
 *   avx512bf16  AVX-512 BF16: AMD Zen 4 and later, Intel Cooper Lake and Sapphire Rapids on (the rest of csrc/)
 *   amx         avx512bf16 and the AMX tile unit (Intel Sapphire Rapids on): its linears on AMX
 * An op runs its variant for the highest path at or below the selected one (the op table, rtp/kernels/ops.py,
 * says which exist; kernel_ops.c dispatches on rtp_isa). RTP_CPU_ISA (rtp/kernels/cpu_kernels.py) selects a
 * lower path than the CPU's, for tests and benchmarks. OpenMP resolves to the libgomp that torch already
 * loaded (same soname), so both share one thread pool.
 * The probes for optional units live beside their kernels: rtp_amx_supported (linear/amx_linear.c),
 * rtp_vnni_supported (linear/vnni_gemm.c). */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include "cpu_kernels.h"

int rtp_isa = RTP_ISA_NONE;

int rtp_cpu_kernels_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512bf16");
}

/* The highest path this CPU runs, RTP_ISA_NONE for none. */
int rtp_cpu_isa(void) {
    __builtin_cpu_init();
    if (rtp_cpu_kernels_supported()) return rtp_amx_supported() ? RTP_ISA_AMX : RTP_ISA_AVX512BF16;
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return RTP_ISA_NONE;
    /* F16C: gcc has no __builtin_cpu_supports name for it; CPUID leaf 1, ECX bit 29 */
    unsigned a, b, c, d;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    if (!(c & (1u << 29))) return RTP_ISA_NONE;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
        && __builtin_cpu_supports("avx512dq"))
        return RTP_ISA_AVX512;
    return RTP_ISA_AVX2;
}

/* Select the CPU's path, or `most` where that is lower; returns the path selected. */
int rtp_select_isa(int most) {
    int have = rtp_cpu_isa();
    rtp_isa = most < have ? most : have;
    return rtp_isa;
}
#endif
