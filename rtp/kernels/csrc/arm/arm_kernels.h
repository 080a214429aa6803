#if defined(__aarch64__)
/* Declarations of the Arm64 NEON path's kernels (the .c files of csrc/arm/): each has the prototype and contract of its
 * _avx2 twin (the op table, rtp/kernels/ops.py, gives each op's parameters; csrc/avx2/ the layouts), with
 * the suffix _neon. Declared here rather than in the generated kernel_ops.h, which lists the x86 variants,
 * so that the kernels build on their own (tests/kernels/arm/harness.c includes this header). */
#ifndef RTP_ARM_KERNELS_H
#define RTP_ARM_KERNELS_H

#include <stdint.h>

/* The largest head dim the attention and RoPE kernels take: cpu_kernels.h's, the same value. */
#ifndef RTP_MAX_HEAD_DIM
#define RTP_MAX_HEAD_DIM 256
#endif

/* norm.c */
void rtp_add_rms_norm_neon(float *residual, int64_t ldr, const void *delta, int delta_bf16, int64_t ldd,
                           const void *weight, int weight_bf16, float eps, void *out, int out_bf16, int64_t ldo,
                           int64_t T, int64_t H);
void rtp_rms_norm_neon(const void *x, int64_t ldx, int x_bf16, const void *weight, int weight_bf16, float eps,
                       void *out, int64_t ldo, int out_bf16, int64_t T, int64_t H);
void rtp_qk_rms_norm_neon(uint16_t *qkv, int64_t ldq, const void *q_weight, const void *k_weight, int weight_bf16,
                          float eps, int64_t T, int64_t H, int64_t Hkv, int64_t D);

/* activation.c */
void rtp_silu_mul_neon(const uint16_t *x, int64_t ldx, uint16_t *out, int64_t ldo, int64_t T, int64_t I);
void rtp_gelu_tanh_mul_neon(const uint16_t *x, int64_t ldx, uint16_t *out, int64_t ldo, int64_t T, int64_t I);
void rtp_softcap_neon(float *x, int64_t ldx, float cap, int64_t T, int64_t N);

/* embedding.c */
void rtp_embed_rows_neon(const void *table, int table_bf16, int64_t ldt, const int32_t *ids, float *out,
                         int64_t ldo, int64_t T, int64_t H, float scale);

/* rope_kv.c */
int rtp_rope_store_kv_neon(const uint16_t *qkv, int64_t ldq, const int32_t *positions, const float *cos_sin,
                           int64_t rot, uint16_t *q_out, void *k_cache, void *v_cache, int64_t tok_stride,
                           const int64_t *slots, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t num_slots,
                           float *k_scales, float *v_scales);

/* linear.c */
void rtp_linear_bf16_neon(const void *x, int64_t ldx, int x_fp32, const uint16_t *w16, int64_t ldw,
                          const float *bias, void *out, int64_t ldo, int out_bf16, int64_t M, int64_t N, int64_t K);

/* linear_int8.c */
int rtp_linear_q4_1_neon(const uint16_t *x, int64_t ldx, const uint8_t *qs, const float *d, const float *m,
                         const float *bias, void *out, int64_t ldo, int out_bf16, int64_t rows, int64_t n, int64_t k);
void rtp_linear_q8_neon(const float *x, int64_t ldx, const int8_t *qs, const float *d, const float *mn, int group,
                        const float *bias, void *out, int64_t ldo, int out_bf16, int64_t rows, int64_t n, int64_t k);
int rtp_linear_u8_neon(const void *x, int64_t ldx, int x_fp32, const int8_t *qs, const float *d, const float *mn,
                       int group, int offset, const float *bias, void *out, int64_t ldo, int out_bf16, int64_t rows,
                       int64_t n, int64_t k);

/* sampling.c */
void rtp_argmax_rows_neon(const float *x, int64_t ldx, int64_t T, int64_t N, int64_t *out);
void rtp_apply_token_bitmask_neon(float *x, int64_t ldx, const int32_t *mask, int64_t ldm, const int64_t *rows,
                                  int64_t R, int64_t N);

/* decode_attention.c, prefill_attention.c */
void rtp_paged_decode_attention_bf16_neon(const uint16_t *q, const void *k_cache, const void *v_cache,
                                          int64_t tok_stride, const int32_t *block_tables, int64_t ldt,
                                          const int32_t *seq_lens, uint16_t *out, int64_t B, int64_t H, int64_t Hkv,
                                          int64_t D, int64_t block_size, float scale, int64_t window,
                                          const float *k_scales, const float *v_scales, float softcap);
int rtp_prefill_attention_bf16_neon(const uint16_t *q, const void *k_cache, const void *v_cache, int64_t tok_stride,
                                    const int32_t *qsl, const int32_t *seq_lens, const int32_t *tables, int64_t ldt,
                                    int64_t first_row, int64_t nseq, uint16_t *out, int64_t H, int64_t Hkv, int64_t D,
                                    int64_t block_size, float scale, int64_t window, int amx, const float *k_scales,
                                    const float *v_scales, float softcap);

#endif
#endif
