"""Structured outputs: grammars that constrain what a request may generate, run by llguidance.

Why llguidance (measured against xgrammar on this project's CPU: docs/benchmarks.md,
"Structured outputs"): no dependencies (xgrammar pulls transformers and triton into a
server that needs neither), no ahead-of-time vocabulary compilation per schema (its Earley
parser computes a mask lazily, so a schema each request brings costs about a millisecond),
JSON Schema, regex, Lark and GBNF grammars, and a parallel batch API for masks and tokens.

    GrammarCompiler  a request's StructuredOutputs -> a grammar llguidance runs, built into a
                     matcher once (on a small pool of threads: a complex grammar takes up to a
                     second to build) and cached by content; an invalid one is an InvalidRequest
                     naming the problem, before the request is queued
    GrammarSlots     one matcher per constrained request, by its runtime slot: each step fills
                     one token bitmask for the rows that need it (one call, rows in parallel),
                     the sampler applies it to the logits in place, and the sampled tokens
                     advance the matchers (one call again). A matcher that can take no more
                     tokens ends its request with "stop".

The bitmask is llguidance's (and xgrammar's) layout: int32 words, bit j of word w allows
token 32w + j; rtp/kernels/cpu_kernels.py apply_token_bitmask writes -inf where it is 0.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from rtp.checkpoint.tokenizer import Tokenizer
from rtp.errors import InvalidRequest
from rtp.sampling_params import StructuredOutputs

# JSON as a model should write it for a machine: one canonical layout, no runs of whitespace
# (small models given free whitespace can fill max_tokens with newlines inside a valid document)
_JSON_OPTIONS = {"whitespace_flexible": False}
_CACHE_SIZE = 1024  # compiled grammars kept (an LRU by content)
# upper bounds (seconds) of the compile-time histogram /metrics exports as rtp:grammar_compile_seconds
COMPILE_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512,
                   1.0, 2.0, 4.0)


def _llguidance():
    import llguidance

    return llguidance


class GrammarCompiler:
    """StructuredOutputs -> a matcher template, built off the caller's thread and cached by content."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int], threads: int = 2):
        llg = _llguidance()
        self.vocab_size = vocab_size
        # built once (about 0.25 s for a 49k vocabulary): the tokenizer's own JSON, so llguidance
        # splits and decodes tokens exactly as rtp's tokenizer does
        self.tokenizer = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                         eos_token=list(eos_token_ids) or None)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="rtp-grammar")
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()
        # compiles (cache misses) and their times, for /metrics: counts per COMPILE_BUCKETS bound, +Inf last
        self.compiles = 0
        self.compile_seconds = 0.0
        self.compile_buckets = [0] * (len(COMPILE_BUCKETS) + 1)

    def compile(self, spec: StructuredOutputs) -> Future:
        """A future of the spec's matcher template (a fresh llguidance LLMatcher, its grammar built);
        it raises InvalidRequest when the grammar cannot be built. The same spec compiles once."""
        key = _key(spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._build, spec)
            self._cache[key] = future
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return future

    def _build(self, spec: StructuredOutputs):
        start = time.perf_counter()
        try:
            return self._build_matcher(spec)
        finally:
            seconds = time.perf_counter() - start
            with self._lock:
                self.compiles += 1
                self.compile_seconds += seconds
                self.compile_buckets[bisect.bisect_left(COMPILE_BUCKETS, seconds)] += 1

    def stats(self) -> dict:
        with self._lock:
            return {"compiles": self.compiles, "compile_seconds": self.compile_seconds,
                    "compile_buckets": list(self.compile_buckets)}

    def _build_matcher(self, spec: StructuredOutputs):
        llg = _llguidance()
        grammar = grammar_text(spec)
        error = llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise InvalidRequest(f"the structured output cannot be compiled: {error.strip()}", "structured_outputs")
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"the structured output cannot be compiled: {matcher.get_error()}",
                                 "structured_outputs")
        return matcher

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def grammar_text(spec: StructuredOutputs) -> str:
    """The grammar llguidance runs for a spec (InvalidRequest for what cannot even be read)."""
    llg = _llguidance()
    try:
        if spec.json is not None or spec.json_object:
            schema = {"type": "object"} if spec.json_object else spec.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if spec.regex is not None:
            return llg.LLMatcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            # Lark string literals: JSON's escapes, so any choice text is taken literally
            return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        if "::=" in spec.grammar:  # GBNF / EBNF, as llama.cpp and vLLM's guided_grammar take it
            from llguidance.gbnf_to_lark import gbnf_to_lark

            return llg.LLMatcher.grammar_from_lark(gbnf_to_lark(spec.grammar))
        return llg.LLMatcher.grammar_from_lark(spec.grammar)
    except InvalidRequest:
        raise
    except Exception as e:  # a schema that is not JSON, a grammar the converter cannot read
        raise InvalidRequest(f"the structured output cannot be read: {e}", "structured_outputs") from None


def _key(spec: StructuredOutputs) -> str:
    import msgspec

    return hashlib.sha256(msgspec.json.encode(spec, order="sorted")).hexdigest()


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
                failed[r] = RuntimeError(f"the grammar refused token {int(tokens[r])}: {m.get_error()}")
            elif m.is_stopped():
                done.add(r)
        return failed, done
