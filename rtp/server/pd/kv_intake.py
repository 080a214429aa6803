"""A decode node's side of a KV hand-off: the pushes that fill its reservations.

A prefill node reserves blocks for a prompt (node.py, `rpc_reserve`; the Reservation and
the table of them are the PDContext's, context.py); its KV then arrives as frames -- over
HTTP push_kv or on the bare TCP KV port -- and each layer is written into the reserved
blocks the moment its bytes are in. Every frame renews the reservation's lease; a push
that breaks returns the blocks at once.

The KV port is open to anyone who can reach it, so it authenticates before it allocates:
the first frame is a small KVHello (at most MAX_HELLO_BYTES) with the reservation's KV key,
checked before anything else is read; then frame headers of at most MAX_KV_HEADER_BYTES,
and payloads of exactly the size the reservation expects. A connection that completes no
frame for `timeout` seconds (idle, or a frame that trickles in) is closed.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import time

from rtp.server.pd.context import PDContext, Reservation
from rtp.wire import rpc

log = logging.getLogger("rtp.serve.pd")


class Refused(Exception):
    """A request (an RPC body, a push) the node will not take: its status and why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class Intake:
    """One push of one request's KV into its reservation, whichever transport carries the frames
    (HTTP push_kv or the KV port). Every frame renews the lease; a layer is written into the
    reserved blocks the moment its bytes are in."""

    def __init__(self, ctx: PDContext):
        self.ctx = ctx
        self.r: Reservation | None = None
        self.nbytes = 0

    def open(self, request_id: str, key: str | None) -> None:
        """Take the push's reservation (Refused says why not). key: the reservation's KV key,
        required on the KV port (None: the push was authenticated otherwise)."""
        r = self.ctx.reservations.get(request_id)
        if r is None or r.state != "reserved":
            raise Refused(404, f"request {request_id} has no reservation here (never made, expired, aborted "
                          f"or already being pushed)")
        if key is not None and not hmac.compare_digest(key.encode(), r.kv_key.encode()):
            raise Refused(401, f"wrong KV key for request {request_id}")
        r.state = "receiving"
        r.deadline = time.monotonic() + self.ctx.lease_seconds
        self.r = r

    def header(self, head: rpc.KVFrame) -> int:
        """Check a frame header; the payload bytes to read next (0 for a heartbeat). Refused says why not.
        The first frame of a push not opened yet opens it (HTTP push_kv: the route authenticated it)."""
        ctx = self.ctx
        if self.r is None:
            self.open(head.request_id, None)
        elif head.request_id != self.r.request_id:
            raise Refused(400, "one push carries one request's KV")
        r = self.r
        if r.state != "receiving":  # expired or aborted meanwhile: the blocks are no longer ours
            raise Refused(410, f"request {r.request_id}'s reservation ended during the transfer")
        r.deadline = time.monotonic() + ctx.lease_seconds
        if head.layer == rpc.HEARTBEAT and head.nbytes == 0:
            return 0
        layers = ctx.layout.layers
        expected = len(r.prompt) * ctx.layout.token_bytes(head.layer) if 0 <= head.layer < len(layers) else -1
        if head.num_tokens != len(r.prompt) or head.nbytes != expected:
            raise Refused(400, f"layer {head.layer}: {head.num_tokens} tokens in {head.nbytes} bytes; expected "
                           f"{len(r.prompt)} tokens in {expected} bytes")
        return head.nbytes

    def payload(self, head: rpc.KVFrame, data) -> None:
        r = self.r
        if r.state != "receiving":
            raise Refused(410, f"request {r.request_id}'s reservation ended during the transfer")
        # written on the engine thread between steps, before the resume that reads it (commands keep
        # their order); `data` is this frame's own buffer, not reused
        written = self.ctx.engine.write_kv(r.engine_id, head.layer, r.blocks, head.num_tokens, data)
        written.add_done_callback(lambda done: self._written(r, head.layer, done))
        r.layers.add(head.layer)
        r.deadline = time.monotonic() + self.ctx.lease_seconds
        self.nbytes += head.nbytes

    def _written(self, r: Reservation, layer: int, done) -> None:
        """A layer's write failed: the engine dropped the request (its KV is incomplete), and so does
        the node, whether the push still runs (its next frame is refused) or all its KV is in."""
        if done.cancelled() or done.exception() is None:
            return
        ctx = self.ctx
        log.error("request %s: writing layer %d of its KV failed: %r", r.request_id, layer, done.exception())
        if ctx.reservations.get(r.request_id) is r:
            del ctx.reservations[r.request_id]
            ctx.metrics.pd_event("push_broken")
            ctx.drop_reservation(r, f"writing layer {layer} of its KV failed")

    def finish(self) -> rpc.PushResponse:
        r, layers = self.r, len(self.ctx.layout.layers)
        if r is None:
            raise Refused(400, "the push carried no KV frame")
        if len(r.layers) != layers:
            raise Refused(400, f"request {r.request_id}: {layers - len(r.layers)} of {layers} layers of KV missing")
        r.state = "ready"
        self.ctx.metrics.on_kv_received(self.nbytes)
        return rpc.PushResponse(request_id=r.request_id, layers=layers)

    def broken(self, why: str) -> None:
        """The push failed: unless all its KV is in, the reservation's blocks go back now."""
        r, ctx = self.r, self.ctx
        if r is not None and r.state == "receiving" and ctx.reservations.get(r.request_id) is r:
            del ctx.reservations[r.request_id]
            ctx.metrics.pd_event("push_broken")
            ctx.drop_reservation(r, why)


