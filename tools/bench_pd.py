"""Prefill/decode disaggregation on loopback: KV transfer bandwidth, its share of TTFT, overlap.

For each shape (the default model, and a random Llama with a larger KV per token: 32 layers of
8 KV heads of 128 dims, 128 KiB per token in bf16, an 8B model's KV over a tiny MLP):

1. transfer: a decode node (`rtp serve --role decode`) in a subprocess; this process reserves
   a CTX-token request and pushes every layer's KV through the real push_kv RPC (the framing the
   prefill node uses), timed from the first byte out to the decode node's acknowledgement, so
   the figure includes HTTP, the frame parsing and the writes into the decode node's blocks.
2. TTFT: a prefill node relaying to that decode node, and the prefill node's own engine as the
   collocated reference: CTX-token prompts (fresh random tokens each time: no prefix-cache hits)
   with max_tokens 2, TTFT measured by a streaming client. The prefill node's
   rtp:pd_kv_transfer_seconds (first layer out to acknowledgement) says how long the push took;
   TTFT(pd) - TTFT(collocated) is what the client waited for it, the rest was hidden behind the
   prefill of later layers (layers are sent as each one's attention has written its KV).

3. with --mixed (or --mixed-only): the same mixed workload (every 4th request a long prompt,
   the others short, Poisson arrivals) against 2 collocated nodes, requests dealt round robin as
   a load balancer would, and against 1 prefill + 1 decode node; P99 TTFT and P99 time between
   tokens (TBT) of each, timed by `rtp bench serve`'s client (`rtp bench serve` itself targets one
   URL, so it cannot deal requests over two nodes).

Prints a table, then one line of JSON. Every node shares this machine's cores with the others
and with this client: read the figures as what loopback on this machine gives, not a network.

    python tools/bench_pd.py [--ctx 2048] [--repeat 5] [--skip-large] [--mixed | --mixed-only]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from _common import REPO, free_port
from rtp.sampling_params import SamplingParams
from rtp.wire import rpc

TOKEN = "bench-pd"


class Node:
    def __init__(self, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench-pd-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "rtp", "serve", "--port", str(self.port),
                                      "--rpc-token", TOKEN, "--log-level", "warning", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)

    def wait(self, timeout: float = 600) -> Node:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"rtp serve exited:\n{Path(self.log.name).read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise SystemExit(f"rtp serve not ready in {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        os.unlink(self.log.name)

    def stats(self) -> rpc.WorkerStats:
        r = httpx.post(self.url + "/rpc/stats", content=rpc.encode(rpc.StatsRequest(version=rpc.RPC_VERSION)),
                       headers={rpc.TOKEN_HEADER: TOKEN}, timeout=30)
        return rpc.decode(rpc.WorkerStats, r.content)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def random_llama(path: Path, vocab: int = 4096) -> Path:
    """A random Llama whose KV is an 8B model's (32 layers x 8 KV heads x 128), its MLP tiny."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return path
    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=32,
                         num_attention_heads=8, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                         torch_dtype="bfloat16", tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return path


