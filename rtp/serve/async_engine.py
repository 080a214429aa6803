"""AsyncEngine: the LLMEngine on its own thread, fed and drained from the event loop.

    event loop (HTTP handlers)                 engine thread
    --------------------------                 -------------
    submit() / abort()  --- commands (SimpleQueue) --->  add_request / abort_request
                                                          step()  -> text deltas per request
    Stream.put()  <--- call_soon_threadsafe, once per step ---

The engine thread owns the LLMEngine outright; the loop never touches it (only the
tokenizer, which is read-only, and the stats snapshot the thread publishes). When
nothing is running the thread blocks on the command queue, so an idle server
burns no CPU. Commands are taken between steps, so an abort takes effect before
the next step and its KV blocks are free again at once.

The engine's outputs are already per-step deltas (rtp/engine/output.py); the thread
only labels each with the prompt of its stream it belongs to.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from rtp.engine.engine import LLMEngine
from rtp.engine.output import ChoiceDelta, RequestDelta
from rtp.sampling_params import SamplingParams

_MIN_PREFILL_MEASURED = 128  # prompt tokens a step needs to count toward the prefill speed
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
        self.engine = engine
        self.tokenizer = engine.tokenizer  # read-only: the loop tokenizes with it
        self.model_path = engine.model_path
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.metrics = metrics            # rtp.serve.metrics.ServerMetrics or None
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
        self._live: dict[str, _Live] = {}  # engine request id -> its stream and prompt; engine thread only
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

    # -- event loop side ------------------------------------------------------------------------

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

    def check_request(self, prompt_ids: list[int], params: SamplingParams, prompt_param: str = "prompt") -> None:
        """LLMEngine.check_request, from the loop: it reads only limits fixed at load."""
        self.engine.check_request(prompt_ids, params, prompt_param)

    def compile_grammar(self, spec, client: str = "local"):
        """LLMEngine.compile_grammar, from the loop: a future from the compiler's own workers."""
        return self.engine.compile_grammar(spec, client)

    def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
               kv_sink=None) -> Stream:
        """Queue one engine request per prompt; their updates arrive on the returned Stream.
        With a kv_sink (one prompt): prefill only, its KV and first token go to the sink
        (LLMEngine.add_request); such a stream feeds no client-facing metrics."""
        if self.dead is not None:
            raise EngineDead(f"the engine failed: {self.dead!r}")
        stream = Stream(self, request_id, prompts, params.n)
        stream.internal = kv_sink is not None
        self.num_unstarted += len(prompts) * params.n
        for i, (engine_id, ids) in enumerate(zip(stream.engine_ids(), prompts)):
            self._commands.put(("add", stream, i, engine_id, ids, params, kv_sink))
        return stream

    async def reserve(self, request_id: str, prompt: list[int], params: SamplingParams):
        """Decode node: reserve blocks for a prompt prefilled elsewhere (LLMEngine.reserve_request);
        its block ids, or the engine's exception (MemoryError: too few free blocks now)."""
        if self.dead is not None:
            raise EngineDead(f"the engine failed: {self.dead!r}")
        done = asyncio.get_running_loop().create_future()
        self._commands.put(("reserve", done, request_id, prompt, params))
        return await done

    def resume(self, request_id: str, prompt: list[int], first_token: int, logprobs, num_cached_tokens: int,
               params: SamplingParams) -> Stream:
        """Decode node: continue a reserved request from its first token; its updates (that token's
        first) arrive on the returned Stream, as for submit()."""
        if self.dead is not None:
            raise EngineDead(f"the engine failed: {self.dead!r}")
        stream = Stream(self, request_id, [prompt])
        stream.engine_ids = lambda: [request_id]  # the id it was reserved under
        self.num_unstarted += 1
        self._commands.put(("resume", stream, request_id, first_token, logprobs, num_cached_tokens, params))
        return stream

    def drop(self, request_id: str) -> None:
        """Abort an engine request by its engine id, whatever state it is in (reserved included)."""
        self._commands.put(("drop", request_id))

    def _close(self, stream: Stream) -> None:
        unstarted = sum(t is None for t in stream.first_token)
        self.num_unstarted -= unstarted * stream.n
        if stream.unfinished:
            self._commands.put(("abort", stream.engine_ids()))
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
        try:
            self._loop.call_soon_threadsafe(self._deliver, batch, step_started)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass

    # -- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._once():
                pass
        except BaseException as e:  # a bug here, not in a request: fail what runs, and exit
            self._die(e)
        finally:
            if self.dead is None:
                self.engine.shutdown()  # stops tensor-parallel followers; nothing without them

    def _once(self) -> bool:
        """Take the waiting commands, then run one step; False once told to stop."""
        # block only when nothing can run: a running batch must not wait for commands
        idle = self.dead is not None or not self.engine.has_unfinished_requests()
        for command in self._take_commands(block=idle):
            if command[0] == "add":
                self._add(*command[1:])
            elif command[0] == "reserve":
                self._reserve(*command[1:])
            elif command[0] == "resume":
                self._resume(*command[1:])
            elif command[0] == "drop":
                self._live.pop(command[1], None)
                self.engine.abort_request(command[1])
            elif command[0] == "abort":
                for engine_id in command[1]:
                    if self._live.pop(engine_id, None) is not None:
                        self.engine.abort_request(engine_id)
            else:  # stop
                for engine_id in list(self._live):
                    self.engine.abort_request(engine_id)
                self._live.clear()
                return False
        if self.dead is None and self.engine.has_unfinished_requests():
            self._step()
        self.stats = {**self.engine.stats(), "prefill_tokens_per_ms": self.prefill_tokens_per_ms,
                      "decode_step_ms": self.decode_step_ms}
        return True

    def _take_commands(self, block: bool) -> list[tuple]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _reserve(self, done: asyncio.Future, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        def settle(result=None, error=None):
            if done.done():
                return  # the caller gave up (cancelled): the engine request is dropped by its abort
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)

        try:
            blocks = self.engine.reserve_request(request_id, prompt, params)
        except Exception as e:  # MemoryError (full now) and ValueError (never) alike: this request alone
            self._loop.call_soon_threadsafe(settle, None, e)
            return
        self._loop.call_soon_threadsafe(settle, blocks)

    def _resume(self, stream: Stream, request_id: str, first_token: int, logprobs, num_cached_tokens: int,
                params: SamplingParams) -> None:
        try:
            out = self.engine.resume_request(request_id, first_token, logprobs, num_cached_tokens)
        except Exception as e:  # unknown, expired or a token that cannot continue it
            self.engine.abort_request(request_id)  # a reservation it left behind goes back to the pool
            self._post([(stream, Update(0, [], finished=True, error=e))], time.monotonic())
            return
        live = _Live(stream, 0)
        update = live.update(out)  # the first token now, not after the next step
        if not update.finished:
            self._live[request_id] = live
        self._post([(stream, update)], time.monotonic())

    def _add(self, stream: Stream, prompt: int, engine_id: str, ids: list[int],
             params: SamplingParams, kv_sink=None) -> None:
        if self.dead is not None:
            self._post([(stream, Update(prompt, [], finished=True, error=EngineDead(repr(self.dead))))],
                       time.monotonic())
            return
        try:
            if kv_sink is None:
                self.engine.add_request(engine_id, ids, params)
            else:
                self.engine.add_request(engine_id, ids, params, kv_sink=kv_sink)
        except Exception as e:  # ValueError: the input; anything else: ours. Either way this request alone.
            self._post([(stream, Update(prompt, [], finished=True, error=e))], time.monotonic())
            return
        self._live[engine_id] = _Live(stream, prompt)

    def _step(self) -> None:
        started = time.monotonic()
        try:
            outputs = self.engine.step()
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
        scheduler = getattr(self.engine, "scheduler", None)
        if scheduler is None:  # an engine without rtp's runtime (a test's stub) reports no speeds
            return
        plan = scheduler.plan
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
        if self.on_dead is not None:
            self.on_dead(error)


class _Live:
    """A running engine request, in the engine thread: the stream and prompt its deltas go to."""

    __slots__ = ("prompt", "stream")

    def __init__(self, stream: Stream, prompt: int):
        self.stream = stream
        self.prompt = prompt

    def update(self, delta: RequestDelta) -> Update:
        return Update(self.prompt, delta.choices, delta.num_cached_tokens, delta.finished, delta.error)
