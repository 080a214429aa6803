"""The output processor: each step's tokens become per-request deltas, once.

The runtime reports what a step did as events (a token appended to a request, and the
finish it caused: eos, a stop id, the length). This processor keeps, per choice (one
runtime request), what turns those tokens into an OpenAI answer -- its incremental
detokenizer, its stop strings and the text held back because it may be the start of
one, whether it wants logprobs -- and emits, per request that moved, one RequestDelta:
the text, token ids and logprob entries added, and the finish. Nothing cumulative is
kept here: the server streams the deltas as they are, and the offline API adds them up
(RequestOutput.add).

    engine step:  events = scheduler.update(tokens)
                  deltas = outputs.emit(events, logprobs)    # text, stop strings, finish
                  (stop strings end requests the runtime still runs: `stopped` lists them)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rtp.checkpoint.tokenizer import IncrementalDetokenizer, Tokenizer
from rtp.runtime import FINISH_REASONS
from rtp.sampling_params import SamplingParams


@dataclass(slots=True)
class ChoiceDelta:
    """What one step added to one choice."""

    index: int                                # the choice's index within its request (0..n-1)
    text: str                                 # text added
    num_tokens: int                           # tokens added
    logprobs: list[dict[int, float]] | None   # their {token id: logprob} entries, sampled token first
    finish_reason: str | None = None          # stop | length | abort | error | remote
    stop_reason: int | str | None = None      # the stop string or requested stop id that ended it
    token_ids: list[int] | None = None        # the tokens added (None where they were not relayed)


def _merge(into: ChoiceDelta, more: ChoiceDelta) -> None:
    """Add a later token's delta of the same choice, in the same step, to its first one."""
    into.text += more.text
    into.num_tokens += more.num_tokens
    if into.logprobs is not None and more.logprobs is not None:
        into.logprobs.extend(more.logprobs)
    into.finish_reason, into.stop_reason = more.finish_reason, more.stop_reason
    if into.token_ids is not None and more.token_ids is not None:
        into.token_ids.extend(more.token_ids)


@dataclass(slots=True)
class RequestDelta:
    """What one step produced for one request; `error` set: it failed and is finished."""

    request_id: str
    choices: list[ChoiceDelta]
    num_cached_tokens: int = 0
    finished: bool = False
    error: Exception | None = None


# -- the offline API's results: deltas added up (vLLM's shape) ------------------------------------------

@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None          # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None      # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: logprob}, sampled first
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = False
    error: Exception | None = None  # set when processing this request failed; the others go on

    @classmethod
    def start(cls, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams
              ) -> RequestOutput:
        want = params.logprobs is not None
        return cls(request_id, prompt, list(prompt_ids),
                   [CompletionOutput(i, logprobs=[] if want else None, cumulative_logprob=0.0 if want else None)
                    for i in range(params.n)])

    def add(self, delta: RequestDelta) -> None:
        self.num_cached_tokens = delta.num_cached_tokens or self.num_cached_tokens
        for d in delta.choices:
            out = self.outputs[d.index]
            out.text += d.text
            out.token_ids.extend(d.token_ids or ())
            if out.logprobs is not None and d.logprobs:
                out.logprobs.extend(d.logprobs)
                out.cumulative_logprob += sum(entry.get(t, 0.0) for entry, t in zip(d.logprobs, d.token_ids or ()))
            if d.finish_reason is not None:
                out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
        if delta.error is not None:
            self.error = delta.error
            for out in self.outputs:
                out.finish_reason = out.finish_reason or "error"
        self.finished = self.finished or delta.finished


# -- the processor ------------------------------------------------------------------------------------

