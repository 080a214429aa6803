#if defined(__aarch64__)
/* The NEON path's int8 linears as the build targets them (baseline ARMv8-A: widening multiplies; with
 * -march=...+dotprod, SDOT): linear_int8.h. */
#define NEON_VARIANT(f) f##_neon
#include "linear_int8.h"
#endif
