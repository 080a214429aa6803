# cython: language_level=3
"""Python entry points of rtp's C kernels (rtp/kernels/csrc/: AVX-512 BF16 and AMX).

One entry point per kernel op comes from the op table (rtp/kernels/ops.py), written into
_kernel_ops.pxi at build time and included below. Arguments are raw addresses and sizes, so this
module needs neither torch nor numpy; rtp.kernels.cpu_kernels checks dtypes, shapes and strides and passes
``tensor.data_ptr()``. Every entry point builds the kernel call as data
(rtp/kernels/csrc/kernel_calls.c) and runs it with the GIL released; between
``record_start()`` and ``record_stop()`` the calls are also kept, for
rtp/kernels/cpu_graph.py to replay with ``run_calls``.
"""
from array import array

from libc.stdint cimport int8_t, int32_t, int64_t, intptr_t, uint32_t, uint64_t
from libc.string cimport memcpy

cdef extern from "kernel_ops.h":
    ctypedef struct rtp_op:
        const char *name
        int8_t words
        int8_t rows
        int8_t decode_rows
        int8_t prefill_rows
        int8_t plan_when
        uint32_t addresses
        int8_t isa

cdef extern from "cpu_kernels.h":
    int rtp_cpu_kernels_supported() nogil
    int rtp_cpu_isa() nogil
    int rtp_select_isa(int most) nogil
    int rtp_isa
    int rtp_amx_supported() nogil
    int rtp_vnni_supported() nogil
    enum:
        RTP_CALL_WORDS
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
    const rtp_op *rtp_call_op(int64_t op) nogil

CALL_WORDS = RTP_CALL_WORDS
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
    if c[0] not in OP_NAMES:
        return ValueError(f"no kernel op {c[0]} (word 0 of a call)")
    name = OP_NAMES[c[0]]
    if rtp_call_op(c[0]).isa > rtp_isa:
        return RuntimeError(f"kernel {name} has no variant for this CPU's ISA path")
    if rows > 0 and w and rows > c[w]:
        return ValueError(f"kernel call {name} was recorded over {c[w]} rows, cannot run over {rows}")
    if name == "rope_store_kv":
        return IndexError(f"rope_store_kv: a slot outside the KV cache's {c[1 + FIELDS[c[0]].index('num_slots')]} "
                          f"slots (those tokens' K/V were not written)")
    return MemoryError(f"kernel {name}: no scratch memory")


include "_kernel_ops.pxi"


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


def op_entry(int64_t op):
    """op's entry in the replay's table (rtp_ops[], kernel_ops.c): (name, words, rows word, decode rows word,
    prefill rows word, plan_when word, address words, lowest ISA path), or None where it has no such op."""
    cdef const rtp_op *o = rtp_call_op(op)
    if o == NULL:
        return None
    return o.name.decode(), o.words, o.rows, o.decode_rows, o.prefill_rows, o.plan_when, o.addresses, o.isa


def cpu_isa() -> int:
    """The highest ISA path this CPU runs (ops.ISAS[i - 1]; 0: none)."""
    return rtp_cpu_isa()


def select_isa(int most) -> int:
    """Run the kernels on this CPU's path, or on path `most` where that is lower; returns the path selected."""
    return rtp_select_isa(most)


def isa() -> int:
    """The path selected (0: none yet)."""
    return rtp_isa


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
