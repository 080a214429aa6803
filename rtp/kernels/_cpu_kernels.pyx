# cython: language_level=3
"""Python entry points of rtp/kernels/csrc/cpu_kernels.c, decode_attention.c, amx_linear.c, prefill_attention.c
and row_kernels.c (AVX-512 BF16 and AMX kernels).

Arguments are raw addresses and sizes, so this module needs neither torch nor
numpy; rtp.kernels.cpu_kernels checks dtypes, shapes and strides and passes
``tensor.data_ptr()``. Every entry point builds the kernel call as data
(rtp/kernels/csrc/kernel_calls.c) and runs it with the GIL released; between
``record_start()`` and ``record_stop()`` the calls are also kept, for
rtp/kernels/cpu_graph.py to replay with ``run_calls``.
"""
from array import array

from libc.stdint cimport int8_t, int32_t, int64_t, intptr_t, uint32_t, uint64_t
from libc.string cimport memcpy

cdef extern from "cpu_kernels.h":
    int rtp_cpu_kernels_supported() nogil
    int rtp_amx_supported() nogil
    int rtp_vnni_supported() nogil
    enum:
        RTP_CALL_WORDS
        RTP_OP_LINEAR_Q4_1
        RTP_OP_LINEAR_Q8
        RTP_OP_LINEAR_TILES
        RTP_OP_ADD_RMS_NORM
        RTP_OP_ROPE_STORE_KV
        RTP_OP_DECODE_ATTENTION
        RTP_OP_EMBED_ROWS
        RTP_OP_SILU_MUL
        RTP_OP_PREFILL_ATTENTION
        RTP_OP_GATHER_ROWS
        RTP_OP_LINEAR_Q4_K
        RTP_OP_LINEAR_BF16
        RTP_OP_LINEAR_U8
        RTP_OP_RMS_NORM
        RTP_OP_QK_RMS_NORM
        RTP_OP_GELU_TANH_MUL
        RTP_OP_SOFTCAP
        RTP_COUNT_AS_RECORDED
        RTP_COUNT_TOKENS
        RTP_COUNT_SAMPLES
        RTP_COUNT_DECODE_ROWS
        RTP_COUNT_PREFILL_ROWS
        RTP_SEVERAL_SAMPLES
        RTP_ONE_SAMPLE
    int rtp_run_call(const int64_t *call) nogil
    void rtp_argmax_rows(const float *x, int64_t ldx, int64_t t, int64_t n, int64_t *out) nogil
    void rtp_apply_token_bitmask(float *x, int64_t ldx, const int32_t *mask, int64_t ldm, const int64_t *rows,
                                 int64_t r, int64_t n) nogil
    uint64_t rtp_stream_read(const void *buf, int64_t nbytes) nogil
    int64_t rtp_run_calls(const int64_t *calls, int64_t n, int64_t rows, int64_t *ns) nogil
    int64_t rtp_run_step_calls(const int64_t *calls, int64_t n, const int8_t *classes, const int64_t *counts,
                               int64_t *ns) nogil
    int rtp_call_rows_word(int64_t op) nogil
    uint32_t rtp_call_address_words(int64_t op) nogil

CALL_WORDS = RTP_CALL_WORDS
# word 0 of a call -> the kernel's name (profiles of a replayed step)
OP_NAMES = {RTP_OP_LINEAR_Q4_1: "linear_q4_1", RTP_OP_LINEAR_Q8: "linear_q8", RTP_OP_LINEAR_TILES: "linear_tiles",
            RTP_OP_ADD_RMS_NORM: "add_rms_norm", RTP_OP_ROPE_STORE_KV: "rope_store_kv",
            RTP_OP_DECODE_ATTENTION: "decode_attention", RTP_OP_EMBED_ROWS: "embed_rows",
            RTP_OP_SILU_MUL: "silu_mul", RTP_OP_PREFILL_ATTENTION: "prefill_attention",
            RTP_OP_GATHER_ROWS: "gather_rows", RTP_OP_LINEAR_Q4_K: "linear_q4_k",
            RTP_OP_LINEAR_BF16: "linear_bf16", RTP_OP_LINEAR_U8: "linear_u8", RTP_OP_RMS_NORM: "rms_norm",
            RTP_OP_QK_RMS_NORM: "qk_rms_norm", RTP_OP_GELU_TANH_MUL: "gelu_tanh_mul", RTP_OP_SOFTCAP: "softcap"}
