"""`rtp route`: the FlexLB master, an OpenAI-compatible front that picks a worker per request.

For each request the master tokenizes the prompt (the model's own tokenizer and chat
template, so its view of a worker's prefix cache is in the worker's tokens), asks the
Router (rtp/router/routing.py) for a prefill worker and a decode worker -- or one
collocated worker -- and proxies the request, relaying the answer as it comes:

    client -> master -> prefill node (x-rtp-decode-peer: the chosen decode node)
                              \\-> decode node streams the continuation back through it

Worker stats come from each node's /rpc/stats, and its liveness from its /health (both
polled every --poll-interval, and once more right after a request a worker served ends,
so the view follows the worker closely without flooding it). A worker whose poll fails
-- no connection, a non-200 answer, an engine that died -- or that could not be
reached for a request leaves the pools until a poll succeeds again.

A request is retried on another worker only where it never reached an engine or the
worker said to come back (`retry_rule`); one that failed inside an engine, or was
refused as bad input, gets the worker's own answer: retrying it would only spread a
request that kills engines. Every error the master writes itself is OpenAI-shaped,
as the workers' are: a body, or an SSE error event when the stream had begun.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable

import httpx
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from rtp.config import RouteConfig
from rtp.http import ClosingStream, HTTPService
from rtp.router.routing import Router, WorkerReport, WorkerView
from rtp.wire import rpc
from rtp.wire.error_body import error_body

log = logging.getLogger("rtp.route")

# -- when a request may go to another worker ------------------------------------------------------

RETRY, RETRY_IF_ALIVE, FINAL = "retry", "retry if alive", "final"

# the request never left the master: no engine saw it
_UNDELIVERED = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# the connection dropped before the status line: a kept-alive connection the worker closed just
# then (harmless), or a worker process that died holding the request -- perhaps of it
_RESET = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


def retry_rule(status: int | None = None, headers=None, error: BaseException | None = None) -> str:
    """What a failed attempt allows: RETRY on another worker, RETRY_IF_ALIVE (only when the worker
    still answers /health), or FINAL (the client gets the worker's answer as it is).

    Retried: no connection at all (error in _UNDELIVERED); a 503 that carries Retry-After, which
    rtp serve sends only for a request no engine has started: its queue or cache is full, it is
    draining, or -- a prefill node -- its decode peer refused the reservation or could not be
    reached (openai_api `_admit`, `_start` and EngineFull; pd.start). A connection reset before
    the status line is retried only while the worker lives: a worker that died holding the
    request may have died of it, and the retry would take the next worker down too.

    Final, because another engine would fail the request the same way (or die of it too):
    - 4xx: the input is bad;
    - 500: the request failed inside an engine;
    - 503 without Retry-After: an engine failure reached this request after it was admitted --
      the engine died (perhaps of it) or a decode node failed it mid-decode (pd.PeerError);
    - 502 and 504: rtp serve never sends them; a proxy in front of a worker does, and it cannot
      say whether the worker had started on the request (a 504 usually means it had, a 502 may be
      a worker that died mid-request), so they pass on as the worker's answer;
    - a read timeout: the worker has the request and is still at it.
    """
    if error is not None:
        return RETRY if isinstance(error, _UNDELIVERED) else RETRY_IF_ALIVE if isinstance(error, _RESET) else FINAL
    if status == 503 and headers is not None and any(k.lower() == "retry-after" for k in headers):
        return RETRY
    return FINAL


def _error(status: int, message: str, retry_after: bool = False) -> Response:
    """An error the master writes itself; retry_after where no engine saw the request (any may later)."""
    return Response(error_body(status, message), status, {"Retry-After": "1"} if retry_after else None,
                    media_type="application/json")


def _message(body: bytes) -> str:
    """The message of a worker's OpenAI-shaped error body, or the start of the body."""
    with contextlib.suppress(Exception):
        return str(json.loads(body)["error"]["message"])
    return body[:200].decode(errors="replace")


class _Worker:
    """One node as the master reaches it: its URL and the router's view of it."""

    def __init__(self, url: str, role: str, router: Router):
        self.url = url.rstrip("/")
        self.role = role
        # the cache's real size arrives with the first stats reply; until then the worker is out
        self.view = router.add_worker(WorkerView(self.url, role, total_blocks=1, block_size=16))
        router.set_healthy(self.url, False)
        self.poll_pending = False
        self.down_why: str | None = "not polled yet"  # why it is out of the pool (None while in it)


class _Retry(Exception):
    """An attempt that failed where retry_rule lets the request go to another worker.
    answer: the worker's own refusal (a 503 with Retry-After), the client's answer if no other
    worker takes the request; None when the worker was not reached."""

    def __init__(self, worker: _Worker, why: str, answer: Response | None = None):
        super().__init__(why)
        self.worker, self.why, self.answer = worker, why, answer


class Master:
    def __init__(self, options: RouteConfig, tokenizer=None, load_tokenizer: Callable[[], object] | None = None):
        """tokenizer: the workers' tokenizer; or load_tokenizer, a function that loads it, run on a
        thread once the master serves (a GGUF's vocabulary takes longer to read than the rest of a
        start: /health answers meanwhile, and requests wait for it)."""
        options.validate()
        self.options = options
        self.tokenizer = tokenizer
        self._load_tokenizer = load_tokenizer
        self._tokenizer_loaded: asyncio.Future | None = None
        self.on_fatal: Callable[[BaseException], None] | None = None  # the tokenizer failed to load
        self.router = Router(options.policy, beta=options.beta, gamma=options.gamma)
        self.pd = bool(options.prefill)
        self.workers: dict[str, _Worker] = {}
        for role, urls in (("prefill", options.prefill), ("decode", options.decode),
                           ("collocated", options.collocated)):
            for url in urls:
                w = _Worker(url, role, self.router)
                self.workers[w.url] = w
        self._client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task] = set()  # the poll loop, single polls, upstream closes
        self.draining = False
        self.failed: BaseException | None = None
        self._metrics()

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        timeout = httpx.Timeout(self.options.request_timeout, connect=5.0)
        self._client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1024,
                                                                              max_keepalive_connections=256))
        await self.poll_all()
        self._spawn(self._poll_loop(), "the poll loop")
        if self.tokenizer is None and self._load_tokenizer is not None:
            self._tokenizer_loaded = asyncio.ensure_future(asyncio.to_thread(self._load_tokenizer))
            self._tokenizer_loaded.add_done_callback(self._tokenizer_done)

    def _tokenizer_done(self, loaded: asyncio.Future) -> None:
        if loaded.cancelled():
            return
        if loaded.exception() is not None:
            log.critical("cannot load the tokenizer: %s", loaded.exception())
            if self.on_fatal is not None:
                self.on_fatal(loaded.exception())
            return
        self.tokenizer = loaded.result()

    async def _await_tokenizer(self):
        """The tokenizer, once loaded (at once after that)."""
        if self.tokenizer is None and self._tokenizer_loaded is not None:
            await asyncio.shield(self._tokenizer_loaded)  # a client that leaves does not cancel the load
        return self.tokenizer

    async def close(self) -> None:
        if self._tokenizer_loaded is not None:
            self._tokenizer_loaded.cancel()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    def _spawn(self, work, what: str) -> asyncio.Task:
        """Run `work` in the background. Its failure is logged here, once (no task's exception goes
        unretrieved), and the set keeps a reference until it ends (the loop keeps only weak ones)."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("%s failed", what, exc_info=t.exception())

        task.add_done_callback(done)
        return task

    # -- worker health and stats -------------------------------------------------------------------

    async def _poll_loop(self) -> None:
        last = None
        while True:
            await asyncio.sleep(self.options.poll_interval)
            try:
                await self.poll_all()
                last = None
            except Exception as e:  # a bug here must not end polling (workers would never come back)
                if repr(e) != last:  # once per distinct failure, not every interval
                    log.exception("polling the workers failed")
                last = repr(e)

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll(w) for w in self.workers.values()))

    async def poll(self, w: _Worker) -> None:
        """Refresh w's view: /health says whether its engine lives (a worker whose engine died still
        answers stats), /rpc/stats its load. Any failure takes it out of the pools until both answer."""
        headers = {"content-type": rpc.CONTENT_TYPE}
        if self.options.rpc_token:
            headers[rpc.TOKEN_HEADER] = self.options.rpc_token
        health, stats = await asyncio.gather(
            self._client.get(w.url + "/health", timeout=5.0),
            self._client.post(w.url + "/rpc/stats", content=rpc.encode(rpc.StatsRequest(version=rpc.RPC_VERSION)),
                              headers=headers, timeout=5.0),
            return_exceptions=True)
        why = _failed_check(health, "/health") or _failed_check(stats, "/rpc/stats")
        if why is None:
            try:
                s = rpc.decode(rpc.WorkerStats, stats.content)
            except rpc.BadRequest as e:
                why = f"/rpc/stats: {e}"
            else:
                if s.role != w.role:
                    why = f"it serves as {s.role!r}, the master has it as {w.role!r}"
        if why is not None:
            self._mark_down(w, why)
            return
        self.router.report(w.view, WorkerReport(
            total_blocks=s.total_blocks, free_blocks=s.free_blocks, block_size=s.block_size,
            queued_prompt_tokens=s.queued_prompt_tokens, running=s.num_running, waiting=s.num_waiting,
            prefill_tokens_per_ms=s.prefill_tokens_per_ms, cached_blocks=s.cached_blocks,
            host_blocks=s.host_blocks, host_saving=s.host_saving, disk_id=s.disk_id, disk_blocks=s.disk_blocks,
            disk_saving=s.disk_saving))
        w.down_why = None
        if not w.view.healthy:
            log.info("worker %s (%s) is up: %d KV blocks of %d tokens", w.url, w.role, s.total_blocks, s.block_size)
            self.router.set_healthy(w.url, True)

    def _mark_down(self, w: _Worker, why: str) -> None:
        if w.view.healthy or why != w.down_why:  # said once per reason, not every poll
            log.warning("worker %s (%s) is out of the pool: %s", w.url, w.role, why)
        w.down_why = why
        if w.view.healthy:
            self.router.set_healthy(w.url, False)

    async def _alive(self, w: _Worker) -> bool:
        try:
            return (await self._client.get(w.url + "/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            return False

    def _poll_soon(self, w: _Worker) -> None:
        """Refresh w's view right after a request it served ends (at most one poll pending)."""
        if not w.poll_pending and self._client is not None:
            w.poll_pending = True

            async def once():
                try:
                    await self.poll(w)
                finally:
                    w.poll_pending = False

            self._spawn(once(), f"a poll of {w.url}")

    # -- the OpenAI routes ---------------------------------------------------------------------------

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", self._proxy("/v1/completions"), methods=["POST"]),
            Route("/v1/chat/completions", self._proxy("/v1/chat/completions"), methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_text, methods=["GET"]),
        ]

    async def health(self, request: Request) -> Response:
        """200 while a request could be served: a usable prefill and decode worker (P/D), or a
        usable collocated one; else 503, saying what is missing."""
        if self.draining:
            return _error(503, "the master is shutting down")
        missing = [role for role in (("prefill", "decode") if self.pd else ("collocated",))
                   if not self.router.candidates(role)]
        if missing:
            return _error(503, f"no healthy {' or '.join(missing)} worker")
        return Response(status_code=200)

    async def models(self, request: Request) -> Response:
        for w in self.workers.values():
            if w.view.healthy:
                try:
                    r = await self._client.get(w.url + "/v1/models", headers=_forwarded(request), timeout=10)
                    return Response(r.content, status_code=r.status_code, media_type="application/json")
                except httpx.HTTPError:
                    continue
        return _error(503, "no healthy worker to list the models", retry_after=True)

    async def metrics_text(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    def _proxy(self, path: str):
        async def endpoint(request: Request) -> Response:
            try:
                return await self.proxy(request, path)
            except ClientDisconnect:
                return Response(status_code=499)
            except Exception as e:  # the master never dies of one request
                log.exception("%s failed", path)
                return _error(500, f"internal error in the master: {e!r}")

        return endpoint

    async def proxy(self, request: Request, path: str) -> Response:
        if self.draining:
            return _error(503, "the master is shutting down", retry_after=True)
        body = await request.body()
        try:
            payload = json.loads(body)
        except ValueError as e:
            return _error(400, f"the body is not valid JSON: {e}")
        if not isinstance(payload, dict):
            return _error(400, "the body must be a JSON object")
        try:
            await self._await_tokenizer()
        except Exception as e:  # noqa: BLE001 -- said once at start (and the master stops)
            return _error(503, f"the master has no tokenizer: {e}")
        tokens = self._prompt_tokens(payload, path)
        max_tokens = payload.get("max_completion_tokens") or payload.get("max_tokens") or 16
        max_tokens = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 16
        stream = bool(payload.get("stream"))
        tried: list[tuple[str, str | None]] = []  # (first worker, decode worker) of each attempt
        failed: _Retry | None = None
        unroutable = None
        for attempt in range(self.options.retries + 1):
            try:
                picked = self._pick(tokens, max_tokens, tried)
            except LookupError as e:
                unroutable = str(e)
                break
            try:
                return await self._forward(request, path, body, picked, tokens, max_tokens, stream)
            except _Retry as f:
                failed = f
                tried.append((picked[0].url, picked[2].url if picked[2] is not None else None))
                if attempt < self.options.retries:
                    self.m_retries.inc()
                    log.warning("retrying a request on another worker: %s did not take it (%s)",
                                f.worker.url, f.why)
        # no worker left to try, or no retry left
        if failed is not None and failed.answer is not None:
            self.m_failures.labels("refused").inc()
            return failed.answer  # the last worker's own "come back later"
        self.m_failures.labels("unreachable" if failed is not None else "no_worker").inc()
        if unroutable is not None:
            why = f"; {failed.worker.url} could not be reached: {failed.why}" if failed is not None else ""
            return _error(503, f"cannot route the request: {unroutable}{why}", retry_after=True)
        return _error(502, f"worker {failed.worker.url} could not be reached: {failed.why}")

    def _prompt_tokens(self, payload: dict, path: str) -> list[int]:
        """The prompt in the model's tokens, for prefix matching; [] when it cannot be built
        (the worker validates the request and answers with its own error)."""
        try:
            if path.endswith("chat/completions"):
                messages = [{"role": m.get("role"), "content": _text(m.get("content"))}
                            for m in payload.get("messages") or []]
                return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                               tokenize=True))
            prompt = payload.get("prompt")
            if isinstance(prompt, list) and prompt:
                prompt = prompt[0]  # batched prompts go to one worker: route by the first
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt)
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return prompt
        except Exception as e:  # noqa: BLE001 -- malformed messages: the worker says what is wrong
            log.debug("no prompt tokens to route by: %r", e)
        return []

    def _pick(self, tokens, max_tokens: int, tried: list[tuple[str, str | None]]):
        """The workers of the next attempt, avoiding those already tried. In P/D a prefill node's
        503 may be its own (full, draining) or its decode peer's (refused, unreachable), so each
        half falls back to a tried worker when its pool has no other, but a pair is tried once."""
        if not self.pd:
            c, hit = self.router.choose_collocated(tokens, exclude=[p for p, _ in tried])
            return self.workers[c.name], hit, None
        p, hit = _avoiding(lambda ex: self.router.choose_prefill(tokens, exclude=ex), [p for p, _ in tried])
        d = _avoiding(lambda ex: self.router.choose_decode(len(tokens), max_tokens, exclude=ex),
                      [d for _, d in tried])
        if (p.name, d.name) in tried:
            raise LookupError("no prefill/decode pair left that has not failed the request")
        return self.workers[p.name], hit, self.workers[d.name]

    async def _forward(self, request: Request, path: str, body: bytes, picked, tokens, max_tokens: int,
                       stream: bool) -> Response:
        """One attempt: the client's answer, or _Retry where retry_rule allows another worker."""
        first, hit, decode = picked
        headers = _forwarded(request)
        if decode is not None:
            headers[rpc.PEER_HEADER] = decode.url
            if self.options.rpc_token:
                headers[rpc.TOKEN_HEADER] = self.options.rpc_token
        router = self.router
        router.prefill_started(first.view, tokens, hit)
        booked = len(tokens) - hit
        expected = router.decode_started(decode.view, len(tokens), max_tokens) if decode is not None else None
        self.m_routed.labels(first.url, first.role).inc()
        if decode is not None:
            self.m_routed.labels(decode.url, "decode").inc()
        state = {"prefilled": False, "generated": 0, "closed": False}

        def prefilled() -> None:
            if not state["prefilled"]:
                state["prefilled"] = True
                router.prefill_finished(first.view, booked)

        def finished() -> None:
            if state["closed"]:
                return
            state["closed"] = True
            prefilled()
            if decode is not None:
                router.decode_finished(decode.view, len(tokens), expected, state["generated"])
                self._poll_soon(decode)
            self._poll_soon(first)

        started = time.perf_counter()
        try:
            upstream = await self._client.send(
                self._client.build_request("POST", first.url + path, content=body, headers=headers), stream=True)
        except httpx.HTTPError as e:
            finished()
            return await self._unanswered(first, e)
        media = upstream.headers.get("content-type", "application/json")
        if not stream or upstream.status_code != 200:
            try:
                content = await upstream.aread()
            except httpx.HTTPError as e:
                finished()
                return self._broken(first, e, "the answer broke off")
            finally:
                await upstream.aclose()
            if upstream.status_code == 200:
                with contextlib.suppress(Exception):
                    state["generated"] = int(json.loads(content)["usage"]["completion_tokens"])
            finished()
            if upstream.status_code != 200:
                if retry_rule(upstream.status_code, upstream.headers) == RETRY:
                    raise _Retry(first, f"it answered {upstream.status_code}: {_message(content)}",
                                 Response(content, upstream.status_code, _passed(upstream.headers), media_type=media))
                if upstream.status_code >= 500:
                    self.m_failures.labels("worker_error").inc()
                    log.warning("worker %s failed a request (%d): %s", first.url, upstream.status_code,
                                _message(content))
                return Response(content, upstream.status_code, _passed(upstream.headers), media_type=media)
            self.m_ttft.observe(time.perf_counter() - started)
            return Response(content, status_code=200, media_type=media)
        # a stream: a status line of 200 means the worker took the request, so no retry from here
        chunks = upstream.aiter_raw()
        try:
            head = await chunks.__anext__()
        except (httpx.HTTPError, StopAsyncIteration) as e:
            await upstream.aclose()
            finished()
            return self._broken(first, e, "the stream ended before its first event")
        prefilled()
        self.m_ttft.observe(time.perf_counter() - started)

        async def relay():
            events = _Events()
            try:
                out = events.whole(head)
                if out:
                    state["generated"] += out.count(b"data: ")
                    yield out
                async for chunk in chunks:
                    out = events.whole(chunk)
                    if out:
                        state["generated"] += out.count(b"data: ")
                        yield out
                if events.tail:
                    yield events.tail
            except httpx.HTTPError as e:
                self.m_failures.labels("stream_broken").inc()
                why = f"worker {first.url} failed mid-stream: {type(e).__name__}"
                log.warning("%s (%s)", why, e)
                if _connection_lost(e):
                    self._mark_down(first, f"{why}: {e}")
                # the incomplete event held back is dropped: the error is an event of its own
                yield b"data: " + error_body(502, why) + b"\n\ndata: [DONE]\n\n"
            finally:
                await upstream.aclose()  # a client that left aborts the request on the worker
                finished()

        def closed() -> None:  # also when the client left before the relay ever ran
            finished()
            if not upstream.is_closed:
                self._spawn(upstream.aclose(), f"closing a stream from {first.url}")

        return ClosingStream(relay(), closed, media)

    async def _unanswered(self, w: _Worker, e: httpx.HTTPError) -> Response:
        """The attempt on w got no status line: raise _Retry where retry_rule allows, else the answer."""
        why = f"{type(e).__name__}: {e}"
        rule = retry_rule(error=e)
        if rule == RETRY_IF_ALIVE:
            if await self._alive(w):  # a kept-alive connection closed under us: the engine is fine
                raise _Retry(w, why)
            self._mark_down(w, f"it dropped a request and is no longer up ({why})")
            self.m_failures.labels("worker_died").inc()
            return _error(502, f"worker {w.url} went down while it held the request ({why}); not retried "
                          "elsewhere, as the request may be what took it down")
        if rule == RETRY:
            self._mark_down(w, why)
            raise _Retry(w, why)
        if isinstance(e, httpx.TimeoutException):
            self.m_failures.labels("timeout").inc()
            return _error(504, f"worker {w.url} did not answer within {self.options.request_timeout:g} s")
        return self._broken(w, e, "the request failed")

    def _broken(self, w: _Worker, e: BaseException, what: str) -> Response:
        """The worker had the request and its answer broke off: the client gets a 502, not a retry."""
        self.m_failures.labels("broken").inc()
        why = f"worker {w.url}: {what}: {type(e).__name__}: {e}"
        if _connection_lost(e):
            self._mark_down(w, why)
        return _error(502, why)

    # -- metrics -------------------------------------------------------------------------------------

    def _metrics(self) -> None:
        self.registry = CollectorRegistry()
        self.m_routed = Counter("rtp:route_requests", "Requests routed to each worker, by role.",
                                ["worker", "role"], registry=self.registry)
        self.m_retries = Counter("rtp:route_retries", "Requests retried on another worker.",
                                 registry=self.registry)
        self.m_failures = Counter("rtp:route_failures", "Requests that failed, by how: refused (the last "
                                  "worker said to come back), unreachable, no_worker, worker_error (a 5xx "
                                  "passed on), worker_died, timeout, broken (an answer broke off), "
                                  "stream_broken.", ["reason"], registry=self.registry)
        self.m_ttft = Histogram("rtp:route_time_to_first_byte_seconds",
                                "Time from routing to the first byte of the answer.",
                                buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60),
                                registry=self.registry)
        self.registry.register(_RouterCollector(self))


