"""The engine's requests: admission, run once, and the one map between their ids.

A client request (its id, a string) runs as one runtime request per choice (n of them, each an
int id and a slot of the Cython runtime). This registry is where a request is checked against
the model, given its runtime requests, and looked up from either side; nothing else keeps a map
between the two id spaces.

    check(ids, params)     everything refusable before a request runs (InvalidRequest naming the field)
    add(...)               admit: runtime requests for its n choices, its sampling settings by slot, and
                           each component's admit hook (a grammar's matcher), all or none
    reserve(...)           the same for a prompt prefilled on another node (P/D decode side)
    of(rid), get(id), remove(id)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from rtp.errors import EngineFull, InvalidRequest
from rtp.sampling_params import SamplingParams


class Request:
    """One client request and its choices' runtime ids (choice i runs as rids[i])."""

    __slots__ = ("grammar", "params", "prompt_ids", "request_id", "rids", "slots")

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, grammar=None):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.grammar = grammar          # its compiled grammar's matcher template (rtp/engine/grammar/), or None
        self.rids: list[int] = []
        self.slots: list[int] = []


class Requests:
    def __init__(self, scheduler, sampling, components, *, max_model_len: int, vocab_size: int,
                 speculate: Callable[[SamplingParams], bool]):
        self.scheduler = scheduler
        self.sampling = sampling              # rtp/engine/sampler.py SlotSettings: settings by runtime slot
        self.components = components
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.speculate = speculate            # whether a request's decode steps may verify drafts
        self._by_id: dict[str, Request] = {}
        self._by_rid: dict[int, Request] = {}
        self._next_rid = itertools.count()

    def check(self, prompt_ids: list[int], params: SamplingParams, prompt_param: str = "prompt") -> None:
        """Everything about a request that can be refused before it runs, against this model:
        InvalidRequest naming the field."""
        params.validate()
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", prompt_param)
        vocab = self.vocab_size
        if not all(type(t) is int and 0 <= t < vocab for t in prompt_ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})", prompt_param)
        params.validate_for(len(prompt_ids), vocab_size=vocab, max_model_len=self.max_model_len,
                            prompt_param=prompt_param)

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, grammar=None, *,
            prefill_only: bool = False) -> Request:
        """Admit a checked request: its n choices queued in the runtime (EngineFull when the runtime
        holds as many requests as it can; InvalidRequest when it could never run here)."""
        request = self._new(request_id, prompt_ids, params, grammar)
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        max_tokens = self._max_tokens(params, len(prompt_ids))

        def queue(rid: int) -> None:
            self.scheduler.add_request(rid, prompt, max_tokens=max_tokens, min_tokens=params.min_tokens,
                                       stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
                                       prefill_only=prefill_only, speculate=self.speculate(params))

        self._admit(request, queue)
        return request

    def reserve(self, request_id: str, prompt_ids: list[int], params: SamplingParams, grammar=None,
                reserve: Callable = None) -> Request:
        """Admit a request whose prompt another node prefills: `reserve(rid, prompt, **stops)` holds its
        blocks (MemoryError when too few are free now). Nothing runs until it is resumed."""
        if params.n != 1:
            raise InvalidRequest("n must be 1 for a request prefilled on another node", "n")
        request = self._new(request_id, prompt_ids, params, grammar)
        max_tokens = self._max_tokens(params, len(prompt_ids))
        if max_tokens < 2:
            raise InvalidRequest("a request of one token finishes on the prefill node; there is nothing to decode",
                                 "max_tokens")
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        self._admit(request, lambda rid: reserve(rid, prompt, max_tokens=max_tokens, min_tokens=params.min_tokens,
                                                 stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
                                                 speculate=self.speculate(params)))
        return request

    def _new(self, request_id: str, prompt_ids: list[int], params: SamplingParams, grammar) -> Request:
        if request_id in self._by_id:
            raise InvalidRequest(f"request {request_id!r} already exists")
        return Request(request_id, list(prompt_ids), params, grammar)

    def _max_tokens(self, params: SamplingParams, prompt_len: int) -> int:
        return params.max_tokens or max(1, self.max_model_len - prompt_len)

    def _admit(self, request: Request, queue: Callable[[int], None]) -> None:
        """Each choice: a runtime request (`queue(rid)`), its settings by slot and every component's
        admit hook; all choices or none."""
        params = request.params
        try:
            for index in range(params.n):
                rid = next(self._next_rid)
                queue(rid)
                request.rids.append(rid)
                slot = self.scheduler.slot_of_request(rid)
                request.slots.append(slot)
                # choice i of a seeded request draws from seed + i, so n > 1 choices differ
                self.sampling.set(slot, params, None if params.seed is None else params.seed + index)
            for component in self.components:
                component.admit(request)
        except BaseException as e:
            for rid in request.rids:
                self.scheduler.abort(rid)
            if isinstance(e, OverflowError):  # every request slot of the runtime is taken
                raise EngineFull(str(e)) from None
            if isinstance(e, ValueError) and not isinstance(e, InvalidRequest):
                raise InvalidRequest(str(e)) from None  # e.g. needs more KV than exists
            raise
        self._by_id[request.request_id] = request
        for rid in request.rids:
            self._by_rid[rid] = request

    def get(self, request_id: str) -> Request | None:
        return self._by_id.get(request_id)

    def of(self, rid: int) -> Request | None:
        """The request a runtime id runs a choice of (None once it is gone)."""
        return self._by_rid.get(rid)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def remove(self, request_id: str) -> Request | None:
        """Forget a request (finished, aborted or failed)."""
        request = self._by_id.pop(request_id, None)
        if request is not None:
            for rid in request.rids:
                self._by_rid.pop(rid, None)
        return request