# what a step graph's call counts its rows in (rtp_run_step_calls)
COUNT_AS_RECORDED, COUNT_TOKENS, COUNT_SAMPLES = RTP_COUNT_AS_RECORDED, RTP_COUNT_TOKENS, RTP_COUNT_SAMPLES
COUNT_DECODE_ROWS, COUNT_PREFILL_ROWS = RTP_COUNT_DECODE_ROWS, RTP_COUNT_PREFILL_ROWS
SEVERAL_SAMPLES, ONE_SAMPLE = RTP_SEVERAL_SAMPLES, RTP_ONE_SAMPLE

cdef object _recording = None  # array('q') of the calls made since record_start(), or None
cdef bint _dry = False          # recording: each call runs over at most DRY_ROWS rows
DRY_ROWS = 2


cdef inline int64_t _float_word(double v):
    cdef int64_t w
    memcpy(&w, &v, sizeof(double))
    return w


cdef int _run(int64_t *c, int used) except -1:
    """Run the call in c[:used] (the words after it are zeroed: a recorded call is all data)."""
    cdef int ok
    cdef int i
    for i in range(used, RTP_CALL_WORDS):
        c[i] = 0
    cdef int w
    if _recording is not None:
        for i in range(RTP_CALL_WORDS):
            _recording.append(c[i])
        if _dry:
            w = rtp_call_rows_word(c[0])
            if w and c[w] > DRY_ROWS:
                c[w] = DRY_ROWS
    with nogil:
        ok = rtp_run_call(c)
    if not ok:
        raise _failure(c, 0)
    return 0


cdef object _failure(const int64_t *c, int64_t rows):
    """The exception for a call that returned 0 (run over `rows` rows; 0: as recorded)."""
    cdef int w = rtp_call_rows_word(c[0])
    name = OP_NAMES.get(c[0], f"op {c[0]}")
    if rows > 0 and w and rows > c[w]:
        return ValueError(f"kernel call {name} was recorded over {c[w]} rows, cannot run over {rows}")
    if c[0] == RTP_OP_ROPE_STORE_KV:
        return IndexError(f"rope_store_kv: a slot outside the KV cache's {c[15]} slots "
                          f"(those tokens' K/V were not written)")
    return MemoryError(f"kernel {name}: no scratch memory")


def supported() -> bool:
    """True when this CPU has AVX-512 BF16 (the kernels are compiled for nothing less)."""
    return bool(rtp_cpu_kernels_supported())


def amx_supported() -> bool:
    """True when this CPU has AMX-BF16 and the kernel granted this process the tile state."""
    return bool(rtp_amx_supported())


def vnni_supported() -> bool:
    """Whether this CPU has AVX-512 VNNI (int8 dot products), which --activation-dtype int8 takes."""
    return bool(rtp_vnni_supported())


def record_start(bint dry=False) -> None:
    """Keep every kernel call from now on (they still run; dry: over at most DRY_ROWS of their rows, so
    each call is checked but a large capture costs nothing) until record_stop()."""
    global _recording, _dry
    if _recording is not None:
        raise RuntimeError("already recording kernel calls")
    _recording = array("q")
    _dry = dry


def record_peek():
    """The calls recorded since record_start(), recording on."""
    if _recording is None:
        raise RuntimeError("not recording kernel calls")
    return _recording


