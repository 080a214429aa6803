"""CPU graphs: a decode step's kernel calls, captured once and replayed from C.

On a CPU with rtp's kernels (rtp/kernels/cpu_kernels.py) every op of a decode step
over GGUF weights is one C kernel: embedding, add + RMSNorm, the quantized
linears, RoPE + KV write, paged attention, SiLU-and-mul, the LM head. Run eagerly,
the Python between those ~300 calls costs 4-6 ms a step, a quarter of a one-row
step. torch.compile removes Python but calls custom ops through the dispatcher,
which costs more than it saves here (docs/benchmarks.md, "Offline generation"). So rtp does on the CPU
what CUDA graphs do on a GPU:

  capture   run the model's forward once over static input buffers while
            rtp/kernels/_cpu_kernels.pyx records every kernel call as data (addresses,
            sizes, flags: rtp/kernels/csrc/kernel_calls.c), under a dispatch mode that
            refuses any torch op that computes (it would be missing from the
            replay) and keeps every buffer the forward allocates alive;
  plan      give those intermediate buffers one arena, reusing memory between
            buffers whose lifetimes (first to last call touching them) do not
            overlap, and rewrite the recorded addresses into it, so a replay's
            working set stays in cache as the eager run's freed-and-reused
            allocations did;
  replay    one C call runs the whole step; the output (the logits) is the same
            tensor every time.

Every kernel treats rows independently, so calls recorded over R rows replay over
any r <= R rows (the row-count word of each call is overwritten). The caller
captures at a few sizes and keeps one graph per run of sizes whose calls agree;
a size whose forward leaves rtp's kernels (bf16 weights on oneDNN, a model
feature without a kernel) gets no graph and runs eagerly.

A graph holds raw addresses of the weights, the KV cache and the static inputs:
it is valid while they are, which the model runner that owns all three ensures.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rtp.kernels import cpu_kernels

aten = torch.ops.aten

# Ops a captured forward may run: allocations (the kernels' outputs) and views.
_ALLOCATIONS = {aten.empty, aten.empty_strided, aten.new_empty, aten.empty_like}
_VIEWS = {aten.view, aten._unsafe_view, aten.slice, aten.select, aten.split, aten.split_with_sizes,
          aten.t, aten.transpose, aten.permute, aten.unsqueeze, aten.squeeze, aten.alias, aten.detach,
          aten.as_strided, aten.expand, aten.unbind}
# Ops that are views when nothing needs converting or copying (checked on their result).
_NO_OPS_WHEN_ALIASED = {aten.to, aten.contiguous, aten.reshape, aten.type_as}
_ALIGN = 64


class CaptureRefused(RuntimeError):
    """The forward ran something a replay could not: a torch op outside rtp's kernels."""


class _CaptureMode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in dynamo.disable unless this says no, and its first
        # call imports torch._dynamo: 1.2-1.9 s of every process's start. Nothing is compiled inside a
        # capture (CPU graphs are off under --compile), so there is nothing for it to disable.
        return False

    def __init__(self):
        super().__init__()
        self.allocations: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        aliased = packet in _NO_OPS_WHEN_ALIASED
        if packet not in _ALLOCATIONS and packet not in _VIEWS and not aliased:
            raise CaptureRefused(f"{func} runs outside rtp's CPU kernels")
        out = func(*args, **(kwargs or {}))
        if aliased and not (isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor)
                            and out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()):
            raise CaptureRefused(f"{func} copies outside rtp's CPU kernels")
        if packet in _ALLOCATIONS:
            self.allocations.append(out)  # alive until planned: no address is reused mid-capture
        return out


class CPUGraph:
    """Recorded kernel calls over an arena of their own; replay(rows) reruns them. A step graph
    (capture(..., samples_from=k)) replays any step instead, replay_step(...)."""

    def __init__(self, calls: np.ndarray, rows: int, arena: torch.Tensor, output: torch.Tensor,
                 classes: np.ndarray | None = None, one_sample_output: torch.Tensor | None = None):
        self.calls = calls           # int64 [n, CALL_WORDS], contiguous
        self.rows = rows             # rows at capture: the most a replay takes
        self.arena = arena           # the intermediates' memory (addresses in calls point here)
        self.output = output
        self.classes = classes       # step graphs: int8 [n], what each call counts its rows in
        self.one_sample_output = one_sample_output  # step graphs captured with one_sample: its output

    def replay(self, rows: int) -> torch.Tensor:
        """Rerun the step over the first `rows` rows of its inputs; returns output[:rows]."""
        self._check_rows(rows)
        cpu_kernels.run_calls(self.calls, rows)
        return self.output[:rows]

    def profile(self, rows: int) -> np.ndarray:
        """replay(rows), timed: each call's wall time in nanoseconds (int64 [n])."""
        self._check_rows(rows)
        times = np.zeros(len(self.calls), dtype=np.int64)
        cpu_kernels.run_calls(self.calls, rows, times)
        return times

    def replay_step(self, tokens: int, samples: int, decode_rows: int, prefill_rows: int,
                    times: np.ndarray | None = None) -> torch.Tensor:
        """Rerun a step graph over a step of `tokens` tokens whose first `decode_rows` rows decode and
        whose next `prefill_rows` rows are prompt chunks, `samples` of them sampling; returns
        output[:samples]."""
        if self.classes is None:
            raise ValueError("replay_step replays step graphs (captured with samples_from)")
        self._check_rows(tokens)
        cpu_kernels.run_step_calls(self.calls, self.classes, tokens, samples, decode_rows, prefill_rows, times)
        if samples == 1 and self.one_sample_output is not None:
            return self.one_sample_output
        return self.output[:samples]

    def _check_rows(self, rows: int) -> None:
        if not 0 < rows <= self.rows:
            raise ValueError(f"a graph captured over {self.rows} rows cannot replay {rows}")

    def signature(self) -> list[tuple]:
        """The calls without their addresses and row counts: equal for two captures exactly when
        they ran the same kernels with the same shapes and flags."""
        return [_call_signature(c) for c in self.calls]


