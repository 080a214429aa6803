"""GrammarCompiler: a request's StructuredOutputs -> a matcher template, each compile bounded.

    compile(spec, client)  a Future of the matcher template (llguidance LLMatcher), or of an
                           InvalidRequest naming what is wrong. In order:
        1. the spec's limits (rtp/engine/grammar/spec.py): size, choices, repetition; refused at
           once, nothing queued;
        2. the cache, by content: a grammar compiled before (or being compiled) is shared, and so
           is a refusal, so a hostile grammar sent again costs nothing;
        3. the queue, fair between clients: each worker takes the next client's oldest compile in
           turn, so one client's many compiles delay another's by at most one compile;
        4. the sandbox (rtp/engine/grammar/sandbox.py): the compile in a child process, killed past
           --grammar-compile-timeout (a 400 that says so) or when every caller has gone;
        5. the build here, of the candidate the sandbox built: the same deterministic work, known
           by then to be bounded.

A caller that stops waiting cancels its Future (asyncio.wrap_future does when its task is
cancelled, e.g. the HTTP client hung up): a compile nobody waits for leaves the queue, or is
killed if it runs.
"""

from __future__ import annotations

import bisect
import hashlib
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, InvalidStateError

import msgspec

from rtp.engine.grammar.sandbox import NO_OUTPUT, CompileCancelled, CompileCrashed, CompileTimeout, Sandbox
from rtp.engine.grammar.spec import GrammarLimits, candidates, check_limits
from rtp.errors import InvalidRequest, one_line
from rtp.sampling_params import StructuredOutputs

_CACHE_SIZE = 1024  # compiles kept (an LRU by content), refusals included
_SANDBOX_MEMORY = 4 << 30  # address space a sandbox may map (a compile past it is a 400)
# upper bounds (seconds) of the compile-time histogram /metrics exports as rtp:grammar_compile_seconds
COMPILE_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512,
                   1.0, 2.0, 4.0)


def parser_limits() -> dict:
    """llguidance's parser limits, its defaults but for errors: one line, never the parser's state."""
    return {"verbose_errors": False}


class _Job:
    """One distinct grammar: its result once built, and who waits for it until then."""

    __slots__ = ("key", "spec", "client", "future", "waiters", "cancelled", "state")

    def __init__(self, key: str, spec: StructuredOutputs, client: str):
        self.key, self.spec, self.client = key, spec, client
        self.future: Future = Future()   # the job's own result; callers get Futures chained to it
        self.waiters: set[Future] = set()
        self.cancelled = threading.Event()
        self.state = "queued"            # queued -> running -> done


