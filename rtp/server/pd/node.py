"""Prefill/decode disaggregation: the RPC routes of a node, and the prefill node's relay.

One request, prefill node P and decode node D (both `rtp serve`, rpc.py for the wire):

    client -> P  OpenAI route
    P            admission    P's engine checks the request and compiles its grammar (a 400 if it
                              refuses), and queues the prefill at once
    P -> D       reserve      meanwhile D admits it too and holds blocks for the prompt under a lease
                              (503 to the client if D is unreachable or refuses; P retries a full D
                              for up to reserve_wait)
    P            prefill      its prefix cache first; each layer's KV is copied out as soon as the
                              layer has written it (kv_transfer.LayerTaps), waits until the
                              reservation is there ...
    P -> D       push_kv      ... and streamed to D while later layers compute; D writes each layer
                              into the reserved blocks as it arrives; every frame renews the lease
    P            first token  sampled; P's blocks are free at once (the prompt stays in its cache)
    P -> D       decode       first token + logprobs; D continues exactly there and streams deltas
    D -> P -> client          relayed as they come (SSE or one JSON body)

A first token that already ends the request (eos, a stop string, max_tokens 1) is answered
by P itself, and D's reservation aborted. Faults: a push that breaks returns D's blocks at
once (and the lease returns them when nothing arrives at all); a broken decode stream
fails the client's request with 503; a client that leaves aborts on P and, through the
abort RPC, on D.

Aborts reach D in every interleaving. On P a closed relay is final: its clean-up runs however
its task ends (cancelled before its first step included), and the relay checks `closed` after
every wait, since a cancellation can be swallowed by a task it waits on (Python 3.11's
wait_for returns a result that arrived with the cancellation). The abort RPC is retried. On D
an abort is remembered for a while, so a reservation it overtook (the reserve still in flight)
is dropped as it lands; a decode stream whose reader leaves (closed connection) aborts too.

Authentication: with --rpc-token, the `x-rtp-rpc-token` header; else with --api-key, the API
key as `Authorization: Bearer`; else none (a warning at start). It is checked before a body is
read, and a body is bounded by its Content-Length at once and counted as it streams.

This file is the node: its RPC routes and what it keeps per request. D's side of the
KV hand-off (the pushes that fill reservations, the KV port) is kv_intake.py; P's relay
through D is relay.py; what they share with the node (the reservations, the relays, the
client to the peers) is the PDContext of context.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from rtp.http import ClosingStream
from rtp.sampling_params import SamplingParams
from rtp.server.async_engine import AsyncEngine, EngineDead, Stream, Update, Withdrawn
from rtp.server.pd.context import PDContext, PeerError, Reservation
from rtp.server.pd.kv_intake import Intake, KVPort, Refused
from rtp.server.pd.relay import Relay, Sink
from rtp.wire import rpc
from rtp.wire.kv_layout import KVLayout

log = logging.getLogger("rtp.serve.pd")

ROLES = ("collocated", "prefill", "decode")
_ABORTS_REMEMBERED = 65536  # request ids whose abort a decode node keeps (for at least _ABORT_MEMORY seconds)
_ABORT_MEMORY = 60.0


class Aborted(Exception):
    """The prefill node aborted a request this node was decoding for it."""


class PDNode:
    """What a node does for prefill/decode disaggregation, whatever its role: the RPC routes
    (stats and abort everywhere; reserve, push_kv and decode on a decode node) and, on a
    prefill node, the relay of OpenAI requests through a decode node."""

    def __init__(self, engine: AsyncEngine, metrics, *, role: str = "collocated", model_name: str,
                 token: str | None = None, api_key: str | None = None, decode_peer: str | None = None,
                 lease_seconds: float = 10.0, reserve_wait: float = 10.0, decode_read_timeout: float = 120.0,
                 kv_timeout: float = 30.0):
        """token: the RPC token (--rpc-token); api_key: the API key, which the RPC routes want instead
        when there is no token. kv_timeout: seconds a KV port connection may go without completing
        a frame (idle, or a frame that trickles) before it is closed."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        self.engine = engine
        self.metrics = metrics
        self.role = role
        self.model_name = model_name
        self.token = token
        self.api_key = api_key
        self.decode_peer = decode_peer.rstrip("/") if decode_peer else None
        self.lease_seconds = lease_seconds
        self.reserve_wait = reserve_wait
        self.decode_read_timeout = decode_read_timeout
        self.kv_timeout = kv_timeout
        self.layout: KVLayout = wire_layout(engine.kv_layout)
        self.block_size = engine.block_size
        self.ctx = PDContext(engine, metrics, self.layout, lease_seconds, decode_read_timeout, self._credentials())
        self._reservations: dict[str, Reservation] = self.ctx.reservations  # decode: by request id
        self._relays: dict[str, Relay] = self.ctx.relays                     # prefill: by request id
        self._decoding: dict[str, Stream] = {}             # decode: resumed requests, by request id
        self._aborted: OrderedDict[str, float] = OrderedDict()  # decode: request id -> when its abort came
        self._reaper: asyncio.Task | None = None
        self._kv_server: asyncio.Server | None = None
        self.kv_port = 0  # decode: the bound KV port (0: none)

    async def open_kv_port(self, host: str, kv_port: int = 0) -> None:
        """On a decode node, open the KV port (kv_port 0: any free one; -1: none, KV over HTTP only)."""
        if self.role != "decode" or kv_port < 0:
            return
        loop = asyncio.get_running_loop()
        self._kv_server = await loop.create_server(lambda: KVPort(self.ctx, self.kv_timeout), host.strip("[]"), kv_port)
        self.kv_port = self._kv_server.sockets[0].getsockname()[1]
        log.info("KV port %d", self.kv_port)

    # -- routes -------------------------------------------------------------------------------

    def routes(self) -> list[Route]:
        rpc_route = self._rpc
        return [
            Route("/rpc/stats", rpc_route(self.rpc_stats, rpc.StatsRequest), methods=["POST"]),
            Route("/rpc/reserve", rpc_route(self.rpc_reserve, rpc.ReserveRequest, decode_only=True),
                  methods=["POST"]),
            Route("/rpc/push_kv", rpc_route(self.rpc_push_kv, None, decode_only=True), methods=["POST"]),
            Route("/rpc/decode", rpc_route(self.rpc_decode, rpc.DecodeRequest, decode_only=True),
                  methods=["POST"]),
            Route("/rpc/abort", rpc_route(self.rpc_abort, rpc.AbortRequest), methods=["POST"]),
        ]

    def _rpc(self, handler, kind: type | None, decode_only: bool = False):
        """Credentials, then the body (kind None: the handler reads a frame stream itself); every
        failure becomes an RPCError with its status, never an exception out of the route."""

        async def endpoint(request: Request) -> Response:
            try:
                if not self._authorized(request.headers):
                    return _error(401, self._credentials_wanted())
                if decode_only and self.role != "decode":
                    return _error(409, f"this node's role is {self.role}, not decode")
                if kind is None:
                    return await handler(request)
                return await handler(request, rpc.decode(kind, await _body(request, rpc.MAX_HEADER_BYTES)))
            except Refused as e:
                return _error(e.status, e.message)
            except rpc.BadRequest as e:
                return _error(400, str(e))
            except ClientDisconnect:
                return Response(status_code=499)
            except Exception as e:  # a bug in a handler: this request fails, the node stays up
                log.exception("RPC %s failed", request.url.path)
                return _error(500, f"internal error: {e!r}")

        return endpoint

    def _authorized(self, headers) -> bool:
        if self.token is not None:
            return rpc.authorized(self.token, headers.get(rpc.TOKEN_HEADER))
        if self.api_key is not None:
            return rpc.bearer_authorized(self.api_key, headers.get("authorization"))
        return True

    def _credentials_wanted(self) -> str:
        if self.token is not None:
            return f"missing or wrong RPC token (send the {rpc.TOKEN_HEADER} header)"
        return "missing or wrong API key (send Authorization: Bearer <key>)"

    def _credentials(self) -> dict[str, str]:
        """What this node sends its peers: the same credentials its own routes want."""
        if self.token is not None:
            return {rpc.TOKEN_HEADER: self.token}
        if self.api_key is not None:
            return {"authorization": f"Bearer {self.api_key}"}
        return {}

    async def rpc_stats(self, request: Request, body: rpc.StatsRequest) -> Response:
        if self.engine.dead is not None:  # a router drops this worker
            return _error(503, f"the engine failed: {self.engine.dead}")
        return _reply(self.worker_stats())

    def worker_stats(self) -> rpc.WorkerStats:
        s = self.engine.stats
        tiers = (s.get("kv_tiers") or {}).get("route", {})
        return rpc.WorkerStats(
            role=self.role, model=self.model_name, block_size=self.block_size,
            total_blocks=s.get("num_blocks", 0), free_blocks=s.get("free_blocks", 0) + s.get("evictable_blocks", 0),
            used_blocks=s.get("used_blocks", 0), cached_blocks=s.get("cached_blocks", 0),
            num_waiting=s.get("num_waiting", 0), num_running=s.get("num_running", 0) + s.get("num_ready", 0),
            num_reserved=s.get("num_reserved", 0), queued_prompt_tokens=s.get("queued_prompt_tokens", 0),
            prefill_tokens_per_ms=s.get("prefill_tokens_per_ms", 0.0),
            decode_step_ms=s.get("decode_step_ms", 0.0), kv_cache_usage=s.get("kv_cache_usage", 0.0),
            kv_layout=self.layout, **tiers)

    async def rpc_abort(self, request: Request, body: rpc.AbortRequest) -> Response:
        found = False
        if self.role == "decode":
            self._remember_abort(body.request_id)
            # a reserve still waiting for its grammar: the compile is cancelled and the reserve refused
            self.engine.drop(_engine_id(body.request_id))
        r = self._reservations.pop(body.request_id, None)
        if r is not None:
            found = True
            self.ctx.drop_reservation(r, "aborted by the prefill node")
        stream = self._decoding.pop(body.request_id, None)
        if stream is not None:
            found = True
            _end_decoding(stream)
        relay = self._relays.get(body.request_id)
        if relay is not None:
            found = True
            relay.close()
        return _reply(rpc.AbortResponse(found=found))

    def _remember_abort(self, request_id: str) -> None:
        """An abort may overtake the reserve it aborts (both in flight): remembered, the reservation
        is dropped as it lands. Old entries go first; at most _ABORTS_REMEMBERED."""
        now = time.monotonic()
        aborted = self._aborted
        aborted[request_id] = now
        aborted.move_to_end(request_id)
        while aborted and (len(aborted) > _ABORTS_REMEMBERED or next(iter(aborted.values())) < now - _ABORT_MEMORY):
            aborted.popitem(last=False)

    # -- decode node -----------------------------------------------------------------------------

    async def rpc_reserve(self, request: Request, body: rpc.ReserveRequest) -> Response:
        why = self.layout.mismatch(body.kv_layout)
        if why is not None:
            return _error(400, why)
        if body.request_id in self._reservations:
            return _error(409, f"request {body.request_id} is already reserved here")
        if body.request_id in self._aborted:
            return _error(409, f"request {body.request_id} was aborted by the prefill node")
        engine_id = _engine_id(body.request_id)
        client = request.client.host if request.client is not None else "peer"  # the grammar compiler's fairness
        try:  # cancelled (the caller left), the reservation is dropped wherever it got to
            blocks = await self.engine.reserve(engine_id, body.prompt_token_ids, body.params, client=client)
        except MemoryError as e:
            self.metrics.pd_event("reserve_full")
            return _error(503, f"KV cache full: {e}")
        except (ValueError, OverflowError) as e:
            return _error(400, str(e))
        except EngineDead as e:
            return _error(503, str(e))
        except Withdrawn:  # the abort came while its grammar compiled (rpc_abort)
            return _error(409, f"request {body.request_id} was aborted by the prefill node")
        if body.request_id in self._aborted:  # the abort overtook this reserve while it waited for the blocks
            self.engine.drop(engine_id)
            return _error(409, f"request {body.request_id} was aborted by the prefill node")
        r = Reservation(body.request_id, engine_id, body.prompt_token_ids, body.params, blocks,
                         time.monotonic() + self.lease_seconds)
        self._reservations[body.request_id] = r
        if self._reaper is None or self._reaper.done():
            self._reaper = self.ctx.spawn(self._reap(), None, "the lease reaper")
        self.metrics.pd_event("reserved")
        return _reply(rpc.ReserveResponse(request_id=body.request_id, num_blocks=len(blocks),
                                          block_size=self.block_size, lease_seconds=self.lease_seconds,
                                          kv_port=self.kv_port, kv_key=r.kv_key, kv_timeout=self.kv_timeout))

    async def rpc_push_kv(self, request: Request) -> Response:
        """Frames of one request's KV over HTTP (the proxy-friendly path; the KV port is faster),
        written into its reserved blocks as each layer arrives."""
        reader = rpc.FrameReader(request.stream(), max_header=rpc.MAX_KV_HEADER_BYTES)
        intake = Intake(self.ctx)
        try:
            while (head := await reader.header(rpc.KVFrame)) is not None:
                n = intake.header(head)  # the route's credentials authenticated this one
                if n:
                    intake.payload(head, await reader.read(n))
            return _reply(intake.finish())
        except Refused as e:
            intake.broken(e.message)
            return _error(e.status, e.message)
        except rpc.BadRequest as e:
            intake.broken(str(e))
            raise
        except (ClientDisconnect, EOFError) as e:
            intake.broken(f"the KV transfer broke off ({e or type(e).__name__})")
            return Response(status_code=499)

    async def rpc_decode(self, request: Request, body: rpc.DecodeRequest) -> Response:
        r = self._reservations.get(body.request_id)
        if r is None:
            return _error(404, f"request {body.request_id} has no reservation here (never made, expired or aborted)")
        if r.state != "ready":
            return _error(409, f"request {body.request_id}'s KV has not all arrived "
                          f"({len(r.layers)} of {len(self.layout.layers)} layers)")
        del self._reservations[body.request_id]
        try:
            stream = self.engine.resume(r.engine_id, r.prompt, body.first_token, body.logprobs,
                                        body.num_cached_tokens, r.params)
        except EngineDead as e:
            self.engine.drop(r.engine_id)
            return _error(503, str(e))
        self.metrics.pd_event("decoding")
        self._decoding[body.request_id] = stream

        def closed() -> None:  # however the response ends: done, the prefill node gone, cancelled
            if self._decoding.get(body.request_id) is stream:
                del self._decoding[body.request_id]
            stream.close()  # aborts it if it still runs: the prefill node (or its client) left

        return ClosingStream(self._deltas(stream), closed, rpc.CONTENT_TYPE)

    async def _deltas(self, stream: Stream):
        async for updates in stream:
            frames = []
            for update in updates:
                if update.error is not None:
                    e = update.error
                    status = (499 if isinstance(e, Aborted) else 400 if isinstance(e, (ValueError, KeyError))
                              else 503 if isinstance(e, EngineDead) else 500)
                    frames.append(rpc.frame(rpc.DecodeDelta(error=f"{type(e).__name__}: {e}", error_status=status)))
                    break
                for c in update.choices:
                    frames.append(rpc.frame(rpc.DecodeDelta(
                        text=c.text, num_tokens=c.num_tokens, logprobs=c.logprobs, finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason, num_cached_tokens=update.num_cached_tokens)))
            if frames:
                yield b"".join(frames)

    async def _reap(self) -> None:
        """Expire leases: a reservation nothing renewed for lease_seconds returns its blocks."""
        while self._reservations:
            await asyncio.sleep(min(0.25, self.lease_seconds / 4))
            now = time.monotonic()
            for r in [r for r in self._reservations.values() if r.deadline < now]:
                del self._reservations[r.request_id]
                self.metrics.pd_event("lease_expired")
                self.ctx.drop_reservation(r, f"its lease of {self.lease_seconds:g} s expired "
                                          f"({len(r.layers)} of {len(self.layout.layers)} layers arrived)")

    # -- prefill node ----------------------------------------------------------------------------

    def relays(self, num_prompts: int, params: SamplingParams) -> bool:
        """Whether an OpenAI request on this node goes through a decode node: on a prefill node, one
        prompt, one choice, more than one token (others run here, as on a collocated node)."""
        return self.role == "prefill" and num_prompts == 1 and params.n == 1 and params.max_tokens != 1

    def peer_for(self, headers) -> str:
        """The decode node for a request: the master's pick (header, with the RPC token) or --decode-peer."""
        named = headers.get(rpc.PEER_HEADER)
        if named:
            if not rpc.authorized(self.token, headers.get(rpc.TOKEN_HEADER)) or self.token is None:
                raise PeerError(f"{rpc.PEER_HEADER} is honoured only with the RPC token "
                                f"(and on a node started with --rpc-token)")
            return named.rstrip("/")
        if self.decode_peer is None:
            raise PeerError("this prefill node has no decode node for the request "
                            "(start it with --decode-peer URL, or route through the master)")
        return self.decode_peer

    async def start(self, request_id: str, prompt: list[int], params: SamplingParams, peer: str, *,
                    client: str = "local", prompt_param: str = "prompt") -> Relay:
        """Admit the request here, prefill only (refused as AsyncEngine.submit refuses: InvalidRequest,
        EngineFull, EngineDead), reserve on the decode node (PeerError when it cannot), then run the
        request through it. Admitted first, so a request this node refuses is a 400 of its own, never
        a reservation's refusal; and the prefill starts while the reservation is on its way (its KV
        waits in the sink until the push starts)."""
        sink = Sink(asyncio.get_running_loop())
        local = await self.engine.submit(request_id, [prompt], params, client=client, prompt_param=prompt_param,
                                         kv_sink=sink)
        try:
            reply = await self._reserve_on(peer, request_id, prompt, params)
        except BaseException:
            local.close()  # aborts the prefill
            raise
        relay = Relay(self.ctx, request_id, prompt, params, peer, reply, local, sink)
        self._relays[request_id] = relay
        relay.begin()
        return relay

    async def _reserve_on(self, peer: str, request_id: str, prompt: list[int],
                          params: SamplingParams) -> rpc.ReserveResponse:
        """The decode node's reservation (retried while it is full, for up to reserve_wait)."""
        body = rpc.encode(rpc.ReserveRequest(version=rpc.RPC_VERSION, request_id=request_id,
                                             prompt_token_ids=prompt, params=params, kv_layout=self.layout))
        deadline = time.monotonic() + self.reserve_wait
        pause = 0.02
        try:
            while True:
                status, reply = await self.ctx.call(peer, "/rpc/reserve", body, rpc.ReserveResponse, timeout=10.0)
                if status != 503 or "KV cache full" not in reply.message or time.monotonic() + pause > deadline:
                    break
                await asyncio.sleep(pause)  # full now: blocks come back as requests finish
                pause = min(pause * 2, 0.2)
        except asyncio.CancelledError:  # the reserve may land after this: the decode node remembers the abort
            self.ctx.spawn(self.ctx.abort_peer(peer, request_id), request_id, "the abort on the decode node")
            raise
        if status != 200:
            self.metrics.pd_event("reserve_refused")
            raise PeerError(f"the decode node {peer} refused the request ({status}): {reply.message}")
        return reply

    async def close(self) -> None:
        for relay in list(self._relays.values()):
            relay.close()
        await self.ctx.settle(2.0)  # the aborts those closes sent, and any still under way: a moment to land
        if self._kv_server is not None:
            self._kv_server.close()
        await self.ctx.close()


