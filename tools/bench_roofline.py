#!/usr/bin/env python3
"""Every step shape beside the limit this machine sets it: a roofline report.

For each step shape the engine runs -- decode at 1, 16 and 64 rows (contexts 256 and
2,048), one 2,048-token prefill chunk, a mixed step (one 256-token prompt beside 63
decode rows) -- this tool builds the step through the real engine (real requests, the
real scheduler and KV cache), times the runner's forward of that very plan (the median of
--repeats runs: a forward is idempotent, it rewrites the same KV slots), and sets it
against two limits measured in the same run:

  compute  the step's FLOPs (linear layers 2 x tokens x N x K, the LM head over the rows
           that sample, attention 4 x heads x head_dim per query-key pair) at the bf16
           matmul rate of this machine (2048^3 torch.matmul: AMX through oneDNN where the
           CPU has it); with --activation-dtype int8, the linear layers that take int8 rows
           count at the int8 rate (2048^3 torch._int_mm: VNNI or AMX-INT8 through oneDNN),
           the rest at the bf16 one;
  memory   the step's bytes -- weights as rtp stores them for the kernels that run them
           (GGUF blocks in tile order, else bf16), KV read (each row's whole context once)
           and written, activations in and out of every linear and the fp32 residual
           stream -- at the streaming-read bandwidth of rtp's own read kernel on both cores,
           measured over a buffer the size of what each phase streams (a buffer past the caches
           is DRAM, one the size of the weights whatever share of L3 this VM gets: all printed).

A step runs its kernels one after another, each against its own resource: the linear layers
multiply (compute) while attention reads the KV cache (memory at long contexts), and neither
overlaps the other, since each waits for the one before. So the step's limit is the sum of its
two phases' limits -- linear layers (their FLOPs; weights, activations and the residual stream)
and attention (its FLOPs; the KV read and written) -- each the larger of its compute and memory
time. "% of limit" is limit / measured; "bound" names the resource that sets the larger share
of the limit, and that share. The table, then (last line of stdout) one JSON.

With --workload N:P_LO-P_HI:O_LO-O_HI, a whole offline workload runs too: tools/bench_offline.py's
(the same requests for the same --seed: N prompts of random tokens, lengths uniform in the ranges,
each generating its length), through LLM.generate. Every forward it runs is timed as it comes and set
against its own limit as above, and the sums say how near the machine's limit the whole run came:
split into the steps that hold prompt rows and those that only decode, with the wall time beside
them (the forwards' sum plus the host's share: scheduling, sampling). Its generated tokens over the
limits' sum is the highest generated tok/s this machine allows that workload -- the figure a ratio
against another engine's measured rate can be checked against.

    python tools/bench_roofline.py
    python tools/bench_roofline.py --repeats 5 --shapes prefill,mixed
    python tools/bench_roofline.py --activation-dtype int8   # int8 rows into the linears, at the int8 limit
    python tools/bench_roofline.py --shapes none --workload 64:256-1024:32-96   # bench_offline's prompt-heavy mix
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from _common import CpuWatch, allowed_token_ids, bench_matmul, make_workload, note, stream_gbps
from rtp.kernels import cpu_kernels

STREAM_MIB = (32, 128, 512, 2048)   # streaming-read buffer sizes; 2 GiB is past any L3 seen here


# -- the machine's limits --------------------------------------------------------------------------

def _figures(ratio: float) -> float:
    """A ratio to 4 significant figures (4 decimals lost a tenth of a ratio of 0.004: a step on a busy
    machine)."""
    return float(f"{ratio:.4g}")


def bench_int8_matmul(n: int = 2048, repeats: int = 6) -> float | None:
    """torch._int_mm GOP/s at n^3 (None where this torch has no CPU int8 matmul)."""
    a = torch.randint(-64, 64, (n, n), dtype=torch.int8)
    b = torch.randint(-64, 64, (n, n), dtype=torch.int8)
    try:
        torch._int_mm(a, b)
    except (RuntimeError, AttributeError):
        return None
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch._int_mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def weight_memory(model: torch.nn.Module) -> dict[str, float]:
    """MiB of each form the linear weights are kept in: the model's parameters, oneDNN's prepacked
    bf16 copies, GGUF blocks as the one-row kernels read them, the same blocks in AMX tile order."""
    seen: set[int] = set()
    mib = {"parameters": 0.0, "onednn_packed": 0.0, "blocks": 0.0, "amx_tiles": 0.0}

    def add(key: str, t: torch.Tensor | None) -> None:
        if t is None or t.device.type != "cpu":
            return
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # an opaque oneDNN tensor
            ptr = id(t)
        if ptr in seen or (ptr == 0 and key != "onednn_packed"):
            return
        seen.add(ptr)
        size = t.untyped_storage().nbytes() if key != "onednn_packed" else t.numel() * t.element_size()
        mib[key] += size / (1 << 20)

    for p in model.parameters():
        add("parameters", p.data)
    for m in model.modules():
        add("onednn_packed", getattr(m, "packed", None))
        quant = getattr(m, "quant", None)
        for part in getattr(quant, "parts", [quant]) if quant is not None else []:
            for t in (part.qs, part.d, part.m):
                add("blocks", t)
            add("amx_tiles", part.tiles)
    return {k: round(v, 1) for k, v in mib.items()}


def rss_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / (1 << 20)
    return float("nan")


# -- what a step costs -----------------------------------------------------------------------------

@dataclass
class ModelCost:
    layers: int
    hidden: int
    heads: int
    head_dim: int
    kv_bytes_per_token: int       # one layer's K and V
    linear_nk: list[tuple[int, int]]   # one layer's linears (N, K)
    linear_int8: list[str | None]  # which of their rows are int8: "all", "prefill" (the prompt rows), or None
    layer_weight_bytes: float     # one layer's linear weights as stored
    vocab: int
    head_weight_bytes: float      # the LM head as stored

    @classmethod
    def of(cls, model: torch.nn.Module, kv_caches: list[torch.Tensor]) -> "ModelCost":
        from rtp.kernels.quant import TILE_KIND_INT8_ROWS, BlockQuantized
        from rtp.models.layers import LinearBase

        config = model.config
        layer0 = model.model.layers[0]
        linears = [m for m in layer0.modules() if isinstance(m, LinearBase)]
        head = model.lm_head
        kv = kv_caches[0]
        int8 = cpu_kernels.int8_rows_available()

        def int8_rows(m) -> str | None:  # the kind the tile kernels take says it (BlockQuantized.tile_kind)
            quant = getattr(m, "quant", None)
            if int8 and isinstance(quant, BlockQuantized) and quant.tile_kind in TILE_KIND_INT8_ROWS.values():
                return quant.int8_rows
            return None

        return cls(layers=config.num_hidden_layers, hidden=config.hidden_size, heads=config.num_attention_heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
                   kv_bytes_per_token=int(kv[:, 0, 0].numel() * kv.element_size()),
                   linear_nk=[tuple(m.weight.shape) for m in linears], linear_int8=[int8_rows(m) for m in linears],
                   layer_weight_bytes=sum(stored_bytes(m) for m in linears), vocab=config.vocab_size,
                   head_weight_bytes=stored_bytes(head))


def stored_bytes(layer) -> float:
    """Bytes of a linear's weights as the kernels that multiply them read them."""
    quant = getattr(layer, "quant", None)
    if quant is None:
        return layer.weight.numel() * layer.weight.element_size()
    total = 0.0
    for part in getattr(quant, "parts", [quant]):  # a fused layer of several layouts: each part
        if part.tiles is not None:
            total += part.tiles.numel()
        else:
            total += sum(t.numel() * t.element_size() for t in (part.qs, part.d, part.m) if t is not None)
    return total