async def push_once(url: str, layout, ctx: int, request_id: str, payloads: list[bytes],
                    tcp: bool) -> tuple[float, int]:
    """Reserve and push one CTX-token request's KV, over the KV port (tcp) or HTTP push_kv, as a
    prefill node does; (seconds from the first byte out to the acknowledgement, bytes)."""
    headers = {rpc.TOKEN_HEADER: TOKEN, "content-type": rpc.CONTENT_TYPE}
    async with httpx.AsyncClient(timeout=120) as client:
        body = rpc.encode(rpc.ReserveRequest(version=rpc.RPC_VERSION, request_id=request_id,
                                             prompt_token_ids=[1] * ctx, params=SamplingParams(max_tokens=4),
                                             kv_layout=layout))
        r = await client.post(url + "/rpc/reserve", content=body, headers=headers)
        if r.status_code != 200:
            raise SystemExit(f"reserve failed: {rpc.decode(rpc.RPCError, r.content).message}")
        reservation = rpc.decode(rpc.ReserveResponse, r.content)

        def header(layer: int, nbytes: int, key: str = "") -> bytes:
            return rpc.frame(rpc.KVFrame(version=rpc.RPC_VERSION, request_id=request_id, layer=layer,
                                         num_tokens=ctx if nbytes else 0, nbytes=nbytes, key=key))

        if tcp:
            reader, writer = await asyncio.open_connection("127.0.0.1", reservation.kv_port)
            # as the prefill node sets its end (rtp/server/pd/relay.py, Relay._push_tcp)
            writer.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            writer.transport.set_write_buffer_limits(high=8 << 20)
            start = time.perf_counter()
            writer.write(header(rpc.HEARTBEAT, 0, reservation.kv_key))
            for layer, payload in enumerate(payloads):
                writer.write(header(layer, len(payload)))
                writer.write(payload)
                await writer.drain()
            writer.write(header(rpc.END, 0))
            (n,) = rpc.LENGTH.unpack(await reader.readexactly(4))
            rpc.decode(rpc.PushResponse, await reader.readexactly(n))
            seconds = time.perf_counter() - start
            writer.close()
        else:
            async def frames():
                for layer, payload in enumerate(payloads):
                    yield header(layer, len(payload))
                    yield payload

            start = time.perf_counter()
            r = await client.post(url + "/rpc/push_kv", content=frames(), headers=headers)
            seconds = time.perf_counter() - start
            if r.status_code != 200:
                raise SystemExit(f"push_kv failed: {rpc.decode(rpc.RPCError, r.content).message}")
        body = rpc.encode(rpc.AbortRequest(version=rpc.RPC_VERSION, request_id=request_id))
        await client.post(url + "/rpc/abort", content=body, headers=headers)
    return seconds, sum(map(len, payloads))


def measure_transfer(decode: Node, ctx: int, repeat: int) -> dict:
    layout = decode.stats().kv_layout
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 255, size=ctx * layout.token_bytes(layer), dtype=np.uint8).tobytes()
                for layer in range(len(layout.layers))]
    out = {"kv_bytes": sum(map(len, payloads)), "kv_mib": sum(map(len, payloads)) / 2**20,
           "layers": len(layout.layers), "dtype": layout.dtype}
    for path, tcp in (("tcp", True), ("http", False)):
        runs = [asyncio.run(push_once(decode.url, layout, ctx, f"bw-{path}-{i}", payloads, tcp))
                for i in range(repeat + 1)][1:]  # the first warms both ends
        seconds = [s for s, _ in runs]
        out[f"{path}_push_s_median"] = statistics.median(seconds)
        out[f"{path}_gb_per_s_median"] = out["kv_bytes"] / statistics.median(seconds) / 1e9
        out[f"{path}_gb_per_s_best"] = out["kv_bytes"] / min(seconds) / 1e9
    return out


def ttft(url: str, prompt: list[int], model: str) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise SystemExit(f"{url}: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data:") and '"text"' in line:
                return time.perf_counter() - start
    raise SystemExit("no token came back")


