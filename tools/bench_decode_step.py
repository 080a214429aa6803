#!/usr/bin/env python3
"""Where a decode step's time goes, kernel by kernel, on this CPU.

A decode step on a CPU with rtp's kernels is one CPU graph (rtp/kernels/cpu_graph.py):
every op is a C kernel call, replayed from C with no Python between them. This tool
fills a batch of --rows requests with --context-token prompts through the real engine,
takes the graph that serves that batch, and replays the step --repeats times with each
call timed in C (clock_gettime around the call, nothing else). Timing from Python
instead adds a call's dispatch to every kernel: 30-40 us each, which at ~270 calls a
step is the size of the kernels themselves.

For each kind of call it prints the milliseconds per step (medians over the repeats,
summed over the step's calls of that kind), its share of the replay, and what it
achieves: GFLOP/s for the linear layers (2 x rows x N x K) and GB/s of weight blocks
read; GB/s of K/V read for decode attention. The replay's FLOP/s are set against this
machine's bf16 matmul rate, measured in the same run (2048^3 torch.matmul), as
tools/bench_offline.py does for its batch-64 target, and against oneDNN's own bf16
GEMMs over the same linears with weights prepacked for it (no dequantisation, no
attention): what a tuned vendor library reaches at these shapes here. Host work
(scheduling, sampling, detokenising) is not in a replay; bench_offline's step times
include it.

With --prompt N the step also holds an N-token prompt (with --rows 0, that prompt alone: a
prefill chunk): the engine runs such a step from its step graph, which this replays the same
way, each call timed. A linear layer's FLOPs then count the rows it multiplies (every token for
the layers, the sampling rows for the LM head) and prefill attention its causal FLOPs
(2 x 2 x heads x head_dim per query-key pair); the oneDNN reference is left out, since its
passes multiply every matrix over the same rows.

The script prints a table, then (as the last line of stdout) one JSON object.

    python tools/bench_decode_step.py                          # 64 rows, 80-token contexts
    python tools/bench_decode_step.py --rows 1 --context 32
    python tools/bench_decode_step.py --rows 64 --context 144 --repeats 30
    python tools/bench_decode_step.py --rows 1 --context 2048 --kv-cache-dtype int8
    python tools/bench_decode_step.py --rows 63 --context 256 --prompt 300   # a mixed step
    python tools/bench_decode_step.py --rows 0 --prompt 2048                 # a prefill chunk
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict

import numpy as np
import torch
from tqdm import tqdm

from _common import CpuWatch, bench_matmul, bench_onednn_linears, count_params, linear_layers, note
from rtp.kernels import cpu_kernels, ops

# bytes a linear kernel reads per weight: GGUF blocks as rtp keeps them (fp32 scales)
_BYTES_PER_WEIGHT = {"q4_1": 24 / 32, "q8_0": 36 / 32, "q8_1": 40 / 32, "q8_16": 40 / 32, "q4_k": 152 / 256,
                     "bf16": 2.0, "q4_1 x int8": 24 / 32, "q8_0 x int8": 36 / 32}
# the tile-order records' kinds (linear_tiles' field `kind`); linear_u8's offsets (q8_0 splits its q)
_U8_KINDS = {0: "q8_1", 32: "q8_16"}
_AMX_KINDS = {0: "q4_1", 1: "q8_0", 2: "q8_1", 3: "q8_16", 4: "bf16", 5: "q4_1 x int8", 6: "q8_0 x int8"}


def linear_names(config) -> dict[tuple[int, int], str]:
    """(N, K) of each Llama-family linear -> its name."""
    return {shape: name for name, shape in linear_layers(config).items()}


def label(call: np.ndarray, names: dict[tuple[int, int], str]) -> tuple[str, str, int, int, str]:
    """(group label, kernel, N, K, block kind) of one recorded call."""
    kernel = cpu_kernels.op_name(int(call[0]))
    op = ops.BY_NAME.get(kernel)
    if op is None or not kernel.startswith("linear_"):
        return kernel, kernel, 0, 0, ""

    def word(field: str) -> int:  # the call's field, by its name in the op table
        return int(call[op.field(field).word])

    n, k = word("n"), word("k")
    if kernel == "linear_tiles":
        kind = _AMX_KINDS[word("kind")]
    elif kernel == "linear_q8":
        kind = "q8_16" if word("group") == 16 else ("q8_1" if word("mn") else "q8_0")
    elif kernel == "linear_u8":
        kind = _U8_KINDS.get(word("offset"), "q8_0")
    else:
        kind = {"linear_q4_k": "q4_k", "linear_bf16": "bf16"}.get(kernel, "q4_1")
    name = names.get((n, k), f"{n}x{k}")
    if kernel == "linear_tiles" and word("glu"):
        name += " + silu_mul"  # the fused MLP epilogue (glu)
    # o_proj and qkv_proj coincide under MHA: the name map keeps the last; fine for a label
    return f"{name} ({kernel.removeprefix('linear_')}, {kind})", kernel, n, k, kind


def fill_batch(llm, rows: int, context: int, seed: int) -> None:
    """Admit `rows` requests of `context` prompt tokens and step until all of them decode."""
    from rtp import SamplingParams

    if rows == 0:
        return
    engine = llm.engine
    vocab = engine.model.config.vocab_size
    rng = np.random.default_rng(seed)
    sp = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)  # up to the context length
    for r in range(rows):
        engine.add_request(f"bench-step-{r}", rng.integers(100, vocab - 100, context).tolist(), sp)
    plan = engine.scheduler.plan
    for _ in range(10 * rows + 100):
        engine.step()
        if plan.num_rows == rows and plan.num_decode_rows == rows:
            return
    raise SystemExit(f"the engine never ran all {rows} requests as one decode step (max_num_seqs, KV memory?)")


def profile(timed_replay, repeats: int) -> np.ndarray:
    """[repeats, calls] nanoseconds from timed_replay() (one replay, each call's ns), after two replays
    left out (warm caches, woken threads)."""
    timed_replay()
    timed_replay()
    return np.stack([timed_replay() for _ in tqdm(range(repeats), desc="replaying", unit="step",
                                                  file=sys.stderr, leave=False)])


def profile_step(llm, prompt: int, repeats: int, seed: int) -> tuple:
    """Add a `prompt`-token request beside the decoding rows and replay the step the engine plans next
    (its step graph) `repeats` times, each call timed: (graph, [repeats, calls] ns, call rows, plan counts)."""
    from rtp import SamplingParams

    engine = llm.engine
    runner = engine.runner
    graph = runner.step_graph
    if graph is None:
        raise SystemExit("no step graph for prefill and mixed steps (see the engine's start-up log)")
    vocab = engine.model.config.vocab_size
    ids = np.random.default_rng(seed + 1).integers(100, vocab - 100, prompt).tolist()
    engine.add_request("bench-step-prompt", ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    got: dict = {}
    forward = runner.forward

    def timed_forward():
        p = runner.plan
        counts = {"tokens": p.num_tokens, "samples": p.num_samples, "decode_rows": p.num_decode_rows,
                  "prefill_rows": p.num_rows - p.num_decode_rows}
        args = (counts["tokens"], counts["samples"], counts["decode_rows"], counts["prefill_rows"])

        def timed_replay() -> np.ndarray:
            t = np.zeros(len(graph.calls), dtype=np.int64)
            graph.replay_step(*args, times=t)
            return t

        got.update(counts=counts, times=profile(timed_replay, repeats))
        return forward()

    runner.forward = timed_forward
    try:
        engine.step()
    finally:
        runner.forward = forward
    counts = got["counts"]
    if counts["prefill_rows"] != 1 or counts["tokens"] != counts["decode_rows"] + prompt:
        raise SystemExit(f"the engine did not plan the prompt whole beside the decode rows ({counts}): "
                         "--prompt must fit the step's token budget with the decode rows")
    # the rows each call multiplies: its class's count (cpu_graph.capture), or as recorded
    by_class = {cpu_kernels.COUNT_TOKENS: counts["tokens"], cpu_kernels.COUNT_SAMPLES: counts["samples"],
                cpu_kernels.SEVERAL_SAMPLES: counts["samples"], cpu_kernels.ONE_SAMPLE: 1}
    call_rows = np.array([by_class.get(int(c), 0) for c in graph.classes], dtype=np.int64)
    return graph, got["times"], call_rows, counts


def summarise(graph, times: np.ndarray, rows: int, context: int, config, params: int, peak: float,
              kv_int8: bool = False, call_rows: np.ndarray | None = None, prompt: int = 0) -> dict:
    names = linear_names(config)
    groups: dict[str, dict] = defaultdict(lambda: {"calls": 0, "flop": 0.0, "bytes": 0.0})
    per_call = np.median(times, axis=0) / 1e6  # ms
    replay_ms = statistics.median(times.sum(axis=1)) / 1e6
    kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for i, (call, ms) in enumerate(zip(graph.calls, per_call)):
        if call_rows is not None and not times[:, i].any():
            continue  # a step graph's call for the other count of sampling rows: not run
        name, kernel, n, k, kind = label(call, names)
        call_m = rows if call_rows is None else int(call_rows[i])
        g = groups[name]
        g["calls"] += 1
        g["ms"] = g.get("ms", 0.0) + float(ms)
        if n:
            g["flop"] += 2.0 * call_m * n * k
            g["bytes"] += n * k * _BYTES_PER_WEIGHT[kind]
        elif kernel == "prefill_attention":
            g["flop"] += 4.0 * config.num_attention_heads * head_dim * prompt * (prompt + 1) / 2
        elif kernel == "decode_attention":
            # K and V: bf16, or int8 with an fp32 scale per token and head
            per_head = head_dim + 4 if kv_int8 else 2 * head_dim
            g["bytes"] += rows * (context + 1) * 2 * kv_heads * per_head
    table = []
    for name, g in sorted(groups.items(), key=lambda kv: -kv[1]["ms"]):
        row = {"kernel": name, "calls": g["calls"], "ms": round(g["ms"], 3), "share": round(g["ms"] / replay_ms, 4)}
        if g["flop"]:
            row["gflops"] = round(g["flop"] / g["ms"] / 1e6, 1)
        if g["bytes"]:
            row["gb_s"] = round(g["bytes"] / g["ms"] / 1e6, 1)
        table.append(row)
    linear = [g for name, g in groups.items() if g["flop"] and not name.startswith("prefill_attention")]
    linear_ms = sum(g["ms"] for g in linear)
    linear_flop = sum(g["flop"] for g in linear)
    # a decode step: 2 x params x rows; a step with a prompt: what its linears multiply
    step_gflops = (2.0 * params * rows if call_rows is None else linear_flop) / replay_ms / 1e6
    return {"rows": rows, "context": context, "prompt": prompt, "calls": sum(g["calls"] for g in groups.values()),
            "replay_ms": round(replay_ms, 3),
            "sum_of_medians_ms": round(float(per_call.sum()), 3), "linear_ms": round(linear_ms, 3),
            "linear_gflop": round(linear_flop / 1e9, 6),
            "linear_gflops": round(linear_flop / linear_ms / 1e6, 1) if linear_ms else None,
            "step_gflops": round(step_gflops, 1), "matmul_bf16_gflops": round(peak, 1),
            "linear_utilisation": round(linear_flop / linear_ms / 1e6 / peak, 4) if linear_ms else None,
            "step_utilisation": round(step_gflops / peak, 4), "kernels": table}


def print_table(res: dict) -> None:
    rows = f"{res['rows']} decode rows at a {res['context'] + 1}-token context"
    if not res["prompt"]:
        what = f"decode step, {rows}"
    elif not res["rows"]:
        what = f"prefill chunk of {res['prompt']} tokens"
    else:
        what = f"mixed step, a {res['prompt']}-token prompt beside {rows}"
    print(f"\n{what}: {res['calls']} kernel calls, replay {res['replay_ms']:.2f} ms (median of the sums)")
    print(f"{'kernel':<34} {'calls':>5} {'ms/step':>8} {'share':>6} {'GFLOP/s':>8} {'GB/s':>6}")
    for k in res["kernels"]:
        gf = f"{k['gflops']:,.0f}" if "gflops" in k else ""
        gb = f"{k['gb_s']:.1f}" if "gb_s" in k else ""
        print(f"{k['kernel']:<34} {k['calls']:>5} {k['ms']:>8.3f} {k['share']:>6.1%} {gf:>8} {gb:>6}")
    peak = res["matmul_bf16_gflops"]
    if res["linear_gflops"]:
        print(f"linear layers: {res['linear_ms']:.2f} ms, {res['linear_gflops']:,.0f} GFLOP/s = "
              f"{res['linear_utilisation']:.0%} of this run's bf16 matmul ({peak:,.0f} GFLOP/s)")
    counted = "2 x params x rows" if not res["prompt"] else "its linears' FLOPs"
    print(f"whole replay: {res['step_gflops']:,.0f} GFLOP/s ({counted}) = {res['step_utilisation']:.0%} "
          f"of the bf16 matmul")
    ref = res.get("onednn_linears")
    if ref:
        print(f"reference: oneDNN, bf16 weights prepacked, the same {ref['matrices']} linears over {ref['rows']} rows: "
              f"{ref['ms']:.2f} ms, {ref['gflops']:,.0f} GFLOP/s = {ref['utilisation']:.0%} of the bf16 matmul")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default=None, help="checkpoint directory or GGUF file (default: SmolLM2-135M)")
    ap.add_argument("--rows", type=int, default=64, help="decode rows in the step (default 64; 0 with --prompt)")
    ap.add_argument("--context", type=int, default=80,
                    help="prompt tokens per row; the step attends over one more (default 80: the middle "
                         "of bench_offline's batch-64 run, contexts 17-144)")
    ap.add_argument("--prompt", type=int, default=0,
                    help="a prompt of this many tokens in the step too: a mixed step, or with --rows 0 a prefill "
                         "chunk (default 0: a decode step)")
    ap.add_argument("--repeats", type=int, default=20, help="timed replays (default 20)")
    ap.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: all cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-deterministic", dest="deterministic", action="store_false",
                    help="one row on the exact one-row kernels (rtp serve --no-deterministic)")
    ap.add_argument("--activation-dtype", default="auto", choices=["auto", "int8", "int8-prefill"],
                    help="rtp's --activation-dtype (int8: Q4_1 layers take int8 rows on a CPU with VNNI and no AMX; "
                         "int8-prefill: their prompt rows only, so a decode step runs as in auto)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "int8"],
                    help="the KV cache's dtype (default auto: the model's, bf16)")
    args = ap.parse_args()
    if args.rows < (0 if args.prompt else 1) or args.context < 1 or args.repeats < 1 or args.prompt < 0:
        ap.error("--context and --repeats must be at least 1, --rows too without --prompt")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_kernels.available():
        raise SystemExit("rtp's CPU kernels are not available here (they need AVX-512 BF16): no CPU graphs to profile")

    from rtp import LLM

    note(f"loading the model, bf16, KV cache {args.kv_cache_dtype}, room for {args.rows} decode rows")
    budget = {"max_num_batched_tokens": max(2048, args.rows + args.prompt)} if args.prompt else {}
    # with a prompt: a sequence more, and at least two (an engine of one sequence captures no step graph)
    seqs = max(args.rows + 1, 2) if args.prompt else args.rows
    llm = LLM(model=args.model, dtype="bfloat16", max_num_seqs=seqs,
              kv_cache_dtype=args.kv_cache_dtype, activation_dtype=args.activation_dtype,
              deterministic=args.deterministic, **budget)
    graph = None if args.prompt else llm.engine.runner.cpu_graph(args.rows)
    if graph is None and not args.prompt:
        raise SystemExit(f"no CPU graph serves {args.rows} rows with this model (see the engine's start-up log)")
    note(f"filling {args.rows} rows with {args.context}-token prompts")
    fill_batch(llm, args.rows, args.context, args.seed)
    # the peak the step is weighed against: torch's bf16 matmul where the CPU multiplies bf16, else its fp32 one
    note("measuring this machine's matmul GFLOP/s (2048x2048; bf16 where native, else fp32)")
    peak = bench_matmul(2048)
    note(f"replaying the step {args.repeats} times, each call timed")
    call_rows = None
    with CpuWatch() as cpu:
        if args.prompt:
            graph, times, call_rows, counts = profile_step(llm, args.prompt, args.repeats, args.seed)
        else:
            times = profile(lambda: graph.profile(args.rows), args.repeats)
    res = summarise(graph, times, args.rows, args.context, llm.engine.model.config,
                    count_params(llm.engine.model), peak, kv_int8=args.kv_cache_dtype == "int8", call_rows=call_rows,
                    prompt=args.prompt)
    res["kv_cache_dtype"] = args.kv_cache_dtype
    res["activation_dtype"] = args.activation_dtype
    res["other_cpu_s"] = cpu.other_cpu_s
    if args.prompt:
        res["plan"] = counts
    else:
        note(f"reference: oneDNN with prepacked bf16 weights over this model's {args.rows}-row linears alone")
        ref = bench_onednn_linears(llm.engine.model.config, args.rows, peak)
        if ref:
            res["onednn_linears"] = ref
    print_table(res)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
