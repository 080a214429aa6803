#!/usr/bin/env python3
"""EPLB on routing traces of DeepSeek-V3's shape: per-rank load balance and a layer-time estimate.

Traces: --layers MoE layers (58) of --experts routed experts (256), top-k (8), over
--ranks EP ranks (16); each layer routes --tokens tokens. Expert popularity is Zipf
with a per-layer random order, its exponent set so that the hottest expert sees
--hot-ratio (20) times the tokens of the median one, as in production traces. The
plans are computed from one window of traffic and judged on the next (a fresh draw
from the same popularity), as a rebalancer would run them.

For each placement (naive: contiguous blocks; static: load-aware, no replicas; EPLB:
replicas of the hottest experts, then balanced packing) it prints the max/min per-rank
token load (mean and worst over layers), the replica memory share, and a cost model of
one MoE layer: the slowest rank's expert GEMMs at this machine's measured grouped-GEMM
rate (torch._grouped_mm, bf16, measured here on a scaled-down shape) plus the all-to-all
at an assumed --link-gbps per rank. Targets (issue 6): EPLB max/min <= 1.10 with at most
15 % replica memory; static between naive and EPLB.

Output: a table, then as the LAST line one JSON object with the same figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rtp.engine.eplb import (  # noqa: E402
    eplb_placement,
    imbalance,
    naive_placement,
    replica_slots,
    static_placement,
)


def zipf_exponent(experts: int, hot_ratio: float) -> float:
    """s with p(1) / p(median) = hot_ratio for p(i) ~ i^-s."""
    return float(np.log(hot_ratio) / np.log(experts / 2))


def traces(args, seed: int, order: np.ndarray) -> np.ndarray:
    rng = np.random.default_rng(seed)
    s = zipf_exponent(args.experts, args.hot_ratio)
    base = 1.0 / np.arange(1, args.experts + 1) ** s
    out = np.empty((args.layers, args.experts), dtype=np.int64)
    for layer in range(args.layers):
        p = base[order[layer]]
        out[layer] = rng.multinomial(args.tokens * args.top_k, p / p.sum())
    return out


def grouped_gemm_gflops() -> float:
    """bf16 expert GEMM rate on this machine: torch._grouped_mm if present, else bmm."""
    import torch

    groups, rows, hidden, inter = 8, 64, 1024, 512
    x = torch.randn(groups * rows, hidden).bfloat16()
    w = torch.randn(groups, hidden, inter).bfloat16()
    offs = torch.arange(rows, groups * rows + 1, rows, dtype=torch.int32)
    grouped = getattr(torch, "_grouped_mm", None)

    def run():
        if grouped is not None:
            return grouped(x, w, offs=offs)
        return torch.bmm(x.view(groups, rows, hidden), w)

    run()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return 2 * groups * rows * hidden * inter / best / 1e9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=58)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per layer per window (default 16384)")
    p.add_argument("--hot-ratio", type=float, default=20.0, help="hottest / median expert load (default 20)")
    p.add_argument("--replica-share", type=float, default=0.05, help="replica slots as a share of experts")
    p.add_argument("--hidden", type=int, default=7168, help="model hidden size (DeepSeek-V3: 7168)")
    p.add_argument("--inter", type=int, default=2048, help="expert intermediate size (DeepSeek-V3: 2048)")
    p.add_argument("--link-gbps", type=float, default=50.0, help="assumed all-to-all GB/s per rank")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    rng = np.random.default_rng(args.seed)
    order = np.stack([rng.permutation(args.experts) for _ in range(args.layers)])
    seen = traces(args, args.seed + 1, order)      # the window the plans are made from
    judged = traces(args, args.seed + 2, order)    # the traffic they then serve
    extra = replica_slots(args.experts, args.ranks, share=args.replica_share)
    plans = {
        "naive": naive_placement(args.layers, args.experts, args.ranks),
        "static": static_placement(seen, args.ranks),
        "eplb": eplb_placement(seen, args.ranks, extra),
    }
    gflops = grouped_gemm_gflops()
    flop_per_token = 3 * 2 * args.hidden * args.inter  # gate, up, down
    results = {}
    for name, plan in plans.items():
        loads = plan.rank_loads(judged)
        ratio = imbalance(loads)
        slots = plan.slots.shape[2] * args.ranks
        gemm_ms = loads.max(axis=1) * flop_per_token / (gflops * 1e9) * 1e3
        # each rank sends its tokens' hidden states to the experts' ranks and gets them back (bf16)
        a2a_ms = 2 * (args.tokens / args.ranks) * args.top_k * args.hidden * 2 / (args.link_gbps * 1e9) * 1e3
        results[name] = {
            "max_min_mean": round(float(ratio.mean()), 4),
            "max_min_worst": round(float(ratio.max()), 4),
            "replica_memory_share": round((slots - args.experts) / args.experts, 4),
            "layer_ms_est": round(float(gemm_ms.mean() + a2a_ms), 3),
            "gemm_ms_est": round(float(gemm_ms.mean()), 3),
            "a2a_ms_est": round(a2a_ms, 3),
        }
    print(f"EPLB on Zipf routing traces: {args.layers} layers x {args.experts} experts, top-{args.top_k}, "
          f"{args.ranks} EP ranks, {args.tokens} tokens per layer, hottest/median expert {args.hot_ratio:g}x")
    print(f"cost model: grouped bf16 GEMM at {gflops:.0f} GFLOP/s (measured here), all-to-all at "
          f"{args.link_gbps:g} GB/s per rank (assumed), expert {args.hidden}x{args.inter}")
    print(f"{'placement':10s} {'max/min mean':>13s} {'max/min worst':>14s} {'replica mem':>12s} "
          f"{'layer ms (est)':>15s}")
    for name, r in results.items():
        print(f"{name:10s} {r['max_min_mean']:13.3f} {r['max_min_worst']:14.3f} "
              f"{r['replica_memory_share'] * 100:11.1f}% {r['layer_ms_est']:15.2f}")
    met = {
        "eplb_le_1.10": results["eplb"]["max_min_mean"] <= 1.10,
        "replica_memory_le_15pct": results["eplb"]["replica_memory_share"] <= 0.15,
        "static_between": results["eplb"]["max_min_mean"] <= results["static"]["max_min_mean"]
        <= results["naive"]["max_min_mean"],
    }
    print("targets: " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in met.items()))
    print(json.dumps({"config": vars(args), "grouped_gemm_gflops": round(gflops, 1), "results": results,
                      "targets_met": met}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
