"""The experiments `rtp simulate` runs: routing policies, collocated vs P/D, beta, load, scale.

Every run is one Cluster simulating one trace to its end; runs are independent,
so they spread over a process pool. Sizes are "equal hardware": a P/D cluster
has as many workers as the collocated one it is compared with, split between
prefill and decode the way an operator would -- by the work the trace asks of
each side (estimated with the cost model, then the best of the neighbouring
splits).
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace

import numpy as np

from rtp.runtime import BlockAllocator, RadixCache
from rtp.router.routing import Router
from rtp.sim import traces
from rtp.sim.cluster import Cluster, WorkerConfig
from rtp.sim.cost_model import DEVICES, MODELS, DeviceProfile, StepCost

BETAS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.65, 0.8, 0.9, 1.0)
LOADS = (0.5, 0.7, 0.85, 1.0, 1.05, 1.1, 1.15)


@dataclass(frozen=True)
class Setup:
    """What a run simulates, small enough to send to a pool process."""
    kind: str
    requests: int
    rate: float
    workers: int
    prefill: int               # P/D split (decode = workers - prefill)
    device: DeviceProfile
    model: str
    kv_tokens: int
    seed: int = 0


@dataclass(frozen=True)
class Run:
    setup: Setup
    mode: str                  # "collocated" or "pd"
    policy: str
    beta: float | str = 0.65
    label: str = ""


def worker_kv_tokens(device: DeviceProfile, model_name: str, memory_bytes: float | None) -> int:
    """KV tokens one worker holds: 90 % of its memory less the weights."""
    model = MODELS[model_name]
    if memory_bytes is None:
        memory_bytes = {"h100": 80e9, "h200": 141e9}.get(device.name, 1 << 30)
        if device.name not in ("h100", "h200"):   # a CPU worker: rtp's default 1 GiB KV budget
            return int(memory_bytes // model.kv_bytes_per_token)
    free = 0.9 * memory_bytes - model.params * model.weight_bytes_per_param
    return int(free // model.kv_bytes_per_token)


def _work_estimate(trace: traces.Trace, cost: StepCost, kv_tokens: int, workers: int,
                   sample: int = 2000, batch: int = 128) -> tuple[float, float]:
    """(prefill, decode) worker-seconds per request. Prefix hits are what one cache as
    large as the cluster's would give (so prefill work is a lower bound)."""
    bs = 64
    cache = RadixCache(BlockAllocator(max(2, workers * kv_tokens // bs), bs))
    idx = np.linspace(0, len(trace) - 1, min(sample, len(trace))).astype(int)
    prefill = decode = 0.0
    for i in idx:
        tokens = trace.tokens(int(i))
        hit = cache.record(tokens)
        prefill += cost.prefill_time(len(tokens), hit)
        out = int(trace.output_len[i])
        ctx = len(tokens) + out / 2
        decode += out * cost.decode_step_time(batch, int(ctx)) / batch
    return prefill / len(idx), decode / len(idx)


def plan_setup(kind: str, *, requests: int, workers: int, load: float, device: DeviceProfile,
               model: str, kv_tokens: int, seed: int = 0) -> Setup:
    """Arrival rate for `load` (1.0: the estimated capacity of the cluster) and the P/D split
    proportional to the estimated prefill and decode work."""
    cost = StepCost(device, MODELS[model])
    probe = traces.make(kind, min(requests, 4000), rate=1.0, seed=seed)
    pre, dec = _work_estimate(probe, cost, kv_tokens, workers)
    rate = load * workers / (pre + dec)
    prefill = min(workers - 1, max(1, round(workers * pre / (pre + dec))))
    return Setup(kind, requests, rate, workers, prefill, device, model, kv_tokens, seed)


def simulate(run: Run) -> tuple[dict, np.ndarray, np.ndarray]:
    """One run: its row of figures, and the TTFT and TBT samples (seconds, float32) behind them."""
    s = run.setup
    cost = StepCost(s.device, MODELS[s.model])
    trace = traces.make(s.kind, s.requests, s.rate, s.seed)
    router = Router(run.policy, beta=run.beta)
    cfg = WorkerConfig(kv_tokens=s.kv_tokens)
    if run.mode == "collocated":
        cluster = Cluster(cost, collocated=s.workers, router=router, config=cfg)
    else:
        cluster = Cluster(cost, prefill=s.prefill, decode=s.workers - s.prefill, router=router, config=cfg)
    result = cluster.run(trace, label_of(run))
    row = result.row()
    row.update(trace=s.kind, mode=run.mode, policy=run.policy, beta=run.beta, workers=s.workers,
               prefill_workers=s.prefill if run.mode == "pd" else 0, rate=round(s.rate, 2),
               mean_beta=round(float(np.mean(router.stats.beta_trace)), 3) if router.stats.beta_trace else None)
    return row, result.ttft.astype(np.float32), result.tbt.astype(np.float32)


def label_of(run: Run) -> str:
    return run.label or f"{run.mode} {run.policy}" + (f" beta={run.beta}" if run.policy == "flexlb" else "")


def pooled(parts: list[tuple[dict, np.ndarray, np.ndarray]]) -> dict:
    """One row for a run simulated with several seeds: percentiles over every seed's samples
    together (a P99 of bursty traffic from one trace is decided by its few worst bursts,
    so one seed's figure moves by 2x), throughput and hit ratio averaged."""
    rows = [p[0] for p in parts]
    ttft = np.concatenate([p[1] for p in parts])
    tbt = np.concatenate([p[2] for p in parts])
    row = dict(rows[0])
    pct = lambda a, q: round(float(np.percentile(a, q)) * 1e3, 2) if len(a) else math.nan  # noqa: E731
    row.update(p50_ttft_ms=pct(ttft, 50), p99_ttft_ms=pct(ttft, 99), p99_tbt_ms=pct(tbt, 99),
               seeds=len(rows),
               **{k: round(float(np.mean([r[k] for r in rows])), 3) for k in ("throughput_tok_s", "prefix_hit")},
               **{k: sum(r[k] for r in rows) for k in ("finished", "requests", "rejected", "wall_s")})
    if rows[0]["mean_beta"] is not None:
        row["mean_beta"] = round(float(np.mean([r["mean_beta"] for r in rows])), 3)
    return row


def run_all(runs: list[Run], jobs: int | None = None, progress=None, seeds: int = 1) -> list[dict]:
    """Simulate every run with `seeds` traces each (seeds setup.seed, setup.seed + 1, ...),
    over a process pool; one pooled row per run, in order."""
    tasks = [replace(r, setup=replace(r.setup, seed=r.setup.seed + k)) for r in runs for k in range(seeds)]
    jobs = jobs or min(len(tasks), os.cpu_count() or 1)
    out = []

    def collect(results):
        for i in range(len(runs)):
            parts = [next(results) for _ in range(seeds)]
            out.append(pooled(parts))
            if progress:
                progress(out[-1])

    if jobs <= 1:
        collect(simulate(t) for t in tasks)
    else:
        with ProcessPoolExecutor(jobs) as pool:
            collect(f.result() for f in [pool.submit(simulate, t) for t in tasks])
    return out


def best_split(setup: Setup, jobs: int | None = None, progress=None, seeds: int = 1) -> tuple[Setup, list[dict]]:
    """Try the estimated P/D split and its neighbours with FlexLB and keep the one closest to
    the best of them on both P99 TTFT and P99 TBT (the smallest worst ratio): an operator
    sizes the pools to meet both latency goals, not one at the other's expense."""
    p = setup.prefill
    step = max(1, setup.workers // 16)
    splits = sorted({min(setup.workers - 1, max(1, p + d * step)) for d in (-2, -1, 0, 1, 2)})
    rows = run_all([Run(replace(setup, prefill=q), "pd", "flexlb", 0.65, f"pd split {q}:{setup.workers - q}")
                    for q in splits], jobs, progress, seeds)
    done = [r for r in rows if r["finished"] == r["requests"]] or rows
    ttft = min(r["p99_ttft_ms"] for r in done)
    tbt = min(r["p99_tbt_ms"] for r in done)
    best = min(done, key=lambda r: max(r["p99_ttft_ms"] / ttft, r["p99_tbt_ms"] / tbt))
    return replace(setup, prefill=best["prefill_workers"]), rows


def table_runs(setup: Setup) -> list[Run]:
    """The seed's Table 1: every policy, collocated and P/D, on equal hardware."""
    runs = [Run(setup, "collocated", p) for p in ("round-robin", "least-loaded", "cache-aware", "flexlb")]
    runs += [Run(setup, "pd", p) for p in ("round-robin", "least-loaded", "cache-aware", "flexlb")]
    runs.append(Run(setup, "pd", "flexlb", "auto"))
    return runs


def beta_runs(setup: Setup, betas=BETAS) -> list[Run]:
    return [Run(setup, "pd", "flexlb", b) for b in betas] + [Run(setup, "pd", "flexlb", "auto")]


def load_runs(setup: Setup, loads=LOADS) -> list[Run]:
    out = []
    for f in loads:
        s = replace(setup, rate=setup.rate * f)
        out += [Run(s, "collocated", "least-loaded", label=f"load x{f} collocated least-loaded"),
                Run(s, "pd", "flexlb", "auto", label=f"load x{f} pd flexlb auto")]
    return out


def fmt_table(rows: list[dict], columns: tuple[str, ...]) -> str:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))
    return "\n".join(lines)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.3g}"
    return str(v)


def device_profile(name: str) -> DeviceProfile:
    if name == "this-cpu":
        return DeviceProfile.measure()
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; choose this-cpu or one of {', '.join(DEVICES)}")
    return DEVICES[name]


def setup_dict(s: Setup) -> dict:
    d = asdict(s)
    d["device"] = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(s.device).items()}
    d["rate"] = round(s.rate, 3)
    return d