def capture(forward: Callable[[], torch.Tensor], rows: int,
            samples: Callable[[torch.Tensor], torch.Tensor] | None = None,
            one_sample: Callable[[torch.Tensor], torch.Tensor] | None = None, dry: bool = False) -> CPUGraph:
    """Capture forward() (over `rows` rows of static inputs; it returns one tensor) as a CPUGraph.
    With `samples`, a step graph: forward() returns the hidden states of every token, samples(hidden)
    the logits of the rows that sample; the calls of the first count their rows in tokens, those of
    the second in samples (replay_step). With `one_sample` too, one_sample(hidden) is captured beside
    samples(hidden), and a replay of one sampling row runs it instead: a batch of one row takes other
    kernels than a batch of several (the one-row kernels), and a replay gives what an eager step gives.
    dry: the kernels run over at most 2 rows while recorded (cpu_kernels.record_start), for a forward
    whose work would cost much and whose result is not wanted. Raises CaptureRefused when the forward
    leaves rtp's kernels."""
    mode = _CaptureMode()
    cpu_kernels.record_start(dry)
    split = one = -1
    one_output = None
    try:
        with mode:
            hidden = output = forward()
            if samples is not None:
                split = len(cpu_kernels.record_peek()) // cpu_kernels.CALL_WORDS
                output = samples(hidden)
                if one_sample is not None:
                    one = len(cpu_kernels.record_peek()) // cpu_kernels.CALL_WORDS
                    one_output = one_sample(hidden)
    finally:
        recorded = cpu_kernels.record_stop()
    calls = np.frombuffer(recorded, dtype=np.int64).reshape(-1, cpu_kernels.CALL_WORDS).copy()
    if not len(calls):
        raise CaptureRefused("the forward made no kernel call")
    classes = None
    if samples is not None:
        classes = np.full(len(calls), cpu_kernels.COUNT_TOKENS, dtype=np.int8)
        classes[split:] = cpu_kernels.COUNT_SAMPLES
        if one_output is not None:
            classes[split:one] = cpu_kernels.SEVERAL_SAMPLES
            classes[one:] = cpu_kernels.ONE_SAMPLE
    outputs = {t.untyped_storage().data_ptr() for t in (output, one_output) if t is not None}
    buffers = sorted({(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                      for t in mode.allocations if t.untyped_storage().data_ptr() not in outputs
                      and t.untyped_storage().nbytes()})
    arena = _relocate(calls, buffers)
    return CPUGraph(calls, rows, arena, output, classes, one_output)


def _call_signature(call: np.ndarray) -> tuple:
    op = int(call[0])
    skip = cpu_kernels.address_words(op) | (1 << cpu_kernels.rows_word(op))
    return tuple(int(w) for i, w in enumerate(call) if not skip >> i & 1)


def _relocate(calls: np.ndarray, buffers: list[tuple[int, int]]) -> torch.Tensor:
    """Move the buffers (start, nbytes; sorted, disjoint) into one arena, sharing memory between
    buffers not live at the same time; rewrites calls in place. Returns the arena."""
    starts = [b[0] for b in buffers]
    first = [-1] * len(buffers)
    last = [-1] * len(buffers)
    refs = []  # (call, word, buffer, offset in buffer)
    for i, call in enumerate(calls):
        mask = cpu_kernels.address_words(int(call[0]))
        for w in range(cpu_kernels.CALL_WORDS):
            if not mask >> w & 1 or call[w] == 0:
                continue
            b = bisect.bisect_right(starts, int(call[w])) - 1
            if b < 0 or int(call[w]) >= buffers[b][0] + buffers[b][1]:
                continue  # weights, the KV cache, static inputs, the output: not ours to move
            refs.append((i, w, b, int(call[w]) - buffers[b][0]))
            first[b] = i if first[b] < 0 else first[b]
            last[b] = i
    sizes = [-(-nbytes // _ALIGN) * _ALIGN for _, nbytes in buffers]
    offsets = _place(list(zip(sizes, first, last)))
    size = max((o + sizes[b] for b, o in enumerate(offsets) if o >= 0), default=0)
    arena = torch.empty(size + _ALIGN, dtype=torch.uint8)
    base = -(-arena.data_ptr() // _ALIGN) * _ALIGN
    for i, w, b, within in refs:
        calls[i, w] = base + offsets[b] + within
    return arena


def _place(blocks: list[tuple[int, int, int]]) -> list[int]:
    """Offsets for blocks (size, first use, last use; first -1: unused, offset -1) such that two
    blocks live at once never overlap: largest first, each at the lowest offset that fits."""
    offsets = [-1] * len(blocks)
    placed: list[int] = []
    for b in sorted((b for b in range(len(blocks)) if blocks[b][1] >= 0), key=lambda b: -blocks[b][0]):
        size, lo, hi = blocks[b]
        busy = sorted((offsets[p], offsets[p] + blocks[p][0]) for p in placed
                      if blocks[p][1] <= hi and lo <= blocks[p][2])
        at = 0
        for start, end in busy:
            if at + size <= start:
                break
            at = max(at, end)
        offsets[b] = at
        placed.append(b)
    return offsets
