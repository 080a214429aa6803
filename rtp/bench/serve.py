"""`rtp bench serve`: load any OpenAI-compatible server and report what `vllm bench serve` reports.

Requests go out at a fixed Poisson rate (--request-rate) or all at once, capped at
--max-concurrency in flight (a fixed concurrency when the rate is inf). Every
request streams (SSE, with stream_options.include_usage), so the client times
each token: TTFT (time to first token), TPOT (time per output token after the
first, per request), ITL (the gap between successive chunks), E2EL (end to end).
Token counts are the server's own `usage`.

Datasets:
  random         prompts of random tokens, --input-len tokens each (--range-ratio spreads it)
  shared-prefix  --num-prefixes system prompts of --prefix-len tokens, each followed by
                 questions of --input-len tokens: request i uses prefix i mod N
  json-schema    random prompts, each request with a JSON Schema of its own (response_format
                 json_schema, strict; rtp/bench/schemas.py). Run twice, side by side: the same
                 workload unconstrained (other prompts of the same lengths, so that the prefix
                 cache favours neither), then constrained; the table compares the two and, against
                 rtp serve, adds the grammar's figures from /metrics: compile time per schema
                 (P50/P99) and the bitmask's cost per step

Prompts are random token ids of --tokenizer (default: rtp's default model) decoded to
text, so the same run works against any server. The client's own CPU time over the run
is reported (on a host it shares with the server, what the measurement cost the server);
against `rtp serve`, the CPU time
its process and its event loop thread (the HTTP side) used during the run is read
from its /metrics and reported too. The table goes to stdout, followed by one line
with the figures as a JSON object; --save-result also writes them, with every
request's figures, to --result-file.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from dataclasses import dataclass, field


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"],
                   help="the API to load (default /v1/completions)")
    p.add_argument("--model", help="model name to send (default: the first the server lists at /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as Authorization: Bearer (default: $OPENAI_API_KEY)")
    p.add_argument("--dataset", default="random", choices=["random", "shared-prefix", "json-schema"])
    p.add_argument("--num-prompts", type=int, default=200, help="requests to send (default 200)")
    p.add_argument("--input-len", "--random-input-len", type=int, default=256,
                   help="prompt tokens (shared-prefix: the question's) (default 256)")
    p.add_argument("--output-len", "--random-output-len", type=int, default=128,
                   help="max_tokens of each request (default 128)")
    p.add_argument("--range-ratio", "--random-range-ratio", type=float, default=0.0,
                   help="draw lengths uniformly from [len*(1-r), len*(1+r)] (default 0: fixed)")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens of each system prompt")
    p.add_argument("--num-prefixes", type=int, default=8, help="shared-prefix: how many system prompts")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight (default: no limit)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask the server to run every request to --output-len tokens (vLLM's extension)")
    p.add_argument("--tokenizer", help="tokenizer for the random prompts: HF directory or .gguf "
                   "(default: rtp's default model)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and the arrival times")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    p.add_argument("--save-result", action="store_true", help="write the figures as JSON to --result-file")
    p.add_argument("--result-file", help="default: bench-serve-<date>.json in the current directory")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", type=_slo,
                   help="service-level objectives a request must meet to count as good, as vLLM's: ttft, tpot, "
                        "e2el (per request) and itl (its longest inter-token gap), e.g. --goodput ttft:1000 itl:100; "
                        "reports good requests per second and their share")


def _slo(text: str) -> tuple[str, float]:
    key, _, ms = text.partition(":")
    try:
        value = float(ms)
    except ValueError:
        value = -1.0
    if key not in ("ttft", "tpot", "itl", "e2el") or not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give KEY:MILLISECONDS with KEY one of ttft, tpot, itl, e2el")
    return key, value


@dataclass
class Request:
    prompt: str | None = None           # /v1/completions
    system: str | None = None           # /v1/chat/completions: the system prompt, if any
    user: str | None = None
    max_tokens: int = 128
    schema: dict | None = None          # json-schema: the response_format's schema


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)


# -- the workload -------------------------------------------------------------------------------------


def make_requests(args, tokenizer, seed: int | None = None, constrained: bool = False) -> list[Request]:
    import numpy as np

    from rtp.bench.schemas import make_schema

    rng = np.random.default_rng(args.seed if seed is None else seed)
    special = set(tokenizer.backend.get_added_tokens_decoder())
    vocab = np.array([t for t in range(tokenizer.backend.get_vocab_size()) if t not in special])

    def text(n: int) -> str:
        # decoded random ids re-encode to about as many tokens; the server's usage reports the truth
        return tokenizer.decode(rng.choice(vocab, size=max(1, n)).tolist())

    def length(n: int) -> int:
        lo, hi = int(n * (1 - args.range_ratio)), int(n * (1 + args.range_ratio))
        return int(rng.integers(max(1, lo), max(1, hi) + 1))

    chat = args.endpoint.endswith("chat/completions")
    prefixes = [text(args.prefix_len) for _ in range(args.num_prefixes)] if args.dataset == "shared-prefix" else []
    requests = []
    for i in range(args.num_prompts):
        question, out = text(length(args.input_len)), length(args.output_len)
        system = prefixes[i % len(prefixes)] if prefixes else None
        schema = make_schema(i, args.seed) if constrained else None
        if args.dataset == "json-schema":
            question = "Answer in JSON. " + question
        if chat:
            requests.append(Request(system=system, user=question, max_tokens=out, schema=schema))
        else:
            requests.append(Request(prompt=(system + "\n" if system else "") + question, max_tokens=out,
                                    schema=schema))
    return requests


def _payload(args, model: str, req: Request) -> dict:
    body = {"model": model, "max_tokens": req.max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if req.schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "reply", "schema": req.schema, "strict": True}}
    if req.prompt is not None:
        body["prompt"] = req.prompt
    else:
        messages = [{"role": "system", "content": req.system}] if req.system else []
        body["messages"] = messages + [{"role": "user", "content": req.user}]
    return body


# -- the client ----------------------------------------------------------------------------------------


async def _send(session, url: str, headers: dict, body: bytes) -> Result:
    import msgspec

    result = Result()
    start = last = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return result
            async for line in response.content:  # one SSE line at a time, as it arrives
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].rstrip()
                if data == b"[DONE]":
                    break
                chunk = msgspec.json.decode(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                    result.output_tokens = usage.get("completion_tokens", 0)
                for choice in chunk.get("choices") or ():
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if piece:  # the chat role chunk carries no text: it is not a token
                        now = time.perf_counter()
                        if result.ttft == 0.0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
    except Exception as e:  # a failed request is counted, never fatal to the run
        result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return result
    result.e2el = time.perf_counter() - start
    if result.ttft == 0.0:  # no chunk carried text (e.g. only special tokens)
        result.ttft = result.e2el
    if result.output_tokens == 0:  # a server without usage: count the chunks
        result.output_tokens = len(result.itl) + 1
    result.ok = True
    return result


def _session(timeout: float, connections: int = 0):
    """An aiohttp session: the client shares the CPU with the server it loads (two cores here), and
    aiohttp reads a streamed chunk for a third of httpx's CPU (63 against 184 us, 64 streams of 128
    chunks from a local SSE server), so less of the server's time goes to its measurement."""
    import aiohttp

    # read_bufsize: an SSE line (a chunk with logprobs, a long tool call) may pass aiohttp's 64 KiB default
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout), read_bufsize=1 << 22,
                                 connector=aiohttp.TCPConnector(limit=connections))