def record_stop():
    """The calls made since record_start(): array('q') of CALL_WORDS words per call."""
    global _recording, _dry
    calls, _recording, _dry = _recording, None, False
    return calls if calls is not None else array("q")


def address_words(int64_t op) -> int:
    """Bitmask of the words of an `op` call that are addresses."""
    return rtp_call_address_words(op)


def rows_word(int64_t op) -> int:
    """The word of an `op` call that holds its row count."""
    return rtp_call_rows_word(op)


def run_calls(intptr_t calls, int64_t n, int64_t rows, intptr_t ns=0) -> None:
    """Run n recorded calls (int64 [n, CALL_WORDS] at address `calls`) in order, each over
    `rows` rows (0: as recorded; never more than a call was recorded with); ns, when not 0, the
    address of int64 [n] that receives each call's wall time in nanoseconds."""
    cdef int64_t done
    with nogil:
        done = rtp_run_calls(<const int64_t *>calls, n, rows, <int64_t *>ns)
    if done != n:
        e = _failure(<const int64_t *>calls + done * RTP_CALL_WORDS, rows)
        raise type(e)(f"replayed call {done}: {e}")


def run_step_calls(intptr_t calls, int64_t n, intptr_t classes, int64_t tokens, int64_t samples,
                   int64_t decode_rows, int64_t prefill_rows, intptr_t ns=0) -> None:
    """Run n recorded calls of a step graph over this step's counts; classes: the address of int8 [n],
    each call's count (COUNT_*); see rtp_run_step_calls in kernel_calls.c."""
    cdef int64_t counts[5]
    cdef int64_t done
    counts[:5] = [0, tokens, samples, decode_rows, prefill_rows]
    with nogil:
        done = rtp_run_step_calls(<const int64_t *>calls, n, <const int8_t *>classes, counts, <int64_t *>ns)
    if done != n:
        e = _failure(<const int64_t *>calls + done * RTP_CALL_WORDS, 0)
        raise type(e)(f"replayed call {done} of a step graph (tokens {tokens}, samples {samples}): {e}")


def linear_q4_1(intptr_t x, int64_t ldx, intptr_t qs, intptr_t d, intptr_t m, intptr_t bias,
                intptr_t out, int64_t ldo, bint out_bf16, int64_t rows, int64_t n, int64_t k) -> None:
    """out = x @ dequant(Q4_1 weight).T (+ bias); x bf16."""
    cdef int64_t c[RTP_CALL_WORDS]
    c[:13] = [RTP_OP_LINEAR_Q4_1, x, ldx, qs, d, m, bias, out, ldo, out_bf16, rows, n, k]
    _run(c, 13)


def linear_u8(intptr_t x, int64_t ldx, bint x_fp32, intptr_t qs, intptr_t d, intptr_t mn, int group, int offset,
              intptr_t bias, intptr_t out, int64_t ldo, bint out_bf16, int64_t rows, int64_t n, int64_t k) -> None:
    """out = x @ W.T (+ bias) for small int8 blocks (q8_1: offset 0, group 32, mn; q8_16: offset 32, group 16)."""
    cdef int64_t c[RTP_CALL_WORDS]
    c[:16] = [RTP_OP_LINEAR_U8, x, ldx, x_fp32, qs, d, mn, group, offset, bias, out, ldo, out_bf16, rows, n, k]
    _run(c, 16)


def linear_bf16(intptr_t x, int64_t ldx, bint x_fp32, intptr_t w, int64_t ldw, intptr_t bias, intptr_t out,
                int64_t ldo, bint out_bf16, int64_t rows, int64_t n, int64_t k) -> None:
    """out = x @ W.T (+ bias) for dense bf16 W [n, k] (row stride ldw); x bf16 or fp32."""
    cdef int64_t c[RTP_CALL_WORDS]
    c[:13] = [RTP_OP_LINEAR_BF16, x, ldx, x_fp32, w, ldw, bias, out, ldo, out_bf16, rows, n, k]
    _run(c, 13)


