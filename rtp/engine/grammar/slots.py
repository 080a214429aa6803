"""GrammarSlots: one matcher per constrained request, by its runtime slot.

Each step fills one token bitmask for the rows that need it (one call, rows in parallel, on a
thread beside the forward), the sampler applies it to the logits in place, and the sampled tokens
advance the matchers (one call again). A matcher that can take no more tokens ends its request
with "stop". A matcher that fails (a branch of the grammar that leads nowhere, a limit of the
parser) fails its request alone, as the grammar's fault: an InvalidRequest naming
structured_outputs, a 400 where the answer has not started.

The bitmask is llguidance's (and xgrammar's) layout: int32 words, bit j of word w allows
token 32w + j; rtp/kernels/cpu_kernels.py apply_token_bitmask writes -inf where it is 0.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from rtp.errors import InvalidRequest, one_line


def _llguidance():
    import llguidance

    return llguidance


class GrammarSlots:
    """The matchers of the constrained requests, by runtime slot, and the step's token bitmask."""

    def __init__(self, num_slots: int, max_rows: int, vocab_size: int):
        self.vocab_size = vocab_size
        self.constrained = np.zeros(num_slots, dtype=bool)
        self.matchers: list = [None] * num_slots
        words = (vocab_size + 31) // 32
        # one row per sampling row a step can have; filled compactly: row i -> the i-th constrained row
        self.bitmask = torch.full((max_rows, words), -1, dtype=torch.int32)
        self._bitmask_np = self.bitmask.numpy()
        self._executor = None
        self._pool: ThreadPoolExecutor | None = None
        self._prefetched: tuple[np.ndarray, Future] | None = None
        # the grammar's work in the step, for /metrics: steps with constrained rows, their rows, and
        # the seconds spent filling masks and advancing matchers
        self.steps = self.rows = 0
        self.fill_seconds = self.advance_seconds = 0.0

    def set(self, slot: int, matcher) -> None:
        """The request admitted at `slot` runs under `matcher` (None: unconstrained)."""
        self.matchers[slot] = matcher
        self.constrained[slot] = matcher is not None

    def stats(self) -> dict:
        return {"steps": self.steps, "rows": self.rows, "fill_seconds": self.fill_seconds,
                "advance_seconds": self.advance_seconds}

    def executor(self):
        if self._executor is None:
            self._executor = _llguidance().LLExecutor()
        return self._executor

    def prefetch(self, slots: np.ndarray) -> None:
        """Start filling the step's masks on a thread of its own: the matchers have taken every
        token up to this step, so the masks need not wait for the logits (llguidance releases
        the GIL; the forward runs meanwhile). `fill` with the same slots collects them."""
        if not self.constrained[slots].any():
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="rtp-bitmask")
        kept = slots.copy()  # the plan's array is rewritten by the next schedule()
        self._prefetched = (kept, self._pool.submit(self._fill, kept))

    def fill(self, slots: np.ndarray) -> np.ndarray:
        """Fill the bitmask for the constrained rows among `slots` (one per sampling row); their
        row indices (mask row i belongs to logits row rows[i]). A matcher in error leaves its
        row all allowed: the token it then consumes fails the request (advance)."""
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None:
            rows = prefetched[1].result()
            if np.array_equal(prefetched[0], slots):
                return rows
        return self._fill(slots)

    def _fill(self, slots: np.ndarray) -> np.ndarray:
        rows = np.flatnonzero(self.constrained[slots])
        if rows.size:
            start = time.perf_counter()
            pairs = [(self.matchers[int(slots[r])], i) for i, r in enumerate(rows.tolist())]
            self.executor().unsafe_compute_mask_ptr(pairs, self._bitmask_np.ctypes.data,
                                                    self._bitmask_np.shape[1] * 4, len(pairs))
            self.fill_seconds += time.perf_counter() - start
            self.steps += 1
            self.rows += int(rows.size)
        return rows

    def advance(self, slots: np.ndarray, tokens: np.ndarray, skip: set[int]) -> tuple[dict[int, Exception], set[int]]:
        """Consume each constrained row's sampled token (rows in `skip` failed already). Returns the
        rows whose token the grammar refused, with why, and the rows whose grammar is complete."""
        rows = [r for r in np.flatnonzero(self.constrained[slots]).tolist() if r not in skip]
        if not rows:
            return {}, set()
        start = time.perf_counter()
        matchers = [self.matchers[int(slots[r])] for r in rows]
        ok = self.executor().consume_token_par([(m, int(tokens[r])) for m, r in zip(matchers, rows)])
        self.advance_seconds += time.perf_counter() - start
        failed, done = {}, set()
        for r, m, accepted in zip(rows, matchers, ok):
            if not accepted or m.is_error():
                failed[r] = grammar_failure(m)
            elif m.is_stopped():
                done.add(r)
        return failed, done


def grammar_failure(matcher) -> InvalidRequest:
    """A matcher that failed mid-request, as its request's error: the grammar's fault, one sentence.
    (The mask only lets through tokens the grammar takes, so a refused token means its state had
    already failed: a branch that leads nowhere, or a parser limit.)"""
    error = matcher.get_error() or "it refused the sampled token"
    if error.startswith("NoExtensionBias"):
        reason = "it reached a point no text can continue from (a rule that never ends)"
    else:
        reason = one_line(error)
    return InvalidRequest(f"the structured output cannot be continued: {reason}", "structured_outputs")
