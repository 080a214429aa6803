/* Declarations of the C kernels (rtp/kernels/csrc/); see each file for layouts and semantics.
 *
 * The ops a kernel call runs (linears, norms, RoPE + KV write, attention, ...) are declared in
 * kernel_ops.h, which setup.py writes from the table in rtp/kernels/ops.py: their prototypes, the
 * RTP_OP_* enum and each call's struct of named fields. What is here is everything else: the CPU
 * probes, the kernels the ops dispatch to, the kernels called directly, and the replay loops. */
#pragma once
#include <stdint.h>

#include "kernel_ops.h"

/* The ISA paths of the architecture built for, lowest first (ops.py's ISA_FAMILIES), and the one selected
 * (cpu_features.c on x86-64, arm/platform.c on AArch64), on which kernel_ops.c's trampolines dispatch each
 * op to its variant. RTP_ISA_UNAVAILABLE: an op with no variant on this architecture (rtp_op.isa). */
#if defined(__aarch64__)
enum { RTP_ISA_NONE = 0, RTP_ISA_NEON, RTP_ISA_DOTPROD, RTP_ISA_UNAVAILABLE = 127 };
#define RTP_ON_ARCH(x86_64, aarch64) (aarch64)
#else
enum { RTP_ISA_NONE = 0, RTP_ISA_AVX2, RTP_ISA_AVX512, RTP_ISA_AVX512BF16, RTP_ISA_AMX, RTP_ISA_UNAVAILABLE = 127 };
#define RTP_ON_ARCH(x86_64, aarch64) (x86_64)
#endif
extern int rtp_isa;
int rtp_cpu_isa(void);
int rtp_select_isa(int most);
int rtp_cpu_kernels_supported(void); /* the avx512bf16 path: what the kernels outside csrc/avx2/ need */
/* The largest head dim the attention and RoPE kernels take (rtp/kernels/cpu_kernels.py checks it). */
#define RTP_MAX_HEAD_DIM 256

/* linear/: the tile-order linear (rtp_linear_tiles) runs one of these. */
int rtp_amx_supported(void);
int rtp_linear_amx(const void *x, int64_t ldx, int x_fp32, int kind, const uint8_t *weights,
                   const float *bias, void *out, int64_t ldo, int out_bf16, int64_t M, int64_t N, int64_t K,
                   int glu);
/* linear/vnni_gemm.c: Q4_1 or Q8_0 records times x's rows quantized to int8 (AVX-512 VNNI); rtp_gemm_avx's contract.
 * The linear kernels take them as record kinds RTP_KIND_Q4_1_INT8_ROWS and RTP_KIND_Q8_0_INT8_ROWS: the
 * records of kinds 0 and 1, whose rows go to rtp_gemm_vnni where the CPU has VNNI and no AMX, and are
 * multiplied in bf16 as kinds 0 and 1 elsewhere (--activation-dtype int8). */
#define RTP_KIND_Q4_1_INT8_ROWS 5
#define RTP_KIND_Q8_0_INT8_ROWS 6
/* The kind of the records themselves: 0 or 1 for the int8-rows kinds, else kind. */
static inline int rtp_record_kind(int kind) {
    return kind == RTP_KIND_Q4_1_INT8_ROWS ? 0 : kind == RTP_KIND_Q8_0_INT8_ROWS ? 1 : kind;
}
int rtp_vnni_supported(void);
int rtp_gemm_vnni(const void *x, int64_t ldx, int x_fp32, int kind, const uint8_t *weights, const float *bias,
                  void *out, int64_t ldo, int out_bf16, int64_t M, int64_t N, int64_t K, int glu);

int rtp_gemm_avx(const void *x, int64_t ldx, int x_fp32, int kind, const uint8_t *weights,
                 const float *bias, void *out, int64_t ldo, int out_bf16, int64_t M, int64_t N, int64_t K, int glu);
int rtp_gemm_amx(const void *x, int64_t ldx, int x_fp32, int kind, const uint8_t *weights,
                 const float *bias, void *out, int64_t ldo, int out_bf16, int64_t M, int64_t N, int64_t K, int glu);

/* Called directly, never recorded (the sampler's, and a bandwidth probe): sampling.c, stream_read.c. */
void rtp_argmax_rows(const float *x, int64_t ldx, int64_t T, int64_t N, int64_t *out);
void rtp_apply_token_bitmask(float *x, int64_t ldx, const int32_t *mask, int64_t ldm, const int64_t *rows,
                             int64_t R, int64_t N);
uint64_t rtp_stream_read(const void *buf, int64_t bytes);
/* avx2/sampling.c, arm/sampling.c: the avx2 and NEON paths' bodies of the two above, which dispatch to them. */
void rtp_argmax_rows_avx2(const float *x, int64_t ldx, int64_t T, int64_t N, int64_t *out);
void rtp_apply_token_bitmask_avx2(float *x, int64_t ldx, const int32_t *mask, int64_t ldm, const int64_t *rows,
                                  int64_t R, int64_t N);
void rtp_argmax_rows_neon(const float *x, int64_t ldx, int64_t T, int64_t N, int64_t *out);
void rtp_apply_token_bitmask_neon(float *x, int64_t ldx, const int32_t *mask, int64_t ldm, const int64_t *rows,
                                  int64_t R, int64_t N);

/* kernel_calls.c: running calls (RTP_CALL_WORDS int64 words, word 0 an RTP_OP_*). */
/* The counts a step graph is replayed over (rtp_run_step_calls): each call's rows word is one of
 * them, named per call by its class (decode and prefill attention take theirs by op). Two more
 * classes hold the sampling rows' calls of a graph captured both ways: RTP_SEVERAL_SAMPLES runs
 * (over the samples) only when more than one row samples, RTP_ONE_SAMPLE (as recorded, over one
 * row: the one-row kernels an eager step of one sample takes) only when exactly one does. */
enum { RTP_COUNT_AS_RECORDED = 0, RTP_COUNT_TOKENS, RTP_COUNT_SAMPLES, RTP_COUNT_DECODE_ROWS, RTP_COUNT_PREFILL_ROWS,
       RTP_SEVERAL_SAMPLES, RTP_ONE_SAMPLE };
int rtp_run_call(const int64_t *call);
int64_t rtp_run_calls(const int64_t *calls, int64_t n, int64_t rows, int64_t *ns);
int64_t rtp_run_step_calls(const int64_t *calls, int64_t n, const int8_t *classes, const int64_t *counts,
                           int64_t *ns);
int rtp_call_rows_word(int64_t op);
uint32_t rtp_call_address_words(int64_t op);
const rtp_op *rtp_call_op(int64_t op);