class _RouterCollector:
    """Read at scrape time: the router's view of every worker."""

    def __init__(self, master: Master):
        self.master = master

    def collect(self):
        m = self.master
        hit = GaugeMetricFamily("rtp:route_prefix_hit_ratio",
                                "Share of routed prompt tokens the chosen worker was believed to hold.")
        hit.add_metric([], m.router.stats.hit_ratio)
        beta = GaugeMetricFamily("rtp:route_beta", "FlexLB's current beta (moves with --beta auto).")
        beta.add_metric([], float(m.router.beta))
        queue = GaugeMetricFamily("rtp:route_queue_tokens", "Queued prompt tokens the master expects "
                                  "at each worker.", labels=["worker", "role"])
        healthy = GaugeMetricFamily("rtp:route_worker_healthy", "1 while the worker is in its pool.",
                                    labels=["worker", "role"])
        free = GaugeMetricFamily("rtp:route_free_kv_tokens", "Free KV tokens each worker reported.",
                                 labels=["worker", "role"])
        for w in m.workers.values():
            queue.add_metric([w.url, w.role], w.view.queued_tokens)
            healthy.add_metric([w.url, w.role], 1.0 if w.view.healthy else 0.0)
            free.add_metric([w.url, w.role], w.view.free_tokens)
        yield from (hit, beta, queue, healthy, free)


