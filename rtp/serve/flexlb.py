"""`rtp route`: the FlexLB master, an OpenAI-compatible front that picks a worker per request.

For each request the master tokenizes the prompt (the model's own tokenizer and chat
template, so its view of a worker's prefix cache is in the worker's tokens), asks the
Router (rtp/serve/routing.py) for a prefill worker and a decode worker -- or one
collocated worker -- and proxies the request, relaying the answer as it comes:

    client -> master -> prefill node (x-rtp-decode-peer: the chosen decode node)
                              \\-> decode node streams the continuation back through it

Worker stats come from each node's /rpc/stats (polled every --poll-interval, and once
more right after a request a worker served ends, so the view follows the worker
closely without flooding it). A worker that fails a poll or a request leaves the
pools until a poll succeeds again. A request whose worker fails before a byte of the
answer reached the client is retried once on another worker; after that it fails
with a clear error -- a 502 body, or an SSE error event when the stream had begun.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field

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
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rtp.serve import rpc
from rtp.serve.routing import Router, WorkerReport, WorkerView
from rtp.serve.streams import ClosingStream

log = logging.getLogger("rtp.route")

_RETRYABLE_STATUS = (502, 503, 504)  # the worker refused (draining, decode peer unreachable, full)


@dataclass
class RouteOptions:
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    collocated: list[str] = field(default_factory=list)
    policy: str = "flexlb"
    beta: float | str = 0.65
    gamma: float = 1.0
    rpc_token: str | None = None
    poll_interval: float = 0.5
    request_timeout: float = 600.0
    retries: int = 1
    host: str = "127.0.0.1"
    port: int = 8080
    grace_period: float = 30.0

    def validate(self) -> None:
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("prefill/decode routing needs both --prefill and --decode workers")
        if not (self.prefill or self.collocated):
            raise ValueError("no workers: give --prefill and --decode URLs, or --collocated URLs")
        urls = self.prefill + self.decode + self.collocated
        if len(set(urls)) != len(urls):
            raise ValueError("a worker URL appears twice")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker URL {url!r} must start with http:// or https://")
        if self.poll_interval <= 0:
            raise ValueError("--poll-interval must be positive")


class _Worker:
    """One node as the master reaches it: its URL and the router's view of it."""

    def __init__(self, url: str, role: str, router: Router):
        self.url = url.rstrip("/")
        self.role = role
        # the cache's real size arrives with the first stats reply; until then the worker is out
        self.view = router.add_worker(WorkerView(self.url, role, total_blocks=1, block_size=16))
        router.set_healthy(self.url, False)
        self.poll_pending = False


class _Failed(Exception):
    """A worker failed the request before a byte reached the client: it may be retried.
    status and body are the worker's answer; None when no answer came (it is unreachable)."""

    def __init__(self, worker: _Worker, why: str, status: int | None = None, body: bytes | None = None):
        super().__init__(why)
        self.worker, self.why, self.status, self.body = worker, why, status, body


