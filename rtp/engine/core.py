"""EngineCore: one step is five calls, and the components' hooks between them.

    step = schedule()      rtp/runtime/scheduler.pyx: admission, chunked prefill, preemption, the plan
    forward(step)          rtp/engine/runner.py: the step's captured graph (or eager model)
    sample(step)           rtp/engine/sampler.py: per-slot settings; a request's fault fails it alone
    update(step)           the runtime appends the tokens: stop ids, length, frees, radix inserts
    emit(step)             rtp/engine/output.py: per-request deltas (text, stop strings, logprobs)

Everything else that acts on a step is a Component (rtp/engine/component.py) called at named
points; the core knows none of them by name. Faults: a failure one request caused fails it
alone; a stage every request shares (schedule, forward, update) raising, or the runtime's
integrity check failing after a request fault, is EngineFatal (rtp/errors.py).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from rtp.engine.component import Step
from rtp.engine.output import Logprobs, RequestDelta
from rtp.errors import EngineFatal

log = logging.getLogger("rtp.engine")
_NO_TOKENS = np.zeros(0, dtype=np.int64)


class EngineCore:
    def __init__(self, *, scheduler, runner, sampler, sampling, outputs, requests, components, eos_token_ids,
                 vocab_size: int, drafts: bool):
        self.scheduler, self.runner, self.sampler, self.sampling = scheduler, runner, sampler, sampling
        self.outputs, self.requests, self.components = outputs, requests, components
        self.eos_token_ids, self.vocab_size, self.drafts = eos_token_ids, vocab_size, drafts
        # the component that constrains tokens, found by what it does: the sampler asks it for the
        # step's token bitmask (fill / bitmask; structured outputs' is rtp/engine/grammar/component.py)
        self.masks = next((c for c in components if getattr(c, "masks_tokens", False)), None)

    def step(self) -> list[RequestDelta]:
        if (step := self.schedule()) is None:
            return []
        self.forward(step)
        self.sample(step)
        self.update(step)
        return self.emit(step)

    def schedule(self) -> Step | None:
        started = time.monotonic()
        for c in self.components:
            c.before_schedule(self)
        s = self.scheduler
        rows = s.schedule()
        for c in self.components:
            c.after_schedule(self)
        if not rows:
            s.update(_NO_TOKENS)  # nothing to run: the step still applies aborts made meanwhile
            return None
        plan = s.plan
        return Step(self, plan, self.runner.sample_req_ids().tolist(), plan.sample_slots[:plan.num_samples], started)

    def forward(self, step: Step) -> None:
        for c in self.components:
            c.before_forward(step)
        try:
            step.logits = self.runner.forward()
        finally:
            for c in self.components:
                c.after_forward(step)

    def sample(self, step: Step) -> None:
        plan = step.plan
        offsets = plan.sample_offsets[:plan.num_samples] if self.drafts else None
        step.sampled = self.sampler.sample(step.logits, self.sampling, step.slots, self.scheduler,
                                           masks=self.masks, eos_token_ids=self.eos_token_ids,
                                           vocab_size=self.vocab_size, offsets=offsets)
        for row, error in step.sampled.failed.items():
            step.finishes.fail(row, error)
        for c in self.components:
            c.after_sample(step)

    def update(self, step: Step) -> None:
        failed, s = step.finishes.failed, self.scheduler
        if failed:
            # a failed row's token is a placeholder: aborted now, the runtime drops it in update()
            step.sampled.token_ids[list(failed)] = 0
            for row in failed:
                s.abort(step.rids[row])
        for rid in step.rids:
            if s.is_first_token(rid) and self.requests.of(rid) is not None:
                # read before update(): a request that finishes on its first token leaves the runtime there
                self.outputs.set_cached(rid, s.cached_prompt_tokens(rid))
        step.events = s.update(step.sampled.token_ids)

    def emit(self, step: Step) -> list[RequestDelta]:
        s, finishes = self.scheduler, step.finishes
        step.deltas = self.outputs.emit(step.events, s.event_req_ids, s.event_tokens, s.event_finish, s.event_rows,
                                        Logprobs.of(step.sampled.output),
                                        ended={step.rids[row] for row in finishes.ended})
        for row, error in finishes.failed.items():
            request = self.requests.of(step.rids[row])
            if request is not None:
                step.deltas[request.request_id] = self.outputs.fail(request, error)
        for c in self.components:
            c.after_emit(step)
        self._retire(step)
        step.seconds = time.monotonic() - step.started
        for c in self.components:
            c.after_step(step)
        return list(step.deltas.values())

    def _retire(self, step: Step) -> None:
        """Every finish of the step applied in one place: requests a stop string or a complete grammar
        ended (the runtime still runs them) and failed ones leave the runtime; finished ones are
        forgotten everywhere; a request fault is followed by the runtime's integrity check."""
        for rid in self.outputs.stopped:
            self.scheduler.abort(rid)
        faults = bool(step.finishes.failed)
        for delta in step.deltas.values():
            if delta.error is not None:
                faults = True
                log.error("request %s failed: %r", delta.request_id, delta.error, exc_info=delta.error)
            if delta.finished:
                self.forget(delta.request_id, abort=delta.error is not None)
        if step.finishes.failed:
            log.warning("step: %d of %d sampling rows failed", len(step.finishes.failed), len(step.rids))
        if faults:
            self.check_integrity()

    def forget(self, request_id: str, abort: bool) -> bool:
        """A request is gone (finished, failed or aborted): out of the registry, the outputs, the
        components and (`abort`) the runtime. False for an unknown one."""
        request = self.requests.remove(request_id)
        if request is None:
            return False
        self.outputs.remove(request)
        for rid in request.rids:
            if abort:
                self.scheduler.abort(rid)
            for c in self.components:
                c.finished(rid)
        return True

    def check_integrity(self) -> None:
        """After a request failed mid-step: the runtime's shared state must still hold together."""
        try:
            self.scheduler.check_integrity()
        except Exception as e:
            raise EngineFatal(f"the runtime's integrity check failed after a request fault: {e!r}") from e
