"""LLMEngine: add_request / step / abort_request, the engine as the offline API and the server drive it.

Built by rtp/engine/builder.py; a step is the core's five calls (rtp/engine/core.py), and every
feature beside them is a component (rtp/engine/component.py). This class only admits requests
(rtp/engine/requests.py: checked once, their grammar compiled off this thread, their runtime
requests made) and answers the commands of prefill/decode disaggregation (KVHandoff). Faults:
rtp/errors.py.
"""

from __future__ import annotations

import numpy as np

from rtp.config import EngineConfig
from rtp.distributed import world_rank
from rtp.engine.builder import build_parts
from rtp.engine.component import Component
from rtp.engine.disaggregation import KVHandoff
from rtp.engine.grammar.component import Grammars
from rtp.engine.kv_transfer import KVLayout, KVSink
from rtp.engine.output import RequestDelta
from rtp.engine.tensor_parallel import stop_followers
from rtp.errors import EngineFatal, InvalidRequest
from rtp.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig):
        parts = build_parts(config)
        m = parts.model
        self.config, self.model_path, self.model, self.model_config = config, m.path, m.model, m.model_config
        self.dtype, self.device, self.kv_dtype, self.max_model_len = m.dtype, m.device, m.kv_dtype, m.max_model_len
        self.runner, self.warmup_seconds, self._followers, self._channel = m.runner, m.warmup_seconds, m.followers, \
            m.channel
        self.tokenizer, self.eos_token_ids = parts.tokenizer, parts.eos_token_ids
        self.allocator, self.cache, self.scheduler = parts.allocator, parts.cache, parts.scheduler
        self.core = parts.core
        self.requests, self.outputs, self.sampler = self.core.requests, self.core.outputs, self.core.sampler
        self.sampling = self.core.sampling
        self.components = parts.components
        # the components the public commands below reach (present in every engine), and a few by
        # their kind, for tools and tests that look inside
        self.handoff = self._component(KVHandoff)
        self.grammars = self._component(Grammars)
        self.balancer, self.drafter = m.balancer, self._component_named("draft_model")
        self.prefill_budget = self._component_named("prefill_budget")
        self.governor = self._component_named("speculation")

    def add_component(self, component: Component) -> None:
        """Add a feature to this engine: its hooks run from the next step on, after the built ones'."""
        self.components.append(component)

    def _component(self, kind: type) -> Component:
        return next(c for c in self.components if isinstance(c, kind))

    def _component_named(self, name: str) -> Component | None:
        return next((c for c in self.components if c.name == name), None)

    # -- requests ---------------------------------------------------------------------------

    def check_request(self, prompt_ids: list[int], params: SamplingParams, prompt_param: str = "prompt") -> None:
        """Everything about a request that can be refused before it runs, against this model:
        InvalidRequest naming the field."""
        self.requests.check(prompt_ids, params, prompt_param)

    def compile_grammar(self, spec, client: str = "local"):
        """A future of the compiled grammar of a StructuredOutputs (rtp/engine/grammar/): bounded,
        cached, fair between clients (`client`: who asks), cancelled when cancelled. The server
        awaits it before queueing, so the engine thread never builds one."""
        return self.grammars.compile(spec, client)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    kv_sink: KVSink | None = None) -> None:
        """Queue a request (InvalidRequest naming the field when it cannot run; EngineFull when the
        runtime holds as many requests as it can). With a kv_sink it is prefill-only
        (rtp/engine/disaggregation.py): it finishes with reason "remote" once its KV and first
        token went to the sink, unless that first token already ends it."""
        params = params or SamplingParams()
        if kv_sink is not None and params.n != 1:
            raise InvalidRequest("n must be 1 for a request prefilled for another node", "n")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.requests.check(ids, params)
        request = self.requests.add(request_id, ids, params, self._grammar(params), prefill_only=kv_sink is not None)
        self.outputs.add(request)
        if kv_sink is not None:
            self.handoff.add_sink(request.rids[0], kv_sink)

    def _grammar(self, params: SamplingParams):
        """The request's compiled grammar: the server waited for it off this thread (a cache hit
        here); the offline API waits here."""
        spec = params.structured_outputs
        return None if spec is None else self.compile_grammar(spec).result()

    def abort_request(self, request_id: str) -> bool:
        """Drop a request wherever it is (queued, running, reserved); its blocks are free before the
        next step. False for an unknown or finished one."""
        return self.core.forget(request_id, abort=True)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """One engine step; what it added to each request that moved (RequestDelta, `finished`
        set on its last).

        Faults are kept where they arise (rtp/errors.py). A failure caused by one request --
        building its sampling row, sampling it, a token outside the vocabulary, detokenizing,
        stop strings, its grammar, its KV hand-off -- finishes that request with an error and the
        step goes on for the others with the tokens they would have had. A failure of a stage every
        request shares (schedule, forward, the runtime's update, a collective), or an integrity
        check that fails after a request was failed, raises EngineFatal."""
        if not self.scheduler.has_unfinished:
            return []
        try:
            return self.core.step()
        except EngineFatal:
            raise
        except Exception as e:
            raise EngineFatal(f"engine step failed: {e!r}") from e

    # -- prefill/decode disaggregation: the decode node (rtp/engine/disaggregation.py) ---------------

    def kv_layout(self) -> KVLayout:
        return self.handoff.layout()

    def reserve_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> np.ndarray:
        """Hold blocks for a prompt another node prefills; returns their ids, in which the prompt's
        KV is to be written (write_kv). MemoryError when too few are free now, InvalidRequest
        when the request could never run here. Nothing runs until resume_request()."""
        self.requests.check(prompt_ids, params)
        blocks = []
        request = self.requests.reserve(request_id, prompt_ids, params, self._grammar(params),
                                        lambda *a, **kw: blocks.append(self.handoff.reserve(*a, **kw)))
        for c in self.components:
            c.reserved(request, blocks[0])
        self.outputs.add(request)
        return blocks[0]

    def write_kv(self, layer: int, blocks: np.ndarray, num_tokens: int, kv) -> None:
        """Write token-major KV (a tensor or its raw bytes) of a reserved request's first num_tokens
        prompt tokens into its blocks. Safe from another thread while steps run."""
        self.handoff.write(layer, blocks, num_tokens, kv)

    def resume_request(self, request_id: str, first_token: int, logprobs: dict[int, float] | None = None,
                       num_cached_tokens: int = 0) -> RequestDelta:
        """The reserved request's KV is in its blocks; continue it from the first token the prefill
        node sampled (counted as generated, with its logprobs and text, as if sampled here). It
        joins the batch at the next step; the delta of that first token. KeyError for a request
        not reserved here; ValueError (nothing changed) for a token that would end it."""
        request = self.requests.get(request_id)
        if request is None or request.rids[0] not in self.handoff.awaiting_kv:
            raise KeyError(f"request {request_id!r} is not reserved here")
        for c in self.components:  # a grammar advances by it (or refuses it), then the hand-off resumes it
            c.resume(request, first_token)
        try:
            return self.outputs.resume(request.rids[0], first_token, logprobs, num_cached_tokens)
        except Exception as e:
            delta = self.outputs.fail(request, e)
            self.core.forget(request_id, abort=True)
            return delta

    # -- tensor parallelism (rtp/engine/tensor_parallel.py) ---------------------------------------

    def followers_alive(self) -> bool:
        """Whether every tensor-parallel follower this engine started still runs."""
        return all(proc.is_alive() for proc in self._followers)

    def shutdown(self) -> None:
        """Stop the grammar compiler's sandboxes and the tensor-parallel followers this engine
        started (idempotent)."""
        self.grammars.close()
        if self._channel is None or world_rank() != 0:
            return
        channel, self._channel = self._channel, None
        stop_followers(channel, self._followers)

    def stats(self) -> dict:
        """The runtime's counters, and each component's under its name."""
        stats = self.scheduler.stats()
        for c in self.components:
            value = c.stats()
            if value is not None and c.name:
                stats[c.name] = value
        return stats
