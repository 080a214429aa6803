"""A prefill node's side of a disaggregated request: the relay through its decode node.

The request prefills here; each layer's KV streams to the decode node (its KV port, or
HTTP push_kv) while later layers compute; the first token goes over with the decode
RPC, and the decode node's deltas come back and are delivered to the client as a
local Stream's would be. Any failure on the way ends the request with a PeerError.

A client that leaves closes the relay: `closed` is final, and the relay checks it after
each wait as well as being cancelled (a task it waits on may swallow the cancellation).
Its clean-up -- the local abort, the abort RPC to the decode node, the metrics -- runs
once however its task ends, even when it is cancelled before its first step.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from urllib.parse import urlsplit

import httpx
import numpy as np

from rtp.engine.kv_transfer import raw_view
from rtp.sampling_params import SamplingParams
from rtp.server.async_engine import ChoiceDelta, Stream, Update
from rtp.server.pd.context import PDContext, PeerError
from rtp.wire import rpc

log = logging.getLogger("rtp.serve.pd")
_MAX_REPLY_BYTES = 1 << 20  # the KV port's reply: a PushResponse or an RPCError


async def drain(stream: Stream) -> list[Update]:
    return [u async for batch in stream for u in batch]


class Sink:
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

    def __init__(self, ctx: PDContext, request_id: str, prompt: list[int], params: SamplingParams, peer: str,
                 reservation: rpc.ReserveResponse, local: Stream, sink: Sink):
        """local, sink: the request's prefill here, admitted already (AsyncEngine.submit with the sink)."""
        super().__init__(ctx.engine, request_id, [prompt])
        self.ctx = ctx
        self.local = local
        self.sink = sink
        self.reservation = reservation
        self.lease_seconds = reservation.lease_seconds
        self.params = params
        self.peer = peer
        self.task: asyncio.Task | None = None
        self.decode_started = False
        self._reported: BaseException | None = None  # the failure the client was given (logged once)
        ctx.engine.num_unstarted += 1  # as submit() counts a prompt until its first token

    def begin(self) -> None:
        """Start relaying; `_ended` cleans up however the task ends."""
        self.task = asyncio.create_task(self._main())
        self.task.add_done_callback(self._ended)

    async def _main(self) -> str:
        """The relay; its outcome: decoded (by the decode node), local (answered here), aborted or failed."""
        try:
            return await self._run()
        except Exception as e:
            if isinstance(e, PeerError):
                log.warning("relay %s: %s", self.request_id, e)
                error = e
            else:
                log.exception("relay %s failed", self.request_id)
                error = PeerError(f"the disaggregated request failed: {e!r}")
            self._reported = e
            self._fail(error)
            return "failed"

    def _ended(self, task: asyncio.Task) -> None:
        ctx = self.ctx
        if task.cancelled():
            outcome = "aborted"
            if not self.closed:  # cancelled from outside (the server stopping): the client hears why
                self._fail(PeerError("the request was cancelled on the prefill node"))
        else:
            outcome = task.result()
        ctx.relays.pop(self.request_id, None)
        ctx.metrics.pd_event(outcome)
        self.local.close()  # aborts the prefill if it still runs (the task may have ended before it began)
        if outcome != "decoded":
            ctx.spawn(ctx.abort_peer(self.peer, self.request_id), self.request_id, "the abort on the decode node")

    def _fail(self, error: Exception) -> None:
        if not self.closed:
            self.engine.deliver(self, Update(0, [], finished=True, error=error))

    def _settle(self, task: asyncio.Task, what: str) -> None:
        """A helper task's failure that the relay did not report already is logged, once."""

        def done(task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is not None and task.exception() is not self._reported:
                log.info("relay %s: %s ended: %s", self.request_id, what, task.exception())

        task.add_done_callback(done)

    async def _run(self) -> str:
        local, sink = self.local, self.sink
        push = asyncio.create_task(self._push_tcp(sink) if self.reservation.kv_port else self._push(sink))
        try:
            return await self._relay(local, sink, push)
        finally:
            local.close()  # aborts the prefill if it still runs
            if not push.done():
                push.cancel()  # closes the push connection: the decode node drops the reservation
            self._settle(push, "the KV push")

    async def _relay(self, local: Stream, sink: Sink, push: asyncio.Task) -> str:
        ctx = self.ctx
        collect = asyncio.ensure_future(drain(local))
        self._settle(collect, "the local prefill")
        try:
            # a push that fails (the decode node gone or refusing) ends the prefill too; never
            # `await task` here: a cancellation of this one would go to that task, which may swallow it
            await asyncio.wait((collect, push), return_when=asyncio.FIRST_COMPLETED)
            if push.done() and push.exception() is not None and not collect.done():
                raise push.exception()
            await asyncio.wait((collect,))
        finally:
            if not collect.done():
                collect.cancel()
        if self.closed:
            return "aborted"
        updates = collect.result()
        last = updates[-1] if updates else None
        remote = (last is not None and last.error is None and last.choices
                  and last.choices[-1].finish_reason == "remote" and sink.first is not None)
        if not remote:
            for update in updates:  # the local answer (an error, or a first token that ended it)
                if update.error is not None:
                    self._fail(update.error)
                    return "failed"
                self.engine.deliver(self, update)
            return "local"
        await asyncio.wait((push,))
        if self.closed:
            return "aborted"
        pushed = push.result()
        token, logprobs, cached = sink.first
        body = rpc.encode(rpc.DecodeRequest(version=rpc.RPC_VERSION, request_id=self.request_id, first_token=token,
                                            logprobs=logprobs, num_cached_tokens=cached))
        self.decode_started = True
        timeout = httpx.Timeout(10.0, read=ctx.decode_read_timeout)
        try:
            async with ctx.client().stream("POST", self.peer + "/rpc/decode", content=body, timeout=timeout,
                                           headers={"content-type": rpc.CONTENT_TYPE}) as response:
                if response.status_code != 200:
                    reply = rpc.decode(rpc.RPCError, await response.aread())
                    raise PeerError(f"the decode node {self.peer} refused to decode ({response.status_code}): "
                                    f"{reply.message}")
                reader = rpc.FrameReader(response.aiter_bytes())
                while not self.closed and (delta := await reader.header(rpc.DecodeDelta)) is not None:
                    if delta.error is not None:
                        raise PeerError(f"the decode node {self.peer} failed the request: {delta.error}")
                    choice = ChoiceDelta(0, delta.text, delta.num_tokens, delta.logprobs, delta.finish_reason,
                                         delta.stop_reason)
                    self.engine.deliver(self, Update(0, [choice], cached, delta.finish_reason is not None))
                    if delta.finish_reason is not None:
                        log.debug("relay %s: %d KV bytes pushed", self.request_id, pushed)
                        return "decoded"
        except (httpx.HTTPError, EOFError, rpc.BadRequest) as e:
            raise PeerError(f"the decode node {self.peer} broke off the stream: {type(e).__name__}: {e}") from None
        if self.closed:  # leaving the block above closed the stream: the decode node aborts it too
            return "aborted"
        raise PeerError(f"the decode node {self.peer} ended the stream before the request finished")

    async def _kv_frames(self, sink: Sink, sent: dict):
        """The KV stream's frames, as (bytes, end of a frame group): a heartbeat first and again
        whenever no layer comes for a third of the lease (or of the KV port's timeout, if shorter),
        so the decode node's lease runs on heartbeats while the prompt waits for its turn and
        prefills here; then each layer's header and raw bytes as the engine hands the layer over.
        Counts the bytes and the first layer's time into `sent`."""

        def heartbeat() -> bytes:
            return rpc.frame(rpc.KVFrame(version=rpc.RPC_VERSION, request_id=self.request_id,
                                         layer=rpc.HEARTBEAT, num_tokens=0, nbytes=0))

        quiet = min(self.lease_seconds, self.reservation.kv_timeout or self.lease_seconds) / 3
        yield heartbeat(), True
        while True:
            try:
                item = await asyncio.wait_for(sink.queue.get(), quiet)
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

    def _sent(self, sink: Sink, sent: dict) -> int:
        now = time.monotonic()
        self.ctx.metrics.on_kv_sent(sent["bytes"], now - (sent["started"] or now), now - (sink.sampled_at or now))
        return sent["bytes"]

    async def _push_tcp(self, sink: Sink) -> int:
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
            # the key first, in a frame of its own: the decode node reads nothing else before it
            writer.write(rpc.frame(rpc.KVHello(version=rpc.RPC_VERSION, request_id=self.request_id, key=key)))
            async for chunk, group_end in self._kv_frames(sink, sent):
                writer.write(chunk)
                if group_end:
                    await writer.drain()  # back-pressure: one layer in flight in the socket buffers at most
            writer.write(rpc.frame(rpc.KVFrame(version=rpc.RPC_VERSION, request_id=self.request_id,
                                               layer=rpc.END, num_tokens=0, nbytes=0)))
            (n,) = rpc.LENGTH.unpack(await asyncio.wait_for(reader.readexactly(4), 60.0))
            if n > _MAX_REPLY_BYTES:
                raise PeerError(f"the decode node {self.peer} answered the KV with a frame of {n} bytes")
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

    async def _push(self, sink: Sink) -> int:
        """Stream the KV layers to the decode node over HTTP push_kv as the engine hands them over;
        returns the bytes sent."""
        sent = {"bytes": 0, "started": None}
        frames = (chunk async for chunk, _ in self._kv_frames(sink, sent))
        timeout = httpx.Timeout(30.0, read=60.0)
        try:
            response = await self.ctx.client().post(self.peer + "/rpc/push_kv", content=frames, timeout=timeout,
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
        """The client left (or the request ended): abort wherever the request is now. Final: the
        relay stops at its next step even if the cancellation does not reach it."""
        if self.closed:
            return
        super().close()
        if self.task is not None and not self.task.done():
            self.task.cancel()