def measure_ttft(prefill: Node, ctx: int, repeat: int, vocab: int, transfer_s: float) -> dict:
    model = httpx.get(prefill.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    rng = np.random.default_rng(1)

    def prompt():  # fresh tokens: no prefix-cache hit on either node
        return rng.integers(100, vocab - 1, size=ctx).tolist()

    # the collocated reference: the prefill node's own engine, asked for one token (answered there)
    colo = []
    pd = []
    ttft(prefill.url, prompt(), model)  # warm both paths once
    for _ in range(repeat):
        body = {"model": model, "prompt": prompt(), "max_tokens": 1, "temperature": 0}
        start = time.perf_counter()
        r = httpx.post(prefill.url + "/v1/completions", json=body, timeout=600)
        assert r.status_code == 200, r.text
        colo.append(time.perf_counter() - start)
    names = ("rtp:pd_kv_transfer_seconds_sum", "rtp:pd_kv_transfer_tail_seconds_sum",
             "rtp:pd_kv_transfer_seconds_count")
    before = [prefill.metric(n) for n in names]
    for _ in range(repeat):
        pd.append(ttft(prefill.url, prompt(), model))
    push, tail, count = (prefill.metric(n) - b for n, b in zip(names, before))
    push, tail = push / max(count, 1.0), tail / max(count, 1.0)
    # tail: from the first token sampled (the last layer computed) to the decode node's ack, the part
    # of the transfer not hidden behind the prefill; hidden: the share of a standalone transfer that
    # did not show as tail. exposed: what the client waited beyond a collocated prefill (the tail,
    # the decode RPC, the decode node's first delta, the hop back).
    exposed = statistics.median(pd) - statistics.median(colo)
    return {"ttft_collocated_s": statistics.median(colo), "ttft_pd_s": statistics.median(pd),
            "push_window_s": push, "tail_s": tail, "exposed_s": exposed,
            "tail_share_of_ttft": tail / statistics.median(pd),
            "hidden_fraction": min(1.0, max(0.0, 1 - tail / transfer_s))}


def mixed_requests(n: int, long_every: int, long_len: int, short_len: int, vocab: int, seed: int):
    """Every long_every-th request a long prompt (long_len tokens, 16 out), the others short
    (short_len tokens, 64 out): the workload where a collocated node's prefills stall its decodes."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        long = i % long_every == 0
        out.append(("long" if long else "short",
                    {"prompt": rng.integers(100, vocab - 1, size=long_len if long else short_len).tolist(),
                     "max_tokens": 16 if long else 64, "ignore_eos": True, "temperature": 0, "stream": True,
                     "stream_options": {"include_usage": True}}))
    return out


async def drive(urls: list[str], model: str, requests, rate: float, seed: int):
    """Send the requests at Poisson arrivals, request i to urls[i % len(urls)] (round robin: what a
    load balancer in front of collocated nodes does), timing each with `rtp bench serve`'s client."""
    import msgspec

    from rtp.bench.serve import _send

    rng = np.random.default_rng(seed + 1)
    headers = {"Content-Type": "application/json"}
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=httpx.Limits(max_connections=256)) as client:
        tasks = []
        for i, (kind, body) in enumerate(requests):
            url = urls[i % len(urls)] + "/v1/completions"
            tasks.append((kind, asyncio.create_task(_send(client, url, headers,
                                                          msgspec.json.encode({**body, "model": model})))))
            await asyncio.sleep(rng.exponential(1.0 / rate))
        return [(kind, await task) for kind, task in tasks]


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99)) if values else float("nan")


def run_mixed(args) -> list[dict]:
    """2 collocated nodes (round robin) against 1 prefill + 1 decode node, same requests."""
    common = ["--max-model-len", str(args.mixed_long + 128), "--kv-cache-memory", "512MiB"]
    requests = mixed_requests(args.mixed_requests, 4, args.mixed_long, 64, 49152, seed=2)
    out = []
    for setup in ("2 collocated", "1 prefill + 1 decode"):
        if setup == "2 collocated":
            nodes = [Node(*common), Node(*common)]
            urls = [n.url for n in nodes]
        else:
            decode = Node("--role", "decode", *common)
            nodes = [decode, Node("--role", "prefill", "--decode-peer", decode.url, *common)]
            urls = [nodes[1].url]
        try:
            for n in nodes:
                n.wait()
            model = httpx.get(urls[0] + "/v1/models", timeout=30).json()["data"][0]["id"]
            asyncio.run(drive(urls, model, mixed_requests(2, 2, 256, 64, 49152, seed=9), 10.0, 0))  # warm up
            start = time.perf_counter()
            results = asyncio.run(drive(urls, model, requests, args.mixed_rate, 0))
            duration = time.perf_counter() - start
        finally:
            for n in nodes:
                n.stop()
        ok = [(k, r) for k, r in results if r.ok]
        row = {"setup": setup, "requests": len(results), "failed": len(results) - len(ok), "duration_s": duration,
               "output_tok_per_s": sum(r.output_tokens for _, r in ok) / duration}
        for kind in ("short", "long", "all"):
            chosen = [r for k, r in ok if kind in ("all", k)]
            row[f"p99_ttft_{kind}_ms"] = p99([r.ttft for r in chosen]) * 1e3
            row[f"p99_tbt_{kind}_ms"] = p99([gap for r in chosen for gap in r.itl]) * 1e3
        out.append(row)
    return out