def _text(content) -> str:
    if isinstance(content, list):
        return "\n".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return content or ""


def _forwarded(request: Request) -> dict[str, str]:
    headers = {"content-type": request.headers.get("content-type", "application/json")}
    if "authorization" in request.headers:  # the workers check the client's API key themselves
        headers["authorization"] = request.headers["authorization"]
    return headers


def _passed(headers) -> dict[str, str]:
    """The headers of a worker's error answer the client needs as well."""
    return {k: headers[k] for k in ("retry-after", "www-authenticate") if k in headers}


def _failed_check(answer, what: str) -> str | None:
    """Why one poll request says the worker is out (None: it answered 200)."""
    if isinstance(answer, httpx.HTTPError):
        return f"{what}: {type(answer).__name__}: {answer}"
    if isinstance(answer, BaseException):
        raise answer
    if answer.status_code != 200:
        return f"{what} answered {answer.status_code}: {_message(answer.content)}"
    return None


def _connection_lost(e: BaseException) -> bool:
    return isinstance(e, (httpx.NetworkError, httpx.RemoteProtocolError))


def _avoiding(choose, tried: list):
    """choose(exclude=tried), or choose(exclude=()) when every usable worker was tried."""
    try:
        return choose(tried)
    except LookupError:
        return choose(())