def _end_decoding(stream: Stream) -> None:
    """Abort a request decoding here for a prefill node, and end its response: the stream's reader
    wakes to an error (a closed Stream alone would leave it waiting)."""
    stream.close()
    stream.put(Update(0, [], finished=True, error=Aborted("aborted by the prefill node")))


async def _body(request: Request, limit: int) -> bytes:
    """The request's body, at most `limit` bytes: a larger Content-Length is refused before reading,
    and a body without one (chunked) is counted as it arrives."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.strip().isdigit():
            raise rpc.BadRequest(f"Content-Length {length[:40]!r} is not a number")
        if int(length) > limit:
            raise Refused(413, f"an RPC body of {int(length)} bytes (limit {limit})")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise Refused(413, f"an RPC body of more than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def wire_layout(layout) -> KVLayout:
    """The engine's description of its KV cache (rtp/engine/kv_transfer.py) as the RPC carries it
    (rtp/wire/kv_layout.py says why they are two structs)."""
    return KVLayout(dtype=layout.dtype, layers=[list(shape) for shape in layout.layers])


def _engine_id(request_id: str) -> str:
    return f"pd-{request_id}"


def _reply(message) -> Response:
    return Response(rpc.encode(message), media_type=rpc.CONTENT_TYPE)


def _error(status: int, message: str) -> Response:
    return Response(rpc.encode(rpc.RPCError(status=status, message=message)), status, media_type=rpc.CONTENT_TYPE)


def new_request_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"