def run_shape(name: str, model_args: list[str], ctx: int, repeat: int, vocab: int, kv_memory: str) -> dict:
    common = ["--no-compile", "--max-model-len", str(ctx + 64), "--kv-cache-memory", kv_memory,
              "--max-num-seqs", "4", "--no-enable-prefix-caching", *model_args]
    decode = Node("--role", "decode", *common)
    prefill = Node("--role", "prefill", "--decode-peer", decode.url, *common)
    try:
        decode.wait()
        prefill.wait()
        out = {"shape": name, "ctx": ctx, **measure_transfer(decode, ctx, repeat)}
        out.update(measure_ttft(prefill, ctx, repeat, vocab, out["tcp_push_s_median"]))
        return out
    finally:
        prefill.stop()
        decode.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, default=2048, help="context tokens (default 2048)")
    p.add_argument("--repeat", type=int, default=5, help="measurements per figure (default 5; medians)")
    p.add_argument("--skip-large", action="store_true", help="only the default model")
    p.add_argument("--mixed", action="store_true", help="also: a mixed workload on 2 collocated nodes vs 1P+1D")
    p.add_argument("--mixed-only", action="store_true", help="only the mixed workload")
    p.add_argument("--mixed-requests", type=int, default=24, help="mixed: requests (every 4th long; default 24)")
    p.add_argument("--mixed-long", type=int, default=1536, help="mixed: tokens of a long prompt (default 1536)")
    p.add_argument("--mixed-rate", type=float, default=1.0, help="mixed: requests per second (default 1)")
    args = p.parse_args()
    if args.mixed_only:
        mixed = run_mixed(args)
        print_mixed(mixed)
        print(json.dumps({"bench": "pd-mixed", "results": mixed}))
        return 0
    results = [run_shape("default (SmolLM2-135M)", [], args.ctx, args.repeat, 49152, "512MiB")]
    if not args.skip_large:
        path = random_llama(Path(tempfile.gettempdir()) / "rtp-bench-pd-llama")
        results.append(run_shape("random Llama, 8B KV shape", ["--model", str(path), "--dtype", "bfloat16"],
                                 args.ctx, args.repeat, 4096, "1GiB"))
    print(f"{'shape':<28} {'dtype':>8} {'KV MiB':>7} {'tcp GB/s':>8} {'http GB/s':>9} {'push s':>7} "
          f"{'TTFT colo':>9} {'TTFT pd':>8} {'tail s':>7} {'tail/TTFT':>9} {'hidden':>7} {'exposed':>8}")
    for r in results:
        print(f"{r['shape']:<28} {r['dtype']:>8} {r['kv_mib']:>7.1f} {r['tcp_gb_per_s_median']:>8.2f} "
              f"{r['http_gb_per_s_median']:>9.2f} {r['tcp_push_s_median']:>7.3f} {r['ttft_collocated_s']:>9.3f} "
              f"{r['ttft_pd_s']:>8.3f} {r['tail_s']:>7.3f} {r['tail_share_of_ttft']:>9.1%} "
              f"{r['hidden_fraction']:>7.0%} {r['exposed_s']:>8.3f}")
    mixed = run_mixed(args) if args.mixed else []
    if mixed:
        print_mixed(mixed)
    print(json.dumps({"bench": "pd", "ctx": args.ctx, "results": results, "mixed": mixed}))
    return 0


def print_mixed(rows: list[dict]) -> None:
    print(f"{'setup':<22} {'ok':>4} {'tok/s':>6} {'P99 TTFT short':>14} {'P99 TTFT long':>13} "
          f"{'P99 TBT short':>13} {'P99 TBT all':>11}")
    for r in rows:
        print(f"{r['setup']:<22} {r['requests'] - r['failed']:>4} {r['output_tok_per_s']:>6.1f} "
              f"{r['p99_ttft_short_ms']:>12.0f}ms {r['p99_ttft_long_ms']:>11.0f}ms {r['p99_tbt_short_ms']:>11.0f}ms "
              f"{r['p99_tbt_all_ms']:>9.0f}ms")


if __name__ == "__main__":
    raise SystemExit(main())
