"""Structured outputs as an engine component (rtp/engine/component.py).

    compile(spec, client)  the request's grammar, bounded and cached (compiler.py), awaited before
                           the request is admitted, never on the engine thread
    admit                  each choice of a constrained request gets its own matcher, by slot
    before_forward         the step's masks are filled on a thread beside the forward
    (sampling)             the sampler asks for them (fill / bitmask: `masks_tokens`)
    after_sample           the sampled tokens advance the matchers: a refused token fails its request
                           as the grammar's fault; a complete grammar ends it with "stop", unless
                           that is before its min_tokens (refused, never dropped silently)
    resume                 P/D: a first token sampled on another node advances the matcher here
"""

from __future__ import annotations

import numpy as np

from rtp.engine.component import Component
from rtp.engine.grammar.compiler import GrammarCompiler
from rtp.engine.grammar.slots import GrammarSlots
from rtp.engine.grammar.spec import GrammarLimits
from rtp.errors import InvalidRequest


class Grammars(Component):
    name = "grammar"
    masks_tokens = True  # the sampler applies this component's token bitmask (rtp/engine/core.py)

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], *, num_slots: int, max_rows: int,
                 limits: GrammarLimits):
        self.slots = GrammarSlots(num_slots, max_rows, vocab_size)
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids, limits)  # starts with its first job
        self._used = False

    def compile(self, spec, client: str = "local"):
        """A Future of the spec's matcher template (rtp/engine/grammar/compiler.py)."""
        self._used = True
        return self.compiler.compile(spec, client)

    # -- the sampler's mask source -----------------------------------------------------------------

    @property
    def bitmask(self):
        return self.slots.bitmask

    def fill(self, slots: np.ndarray) -> np.ndarray:
        return self.slots.fill(slots)

    # -- hooks ----------------------------------------------------------------------------------

    def admit(self, request) -> None:
        for slot in request.slots:  # each choice runs a copy of the compiled template
            self.slots.set(slot, None if request.grammar is None else request.grammar.deep_copy())

    def before_forward(self, step) -> None:
        self.slots.prefetch(step.slots)  # the masks are filled beside the forward, not after it

    def after_sample(self, step) -> None:
        finishes = step.finishes
        refused, complete = self.slots.advance(step.slots, step.sampled.token_ids, set(finishes.failed))
        for row, error in refused.items():
            finishes.fail(row, error)
        if not complete:
            return
        rows = sorted(complete)
        slots = step.slots[rows]
        generated = step.core.scheduler.output_lengths(slots) + 1  # this step's token included
        wanted = step.core.sampling.min_tokens[slots]
        for row, n, m in zip(rows, generated, wanted):
            if n < m:  # min_tokens cannot be honoured (the grammar takes nothing more): the client's mistake
                finishes.fail(row, InvalidRequest(f"the structured output was complete after {int(n)} tokens, "
                                                  f"fewer than min_tokens {int(m)}: lower min_tokens or widen the "
                                                  "grammar", "min_tokens"))
            else:
                finishes.end(row)

    def resume(self, request, token: int) -> None:
        """The first token was sampled under the grammar on the prefill node: it advances it here."""
        if not self.slots.constrained[request.slots[0]]:
            return
        refused, complete = self.slots.advance(np.array(request.slots[:1]), np.array([token]), set())
        if refused or complete:
            raise ValueError(f"the first token {token} " + ("breaks the request's grammar" if refused
                             else "completes the request's grammar: the prefill node answers it"))

    def stats(self) -> dict | None:
        if not self._used:
            return None  # once a request brought a structured output
        return {**self.compiler.stats(), **self.slots.stats()}

    def close(self) -> None:
        self.compiler.close()