def linear_q4_k(intptr_t x, int64_t ldx, intptr_t qs, intptr_t scm, intptr_t dd, intptr_t bias, intptr_t out,
                int64_t ldo, bint out_bf16, int64_t rows, int64_t n, int64_t k) -> None:
    """out = x @ (Q4_K super-blocks, rtp's q4_k layout).T (+ bias); x bf16."""
    cdef int64_t c[RTP_CALL_WORDS]
    c[:13] = [RTP_OP_LINEAR_Q4_K, x, ldx, qs, scm, dd, bias, out, ldo, out_bf16, rows, n, k]
    _run(c, 13)


def linear_q8(intptr_t x, int64_t ldx, intptr_t qs, intptr_t d, intptr_t mn, int group, intptr_t bias,
              intptr_t out, int64_t ldo, bint out_bf16, int64_t rows, int64_t n, int64_t k) -> None:
    """out = x @ dequant(int8 blocks).T (+ bias): d per `group` (32 or 16) weights, mn per 32 or 0; x fp32."""
    cdef int64_t c[RTP_CALL_WORDS]
    c[:14] = [RTP_OP_LINEAR_Q8, x, ldx, qs, d, mn, group, bias, out, ldo, out_bf16, rows, n, k]
    _run(c, 14)


def linear_tiles(intptr_t x, int64_t ldx, bint x_fp32, int kind, intptr_t weights, intptr_t bias,
                 intptr_t out, int64_t ldo, bint out_bf16, int64_t rows, int64_t n, int64_t k, bint glu,
                 bint amx, int64_t bf16_rows=0, bint bf16_rows_decode=False) -> None:
    """out = x @ dequant(weight).T (+ bias) from weight records in tile order (kind 0 Q4_1, 1 Q8_0,
    2 Q8_1, 3 Q8 with scales per 16, 4 bf16; 5 and 6: the records of 0 and 1 with x's rows quantized to
    int8, vnni_gemm.c, where the CPU has VNNI and the call is not on AMX; the first bf16_rows rows in
    bf16 all the same); x bf16 or fp32. glu: weight is gate and up interleaved by tiles, out bf16
    [rows, n / 2] = silu(gate) * up. amx: on AMX tiles (amx_linear.c, amx_gemm.c), else with AVX-512
    BF16 (avx_gemm.c). bf16_rows_decode: a step graph's replay sets bf16_rows to the step's decode rows."""
    cdef int64_t c[RTP_CALL_WORDS]
    c[:17] = [RTP_OP_LINEAR_TILES, x, ldx, x_fp32, kind, weights, bias, out, ldo, out_bf16, rows, n, k, glu, amx,
              bf16_rows, bf16_rows_decode]
    _run(c, 17)


def paged_decode_attention_bf16(intptr_t q, intptr_t k_cache, intptr_t v_cache, int64_t tok_stride,
                                intptr_t block_tables, int64_t ldt, intptr_t seq_lens, intptr_t out,
                                int64_t b, int64_t h, int64_t hkv, int64_t d, int64_t block_size,
                                float scale, int64_t window, intptr_t k_scales=0, intptr_t v_scales=0,
                                float softcap=0) -> None:
    """One bf16 query token per row over paged bf16 K/V, or int8 K/V with fp32 scales (k_scales,
    v_scales: [slots, hkv]; 0: bf16); softcap > 0: scores -> softcap * tanh(scores / softcap) (0:
    none); see decode_attention.c for the layout."""
    cdef int64_t c[RTP_CALL_WORDS]
    c[:19] = [RTP_OP_DECODE_ATTENTION, q, k_cache, v_cache, tok_stride, block_tables, ldt, seq_lens, out,
              b, h, hkv, d, block_size, _float_word(scale), window, k_scales, v_scales, _float_word(softcap)]
    _run(c, 19)


