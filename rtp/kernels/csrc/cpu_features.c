/* Whether this CPU runs rtp's kernels at all: they are plain C with AVX-512 BF16 intrinsics and
 * OpenMP (no Python, no torch), compiled for avx512bf16 through target attributes, so the module
 * builds and imports on any x86, and called only where this says yes. OpenMP resolves to the
 * libgomp that torch already loaded (same soname), so both share one thread pool.
 * The probes for the optional units live beside their kernels: rtp_amx_supported (linear/amx_linear.c),
 * rtp_vnni_supported (linear/vnni_gemm.c). */
#include "cpu_kernels.h"

int rtp_cpu_kernels_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512bf16");
}
