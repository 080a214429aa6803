"""`rtp serve --kv-disk-cache DIR`: a restarted server on the same directory answers a conversation it
saw before from the disk tier (the same greedy answer the first server computed cold), reports the
directory to a router as the first did, and /metrics counts each tier's hits, the loads decided and the
disk tier's state."""

from __future__ import annotations

import re

import httpx
import openai
from servers import MODEL, Server

from rtp.wire import rpc

SYSTEM = ("You are a careful assistant for a tea shop. " * 40).strip()
ARGS = ("--max-model-len", "1024", "--kv-host-cache-gb", "0.1")


def _ask(server: Server) -> str:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which green tea is mildest?"}])
    return r.choices[0].message.content


def _series(url: str, name: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {labels: float(value) for labels, value in
            re.findall(rf"^rtp:{name}(?:_total)?\{{([^}}]*)\}} ([0-9.e+-]+)$", text, flags=re.M)}


def _stats(server: Server) -> rpc.WorkerStats:
    """What a FlexLB master reads: the tiers it counts prefix hits in come with the load."""
    r = httpx.post(server.url + "/rpc/stats", content=rpc.encode(rpc.StatsRequest(version=rpc.RPC_VERSION)),
                   timeout=10)
    assert r.status_code == 200, r.text
    return rpc.decode(rpc.WorkerStats, r.content)


def _label(labels: str, name: str) -> str:
    return re.search(rf'{name}="([^"]*)"', labels).group(1)


def test_a_restarted_server_answers_from_the_disk_tier(tmp_path):
    directory = str(tmp_path / "kv")
    first = Server(*ARGS, "--kv-disk-cache", directory).wait_ready()
    try:
        cold = _ask(first)
        writable = _series(first.url, "kv_tier_disk_writable")
        assert list(writable.values()) == [1.0]
        before = _stats(first)
        assert before.host_blocks > 0 and before.disk_blocks > 0 and before.disk_id
        assert 0 < before.host_saving <= 1 and 0 < before.disk_saving <= 1
    finally:
        first.stop()  # queued block writes finish before the process exits
    assert len(list((tmp_path / "kv").rglob("*.kv"))) >= 20

    second = Server(*ARGS, "--kv-disk-cache", directory).wait_ready()
    try:
        assert _ask(second) == cold
        hits = {_label(k, "tier"): v for k, v in _series(second.url, "kv_tier_hit_tokens").items()}
        assert hits["disk"] >= 20 * 16 and hits["host"] == 0
        decisions = {_label(k, "decision"): v for k, v in _series(second.url, "kv_tier_decisions").items()}
        assert decisions == {"load": 1.0, "recompute": 0.0}
        assert sum(_series(second.url, "kv_tier_loaded_bytes").values()) > 0
        assert _stats(second).disk_id == before.disk_id  # one directory: the router's one disk tier
    finally:
        second.stop()
