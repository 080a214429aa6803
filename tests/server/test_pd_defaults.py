"""A prefill/decode pair as it runs by default: real `rtp serve` processes on loopback.

Unlike tests/server/test_pd.py's pair (float32, an RPC token, a 2 s lease) this one runs in the
default dtype (bf16 on this CPU, so one-token steps replay CPU graphs where rtp's kernels
run), with `--api-key` and no `--rpc-token` (the RPC routes then want the API key), and the
default 10 s lease, so a reservation left behind shows as a node that is not idle at once.
The reference for generated text is the decode node itself, answering the same prompts on its
own OpenAI routes in the same order: the same kernels on the same KV.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from servers import MODEL, Server, metrics
from test_pd import call, pd_events

from rtp.wire import rpc

KEY = "pd-defaults-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
COMMON = ("--api-key", KEY, "--max-model-len", "2048", "--kv-cache-memory", "512MiB", "--max-num-seqs", "16")


@pytest.fixture(scope="module")
def pair():
    decode = Server("--role", "decode", *COMMON, threads=1)
    prefill = Server("--role", "prefill", "--decode-peer", decode.url, *COMMON, threads=1)
    try:
        decode.wait_ready()
        prefill.wait_ready()
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


def _stats(server: Server) -> rpc.WorkerStats:
    r = httpx.post(server.url + "/rpc/stats", content=rpc.encode(rpc.StatsRequest(version=rpc.RPC_VERSION)),
                   headers=AUTH, timeout=10)
    assert r.status_code == 200, r.content
    return rpc.decode(rpc.WorkerStats, r.content)


def _wait_idle(*servers: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for server in servers:
        while True:
            s, m = _stats(server), metrics(server.url)
            if (s.used_blocks == 0 and s.num_running == 0 and s.num_waiting == 0 and s.num_reserved == 0
                    and m["rtp:num_free_blocks"] == s.total_blocks):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"{server.url} not idle after {timeout} s: {s}")
            time.sleep(0.1)


def _complete(server: Server, prompt, max_tokens: int = 12) -> dict:
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=120, json={
        "model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_rpc_routes_want_the_api_key_when_there_is_no_rpc_token(pair):
    prefill, decode = pair
    body = rpc.StatsRequest(version=rpc.RPC_VERSION)
    for server in pair:
        assert call(server.url, "/rpc/stats", body, token=None)[0] == 401
        assert call(server.url, "/rpc/stats", body, token=KEY)[0] == 401  # the RPC token header is not the key
        r = httpx.post(server.url + "/rpc/stats", content=rpc.encode(body), timeout=10,
                       headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and "API key" in rpc.decode(rpc.RPCError, r.content).message
        assert _stats(server).role in ("prefill", "decode")
    # the prefill node sends the key to its decode node: a request goes through
    assert _complete(prefill, "Hello")["choices"][0]["text"]


def test_one_token_steps_replayed_from_graphs_cross_the_pair(pair):
    """One token left to compute -- a one-token prompt, or a prompt cached but for its last token --
    is a one-token step, replayed from a CPU graph: its KV still reaches the decode node, and the
    text is what the decode node answers on its own."""
    prefill, decode = pair
    tokens = httpx.post(decode.url + "/tokenize", headers=AUTH, timeout=30, json={
        "prompt": "Rivers carve valleys over millions of years, and the sediment they carry builds "
                  "deltas where they meet the sea. " * 2}).json()["tokens"]
    cached = tokens[:33]  # after a first run two blocks of 16 are cached: one token left
    before = pd_events(prefill).get("decoded", 0)
    for prompt in ("hi", cached):
        want = [_complete(decode, prompt) for _ in range(2)]  # the decode node alone: the reference
        got = [_complete(prefill, prompt) for _ in range(2)]
        assert [g["choices"][0]["text"] for g in got] == [w["choices"][0]["text"] for w in want], prompt
        if prompt is cached:
            assert got[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == len(cached) - 1
    assert pd_events(prefill).get("decoded", 0) - before == 4
    _wait_idle(prefill, decode, timeout=5.0)


STORM_PROMPTS = ["hi", "The capital of France is", "word " * 300, "Count with me: one, two,",
                 "A shared preamble that fills a few KV blocks of sixteen tokens each. " * 3]


async def _storm(url: str, clients: int, seed: int) -> list[int]:
    """Streaming clients that each leave at a random time in the first 2 s, a third of them within
    50 ms (before their first token however fast the machine); what each read (data lines)."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=60, headers=AUTH, limits=httpx.Limits(max_connections=clients + 4)) as client:

        async def one(i: int) -> int:
            body = {"model": MODEL, "prompt": STORM_PROMPTS[i % len(STORM_PROMPTS)], "max_tokens": 1000,
                    "ignore_eos": True, "temperature": 0, "stream": True}
            lines = 0

            async def read() -> None:
                nonlocal lines
                async with client.stream("POST", url + "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        lines += line.startswith("data:")

            try:
                await asyncio.wait_for(read(), rng.uniform(0.005, 0.05) if i % 3 == 0 else rng.uniform(0.02, 2.0))
            except asyncio.TimeoutError:
                pass
            return lines

        return await asyncio.gather(*(one(i) for i in range(clients)))


def test_an_abort_storm_leaves_both_nodes_idle(pair):
    """Clients that leave at random times, before or after their first token, abort on both nodes in
    every interleaving: no request keeps decoding for a client that left (1000 tokens take far
    longer than the 2 s they stay), no reservation waits for its lease, and no background task's
    failure goes unhandled."""
    prefill, decode = pair
    before_p, before_d = pd_events(prefill), pd_events(decode)
    finished_before = _finished_here(decode)
    read = []
    for seed in range(2):
        read += asyncio.run(_storm(prefill.url, 40, seed))
    assert any(read) and read.count(0) >= 10  # some left after their first token, many before it
    _wait_idle(prefill, decode, timeout=5.0)  # well within the 10 s lease
    after_p, after_d = pd_events(prefill), pd_events(decode)
    grew = {event: after_p.get(event, 0) - before_p.get(event, 0) for event in ("aborted", "decoded", "local", "failed")}
    assert 0 < grew["aborted"] <= 80 and grew["decoded"] == grew["local"] == grew["failed"] == 0, grew
    assert after_d.get("lease_expired", 0) == before_d.get("lease_expired", 0)
    assert _finished_here(decode) == finished_before  # none decoded to its end for a client gone
    for server in pair:
        assert "Task exception was never retrieved" not in server.output()


def _finished_here(decode: Server) -> int:
    """Requests the decode node decoded to their end for the prefill node, per its log."""
    return sum("request pd-" in line and " finished: " in line for line in decode.output().splitlines())