def add_rms_norm(intptr_t residual, int64_t ldr, intptr_t delta, bint delta_bf16, int64_t ldd,
                 intptr_t weight, bint weight_bf16, float eps, intptr_t out, bint out_bf16, int64_t ldo, int64_t t,
                 int64_t h) -> None:
    """residual += delta (0: none); out = rmsnorm(residual) * weight."""
    cdef int64_t c[RTP_CALL_WORDS]
    c[:14] = [RTP_OP_ADD_RMS_NORM, residual, ldr, delta, delta_bf16, ldd, weight, weight_bf16, _float_word(eps),
              out, out_bf16, ldo, t, h]
    _run(c, 14)


def rope_store_kv(intptr_t qkv, int64_t ldq, intptr_t positions, intptr_t cos_sin, int64_t rot,
                  intptr_t q_out, intptr_t k_cache, intptr_t v_cache, int64_t tok_stride,
                  intptr_t slots, int64_t t, int64_t h, int64_t hkv, int64_t d, int64_t num_slots,
                  intptr_t k_scales=0, intptr_t v_scales=0) -> None:
    """Rotate q, k of a fused qkv output; q to q_out, k and v into the cache (num_slots slots) at
    slots: bf16, or int8 with their fp32 scales (k_scales, v_scales [num_slots, hkv]; 0: bf16).
    IndexError, after the call, when a slot lies outside the cache (nothing written there)."""
    cdef int64_t c[RTP_CALL_WORDS]
    c[:18] = [RTP_OP_ROPE_STORE_KV, qkv, ldq, positions, cos_sin, rot, q_out, k_cache, v_cache, tok_stride,
              slots, t, h, hkv, d, num_slots, k_scales, v_scales]
    _run(c, 18)


def embed_rows(intptr_t table, bint table_bf16, int64_t ldt, intptr_t ids, intptr_t out, int64_t ldo,
               int64_t t, int64_t h, float scale=1.0) -> None:
    """out fp32 [t, h] = table rows at ids (int32), times scale rounded to the table's dtype (1: as they are)."""
    cdef int64_t c[RTP_CALL_WORDS]
    c[:10] = [RTP_OP_EMBED_ROWS, table, table_bf16, ldt, ids, out, ldo, t, h, _float_word(scale)]
    _run(c, 10)


def silu_mul(intptr_t x, int64_t ldx, intptr_t out, int64_t ldo, int64_t t, int64_t i) -> None:
    """out bf16 [t, i] = silu(x[:, :i]) * x[:, i:] for x bf16 [t, 2i]."""
    cdef int64_t c[RTP_CALL_WORDS]
    c[:7] = [RTP_OP_SILU_MUL, x, ldx, out, ldo, t, i]
    _run(c, 7)


def gelu_tanh_mul(intptr_t x, int64_t ldx, intptr_t out, int64_t ldo, int64_t t, int64_t i) -> None:
    """out bf16 [t, i] = gelu_tanh(x[:, :i]) * x[:, i:] for x bf16 [t, 2i]."""
    cdef int64_t c[RTP_CALL_WORDS]
    c[:7] = [RTP_OP_GELU_TANH_MUL, x, ldx, out, ldo, t, i]
    _run(c, 7)


def rms_norm(intptr_t x, int64_t ldx, bint x_bf16, intptr_t weight, bint weight_bf16, float eps, intptr_t out,
             int64_t ldo, bint out_bf16, int64_t t, int64_t h) -> None:
    """out [t, h] = rmsnorm(x [t, h]) * weight; x, weight and out each bf16 or fp32 (strides in their elements)."""
    cdef int64_t c[RTP_CALL_WORDS]
    c[:12] = [RTP_OP_RMS_NORM, x, ldx, x_bf16, weight, weight_bf16, _float_word(eps), out, ldo, out_bf16, t, h]
    _run(c, 12)


