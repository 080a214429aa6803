"""The internal RPC between rtp nodes: msgspec Structs as MessagePack over plain HTTP.

Shared by the server (rtp/server/pd/, which serves and calls it) and the router
(rtp/router/flexlb.py, which polls /rpc/stats); it imports msgspec, the standard library and
rtp's Base tier (SamplingParams, itself msgspec only), so neither process pays for the other.

Every node serves these routes on its own Starlette app, next to the OpenAI API, so any
HTTP proxy or load balancer carries them. Bodies are `application/msgpack`; each Struct
carries `version` and a node answers a version it does not speak, or a body that does not
decode (nested too deeply included), with 400 and an `RPCError` saying why. With
`--rpc-token` every route needs the header `x-rtp-rpc-token`; without it but with
`--api-key`, `Authorization: Bearer <key>`; 401 without them, before any body is read.
A body is at most MAX_HEADER_BYTES (413, refused by its Content-Length before reading).

    POST /rpc/stats     StatsRequest   -> WorkerStats            (any role; the FlexLB master polls it)
    POST /rpc/reserve   ReserveRequest -> ReserveResponse        (decode: blocks held under a lease)
    POST /rpc/push_kv   frames of KVFrame + raw KV bytes -> PushResponse  (decode; opened right after
                        the reservation, heartbeats renew the lease until the layers come)
    POST /rpc/decode    DecodeRequest  -> frames of DecodeDelta  (decode: the continuation, streamed)
    POST /rpc/abort     AbortRequest   -> AbortResponse          (any role)

A streamed body is a sequence of frames: a 4-byte big-endian length, that many bytes of
MessagePack header, then the `nbytes` raw bytes the header announces (KV only). Raw bytes
keep the KV out of the MessagePack encoder: a layer's tensor goes to the socket as it is.

The decode node's KV port (kv_intake.py) carries the same KV frames on a bare TCP
connection, after a first frame of its own:

    KVHello (request id, the reservation's kv_key; at most MAX_HELLO_BYTES)
    KVFrame (at most MAX_KV_HEADER_BYTES) [+ nbytes raw]  ...  KVFrame layer=END
    <- one frame: PushResponse or RPCError
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import AsyncIterator

import msgspec
from msgspec import Struct

from rtp.sampling_params import SamplingParams
from rtp.wire.kv_layout import KVLayout

RPC_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})
CONTENT_TYPE = "application/msgpack"
TOKEN_HEADER = "x-rtp-rpc-token"
# on the prefill node's OpenAI routes: the decode node to hand this request to (the master's pick);
# honoured only with the RPC token, since the node will send its KV, and the token, there
PEER_HEADER = "x-rtp-decode-peer"

_encoder = msgspec.msgpack.Encoder()
LENGTH = struct.Struct(">I")
MAX_HEADER_BYTES = 16 << 20  # a reserve carries a whole prompt; nothing else comes near
MAX_KV_HEADER_BYTES = 4096  # a KVFrame header: a request id and a few integers
MAX_HELLO_BYTES = 1024      # the KV port's first frame, read before the peer is authenticated


class RPCError(Struct, kw_only=True):
    version: int = RPC_VERSION
    status: int
    message: str


class StatsRequest(Struct, kw_only=True):
    version: int


class WorkerStats(Struct, kw_only=True):
    """One worker's load, as the FlexLB master routes by it."""

    version: int = RPC_VERSION
    role: str                     # collocated | prefill | decode
    model: str                    # the served model name
    block_size: int
    total_blocks: int             # usable KV blocks
    free_blocks: int              # allocatable now: free plus evictable (prefix cache, unreferenced)
    used_blocks: int              # held by requests (running, reserved or handed off)
    cached_blocks: int            # held by the prefix cache (used or not)
    num_waiting: int
    num_running: int
    num_reserved: int             # decode: reservations whose KV has not all arrived
    queued_prompt_tokens: int     # prompt tokens of waiting requests
    prefill_tokens_per_ms: float  # measured (moving average); 0 until a prefill ran
    decode_step_ms: float         # measured (moving average) over decode-only steps; 0 until one ran
    kv_cache_usage: float
    kv_layout: KVLayout           # a prefill node hands KV only to a decode node of the same layout
    # its KV tiers (--kv-host-cache-gb, --kv-disk-cache), which a router counts prefix hits in
    host_blocks: int = 0          # host tier size (0: none)
    host_saving: float = 0.0      # share of a prompt token's compute time a load from there saves
    disk_id: str = ""             # the disk tier's directory and model ("" none): the same for workers sharing it
    disk_blocks: int = 0
    disk_saving: float = 0.0


class ReserveRequest(Struct, kw_only=True):
    version: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_layout: KVLayout           # the prefill node's: the decode node refuses a different one


class ReserveResponse(Struct, kw_only=True):
    version: int = RPC_VERSION
    request_id: str
    num_blocks: int
    block_size: int
    lease_seconds: float          # renewed by every KV frame; expired, the blocks return to the pool
    kv_port: int = 0              # the decode node's KV port (0: none, push over HTTP)
    kv_key: str = ""              # what the KVHello on the KV port must carry
    kv_timeout: float = 0.0       # the KV port closes a connection that completes no frame this long (0: unsaid)