class Logprobs:
    """A step's logprobs on the host, by sampling row: the sampled token's, and the top k of each
    row (k the most any row asked for; a row takes its own first k)."""

    __slots__ = ("chosen", "top_ids", "top_values")

    def __init__(self, chosen: np.ndarray, top_values: np.ndarray | None, top_ids: np.ndarray | None):
        self.chosen, self.top_values, self.top_ids = chosen, top_values, top_ids

    @classmethod
    def of(cls, sampled) -> Logprobs | None:
        """A step's logprobs (rtp/engine/sampler.py SamplerOutput) copied to the host once, when any
        row asked for them."""
        if sampled is None or sampled.logprobs is None:
            return None
        top = sampled.top_logprobs
        return cls(sampled.logprobs.cpu().numpy(), None if top is None else top[0].cpu().numpy(),
                   None if top is None else top[1].cpu().numpy())

    def entry(self, row: int, token: int, k: int) -> dict[int, float]:
        entry = {token: float(self.chosen[row])}
        if k and self.top_ids is not None:
            for j in range(k):
                entry.setdefault(int(self.top_ids[row, j]), float(self.top_values[row, j]))
        return entry


class _Request:
    """A request's progress toward its answer (the request itself: rtp/engine/requests.py)."""

    __slots__ = ("choices", "num_cached_tokens", "params", "request_id", "unfinished")

    def __init__(self, request_id: str, params: SamplingParams):
        self.request_id = request_id
        self.params = params
        self.choices: list[_Choice] = []
        self.unfinished = params.n
        self.num_cached_tokens = 0


class _Choice:
    __slots__ = ("detok", "finished", "held", "index", "request", "rid")

    def __init__(self, request: _Request, index: int, rid: int, detok: IncrementalDetokenizer):
        self.request, self.index, self.rid, self.detok = request, index, rid, detok
        self.held = ""  # text withheld because it may be the start of a stop string
        self.finished = False