def qk_rms_norm(intptr_t qkv, int64_t ldq, intptr_t q_weight, intptr_t k_weight, bint weight_bf16, float eps,
                int64_t t, int64_t h, int64_t hkv, int64_t d) -> None:
    """In place: each q head (h of them) and k head (hkv) of qkv bf16 [t, (h + 2 hkv) d] normed with its weight."""
    cdef int64_t c[RTP_CALL_WORDS]
    c[:11] = [RTP_OP_QK_RMS_NORM, qkv, ldq, q_weight, k_weight, weight_bf16, _float_word(eps), t, h, hkv, d]
    _run(c, 11)


def softcap(intptr_t x, int64_t ldx, float cap, int64_t t, int64_t n) -> None:
    """In place: x fp32 [t, n] = cap * tanh(x / cap)."""
    cdef int64_t c[RTP_CALL_WORDS]
    c[:6] = [RTP_OP_SOFTCAP, x, ldx, _float_word(cap), t, n]
    _run(c, 6)


def prefill_attention_bf16(intptr_t q, intptr_t k_cache, intptr_t v_cache, int64_t tok_stride, intptr_t qsl,
                           intptr_t seq_lens, intptr_t tables, int64_t ldt, int64_t first_row, int64_t nseq,
                           intptr_t out, int64_t h, int64_t hkv, int64_t d, int64_t block_size, float scale,
                           int64_t window, bint amx, intptr_t k_scales=0, intptr_t v_scales=0,
                           float softcap=0) -> None:
    """Causal varlen attention of a step plan's rows [first_row, first_row + nseq) over paged bf16 K/V, or
    int8 K/V with fp32 scales (k_scales, v_scales [slots, hkv]; 0: bf16); softcap as
    paged_decode_attention_bf16's; see prefill_attention.c."""
    cdef int64_t c[RTP_CALL_WORDS]
    c[:22] = [RTP_OP_PREFILL_ATTENTION, q, k_cache, v_cache, tok_stride, qsl, seq_lens, tables, ldt, first_row, nseq,
              out, h, hkv, d, block_size, _float_word(scale), window, amx, k_scales, v_scales, _float_word(softcap)]
    _run(c, 22)


def gather_rows(intptr_t src, int64_t src_stride, intptr_t idx, int64_t n, intptr_t out, int64_t out_stride,
                int64_t row_bytes) -> None:
    """out row i = src row idx[i] (int32), row_bytes each, strides in bytes."""
    cdef int64_t c[RTP_CALL_WORDS]
    c[:8] = [RTP_OP_GATHER_ROWS, src, src_stride, idx, n, out, out_stride, row_bytes]
    _run(c, 8)


def apply_token_bitmask(intptr_t x, int64_t ldx, intptr_t mask, int64_t ldm, intptr_t rows, int64_t r,
                        int64_t n) -> None:
    """x fp32 rows[i] of [*, n] (row stride ldx) = -inf where bit j of mask row i (int32 words, row
    stride ldm) is 0."""
    with nogil:
        rtp_apply_token_bitmask(<float *>x, ldx, <const int32_t *>mask, ldm, <const int64_t *>rows, r, n)


def argmax_rows(intptr_t x, int64_t ldx, int64_t t, int64_t n, intptr_t out) -> None:
    """out int64 [t] = each row's argmax of x fp32 [t, n] (first on ties; first NaN if any)."""
    with nogil:
        rtp_argmax_rows(<const float *>x, ldx, t, n, <int64_t *>out)


def stream_read(intptr_t buf, int64_t nbytes) -> int:
    """Read nbytes (a multiple of 256, 64-byte aligned) at buf once, on every thread; returns the
    words folded by xor (tools/bench_roofline.py times it as the memory bandwidth)."""
    cdef uint64_t folded
    with nogil:
        folded = rtp_stream_read(<const void *>buf, nbytes)
    return folded