class KVHello(Struct, kw_only=True):
    """The first frame on the KV port: which reservation, and its key (checked before anything else)."""

    version: int
    request_id: str
    key: str


class KVFrame(Struct, kw_only=True):
    """Header of one layer's KV of a request: tokens [0, num_tokens), token-major, nbytes raw bytes."""

    version: int
    request_id: str
    layer: int
    num_tokens: int
    nbytes: int
    # read by no one now: the key travels in the KVHello. An older sender's first frame (a heartbeat
    # carrying the key) still reads as a KVHello, so it is kept for them (and tools/bench_pd.py)
    key: str = ""


HEARTBEAT = -1  # a KVFrame of this layer (no bytes) only renews the lease: the prompt is still queued or prefilling
END = -2        # on the KV port: every layer was sent, reply now


class PushResponse(Struct, kw_only=True):
    version: int = RPC_VERSION
    request_id: str
    layers: int                   # layers received and written


class DecodeRequest(Struct, kw_only=True):
    version: int
    request_id: str
    first_token: int
    logprobs: dict[int, float] | None = None  # the first token's entry, when the request wants logprobs
    num_cached_tokens: int = 0                # prompt tokens the prefill node's prefix cache supplied


class DecodeDelta(Struct, kw_only=True):
    """What one decode step added (the first frame carries the first token)."""

    version: int = RPC_VERSION
    text: str = ""
    num_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None      # the request failed on the decode node: the stream ends here
    error_status: int = 500


class AbortRequest(Struct, kw_only=True):
    version: int
    request_id: str


class AbortResponse(Struct, kw_only=True):
    version: int = RPC_VERSION
    found: bool


class _Versioned(Struct):
    version: int


class BadRequest(Exception):
    """A body this node cannot take: answered with 400 and the reason."""


def encode(message: Struct) -> bytes:
    return _encoder.encode(message)


def decode(kind: type, data: bytes | bytearray | memoryview):
    """Decode a body as `kind`, checking its version first; BadRequest says what is wrong."""
    # msgspec bounds its own recursion: a body nested too deeply raises RecursionError, cleanly
    try:
        version = msgspec.msgpack.decode(data, type=_Versioned).version
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as e:
        raise BadRequest(f"not a versioned rtp RPC message ({kind.__name__}): {e}") from None
    if version not in SUPPORTED_VERSIONS:
        raise BadRequest(f"RPC version {version} is not supported (this node speaks "
                         f"{', '.join(map(str, sorted(SUPPORTED_VERSIONS)))})")
    try:
        return msgspec.msgpack.decode(data, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as e:
        raise BadRequest(f"malformed {kind.__name__}: {e}") from None


def frame(header: Struct) -> bytes:
    """A frame's length prefix and header (a KVFrame's nbytes raw bytes are to follow it)."""
    data = _encoder.encode(header)
    return LENGTH.pack(len(data)) + data


def authorized(token: str | None, given: str | None) -> bool:
    return token is None or (given is not None and hmac.compare_digest(given.encode(), token.encode()))


def bearer_authorized(key: str, authorization: str | None) -> bool:
    """Whether an Authorization header is `Bearer <key>`."""
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


class FrameReader:
    """Frames out of a stream of byte chunks of any size (what an HTTP body arrives as)."""

    def __init__(self, chunks: AsyncIterator[bytes], max_header: int = MAX_HEADER_BYTES):
        self._chunks = chunks.__aiter__()
        self._buf = bytearray()
        self._eof = False
        self.max_header = max_header

    async def _more(self) -> bool:
        if self._eof:
            return False
        try:
            chunk = await self._chunks.__anext__()
        except StopAsyncIteration:
            self._eof = True
            return False
        self._buf += chunk
        return True

    async def header(self, kind: type):
        """The next frame's header as `kind`; None at the end of the stream (between frames)."""
        while len(self._buf) < 4:
            if not await self._more():
                if self._buf:
                    raise EOFError("the stream ended inside a frame's length")
                return None
        (n,) = LENGTH.unpack_from(self._buf)
        if n > self.max_header:
            raise BadRequest(f"a frame header of {n} bytes (more than {self.max_header})")
        data = await self.read(4 + n)
        return decode(kind, memoryview(data)[4:])

    async def read(self, n: int) -> bytearray:
        """Exactly n bytes (EOFError when the stream ends first); a large payload is copied once,
        chunk by chunk, into its own buffer."""
        buf = self._buf
        if len(buf) >= n:
            out = buf[:n]
            del buf[:n]
            return out
        out = bytearray(n)
        view = memoryview(out)
        have = len(buf)
        view[:have] = buf
        buf.clear()
        while have < n:
            try:
                chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                self._eof = True
                raise EOFError(f"the stream ended {n - have} bytes into a frame of {n}") from None
            take = min(len(chunk), n - have)
            view[have:have + take] = memoryview(chunk)[:take]
            have += take
            if take < len(chunk):
                buf += memoryview(chunk)[take:]
        return out