class OutputProcessor:
    """Per choice (by runtime id): its detokenizer, stop strings and held-back text; deltas out,
    once per step. Which request a runtime id belongs to is the registry's to say
    (rtp/engine/requests.py); here only each choice's way to its text."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._choices: dict[int, _Choice] = {}  # runtime id -> choice
        self.stopped: list[int] = []  # runtime ids a stop string ended in the last emit (still in the runtime)

    def add(self, request) -> None:
        """Start the answer of an admitted request (rtp/engine/requests.py Request)."""
        params = request.params
        progress = _Request(request.request_id, params)
        for index, rid in enumerate(request.rids):
            choice = _Choice(progress, index, rid, IncrementalDetokenizer(
                self.tokenizer, request.prompt_ids, skip_special_tokens=params.skip_special_tokens))
            progress.choices.append(choice)
            self._choices[rid] = choice

    def __len__(self) -> int:
        """Choices whose answer is under way."""
        return len(self._choices)

    def remove(self, request) -> None:
        """Forget a request (finished, aborted or failed)."""
        for rid in request.rids:
            self._choices.pop(rid, None)

    def set_cached(self, rid: int, num_cached_tokens: int) -> None:
        """The prompt tokens the prefix cache served (read before the first token's update)."""
        self._choices[rid].request.num_cached_tokens = num_cached_tokens

    def emit(self, n: int, req_ids: np.ndarray, tokens: np.ndarray, finish: np.ndarray,
             rows: np.ndarray, logprobs: Logprobs | None, ended: set[int] = frozenset()
             ) -> dict[str, RequestDelta]:
        """The deltas of a step's `n` runtime events (request id, token, finish code), by request id.
        rows: each event's sampling row (for logprobs); ended: runtime ids whose token ends them
        with "stop" though the runtime would go on (a complete grammar). A choice that gained
        several tokens in one step (verified drafts) gets them as one delta. A request whose text
        fails (a detokenizer or stop-string error) comes back with `error` set; the caller ends it."""
        deltas: dict[str, RequestDelta] = {}
        self.stopped = []
        for i in range(n):
            choice = self._choices.get(int(req_ids[i]))
            if choice is None or choice.finished:
                continue  # aborted or failed while the step ran
            request = choice.request
            delta = deltas.get(request.request_id)
            if delta is None:
                delta = deltas[request.request_id] = RequestDelta(request.request_id, [], request.num_cached_tokens)
            elif delta.error is not None:
                continue
            token, reason = int(tokens[i]), FINISH_REASONS[int(finish[i])]
            if choice.rid in ended and reason in (None, "remote"):
                # its grammar is complete: it ends here (a prefill-only request too, as a stop string
                # on its first token does); the runtime still holds it: the engine aborts it there
                reason = "stop"
                self.stopped.append(choice.rid)
            entry = None
            if request.params.logprobs is not None and logprobs is not None:
                entry = logprobs.entry(int(rows[i]), token, request.params.logprobs)
            try:
                step = self._advance(choice, token, entry, reason)
                last = delta.choices[-1] if delta.choices else None
                if last is not None and last.index == step.index and last.finish_reason is None:
                    _merge(last, step)
                else:
                    delta.choices.append(step)
            except Exception as e:
                deltas[request.request_id] = self._fail(request.request_id, request, e)
                continue
            delta.finished = request.unfinished == 0
        return deltas

    def resume(self, rid: int, token: int, entry: dict[int, float] | None, num_cached_tokens: int) -> RequestDelta:
        """A first token sampled on another node (prefill/decode), taken as if sampled here."""
        choice = self._choices[rid]
        choice.request.num_cached_tokens = num_cached_tokens
        if choice.request.params.logprobs is not None:
            entry = dict(entry) if entry else {token: 0.0}
        else:
            entry = None
        delta = self._advance(choice, token, entry, None)
        return RequestDelta(choice.request.request_id, [delta], num_cached_tokens)

    def fail(self, request, error: Exception) -> RequestDelta:
        """End a request (rtp/engine/requests.py Request) with an error: every choice not finished
        finishes with "error"."""
        choice = self._choices.get(request.rids[0]) if request.rids else None
        return self._fail(request.request_id, None if choice is None else choice.request, error)

    @staticmethod
    def _fail(request_id: str, progress: _Request | None, error: Exception) -> RequestDelta:
        choices = []
        if progress is not None:
            for choice in progress.choices:
                if not choice.finished:
                    choice.finished = True
                    choices.append(ChoiceDelta(choice.index, "", 0, None, "error"))
            progress.unfinished = 0
        return RequestDelta(request_id, choices, 0 if progress is None else progress.num_cached_tokens,
                            finished=True, error=error)

    def _advance(self, choice: _Choice, token: int, entry: dict[int, float] | None, reason: str | None) -> ChoiceDelta:
        params = choice.request.params
        text = choice.detok.add(token)
        stop_reason: int | str | None = None
        if params.stop:
            text, stop = self._match_stops(choice, text, params)
            if stop is not None:
                # the runtime still runs it: the engine aborts it there (self.stopped)
                reason, stop_reason = "stop", stop
                self.stopped.append(choice.rid)
        if reason is not None and stop_reason is None:
            if reason == "stop" and token in params.stop_token_ids:
                stop_reason = token  # as vLLM: a requested stop id is a stop reason, eos is not
            if reason != "remote":
                text += choice.held + choice.detok.flush()
                choice.held = ""
        if reason is not None:
            choice.finished = True
            choice.request.unfinished -= 1
        return ChoiceDelta(choice.index, text, 1, [entry] if entry is not None else None, reason, stop_reason,
                           [token])

    @staticmethod
    def _match_stops(choice: _Choice, piece: str, params: SamplingParams) -> tuple[str, str | None]:
        """(text to emit now, the stop string that matched or None), holding back the longest
        tail that could still grow into a stop string; a stop string is never emitted unless asked."""
        pending = choice.held + piece
        for stop in params.stop:
            at = pending.find(stop)
            if at >= 0:
                choice.held = ""
                return (pending[: at + len(stop)] if params.include_stop_str_in_output else pending[:at]), stop
        hold = 0
        for stop in params.stop:
            for k in range(min(len(stop) - 1, len(pending)), 0, -1):
                if stop.startswith(pending[-k:]):
                    hold = max(hold, k)
                    break
        choice.held = pending[len(pending) - hold:]
        return pending[: len(pending) - hold], None
