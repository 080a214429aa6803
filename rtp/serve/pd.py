"""Prefill/decode disaggregation: the RPC routes of a node, and the prefill node's relay.

One request, prefill node P and decode node D (both `rtp serve`, rpc.py for the wire):

    client -> P  OpenAI route
    P -> D       reserve      D holds blocks for the prompt under a lease (503 to the client if D
                              is unreachable or refuses; P retries a full D for up to reserve_wait)
    P            prefill      its prefix cache first; each layer's KV is copied out as soon as the
                              layer has written it (kv_transfer.LayerTaps) ...
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
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import socket
import time
import uuid
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
import numpy as np
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from rtp.engine.kv_transfer import KVLayout, raw_view
from rtp.sampling_params import SamplingParams
from rtp.serve import rpc
from rtp.serve.async_engine import AsyncEngine, ChoiceDelta, EngineDead, Stream, Update
from rtp.serve.streams import ClosingStream

log = logging.getLogger("rtp.serve.pd")

ROLES = ("collocated", "prefill", "decode")


class PeerError(Exception):
    """The decode node cannot take or finish this request; the client gets 503 (the master retries)."""


class PDNode:
    """What a node does for prefill/decode disaggregation, whatever its role: the RPC routes
    (stats and abort everywhere; reserve, push_kv and decode on a decode node) and, on a
    prefill node, the relay of OpenAI requests through a decode node."""

    def __init__(self, engine: AsyncEngine, metrics, *, role: str = "collocated", model_name: str,
                 token: str | None = None, decode_peer: str | None = None, lease_seconds: float = 10.0,
                 reserve_wait: float = 10.0, decode_read_timeout: float = 120.0):
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        self.engine = engine
        self.metrics = metrics
        self.role = role
        self.model_name = model_name
        self.token = token
        self.decode_peer = decode_peer.rstrip("/") if decode_peer else None
        self.lease_seconds = lease_seconds
        self.reserve_wait = reserve_wait
        self.decode_read_timeout = decode_read_timeout
        self.layout: KVLayout = engine.engine.kv_layout()
        self.block_size = engine.engine.scheduler.block_size
        self._reservations: dict[str, _Reservation] = {}  # decode: by request id
        self._decoding: dict[str, Stream] = {}             # decode: resumed requests, by request id
        self._relays: dict[str, Relay] = {}                # prefill: by request id
        self._reaper: asyncio.Task | None = None
        self._http: httpx.AsyncClient | None = None
        self._kv_server: asyncio.Server | None = None
        self.kv_port = 0  # decode: the bound KV port (0: none)

    async def open_kv_port(self, host: str, kv_port: int = 0) -> None:
        """On a decode node, open the KV port (kv_port 0: any free one; -1: none, KV over HTTP only)."""
        if self.role != "decode" or kv_port < 0:
            return
        loop = asyncio.get_running_loop()
        self._kv_server = await loop.create_server(lambda: _KVPort(self), host.strip("[]"), kv_port)
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
        """Token, then the body (kind None: the handler reads a frame stream itself); every
        failure becomes an RPCError with its status, never an exception out of the route."""

        async def endpoint(request: Request) -> Response:
            try:
                if not rpc.authorized(self.token, request.headers.get(rpc.TOKEN_HEADER)):
                    return _error(401, f"missing or wrong RPC token (send the {rpc.TOKEN_HEADER} header)")
                if decode_only and self.role != "decode":
                    return _error(409, f"this node's role is {self.role}, not decode")
                if kind is None:
                    return await handler(request)
                body = await request.body()
                if len(body) > rpc.MAX_HEADER_BYTES:
                    return _error(413, f"an RPC body of {len(body)} bytes (limit {rpc.MAX_HEADER_BYTES})")
                return await handler(request, rpc.decode(kind, body))
            except rpc.BadRequest as e:
                return _error(400, str(e))
            except ClientDisconnect:
                return Response(status_code=499)
            except Exception as e:  # a bug in a handler: this request fails, the node stays up
                log.exception("RPC %s failed", request.url.path)
                return _error(500, f"internal error: {e!r}")

        return endpoint

    async def rpc_stats(self, request: Request, body: rpc.StatsRequest) -> Response:
        return _reply(self.worker_stats())

    def worker_stats(self) -> rpc.WorkerStats:
        s = self.engine.stats
        return rpc.WorkerStats(
            role=self.role, model=self.model_name, block_size=self.block_size,
            total_blocks=s.get("num_blocks", 0), free_blocks=s.get("free_blocks", 0) + s.get("evictable_blocks", 0),
            used_blocks=s.get("used_blocks", 0), cached_blocks=s.get("cached_blocks", 0),
            num_waiting=s.get("num_waiting", 0), num_running=s.get("num_running", 0) + s.get("num_ready", 0),
            num_reserved=s.get("num_reserved", 0), queued_prompt_tokens=s.get("queued_prompt_tokens", 0),
            prefill_tokens_per_ms=s.get("prefill_tokens_per_ms", 0.0),
            decode_step_ms=s.get("decode_step_ms", 0.0), kv_cache_usage=s.get("kv_cache_usage", 0.0),
            kv_layout=self.layout)

    async def rpc_abort(self, request: Request, body: rpc.AbortRequest) -> Response:
        found = False
        r = self._reservations.pop(body.request_id, None)
        if r is not None:
            found = True
            self._drop_reservation(r, "aborted by the prefill node")
        for stream in (self._decoding.get(body.request_id), self._relays.get(body.request_id)):
            if stream is not None:
                found = True
                stream.close()
        return _reply(rpc.AbortResponse(found=found))

    # -- decode node -----------------------------------------------------------------------------

    async def rpc_reserve(self, request: Request, body: rpc.ReserveRequest) -> Response:
        why = self.layout.mismatch(body.kv_layout)
        if why is not None:
            return _error(400, why)
        if body.request_id in self._reservations:
            return _error(409, f"request {body.request_id} is already reserved here")
        engine_id = _engine_id(body.request_id)
        try:
            blocks = await self.engine.reserve(engine_id, body.prompt_token_ids, body.params)
        except MemoryError as e:
            self.metrics.pd_event("reserve_full")
            return _error(503, f"KV cache full: {e}")
        except (ValueError, OverflowError) as e:
            return _error(400, str(e))
        except EngineDead as e:
            return _error(503, str(e))
        except asyncio.CancelledError:
            self.engine.drop(engine_id)  # reserved after the caller left: nobody will push
            raise
        r = _Reservation(body.request_id, engine_id, body.prompt_token_ids, body.params, blocks,
                         time.monotonic() + self.lease_seconds)
        self._reservations[body.request_id] = r
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.create_task(self._reap())
        self.metrics.pd_event("reserved")
        return _reply(rpc.ReserveResponse(request_id=body.request_id, num_blocks=len(blocks),
                                          block_size=self.block_size, lease_seconds=self.lease_seconds,
                                          kv_port=self.kv_port, kv_key=r.kv_key))

    async def rpc_push_kv(self, request: Request) -> Response:
        """Frames of one request's KV over HTTP (the proxy-friendly path; the KV port is faster),
        written into its reserved blocks as each layer arrives."""
        reader = rpc.FrameReader(request.stream())
        intake = _Intake(self)
        try:
            while (head := await reader.header(rpc.KVFrame)) is not None:
                n = intake.header(head, key=None)  # the RPC token authenticated this one
                if n:
                    intake.payload(head, await reader.read(n))
            return _reply(intake.finish())
        except _Refused as e:
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

        def closed() -> None:
            self._decoding.pop(body.request_id, None)
            stream.close()  # aborts it if it still runs: the prefill node (or its client) left

        return ClosingStream(self._deltas(stream), closed, rpc.CONTENT_TYPE)

    async def _deltas(self, stream: Stream):
        async for updates in stream:
            frames = []
            for update in updates:
                if update.error is not None:
                    e = update.error
                    status = 400 if isinstance(e, (ValueError, KeyError)) else 503 if isinstance(e, EngineDead) else 500
                    frames.append(rpc.frame(rpc.DecodeDelta(error=f"{type(e).__name__}: {e}", error_status=status)))
                    break
                for c in update.choices:
                    frames.append(rpc.frame(rpc.DecodeDelta(
                        text=c.text, num_tokens=c.num_tokens, logprobs=c.logprobs, finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason, num_cached_tokens=update.num_cached_tokens)))
            if frames:
                yield b"".join(frames)

    def _drop_reservation(self, r: _Reservation, why: str) -> None:
        r.state = "dropped"
        self.engine.drop(r.engine_id)
        log.info("reservation %s dropped: %s (%d blocks back to the pool)", r.request_id, why, len(r.blocks))

    async def _reap(self) -> None:
        """Expire leases: a reservation nothing renewed for lease_seconds returns its blocks."""
        while self._reservations:
            await asyncio.sleep(min(0.25, self.lease_seconds / 4))
            now = time.monotonic()
            for r in [r for r in self._reservations.values() if r.deadline < now]:
                del self._reservations[r.request_id]
                self.metrics.pd_event("lease_expired")
                self._drop_reservation(r, f"its lease of {self.lease_seconds:g} s expired "
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

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            # generous pool: one connection per request in flight; timeouts per call below
            self._http = httpx.AsyncClient(limits=httpx.Limits(max_connections=512, max_keepalive_connections=64),
                                           headers={rpc.TOKEN_HEADER: self.token} if self.token else {})
        return self._http

    async def start(self, request_id: str, prompt: list[int], params: SamplingParams, peer: str) -> Relay:
        """Reserve on the decode node (PeerError when it cannot), then run the request through it."""
        body = rpc.encode(rpc.ReserveRequest(version=rpc.RPC_VERSION, request_id=request_id,
                                             prompt_token_ids=prompt, params=params, kv_layout=self.layout))
        deadline = time.monotonic() + self.reserve_wait
        pause = 0.02
        try:
            while True:
                status, reply = await self._call(peer, "/rpc/reserve", body, rpc.ReserveResponse, timeout=10.0)
                if status != 503 or "KV cache full" not in reply.message or time.monotonic() + pause > deadline:
                    break
                await asyncio.sleep(pause)  # full now: blocks come back as requests finish
                pause = min(pause * 2, 0.2)
        except asyncio.CancelledError:
            asyncio.ensure_future(self._abort_peer(peer, request_id))
            raise
        if status != 200:
            self.metrics.pd_event("reserve_refused")
            raise PeerError(f"the decode node {peer} refused the request ({status}): {reply.message}")
        relay = Relay(self, request_id, prompt, params, peer, reply)
        self._relays[request_id] = relay
        relay.task = asyncio.create_task(relay.run())
        return relay

    async def _call(self, peer: str, path: str, body: bytes, kind: type, timeout: float):
        """One unary RPC: (status, reply or RPCError); PeerError when the peer cannot be reached."""
        try:
            response = await self._client().post(peer + path, content=body, timeout=timeout,
                                                 headers={"content-type": rpc.CONTENT_TYPE})
        except httpx.HTTPError as e:
            self.metrics.pd_event("peer_unreachable")
            raise PeerError(f"the decode node {peer} is unreachable: {type(e).__name__}: {e}") from None
        try:
            if response.status_code == 200:
                return 200, rpc.decode(kind, response.content)
            return response.status_code, rpc.decode(rpc.RPCError, response.content)
        except rpc.BadRequest as e:
            raise PeerError(f"the decode node {peer} answered {response.status_code} with an unreadable body: {e}")

    async def _abort_peer(self, peer: str, request_id: str) -> None:
        body = rpc.encode(rpc.AbortRequest(version=rpc.RPC_VERSION, request_id=request_id))
        try:
            await self._call(peer, "/rpc/abort", body, rpc.AbortResponse, timeout=5.0)
        except PeerError as e:  # its lease returns the blocks anyway
            log.warning("abort of %s on %s failed: %s", request_id, peer, e)

    async def close(self) -> None:
        for relay in list(self._relays.values()):
            relay.close()
        if self._kv_server is not None:
            self._kv_server.close()
        if self._http is not None:
            await self._http.aclose()


async def _drain(stream: Stream) -> list[Update]:
    return [u async for batch in stream for u in batch]


def _engine_id(request_id: str) -> str:
    return f"pd-{request_id}"


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class _Intake:
    """One push of one request's KV into its reservation, whichever transport carries the frames
    (HTTP push_kv or the KV port). Every frame renews the lease; a layer is written into the
    reserved blocks the moment its bytes are in."""

    def __init__(self, node: PDNode):
        self.node = node
        self.r: _Reservation | None = None
        self.nbytes = 0

    def header(self, head: rpc.KVFrame, key: str | None) -> int:
        """Check a frame header; the payload bytes to read next (0 for a heartbeat). _Refused says why not.
        key: the reservation's KV key, required on the KV port (None: authenticated otherwise)."""
        node = self.node
        if self.r is None:
            r = node._reservations.get(head.request_id)
            if r is None or r.state != "reserved":
                raise _Refused(404, f"request {head.request_id} has no reservation here (never made, expired "
                               f"or aborted)")
            if key is not None and not hmac.compare_digest(key.encode(), r.kv_key.encode()):
                raise _Refused(401, f"wrong KV key for request {head.request_id}")
            r.state = "receiving"
            self.r = r
        elif head.request_id != self.r.request_id:
            raise _Refused(400, "one push carries one request's KV")
        r = self.r
        if r.state != "receiving":  # expired or aborted meanwhile: the blocks are no longer ours
            raise _Refused(410, f"request {r.request_id}'s reservation ended during the transfer")
        r.deadline = time.monotonic() + node.lease_seconds
        if head.layer == rpc.HEARTBEAT and head.nbytes == 0:
            return 0
        layers = node.layout.layers
        expected = len(r.prompt) * node.layout.token_bytes(head.layer) if 0 <= head.layer < len(layers) else -1
        if head.num_tokens != len(r.prompt) or head.nbytes != expected:
            raise _Refused(400, f"layer {head.layer}: {head.num_tokens} tokens in {head.nbytes} bytes; expected "
                           f"{len(r.prompt)} tokens in {expected} bytes")
        return head.nbytes

    def payload(self, head: rpc.KVFrame, data) -> None:
        r = self.r
        if r.state != "receiving":
            raise _Refused(410, f"request {r.request_id}'s reservation ended during the transfer")
        self.node.engine.engine.write_kv(head.layer, r.blocks, head.num_tokens, data)
        r.layers.add(head.layer)
        r.deadline = time.monotonic() + self.node.lease_seconds
        self.nbytes += head.nbytes

    def finish(self) -> rpc.PushResponse:
        r, layers = self.r, len(self.node.layout.layers)
        if r is None:
            raise _Refused(400, "the push carried no KV frame")
        if len(r.layers) != layers:
            raise _Refused(400, f"request {r.request_id}: {layers - len(r.layers)} of {layers} layers of KV missing")
        r.state = "ready"
        self.node.metrics.on_kv_received(self.nbytes)
        return rpc.PushResponse(request_id=r.request_id, layers=layers)

    def broken(self, why: str) -> None:
        """The push failed: unless all its KV is in, the reservation's blocks go back now."""
        r, node = self.r, self.node
        if r is not None and r.state == "receiving" and node._reservations.get(r.request_id) is r:
            del node._reservations[r.request_id]
            node.metrics.pd_event("push_broken")
            node._drop_reservation(r, why)


