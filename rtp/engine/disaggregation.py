"""Prefill/decode disaggregation, the engine's side: a request's KV leaves one engine for another.

Prefill node: a request added with a KV sink is prefill-only. In the step that computes
its last prompt chunk the runner hands each layer's KV to the sink (LayerTaps, armed by
`arm`); the request then samples its first token, the runtime finishes it with reason
"remote", and `hand_off` frees its blocks (the prompt stays in the prefix cache) and gives
the sink the token.

Decode node: `reserve` holds blocks for a prompt another node prefills, `write` puts each
layer's KV into them (from another thread, while steps run: no step touches a reserved
request's blocks), and `resume` continues the request from the first token sampled there.

An engine component (rtp/engine/component.py): it arms the KV taps around the forward and hands
off the prefill-only requests a step finished; the wire protocol (RPC, the KV port, relaying)
lives in the server (rtp/server/pd/).
"""

from __future__ import annotations

import numpy as np
import torch

from rtp.engine.component import Component
from rtp.engine.kv_transfer import KVLayout, KVSink, LayerTaps, layout_of, scatter, token_slots


class KVHandoff(Component):
    def __init__(self, scheduler, runner):
        self.scheduler = scheduler
        self.runner = runner
        self.sinks: dict[int, KVSink] = {}     # runtime id -> where a prefill-only request's KV goes
        self.awaiting_kv: set[int] = set()        # runtime ids whose KV is on its way from a prefill node
        self._taps: LayerTaps | None = None    # installed with the first prefill-only request

    def layout(self) -> KVLayout:
        return layout_of(self.runner.kv_caches)

    # -- prefill node --------------------------------------------------------------------------

    def add_sink(self, rid: int, sink: KVSink) -> None:
        self._refuse_int8()
        if self._taps is None:
            self._taps = LayerTaps(self.runner.model.attention_layers(), self.runner.kv_caches)
            self.runner.taps = self._taps  # the runner hands them every layer, whichever path runs the step
        self.sinks[rid] = sink

    def before_forward(self, step) -> None:
        self.arm(step.rids)

    def after_forward(self, step) -> None:
        self.disarm()

    def after_emit(self, step) -> None:
        """The step's prefill-only requests that sampled their first token go to their sinks; a
        hand-off that fails fails its request alone."""
        if not self.sinks:
            return
        core = step.core
        for delta in step.deltas.values():
            for choice in delta.choices:
                if choice.finish_reason != "remote" or delta.error is not None:
                    continue
                request = core.requests.get(delta.request_id)
                try:
                    self.hand_off(request.rids[choice.index], choice.token_ids[0],
                                  choice.logprobs[0] if choice.logprobs else None, delta.num_cached_tokens)
                except Exception as e:
                    failed = core.outputs.fail(request, e)
                    delta.choices, delta.error, delta.finished = failed.choices, e, True

    def finished(self, rid: int) -> None:
        self.sinks.pop(rid, None)
        self.awaiting_kv.discard(rid)

    def arm(self, rids: list[int]) -> None:
        """Before a forward: the prefill-only requests sampling in it have all their earlier
        chunks' KV in place, so each layer's tap can take all of it."""
        if self._taps is None:
            return
        taps = []
        for rid in rids:
            sink = self.sinks.get(rid)
            if sink is not None:
                state = self.scheduler.request_state(rid)
                taps.append((token_slots(state["block_ids"], self.scheduler.block_size, state["num_tokens"]), sink))
        self._taps.arm(taps)

    def disarm(self) -> None:
        if self._taps is not None:
            self._taps.disarm()

    def hand_off(self, rid: int, token: int, logprobs: dict[int, float] | None, num_cached_tokens: int) -> None:
        """A prefill-only request sampled its first token: every layer's KV went to its sink during
        the step, so its blocks are free at once."""
        sink = self.sinks.pop(rid)
        self.scheduler.release(rid)
        sink.finish(token, logprobs, num_cached_tokens)

    # -- decode node ---------------------------------------------------------------------------

    def reserve(self, rid: int, prompt: np.ndarray, *, max_tokens: int, min_tokens: int,
                stop_token_ids, ignore_eos: bool, speculate: bool = False) -> np.ndarray:
        """Blocks for a prompt whose KV another node computes (MemoryError when too few are free
        now); their ids, in token order."""
        self._refuse_int8()
        blocks = self.scheduler.reserve(rid, prompt, max_tokens=max_tokens, min_tokens=min_tokens,
                                        stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, speculate=speculate)
        self.awaiting_kv.add(rid)
        return blocks

    def write(self, layer: int, blocks: np.ndarray, num_tokens: int, kv: torch.Tensor | bytes) -> None:
        """Token-major KV of a reserved request's first num_tokens prompt tokens, into its blocks."""
        scatter(self.runner.kv_caches[layer], token_slots(blocks, self.scheduler.block_size, num_tokens), kv)

    def _refuse_int8(self) -> None:
        # `rtp serve` refuses the combination at start-up; this guards the engine used directly
        if self.runner.kv_scales:
            raise ValueError("prefill/decode KV transfer with --kv-cache-dtype int8 is not supported yet "
                             "(the transfer moves blocks without their scales)")

    def resume(self, request, first_token: int) -> None:
        """The reserved request joins the batch from its first token (the hook runs after the other
        components', which may refuse the token; KeyError: not reserved here; ValueError, nothing
        changed: the token would end it)."""
        rid = request.rids[0]
        if rid not in self.awaiting_kv:
            raise KeyError(f"request {request.request_id!r} is not reserved here")
        self.scheduler.resume(rid, first_token)
        self.awaiting_kv.discard(rid)
