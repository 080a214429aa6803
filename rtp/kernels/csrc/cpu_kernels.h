/* Declarations of the C kernels (rtp/kernels/csrc/); see each file for layouts and semantics. */
#pragma once
#include <stdint.h>

int rtp_cpu_kernels_supported(void);
/* The largest head dim the attention and RoPE kernels take (rtp/kernels/cpu_kernels.py checks it). */
#define RTP_MAX_HEAD_DIM 256
/* The attention kernels and the KV write take bf16 caches, or int8 ones with fp32 scales per (token,
 * kv head) (k_scales / v_scales not NULL; see decode_attention.c). */
void rtp_paged_decode_attention_bf16(
    const uint16_t *q, const void *k_cache, const void *v_cache, int64_t tok_stride,
    const int32_t *block_tables, int64_t ldt, const int32_t *seq_lens, uint16_t *out,
    int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size, float scale, int64_t window,
    const float *k_scales, const float *v_scales, float softcap);
int rtp_linear_q4_1(const uint16_t *x, int64_t ldx, const uint8_t *qs, const float *d,
                    const float *mn, const float *bias, void *out, int64_t ldo,
                    int out_bf16, int64_t M, int64_t N, int64_t K);
int rtp_linear_u8(const void *x, int64_t ldx, int x_fp32, const int8_t *qs, const float *d, const float *mn,
                  int group, int offset, const float *bias, void *out, int64_t ldo, int out_bf16, int64_t M,
                  int64_t N, int64_t K);
void rtp_linear_bf16(const void *x, int64_t ldx, int x_fp32, const uint16_t *w, int64_t ldw, const float *bias,
                     void *out, int64_t ldo, int out_bf16, int64_t M, int64_t N, int64_t K);
int rtp_linear_q4_k(const uint16_t *x, int64_t ldx, const uint8_t *qs, const uint8_t *scm, const float *dd,
                    const float *bias, void *out, int64_t ldo, int out_bf16, int64_t M, int64_t N, int64_t K);
void rtp_linear_q8(const float *x, int64_t ldx, const int8_t *qs, const float *d, const float *mn, int group,
                   const float *bias, void *out, int64_t ldo, int out_bf16, int64_t M, int64_t N, int64_t K);
void rtp_add_rms_norm(float *residual, int64_t ldr, const void *delta, int delta_bf16, int64_t ldd,
                      const void *weight, int weight_bf16, float eps, void *out, int out_bf16, int64_t ldo,
                      int64_t T, int64_t H);
int rtp_rope_store_kv(const uint16_t *qkv, int64_t ldq, const int32_t *positions,
                      const float *cos_sin, int64_t rot, uint16_t *q_out, void *k_cache,
                      void *v_cache, int64_t tok_stride, const int64_t *slots,
                      int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t num_slots,
                      float *k_scales, float *v_scales);
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
void rtp_embed_rows(const void *table, int table_bf16, int64_t ldt, const int32_t *ids, float *out,
                    int64_t ldo, int64_t T, int64_t H, float scale);
void rtp_argmax_rows(const float *x, int64_t ldx, int64_t T, int64_t N, int64_t *out);
void rtp_apply_token_bitmask(float *x, int64_t ldx, const int32_t *mask, int64_t ldm, const int64_t *rows,
                             int64_t R, int64_t N);
uint64_t rtp_stream_read(const void *buf, int64_t bytes);
void rtp_silu_mul(const uint16_t *x, int64_t ldx, uint16_t *out, int64_t ldo, int64_t T, int64_t I);
int rtp_prefill_attention_bf16(const uint16_t *q, const void *k_cache, const void *v_cache,
                               int64_t tok_stride, const int32_t *qsl, const int32_t *seq_lens, const int32_t *tables,
                               int64_t ldt, int64_t first_row, int64_t nseq, uint16_t *out, int64_t H, int64_t Hkv,
                               int64_t D, int64_t block_size, float scale, int64_t window, int amx,
                               const float *k_scales, const float *v_scales, float softcap);
void rtp_gather_rows(const void *src, int64_t src_stride, const int32_t *idx, int64_t n, void *out,
                     int64_t out_stride, int64_t row_bytes);
/* norm.c, activation.c: beyond the Llama topology */
void rtp_rms_norm(const void *x, int64_t ldx, int x_bf16, const void *weight, int weight_bf16, float eps,
                  void *out, int64_t ldo, int out_bf16, int64_t T, int64_t H);
void rtp_qk_rms_norm(uint16_t *qkv, int64_t ldq, const void *q_weight, const void *k_weight, int weight_bf16,
                     float eps, int64_t T, int64_t H, int64_t Hkv, int64_t D);
void rtp_gelu_tanh_mul(const uint16_t *x, int64_t ldx, uint16_t *out, int64_t ldo, int64_t T, int64_t I);
void rtp_softcap(float *x, int64_t ldx, float cap, int64_t T, int64_t N);

/* kernel_calls.c: a kernel call as RTP_CALL_WORDS int64 words, word 0 one of these */
#define RTP_CALL_WORDS 24 /* prefill attention over an int8 cache, with its softcap, takes 22 */
enum {
    RTP_OP_LINEAR_Q4_1 = 1,
    RTP_OP_LINEAR_Q8,
    RTP_OP_LINEAR_TILES,
    RTP_OP_ADD_RMS_NORM,
    RTP_OP_ROPE_STORE_KV,
    RTP_OP_DECODE_ATTENTION,
    RTP_OP_EMBED_ROWS,
    RTP_OP_SILU_MUL,
    RTP_OP_PREFILL_ATTENTION,
    RTP_OP_GATHER_ROWS,
    RTP_OP_LINEAR_Q4_K,
    RTP_OP_LINEAR_BF16,
    RTP_OP_LINEAR_U8,
    RTP_OP_RMS_NORM,
    RTP_OP_QK_RMS_NORM,
    RTP_OP_GELU_TANH_MUL,
    RTP_OP_SOFTCAP,
};
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
