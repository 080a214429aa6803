/* The tile-order linear: weight records in 16-row tiles (BlockQuantized.tile_layout), multiplied on
 * AMX (amx_linear.c, amx_gemm.c) where the call says so, else with AVX-512 BF16 (avx_gemm.c) or, for
 * the int8-rows kinds, AVX-512 VNNI (vnni_gemm.c, which rtp_gemm_avx hands them to). */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include "cpu_kernels.h"

/* x, ldx .. glu: rtp_gemm_avx's arguments. bf16_rows: the rows before it are multiplied in bf16 even
 * where the kind takes int8 rows (--activation-dtype int8-prefill: a step's decode rows come first, its
 * prompt rows after; a step graph's replay puts the step's decode rows there, ops.py). Rows are
 * independent in every tile kernel, so the two halves give each row the bits it would get in a call of
 * its own kind. */
int rtp_linear_tiles(const void *x, int64_t ldx, int x_fp32, int kind, const uint8_t *weights, const float *bias,
                     void *out, int64_t ldo, int out_bf16, int64_t M, int64_t N, int64_t K, int glu, int amx,
                     int64_t bf16_rows) {
    if (bf16_rows > M) bf16_rows = M;
    if (amx) return rtp_linear_amx(x, ldx, x_fp32, kind, weights, bias, out, ldo, out_bf16, M, N, K, glu);
    if (bf16_rows <= 0 || rtp_record_kind(kind) == kind)
        return rtp_gemm_avx(x, ldx, x_fp32, kind, weights, bias, out, ldo, out_bf16, M, N, K, glu);
    if (!rtp_gemm_avx(x, ldx, x_fp32, rtp_record_kind(kind), weights, bias, out, ldo, out_bf16, bf16_rows, N, K, glu))
        return 0;
    if (bf16_rows == M) return 1;
    const char *rest = (const char *)x + bf16_rows * ldx * (x_fp32 ? 4 : 2);
    char *rest_out = (char *)out + bf16_rows * ldo * (out_bf16 ? 2 : 4);
    return rtp_gemm_avx(rest, ldx, x_fp32, kind, weights, bias, rest_out, ldo, out_bf16, M - bf16_rows, N, K, glu);
}
#endif