class _Events:
    """Cuts a relayed SSE body at event boundaries, so that an error event the master adds when
    the worker's stream breaks never lands inside a half-relayed event."""

    def __init__(self):
        self.tail = b""

    def whole(self, chunk: bytes) -> bytes:
        """The complete events that chunk finishes; the rest waits in self.tail."""
        data = self.tail + chunk
        end = data.rfind(b"\n\n") + 2
        if end < 2:
            self.tail = data
            return b""
        self.tail = data[end:]
        return data[:end]


def route(options: RouteConfig, load_tokenizer: Callable[[], object]) -> int:
    """Run the master until SIGTERM or Ctrl-C (rtp/http.py: the drain, as `rtp serve`'s); 2 when
    the tokenizer (loaded once the master serves) fails to load."""
    master = Master(options, load_tokenizer=load_tokenizer)
    asyncio.run(_run(master))
    return 2 if master.failed is not None else 0


async def _run(master: Master) -> None:
    o = master.options

    def drain(signame: str) -> None:
        log.info("%s: draining", signame)
        master.draining = True

    service = HTTPService(o.host, o.port, o.grace_period, on_drain=drain)

    def fatal(error: BaseException) -> None:
        master.failed = error
        master.draining = True
        service.stop(grace=0.5)

    master.on_fatal = fatal

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await master.start()
        try:
            yield
        finally:
            await master.close()

    app = Starlette(routes=master.routes(), lifespan=lifespan)
    log.info("routing on http://%s:%d: %s policy, beta %s; %d prefill, %d decode, %d collocated workers",
             o.host, o.port, o.policy, o.beta, len(o.prefill), len(o.decode), len(o.collocated))
    await service.serve(app)
