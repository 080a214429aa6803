"""What a feature of the engine is: a component with named hooks, owning its own state.

The engine core (rtp/engine/core.py) runs a step as five calls -- schedule, forward, sample,
update, emit -- and between them calls every component's hooks in order. It knows none of
them by name: speculative drafting, the speculation governor, the prefill budget, grammars,
the P/D hand-off, EPLB and the tensor-parallel plan broadcast are each a Component. A new
feature is a new file with a subclass; the core does not change.

    hook                   when                                  what components do there
    admit(request)         a request's choices got runtime slots  take what they need of it (a matcher)
    before_schedule(core)  before the scheduler plans             set its knobs (prefill budget, drafting cap)
    after_schedule(core)   the scheduler planned (rows or none)   let go what was held for its planning
    before_forward(step)   the plan is made, the model not run    drafts, KV taps, mask prefetch, plan broadcast
    after_forward(step)    logits are out                         disarm taps
    after_sample(step)     tokens are sampled, not yet applied    judge them: report finishes (grammars)
    after_emit(step)       the step's deltas are made             hand requests off (P/D)
    after_step(step)       the step is over and timed             learn from it (budgets), move experts
    finished(rid)          a runtime request is gone               drop what was kept for it
    reserved(request, blocks)  P/D decode side: a request's KV is   mark those blocks stale (a draft model)
                           to come from another node into blocks
    resume(request, token) P/D decode side: the request continues  advance by it (a grammar; ValueError
                           from a token sampled on another node     refuses it, nothing changed)
    stats()                /metrics asks                          counters, under the component's `name`

A component reports that a request ends through `step.finishes`, never by calling the
scheduler: the core applies every finish of a step in one place (EngineCore._apply).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np


class Component:
    """A feature acting on the engine's steps. Every hook is optional: the default does nothing."""

    name = ""  # its key in the engine's stats ("" : none)

    def admit(self, request) -> None:
        pass

    def before_schedule(self, core) -> None:
        pass

    def after_schedule(self, core) -> None:
        pass

    def before_forward(self, step: Step) -> None:
        pass

    def after_forward(self, step: Step) -> None:
        pass

    def after_sample(self, step: Step) -> None:
        pass

    def after_emit(self, step: Step) -> None:
        pass

    def after_step(self, step: Step) -> None:
        pass

    def finished(self, rid: int) -> None:
        pass

    def reserved(self, request, blocks: np.ndarray) -> None:
        pass

    def resume(self, request, token: int) -> None:
        pass

    def stats(self):
        return None


class Finishes:
    """The ends a step decided outside the runtime's own finish codes (eos, stop ids, length).

    failed   sampling rows whose request fails, with why: their token is a placeholder the
             runtime must never append, so the core drops them before `update`
    ended    sampling rows whose token ends their request with "stop" though the runtime would
             go on (a grammar that is complete): applied after `emit`, with the stop strings
             the output processor found
    """

    __slots__ = ("ended", "failed")

    def __init__(self):
        self.failed: dict[int, Exception] = {}
        self.ended: set[int] = set()

    def fail(self, row: int, error: Exception) -> None:
        self.failed.setdefault(row, error)
        self.ended.discard(row)

    def end(self, row: int) -> None:
        if row not in self.failed:
            self.ended.add(row)


@dataclass
class Step:
    """One step as it passes through the core and its components."""

    core: object                                # the EngineCore (its scheduler, runner, outputs, requests)
    plan: object                                # the scheduler's StepPlan, filled in place
    rids: list[int]                             # runtime id of each sampling row
    slots: np.ndarray                           # runtime slot of each sampling row
    started: float = field(default_factory=time.monotonic)  # before the plan was made
    logits: object = None
    sampled: object = None                      # rtp/engine/sampler.py Sampled
    finishes: Finishes = field(default_factory=Finishes)
    events: int = 0                             # the runtime's events of the update
    deltas: dict = field(default_factory=dict)  # request id -> RequestDelta
    seconds: float = 0.0                        # wall time, schedule to emit
