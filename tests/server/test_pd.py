"""Prefill/decode disaggregation, end to end: real `rtp serve` processes on loopback.

Three servers start together at the top of the module (loading overlaps) and are shared:
a collocated one (the reference), a decode node (short KV lease, so expiry is testable) and
a prefill node relaying through it. All run float32, as tests/server/test_serve.py's reference
server does: greedy tokens must not depend on how requests were batched, which bf16
does not promise and fp32 practically does. The last test kills the decode node.
"""

from __future__ import annotations

import json
import re
import select
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import numpy as np
import openai
import pytest
import torch
from servers import MODEL, Server, free_port, metrics

from rtp.engine.kv_transfer import gather, layout_of, raw_view, scatter, token_slots
from rtp.sampling_params import SamplingParams
from rtp.server.pd.node import wire_layout
from rtp.wire import rpc

TOKEN = "pd-test-secret"
COMMON = ("--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "96MiB", "--max-num-seqs", "16")
LEASE = 2.0


@pytest.mark.parametrize(("src_bs", "dst_bs", "n"), [(16, 16, 64), (16, 8, 61), (4, 16, 33), (16, 32, 5)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_moves_token_major_between_block_sizes(src_bs, dst_bs, n, dtype):
    """Gather on one node, raw bytes on the wire, scatter on the other: the layout conversion."""
    rng = np.random.default_rng(n)
    src = torch.randn(2, 40, src_bs, 3, 8).to(dtype)
    dst = torch.zeros(2, 80, dst_bs, 3, 8, dtype=dtype)
    src_blocks = rng.permutation(np.arange(1, 40))[: -(-n // src_bs)]
    dst_blocks = rng.permutation(np.arange(1, 80))[: -(-n // dst_bs)]
    kv = gather(src, token_slots(src_blocks, src_bs, n))
    wire = raw_view(kv).tobytes()
    scatter(dst, token_slots(dst_blocks, dst_bs, n), wire)
    assert torch.equal(gather(dst, token_slots(dst_blocks, dst_bs, n)), kv)
    pos = np.arange(n)  # token t of the request sits in its block t // bs at offset t % bs
    assert torch.equal(dst[:, dst_blocks[pos // dst_bs], pos % dst_bs], src[:, src_blocks[pos // src_bs], pos % src_bs])
    untouched = np.setdiff1d(np.arange(80), dst_blocks)
    assert not dst[:, untouched].any()
    # the engine's description of each cache, as the wire carries it (the dtype's size from the wire's table)
    layout = wire_layout(layout_of([src]))
    assert layout.token_bytes(0) * n == len(wire)
    assert layout.mismatch(wire_layout(layout_of([dst]))) is None
    assert "dtype" in layout.mismatch(wire_layout(layout_of([dst.to(torch.float16)])))


@pytest.fixture(scope="module")
def nodes():
    decode = Server("--role", "decode", "--rpc-token", TOKEN, "--kv-lease", str(LEASE), *COMMON, threads=1)
    launched = {
        "decode": decode,
        "prefill": Server("--role", "prefill", "--rpc-token", TOKEN, "--decode-peer", decode.url, *COMMON, threads=1),
        "collocated": Server(*COMMON, threads=1),
    }
    try:
        for server in launched.values():
            server.wait_ready()
        yield launched
    finally:
        for server in launched.values():
            server.stop()


@pytest.fixture(scope="module")
def clients(nodes):
    def client(name):
        return openai.OpenAI(base_url=nodes[name].url + "/v1", api_key="unused", max_retries=0, timeout=120)

    return client("prefill"), client("collocated")


def call(url: str, path: str, message, token: str | None = TOKEN, kind: type | None = None):
    """One RPC: (status, decoded reply or RPCError)."""
    headers = {"content-type": rpc.CONTENT_TYPE}
    if token is not None:
        headers[rpc.TOKEN_HEADER] = token
    body = message if isinstance(message, bytes) else rpc.encode(message)
    r = httpx.post(url + path, content=body, headers=headers, timeout=30)
    if r.status_code == 200:
        return 200, rpc.decode(kind, r.content) if kind else r.content
    return r.status_code, rpc.decode(rpc.RPCError, r.content)


def stats(server: Server) -> rpc.WorkerStats:
    status, s = call(server.url, "/rpc/stats", rpc.StatsRequest(version=rpc.RPC_VERSION), kind=rpc.WorkerStats)
    assert status == 200, s
    return s


def pd_events(server: Server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^rtp:pd_events_total\{[^}]*event="(\w+)"[^}]*\} ([0-9.e+-]+)$', text, re.MULTILINE)}


def wait_idle(*servers: Server, timeout: float = 15.0) -> None:
    """Every block back in the pool, per the stats RPC and /metrics alike."""
    deadline = time.monotonic() + timeout
    for server in servers:
        while True:
            s, m = stats(server), metrics(server.url)
            idle = (s.used_blocks == 0 and s.num_running == 0 and s.num_waiting == 0 and s.num_reserved == 0
                    and m["rtp:num_used_blocks"] == 0 and m["rtp:num_requests_reserved"] == 0
                    and m["rtp:num_free_blocks"] == s.total_blocks)
            if idle:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"{server.url} not idle after {timeout} s: {s}")
            time.sleep(0.1)


def _requests():
    """16 requests: completions and chat, streamed and not; a long prompt (many blocks) and two
    sharing a prefix (the second hits the prefill node's prefix cache)."""
    long_prompt = "Here is a list of fruits: " + ", ".join(["apple", "banana", "cherry", "grape"] * 20) + ". The"
    shared = "You are a helpful assistant who answers in one sentence. " * 4
    prompts = ["The capital of France is", "def fibonacci(n):", long_prompt, "Once upon a time",
               shared + "What is two plus two?", shared + "Name a primary colour.", "1, 2, 3, 4,", "The sky is"]
    out = []
    for i, p in enumerate(prompts):
        out.append(("completion", bool(i % 2), p))
        out.append(("chat", not i % 2, p))
    return out


def _run(client: openai.OpenAI, kind: str, stream: bool, text: str) -> str:
    common = {"model": MODEL, "temperature": 0, "max_tokens": 8, "stream": stream}
    if kind == "completion":
        r = client.completions.create(prompt=text, **common)
        return "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
    r = client.chat.completions.create(messages=[{"role": "user", "content": text}], **common)
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in r if c.choices)
    return r.choices[0].message.content


def test_a_prefill_decode_pair_generates_what_a_collocated_server_does(nodes, clients):
    pd, colo = clients
    requests = _requests()
    before = pd_events(nodes["prefill"])
    # the pair and the reference at once: 16 concurrent requests on each (fp32: batching changes no token)
    with ThreadPoolExecutor(32) as pool:
        got = pool.map(lambda r: _run(pd, *r), requests)
        want = pool.map(lambda r: _run(colo, *r), requests)
        got, want = list(got), list(want)
    for r, g, w in zip(requests, got, want):
        assert g == w, r
    # every one went through the decode node, but for those whose first token was already eos
    # (empty outputs here): the prefill node answers those itself
    events = pd_events(nodes["prefill"])
    assert events.get("local", 0) - before.get("local", 0) == sum(w == "" for w in want)
    assert events.get("decoded", 0) - before.get("decoded", 0) == sum(w != "" for w in want) >= 12
    assert metrics(nodes["prefill"].url)["rtp:pd_kv_sent_bytes_total"] > 0
    wait_idle(nodes["prefill"], nodes["decode"])


def test_the_second_of_two_same_prompts_reuses_the_prefill_nodes_cache(nodes, clients):
    pd, _ = clients
    prompt = "A long shared preamble that fills several KV blocks of sixteen tokens each. " * 6
    first = pd.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)
    again = pd.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens >= 64
    wait_idle(nodes["prefill"], nodes["decode"])


def test_a_first_token_that_ends_the_request_is_answered_by_the_prefill_node(nodes, clients):
    pd, colo = clients
    first = colo.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                    max_tokens=1).choices[0].text
    assert first.strip()
    before = pd_events(nodes["prefill"]).get("local", 0)
    for client in (pd, colo):
        r = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=10,
                                      stop=[first.strip()])
        assert r.choices[0].finish_reason == "stop"
    assert pd_events(nodes["prefill"]).get("local", 0) - before == 1
    wait_idle(nodes["prefill"], nodes["decode"])  # the decode node's reservation was aborted


def test_logprobs_and_usage_cross_the_pair(nodes, clients):
    pd, colo = clients
    args = {"model": MODEL, "prompt": "Water boils at", "temperature": 0, "max_tokens": 6, "logprobs": 2}
    a, b = pd.completions.create(**args), colo.completions.create(**args)
    assert a.choices[0].logprobs.tokens == b.choices[0].logprobs.tokens
    assert a.choices[0].logprobs.token_logprobs == pytest.approx(b.choices[0].logprobs.token_logprobs, abs=1e-3)
    assert a.usage.completion_tokens == b.usage.completion_tokens == 6


def test_rpc_routes_want_the_token_and_well_formed_bodies(nodes):
    d, c = nodes["decode"], nodes["collocated"]
    stats_request = rpc.StatsRequest(version=rpc.RPC_VERSION)
    assert call(d.url, "/rpc/stats", stats_request, token=None)[0] == 401
    assert call(d.url, "/rpc/stats", stats_request, token="wrong")[0] == 401
    assert call(c.url, "/rpc/stats", stats_request, token=None)[0] == 200  # a node without --rpc-token
    status, e = call(d.url, "/rpc/stats", b"\xc1 not msgpack")
    assert status == 400 and "versioned" in e.message
    status, e = call(d.url, "/rpc/stats", rpc.StatsRequest(version=99))
    assert status == 400 and "version 99" in e.message
    status, e = call(d.url, "/rpc/abort", msgspec.msgpack.encode({"version": 1, "request_id": 7}))
    assert status == 400 and "request_id" in e.message
    layout = stats(d).kv_layout
    reserve = {"version": 1, "request_id": "r-bad", "prompt_token_ids": [1, 2, 3], "params": SamplingParams(max_tokens=4)}
    status, e = call(d.url, "/rpc/reserve", rpc.ReserveRequest(**reserve, kv_layout=rpc.KVLayout("bfloat16",
                                                                                                 layout.layers)))
    assert status == 400 and "dtype bfloat16" in e.message
    status, e = call(c.url, "/rpc/reserve", rpc.ReserveRequest(**reserve, kv_layout=layout), token=None)
    assert status == 409 and "collocated" in e.message
    status, e = call(d.url, "/rpc/decode", rpc.DecodeRequest(version=1, request_id="nobody", first_token=5))
    assert status == 404
    assert httpx.get(d.url + "/health").status_code == 200
    wait_idle(d)


def _generate(server: Server, headers=None, **body):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 0, **body}
    return httpx.post(server.url + "/v1/completions", json=body, headers=headers or {}, timeout=60)


def test_an_unreachable_or_refusing_decode_node_gets_503(nodes):
    p = nodes["prefill"]
    dead = f"http://127.0.0.1:{free_port()}"
    r = _generate(p, {rpc.PEER_HEADER: dead, rpc.TOKEN_HEADER: TOKEN})
    assert r.status_code == 503 and "unreachable" in r.json()["error"]["message"]
    r = _generate(p, {rpc.PEER_HEADER: nodes["collocated"].url, rpc.TOKEN_HEADER: TOKEN}, stream=True)
    assert r.status_code == 503 and "refused" in r.json()["error"]["message"]
    # the master's per-request pick is honoured only with the RPC token: else a client could send
    # the node's KV (and its token) anywhere
    r = _generate(p, {rpc.PEER_HEADER: nodes["decode"].url})
    assert r.status_code == 503 and "RPC token" in r.json()["error"]["message"]
    assert _generate(p, {rpc.PEER_HEADER: nodes["decode"].url, rpc.TOKEN_HEADER: TOKEN}).status_code == 200
    wait_idle(p, nodes["decode"])


def _reserve(d: Server, request_id: str, prompt_len: int = 40):
    layout = stats(d).kv_layout
    status, reply = call(d.url, "/rpc/reserve", rpc.ReserveRequest(
        version=1, request_id=request_id, prompt_token_ids=list(range(100, 100 + prompt_len)),
        params=SamplingParams(max_tokens=8), kv_layout=layout), kind=rpc.ReserveResponse)
    assert status == 200, reply
    return layout, reply


def test_a_broken_transfer_or_an_unused_lease_returns_the_blocks(nodes):
    d = nodes["decode"]
    before = pd_events(d)
    # a prefill node that dies halfway through the layers: the connection drops
    layout, reply = _reserve(d, "broken-1")
    assert stats(d).num_reserved == 1 and stats(d).used_blocks == reply.num_blocks == 3

    class Dropped(Exception):
        pass

    def frames():
        for layer in range(3):
            n = 40 * layout.token_bytes(layer)
            yield rpc.frame(rpc.KVFrame(version=1, request_id="broken-1", layer=layer, num_tokens=40, nbytes=n))
            yield bytes(n // 2) if layer == 2 else bytes(n)
            time.sleep(0.05)
        raise Dropped()

    with pytest.raises((Dropped, httpx.HTTPError)):
        httpx.post(d.url + "/rpc/push_kv", content=frames(), timeout=30,
                   headers={rpc.TOKEN_HEADER: TOKEN, "content-type": rpc.CONTENT_TYPE})
    wait_idle(d, timeout=LEASE * 3)
    assert pd_events(d).get("push_broken", 0) + pd_events(d).get("lease_expired", 0) > \
        before.get("push_broken", 0) + before.get("lease_expired", 0)
    # a reservation nothing arrives for: its lease expires
    _reserve(d, "silent-1")
    time.sleep(LEASE / 2)
    assert stats(d).used_blocks == 3  # still held within the lease
    wait_idle(d, timeout=LEASE * 3)
    assert pd_events(d).get("lease_expired", 0) >= before.get("lease_expired", 0) + 1
    status, e = call(d.url, "/rpc/decode", rpc.DecodeRequest(version=1, request_id="silent-1", first_token=5))
    assert status == 404 and "expired" in e.message


def test_a_first_token_that_cannot_continue_is_refused_and_frees_the_reservation(nodes):
    d = nodes["decode"]
    layout = stats(d).kv_layout
    params = SamplingParams(max_tokens=8, stop_token_ids=[7])
    status, reply = call(d.url, "/rpc/reserve", rpc.ReserveRequest(
        version=1, request_id="stops-at-once", prompt_token_ids=list(range(100, 140)), params=params,
        kv_layout=layout), kind=rpc.ReserveResponse)
    assert status == 200, reply

    def frames():
        for layer in range(len(layout.layers)):
            n = 40 * layout.token_bytes(layer)
            yield rpc.frame(rpc.KVFrame(version=1, request_id="stops-at-once", layer=layer, num_tokens=40, nbytes=n))
            yield bytes(n)

    status, pushed = call(d.url, "/rpc/push_kv", b"".join(frames()), kind=rpc.PushResponse)
    assert status == 200 and pushed.layers == len(layout.layers)
    # token 7 is a stop token: the prefill node should have finished the request itself
    r = httpx.post(d.url + "/rpc/decode", content=rpc.encode(rpc.DecodeRequest(
        version=1, request_id="stops-at-once", first_token=7)), headers={rpc.TOKEN_HEADER: TOKEN}, timeout=30)
    (n,) = rpc.LENGTH.unpack(r.content[:4])
    delta = rpc.decode(rpc.DecodeDelta, r.content[4:4 + n])
    assert delta.error_status == 400 and "finishes" in delta.error
    wait_idle(d)


def test_a_client_that_leaves_aborts_on_both_nodes(nodes):
    p, d = nodes["prefill"], nodes["decode"]
    before = pd_events(p).get("aborted", 0)
    body = {"model": MODEL, "prompt": "Count with me: one, two,", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", p.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
        assert got
        assert stats(d).num_running == 1  # decoding there now
    wait_idle(p, d)
    # and one that leaves during the prefill or the transfer, whichever it is in
    long = {**body, "prompt": "word " * 300, "max_tokens": 150, "stream": False}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(p.url + "/v1/completions", json=long, timeout=0.3)
    wait_idle(p, d)
    assert pd_events(p).get("aborted", 0) - before == 2


def _tokens(server: Server, text: str) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]


def test_one_token_and_fully_cached_prompts_cross_the_pair(nodes, clients):
    """A prompt with one token left to compute -- one token long, or found in the prefill node's
    cache but for its last token -- makes a one-token step, which must hand the decode node every
    layer's KV like any other (tests/engine/test_kv_taps.py has each step shape)."""
    pd, colo = clients
    long = _tokens(nodes["collocated"], "The history of the printing press begins in the fifteenth century, "
                                        "when movable type changed how books were made and read. " * 2)
    cached = long[:33]  # 33 tokens: two blocks of 16 in the prefix cache after a first run, one left
    before = pd_events(nodes["prefill"]).get("decoded", 0)
    args = {"model": MODEL, "temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    for prompt in ("hi", cached):
        runs = [(client.completions.create(prompt=prompt, **args), client.completions.create(prompt=prompt, **args))
                for client in (pd, colo)]
        (first, again), (want_first, want_again) = runs
        assert first.choices[0].text == want_first.choices[0].text and first.choices[0].text, prompt
        assert again.choices[0].text == want_again.choices[0].text, prompt
        if prompt is cached:
            assert again.usage.prompt_tokens_details.cached_tokens == len(cached) - 1
    assert pd_events(nodes["prefill"]).get("decoded", 0) - before == 4  # all through the decode node
    wait_idle(nodes["prefill"], nodes["decode"])


def _raw_post(server: Server, path: str, headers: dict[str, str], body=None) -> tuple[bytes, int]:
    """POST on a bare socket: (the start of the answer, body bytes sent). body(sock) sends what it
    wants and returns the count; the answer may be empty when the server closed on it."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        head = f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: {rpc.CONTENT_TYPE}\r\n"
        s.sendall((head + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode())
        sent = body(s) if body is not None else 0
        try:
            return s.recv(4096), sent
        except OSError:
            return b"", sent


def test_rpc_bodies_are_bounded_as_they_are_read(nodes):
    """Credentials before the body; then a Content-Length over the limit is refused at once, and a
    body without one is counted as it streams: neither is buffered whole."""
    d = nodes["decode"]
    huge = str(400 << 20)
    start = time.monotonic()
    answer, _ = _raw_post(d, "/rpc/stats", {"content-length": huge})  # no token: 401, nothing read
    assert answer.startswith(b"HTTP/1.1 401")
    answer, _ = _raw_post(d, "/rpc/stats", {"content-length": huge, rpc.TOKEN_HEADER: TOKEN})
    assert answer.startswith(b"HTTP/1.1 413")
    assert time.monotonic() - start < 5  # not waiting for 400 MiB that never comes

    def chunked(s: socket.socket) -> int:
        chunk = b"%x\r\n" % (1 << 20) + bytes(1 << 20) + b"\r\n"
        sent = 0
        try:
            while sent < 400 << 20 and not select.select([s], [], [], 0)[0]:  # until the server answers
                s.sendall(chunk)
                sent += 1 << 20
        except OSError:  # it answered and closed
            pass
        return sent

    answer, sent = _raw_post(d, "/rpc/reserve", {"transfer-encoding": "chunked", rpc.TOKEN_HEADER: TOKEN}, chunked)
    assert sent < 64 << 20, f"{sent >> 20} MiB sent before the server refused"
    assert answer == b"" or answer.startswith(b"HTTP/1.1 413"), answer[:100]
    status, e = call(d.url, "/rpc/abort", b"\x82" + msgspec.msgpack.encode("version") + b"\x01"
                     + msgspec.msgpack.encode("request_id") + b"\x91" * 50_000 + b"\xc0")
    assert status == 400 and "recursion" in e.message
    assert httpx.get(d.url + "/health").status_code == 200
    wait_idle(d)


def test_the_kv_port_refuses_a_stranger_before_reading(nodes):
    d = nodes["decode"]
    _, reply = _reserve(d, "stranger-1")
    assert reply.kv_port > 0 and reply.kv_timeout > 0
    with socket.create_connection(("127.0.0.1", reply.kv_port), timeout=10) as s:
        s.sendall(rpc.LENGTH.pack((16 << 20) - 1))  # "a 16 MiB first frame follows"
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    (n,) = rpc.LENGTH.unpack(data[:4])
    error = rpc.decode(rpc.RPCError, data[4:4 + n])
    assert error.status == 400 and "frame header" in error.message
    assert stats(d).num_reserved == 1  # a stranger cannot end a reservation
    call(d.url, "/rpc/abort", rpc.AbortRequest(version=1, request_id="stranger-1"))
    wait_idle(d, timeout=LEASE / 2)


def test_a_closed_decode_stream_aborts_on_the_decode_node(nodes):
    """Without an abort RPC: the prefill node's connection closing is enough."""
    d = nodes["decode"]
    layout = stats(d).kv_layout
    status, reply = call(d.url, "/rpc/reserve", rpc.ReserveRequest(
        version=1, request_id="closed-1", prompt_token_ids=list(range(100, 140)),
        params=SamplingParams(max_tokens=400, ignore_eos=True), kv_layout=layout), kind=rpc.ReserveResponse)
    assert status == 200, reply
    frames = []
    for layer in range(len(layout.layers)):
        n = 40 * layout.token_bytes(layer)
        frames += [rpc.frame(rpc.KVFrame(version=1, request_id="closed-1", layer=layer, num_tokens=40, nbytes=n)),
                   bytes(n)]
    assert call(d.url, "/rpc/push_kv", b"".join(frames), kind=rpc.PushResponse)[0] == 200
    body = rpc.encode(rpc.DecodeRequest(version=1, request_id="closed-1", first_token=5))
    with httpx.stream("POST", d.url + "/rpc/decode", content=body, headers={rpc.TOKEN_HEADER: TOKEN},
                      timeout=30) as r:
        chunks = r.iter_bytes()
        next(chunks)
        next(chunks)
        assert stats(d).num_running == 1
    wait_idle(d, timeout=3.0)  # 400 tokens take far longer


def test_an_abort_that_overtakes_its_reserve_still_frees_the_blocks(nodes):
    d = nodes["decode"]
    layout = stats(d).kv_layout

    def reserve(request_id: str):
        return call(d.url, "/rpc/reserve", rpc.ReserveRequest(
            version=1, request_id=request_id, prompt_token_ids=list(range(100, 140)),
            params=SamplingParams(max_tokens=8), kv_layout=layout), kind=rpc.ReserveResponse)

    def abort(request_id: str):
        return call(d.url, "/rpc/abort", rpc.AbortRequest(version=1, request_id=request_id), kind=rpc.AbortResponse)

    status, reply = abort("overtaken-0")
    assert status == 200 and not reply.found
    status, e = reserve("overtaken-0")
    assert status == 409 and "aborted" in e.message
    # both in flight at once, whichever lands first
    with ThreadPoolExecutor(16) as pool:
        done = [(pool.submit(reserve, f"overtaken-{i}"), pool.submit(abort, f"overtaken-{i}")) for i in range(1, 13)]
        outcomes = [(r.result()[0], a.result()[1].found) for r, a in done]
    assert all(status in (200, 409) for status, _ in outcomes), outcomes
    wait_idle(d, timeout=LEASE / 2)  # before any lease could have expired


def test_structured_outputs_cross_the_pair(nodes, clients):
    """The grammar travels with the request: the prefill node samples the first token under it, the
    decode node advances its own matcher by that token and goes on (or, when that token completes
    the grammar, the prefill node answers); logit_bias likewise."""
    pd, colo = clients
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "rating"],
              "properties": {"city": {"type": "string", "maxLength": 20},
                             "rating": {"type": "integer", "minimum": 1, "maximum": 5}}}
    requests = [
        dict(prompt="A city review:", extra_body={"guided_json": schema}),
        dict(prompt="Is the sky blue? Answer:", extra_body={"guided_choice": ["yes", "no", "maybe"]}),
        dict(prompt="A date:", extra_body={"guided_regex": r"\d{4}-\d{2}-\d{2}"}),
        dict(prompt="The capital of France is", logit_bias={"1234": 100}, extra_body={"ignore_eos": True}),
    ]

    def complete(client, r):
        return client.completions.create(model=MODEL, temperature=0, max_tokens=40, **r).choices[0]

    # the pair and the reference at once, every request concurrently (fp32: batching changes no token)
    with ThreadPoolExecutor(2 * len(requests)) as pool:
        got = pool.map(lambda r: complete(pd, r), requests)
        want = pool.map(lambda r: complete(colo, r), requests)
        got, want = list(got), list(want)
    for r, g, w in zip(requests, got, want):
        assert (g.text, g.finish_reason) == (w.text, w.finish_reason), r
    json.loads(got[0].text)  # the schema's answer, through the pair, is JSON
    wait_idle(nodes["prefill"], nodes["decode"])


def test_a_decode_node_that_dies_fails_the_stream_and_frees_the_prefill_node(nodes):
    """Last: it kills the decode node."""
    p, d = nodes["prefill"], nodes["decode"]
    body = {"model": MODEL, "prompt": "Count with me: one, two,", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    started = time.monotonic()
    events = []
    with httpx.stream("POST", p.url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(line[5:].strip())
                if len(events) == 3:
                    d.proc.send_signal(signal.SIGKILL)
    assert time.monotonic() - started < 30
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "decode node" in error["message"]
    assert len(events) < 100
    wait_idle(p)
    r = _generate(p)  # and the prefill node says why the next request cannot run
    assert r.status_code == 503 and "unreachable" in r.json()["error"]["message"]
