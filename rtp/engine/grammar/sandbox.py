"""A grammar compile in a process of its own, so that no grammar costs more than its bounds.

llguidance builds a grammar in Rust: once started, a compile cannot be interrupted from Python,
and a hostile one (a million-string choice, a schema whose branches multiply) can take tens of
seconds and gigabytes. So every grammar a request brings is first built here, in a child process
(`_child`, at a lower CPU priority) that holds its own copy of the tokenizer and runs under a
memory limit: the parent waits at most --grammar-compile-timeout for the answer and kills the
child when the time is up or the request's client has gone. Only a grammar that built here is
built again in the server's process, where the same deterministic work is then known to be
bounded.

The child builds each candidate text (rtp/engine/grammar/spec.py) until one builds, and checks
what the matcher could otherwise meet later:
- that some output satisfies it: the first mask allows a token, or the empty output is accepted
  (a regex of an empty class, a rule that only recurses, a schema that only refers to itself);
- that its limits do not trip while it generates: a short walk of seeded random tokens through
  the grammar, so a lexer that explodes a few tokens in (`a{1000000}`) fails here, not mid-request.

Frames on stdin/stdout: a 4-byte little-endian length, then msgpack. The first frame to the child
is its setup (tokenizer JSON, vocabulary size, eos ids, parser limits, memory cap); it answers
{"ready": true}. Each job {"grammars": [...], "walk": n, "seed": s} gets {"index": i, "errors": [...]}:
the first candidate that built (-1: none) and, per candidate tried, why it did not.
"""

from __future__ import annotations

import os
import selectors
import struct
import subprocess
import sys
import threading
import time

import msgspec
import numpy as np

_HEADER = struct.Struct("<I")
_STARTUP_SECONDS = 60.0  # the child's own start (imports, tokenizer): not a compile's time
NO_OUTPUT = "no output"  # the child's word for a grammar no text satisfies
# The child lowers its own priority before anything else: a compile is its request's work, and
# must not take the cores from the engine's steps, which every other request waits on (a cold start,
# a second of CPU, beside a step slowed that step 10x without it: libgomp's threads wait for cores).
_NICE = 10
_LAUNCH = f"import os; os.nice({_NICE}); from rtp.engine.grammar.sandbox import _child; _child()"


class CompileTimeout(Exception):
    """The compile ran past its time and was killed. cpu_seconds: the CPU time the child spent on it
    (None where /proc cannot say) -- a compile starved by a loaded machine spent little of it."""

    def __init__(self, cpu_seconds: float | None = None):
        super().__init__()
        self.cpu_seconds = cpu_seconds


class CompileCancelled(Exception):
    """The compile was killed because nobody waits for it any more."""


class CompileCrashed(Exception):
    """The child died during the compile (past its memory cap, or a crash in the library)."""


def _write(stream, obj) -> None:
    data = msgspec.msgpack.encode(obj)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read(stream):
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    return None if len(data) < size else msgspec.msgpack.decode(data)


