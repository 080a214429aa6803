"""A P/D node's guards, in-process with a stub engine: the KV port's authentication and
timeouts, and /rpc/stats on a dead engine. No model loads; each test takes well under a second
of its own (the timeouts are set short)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from rtp.sampling_params import SamplingParams
from rtp.server.pd import KVPort, PDNode, Reservation
from rtp.wire import rpc

LAYOUT = SimpleNamespace(dtype="float32", layers=[[2, 1, 4]] * 2)  # the engine's: two layers of 32 bytes a token


class StubEngine:
    """What PDNode reads of an AsyncEngine: its facts and the commands it gives."""

    def __init__(self):
        self.kv_layout = LAYOUT
        self.block_size = 16
        self.dead = None
        self.stats = {"num_blocks": 10, "free_blocks": 10}
        self.dropped: list[str] = []
        self.written: list[int] = []
        self.failing_write: int | None = None  # the layer whose write fails

    def drop(self, engine_id: str) -> None:
        self.dropped.append(engine_id)

    def write_kv(self, engine_id, layer, blocks, num_tokens, kv) -> asyncio.Future:
        self.written.append(layer)
        done = asyncio.get_running_loop().create_future()
        if layer == self.failing_write:
            done.set_exception(RuntimeError("the cache write failed"))
        else:
            done.set_result(None)
        return done


class StubMetrics:
    def __init__(self):
        self.events: list[str] = []

    def pd_event(self, event: str) -> None:
        self.events.append(event)

    def on_kv_received(self, nbytes: int) -> None:
        pass


def _node(**kw) -> PDNode:
    return PDNode(StubEngine(), StubMetrics(), role="decode", model_name="stub", **kw)


def _reserve(node: PDNode, request_id: str = "r-1", tokens: int = 3) -> Reservation:
    r = Reservation(request_id, f"pd-{request_id}", list(range(tokens)), SamplingParams(max_tokens=4),
                    np.array([1]), time.monotonic() + node.lease_seconds)
    node._reservations[request_id] = r
    return r


class FakeTransport:
    def __init__(self):
        self.written = bytearray()
        self.closed = False

    def get_extra_info(self, name):
        return None

    def write(self, data) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True


def _feed(port: KVPort, data: bytes) -> None:
    """Hand data to the protocol as the event loop would: into the buffers it offers."""
    view = memoryview(data)
    while view and not port.done:
        buf = port.get_buffer(len(view))
        assert len(buf) <= max(rpc.MAX_KV_HEADER_BYTES, 64 * 1024), f"a buffer of {len(buf)} bytes offered"
        n = min(len(buf), len(view))
        buf[:n] = view[:n]
        port.buffer_updated(n)
        view = view[n:]


def _reply(data: bytes):
    (n,) = rpc.LENGTH.unpack(data[:4])
    return msgspec.msgpack.decode(data[4:4 + n])


def test_an_unauthenticated_length_prefix_allocates_nothing_big():
    async def run():
        node = _node()
        _reserve(node)
        port = KVPort(node.ctx, timeout=5.0)
        transport = FakeTransport()
        port.connection_made(transport)
        _feed(port, rpc.LENGTH.pack((16 << 20) - 1))  # "a 16 MiB header follows"
        assert port.done and transport.closed and len(port.buf) <= rpc.MAX_HELLO_BYTES
        reply = _reply(bytes(transport.written))
        assert reply["status"] == 400 and "frame header" in reply["message"]
        assert node._reservations["r-1"].state == "reserved"  # a stranger cannot end a reservation

        # the right request id with the wrong key: refused, and the reservation stays
        port, transport = KVPort(node.ctx, timeout=5.0), FakeTransport()
        port.connection_made(transport)
        _feed(port, rpc.frame(rpc.KVHello(version=1, request_id="r-1", key="wrong")))
        assert transport.closed and _reply(bytes(transport.written))["status"] == 401
        assert node._reservations["r-1"].state == "reserved" and not node.engine.dropped

        # the right key: then a KV frame header may be up to MAX_KV_HEADER_BYTES, no more
        port, transport = KVPort(node.ctx, timeout=5.0), FakeTransport()
        port.connection_made(transport)
        _feed(port, rpc.frame(rpc.KVHello(version=1, request_id="r-1", key=node._reservations["r-1"].kv_key)))
        assert not port.done and node._reservations["r-1"].state == "receiving"
        _feed(port, rpc.LENGTH.pack(rpc.MAX_KV_HEADER_BYTES + 1))
        assert transport.closed and _reply(bytes(transport.written))["status"] == 400
        assert "r-1" not in node._reservations and node.engine.dropped == ["pd-r-1"]  # a broken push

    asyncio.run(run())


def test_a_complete_push_on_the_kv_port_is_accepted():
    async def run():
        node = _node()
        r = _reserve(node, tokens=3)
        port, transport = KVPort(node.ctx, timeout=5.0), FakeTransport()
        port.connection_made(transport)
        data = rpc.frame(rpc.KVHello(version=1, request_id="r-1", key=r.kv_key))
        data += rpc.frame(rpc.KVFrame(version=1, request_id="r-1", layer=rpc.HEARTBEAT, num_tokens=0, nbytes=0))
        for layer in range(2):
            data += rpc.frame(rpc.KVFrame(version=1, request_id="r-1", layer=layer, num_tokens=3, nbytes=96))
            data += bytes(96)
        data += rpc.frame(rpc.KVFrame(version=1, request_id="r-1", layer=rpc.END, num_tokens=0, nbytes=0))
        _feed(port, data)
        assert transport.closed and _reply(bytes(transport.written)) == {"version": 1, "request_id": "r-1",
                                                                           "layers": 2}
        assert r.state == "ready" and node.engine.written == [0, 1]

    asyncio.run(run())


def test_a_failed_kv_write_drops_the_reservation():
    """The engine thread failed to write a layer (AsyncEngine.write_kv): the reservation goes, so its
    blocks return and the push's next frame, or the decode RPC, finds none."""

    async def run():
        node = _node()
        node.engine.failing_write = 0
        r = _reserve(node, tokens=3)
        port, transport = KVPort(node.ctx, timeout=5.0), FakeTransport()
        port.connection_made(transport)
        data = rpc.frame(rpc.KVHello(version=1, request_id="r-1", key=r.kv_key))
        data += rpc.frame(rpc.KVFrame(version=1, request_id="r-1", layer=0, num_tokens=3, nbytes=96)) + bytes(96)
        _feed(port, data)
        await asyncio.sleep(0)  # the write's answer comes back through the loop
        assert "r-1" not in node._reservations and r.state == "dropped" and node.engine.dropped == ["pd-r-1"]
        _feed(port, rpc.frame(rpc.KVFrame(version=1, request_id="r-1", layer=1, num_tokens=3, nbytes=96)))
        assert transport.closed and _reply(bytes(transport.written))["status"] == 410

    asyncio.run(run())