@dataclass
class StepCost:
    tokens: int
    samples: int
    decode_rows: int
    prefill_rows: int
    mean_context: float
    linear_flop: float      # linear layers and the LM head
    int8_flop: float        # the share of linear_flop in layers that take int8 rows
    linear_bytes: float     # their weights as stored, their activations and the residual stream
    weight_bytes: float     # what the linears' bandwidth is measured at (a buffer of that size)
    attention_flop: float
    kv_bytes: float         # KV read (each row's whole context once) and written

    @property
    def flop(self) -> float:
        return self.linear_flop + self.attention_flop

    @property
    def bytes(self) -> float:
        return self.linear_bytes + self.kv_bytes

    @classmethod
    def of(cls, plan, cost: ModelCost) -> "StepCost":
        t, ns, nd, nr = plan.num_tokens, plan.num_samples, plan.num_decode_rows, plan.num_rows
        qsl, lens = plan.query_start_loc[: nr + 1].astype(np.int64), plan.seq_lens[:nr].astype(np.int64)
        q = qsl[1:] - qsl[:-1]
        keys = q * (lens - q) + q * (q + 1) // 2  # causal: query i of a chunk sees the prefix and i + 1
        per_layer_mm = sum(n * k for n, k in cost.linear_nk)
        # int8-prefill: the decode rows (the step's first) in bf16, the prompt rows as int8
        int8_mm = sum(n * k * (t if int8 == "all" else t - nd) for (n, k), int8 in zip(cost.linear_nk, cost.linear_int8)
                      if int8)
        linear_flop = cost.layers * 2.0 * t * per_layer_mm + 2.0 * ns * cost.vocab * cost.hidden
        attention_flop = cost.layers * 4.0 * cost.heads * cost.head_dim * float(keys.sum())
        weights = cost.layers * cost.layer_weight_bytes + cost.head_weight_bytes
        kv = cost.layers * cost.kv_bytes_per_token * float(lens.sum() + t)  # every context read once, new KV written
        acts = cost.layers * (sum(2.0 * t * (n + k) for n, k in cost.linear_nk) + 4.0 * t * cost.hidden * 4)
        acts += ns * (2.0 * cost.hidden + 4.0 * cost.vocab)
        return cls(t, ns, nd, nr - nd, float(lens.mean()), linear_flop, cost.layers * 2.0 * int8_mm,
                   weights + acts, weights, attention_flop, kv)