class Master:
    def __init__(self, options: RouteOptions, tokenizer):
        options.validate()
        self.options = options
        self.tokenizer = tokenizer
        self.router = Router(options.policy, beta=options.beta, gamma=options.gamma)
        self.pd = bool(options.prefill)
        self.workers: dict[str, _Worker] = {}
        for role, urls in (("prefill", options.prefill), ("decode", options.decode),
                           ("collocated", options.collocated)):
            for url in urls:
                w = _Worker(url, role, self.router)
                self.workers[w.url] = w
        self._client: httpx.AsyncClient | None = None
        self._poller: asyncio.Task | None = None
        self.draining = False
        self._metrics()

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        timeout = httpx.Timeout(self.options.request_timeout, connect=5.0)
        self._client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1024,
                                                                              max_keepalive_connections=256))
        await self.poll_all()
        self._poller = asyncio.create_task(self._poll_loop())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._client is not None:
            await self._client.aclose()

    # -- worker stats --------------------------------------------------------------------------------

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.options.poll_interval)
            await self.poll_all()

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll(w) for w in self.workers.values()))

    async def poll(self, w: _Worker) -> None:
        headers = {"content-type": rpc.CONTENT_TYPE}
        if self.options.rpc_token:
            headers[rpc.TOKEN_HEADER] = self.options.rpc_token
        try:
            r = await self._client.post(w.url + "/rpc/stats", content=rpc.encode(
                rpc.StatsRequest(version=rpc.RPC_VERSION)), headers=headers, timeout=5.0)
            if r.status_code != 200:
                raise RuntimeError(f"stats answered {r.status_code}: {r.text[:200]}")
            s = rpc.decode(rpc.WorkerStats, r.content)
        except Exception as e:  # noqa: BLE001 -- any failure takes the worker out until it answers again
            self._mark_down(w, f"stats: {e!r}")
            return
        if s.role != w.role:
            self._mark_down(w, f"it serves as {s.role!r}, the master has it as {w.role!r}")
            return
        w.view.apply_report(WorkerReport(
            total_blocks=s.total_blocks, free_blocks=s.free_blocks, block_size=s.block_size,
            queued_prompt_tokens=s.queued_prompt_tokens, running=s.num_running, waiting=s.num_waiting,
            prefill_tokens_per_ms=s.prefill_tokens_per_ms, cached_blocks=s.cached_blocks))
        if not w.view.healthy:
            log.info("worker %s (%s) is up: %d KV blocks of %d tokens", w.url, w.role, s.total_blocks, s.block_size)
            self.router.set_healthy(w.url, True)

    def _mark_down(self, w: _Worker, why: str) -> None:
        if w.view.healthy:
            log.warning("worker %s (%s) is out of the pool: %s", w.url, w.role, why)
            self.router.set_healthy(w.url, False)

    def _poll_soon(self, w: _Worker) -> None:
        """Refresh w's view right after a request it served ends (at most one poll pending)."""
        if not w.poll_pending and self._client is not None:
            w.poll_pending = True

            async def once():
                try:
                    await self.poll(w)
                finally:
                    w.poll_pending = False

            asyncio.get_running_loop().create_task(once())

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
        return _error(503, "no healthy worker to list the models")

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
            return _error(503, "the master is shutting down")
        body = await request.body()
        try:
            payload = json.loads(body)
        except ValueError as e:
            return _error(400, f"the body is not valid JSON: {e}")
        if not isinstance(payload, dict):
            return _error(400, "the body must be a JSON object")
        tokens = self._prompt_tokens(payload, path)
        max_tokens = payload.get("max_completion_tokens") or payload.get("max_tokens") or 16
        max_tokens = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 16
        stream = bool(payload.get("stream"))
        tried: list[str] = []
        for attempt in range(self.options.retries + 1):
            try:
                picked = self._pick(tokens, max_tokens, tried)
            except LookupError as e:
                return _error(503, f"cannot route the request: {e}")
            try:
                return await self._forward(request, path, body, picked, tokens, max_tokens, stream)
            except _Failed as f:
                tried.append(f.worker.url)
                if f.status is None:  # not reachable: out of the pool until a poll answers
                    self._mark_down(f.worker, f.why)
                if attempt < self.options.retries:
                    self.m_retries.inc()
                    log.warning("retrying a request on another worker: %s failed it (%s)", f.worker.url, f.why)
                    continue
                self.m_failures.labels("worker_failed").inc()
                if f.body is not None:  # the worker's own refusal, relayed
                    return Response(f.body, status_code=f.status, media_type="application/json")
                return _error(502, f"worker {f.worker.url} failed the request: {f.why}")
        raise AssertionError("unreachable")

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

    def _pick(self, tokens, max_tokens: int, tried: list[str]):
        if self.pd:
            p, hit = self.router.choose_prefill(tokens, exclude=tried)
            d = self.router.choose_decode(len(tokens), max_tokens, exclude=tried)
            return self.workers[p.name], hit, self.workers[d.name]
        c, hit = self.router.choose_collocated(tokens, exclude=tried)
        return self.workers[c.name], hit, None

    async def _forward(self, request: Request, path: str, body: bytes, picked, tokens, max_tokens: int,
                       stream: bool) -> Response:
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
            raise _Failed(first, f"{type(e).__name__}: {e}") from None
        if upstream.status_code in _RETRYABLE_STATUS:
            content = await upstream.aread()
            await upstream.aclose()
            finished()
            raise _Failed(first, f"it answered {upstream.status_code}: {content[:200]!r}",
                          status=upstream.status_code, body=content)
        media = upstream.headers.get("content-type", "application/json")
        if not stream or upstream.status_code != 200:
            try:
                content = await upstream.aread()
            except httpx.HTTPError as e:
                finished()
                raise _Failed(first, f"the answer broke off: {e!r}") from None
            finally:
                await upstream.aclose()
            if upstream.status_code == 200:
                with contextlib.suppress(Exception):
                    state["generated"] = int(json.loads(content)["usage"]["completion_tokens"])
            finished()
            self.m_ttft.observe(time.perf_counter() - started)
            return Response(content, status_code=upstream.status_code, media_type=media)
        # a stream: the first chunk decides whether a retry is still possible
        chunks = upstream.aiter_raw()
        try:
            head = await chunks.__anext__()
        except (httpx.HTTPError, StopAsyncIteration) as e:
            await upstream.aclose()
            finished()
            raise _Failed(first, f"the stream ended before its first byte: {e!r}") from None
        prefilled()
        self.m_ttft.observe(time.perf_counter() - started)

        async def relay():
            try:
                yield head
                state["generated"] += head.count(b"data: ")
                async for chunk in chunks:
                    state["generated"] += chunk.count(b"data: ")
                    yield chunk
            except httpx.HTTPError as e:
                self.m_failures.labels("stream_broken").inc()
                log.warning("worker %s broke a stream after it started: %r", first.url, e)
                error = {"error": {"message": f"worker {first.url} failed mid-stream: {type(e).__name__}",
                                   "type": "upstream_error", "code": 502}}
                yield b"data: " + json.dumps(error).encode() + b"\n\n"
            finally:
                await upstream.aclose()  # a client that left aborts the request on the worker
                finished()

        def closed() -> None:  # also when the client left before the relay ever ran
            finished()
            if not upstream.is_closed:
                asyncio.get_running_loop().create_task(upstream.aclose())

        return ClosingStream(relay(), closed, media)

    # -- metrics -------------------------------------------------------------------------------------

    def _metrics(self) -> None:
        self.registry = CollectorRegistry()
        self.m_routed = Counter("rtp:route_requests", "Requests routed to each worker, by role.",
                                ["worker", "role"], registry=self.registry)
        self.m_retries = Counter("rtp:route_retries", "Requests retried on another worker.",
                                 registry=self.registry)
        self.m_failures = Counter("rtp:route_failures", "Requests that failed at a worker, by how.",
                                  ["reason"], registry=self.registry)
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


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "routing_error", "code": status}},
                        status_code=status)


def route(options: RouteOptions, tokenizer) -> int:
    """Run the master until SIGTERM or Ctrl-C."""
    asyncio.run(_run(Master(options, tokenizer)))
    return 0


async def _run(master: Master) -> None:
    import signal

    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await master.start()
        try:
            yield
        finally:
            await master.close()

    o = master.options
    config = Config()
    config.bind = [f"{o.host}:{o.port}"]
    config.graceful_timeout = o.grace_period
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    stop = asyncio.Event()

    def drain(signame: str) -> None:
        log.info("%s: draining", signame)
        master.draining = True
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, drain, sig.name)
    app = Starlette(routes=master.routes(), lifespan=lifespan)
    log.info("routing on http://%s:%d: %s policy, beta %s; %d prefill, %d decode, %d collocated workers",
             o.host, o.port, o.policy, o.beta, len(o.prefill), len(o.decode), len(o.collocated))
    await hypercorn_serve(app, config, shutdown_trigger=stop.wait)

