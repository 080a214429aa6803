"""Torch-facing wrappers of rtp's CPU kernels (rtp/kernels/csrc/; each op defined once in rtp/kernels/ops.py).

Each kernel is registered as a torch custom op, so a `torch.compile`d decode
graph calls it as one opaque node; eager code calls the implementation
directly (the custom-op dispatcher costs more than a small kernel). The
wrappers allocate outputs and pass addresses; callers check operands with the
`*_supported` predicates, and the C side trusts them. `available()` is False
off x86, on CPUs without AVX-512 BF16, or with RTP_CPU_KERNELS=0 (to measure
the plain PyTorch path); then nothing here is called.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch

from rtp.kernels import ops


def _probe() -> int:
    """The ISA path the kernels run on (ops.ISAS[i - 1]; 0: none): this CPU's highest, or RTP_CPU_ISA's where
    that is lower (tests and benchmarks run the lower paths so); RTP_AMX=0 stops at avx512bf16."""
    if os.environ.get("RTP_CPU_KERNELS", "1") == "0":
        return 0
    try:
        from rtp.kernels import _cpu_kernels
    except ImportError:
        return 0
    if not ops.ISAS:  # an architecture rtp has no kernels for
        return 0
    want = os.environ.get("RTP_CPU_ISA", "") or ops.ISAS[-1]
    if want not in ops.ISAS:
        raise ValueError(f"RTP_CPU_ISA={want!r}: one of {', '.join(ops.ISAS)}")
    most = ops.ISAS.index(want) + 1
    if os.environ.get("RTP_AMX", "1") == "0" and "amx" in ops.ISAS:
        most = min(most, ops.ISAS.index("avx512bf16") + 1)
    return _cpu_kernels.select_isa(most)


# Decided once at import: constants are what torch.compile can trace through.
_ISA = _probe()
_AVAILABLE = _ISA > 0
if _AVAILABLE:
    from rtp.kernels import _cpu_kernels as _k
# the path of the kernels outside csrc/avx2/ and csrc/arm/: tile-order linears, VNNI and AMX (x86-64 only)
_BF16_PATH = "avx512bf16" in ops.ISAS and _ISA >= ops.ISAS.index("avx512bf16") + 1
# each op: whether it has a variant on the selected path (an op without one leaves its layers on torch)
_HAS = {op.name: _AVAILABLE and op.lowest_isa is not None and _ISA >= ops.ISAS.index(op.lowest_isa) + 1
        for op in ops.OPS}


def available() -> bool:
    """Whether rtp's kernels run here at all (on some ISA path)."""
    return _AVAILABLE


def isa() -> str | None:
    """The ISA path the kernels run on (ops.ISAS), None where they do not run."""
    return ops.ISAS[_ISA - 1] if _AVAILABLE else None


def paths_here() -> tuple[str, ...]:
    """The ISA paths this CPU can run (RTP_CPU_ISA may pick any of them), lowest first."""
    return ops.ISAS[:_k.cpu_isa()] if _AVAILABLE else ()


def has_op(name: str) -> bool:
    """Whether kernel op `name` runs on the selected path."""
    return _HAS[name]


@contextlib.contextmanager
def on_isa(name: str):
    """Within: the kernels dispatch to ISA path `name`'s variants (or the CPU's highest, where lower), so that a
    test runs a lower path's kernels on a machine that has a higher one. Only what the kernels run changes:
    the predicates and layouts chosen at import stay (tests call the kernels directly)."""
    previous = _k.isa()
    _k.select_isa(ops.ISAS.index(name) + 1)
    try:
        yield ops.ISAS[_k.isa() - 1]
    finally:
        _k.select_isa(previous)


def lanes_available() -> bool:
    """Whether the lane-order linears run here: the avx512 path (AVX-512 without BF16) on a CPU with VNNI. Layers
    then keep their blocks in lane order (BlockQuantized.lane_layout), which take every batch."""
    return _HAS["linear_lanes"] and not _BF16_PATH and _k.vnni_supported()


def tiles_available() -> bool:
    """Whether the tile-order linears run here (avx512bf16 and amx): layers then keep their blocks in tile order."""
    return _HAS["linear_tiles"]


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _op(name: str, mutates: tuple[str, ...], fake):
    """Register fn as custom op rtp::name; the returned function picks op or fn."""
    def register(fn):
        op = torch.library.custom_op(f"rtp::{name}", fn, mutates_args=mutates)
        op.register_fake(fake)

        def call(*args, **kwargs):
            return op(*args, **kwargs) if torch.compiler.is_compiling() else fn(*args, **kwargs)

        call.__doc__ = fn.__doc__
        call.op = op
        return call

    return register


# -- linear over GGUF blocks ----------------------------------------------------------------------

@_op("linear_q4_1", (), lambda x, qs, d, m, bias, out_dtype: x.new_empty(x.shape[0], qs.shape[0],
                                                                        dtype=out_dtype))
def linear_q4_1(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] bf16 @ Q4_1 weight [N, K].T (+ bias fp32) -> [M, N] in out_dtype."""
    return linear_q4_1_into(x, qs, d, m, bias, torch.empty(x.shape[0], qs.shape[0], dtype=out_dtype))


@_op("linear_u8", (), lambda x, qs, d, m, group, offset, bias, out_dtype: x.new_empty(x.shape[0], qs.shape[0],
                                                                                    dtype=out_dtype))
def linear_u8(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, group: int, offset: int,
              bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] bf16 or fp32 (rounded to bf16) @ small int8 blocks [N, K].T: w = d (q) + m for q8_1 (group 32,
    offset 0, m), w = d_g q for q8_16 (group 16, offset 32) -- q + 128 + offset is a bf16 exactly (csrc/linear/u8.c)."""
    return linear_u8_into(x, qs, d, m, group, offset, bias, torch.empty(x.shape[0], qs.shape[0], dtype=out_dtype))