# -- driving the engine to each shape --------------------------------------------------------------

class ForwardTimer:
    """Wraps the runner's forward: when the planned step has the awaited shape, the forward runs
    warm-up + repeats times over that same plan and the times are kept."""

    def __init__(self, runner, repeats: int):
        self.runner, self.repeats = runner, repeats
        self.forward = runner.forward
        self.want: tuple[int, int, int] | None = None  # (rows, decode rows, tokens); -1: any
        self.times: list[float] = []
        self.cost = None
        self.path = ""
        runner.forward = self

    def expect(self, rows: int, decode_rows: int, tokens: int = -1) -> None:
        self.want, self.times = (rows, decode_rows, tokens), []

    def _matches(self, plan) -> bool:
        if self.want is None:
            return False
        got = (plan.num_rows, plan.num_decode_rows, plan.num_tokens)
        return all(w < 0 or w == g for w, g in zip(self.want, got))

    def __call__(self):
        plan = self.runner.plan
        if not self._matches(plan):
            return self.forward()
        self.want = None
        graphs = self.runner.graph_steps
        for _ in range(2):
            out = self.forward()
        self.path = "CPU graph" if self.runner.graph_steps > graphs else "eager"
        for _ in range(self.repeats):
            t = time.perf_counter()
            out = self.forward()
            self.times.append(time.perf_counter() - t)
        self.plan_snapshot = plan
        return out


class StepRecorder:
    """Wraps the runner's forward while a workload runs: every step's time and cost, as it comes (the
    plan is rewritten by the next step)."""

    def __init__(self, runner, model_cost: ModelCost):
        self.runner, self.model_cost, self.forward = runner, model_cost, runner.forward
        self.steps: list[tuple[float, StepCost]] = []

    def __enter__(self) -> "StepRecorder":
        self.runner.forward = self
        return self

    def __exit__(self, *exc) -> None:
        self.runner.forward = self.forward

    def __call__(self):
        t = time.perf_counter()
        out = self.forward()
        seconds = time.perf_counter() - t
        self.steps.append((seconds, StepCost.of(self.runner.plan, self.model_cost)))
        return out


def run_workload(llm, spec: tuple[int, tuple[int, int], tuple[int, int]], seed: int, model_path: Path,
                 cost: ModelCost) -> dict:
    """tools/bench_offline.py's workload for this spec and seed through LLM.generate, every step recorded."""
    from rtp import SamplingParams

    n, prompt_lens, output_lens = spec
    work = make_workload(allowed_token_ids(model_path), n, prompt_lens, output_lens, seed, stream=1)
    note(f"workload: {n} requests, {work.prompt_tokens:,} prompt tokens, {work.output_tokens:,} to generate")
    llm.generate([work.prompts[0][:16]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in work.output_lens]
    with StepRecorder(llm.engine.runner, cost) as recorder:
        t = time.perf_counter()
        outs = llm.generate(work.prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests": n, "prompt_lens": list(prompt_lens), "output_lens": list(output_lens), "seed": seed,
            "prompt_tokens": work.prompt_tokens, "generated_tokens": generated, "wall_s": wall,
            "steps": recorder.steps}


ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64)  # decode-only steps by batch size: up to each, past the last