class KVPort(asyncio.BufferedProtocol):
    """The decode node's KV port: frames as on push_kv, on a bare TCP connection, received
    straight into each frame's own buffer (no copy between the socket and the cache write but
    the write itself). A KVHello with the reservation's KV key comes first; one reply frame (a
    PushResponse or an RPCError) ends the connection, as does `timeout` seconds without a
    complete frame."""

    def __init__(self, ctx: PDContext, timeout: float = 30.0):
        self.ctx = ctx
        self.timeout = timeout
        self.intake = Intake(ctx)
        self.transport = None
        self.head: rpc.KVFrame | None = None
        self.done = False
        self._timer: asyncio.TimerHandle | None = None
        self._expect(4, "hello length")

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
        self._rearm()

    def _rearm(self) -> None:
        """Another `timeout` seconds for the next frame to complete."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(self.timeout, self._expired)

    def _expired(self) -> None:
        if not self.done:
            self._end(rpc.RPCError(status=408, message=f"no complete KV frame for {self.timeout:g} s "
                                   f"(waiting for the {self.what})"))

    def get_buffer(self, sizehint: int):
        return self.view[self.have:]

    def buffer_updated(self, nbytes: int) -> None:
        self.have += nbytes
        try:
            while self.have == len(self.buf) and not self.done:
                self._complete()
                if not self.done:
                    self._rearm()
        except Refused as e:
            self._end(rpc.RPCError(status=e.status, message=e.message))
        except rpc.BadRequest as e:
            self._end(rpc.RPCError(status=400, message=str(e)))
        except Exception as e:  # a bug: this push fails, the node stays up
            log.exception("KV port failed (request %s)", self.intake.r.request_id if self.intake.r else "unknown")
            self._end(rpc.RPCError(status=500, message=f"internal error: {e!r}"))

    def _complete(self) -> None:
        if self.what in ("hello length", "length"):
            (n,) = rpc.LENGTH.unpack(self.buf)
            limit = rpc.MAX_HELLO_BYTES if self.what == "hello length" else rpc.MAX_KV_HEADER_BYTES
            if n > limit:  # refused before a byte of it is buffered
                raise rpc.BadRequest(f"a KV port frame header of {n} bytes (limit {limit})")
            self._expect(n, "hello" if self.what == "hello length" else "header")
        elif self.what == "hello":
            hello = rpc.decode(rpc.KVHello, self.buf)
            self.intake.open(hello.request_id, hello.key)
            self._expect(4, "length")
        elif self.what == "header":
            self.head = rpc.decode(rpc.KVFrame, self.buf)
            if self.head.layer == rpc.END and self.head.nbytes == 0:
                self._end(self.intake.finish())
                return
            n = self.intake.header(self.head)
            self._expect(n, "payload") if n else self._expect(4, "length")
        else:
            self.intake.payload(self.head, self.buf)
            self._expect(4, "length")

    def _end(self, reply) -> None:
        self.done = True
        if self._timer is not None:
            self._timer.cancel()
        self._expect(0, "nothing")  # no buffer held past the end
        if isinstance(reply, rpc.RPCError):
            self.intake.broken(reply.message)
        self.transport.write(rpc.frame(reply))
        self.transport.close()

    def connection_lost(self, exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if not self.done:
            self.done = True
            self.intake.broken(f"the KV connection dropped ({exc or 'closed'})")