def linear_u8_into(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, group: int,
                   offset: int, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """linear_u8 written into out; returns out."""
    if x.stride(1) != 1 or (x.dtype == torch.bfloat16 and x.stride(0) % 2):
        x = x.contiguous()
    rows, k = x.shape
    n = qs.shape[0]
    _checked_out(out, rows, n)
    _k.linear_u8(x.data_ptr(), x.stride(0), x.dtype == torch.float32, qs.data_ptr(), d.data_ptr(), _ptr(m), group,
                 offset, _ptr(bias), out.data_ptr(), out.stride(0), out.dtype == torch.bfloat16, rows, n, k)
    return out


@_op("linear_bf16", (), lambda x, w, bias, out_dtype: x.new_empty(x.shape[0], w.shape[0], dtype=out_dtype))
def linear_bf16(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] bf16 or fp32 @ w [N, K].T (dense bf16, rows contiguous) (+ bias fp32) -> [M, N] in out_dtype."""
    return linear_bf16_into(x, w, bias, torch.empty(x.shape[0], w.shape[0], dtype=out_dtype))


def linear_bf16_into(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """linear_bf16 written into out; returns out."""
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    n = w.shape[0]
    _checked_out(out, rows, n)
    _k.linear_bf16(x.data_ptr(), x.stride(0), x.dtype == torch.float32, w.data_ptr(), w.stride(0), _ptr(bias),
                   out.data_ptr(), out.stride(0), out.dtype == torch.bfloat16, rows, n, k)
    return out


@_op("linear_q4_k", (), lambda x, qs, scm, dd, bias, out_dtype: x.new_empty(x.shape[0], qs.shape[0],
                                                                            dtype=out_dtype))
def linear_q4_k(x: torch.Tensor, qs: torch.Tensor, scm: torch.Tensor, dd: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] bf16 @ Q4_K weight [N, K].T in its own super-blocks (rtp's q4_k layout: qs uint8 [N, K/2],
    scm uint8 [N, K/256, 16], dd fp32 [N, K/256, 2]) (+ bias fp32) -> [M, N] in out_dtype."""
    return linear_q4_k_into(x, qs, scm, dd, bias, torch.empty(x.shape[0], qs.shape[0], dtype=out_dtype))


def linear_q4_k_into(x: torch.Tensor, qs: torch.Tensor, scm: torch.Tensor, dd: torch.Tensor,
                     bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """linear_q4_k written into out; returns out."""
    x = x.contiguous()
    rows, k = x.shape
    n = qs.shape[0]
    _checked_out(out, rows, n)
    _k.linear_q4_k(x.data_ptr(), k, qs.data_ptr(), scm.data_ptr(), dd.data_ptr(), _ptr(bias), out.data_ptr(),
                   out.stride(0), out.dtype == torch.bfloat16, rows, n, k)
    return out


def _checked_out(out: torch.Tensor, rows: int, n: int) -> None:
    """An output the kernels write rows of n values into, at its row stride (a column slice too)."""
    if out.shape != (rows, n) or out.stride(1) != 1 or out.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the output must be fp32 or bf16 [{rows}, {n}] with contiguous rows")


def linear_q4_1_into(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                     bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """linear_q4_1 written into out (e.g. a fused layer's columns of one output); returns out."""
    x = x.contiguous()
    rows, k = x.shape
    n = qs.shape[0]
    _checked_out(out, rows, n)
    _k.linear_q4_1(x.data_ptr(), k, qs.data_ptr(), d.data_ptr(), m.data_ptr(), _ptr(bias),
                   out.data_ptr(), out.stride(0), out.dtype == torch.bfloat16, rows, n, k)
    return out


@_op("linear_q8", (), lambda x, qs, d, m, group, bias, out_dtype: x.new_empty(x.shape[0], qs.shape[0],
                                                                            dtype=out_dtype))
def linear_q8(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, group: int,
              bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] fp32 @ int8-block weight [N, K].T (+ bias fp32) -> [M, N] in out_dtype: w = d q (+ m), d
    fp32 [N, K / group] (group 32 or 16), m fp32 [N, K / 32] or None."""
    return linear_q8_into(x, qs, d, m, group, bias, torch.empty(x.shape[0], qs.shape[0], dtype=out_dtype))


def linear_q8_into(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, group: int,
                   bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """linear_q8 written into out; returns out."""
    x = x.contiguous()
    rows, k = x.shape
    n = qs.shape[0]
    _checked_out(out, rows, n)
    _k.linear_q8(x.data_ptr(), k, qs.data_ptr(), d.data_ptr(), _ptr(m), group, _ptr(bias), out.data_ptr(),
                 out.stride(0), out.dtype == torch.bfloat16, rows, n, k)
    return out


# The tile-order linear kernels take any number of rows: on AMX (amx_linear.c, amx_gemm.c) where the CPU
# has it, else with AVX-512 BF16 (avx_gemm.c); decided at import like _AVAILABLE.
_AMX = "amx" in ops.ISAS and _ISA == ops.ISAS.index("amx") + 1


def amx_available() -> bool:
    return _AMX


def int8_rows_available() -> bool:
    """Whether the tile kernels multiply int8 rows (--activation-dtype int8): AVX-512 VNNI, and no AMX
    taking the tiles (which multiplies them in bf16)."""
    return _BF16_PATH and not _AMX and _k.vnni_supported()


@_op("linear_tiles", (), lambda x, kind, weights, bias, out_dtype, bf16_rows=0, bf16_rows_decode=False: x.new_empty(
    x.shape[0], weights.shape[0] * 16, dtype=out_dtype))
def linear_tiles(x: torch.Tensor, kind: int, weights: torch.Tensor, bias: torch.Tensor | None,
               out_dtype: torch.dtype, bf16_rows: int = 0, bf16_rows_decode: bool = False) -> torch.Tensor:
    """x [M, K] bf16 or fp32 (rounded to bf16 as it is read) @ W [N, K].T (+ bias fp32) -> [M, N]
    in out_dtype, on AMX tiles or with AVX-512 BF16 (linear_tiles_into). W: GGUF blocks in tile order,
    uint8 [N/16, K/32, record] (BlockQuantized.tile_layout); kind 0 Q4_1, 1 Q8_0, 2 Q8_1, 3 Q8 with
    scales per 16, 4 bf16; 5 and 6 the records of 0 and 1 with x's rows as int8 (BlockQuantized.tile_kind),
    but for the first bf16_rows rows (bf16_rows_decode: the step's decode rows, in a step graph's replay)."""
    return _linear_tiles(x, kind, weights, bias, out_dtype, False, bf16_rows, bf16_rows_decode)


@_op("linear_tiles_glu", (), lambda x, kind, weights, bias, bf16_rows=0, bf16_rows_decode=False: x.new_empty(
    x.shape[0], weights.shape[0] * 8, dtype=torch.bfloat16))
def linear_tiles_glu(x: torch.Tensor, kind: int, weights: torch.Tensor, bias: torch.Tensor | None,
                     bf16_rows: int = 0, bf16_rows_decode: bool = False) -> torch.Tensor:
    """An MLP's silu(x Wg^T + bg) * (x Wu^T + bu) in one pass -> bf16 [M, I]: x [M, K] bf16;
    weights: the gate and up blocks with their 16-row tiles interleaved, uint8 [2I/16, K/32,
    record] (BlockQuantized.tile_layout(glu=True)); bias fp32 [gate I | up I] or None; bf16_rows as
    linear_tiles."""
    return _linear_tiles(x, kind, weights, bias, torch.bfloat16, True, bf16_rows, bf16_rows_decode)


def _linear_tiles(x: torch.Tensor, kind: int, weights: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype, glu: bool, bf16_rows: int, bf16_rows_decode: bool) -> torch.Tensor:
    n = weights.shape[0] * 16
    return linear_tiles_into(x, kind, weights, bias, torch.empty(x.shape[0], n // 2 if glu else n, dtype=out_dtype),
                           glu, bf16_rows=bf16_rows, bf16_rows_decode=bf16_rows_decode)


def linear_tiles_into(x: torch.Tensor, kind: int, weights: torch.Tensor, bias: torch.Tensor | None,
                      out: torch.Tensor, glu: bool = False, amx: bool | None = None, bf16_rows: int = 0,
                      bf16_rows_decode: bool = False) -> torch.Tensor:
    """linear_tiles (glu: linear_tiles_glu) written into out; returns out. amx None: on the AMX unit
    where this CPU has one; False: with AVX-512 BF16 (avx_gemm.c), which runs wherever rtp's kernels do.
    An int8-rows kind multiplies its first bf16_rows rows in bf16 (--activation-dtype int8-prefill: the
    step's decode rows, which come first; bf16_rows_decode: a step graph's replay sets them per step)."""
    fp32 = x.dtype == torch.float32
    if x.stride(1) != 1 or (not fp32 and x.stride(0) % 2):
        x = x.contiguous()
    rows, k = x.shape
    n = weights.shape[0] * 16
    _checked_out(out, rows, n // 2 if glu else n)
    _k.linear_tiles(x.data_ptr(), x.stride(0), fp32, kind, weights.data_ptr(), _ptr(bias), out.data_ptr(),
                    out.stride(0), out.dtype == torch.bfloat16, rows, n, k, glu, _AMX if amx is None else amx and _AMX,
                    bf16_rows, bf16_rows_decode)
    return out


# -- linear over lane-order records (csrc/avx512/linear_lanes.c: the avx512 path) ---------------------

@_op("linear_lanes", (), lambda x, kind, weights, bias, out_dtype: x.new_empty(x.shape[0], weights.shape[0] * 16,
                                                                             dtype=out_dtype))
def linear_lanes(x: torch.Tensor, kind: int, weights: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] bf16 or fp32 @ W.T (+ bias fp32) -> [M, N] in out_dtype, W's records in lane order (linear_lanes_into;
    a torch custom op, so compiled graphs call it as one node)."""
    return linear_lanes_into(x, kind, weights, bias, torch.empty(x.shape[0], weights.shape[0] * 16, dtype=out_dtype))


def linear_lanes_into(x: torch.Tensor, kind: int, weights: torch.Tensor, bias: torch.Tensor | None,
                      out: torch.Tensor) -> torch.Tensor:
    """out [M, N] = x [M, K] (bf16 or fp32) @ W.T (+ bias fp32) for W's records in lane order (uint8 [N/16, K/32,
    record], BlockQuantized.lane_layout, `kind` its TILE_KIND); returns out."""
    fp32 = x.dtype == torch.float32
    if x.stride(1) != 1 or (not fp32 and x.stride(0) % 2):
        x = x.contiguous()
    rows, k = x.shape
    n = weights.shape[0] * 16
    _checked_out(out, rows, n)
    _k.linear_lanes(x.data_ptr(), x.stride(0), fp32, kind, weights.data_ptr(), _ptr(bias), out.data_ptr(),
                    out.stride(0), out.dtype == torch.bfloat16, rows, n, k)
    return out


# -- a MoE layer's routed experts (csrc/moe.c) -----------------------------------------------------

def moe_experts(x: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool, expert_slots: torch.Tensor,
                replica_count: torch.Tensor, expert_load: torch.Tensor | None, w13: torch.Tensor, w2: torch.Tensor,
                kind13: int, kind2: int, inter: int, lanes: bool) -> torch.Tensor:
    """A MoE layer's routed experts in one call -> fp32 [T, hidden]: x bf16 [T, hidden]; logits bf16 or fp32
    [T, experts] (softmax, top_k, renormalised where asked); expert_slots int64 [experts, max_replicas] and
    replica_count int64 [experts] (EPLB's tables: an expert's pairs dealt round-robin over its slots);
    expert_load int64 [experts] += pairs per expert (None: not counted); w13, w2 int64 [slots]: each slot's
    [gate | up] records (kind13, [2 inter, hidden]) and down records (kind2) by address, 0 for an empty slot,
    glu tiles and tiles, or with lanes both in lane order. The tables are read when the call runs, so a CPU
    graph replays a placement EPLB changed."""
    if x.stride(1) != 1 or x.stride(0) % 2:
        x = x.contiguous()
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    t, hidden = x.shape
    out = torch.empty(t, hidden, dtype=torch.float32)
    _k.moe_experts(x.data_ptr(), x.stride(0), logits.data_ptr(), logits.stride(0), logits.dtype == torch.bfloat16, t,
                   hidden, inter, logits.shape[1], top_k, renormalize, expert_slots.data_ptr(), expert_slots.shape[1],
                   replica_count.data_ptr(), _ptr(expert_load), w13.shape[0], w13.data_ptr(), w2.data_ptr(), kind13,
                   kind2, 2 if lanes else int(bool(_AMX)), out.data_ptr(), hidden)  # csrc/moe.c's RTP_MOE_*
    return out


def add_sigmoid_gated_supported(out: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> bool:
    return (_HAS["add_sigmoid_gated"] and out.dtype == torch.float32 and y.dtype == torch.bfloat16
            and gate.dtype in (torch.bfloat16, torch.float32) and out.dim() == y.dim() == gate.dim() == 2
            and gate.shape[1] == 1 and out.shape == y.shape and gate.shape[0] == out.shape[0]
            and out.stride(1) == y.stride(1) == 1)


def add_sigmoid_gated(out: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """In place: out fp32 [T, H] += sigmoid(gate [T, 1]) * y bf16 [T, H] (a shared expert's gated output
    onto the routed experts' sum); returns out."""
    t, h = out.shape
    _k.add_sigmoid_gated(out.data_ptr(), out.stride(0), gate.data_ptr(), gate.dtype == torch.bfloat16, gate.stride(0),
                         y.data_ptr(), y.stride(0), t, h)
    return out


# -- residual add + RMSNorm -----------------------------------------------------------------------

def norm_supported(residual: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_HAS["add_rms_norm"] and residual.device.type == "cpu" and residual.dtype == torch.float32
            and weight.dtype in (torch.float32, torch.bfloat16) and residual.dim() == 2 and residual.stride(1) == 1
            and residual.shape[1] % 16 == 0)


@_op("add_rms_norm", ("residual",),
     lambda residual, delta, weight, eps, out_dtype: torch.empty_like(residual, dtype=out_dtype))
def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """residual (fp32, updated in place) += delta; returns rmsnorm(residual) * weight in out_dtype."""
    t, h = residual.shape
    out = torch.empty(t, h, dtype=out_dtype)
    if delta is not None:
        delta = delta.contiguous()
    _k.add_rms_norm(residual.data_ptr(), residual.stride(0), _ptr(delta),
                    delta is not None and delta.dtype == torch.bfloat16, h, weight.data_ptr(),
                    weight.dtype == torch.bfloat16, eps,
                    out.data_ptr(), out_dtype == torch.bfloat16, h, t, h)
    return out


# -- embedding lookup and the MLP's activation -------------------------------------------------

def embed_supported(ids: torch.Tensor, table: torch.Tensor) -> bool:
    return (_HAS["embed_rows"] and table.device.type == "cpu" and table.dtype in (torch.float32, torch.bfloat16)
            and table.dim() == 2 and table.stride(1) == 1 and ids.dtype == torch.int32 and ids.dim() == 1)


@_op("embed_rows", (), lambda ids, table, scale=1.0: table.new_empty(ids.shape[0], table.shape[1],
                                                                     dtype=torch.float32))
def embed_rows(ids: torch.Tensor, table: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """table[ids] in fp32 (the residual stream's dtype), [T, H]; with a scale, (table[ids] * scale) in the
    table's dtype first, as torch multiplies the rows by a scalar (Gemma's embeddings)."""
    ids = ids.contiguous()
    t, h = ids.shape[0], table.shape[1]
    out = torch.empty(t, h, dtype=torch.float32)
    _k.embed_rows(table.data_ptr(), table.dtype == torch.bfloat16, table.stride(0), ids.data_ptr(),
                  out.data_ptr(), h, t, h, scale)
    return out


def silu_mul_supported(x: torch.Tensor) -> bool:
    return (_HAS["silu_mul"] and x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.dim() == 2
            and x.stride(1) == 1 and x.shape[1] % 32 == 0)


@_op("silu_mul", (), lambda x: x.new_empty(x.shape[0], x.shape[1] // 2))
def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] bf16 [T, 2I] -> [T, I] bf16 (fp32 inside, one rounding)."""
    t, i = x.shape[0], x.shape[1] // 2
    out = torch.empty(t, i, dtype=torch.bfloat16)
    _k.silu_mul(x.data_ptr(), x.stride(0), out.data_ptr(), i, t, i)
    return out


# -- beyond the Llama topology (csrc/norm.c, csrc/activation.c): Gemma's norms, GeGLU, softcapping --

def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_HAS["rms_norm"] and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2
            and x.stride(1) == 1 and weight.dtype in (torch.float32, torch.bfloat16) and weight.is_contiguous()
            and tuple(weight.shape) == (x.shape[1],))


@_op("rms_norm", (), lambda x, weight, eps: x.new_empty(x.shape))
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x) * weight over each row of x [T, H] (bf16 or fp32) -> [T, H] in x's dtype, as RMSNorm's
    forward (fp32 inside, one rounding)."""
    t, h = x.shape
    out = torch.empty(t, h, dtype=x.dtype)
    _k.rms_norm(x.data_ptr(), x.stride(0), x.dtype == torch.bfloat16, weight.data_ptr(),
                weight.dtype == torch.bfloat16, eps, out.data_ptr(), h, out.dtype == torch.bfloat16, t, h)
    return out


def qk_norm_supported(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, heads: int,
                      kv_heads: int) -> bool:
    d = q_weight.shape[0]
    return (_HAS["qk_rms_norm"] and qkv.device.type == "cpu" and qkv.dtype == torch.bfloat16 and qkv.dim() == 2
            and qkv.stride(1) == 1 and qkv.shape[1] >= (heads + kv_heads) * d
            and q_weight.dtype == k_weight.dtype and q_weight.dtype in (torch.float32, torch.bfloat16)
            and q_weight.dim() == 1 and q_weight.shape == k_weight.shape
            and q_weight.is_contiguous() and k_weight.is_contiguous())


@_op("qk_rms_norm", ("qkv",), lambda qkv, q_weight, k_weight, heads, kv_heads, eps: None)
def qk_rms_norm(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, heads: int, kv_heads: int,
                eps: float) -> None:
    """In place over a fused qkv output [T, (H + 2 Hkv) D] bf16: each of its `heads` q heads normed with
    q_weight [D], each of its `kv_heads` k heads with k_weight (q/k norm before RoPE); v untouched."""
    d = q_weight.shape[0]
    _k.qk_rms_norm(qkv.data_ptr(), qkv.stride(0), q_weight.data_ptr(), k_weight.data_ptr(),
                   q_weight.dtype == torch.bfloat16, eps, qkv.shape[0], heads, kv_heads, d)


def gelu_tanh_mul_supported(x: torch.Tensor) -> bool:
    return (_HAS["gelu_tanh_mul"] and x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.dim() == 2
            and x.stride(1) == 1 and x.shape[1] % 2 == 0)


@_op("gelu_tanh_mul", (), lambda x: x.new_empty(x.shape[0], x.shape[1] // 2))
def gelu_tanh_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up for x = [gate | up] bf16 [T, 2I] -> [T, I] bf16 (fp32 inside,
    one rounding): Gemma's GeGLU."""
    t, i = x.shape[0], x.shape[1] // 2
    out = torch.empty(t, i, dtype=torch.bfloat16)
    _k.gelu_tanh_mul(x.data_ptr(), x.stride(0), out.data_ptr(), i, t, i)
    return out


def softcap_supported(x: torch.Tensor) -> bool:
    return (_HAS["softcap"] and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and x.stride(1) == 1)


@_op("softcap", ("x",), lambda x, cap: None)
def softcap(x: torch.Tensor, cap: float) -> None:
    """In place: x = cap * tanh(x / cap) over logits x fp32 [T, N] (rows contiguous), as torch's
    tanh(x / cap) * cap (Gemma's final_logit_softcapping)."""
    _k.softcap(x.data_ptr(), x.stride(0), cap, x.shape[0], x.shape[1])


# -- greedy sampling ------------------------------------------------------------------------------

def argmax_supported(x: torch.Tensor) -> bool:
    """Whether argmax_rows takes x: CPU fp32 [T, N], N >= 1, rows contiguous."""
    return (_AVAILABLE and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and x.shape[1] > 0 and x.stride(1) == 1)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """int64 [T]: each row's argmax of x fp32 [T, N] (last dim contiguous): the first index of
    the maximum, or of the first NaN, as NumPy's argmax."""
    if not argmax_supported(x):
        raise ValueError(f"argmax_rows takes a CPU fp32 [T, N] tensor (N >= 1) with contiguous rows, got "
                         f"{x.dtype} {tuple(x.shape)}")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _k.argmax_rows(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    return out


def stream_read(buf: torch.Tensor) -> int:
    """Read buf (contiguous, 64-byte aligned, a multiple of 256 bytes) once on every thread: a
    streaming read for measuring memory bandwidth (tools/bench_roofline.py)."""
    nbytes = buf.numel() * buf.element_size()
    if not buf.is_contiguous() or buf.data_ptr() % 64 or nbytes % 256:
        raise ValueError("stream_read takes a contiguous, 64-byte aligned buffer of a multiple of 256 bytes")
    return _k.stream_read(buf.data_ptr(), nbytes)


# -- structured outputs: a token bitmask over logits rows ------------------------------------------

def apply_token_bitmask(x: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: x[rows[i], j] = -inf wherever bit j % 32 of mask[i, j // 32] is 0 (x fp32 [T, N],
    mask int32 [R, ceil(N / 32)], rows int64 [R]; the layout llguidance and xgrammar fill). rtp's
    kernel wherever rtp's kernels run (AVX2 and up); torch elsewhere."""
    n = x.shape[1]
    if (_AVAILABLE and x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(1) == 1
            and mask.dtype == torch.int32 and mask.stride(1) == 1 and mask.shape[1] * 32 >= n
            and rows.dtype == torch.int64 and rows.is_contiguous() and mask.shape[0] >= rows.shape[0]):
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= x.shape[0]):
            raise IndexError(f"bitmask rows {rows.tolist()} outside the {x.shape[0]} rows of the logits")
        _k.apply_token_bitmask(x.data_ptr(), x.stride(0), mask.data_ptr(), mask.stride(0), rows.data_ptr(),
                               rows.shape[0], n)
        return
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    m = mask[: rows.shape[0]].to(x.device)
    allowed = ((m.unsqueeze(-1) >> shifts) & 1).reshape(m.shape[0], -1)[:, :n].bool()
    x[rows] = x[rows].masked_fill(~allowed, float("-inf"))


# -- RoPE + KV cache write ------------------------------------------------------------------------

def rope_supported(qkv: torch.Tensor, kv_cache: torch.Tensor, cos_sin: torch.Tensor,
                   positions: torch.Tensor, head_dim: int) -> bool:
    """Whether rope_store_kv (bf16 cache) or rope_store_kv_int8 (int8 cache) takes these operands."""
    rot = cos_sin.shape[1]
    return (_HAS["rope_store_kv"] and qkv.device.type == "cpu" and qkv.dtype == torch.bfloat16
            and (kv_cache.dtype == torch.bfloat16 or kv_cache.dtype == torch.int8 and head_dim % 16 == 0
                 and head_dim <= 256)
            and cos_sin.dtype == torch.float32
            and positions.dtype == torch.int32 and qkv.stride(1) == 1 and (rot // 2) % 16 == 0
            and rot <= head_dim and kv_cache.is_contiguous())


@_op("rope_store_kv", ("kv_cache",),
     lambda qkv, positions, cos_sin, kv_cache, slot_mapping, heads, kv_heads:
     qkv.new_empty(qkv.shape[0], heads, kv_cache.shape[-1]))
def rope_store_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """Rotate the q and k parts of qkv [T, (H + 2 Hkv) D] bf16; returns q [T, H, D]; writes k and v
    into kv_cache [2, blocks, block_size, Hkv, D] at slot_mapping (int64). The kernel reads T
    slots and T positions as they lie in memory (a shorter or int32 slot_mapping would send K/V
    to wrong addresses), and writes no slot outside the cache (IndexError)."""
    return _rope_store_kv(qkv, positions, cos_sin, kv_cache, None, slot_mapping, heads, kv_heads)


@_op("rope_store_kv_int8", ("kv_cache", "kv_scales"),
     lambda qkv, positions, cos_sin, kv_cache, kv_scales, slot_mapping, heads, kv_heads:
     qkv.new_empty(qkv.shape[0], heads, kv_cache.shape[-1]))
def rope_store_kv_int8(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                       kv_scales: torch.Tensor, slot_mapping: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """rope_store_kv into an int8 cache [2, blocks, block_size, Hkv, D] and its fp32 scales [2, blocks,
    block_size, Hkv]: each token's K (rotated, rounded to bf16) and V row of a kv head as int8 with
    one scale, symmetric absmax / 127 (rtp.models.attention.quantize_kv, the same numbers). Where
    rtp.models.attention.rotates_kv(D), K is quantized times the normalized Hadamard matrix
    (rtp.models.attention.hadamard, in fp32) and the returned q is rotated alike, rounded to bf16."""
    if kv_scales.dtype != torch.float32 or not kv_scales.is_contiguous() or kv_scales.shape != kv_cache.shape[:-1]:
        raise ValueError(f"rope_store_kv_int8: the scales must be contiguous fp32 {tuple(kv_cache.shape[:-1])}")
    return _rope_store_kv(qkv, positions, cos_sin, kv_cache, kv_scales, slot_mapping, heads, kv_heads)


def _rope_store_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                   kv_scales: torch.Tensor | None, slot_mapping: torch.Tensor, heads: int,
                   kv_heads: int) -> torch.Tensor:
    t = qkv.shape[0]
    d = kv_cache.shape[-1]
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape[0] < t or positions.shape[0] < t:
        raise ValueError(f"rope_store_kv: {t} tokens need int64 slot_mapping and positions of {t}, got "
                         f"{slot_mapping.dtype} [{slot_mapping.shape[0]}] and [{positions.shape[0]}]")
    q = torch.empty(t, heads, d, dtype=qkv.dtype)
    slots = slot_mapping.contiguous()
    pos = positions.contiguous()
    scales = (0, 0) if kv_scales is None else (kv_scales[0].data_ptr(), kv_scales[1].data_ptr())
    _k.rope_store_kv(qkv.data_ptr(), qkv.stride(0), pos.data_ptr(), cos_sin.data_ptr(), cos_sin.shape[1],
                     q.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), kv_heads * d,
                     slots.data_ptr(), t, heads, kv_heads, d, kv_cache.shape[1] * kv_cache.shape[2], *scales)
    return q


# -- decode attention over the paged cache (rtp/kernels/csrc/attention/decode_attention.c) -----------

def attention_supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether paged_decode_attention (bf16 cache) or paged_decode_attention_int8 (int8 cache, bf16 q)
    takes these operands."""
    d = q.shape[-1]
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    return (_HAS["decode_attention"] and q.device.type == "cpu"
            and (k_cache.dtype == torch.bfloat16 or k_cache.dtype == torch.int8 and q.dtype == torch.bfloat16)
            and d % 32 == 0 and d <= 256 and heads % kv_heads == 0 and heads // kv_heads <= 16
            and k_cache.stride(-1) == 1 and k_cache.stride(-2) == d)


@_op("paged_decode_attention", (),
     lambda q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap=0.0: torch.empty_like(q))
def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           window: int, softcap: float = 0.0) -> torch.Tensor:
    """q [B, H, D] bf16 over k/v_cache [blocks, block_size, Hkv, D] bf16 -> [B, H, D] bf16.
    window 0: no sliding window. softcap > 0: scores -> softcap * tanh(scores / softcap) before the
    softmax (Gemma 2's attention logit softcapping); 0: none."""
    return paged_decode_attention_into(q, k_cache, v_cache, block_tables, seq_lens, scale, window,
                                       torch.empty_like(q.contiguous()), softcap=softcap)


@_op("paged_decode_attention_int8", (),
     lambda q, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, scale, window, softcap=0.0:
     torch.empty_like(q))
def paged_decode_attention_int8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                k_scales: torch.Tensor, v_scales: torch.Tensor, block_tables: torch.Tensor,
                                seq_lens: torch.Tensor, scale: float, window: int, softcap: float = 0.0) -> torch.Tensor:
    """paged_decode_attention over int8 k/v_cache [blocks, block_size, Hkv, D] with their fp32 scales
    [blocks, block_size, Hkv] (row = scale * q): scores and value sums on the int8 values, each key's
    scale applied once to its score and each value's to its probability. softcap as paged_decode_attention's."""
    return paged_decode_attention_into(q, k_cache, v_cache, block_tables, seq_lens, scale, window,
                                       torch.empty_like(q.contiguous()), k_scales, v_scales, softcap)


def _scale_ptrs(k_cache: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None) -> tuple[int, int]:
    """The scales' addresses for the kernels (0, 0 for a bf16 cache), checked against the int8 cache."""
    if k_cache.dtype != torch.int8:
        return 0, 0
    for s in (k_scales, v_scales):
        if (s is None or s.dtype != torch.float32 or s.shape != k_cache.shape[:-1] or not s.is_contiguous()
                or k_cache.stride(1) != k_cache.shape[2] * k_cache.shape[3]):
            raise ValueError(f"an int8 KV cache {tuple(k_cache.shape)} needs contiguous fp32 scales "
                             f"{tuple(k_cache.shape[:-1])} for K and V")
    return k_scales.data_ptr(), v_scales.data_ptr()


def paged_decode_attention_into(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int,
                                out: torch.Tensor, k_scales: torch.Tensor | None = None,
                                v_scales: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """paged_decode_attention (int8 caches: with their scales) written into out ([B, H, D] bf16,
    contiguous: the decode rows of a step's attention output, which the prefill kernel fills after
    them); returns out."""
    q = q.contiguous()
    b, h, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    lens = seq_lens.contiguous()
    if not out.is_contiguous() or out.shape != q.shape or out.dtype != torch.bfloat16:
        raise ValueError("paged_decode_attention_into writes a contiguous bf16 tensor of q's shape")
    _k.decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                   k_cache.stride(1), tables.data_ptr(), tables.stride(0),
                                   lens.data_ptr(), out.data_ptr(), b, h, hkv, d, block_size,
                                   scale, window, *_scale_ptrs(k_cache, k_scales, v_scales), softcap)
    return out


# -- kernel calls as data (rtp/kernels/cpu_graph.py) ------------------------------------------------

CALL_WORDS = ops.CALL_WORDS


def record_start(dry: bool = False) -> None:
    """Record every kernel call from now on (they still run), until record_stop(). dry: each call runs
    over at most 2 of its rows, enough to check it, so recording a large forward costs little; what
    the forward computes is then not its result (a capture's first replay computes it)."""
    _k.record_start(dry)


def record_peek():
    """The calls recorded so far (array('q')), recording on."""
    return _k.record_peek()


def record_stop():
    """The calls since record_start(): array('q'), CALL_WORDS int64 words per call."""
    return _k.record_stop()


# what a call's words mean, from the op table (the compiled kernel_calls.c reads the same table)
address_words = ops.address_words
op_name = ops.op_name
rows_word = ops.rows_word


# what a step graph's call counts its rows in; the last two: its sampling calls captured both ways, the
# ones that run for several samples and the ones that run for one (cpu_graph.capture's one_sample)
(COUNT_AS_RECORDED, COUNT_TOKENS, COUNT_SAMPLES, _COUNT_DECODE_ROWS, _COUNT_PREFILL_ROWS, SEVERAL_SAMPLES,
 ONE_SAMPLE) = (getattr(_k, n, i) if _AVAILABLE else i for i, n in enumerate(
    ("COUNT_AS_RECORDED", "COUNT_TOKENS", "COUNT_SAMPLES", "COUNT_DECODE_ROWS", "COUNT_PREFILL_ROWS",
     "SEVERAL_SAMPLES", "ONE_SAMPLE")))


def run_step_calls(calls, classes, tokens: int, samples: int, decode_rows: int, prefill_rows: int,
                   times=None) -> None:
    """Run a step graph's calls (numpy int64 [n, CALL_WORDS]; classes int8 [n], each call's COUNT_*)
    over a step of `tokens` tokens, `samples` sampling rows, `decode_rows` decode rows and then
    `prefill_rows` prompt chunks; times as run_calls'."""
    if classes.dtype != np.int8 or classes.shape != (calls.shape[0],) or not classes.flags.c_contiguous:
        raise ValueError("classes must be a contiguous int8 array, one per call")
    _k.run_step_calls(calls.ctypes.data, calls.shape[0], classes.ctypes.data, tokens, samples, decode_rows,
                      prefill_rows, 0 if times is None else times.ctypes.data)


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] for x [T, C] (rows contiguous) and index int32 [n] (one rtp kernel call, so that a
    captured step graph gathers its sampling rows too)."""
    if x.dim() != 2 or x.stride(1) != 1 or index.dtype != torch.int32 or not index.is_contiguous():
        raise ValueError("gather_rows takes x [T, C] with contiguous rows and a contiguous int32 index")
    out = torch.empty(index.shape[0], x.shape[1], dtype=x.dtype)
    size = x.element_size()
    _k.gather_rows(x.data_ptr(), x.stride(0) * size, index.data_ptr(), index.shape[0], out.data_ptr(),
                   x.shape[1] * size, x.shape[1] * size)
    return out


def run_calls(calls, rows: int, times=None) -> None:
    """Run recorded calls (numpy int64 [n, CALL_WORDS], C-contiguous) over `rows` rows; times, a
    C-contiguous numpy int64 [n], receives each call's wall time in nanoseconds."""
    if times is not None and (times.dtype != np.int64 or times.shape != (calls.shape[0],)
                              or not times.flags.c_contiguous):
        raise ValueError(f"times must be a contiguous int64 array of {calls.shape[0]} (one per call)")
    _k.run_calls(calls.ctypes.data, calls.shape[0], rows, 0 if times is None else times.ctypes.data)


# -- prefill attention over the paged cache (rtp/kernels/csrc/attention/prefill_attention.c) ---------------

# RTP_PREFILL_ATTENTION=0 keeps prefill on torch's SDPA (to compare the two); decided at import.
_PREFILL = _HAS["prefill_attention"] and os.environ.get("RTP_PREFILL_ATTENTION", "1") != "0"


def prefill_attention_supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether prefill_attention takes these operands: bf16 q [T, H, D] and a bf16 or int8 cache, D a
    multiple of 32 up to 256, at most 16 query heads per kv head."""
    d = q.shape[-1]
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    return (_PREFILL and q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.dim() == 3
            and k_cache.dtype in (torch.bfloat16, torch.int8) and d % 32 == 0 and d <= 256 and heads % kv_heads == 0
            and heads // kv_heads <= 16 and k_cache.stride(-1) == 1 and k_cache.stride(-2) == d)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor, first_row: int, rows: int, scale: float,
                      window: int, out: torch.Tensor | None = None, amx: bool | None = None,
                      k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
                      softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of a step plan's prompt chunks over the paged cache: rows [first_row, first_row +
    rows) of the plan's arrays (int32; query_start_loc [R + 1], seq_lens [R], block_tables [R, W] with
    rows contiguous), each row's query tokens [qsl[r], qsl[r + 1]) of q [T, H, D] bf16, attending to its
    seq_lens[r] keys (the chunk's own included, already in the cache). Writes those rows of out ([T, H,
    D] bf16, allocated when None) and returns it. window 0: no sliding window. amx None: the tiles
    where this CPU has them. An int8 cache comes with its fp32 scales [blocks, block_size, Hkv] (its
    K/V rows are dequantized to bf16 as the kernel packs them). softcap > 0: scores -> softcap * tanh(scores /
    softcap) before the mask (Gemma 2); 0: none."""
    q = q.contiguous()
    t, h, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    if out is None:
        out = torch.empty_like(q)
    for a in (query_start_loc, seq_lens, block_tables):
        if a.dtype != torch.int32 or a.stride(-1) != 1:
            raise ValueError("prefill_attention takes the plan's int32 arrays with contiguous rows")
    if not (0 <= first_row and first_row + rows <= seq_lens.shape[0] and query_start_loc.shape[0] > first_row + rows
            and block_tables.shape[0] >= first_row + rows):
        raise ValueError(f"rows [{first_row}, {first_row + rows}) lie outside the plan's arrays")
    _k.prefill_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(1),
                              query_start_loc.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(),
                              block_tables.stride(0), first_row, rows, out.data_ptr(), h, hkv, d, block_size, scale,
                              window, _AMX if amx is None else amx and _AMX, *_scale_ptrs(k_cache, k_scales, v_scales),
                              softcap)
    return out