def rows_bucket(rows: int) -> tuple[int, str]:
    """A batch size's bucket: its order and its label ("1", "3-4", ..., "65+")."""
    low = 1
    for i, top in enumerate(ROW_BUCKETS):
        if rows <= top:
            return i, str(top) if low == top else f"{low}-{top}"
        low = top + 1
    return len(ROW_BUCKETS), f"{low}+"


def workload_rows(run: dict, limits: dict) -> dict:
    """The recorded steps against their limits, summed: those holding prompt rows, those only decoding,
    and the decode-only ones again by batch size (with their mean context)."""
    groups: dict = {"with prompt rows": [0, 0.0, 0.0, 0.0], "decode only": [0, 0.0, 0.0, 0.0]}
    by_rows: dict[tuple[int, str], list] = {}
    for seconds, cost in run["steps"]:
        limit = row_for({"name": "", "path": "", "cost": cost, "measured": seconds}, limits)["limit_ms"] / 1e3
        tallies = [groups["with prompt rows" if cost.prefill_rows else "decode only"]]
        if not cost.prefill_rows:
            tallies.append(by_rows.setdefault(rows_bucket(cost.decode_rows), [0, 0.0, 0.0, 0.0]))
        for t in tallies:  # steps, measured seconds, limit seconds, contexts' sum
            for i, v in enumerate((1, seconds, limit, cost.mean_context)):
                t[i] += v
    groups["all forwards"] = [sum(g[i] for g in groups.values()) for i in range(4)]

    def summary(c: int, m: float, lim: float) -> dict:
        return {"steps": c, "measured_s": round(m, 5), "limit_s": round(lim, 5),
                "of_limit": _figures(lim / m) if m else None}

    out = {k: v for k, v in run.items() if k != "steps"}
    out["groups"] = {k: summary(c, m, lim) for k, (c, m, lim, _) in groups.items()}
    out["decode_by_rows"] = {k: {**summary(c, m, lim), "mean_context": round(ctx / c, 1)}
                             for (_, k), (c, m, lim, ctx) in sorted(by_rows.items())}
    out["wall_s"] = round(run["wall_s"], 3)
    out["generated_tok_s"] = round(run["generated_tokens"] / run["wall_s"], 2)
    limit_s = groups["all forwards"][2]
    out["generated_tok_s_at_limit"] = round(run["generated_tokens"] / limit_s, 2) if limit_s else None
    return out


def print_workload(w: dict) -> None:
    print(f"\nworkload: {w['requests']} requests (prompts {w['prompt_lens'][0]}-{w['prompt_lens'][1]}, outputs "
          f"{w['output_lens'][0]}-{w['output_lens'][1]}, seed {w['seed']}): {w['prompt_tokens']:,} prompt tokens, "
          f"{w['generated_tokens']:,} generated")
    print(f"{'steps':<18} {'count':>6} {'measured s':>11} {'limit s':>9} {'of limit':>9}")
    for name, g in w["groups"].items():
        of = f"{g['of_limit']:.1%}" if g["of_limit"] else "-"
        print(f"{name:<18} {g['steps']:>6} {g['measured_s']:>11.2f} {g['limit_s']:>9.2f} {of:>9}")
    print(f"{'wall (generate)':<18} {'':>6} {w['wall_s']:>11.2f}")
    print(f"{'decode-only rows':<18} {'count':>6} {'measured s':>11} {'limit s':>9} {'of limit':>9} {'context':>8}")
    for name, g in w["decode_by_rows"].items():
        of = f"{g['of_limit']:.1%}" if g["of_limit"] else "-"
        print(f"{name:<18} {g['steps']:>6} {g['measured_s']:>11.2f} {g['limit_s']:>9.2f} {of:>9} "
              f"{g['mean_context']:>8.0f}")
    print(f"generated tok/s: {w['generated_tok_s']:,.1f} measured, {w['generated_tok_s_at_limit']:,.1f} at the limit")