class _KVPort(asyncio.BufferedProtocol):
    """The decode node's KV port: frames as on push_kv, on a bare TCP connection, received
    straight into each frame's own buffer (no copy between the socket and the cache write but
    the write itself). The first frame carries the reservation's KV key. One reply frame (a
    PushResponse or an RPCError) ends the connection."""

    def __init__(self, node: PDNode):
        self.node = node
        self.intake = _Intake(node)
        self.transport = None
        self.head: rpc.KVFrame | None = None
        self._expect(4, "length")
        self.done = False

    def _expect(self, n: int, what: str) -> None:
        self.buf = bytearray(n)
        self.view = memoryview(self.buf)
        self.have = 0
        self.what = what

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:  # fewer, larger reads: a layer is megabytes
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)

    def get_buffer(self, sizehint: int):
        return self.view[self.have:]

    def buffer_updated(self, nbytes: int) -> None:
        self.have += nbytes
        try:
            while self.have == len(self.buf) and not self.done:
                self._complete()
        except _Refused as e:
            self._end(rpc.RPCError(status=e.status, message=e.message))
        except rpc.BadRequest as e:
            self._end(rpc.RPCError(status=400, message=str(e)))
        except Exception as e:  # a bug: this push fails, the node stays up
            log.exception("KV port failed")
            self._end(rpc.RPCError(status=500, message=f"internal error: {e!r}"))

    def _complete(self) -> None:
        if self.what == "length":
            (n,) = rpc.LENGTH.unpack(self.buf)
            if n > rpc.MAX_HEADER_BYTES:
                raise rpc.BadRequest(f"a frame header of {n} bytes")
            self._expect(n, "header")
        elif self.what == "header":
            self.head = rpc.decode(rpc.KVFrame, self.buf)
            if self.head.layer == rpc.END and self.head.nbytes == 0:
                self._end(self.intake.finish())
                return
            n = self.intake.header(self.head, key=self.head.key if self.intake.r is None else None)
            self._expect(n, "payload") if n else self._expect(4, "length")
        else:
            self.intake.payload(self.head, self.buf)
            self._expect(4, "length")

    def _end(self, reply) -> None:
        self.done = True
        if isinstance(reply, rpc.RPCError):
            self.intake.broken(reply.message)
        self.transport.write(rpc.frame(reply))
        self.transport.close()

    def connection_lost(self, exc) -> None:
        if not self.done:
            self.done = True
            self.intake.broken(f"the KV connection dropped ({exc or 'closed'})")


