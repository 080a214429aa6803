"""AsyncEngine: the one holder of the LLMEngine. The engine steps on a thread of its own, and the
event loop reaches it only through the commands below, never by a call into the LLMEngine.

    event loop (HTTP handlers)                    engine thread
    --------------------------                    -------------
    await submit()  ---- "add" ------------------>  admission: check_request; a grammar's compile
                                                    started (compile_grammar), its completion
                                                    posting "compiled" back; then add_request
                    <--- the Stream, or the refusal (InvalidRequest, EngineFull) ---
    abort(), Stream.close()  ---- "abort" ------->  abort_request, or the pending compile cancelled
    await reserve() ---- "reserve" -------------->  admission as above, then reserve_request
    write_kv()      ---- "write_kv" ------------->  write_kv, between steps
    resume()        ---- "resume" --------------->  resume_request
    drop()          ---- "drop" ----------------->  abort_request
                                                    step()  -> text deltas per request
    Stream.put()  <--- call_soon_threadsafe, once per step ---

Admission happens once, here, on the engine side: the server awaits submit() and answers its
refusal as a 400 naming the field (or a 503), so a request that cannot run never gets a 200
status line. A grammar compiles on the compiler's own workers (rtp/engine/grammar/compiler.py),
never on the engine thread, which keeps stepping the other requests meanwhile; a client that
leaves while its grammar compiles cancels that compile.

The loop reads only what this class publishes: facts fixed at load (tokenizer, read-only; the
model's limits; the KV layout), the stats snapshot the thread replaces after every step, and
`dead`. When nothing is running the thread blocks on the command queue, so an idle server burns
no CPU. Commands are taken between steps, so an abort takes effect before the next step and its
KV blocks are free again at once; commands run in the order they were given (a KV write before
the resume that reads it).

The engine's outputs are already per-step deltas (rtp/engine/output.py); the thread only labels
each with the prompt of its stream it belongs to.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from rtp.engine.engine import LLMEngine
from rtp.engine.output import ChoiceDelta, RequestDelta
from rtp.sampling_params import SamplingParams

_MIN_PREFILL_MEASURED = 128  # prompt tokens a step needs to count toward the prefill speed
_FOLLOWERS_CHECKED = 1.0     # seconds between checks that every tensor-parallel follower still runs
log = logging.getLogger("rtp.serve")


@dataclass(slots=True)
class Update:
    """What one engine step produced for one prompt of a stream."""

    prompt: int                       # index of the prompt within the HTTP request
    choices: list[ChoiceDelta]
    num_cached_tokens: int = 0
    finished: bool = False
    error: Exception | None = None    # the prompt failed; its other fields are empty


class EngineDead(RuntimeError):
    """A step failed outside any one request (EngineFatal); nothing more can be trusted to run."""


class Withdrawn(Exception):
    """The request was aborted (drop, abort) while it waited for its grammar: it never ran."""


class Stream:
    """One HTTP request's view of its engine requests (one per prompt), in the loop thread.

    Updates queue up in a list; a reader that falls behind takes them all at once,
    so a slow client costs one wake-up, not one per token.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, prompts: list[list[int]], n: int = 1):
        self.engine = engine
        self.request_id = request_id
        self.prompts = prompts
        self.n = n  # sequences per prompt
        self.arrival = time.monotonic()
        self.first_token: list[float | None] = [None] * len(prompts)
        self.last_token: list[float] = [0.0] * len(prompts)
        self.unfinished = len(prompts)
        self.generated = 0  # tokens, all prompts and choices
        self.closed = False
        self.internal = False  # a prefill-only stream: no client-facing metrics, no request log line
        self._items: list[Update] = []
        self._ready = asyncio.Event()

    def engine_ids(self) -> list[str]:
        return [f"{self.request_id}-{i}" for i in range(len(self.prompts))]

    def put(self, update: Update) -> None:
        self._items.append(update)
        if update.finished:
            self.unfinished -= 1
        self._ready.set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> list[Update]:
        """The updates that arrived since the last call; StopAsyncIteration after the last."""
        while not self._items:
            if self.unfinished == 0 or self.closed:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        items, self._items = self._items, []
        return items

    def close(self) -> None:
        """Abort whatever is still running; safe to call twice and after the end."""
        if not self.closed:
            self.closed = True
            self.engine._close(self)