def run_until(engine, timer: ForwardTimer, limit: int = 400) -> None:
    for _ in range(limit):
        if timer.times:
            return
        engine.step()
    raise SystemExit(f"the engine never ran the awaited step shape {timer.want}")


def add_prompts(engine, n: int, length: int, rng: np.random.Generator, tag: str) -> list[str]:
    from rtp import SamplingParams

    vocab = engine.model.config.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    ids = []
    for r in range(n):
        rid = f"{tag}-{r}"
        engine.add_request(rid, rng.integers(100, vocab - 100, length).tolist(), sp)
        ids.append(rid)
    return ids


def fill_decode(engine, n: int, context: int, rng, tag: str) -> list[str]:
    """n requests of `context`-token prompts, stepped until all of them decode together."""
    ids = add_prompts(engine, n, context, rng, tag)
    plan = engine.scheduler.plan
    for _ in range(20 * n + 200):
        engine.step()
        if plan.num_rows == n == plan.num_decode_rows:
            return ids
    raise SystemExit(f"the engine never ran {n} rows as one decode step (KV memory?)")


def abort(engine, ids: list[str]) -> None:
    for rid in ids:
        engine.abort_request(rid)


# -- the report ------------------------------------------------------------------------------------

def step_of(name: str, timer: ForwardTimer, model_cost: ModelCost) -> dict:
    """A shape's measurement, set against the limits once every shape has run (row_for)."""
    return {"name": name, "path": timer.path, "cost": StepCost.of(timer.plan_snapshot, model_cost),
            "measured": statistics.median(timer.times)}


def bandwidth(streamed: float, limits: dict) -> float:
    """The streaming-read GB/s measured over the smallest buffer that holds `streamed` bytes."""
    return next((limits["stream_gb_s"][m] for m in STREAM_MIB if (m << 20) >= streamed),
                limits["stream_gb_s"][STREAM_MIB[-1]])


def row_for(step: dict, limits: dict) -> dict:
    name, cost, measured = step["name"], step["cost"], step["measured"]
    bf16 = limits["bf16_gflops"] * 1e9
    linear_compute = (cost.linear_flop - cost.int8_flop) / bf16
    if cost.int8_flop:
        linear_compute += cost.int8_flop / (limits["int8_gops"] * 1e9)
    phases = {"linears": (linear_compute, cost.linear_bytes / (bandwidth(cost.weight_bytes, limits) * 1e9)),
              "attention": (cost.attention_flop / bf16, cost.kv_bytes / (bandwidth(cost.kv_bytes, limits) * 1e9))}
    limit = sum(max(c, m) for c, m in phases.values())
    compute_share = sum(c for c, m in phases.values() if c >= m) / limit
    return {"shape": name, "path": step["path"], "tokens": cost.tokens, "decode_rows": cost.decode_rows,
            "prefill_rows": cost.prefill_rows, "mean_context": round(cost.mean_context, 1),
            "ms": round(measured * 1e3, 3), "gflop": round(cost.flop / 1e9, 3),
            "int8_gflop": round(cost.int8_flop / 1e9, 3), "gflops": round(cost.flop / measured / 1e9, 1),
            "mb": round(cost.bytes / 1e6, 1), "gb_s": round(cost.bytes / measured / 1e9, 1),
            "phases": {k: {"limit_ms": round(max(c, m) * 1e3, 3), "bound": "compute" if c >= m else "memory"}
                       for k, (c, m) in phases.items()},
            "limit_ms": round(limit * 1e3, 3), "bound": "compute" if compute_share >= 0.5 else "memory",
            "bound_share": round(max(compute_share, 1 - compute_share), 3), "of_limit": _figures(limit / measured)}


