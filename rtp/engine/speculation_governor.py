"""Whether drafting pays at the batch size running now: measured on the engine's own steps.

Verifying d drafts costs d more rows in the target's step, and a draft model d forwards of its
own. With one request running, a step is bound by reading the weights and those rows are nearly
free; with more running it becomes bound by compute and the same drafts cost real time. Where the
break-even lies depends on the model, the draft, the machine and how much of the text the drafts
guess: SmolLM2-135M drafted by its own Q4_1 copy on a 2-core AMX Xeon measured 1.62x at 2 chat
streams, 0.93x at 4 and 0.62x at 8, while n-gram drafts still gave 1.61x at 8 code streams.
vLLM and SGLang stop drafting past a fixed batch size (rtp's --speculative-max-running stays as
that cap); below it, this measures.

Per batch size (requests decoding in a step, in buckets 1, 2, 3-4, 5-8, ...) it keeps running
averages of a decode step's seconds per token it emitted, with drafts and without. A bucket drafts
until it has _TRIES steps measured drafting, then runs as many without, then takes whichever
costs less a token (a plain mean of the first steps, then a slow running average), and every
_EXPLORE steps there _RUN steps of the other (weighted more, being rare), so a change of workload
(texts the drafts guess better or worse) moves the choice. Steps with prompt tokens are not measured
(their time is mostly the prompt's). Output never depends on the choice: drafts are verified
exactly, and seeded sampling draws the same numbers either way. O(1) a step, no allocation.
"""

from __future__ import annotations

import numpy as np

from rtp.engine.component import Component

_SMOOTHING = 0.05  # weight of the newest step in a running average, once it has _TRIES steps
_TRIES = 8         # steps measured each way (their plain mean) before the averages decide
_EXPLORE = 256     # every this many steps, a bucket runs _RUN steps of the choice it did not make
_RUN = 4
_EXPLORED = 0.15   # the weight such a step gets in its average (it is measured that rarely)


def _bucket(requests: int) -> int:
    """1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ...: batch sizes whose steps cost alike."""
    return max(0, requests - 1).bit_length()


class SpeculationGovernor(Component):
    """An engine component (rtp/engine/component.py): sets the scheduler's drafting cap before each
    plan, and measures each decode step after it."""

    name = "speculation"

    def __init__(self, max_running: int):
        self.max_running = max_running
        self._cost: dict[tuple[int, bool], list[float]] = {}  # (bucket, drafted) -> [s a token, steps]
        self._decided: dict[int, int] = {}                     # bucket -> steps decided
        self.drafting = True  # the latest choice
        self._exploring = False  # whether it was the one it did not prefer
        self._switched_on = False  # whether it drafts after a step that did not
        self._before = (0, 0)  # the scheduler's verification counters when the step began

    def before_schedule(self, core) -> None:
        s = core.scheduler
        s.spec_max_running = self.cap(s.num_running)
        self._before = (s.spec_verifications, s.spec_emitted_tokens)

    def after_step(self, step) -> None:
        s, plan = step.core.scheduler, step.plan
        drafts = int(np.count_nonzero(plan.sample_offsets[:plan.num_samples]))
        requests = plan.num_samples - drafts
        # a request that verified emitted its kept drafts and one more; the others one token each
        emitted = requests - (s.spec_verifications - self._before[0]) + (s.spec_emitted_tokens - self._before[1])
        self.observe(step.seconds, requests, emitted, drafts > 0, plan.num_tokens - plan.num_decode_rows)

    def cap(self, running: int) -> int:
        """The scheduler's spec_max_running for the next step, `running` requests running now: the
        configured cap where drafting pays (or is still being measured), else 0 (no drafts)."""
        if running > self.max_running or running < 1:
            return self.max_running  # the scheduler drafts nothing past the cap anyway
        b = _bucket(running)
        n = self._decided[b] = self._decided.get(b, 0) + 1
        on, off = self._cost.get((b, True)), self._cost.get((b, False))
        self._exploring = False
        if on is None or on[1] < _TRIES:
            draft = True
        elif off is None or off[1] < _TRIES:
            draft = False
        else:
            draft = on[0] <= off[0]
            if n % _EXPLORE < _RUN:
                draft, self._exploring = not draft, True
        # The first step that drafts after steps that did not catches the draft up on what they
        # generated: a cost of switching, paid once, not of drafting; it is not measured.
        self._switched_on = draft and not self.drafting
        self.drafting = draft
        return self.max_running if draft else 0

    def observe(self, seconds: float, requests: int, emitted: int, drafted: bool, prompt_tokens: int) -> None:
        """A step's wall time, the requests it decoded, the tokens they emitted, whether any of them
        verified drafts, and its prompt tokens."""
        if prompt_tokens or requests < 1 or emitted < 1 or self._switched_on:
            return
        key = (_bucket(requests), drafted)
        per_token = seconds / emitted
        cost = self._cost.setdefault(key, [0.0, 0])
        cost[1] += 1
        # the first steps' plain mean, then a slow running average (a request's first drafting step
        # catches the draft up on its prompt and costs several usual ones: it must not decide alone)
        weight = _EXPLORED if self._exploring and drafted == self.drafting else _SMOOTHING
        cost[0] += (per_token - cost[0]) * max(weight, 1.0 / cost[1])

    def stats(self) -> dict:
        """Per bucket (its largest batch size): ms a token with and without drafts, and steps measured."""
        out: dict[str, dict] = {}
        for (b, drafted), (per_token, steps) in sorted(self._cost.items()):
            entry = out.setdefault(str(1 << b), {})
            entry["draft_ms_per_token" if drafted else "plain_ms_per_token"] = round(per_token * 1e3, 4)
            entry["draft_steps" if drafted else "plain_steps"] = int(steps)
        return out