@dataclass
class _Reservation:
    request_id: str
    engine_id: str
    prompt: list[int]
    params: SamplingParams
    blocks: np.ndarray
    deadline: float
    kv_key: str = field(default_factory=lambda: secrets.token_hex(16))
    state: str = "reserved"  # reserved -> receiving -> ready (decode takes it); dropped
    layers: set[int] = field(default_factory=set)


class _Sink:
    """The engine thread's end of a prefill-only request (kv_transfer.KVSink): layers and the
    first token cross to the event loop as queue items."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.first: tuple[int, dict[int, float] | None, int] | None = None
        self.sampled_at = 0.0

    def put_layer(self, layer: int, kv) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (layer, kv))

    def finish(self, token: int, logprobs, num_cached_tokens: int) -> None:
        self.sampled_at = time.monotonic()  # the prefill's last layer is done: every layer is queued
        self.first = (token, logprobs, num_cached_tokens)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


class Relay(Stream):
    """A prefill node's client-facing stream of one request decoded elsewhere: the OpenAI layer
    reads it as it reads a local Stream. Its updates come from the decode node (or from the local
    engine when the first token already ends the request)."""

    def __init__(self, node: PDNode, request_id: str, prompt: list[int], params: SamplingParams, peer: str,
                 reservation: rpc.ReserveResponse):
        super().__init__(node.engine, request_id, [prompt])
        self.node = node
        self.reservation = reservation
        self.lease_seconds = reservation.lease_seconds
        self.params = params
        self.peer = peer
        self.task: asyncio.Task | None = None
        self.decode_started = False
        node.engine.num_unstarted += 1  # as submit() counts a prompt until its first token

    async def run(self) -> None:
        node, engine = self.node, self.node.engine
        outcome = "failed"
        try:
            outcome = await self._run()
        except asyncio.CancelledError:
            outcome = "aborted"
        except Exception as e:
            error = e if isinstance(e, PeerError) else PeerError(f"the disaggregated request failed: {e!r}")
            if not isinstance(e, PeerError):
                log.exception("relay %s failed", self.request_id)
            self._fail(error)
        finally:
            node._relays.pop(self.request_id, None)
            node.metrics.pd_event(outcome)
            if outcome != "decoded":
                engine._commands.put(("abort", self.engine_ids()))  # a no-op once it left the engine
                if outcome != "local":
                    await asyncio.shield(node._abort_peer(self.peer, self.request_id))
                else:
                    asyncio.ensure_future(node._abort_peer(self.peer, self.request_id))

    def _fail(self, error: Exception) -> None:
        if not self.closed:
            self.engine._deliver([(self, Update(0, [], finished=True, error=error))], time.monotonic())

    async def _run(self) -> str:
        engine = self.node.engine
        sink = _Sink(asyncio.get_running_loop())
        local = engine.submit(self.request_id, self.prompts, self.params, kv_sink=sink)
        push = asyncio.create_task(self._push_tcp(sink) if self.reservation.kv_port else self._push(sink))
        try:
            return await self._relay(local, sink, push)
        finally:
            local.close()  # aborts the prefill if it still runs
            if not push.done():
                push.cancel()  # closes the push connection: the decode node drops the reservation

    async def _relay(self, local: Stream, sink: _Sink, push: asyncio.Task) -> str:
        node = self.node
        collect = asyncio.ensure_future(_drain(local))
        try:
            # a push that fails (the decode node gone or refusing) ends the prefill too
            await asyncio.wait((collect, push), return_when=asyncio.FIRST_COMPLETED)
            if push.done() and push.exception() is not None and not collect.done():
                raise push.exception()
            updates = await collect
        finally:
            if not collect.done():
                collect.cancel()
        last = updates[-1] if updates else None
        remote = (last is not None and last.error is None and last.choices
                  and last.choices[-1].finish_reason == "remote" and sink.first is not None)
        if not remote:
            for update in updates:  # the local answer (an error, or a first token that ended it)
                if update.error is not None:
                    self._fail(update.error)
                    return "failed"
                self.engine._deliver([(self, update)], time.monotonic())
            return "local"
        pushed = await push
        token, logprobs, cached = sink.first
        body = rpc.encode(rpc.DecodeRequest(version=rpc.RPC_VERSION, request_id=self.request_id, first_token=token,
                                            logprobs=logprobs, num_cached_tokens=cached))
        self.decode_started = True
        timeout = httpx.Timeout(10.0, read=node.decode_read_timeout)
        try:
            async with node._client().stream("POST", self.peer + "/rpc/decode", content=body, timeout=timeout,
                                             headers={"content-type": rpc.CONTENT_TYPE}) as response:
                if response.status_code != 200:
                    reply = rpc.decode(rpc.RPCError, await response.aread())
                    raise PeerError(f"the decode node {self.peer} refused to decode ({response.status_code}): "
                                    f"{reply.message}")
                reader = rpc.FrameReader(response.aiter_bytes())
                while (delta := await reader.header(rpc.DecodeDelta)) is not None:
                    if delta.error is not None:
                        raise PeerError(f"the decode node {self.peer} failed the request: {delta.error}")
                    choice = ChoiceDelta(0, delta.text, delta.num_tokens, delta.logprobs, delta.finish_reason,
                                         delta.stop_reason)
                    self.engine._deliver([(self, Update(0, [choice], cached, delta.finish_reason is not None))],
                                         time.monotonic())
                    if delta.finish_reason is not None:
                        log.debug("relay %s: %d KV bytes pushed", self.request_id, pushed)
                        return "decoded"
        except (httpx.HTTPError, EOFError, rpc.BadRequest) as e:
            raise PeerError(f"the decode node {self.peer} broke off the stream: {type(e).__name__}: {e}") from None
        raise PeerError(f"the decode node {self.peer} ended the stream before the request finished")

    async def _kv_frames(self, sink: _Sink, sent: dict, key: str = ""):
        """The KV stream's frames, as (bytes, end of a frame group): a heartbeat first (carrying the
        KV port's key) and again whenever no layer comes for a third of the lease, so the decode
        node's lease runs on heartbeats while the prompt waits for its turn and prefills here;
        then each layer's header and raw bytes as the engine hands the layer over. Counts the
        bytes and the first layer's time into `sent`."""

        def heartbeat(key: str = "") -> bytes:
            return rpc.frame(rpc.KVFrame(version=rpc.RPC_VERSION, request_id=self.request_id,
                                         layer=rpc.HEARTBEAT, num_tokens=0, nbytes=0, key=key))

        yield heartbeat(key), True
        while True:
            try:
                item = await asyncio.wait_for(sink.queue.get(), self.lease_seconds / 3)
            except asyncio.TimeoutError:
                yield heartbeat(), True
                continue
            if item is None:
                return
            layer, kv = item
            sent["started"] = sent["started"] or time.monotonic()
            payload = raw_view(kv).reshape(-1).view(np.uint8)
            yield rpc.frame(rpc.KVFrame(version=rpc.RPC_VERSION, request_id=self.request_id, layer=layer,
                                        num_tokens=kv.shape[1], nbytes=payload.nbytes)), False
            yield payload.data, True
            sent["bytes"] += payload.nbytes

    def _sent(self, sink: _Sink, sent: dict) -> int:
        now = time.monotonic()
        self.node.metrics.on_kv_sent(sent["bytes"], now - (sent["started"] or now), now - (sink.sampled_at or now))
        return sent["bytes"]

    async def _push_tcp(self, sink: _Sink) -> int:
        """Stream the KV layers to the decode node's KV port as the engine hands them over; returns
        the bytes sent once the decode node acknowledged them all."""
        host = urlsplit(self.peer).hostname or "127.0.0.1"
        port, key = self.reservation.kv_port, self.reservation.kv_key
        sent = {"bytes": 0, "started": None}
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10.0)
        except (OSError, asyncio.TimeoutError) as e:
            raise PeerError(f"the decode node's KV port {host}:{port} is unreachable: {e!r}") from None
        writer.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        writer.transport.set_write_buffer_limits(high=8 << 20)  # a layer in flight without waiting
        try:
            async for chunk, group_end in self._kv_frames(sink, sent, key):
                writer.write(chunk)
                if group_end:
                    await writer.drain()  # back-pressure: one layer in flight in the socket buffers at most
            writer.write(rpc.frame(rpc.KVFrame(version=rpc.RPC_VERSION, request_id=self.request_id,
                                               layer=rpc.END, num_tokens=0, nbytes=0)))
            (n,) = rpc.LENGTH.unpack(await asyncio.wait_for(reader.readexactly(4), 60.0))
            data = await asyncio.wait_for(reader.readexactly(n), 60.0)
        except (OSError, EOFError, asyncio.TimeoutError) as e:
            raise PeerError(f"the KV transfer to {host}:{port} failed: {e!r}") from None
        finally:
            writer.close()
        try:
            rpc.decode(rpc.PushResponse, data)
        except rpc.BadRequest:
            try:
                message = rpc.decode(rpc.RPCError, data).message
            except rpc.BadRequest as e:
                message = f"an unreadable reply: {e}"
            raise PeerError(f"the decode node {self.peer} rejected the KV: {message}") from None
        return self._sent(sink, sent)

    async def _push(self, sink: _Sink) -> int:
        """Stream the KV layers to the decode node over HTTP push_kv as the engine hands them over;
        returns the bytes sent."""
        sent = {"bytes": 0, "started": None}
        frames = (chunk async for chunk, _ in self._kv_frames(sink, sent))
        timeout = httpx.Timeout(30.0, read=60.0)
        try:
            response = await self.node._client().post(self.peer + "/rpc/push_kv", content=frames, timeout=timeout,
                                                       headers={"content-type": rpc.CONTENT_TYPE})
        except httpx.HTTPError as e:
            raise PeerError(f"the KV transfer to {self.peer} failed: {type(e).__name__}: {e}") from None
        if response.status_code != 200:
            try:
                message = rpc.decode(rpc.RPCError, response.content).message
            except rpc.BadRequest:
                message = response.text[:200]
            raise PeerError(f"the decode node {self.peer} rejected the KV ({response.status_code}): {message}")
        return self._sent(sink, sent)

    def close(self) -> None:
        """The client left (or the request ended): abort wherever the request is now."""
        if self.closed:
            return
        super().close()
        if self.task is not None and not self.task.done():
            self.task.cancel()


def _reply(message) -> Response:
    return Response(rpc.encode(message), media_type=rpc.CONTENT_TYPE)


def _error(status: int, message: str) -> Response:
    return Response(rpc.encode(rpc.RPCError(status=status, message=message)), status, media_type=rpc.CONTENT_TYPE)


def new_request_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"
