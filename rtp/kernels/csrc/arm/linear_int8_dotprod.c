#if defined(__aarch64__)
/* The dotprod path's int8 linears: linear_int8.h compiled for ARMv8.2-A with the dot product (SDOT) whatever
 * the build's -march, so one build carries both forms; run on the cores whose HWCAP reports it
 * (arm/platform.c). The same bits as the neon path's. */
#pragma GCC target("arch=armv8.2-a+dotprod")
#define NEON_VARIANT(f) f##_dotprod
#include "linear_int8.h"
#endif