class Sandbox:
    """One child process that runs compiles, and a warm spare: a killed child is replaced by the
    spare at once (a cold start takes about a second, the tokenizer's), and a new spare starts in
    the background. `run` is called from one thread at a time; `kill` from any thread."""

    def __init__(self, setup: dict):
        self._setup = setup
        self._proc: subprocess.Popen | None = None
        self._spare: subprocess.Popen | None = None
        self._refilling = False
        self._closed = False
        self._lock = threading.Condition()

    def start(self) -> None:
        """Start the child (and its spare) now, if not running (run() does it too)."""
        self._ensure()

    def run(self, grammars: list[str], timeout: float, cancelled: threading.Event, walk: int = 16,
            seed: int = 0) -> dict:
        """Build the candidates in the child: {"index", "errors", "seconds"}. CompileTimeout past
        `timeout` seconds, CompileCancelled once `cancelled` is set (kill() stops a running
        compile), CompileCrashed when the child died."""
        proc = self._ensure()
        if cancelled.is_set():
            raise CompileCancelled()
        cpu_before = _cpu_seconds(proc)
        try:
            _write(proc.stdin, {"grammars": grammars, "walk": walk, "seed": seed})
            reply = self._await(proc, timeout)
        except CompileTimeout as e:
            spent = None if e.cpu_seconds is None or cpu_before is None else e.cpu_seconds - cpu_before
            raise CompileTimeout(spent) from None
        except OSError:
            reply = None
        if reply is None:
            _stop(proc)
            raise CompileCancelled() if cancelled.is_set() else CompileCrashed()
        return reply

    def kill(self) -> None:
        """Stop whatever the child runs now (the spare takes its place for the next compile)."""
        with self._lock:
            proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            procs, self._proc, self._spare = (self._proc, self._spare), None, None
        for proc in procs:
            if proc is not None:
                _stop(proc)

    @property
    def warm(self) -> bool:
        """Whether a child runs and a spare waits, both ready."""
        with self._lock:
            return all(p is not None and p.poll() is None for p in (self._proc, self._spare))

    def _ensure(self) -> subprocess.Popen:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return self._proc
            dead, self._proc = self._proc, None
            while self._spare is None and self._refilling:
                self._lock.wait()  # a spare on its way is sooner than a cold start
            spare, self._spare = self._spare, None
        if dead is not None:
            _stop(dead)
        if spare is not None and spare.poll() is None:
            proc = spare
        else:
            if spare is not None:
                _stop(spare)
            proc = self._spawn()
        with self._lock:
            self._proc = proc
        self._refill()
        return proc

    def _refill(self) -> None:
        """Start a new spare on a thread of its own, unless one is there or on its way."""
        with self._lock:
            if self._spare is not None or self._refilling or self._closed:
                return
            self._refilling = True

        def spawn() -> None:
            try:
                proc = self._spawn()
            except CompileCrashed:
                proc = None
            with self._lock:
                self._refilling = False
                keep = proc is not None and not self._closed and self._spare is None
                if keep:
                    self._spare = proc
                self._lock.notify_all()
            if proc is not None and not keep:
                _stop(proc)

        threading.Thread(target=spawn, name="rtp-grammar-spare", daemon=True).start()

    def _spawn(self) -> subprocess.Popen:
        """A new child, set up and ready (CompileCrashed if it does not get there)."""
        env = {**os.environ, "RUST_BACKTRACE": "0"}
        proc = subprocess.Popen([sys.executable, "-c", _LAUNCH], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        try:
            _write(proc.stdin, self._setup)
            ready = self._await(proc, _STARTUP_SECONDS)
        except (OSError, CompileTimeout):
            ready = None
        if ready is None:
            _stop(proc)
            raise CompileCrashed()
        return proc

    @staticmethod
    def _await(proc: subprocess.Popen, timeout: float):
        """The child's next frame, or None if it died; CompileTimeout (child stopped) past timeout."""
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                cpu = _cpu_seconds(proc)
                _stop(proc)
                raise CompileTimeout(cpu)
        return _read(proc.stdout)


def _cpu_seconds(proc: subprocess.Popen) -> float | None:
    """The CPU time (user + system) the child has used, from /proc; None where it cannot be read."""
    try:
        with open(f"/proc/{proc.pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        try:
            stream.close()
        except OSError:
            pass


# -- the child ------------------------------------------------------------------------------------------

def _allowed(matcher) -> np.ndarray:
    words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return np.flatnonzero(np.unpackbits(words, bitorder="little"))


def _check(llg, tokenizer, limits, grammar: str, walk: int, seed: int, eos: np.ndarray) -> str | None:
    """Why this grammar cannot run, or None."""
    matcher = llg.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
    if matcher.is_error():
        return matcher.get_error()
    allowed = _allowed(matcher)
    if matcher.is_error() or (not allowed.size and not matcher.is_accepting()):
        return NO_OUTPUT
    rng = np.random.default_rng(seed)
    for _ in range(walk):
        tokens = allowed[~np.isin(allowed, eos)]
        if not tokens.size or matcher.is_stopped():
            return None
        if not matcher.consume_token(int(tokens[rng.integers(tokens.size)])) or matcher.is_error():
            return matcher.get_error()
        allowed = _allowed(matcher)
        if matcher.is_error():
            error = matcher.get_error()
            # a dead end of one branch is not a limit: the model may never take it (and if it does,
            # the request fails alone, as the grammar's fault); a limit trips on every branch alike
            return None if error.startswith("NoExtensionBias") else error
    return None


def _child() -> None:
    import resource

    import llguidance as llg

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    setup = _read(stdin)
    if setup is None:
        return
    memory = setup.get("memory") or 0
    if memory:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    tokenizer = llg.LLTokenizer(setup["tokenizer"], n_vocab=setup["vocab_size"], eos_token=setup["eos"] or None)
    limits = llg.LLParserLimits(**setup["limits"])
    eos = np.asarray(setup["eos"], dtype=np.int64)
    # the first mask over a tokenizer builds its token trie's tables (about half a second): before
    # "ready", so that a spare taking over a killed child answers at once
    _check(llg, tokenizer, limits, llg.LLMatcher.grammar_from_regex("[a-z]+"), 2, 0, eos)
    _write(stdout, {"ready": True})
    while (job := _read(stdin)) is not None:
        started, errors, index = time.perf_counter(), [], -1
        for i, grammar in enumerate(job["grammars"]):
            try:
                error = _check(llg, tokenizer, limits, grammar, job["walk"], job["seed"], eos)
            except Exception as e:  # a panic inside the library is an error like any other
                error = f"{type(e).__name__}: {e}"
            if error is None:
                index = i
                break
            errors.append(error)
        _write(stdout, {"index": index, "errors": errors, "seconds": time.perf_counter() - started})

