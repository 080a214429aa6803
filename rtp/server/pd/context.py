"""What the parts of a P/D node share: the engine, the tables of requests in flight, the HTTP
client to its peers, and the few operations the parts call on each other.

PDNode (node.py) builds one PDContext and hands it to each Intake, KVPort (kv_intake.py) and
Relay (relay.py); they use its public attributes and methods only, so none of them imports
the node. Who writes what:

    reservations  decode: added by the reserve route, taken by the decode route; dropped by the
                  lease reaper, the abort route or a push that breaks (drop_reservation)
    relays        prefill: added by PDNode.start, removed by the relay itself when it ends
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx
import numpy as np

from rtp.sampling_params import SamplingParams
from rtp.server.async_engine import AsyncEngine, Stream
from rtp.wire import rpc
from rtp.wire.kv_layout import KVLayout

if TYPE_CHECKING:
    from rtp.server.metrics import ServerMetrics

log = logging.getLogger("rtp.serve.pd")


class PeerError(Exception):
    """The decode node cannot take or finish this request; the client gets 503 (the master retries)."""


@dataclass
class Reservation:
    """Blocks a decode node holds for one prompt until its KV has arrived and the decode starts."""

    request_id: str
    engine_id: str
    prompt: list[int]
    params: SamplingParams
    blocks: np.ndarray
    deadline: float
    kv_key: str = field(default_factory=lambda: secrets.token_hex(16))
    state: str = "reserved"  # reserved -> receiving -> ready (decode takes it); dropped
    layers: set[int] = field(default_factory=set)


@dataclass(eq=False)
class PDContext:
    """engine, metrics, layout: the node's. lease_seconds: how long a reservation lives without a
    frame; decode_read_timeout: how long a relay waits for the decode node's next delta.
    headers: the credentials sent to peers (the same its own routes want)."""

    engine: AsyncEngine
    metrics: ServerMetrics
    layout: KVLayout
    lease_seconds: float
    decode_read_timeout: float
    headers: dict[str, str]
    reservations: dict[str, Reservation] = field(default_factory=dict)  # decode: by request id
    relays: dict[str, Stream] = field(default_factory=dict)             # prefill: relay.Relay by request id
    _tasks: set[asyncio.Task] = field(default_factory=set, init=False, repr=False)  # spawned, kept until done
    _http: httpx.AsyncClient | None = field(default=None, init=False, repr=False)

    def spawn(self, coro, request_id: str | None, what: str) -> asyncio.Task:
        """Run coro in the background, kept alive until done; its failure is logged once, with the
        request id it is for (never "Task exception was never retrieved")."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def done(task: asyncio.Task) -> None:
            self._tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:
                e = task.exception()
                log.error("%s failed%s: %r", what, f" (request {request_id})" if request_id else "", e, exc_info=e)

        task.add_done_callback(done)
        return task

    def drop_reservation(self, r: Reservation, why: str) -> None:
        """Return a reservation's blocks to the engine; the caller has taken it out of `reservations`."""
        r.state = "dropped"
        self.engine.drop(r.engine_id)
        log.info("reservation %s dropped: %s (%d blocks back to the pool)", r.request_id, why, len(r.blocks))

    def client(self) -> httpx.AsyncClient:
        if self._http is None:
            # generous pool: one connection per request in flight; timeouts per call
            self._http = httpx.AsyncClient(limits=httpx.Limits(max_connections=512, max_keepalive_connections=64),
                                           headers=self.headers)
        return self._http

    async def call(self, peer: str, path: str, body: bytes, kind: type, timeout: float):
        """One unary RPC: (status, reply or RPCError); PeerError when the peer cannot be reached."""
        try:
            response = await self.client().post(peer + path, content=body, timeout=timeout,
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

    async def abort_peer(self, peer: str, request_id: str, attempts: int = 3) -> None:
        """The abort RPC, retried a few times when the decode node cannot be reached: a request it
        decodes has no lease to end it (a reservation's lease returns its blocks anyway)."""
        body = rpc.encode(rpc.AbortRequest(version=rpc.RPC_VERSION, request_id=request_id))
        for attempt in range(1, attempts + 1):
            try:
                status, reply = await self.call(peer, "/rpc/abort", body, rpc.AbortResponse, timeout=5.0)
            except PeerError as e:
                if attempt == attempts:
                    log.warning("abort of %s on %s failed %d times: %s", request_id, peer, attempts, e)
                    return
                await asyncio.sleep(0.1 * 2 ** attempt)
                continue
            if status != 200:
                log.warning("abort of %s on %s refused (%d): %s", request_id, peer, status, reply.message)
            return

    async def settle(self, timeout: float) -> None:
        """Give the background tasks (aborts under way) `timeout` seconds to land, then cancel the rest."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)
        for task in list(self._tasks):
            task.cancel()

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