class GrammarCompiler:
    """Cheap to build: the tokenizer, the workers and their sandboxes start with the first spec that
    passes its limits (a server whose requests bring no grammar pays nothing), and off the caller's
    thread (the event loop's)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int],
                 limits: GrammarLimits | None = None, workers: int = 2):
        self.limits = limits or GrammarLimits()
        self.vocab_size = vocab_size
        self._rtp_tokenizer = tokenizer
        self._eos = list(eos_token_ids)
        self._workers = workers
        self._setup: dict | None = None  # built by the first worker (_prepare)
        self.tokenizer = None            # llguidance's tokenizer, likewise
        self._sandboxes: list[Sandbox] = []
        self._threads: list[threading.Thread] = []
        self._cache: OrderedDict[str, _Job] = OrderedDict()
        # fair queueing: each client with queued jobs has a turn number; the lowest goes next (ties: the
        # earliest to arrive) and its turn advances; a client that arrives joins at the current turn,
        # so it goes before a client that has had its turn, however many jobs that one has queued
        self._queues: dict[str, deque[_Job]] = {}  # client -> its queued jobs
        self._turns: dict[str, int] = {}
        self._clock = 0  # the turn of the job started last
        self._lock = threading.Condition()
        self._closed = False
        self._running: dict[int, tuple[_Job, Sandbox]] = {}
        # compiles (cache misses that ran) and their times, for /metrics: counts per COMPILE_BUCKETS bound,
        # +Inf last; refusals by cause
        self.compiles = 0
        self.compile_seconds = 0.0
        self.compile_buckets = [0] * (len(COMPILE_BUCKETS) + 1)
        self.refused = {"limits": 0, "invalid": 0, "timeout": 0, "cancelled": 0}
        self._prepared = threading.Lock()

    def _prepare(self) -> dict:
        """The setup the sandboxes share, and llguidance's tokenizer here (once, on a worker)."""
        import llguidance as llg

        with self._prepared:
            if self._setup is None:
                tokenizer_json = self._rtp_tokenizer.backend.to_str()
                # built once (about 0.4 s for a 49k vocabulary): the tokenizer's own JSON, so llguidance
                # splits and decodes tokens exactly as rtp's tokenizer does
                self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos or None)
                self._llg_limits = llg.LLParserLimits(**parser_limits())
                self._setup = {"tokenizer": tokenizer_json, "vocab_size": self.vocab_size, "eos": self._eos,
                               "limits": parser_limits(), "memory": _SANDBOX_MEMORY}
            return self._setup

    def _start_workers(self) -> None:
        """Start the workers (under the lock, with the first job queued)."""
        if self._threads or self._closed:
            return
        self._threads = [threading.Thread(target=self._work, daemon=True, name=f"rtp-grammar-{i}")
                         for i in range(self._workers)]
        for thread in self._threads:
            thread.start()

    def compile(self, spec: StructuredOutputs, client: str = "local") -> Future:
        """A Future of the spec's matcher template (see the module docstring); cancel it to stop
        waiting. Refusals are InvalidRequest with param structured_outputs."""
        waiter: Future = Future()
        try:
            check_limits(spec, self.limits)
        except InvalidRequest as e:
            with self._lock:
                self.refused["limits"] += 1
            waiter.set_exception(e)
            return waiter
        key = hashlib.sha256(msgspec.json.encode(spec, order="sorted")).hexdigest()
        with self._lock:
            job = self._cache.get(key)
            if job is not None:
                self._cache.move_to_end(key)
            else:
                job = self._cache[key] = _Job(key, spec, client)
                if client not in self._queues:
                    self._queues[client], self._turns[client] = deque(), self._clock
                self._queues[client].append(job)
                self._start_workers()
                while len(self._cache) > _CACHE_SIZE:
                    self._evict()
                self._lock.notify()
            done = job.future.done()
            if not done:
                job.waiters.add(waiter)
        if not done:
            waiter.add_done_callback(lambda w: self._left(job, w))
        job.future.add_done_callback(lambda f: _settle(waiter, f))  # at once when done
        return waiter

    def _evict(self) -> None:
        """Drop the least recent finished job (queued and running ones stay: someone waits for them)."""
        for key, job in self._cache.items():
            if job.future.done():
                del self._cache[key]
                return
        return

    def _left(self, job: _Job, waiter: Future) -> None:
        """A caller's Future is done: if it was cancelled and was the job's last caller, the job goes."""
        if not waiter.cancelled():
            return
        kill = None
        with self._lock:
            job.waiters.discard(waiter)
            if job.waiters or job.future.done():
                return
            job.cancelled.set()
            if self._cache.get(job.key) is job:
                del self._cache[job.key]  # nothing was learned: the next request compiles it afresh
            if job.state == "queued":
                queue = self._queues.get(job.client)
                if queue is not None and job in queue:
                    queue.remove(job)
                    if not queue:
                        del self._queues[job.client], self._turns[job.client]
                self.refused["cancelled"] += 1
                job.future.cancel()
                return
            kill = next((sandbox for j, sandbox in self._running.values() if j is job), None)
        if kill is not None:
            kill.kill()

    def _next(self) -> _Job | None:
        """The oldest job of the client whose turn it is; None once closed."""
        with self._lock:
            while not self._queues and not self._closed:
                self._lock.wait()
            if self._closed:
                return None
            client = min(self._queues, key=self._turns.__getitem__)
            queue = self._queues[client]
            job = queue.popleft()
            self._clock = self._turns[client]
            self._turns[client] += 1
            if not queue:
                del self._queues[client], self._turns[client]
            job.state = "running"
            return job

    def _work(self) -> None:
        me = threading.get_ident()
        sandbox = Sandbox(self._prepare())
        with self._lock:
            self._sandboxes.append(sandbox)
        while True:
            # a child ready before a job is taken: a worker whose child was just killed takes over its
            # spare or starts a new one (a second) while another worker with a child takes the job
            try:
                sandbox.start()
            except CompileCrashed:
                pass  # started again by the compile, which reports it
            if (job := self._next()) is None:
                break
            with self._lock:
                self._running[me] = (job, sandbox)
            started = time.perf_counter()
            try:
                result, cause, remember = self._attempt(job, sandbox)
            finally:
                with self._lock:
                    del self._running[me]
            seconds = time.perf_counter() - started
            with self._lock:
                job.state = "done"
                if not remember and self._cache.get(job.key) is job:
                    del self._cache[job.key]  # its waiters have the answer; the next request compiles afresh
                if cause is not None:
                    self.refused[cause] += 1
                if cause != "cancelled":
                    self.compiles += 1
                    self.compile_seconds += seconds
                    self.compile_buckets[bisect.bisect_left(COMPILE_BUCKETS, seconds)] += 1
            if cause == "cancelled":
                job.future.cancel()
            elif isinstance(result, Exception):
                job.future.set_exception(result)
            else:
                job.future.set_result(result)
        sandbox.close()

    def _attempt(self, job: _Job, sandbox: Sandbox):
        """(result, cause, remember) of a job: the matcher template or the InvalidRequest it gets, its
        refusal cause (None when built), and whether the cache keeps it. Only what the grammar itself
        decides is kept: a timeout is kept when the compile spent at least a quarter of the timeout in
        CPU time (a grammar slow to build), not when a loaded machine starved it (the child runs
        niced); a child that died is tried once more on a fresh one first -- it may have been killed
        for the compile before it (a cancelled job's kill can land as the next job starts)."""
        for attempt in (0, 1):
            try:
                return self._build(job, sandbox), None, True
            except CompileTimeout as e:
                slow = e.cpu_seconds is not None and e.cpu_seconds >= 0.25 * self.limits.compile_timeout
                return InvalidRequest(f"the structured output took longer than {self.limits.compile_timeout:g} s "
                                      "to compile (--grammar-compile-timeout)", "structured_outputs"), "timeout", slow
            except CompileCrashed:
                if attempt == 0 and not job.cancelled.is_set():
                    continue
                return InvalidRequest("the structured output needs more memory to compile than rtp allows",
                                      "structured_outputs"), "invalid", True
            except InvalidRequest as e:
                return e, "invalid", True
            except CompileCancelled:
                return None, "cancelled", False
            except Exception as e:  # a bug here or in the library: this request fails alone, the worker goes on
                return e, "invalid", False
        raise AssertionError("unreachable")

    def _build(self, job: _Job, sandbox: Sandbox):
        """The matcher template of a job's spec: built in the sandbox first, then here."""
        import llguidance as llg

        grammars, unread = candidates(job.spec, self._special_token)
        verdict = sandbox.run(grammars, self.limits.compile_timeout, job.cancelled, seed=int(job.key[:8], 16))
        index = verdict["index"]
        if index < 0:
            raise InvalidRequest(_refusal(verdict["errors"], unread), "structured_outputs")
        matcher = llg.LLMatcher(self.tokenizer, grammars[index], log_level=0, limits=self._llg_limits)
        if matcher.is_error():  # the sandbox built the same text: not expected, but never a silent pass
            raise InvalidRequest(f"the structured output cannot be compiled: {one_line(matcher.get_error())}",
                                 "structured_outputs")
        return matcher

    def _special_token(self, text: str) -> int | None:
        """The id of `text` where it is one token llguidance takes as special (a grammar names such a
        token by id: no text literal matches it), else None."""
        token = self._rtp_tokenizer.backend.token_to_id(text)
        if token is None or token >= self.vocab_size or not self.tokenizer.is_special_token(token):
            return None
        return token

    @property
    def warm(self) -> bool:
        """Whether every worker's sandbox and its spare are up and ready."""
        with self._lock:
            sandboxes = list(self._sandboxes)
        return len(sandboxes) == self._workers and all(sandbox.warm for sandbox in sandboxes)

    def stats(self) -> dict:
        with self._lock:
            return {"compiles": self.compiles, "compile_seconds": self.compile_seconds,
                    "compile_buckets": list(self.compile_buckets), "refused": dict(self.refused)}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            running = [sandbox for _, sandbox in self._running.values()]
        for sandbox in running:
            sandbox.kill()  # each worker then closes its sandbox (and spare) as it leaves


def _refusal(errors: list[str], unread: dict[str, str]) -> str:
    """One sentence for a spec none of whose grammars built (`errors`: each one's reason, in order)."""
    if NO_OUTPUT in errors:
        return "no output satisfies the structured output: no token can begin it"
    if len(errors) == 2 or unread:  # a grammar text tried as GBNF, then as Lark
        gbnf = unread.get("gbnf") or errors[0]
        return f"the grammar is neither GBNF ({one_line(gbnf, 140)}) nor Lark ({one_line(errors[-1], 140)})"
    return f"the structured output cannot be compiled: {one_line(errors[0])}"


def _settle(waiter: Future, job_future: Future) -> None:
    """Copy the job's outcome into one caller's Future (unless that caller already gave up)."""
    try:
        if job_future.cancelled():
            waiter.cancel()
        elif job_future.exception() is not None:
            waiter.set_exception(job_future.exception())
        else:
            waiter.set_result(job_future.result())
    except InvalidStateError:  # the caller cancelled meanwhile
        pass
