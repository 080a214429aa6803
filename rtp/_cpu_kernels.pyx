# cython: language_level=3
"""Python entry points of rtp/csrc/cpu_kernels.c (AVX-512 BF16 decode kernels).

Arguments are raw addresses and sizes, so this module needs neither torch nor
numpy; rtp.models.cpu_ops checks dtypes, shapes and strides and passes
``tensor.data_ptr()``. The GIL is released while a kernel runs.
"""
from libc.stdint cimport int8_t, int32_t, int64_t, intptr_t, uint8_t, uint16_t

cdef extern from "cpu_kernels.h":
    int rtp_cpu_kernels_supported() nogil
    void rtp_linear_q4_1(const uint16_t *x, int64_t ldx, const uint8_t *qs, const float *d,
                         const float *mn, const float *bias, void *out, int64_t ldo,
                         int out_bf16, int64_t M, int64_t N, int64_t K) nogil
    void rtp_linear_q8_0(const float *x, int64_t ldx, const int8_t *qs, const float *d,
                         const float *bias, void *out, int64_t ldo, int out_bf16,
                         int64_t M, int64_t N, int64_t K) nogil
    void rtp_add_rms_norm(float *residual, int64_t ldr, const void *delta, int delta_bf16, int64_t ldd,
                          const void *weight, int weight_bf16, float eps, void *out, int out_bf16, int64_t ldo,
                          int64_t T, int64_t H) nogil
    void rtp_rope_store_kv(const uint16_t *qkv, int64_t ldq, const int32_t *positions,
                           const float *cos_sin, int64_t rot, uint16_t *q_out, uint16_t *k_cache,
                           uint16_t *v_cache, int64_t tok_stride, const int64_t *slots,
                           int64_t T, int64_t H, int64_t Hkv, int64_t D) nogil
    int rtp_amx_supported() nogil
    int rtp_linear_amx(const uint16_t *x, int64_t ldx, int kind, const uint8_t *weights,
                       const float *bias, void *out, int64_t ldo, int out_bf16,
                       int64_t M, int64_t N, int64_t K) nogil
    void rtp_paged_decode_attention_bf16(
        const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, int64_t tok_stride,
        const int32_t *block_tables, int64_t ldt, const int32_t *seq_lens, uint16_t *out,
        int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size, float scale,
        int64_t window) nogil


def supported() -> bool:
    """True when this CPU has AVX-512 BF16 (the kernels are compiled for nothing less)."""
    return bool(rtp_cpu_kernels_supported())


def linear_q4_1(intptr_t x, int64_t ldx, intptr_t qs, intptr_t d, intptr_t m, intptr_t bias,
                intptr_t out, int64_t ldo, bint out_bf16, int64_t rows, int64_t n, int64_t k) -> None:
    """out = x @ dequant(Q4_1 weight).T (+ bias); x bf16."""
    with nogil:
        rtp_linear_q4_1(<const uint16_t *>x, ldx, <const uint8_t *>qs, <const float *>d,
                        <const float *>m, <const float *>bias, <void *>out, ldo,
                        out_bf16, rows, n, k)


def amx_supported() -> bool:
    """True when this CPU has AMX-BF16 and the kernel granted this process the tile state."""
    return bool(rtp_amx_supported())


def linear_amx(intptr_t x, int64_t ldx, int kind, intptr_t weights, intptr_t bias,
               intptr_t out, int64_t ldo, bint out_bf16, int64_t rows, int64_t n, int64_t k) -> None:
    """out = x @ dequant(weight).T (+ bias) on AMX; kind 0 Q4_1, 1 Q8_0 (tile-order records); x bf16."""
    cdef int ok
    with nogil:
        ok = rtp_linear_amx(<const uint16_t *>x, ldx, kind, <const uint8_t *>weights,
                            <const float *>bias, <void *>out, ldo, out_bf16, rows, n, k)
    if not ok:
        raise MemoryError("rtp_linear_amx: no scratch memory")


def linear_q8_0(intptr_t x, int64_t ldx, intptr_t qs, intptr_t d, intptr_t bias, intptr_t out,
                int64_t ldo, bint out_bf16, int64_t rows, int64_t n, int64_t k) -> None:
    """out = x @ dequant(Q8_0 weight).T (+ bias); x fp32."""
    with nogil:
        rtp_linear_q8_0(<const float *>x, ldx, <const int8_t *>qs, <const float *>d,
                        <const float *>bias, <void *>out, ldo, out_bf16, rows, n, k)


def paged_decode_attention_bf16(intptr_t q, intptr_t k_cache, intptr_t v_cache, int64_t tok_stride,
                                intptr_t block_tables, int64_t ldt, intptr_t seq_lens, intptr_t out,
                                int64_t b, int64_t h, int64_t hkv, int64_t d, int64_t block_size,
                                float scale, int64_t window) -> None:
    """One query token per row over paged bf16 K/V; see cpu_kernels.c for the layout."""
    with nogil:
        rtp_paged_decode_attention_bf16(<const uint16_t *>q, <const uint16_t *>k_cache,
                                        <const uint16_t *>v_cache, tok_stride,
                                        <const int32_t *>block_tables, ldt, <const int32_t *>seq_lens,
                                        <uint16_t *>out, b, h, hkv, d, block_size, scale, window)


def add_rms_norm(intptr_t residual, int64_t ldr, intptr_t delta, bint delta_bf16, int64_t ldd,
                 intptr_t weight, bint weight_bf16, float eps, intptr_t out, bint out_bf16, int64_t ldo, int64_t t,
                 int64_t h) -> None:
    """residual += delta (0: none); out = rmsnorm(residual) * weight."""
    with nogil:
        rtp_add_rms_norm(<float *>residual, ldr, <const void *>delta, delta_bf16, ldd,
                         <const void *>weight, weight_bf16, eps, <void *>out, out_bf16, ldo, t, h)


def rope_store_kv(intptr_t qkv, int64_t ldq, intptr_t positions, intptr_t cos_sin, int64_t rot,
                  intptr_t q_out, intptr_t k_cache, intptr_t v_cache, int64_t tok_stride,
                  intptr_t slots, int64_t t, int64_t h, int64_t hkv, int64_t d) -> None:
    """Rotate q, k of a fused qkv output; q to q_out, k and v into the cache at slots."""
    with nogil:
        rtp_rope_store_kv(<const uint16_t *>qkv, ldq, <const int32_t *>positions,
                          <const float *>cos_sin, rot, <uint16_t *>q_out, <uint16_t *>k_cache,
                          <uint16_t *>v_cache, tok_stride, <const int64_t *>slots, t, h, hkv, d)