class AsyncEngine:
    """The engine stepped on a thread of its own. Build it with `load` (the model loads on that
    thread) or hand a built engine to the constructor (tests)."""

    def __init__(self, engine: LLMEngine, metrics=None, _thread: threading.Thread | None = None,
                 _go: threading.Event | None = None):
        self._engine = engine  # the engine thread's alone once start() ran: the loop gives commands
        # facts fixed at load, read here once, before the thread steps: the loop reads these, never the engine
        self.tokenizer = engine.tokenizer  # read-only: the loop tokenizes with it
        self.model_path = engine.model_path
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.kv_layout = engine.kv_layout()  # the engine's own description (P/D turns it into the wire's)
        self.block_size = engine.scheduler.block_size
        self.metrics = metrics            # rtp.server.metrics.ServerMetrics or None
        self.stats: dict = engine.stats()  # replaced (never mutated) by the engine thread
        # measured on the engine thread (exponential moving averages), for the FlexLB master's stats
        self.prefill_tokens_per_ms = 0.0
        self._prefill_tokens = self._prefill_ms = 0.0
        self.decode_step_ms = 0.0
        self.num_unstarted = 0             # sequences (prompts x n) submitted that have no token yet
        self.dead: BaseException | None = None
        # called (on the engine thread) when the engine dies, after every request in flight was
        # failed: the server exits non-zero then, for its supervisor to restart it
        self.on_dead: Callable[[BaseException], None] | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}        # engine request id -> its stream and prompt; engine thread only
        self._pending: dict[str, _Pending] = {}  # engine request id -> its admission waiting for a grammar; likewise
        # tensor-parallel (or expert-parallel) followers this engine started: the thread checks they
        # still run, so an idle server notices a dead rank too (a step with one fails on its own)
        self._watch_followers = engine.config.parallel.ranks > 1
        self._followers_checked = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._go = _go or threading.Event()  # set by start() (or stop()): the thread may run the loop
        self._thread = _thread or threading.Thread(target=self._run, name="rtp-engine", daemon=True)

    @classmethod
    def load(cls, build: Callable[[], LLMEngine], metrics=None) -> "AsyncEngine":
        """Build the engine with `build()` on the thread that will step it; errors re-raised here.

        Why the same thread: libgomp gives each thread that opens a parallel region its own
        worker pool, and once it manages more threads than there are CPUs it stops letting
        idle workers spin. Loading in the main thread and stepping in another made two pools
        on two cores, every parallel region then woke a sleeping worker, and steps ran 1.8x
        slower (845 vs 478 tok/s offline, same engine). With load and steps on one thread
        there is one pool."""
        built: dict = {}
        ready, go = threading.Event(), threading.Event()

        def main() -> None:
            try:
                built["engine"] = build()
            except BaseException as e:
                built["error"] = e
                return
            finally:
                ready.set()
            go.wait()  # set by start() or stop(), after the AsyncEngine below exists
            built["self"]._run()

        thread = threading.Thread(target=main, name="rtp-engine", daemon=True)
        thread.start()
        ready.wait()
        if "error" in built:
            raise built["error"]
        self = cls(built["engine"], metrics, _thread=thread, _go=go)
        built["self"] = self
        return self

    # -- the commands (event loop side) -----------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if not self._thread.is_alive():
            self._thread.start()
        self._go.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever still runs and end the engine thread (from any thread)."""
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._go.set()
            self._thread.join(timeout)

    async def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams, *,
                     client: str = "local", prompt_param: str = "prompt", kv_sink=None) -> Stream:
        """Admit one engine request per prompt (all or none) and return their Stream once they are
        queued; their updates arrive on it. Refused: the engine's exception (InvalidRequest naming
        the field -- prompt_param for the prompt, structured_outputs for the grammar --, EngineFull,
        EngineDead). `client` is who asks, for the grammar compiler's fairness. Cancelled (the
        client left), the request goes wherever it is, its grammar's compile included.
        With a kv_sink (one prompt): prefill only, its KV and first token go to the sink
        (LLMEngine.add_request); such a stream feeds no client-facing metrics."""
        self._raise_if_dead()
        stream = Stream(self, request_id, prompts, params.n)
        stream.internal = kv_sink is not None
        self.num_unstarted += len(prompts) * params.n
        admitted = self._loop.create_future()
        self._commands.put(("add", admitted, stream, prompts, params, client, prompt_param, kv_sink))
        try:
            await admitted
        except BaseException:
            self._withdraw(stream)
            raise
        return stream

    def abort(self, engine_ids: list[str]) -> None:
        """Abort engine requests by their engine ids, wherever they are (a no-op for one that ended)."""
        self._commands.put(("abort", engine_ids))

    async def reserve(self, request_id: str, prompt: list[int], params: SamplingParams, client: str = "peer"):
        """Decode node: admit a prompt prefilled elsewhere and reserve blocks for its KV
        (LLMEngine.reserve_request, after its grammar compiled off the engine thread); its block ids,
        or the engine's exception (MemoryError: too few free blocks now; InvalidRequest). Cancelled,
        the reservation is dropped wherever it is."""
        self._raise_if_dead()
        done = self._loop.create_future()
        self._commands.put(("reserve", done, request_id, prompt, params, client))
        try:
            return await done
        except asyncio.CancelledError:
            self.drop(request_id)  # reserved after the caller left: nobody will push
            raise

    def write_kv(self, engine_id: str, layer: int, blocks, num_tokens: int, kv) -> asyncio.Future:
        """Decode node: write token-major KV of a reserved request's first num_tokens prompt tokens
        into its blocks (LLMEngine.write_kv), between steps. `kv` is not read or kept after the
        returned future is done; it fails with the engine's exception, and the request is then
        dropped (its KV is incomplete: it must never decode)."""
        done = self._loop.create_future()
        self._commands.put(("write_kv", done, engine_id, layer, blocks, num_tokens, kv))
        return done

    def resume(self, request_id: str, prompt: list[int], first_token: int, logprobs, num_cached_tokens: int,
               params: SamplingParams) -> Stream:
        """Decode node: continue a reserved request from its first token; its updates (that token's
        first) arrive on the returned Stream, as for submit()."""
        self._raise_if_dead()
        stream = Stream(self, request_id, [prompt])
        stream.engine_ids = lambda: [request_id]  # the id it was reserved under
        self.num_unstarted += 1
        self._commands.put(("resume", stream, request_id, first_token, logprobs, num_cached_tokens, params))
        return stream

    def drop(self, request_id: str) -> None:
        """Abort an engine request by its engine id, whatever state it is in (reserved included)."""
        self._commands.put(("drop", request_id))

    def deliver(self, stream: Stream, update: Update) -> None:
        """Give a stream an update that did not come from this engine's steps (a relay's, from its
        decode node), counted and logged as the engine's own are."""
        self._deliver([(stream, update)], time.monotonic())

    def _raise_if_dead(self) -> None:
        if self.dead is not None:
            raise EngineDead(f"the engine failed: {self.dead!r}")

    def _withdraw(self, stream: Stream) -> None:
        """A stream that was refused, or whose client left before it was admitted: closed quietly
        (nothing was generated for it), and wherever its requests got to, aborted."""
        if not stream.closed:
            stream.closed = True
            self.num_unstarted -= sum(t is None for t in stream.first_token) * stream.n
            self.abort(stream.engine_ids())

    def _close(self, stream: Stream) -> None:
        unstarted = sum(t is None for t in stream.first_token)
        self.num_unstarted -= unstarted * stream.n
        if stream.unfinished:
            self.abort(stream.engine_ids())
            if stream.internal:
                return  # its PD request logs and counts the abort
            if self.metrics is not None:
                self.metrics.on_abort(stream)
            log.info("request %s aborted after %d generated tokens (client gone or server draining)",
                     stream.request_id, stream.generated)

    def _deliver(self, batch: list[tuple[Stream, Update]], step_started: float) -> None:
        now = time.monotonic()
        for stream, update in batch:
            if stream.closed:
                continue  # the client left; its abort is already queued
            metrics = None if stream.internal else self.metrics
            i = update.prompt
            if stream.first_token[i] is None:
                stream.first_token[i] = now
                self.num_unstarted -= stream.n
                if metrics is not None and update.error is None:
                    metrics.on_first_token(stream, i, now, step_started)
            elif metrics is not None:
                metrics.on_token(now - stream.last_token[i])
            stream.last_token[i] = now
            for choice in update.choices:
                stream.generated += choice.num_tokens
            if metrics is not None:
                metrics.on_update(stream, update, now)
            stream.put(update)
            if stream.unfinished == 0:
                stream.closed = True
                if stream.internal:
                    continue
                log.info("request %s finished: %d prompt + %d generated tokens in %.3f s (first token %.3f s)",
                         stream.request_id, sum(map(len, stream.prompts)), stream.generated,
                         now - stream.arrival, stream.first_token[0] - stream.arrival)

    def _post(self, batch: list[tuple[Stream, Update]], step_started: float) -> None:
        self._call_soon(self._deliver, batch, step_started)

    def _call_soon(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass

    def _settle(self, done: asyncio.Future, result=None, error: BaseException | None = None) -> None:
        """Answer a command's future from the engine thread (a caller that gave up is not answered)."""
        def settle() -> None:
            if done.done():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)

        self._call_soon(settle)

    # -- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._once():
                pass
        except BaseException as e:  # a bug here, not in a request: fail what runs, and exit
            self._die(e)
        finally:
            if self.dead is None:
                self._engine.shutdown()  # stops tensor-parallel followers; nothing without them

    def _once(self) -> bool:
        """Take the waiting commands, then run one step; False once told to stop."""
        # block only when nothing can run: a running batch must not wait for commands
        idle = self.dead is not None or not self._engine.has_unfinished_requests()
        for command in self._take_commands(block=idle):
            if not self._command(command):
                return False
        if self.dead is None and self._engine.has_unfinished_requests():
            self._step()
        if self._watch_followers and self.dead is None:
            self._check_followers()
        self.stats = {**self._engine.stats(), "prefill_tokens_per_ms": self.prefill_tokens_per_ms,
                      "decode_step_ms": self.decode_step_ms}
        return True

    def _command(self, command: tuple) -> bool:
        kind, args = command[0], command[1:]
        if kind == "add":
            self._add(*args)
        elif kind == "compiled":
            self._compiled(*args)
        elif kind == "abort":
            for engine_id in args[0]:
                if self._live.pop(engine_id, None) is not None:
                    self._engine.abort_request(engine_id)
                else:
                    self._cancel_pending(engine_id)
        elif kind == "reserve":
            self._reserve(*args)
        elif kind == "write_kv":
            self._write_kv(*args)
        elif kind == "resume":
            self._resume(*args)
        elif kind == "drop":
            self._live.pop(args[0], None)
            self._cancel_pending(args[0])
            self._engine.abort_request(args[0])
        else:  # stop
            for engine_id in list(self._live):
                self._engine.abort_request(engine_id)
            self._live.clear()
            self._refuse_pending(EngineDead("the server is stopping"))
            return False
        return True

    def _take_commands(self, block: bool) -> list[tuple]:
        commands = []
        if block:
            try:  # with followers to watch, wake up now and then to look at them
                commands.append(self._commands.get(timeout=_FOLLOWERS_CHECKED if self._watch_followers else None))
            except queue.Empty:
                pass
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _check_followers(self) -> None:
        now = time.monotonic()
        if now - self._followers_checked < _FOLLOWERS_CHECKED:
            return
        self._followers_checked = now
        if not self._engine.followers_alive():
            self._die(RuntimeError("a tensor-parallel follower process exited"))

    # admission: a grammar compiles off this thread, then the request goes in

    def _admit(self, engine_ids: list[str], prompts: list[list[int]], params: SamplingParams, client: str,
               prompt_param: str, then: Callable[[], None], refuse: Callable[[BaseException], None]) -> None:
        """Check the request against the model, then run `then` here once its grammar compiled (at
        once without one); `refuse(e)` with why not."""
        if self.dead is not None:
            refuse(EngineDead(f"the engine failed: {self.dead!r}"))
            return
        try:  # before its grammar: a request refused anyway costs no compile
            for ids in prompts:
                self._engine.check_request(ids, params, prompt_param)
        except Exception as e:  # InvalidRequest naming the field; anything else is ours, this request's alone
            refuse(e)
            return
        spec = params.structured_outputs
        if spec is None:
            then()
            return
        try:
            # a Future: the limits are checked here (bounded by --grammar-max-bytes), the compile runs on
            # the compiler's own workers and sandboxes, cached by content (LLMEngine.add_request then
            # finds it done)
            future = self._engine.compile_grammar(spec, client)
        except Exception as e:
            refuse(e)
            return
        pending = _Pending(engine_ids, future, then, refuse)
        if future.done():
            self._compiled(pending)
            return
        for engine_id in engine_ids:
            self._pending[engine_id] = pending
        future.add_done_callback(lambda f: self._commands.put(("compiled", pending)))

    def _compiled(self, pending: _Pending) -> None:
        if pending.withdrawn:
            return  # aborted while it compiled; its compile was cancelled then
        for engine_id in pending.engine_ids:
            self._pending.pop(engine_id, None)
        future = pending.future
        if future.cancelled():  # the compiler closed under it
            pending.refuse(EngineDead("the grammar compiler stopped"))
        elif future.exception() is not None:  # InvalidRequest(param structured_outputs): the server names its field
            pending.refuse(future.exception())
        elif self.dead is not None:
            pending.refuse(EngineDead(f"the engine failed: {self.dead!r}"))
        else:
            pending.then()

    def _cancel_pending(self, engine_id: str) -> None:
        """Withdraw an admission waiting for its grammar: the compile nobody waits for is dropped, or
        killed if it runs (rtp/engine/grammar/compiler.py), and a caller still waiting hears so."""
        pending = self._pending.pop(engine_id, None)
        if pending is None:
            return
        for other in pending.engine_ids:
            self._pending.pop(other, None)
        pending.withdrawn = True
        pending.future.cancel()
        pending.refuse(Withdrawn(f"request {engine_id} was aborted while its grammar compiled"))

    def _refuse_pending(self, error: BaseException) -> None:
        for pending in {id(p): p for p in self._pending.values()}.values():
            pending.withdrawn = True
            pending.future.cancel()
            pending.refuse(error)
        self._pending.clear()

    def _add(self, admitted: asyncio.Future, stream: Stream, prompts: list[list[int]], params: SamplingParams,
             client: str, prompt_param: str, kv_sink=None) -> None:
        def refuse(error: BaseException) -> None:
            self._settle(admitted, error=error)

        def add() -> None:
            added = []
            try:
                for engine_id, ids in zip(stream.engine_ids(), prompts):
                    if kv_sink is None:
                        self._engine.add_request(engine_id, ids, params)
                    else:
                        self._engine.add_request(engine_id, ids, params, kv_sink=kv_sink)
                    added.append(engine_id)
            except Exception as e:  # EngineFull, InvalidRequest, or ours: this request alone, all its prompts
                for engine_id in added:
                    self._engine.abort_request(engine_id)
                refuse(e)
                return
            for prompt, engine_id in enumerate(added):
                self._live[engine_id] = _Live(stream, prompt)
            self._settle(admitted, stream)

        self._admit(stream.engine_ids(), prompts, params, client, prompt_param, add, refuse)

    def _reserve(self, done: asyncio.Future, request_id: str, prompt: list[int], params: SamplingParams,
                 client: str) -> None:
        def refuse(error: BaseException) -> None:
            self._settle(done, error=error)

        def reserve() -> None:
            try:
                blocks = self._engine.reserve_request(request_id, prompt, params)
            except Exception as e:  # MemoryError (full now) and ValueError (never) alike: this request alone
                refuse(e)
                return
            self._settle(done, blocks)

        self._admit([request_id], [prompt], params, client, "prompt_token_ids", reserve, refuse)

    def _write_kv(self, done: asyncio.Future, engine_id: str, layer: int, blocks, num_tokens: int, kv) -> None:
        try:
            self._engine.write_kv(layer, blocks, num_tokens, kv)
        except Exception as e:  # this reservation's alone: its KV is incomplete, so it goes
            self._engine.abort_request(engine_id)
            self._settle(done, error=e)
            return
        self._settle(done)

    def _resume(self, stream: Stream, request_id: str, first_token: int, logprobs, num_cached_tokens: int,
                params: SamplingParams) -> None:
        try:
            out = self._engine.resume_request(request_id, first_token, logprobs, num_cached_tokens)
        except Exception as e:  # unknown, expired or a token that cannot continue it
            self._engine.abort_request(request_id)  # a reservation it left behind goes back to the pool
            self._post([(stream, Update(0, [], finished=True, error=e))], time.monotonic())
            return
        live = _Live(stream, 0)
        update = live.update(out)  # the first token now, not after the next step
        if not update.finished:
            self._live[request_id] = live
        self._post([(stream, update)], time.monotonic())

    def _step(self) -> None:
        started = time.monotonic()
        try:
            outputs = self._engine.step()
            self._measure(time.monotonic() - started)
        except Exception as e:
            # not attributable to one request (the engine fails those alone and steps on), so
            # nothing more can be trusted to run: fail them all, and let the server exit
            self._die(e)
            return
        batch = []
        for delta in outputs:
            live = self._live.get(delta.request_id)
            if live is None:
                continue
            update = live.update(delta)
            batch.append((live.stream, update))
            if update.finished:
                del self._live[delta.request_id]
        if batch:
            self._post(batch, started)

    def _measure(self, seconds: float) -> None:
        """Prefill speed (prompt tokens per ms over recent steps with at least 128 of them) and
        decode step time (decode-only steps), as moving averages: what the master divides
        queues by."""
        scheduler = getattr(self._engine, "scheduler", None)
        plan = getattr(scheduler, "plan", None)
        if plan is None:  # an engine without rtp's runtime (a test's stub) reports no speeds
            return
        prefill = plan.num_tokens - plan.num_decode_rows
        ms = max(seconds * 1000.0, 1e-3)
        if prefill >= _MIN_PREFILL_MEASURED:
            # a ratio of moving sums, not a moving average of per-step rates, and only steps with
            # enough prompt tokens: a step of 5 says little about speed (its fixed cost dominates)
            self._prefill_tokens = 0.8 * self._prefill_tokens + prefill
            self._prefill_ms = 0.8 * self._prefill_ms + ms
            self.prefill_tokens_per_ms = self._prefill_tokens / self._prefill_ms
        elif prefill == 0 and plan.num_rows:
            self.decode_step_ms = ms if not self.decode_step_ms else 0.8 * self.decode_step_ms + 0.2 * ms

    def _die(self, error: BaseException) -> None:
        # one record, its first line the cause, for whoever is paged; the traceback follows it
        log.critical("engine failed, no more requests can run: %s", error, exc_info=error)
        self.dead = error
        dead = EngineDead(repr(error))
        self._post([(live.stream, Update(live.prompt, [], finished=True, error=dead))
                    for live in self._live.values()], time.monotonic())
        self._live.clear()
        self._refuse_pending(dead)
        if self.on_dead is not None:
            self.on_dead(error)


class _Pending:
    """An admission waiting for its grammar's compile, on the engine thread: `then` adds the request
    once it compiled, `refuse` answers the caller otherwise."""

    __slots__ = ("engine_ids", "future", "refuse", "then", "withdrawn")

    def __init__(self, engine_ids: list[str], future: Future, then: Callable[[], None],
                 refuse: Callable[[BaseException], None]):
        self.engine_ids = engine_ids
        self.future = future
        self.then = then
        self.refuse = refuse
        self.withdrawn = False  # aborted meanwhile: its completion is ignored

class _Live:
    """A running engine request, in the engine thread: the stream and prompt its deltas go to."""

    __slots__ = ("prompt", "stream")

    def __init__(self, stream: Stream, prompt: int):
        self.stream = stream
        self.prompt = prompt

    def update(self, delta: RequestDelta) -> Update:
        return Update(self.prompt, delta.choices, delta.num_cached_tokens, delta.finished, delta.error)
