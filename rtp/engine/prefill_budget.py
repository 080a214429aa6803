"""How many prompt tokens a step may take while other requests decode, sized per step.

A step that carries decoding requests makes every one of them wait for its prompt chunks: the
prompt tokens trade inter-token latency (ITL) of the running streams against time to first
token (TTFT) of the waiting ones. A fixed cap picks one point of that trade for every load;
this picks it per step from what the steps measurably cost on this machine:

  base     the prompt tokens that keep a step carrying decodes near `target_step_s`: (target -
           a decode step's time) / a prompt token's time, both running averages over the
           engine's own steps (a decode-only step's seconds; a mixed step's extra seconds per
           prompt token);
  ageing   the budget (at least the floor) doubles for every `target_step_s` the longest-waiting
           request has waited past one target, so a burst of arrivals is prefilled at full speed (its
           few long steps are a small share of all inter-token gaps) while steady traffic
           keeps steps near the target.

The result is clamped to [one KV block, `cap`] (cap: the step's token budget, or a fixed
--max-prefill-tokens-with-decodes); until a step of each kind was measured, the cap holds.
An engine component (rtp/engine/component.py): it sets the scheduler's budget before each plan
and learns from each step's time after it. O(1) a step, no allocation.
"""

from __future__ import annotations

import time

from rtp.engine.component import Component

_SMOOTHING = 0.2   # weight of the newest step in the running averages
_RING = 4096       # steps whose start times are kept (to age the waiting queue)


class PrefillBudget(Component):
    name = "prefill_budget"

    def __init__(self, target_step_s: float, cap: int, floor: int):
        self.target = target_step_s
        self.cap = cap
        self.floor = min(floor, cap)
        self.decode_s: float | None = None   # a step without prompt tokens
        self.token_s: float | None = None    # a prompt token's share of a step
        self._step_start = [0.0] * _RING     # monotonic time each step count began at
        self._oldest_ring_step = 0
        self.last = cap                      # the latest budget (for /metrics and tests)

    def before_schedule(self, core) -> None:
        s = core.scheduler
        s.max_prefill_tokens_with_decodes = self.budget(s.step_count, s.oldest_waiting_step)

    def after_step(self, step) -> None:
        plan = step.plan
        self.observe(step.seconds, plan.num_tokens - plan.num_decode_rows, plan.num_decode_rows)

    def stats(self) -> int:
        return self.last

    def budget(self, step: int, oldest_waiting_step: int, now: float | None = None) -> int:
        """The prompt tokens step number `step` may take beside its decodes."""
        now = time.monotonic() if now is None else now
        self._step_start[step % _RING] = now
        self._oldest_ring_step = max(self._oldest_ring_step, step - _RING + 1)
        if self.decode_s is None or self.token_s is None:
            self.last = self.cap
            return self.cap
        tokens = max(0.0, self.target - self.decode_s) / max(self.token_s, 1e-9)
        if oldest_waiting_step >= 0:
            # ageing grows the budget from at least the floor: where a decode step alone takes the
            # target (64 rows on a slow CPU), the base is 0, and doubling 0 kept every waiting
            # request at the floor for as long as the batch ran (P99 TTFT 16-23 s at concurrency 64)
            tokens = max(tokens, float(self.floor))
            since = self._step_start[max(oldest_waiting_step, self._oldest_ring_step) % _RING]
            waited = (now - since) / self.target - 1.0
            if waited > 0:
                tokens *= 2.0 ** min(waited, 30.0)
        self.last = int(min(self.cap, max(self.floor, tokens)))
        return self.last

    def observe(self, seconds: float, prompt_tokens: int, decode_rows: int) -> None:
        """What a step took: its wall time, its prompt tokens and its decode rows."""
        if prompt_tokens <= 0:
            if decode_rows > 0:
                self.decode_s = _average(self.decode_s, seconds)
            return
        base = self.decode_s if decode_rows > 0 and self.decode_s is not None else 0.0
        if decode_rows > 0 and self.decode_s is None:
            return  # no decode step measured yet: this one's split is unknown
        self.token_s = _average(self.token_s, max(seconds - base, 0.0) / prompt_tokens)


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + _SMOOTHING * (new - old)