def print_table(rows: list[dict], limits: dict) -> None:
    s = limits["stream_gb_s"]
    int8 = f"{limits['int8_gops']:,.0f} GOP/s" if limits.get("int8_gops") else "n/a"
    if limits.get("int8_gops_probes"):
        int8 += " (the faster of " + " / ".join(f"{v:,.0f}" for v in limits["int8_gops_probes"]) + ")"
    probes = " / ".join(f"{v:,.0f}" for v in limits.get("bf16_gflops_probes", []))
    print(f"\nthis machine: bf16 matmul {limits['bf16_gflops']:,.0f} GFLOP/s (the faster of probes {probes}, before and "
          f"after the shapes), int8 matmul {int8}; streaming read "
          + ", ".join(f"{v:.1f} GB/s at {m} MiB" for m, v in s.items()) + f"; RSS {limits['rss_gib']:.2f} GiB")
    print("weights (MiB): " + ", ".join(f"{k.replace('_', ' ')} {v:,.1f}" for k, v in limits["weights_mib"].items()))
    head = (f"{'shape':<26} {'path':<9} {'tokens':>6} {'ms':>9} {'GFLOP':>8} {'GFLOP/s':>8} {'MB':>8} "
            f"{'GB/s':>6} {'limit ms':>9} {'bound':>12} {'of limit':>8}")
    print(head)
    for r in rows:
        print(f"{r['shape']:<26} {r['path']:<9} {r['tokens']:>6} {r['ms']:>9.2f} {r['gflop']:>8.1f} "
              f"{r['gflops']:>8,.0f} {r['mb']:>8.1f} {r['gb_s']:>6.1f} {r['limit_ms']:>9.2f} "
              f"{r['bound'] + ' ' + format(r['bound_share'], '.0%'):>12} "
              f"{r['of_limit']:>8.1%}")


SHAPES = ("decode", "prefill", "mixed")