async def _run(args, model: str, requests: list[Request]) -> tuple[list[Result], float, float]:
    import msgspec
    import numpy as np

    url = args.base_url.rstrip("/") + args.endpoint
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    bodies = [msgspec.json.encode(_payload(args, model, r)) for r in requests]
    bar = None
    if not args.disable_tqdm:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="requests", unit="req", file=sys.stderr)
    gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = np.random.default_rng(args.seed + 1)
    async with _session(args.timeout, args.max_concurrency or 0) as client:
        # one short request first: a wrong URL or model fails here, not 200 times
        probe = await _send(client, url, headers, msgspec.json.encode(
            {**_payload(args, model, requests[0]), "max_tokens": 4}))
        if not probe.ok:
            raise RuntimeError(f"the test request failed: {probe.error}")

        async def one(body: bytes) -> Result:
            if gate is None:
                result = await _send(client, url, headers, body)
            else:
                async with gate:
                    result = await _send(client, url, headers, body)
            if bar is not None:
                bar.update(1)
            return result

        start, cpu = time.perf_counter(), time.process_time()
        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(one(body)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration, cpu = time.perf_counter() - start, time.process_time() - cpu
    if bar is not None:
        bar.close()
    return results, duration, cpu


_CPU_METRICS = ("rtp:event_loop_cpu_seconds_total", "process_cpu_seconds_total")


async def server_cpu(args) -> dict[str, float]:
    """rtp serve's CPU counters from /metrics ({} from a server without them)."""
    import aiohttp

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        async with _session(10) as client, client.get(args.base_url.rstrip("/") + "/metrics",
                                                       headers=headers) as response:
            text = await response.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return {}
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.split("{")[0] in _CPU_METRICS:
            found[name.split("{")[0]] = float(value)
    return found if len(found) == len(_CPU_METRICS) else {}


async def _first_model(args) -> str:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with _session(30) as client, client.get(args.base_url.rstrip("/") + "/v1/models",
                                                   headers=headers) as response:
        response.raise_for_status()
        return (await response.json())["data"][0]["id"]


# -- the report ----------------------------------------------------------------------------------------


def summarize(args, model: str, results: list[Result], duration: float, client_cpu: float) -> dict:
    import numpy as np

    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    figures = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "base_url": args.base_url, "endpoint": args.endpoint,
        "model": model, "dataset": args.dataset, "num_prompts": len(results),
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency, "duration": duration,
        "completed": len(done), "failed": len(results) - len(done),
        "total_input_tokens": prompt, "total_output_tokens": output,
        "request_throughput": len(done) / duration, "output_throughput": output / duration,
        "total_token_throughput": (prompt + output) / duration,
        # this client's own CPU during the run: on a host it shares with the server, the server's loss
        "client_cpu_s": client_cpu, "client_us_per_output_token": 1e6 * client_cpu / max(1, output),
    }
    series = {
        "ttft": [r.ttft for r in done],
        "tpot": [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.e2el for r in done],
    }
    slos = dict(getattr(args, "goodput", None) or [])
    if slos:
        def good(r: Result) -> bool:
            seen = {"ttft": r.ttft, "e2el": r.e2el, "itl": max(r.itl, default=0.0),
                    "tpot": (r.e2el - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0}
            return all(seen[k] * 1000 <= limit for k, limit in slos.items())

        n_good = sum(good(r) for r in done)
        figures["goodput_slos_ms"] = slos
        figures["good_requests"] = n_good
        figures["request_goodput"] = n_good / duration
        figures["good_share"] = n_good / len(results)
    for name, values in series.items():
        ms = np.asarray(values or [0.0]) * 1000
        figures[f"mean_{name}_ms"] = float(ms.mean())
        figures[f"median_{name}_ms"] = float(np.median(ms))
        figures[f"std_{name}_ms"] = float(ms.std())
        figures[f"p90_{name}_ms"] = float(np.percentile(ms, 90))
        figures[f"p99_{name}_ms"] = float(np.percentile(ms, 99))
    return figures


def print_table(f: dict) -> None:
    def row(label, value, fmt="{:.2f}"):
        print(f"{label:<40}{fmt.format(value) if value is not None else '-':>10}")

    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    row("Successful requests:", f["completed"], "{}")
    row("Failed requests:", f["failed"], "{}")
    row("Maximum request concurrency:", f["max_concurrency"], "{}")
    row("Request rate (req/s):", f["request_rate"], "{}")
    row("Benchmark duration (s):", f["duration"])
    row("Total input tokens:", f["total_input_tokens"], "{}")
    row("Total generated tokens:", f["total_output_tokens"], "{}")
    row("Request throughput (req/s):", f["request_throughput"])
    row("Output token throughput (tok/s):", f["output_throughput"])
    row("Total token throughput (tok/s):", f["total_token_throughput"])
    if "request_goodput" in f:
        slos = " ".join(f"{k}<={v:g}ms" for k, v in f["goodput_slos_ms"].items())
        row(f"Request goodput (req/s, {slos}):", f["request_goodput"])
        row("Good requests (%):", 100 * f["good_share"])
    row("Client CPU (s):", f["client_cpu_s"])
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        for stat in ("mean", "median", "p90", "p99"):
            row(f"{stat.capitalize() if stat[0] != 'p' else stat.upper()} {name.upper()} (ms):",
                f[f"{stat}_{name}_ms"])
    if "server_cpu_s" in f:
        print("{s:{c}^{n}}".format(s="Server CPU (rtp serve's /metrics)", n=50, c="-"))
        row("Process CPU (s):", f["server_cpu_s"])
        row("Event loop thread CPU (s):", f["server_event_loop_cpu_s"])
        row("Event loop share of process CPU (%):", 100 * f["server_event_loop_cpu_share"])
        row("Event loop CPU per token (us):", f["server_event_loop_us_per_output_token"], "{:.1f}")
    print("=" * 50)


def main(args: argparse.Namespace) -> int:
    import msgspec

    if args.num_prompts < 1 or (args.max_concurrency is not None and args.max_concurrency < 1):
        print("rtp bench serve: --num-prompts and --max-concurrency must be positive", file=sys.stderr)
        return 2
    from rtp.checkpoint.tokenizer import Tokenizer

    if args.tokenizer:
        from rtp.checkpoint.hub import resolve_model

        tokenizer = Tokenizer.from_pretrained(resolve_model(args.tokenizer))
    else:
        from rtp.checkpoint.default_model import default_model_path

        tokenizer = Tokenizer.from_pretrained(default_model_path())
    if args.dataset == "json-schema":
        return _json_schema_main(args, tokenizer)
    try:
        model = args.model or asyncio.run(_first_model(args))
        requests = make_requests(args, tokenizer)
        cpu_before = asyncio.run(server_cpu(args))
        results, duration, client_cpu = asyncio.run(_run(args, model, requests))
        cpu_after = asyncio.run(server_cpu(args))
    except Exception as e:
        print(f"rtp bench serve: {e}", file=sys.stderr)
        return 1
    figures = summarize(args, model, results, duration, client_cpu)
    if cpu_before and cpu_after:
        # rtp serve: what its HTTP side (event loop thread) cost, next to the whole process
        loop, process = (cpu_after[m] - cpu_before[m] for m in _CPU_METRICS)
        figures["server_cpu_s"] = process
        figures["server_event_loop_cpu_s"] = loop
        figures["server_event_loop_cpu_share"] = loop / process if process else 0.0
        figures["server_event_loop_us_per_output_token"] = 1e6 * loop / max(1, figures["total_output_tokens"])
    print_table(figures)
    errors = [r.error for r in results if not r.ok]
    if errors:
        print(f"{len(errors)} requests failed; the first: {errors[0]}", file=sys.stderr)
    if args.save_result:
        path = args.result_file or f"bench-serve-{time.strftime('%Y%m%d-%H%M%S')}.json"
        detail = {**figures, "input_lens": [r.prompt_tokens for r in results],
                  "output_lens": [r.output_tokens for r in results], "ttfts": [r.ttft for r in results],
                  "itls": [r.itl for r in results], "e2els": [r.e2el for r in results], "errors": errors}
        with open(path, "wb") as out:
            out.write(msgspec.json.format(msgspec.json.encode(detail), indent=2))
        print(f"results written to {path}", file=sys.stderr)
    print(msgspec.json.encode(figures).decode())
    return 0 if figures["completed"] else 1


# -- --dataset json-schema: constrained against unconstrained, side by side ---------------------------


async def grammar_metrics(args) -> dict:
    """rtp serve's grammar figures from /metrics ({} from a server without them)."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        async with _session(10) as client, client.get(args.base_url.rstrip("/") + "/metrics",
                                                       headers=headers) as response:
            text = await response.text() if response.status == 200 else ""
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return {}
    out: dict = {"buckets": {}}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "rtp:grammar_compile_seconds_bucket":
                    out["buckets"][float(sample.labels["le"])] = sample.value
                elif sample.name.startswith("rtp:grammar_") and not sample.name.endswith("_created"):
                    out[sample.name.removeprefix("rtp:grammar_")] = sample.value
    except ValueError:  # not Prometheus text: a server without /metrics
        return {}
    return out if out["buckets"] else {}


def _histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus' histogram_quantile: linear within the bucket the quantile falls in."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def _grammar_figures(before: dict, after: dict) -> dict:
    if not after:
        return {}
    buckets = {b: after["buckets"][b] - before.get("buckets", {}).get(b, 0.0) for b in after["buckets"]}

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps = delta("steps_total")
    return {"compiles": delta("compile_seconds_count"),
            "compile_p50_ms": 1000 * _histogram_quantile(0.5, buckets),
            "compile_p99_ms": 1000 * _histogram_quantile(0.99, buckets),
            "compile_mean_ms": 1000 * delta("compile_seconds_sum") / max(1.0, delta("compile_seconds_count")),
            "constrained_steps": steps, "rows_per_step": delta("rows_total") / max(1.0, steps),
            "bitmask_ms_per_step": 1000 * delta("bitmask_seconds_total") / max(1.0, steps),
            "advance_ms_per_step": 1000 * delta("advance_seconds_total") / max(1.0, steps)}


def _json_schema_main(args, tokenizer) -> int:
    import msgspec

    try:
        model = args.model or asyncio.run(_first_model(args))
        # other prompts of the same lengths for the unconstrained pass: the prefix cache favours neither
        bound = make_requests(args, tokenizer, constrained=True)
        before = asyncio.run(grammar_metrics(args))
        # constrained requests end where their document does (--ignore-eos would keep some servers
        # generating after the grammar completed), up to --output-len tokens
        bound_args = argparse.Namespace(**{**vars(args), "ignore_eos": False})
        bound_results, bound_duration, bound_cpu = asyncio.run(_run(bound_args, model, bound))
        after = asyncio.run(grammar_metrics(args))
        # the same work unconstrained: each request runs to the length its constrained twin had
        # (a grammar that completes ends its request early; fewer tokens per prompt is not the
        # grammar's cost), on other prompts of the same lengths so the prefix cache favours neither
        free = make_requests(args, tokenizer, seed=args.seed + 1000)
        for request, twin in zip(free, bound_results):
            request.max_tokens = max(1, twin.output_tokens)
        free_args = argparse.Namespace(**{**vars(args), "ignore_eos": True})
        free_results, free_duration, free_cpu = asyncio.run(_run(free_args, model, free))
    except Exception as e:
        print(f"rtp bench serve: {e}", file=sys.stderr)
        return 1
    figures = {"unconstrained": summarize(args, model, free_results, free_duration, free_cpu),
               "constrained": summarize(args, model, bound_results, bound_duration, bound_cpu)}
    u, c = figures["unconstrained"], figures["constrained"]
    figures["constrained_over_unconstrained_output_throughput"] = \
        c["output_throughput"] / u["output_throughput"] if u["output_throughput"] else 0.0
    figures["grammar"] = _grammar_figures(before, after)

    def row(label, key, fmt="{:.2f}"):
        print(f"{label:<34}{fmt.format(u[key]):>14}{fmt.format(c[key]):>14}")

    print("{s:{c}^{n}}".format(s=" JSON Schema Benchmark ", n=62, c="="))
    print(f"{'':<34}{'unconstrained':>14}{'constrained':>14}")
    row("Successful requests:", "completed", "{}")
    row("Duration (s):", "duration")
    row("Generated tokens:", "total_output_tokens", "{}")
    print(f"{'Mean output tokens per request:':<34}{u['total_output_tokens'] / max(1, u['completed']):>14.1f}"
          f"{c['total_output_tokens'] / max(1, c['completed']):>14.1f}")
    row("Output throughput (tok/s):", "output_throughput")
    for key in ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_tpot_ms"):
        row(key.replace("_ms", " (ms):").replace("_", " ").capitalize(), key)
    print(f"{'Constrained / unconstrained tok/s:':<34}{figures['constrained_over_unconstrained_output_throughput']:>28.3f}")
    g = figures["grammar"]
    if g:
        print("{s:{c}^{n}}".format(s=" Grammar (rtp serve's /metrics) ", n=62, c="-"))
        for label, key in (("Schemas compiled:", "compiles"), ("Compile P50 (ms):", "compile_p50_ms"),
                           ("Compile P99 (ms):", "compile_p99_ms"), ("Compile mean (ms):", "compile_mean_ms"),
                           ("Constrained rows per step:", "rows_per_step"),
                           ("Bitmask fill per step (ms):", "bitmask_ms_per_step"),
                           ("Grammar advance per step (ms):", "advance_ms_per_step")):
            print(f"{label:<34}{g[key]:>28.3f}")
    print("=" * 62)
    failed = [r.error for r in bound_results + free_results if not r.ok]
    if failed:
        print(f"{len(failed)} requests failed; the first: {failed[0]}", file=sys.stderr)
    print(msgspec.json.encode(figures).decode())
    return 0 if c["completed"] and u["completed"] else 1