def test_an_idle_or_trickling_kv_connection_is_closed():
    """kv_timeout: a connection that completes no frame for that long is closed (408), whether it
    sends nothing or a frame a byte at a time; the reservation it was filling returns its blocks."""

    async def run():
        node = _node(kv_timeout=0.3)
        r = _reserve(node)
        await node.open_kv_port("127.0.0.1", 0)
        try:
            async def reply_and_eof(reader) -> tuple[dict, float]:
                start = time.monotonic()
                (n,) = rpc.LENGTH.unpack(await asyncio.wait_for(reader.readexactly(4), 5))
                reply = msgspec.msgpack.decode(await reader.readexactly(n))
                assert await asyncio.wait_for(reader.read(), 5) == b""
                return reply, time.monotonic() - start

            # silent from the start
            reader, writer = await asyncio.open_connection("127.0.0.1", node.kv_port)
            reply, waited = await reply_and_eof(reader)
            assert reply["status"] == 408 and 0.2 < waited < 2.0
            writer.close()

            # a hello that trickles in a byte every 0.1 s: each byte arrives within the timeout,
            # the frame does not
            reader, writer = await asyncio.open_connection("127.0.0.1", node.kv_port)
            hello = rpc.frame(rpc.KVHello(version=1, request_id="r-1", key=r.kv_key))

            async def trickle():
                for b in hello[:-1]:
                    writer.write(bytes([b]))
                    await asyncio.sleep(0.1)

            dripping = asyncio.ensure_future(trickle())
            reply, waited = await reply_and_eof(reader)
            dripping.cancel()
            assert reply["status"] == 408 and waited < 2.0
            writer.close()
            assert r.state == "reserved"  # it never authenticated: the reservation is not its to end

            # authenticated, then silent: the push is broken, the blocks go back
            reader, writer = await asyncio.open_connection("127.0.0.1", node.kv_port)
            writer.write(hello)
            reply, _ = await reply_and_eof(reader)
            assert reply["status"] == 408
            writer.close()
            assert "r-1" not in node._reservations and node.engine.dropped == ["pd-r-1"]
        finally:
            await node.close()

    asyncio.run(run())


def test_rpc_stats_answers_503_when_the_engine_is_dead():
    node = _node()
    app = Starlette(routes=node.routes())
    body = rpc.encode(rpc.StatsRequest(version=rpc.RPC_VERSION))
    with TestClient(app) as client:
        r = client.post("/rpc/stats", content=body)
        assert r.status_code == 200 and rpc.decode(rpc.WorkerStats, r.content).total_blocks == 10
        node.engine.dead = RuntimeError("the forward raised")
        r = client.post("/rpc/stats", content=body)
        assert r.status_code == 503
        assert "the forward raised" in rpc.decode(rpc.RPCError, r.content).message


@pytest.mark.parametrize("where", ["top", "field", "unknown field"])
def test_deeply_nested_msgpack_is_a_bad_request(where):
    deep = b"\x91" * 50_000 + b"\xc0"  # 50,000 nested one-element arrays
    head = {"version": 1}
    prefix = msgspec.msgpack.encode(head)[1:]  # the map's entries, without its header byte
    if where == "top":
        data = deep
    else:
        key = "request_id" if where == "field" else "junk"
        data = b"\x82" + prefix + msgspec.msgpack.encode(key) + deep
    with pytest.raises(rpc.BadRequest):
        rpc.decode(rpc.AbortRequest, data)