def _workload_spec(text: str) -> tuple[int, tuple[int, int], tuple[int, int]]:
    try:
        n, p, o = text.split(":")
        spec = int(n), tuple(int(v) for v in p.split("-")), tuple(int(v) for v in o.split("-"))
    except ValueError:
        spec = None
    if (spec is None or len(spec[1]) != 2 or len(spec[2]) != 2 or spec[0] < 1
            or not 1 <= spec[1][0] <= spec[1][1] or not 1 <= spec[2][0] <= spec[2][1]):
        raise argparse.ArgumentTypeError(f"{text!r}: give REQUESTS:PROMPT_LO-PROMPT_HI:OUTPUT_LO-OUTPUT_HI, "
                                         "e.g. 64:256-1024:32-96")
    return spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default=None, help="checkpoint directory, GGUF file or ID (default: SmolLM2-135M)")
    ap.add_argument("--repeats", type=int, default=7, help="timed forwards per shape (default 7)")
    ap.add_argument("--rows", type=int, default=64, help="the largest decode batch; 16 and 1 are measured too "
                                                         "(default 64)")
    ap.add_argument("--contexts", default="256,2048", help="decode contexts; the mixed step runs at the first "
                                                           "(default 256,2048)")
    ap.add_argument("--prefill-tokens", type=int, default=2048, help="the prefill chunk (default 2048)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="which of decode, prefill, mixed, or none "
                                                               "(default all)")
    ap.add_argument("--workload", type=_workload_spec, metavar="N:P_LO-P_HI:O_LO-O_HI",
                    help="also run tools/bench_offline.py's workload of N requests, prompt and output lengths in "
                         "those ranges (its --seed), every step against its limit; e.g. 64:256-1024:32-96")
    ap.add_argument("--kv-cache-gib", type=float, default=4,
                    help="KV cache: --rows rows at the longest context, with room (default 4; SmolLM2-135M "
                         "needs 3.3)")
    ap.add_argument("--activation-dtype", default="auto", choices=["auto", "int8", "int8-prefill"],
                    help="rtp's --activation-dtype (int8: Q4_1 and Q8_0 layers take int8 rows on a CPU with VNNI and "
                         "no AMX, int8-prefill their prompt rows only; those rows' FLOPs count at the int8 rate)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    shapes = set(args.shapes.split(",")) - {"none"}
    contexts = [int(c) for c in args.contexts.split(",")]
    if shapes - set(SHAPES) or args.repeats < 1 or args.rows < 2 or min(contexts) < 1:
        ap.error(f"--shapes takes {', '.join(SHAPES)} or none; --repeats at least 1, --rows at least 2")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_kernels.available():
        raise SystemExit("rtp's CPU kernels are not available here (they need AVX-512 BF16)")

    from rtp import LLM

    longest = args.workload[1][1] + args.workload[2][1] if args.workload else 0  # a workload's longest request
    top = max(contexts + [args.prefill_tokens, longest])
    budget = max(2048, args.prefill_tokens)
    note(f"loading the model, bf16, --activation-dtype {args.activation_dtype}")
    llm = LLM(model=args.model, dtype="bfloat16", max_num_seqs=args.rows, max_num_batched_tokens=budget,
              max_model_len=top + 512, kv_cache_memory=int(args.kv_cache_gib * (1 << 30)),
              enable_prefix_caching=False, activation_dtype=args.activation_dtype)
    engine = llm.engine
    limits = {"rss_gib": rss_gib(), "weights_mib": weight_memory(engine.model)}
    note("measuring this machine: bf16 and int8 matmul, streaming reads")
    limits["bf16_gflops"] = bench_matmul(2048, torch.bfloat16)
    limits["int8_gops"] = bench_int8_matmul()
    limits["stream_gb_s"] = {m: stream_gbps(m) for m in STREAM_MIB}
    timer = ForwardTimer(engine.runner, args.repeats)
    cost = ModelCost.of(engine.model, engine.runner.kv_caches)
    rng = np.random.default_rng(args.seed)
    steps: list[dict] = []
    batches = sorted({args.rows, min(16, args.rows - 1), 1}, reverse=True)
    with CpuWatch() as cpu:
        if "prefill" in shapes:
            note(f"prefill: one {args.prefill_tokens:,}-token chunk")
            timer.expect(1, 0, args.prefill_tokens)
            ids = add_prompts(engine, 1, args.prefill_tokens, rng, "prefill")
            run_until(engine, timer)
            steps.append(step_of(f"prefill {args.prefill_tokens}", timer, cost))
            abort(engine, ids)
            engine.step()
        for context in contexts:
            mixed = "mixed" in shapes and context == contexts[0]
            if "decode" not in shapes and not mixed:
                continue
            note(f"filling {args.rows} rows at context {context}")
            ids = fill_decode(engine, args.rows, context, rng, f"ctx{context}")
            if "decode" in shapes:
                timer.expect(args.rows, args.rows, args.rows)
                run_until(engine, timer)
                steps.append(step_of(f"decode {args.rows} @ {context}", timer, cost))
            if mixed:
                abort(engine, ids[:1])
                ids = ids[1:]
                timer.expect(args.rows, args.rows - 1)
                ids += add_prompts(engine, 1, context, rng, "mixed")
                run_until(engine, timer)
                steps.append(step_of(f"mixed {context} + {args.rows - 1} decode", timer, cost))
            if "decode" in shapes:
                for keep in batches[1:]:
                    abort(engine, ids[keep:])
                    ids = ids[:keep]
                    engine.step()  # the aborts take effect
                    timer.expect(keep, keep, keep)
                    run_until(engine, timer)
                    steps.append(step_of(f"decode {keep} @ {context}", timer, cost))
            abort(engine, ids)
            engine.step()
        workload = None
        if args.workload:
            from rtp.checkpoint.default_model import default_model_path

            model_path = Path(args.model).expanduser() if args.model else default_model_path()
            workload = run_workload(llm, args.workload, args.seed, model_path, cost)
    # the matmul again after the shapes, and the faster of the two probes as the limit: a probe that caught the
    # host in a slow minute (it moves 1.5x within minutes) put steps above 100 % of their "limit"
    note("measuring the bf16 and int8 matmuls again")
    limits["bf16_gflops_probes"] = [round(limits["bf16_gflops"], 1), round(bench_matmul(2048, torch.bfloat16), 1)]
    limits["bf16_gflops"] = max(limits["bf16_gflops_probes"])
    if limits["int8_gops"]:
        limits["int8_gops_probes"] = [round(limits["int8_gops"], 1), round(bench_int8_matmul(), 1)]
        limits["int8_gops"] = max(limits["int8_gops_probes"])
    limits["activation_dtype"] = args.activation_dtype
    rows = [row_for(step, limits) for step in steps]
    limits["other_cpu_s"] = cpu.other_cpu_s
    if rows:
        print_table(rows, limits)
    figures = {"limits": {**limits, "stream_gb_s": {str(k): round(v, 1) for k, v in limits["stream_gb_s"].items()}},
               "shapes": rows}
    if workload is not None:
        figures["workload"] = workload_rows(workload, limits)
        print_workload(figures["workload"])
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
