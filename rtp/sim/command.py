"""`rtp simulate`: a cluster of prefill and decode workers, simulated with rtp's real routing and runtime.

For each trace (conversational with shared system prompts, long-context code,
bursty chat) it prints
  1. Table 1: throughput, P99 TTFT and P99 TBT of every routing policy,
     collocated and prefill/decode-disaggregated, on equal hardware;
  2. a sweep of FlexLB's beta, and auto-beta against the best fixed beta;
  3. P99 TTFT against load, collocated least-loaded vs P/D FlexLB;
then the targets and, last, one JSON line with every figure. `--scale` instead
times one run of 1,000 workers and 100,000 requests.

Workers run the real Scheduler, BlockAllocator and RadixCache; the master is
the real Router of `rtp route`; step times come from a roofline cost model
(--device h200/h100 from published FLOP/s and bandwidth, or this-cpu measured
here). The P/D split is sized from each trace's prefill and decode work.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

TRACES = ("conversational", "code", "bursty")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--traces", nargs="+", choices=TRACES, default=list(TRACES), help="workloads (default: all)")
    p.add_argument("--workers", type=int, default=None,
                   help="workers per cluster, collocated or P+D (default 16; 1000 with --scale)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per trace and seed (default 12000; 100000 with --scale)")
    p.add_argument("--seeds", type=int, default=6,
                   help="traces per run, seeds --seed, --seed+1, ...; percentiles pool them all (default 6: "
                        "one bursty trace's P99 is decided by its few worst bursts and moves by 2x between seeds)")
    p.add_argument("--load", type=float, default=1.0,
                   help="arrival rate as a share of the estimated cluster capacity (default 1.0)")
    p.add_argument("--device", default="h200", help="h200, h100 or this-cpu (measured here) (default h200)")
    p.add_argument("--model", default=None,
                   help="llama3-8b or smollm2-135m (default: llama3-8b on a GPU, smollm2-135m on this-cpu)")
    p.add_argument("--memory", type=float, default=None, metavar="BYTES",
                   help="device memory per worker (default: the device's; 1 GiB of KV on this-cpu)")
    p.add_argument("--skip", nargs="*", default=[], choices=["table", "beta", "load"], help="parts to leave out")
    p.add_argument("--jobs", type=int, default=None, help="simulations run in parallel (default: CPU count)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", metavar="DIR", help="write P99 TTFT vs beta and vs load as PNGs (needs matplotlib)")
    p.add_argument("--scale", action="store_true",
                   help="time one P/D FlexLB run of --workers 1000 --requests 100000 (overridable) instead")


def main(args: argparse.Namespace) -> int:
    from rtp.sim import experiments as ex

    try:
        device = ex.device_profile(args.device)
    except ValueError as e:
        print(f"rtp simulate: {e}", file=sys.stderr)
        return 2
    model = args.model or ("smollm2-135m" if device.name == "this-cpu" else "llama3-8b")
    if model not in ex.MODELS:
        print(f"rtp simulate: unknown model {model!r}; choose one of {', '.join(ex.MODELS)}", file=sys.stderr)
        return 2
    kv = ex.worker_kv_tokens(device, model, args.memory)
    say = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    if args.scale:
        return _scale(args, ex, device, model, kv, say)
    args.workers = args.workers or 16
    args.requests = args.requests or 12000

    report = {"device": device.name, "model": model, "workers": args.workers, "requests": args.requests,
              "load": args.load, "kv_tokens_per_worker": kv, "traces": {}}
    targets = {}
    t0 = time.perf_counter()
    for kind in args.traces:
        say(f"[{kind}] sizing: rate for load {args.load} and the P/D split ...")
        setup = ex.plan_setup(kind, requests=args.requests, workers=args.workers, load=args.load,
                              device=device, model=model, kv_tokens=kv, seed=args.seed)
        setup, splits = ex.best_split(setup, args.jobs, _progress(say), args.seeds)
        out = {"setup": ex.setup_dict(setup), "splits": splits}
        print(f"\n## {kind}: {args.workers} workers ({setup.prefill} prefill + "
              f"{args.workers - setup.prefill} decode for P/D), {args.seeds} x {args.requests} requests at "
              f"{setup.rate:.1f}/s, {device.name}, {model}\n")
        if "table" not in args.skip:
            rows = ex.run_all(ex.table_runs(setup), args.jobs, _progress(say), args.seeds)
            out["table"] = rows
            print(ex.fmt_table(rows, ("label", "throughput_tok_s", "p50_ttft_ms", "p99_ttft_ms", "p99_tbt_ms",
                                      "prefix_hit", "finished")))
            ll = next(r for r in rows if r["mode"] == "collocated" and r["policy"] == "least-loaded")
            fl = next(r for r in rows if r["mode"] == "pd" and r["policy"] == "flexlb" and r["beta"] == 0.65)
            targets[f"{kind}: P99 TTFT of P/D FlexLB against collocated least-loaded"] = \
                fl["p99_ttft_ms"] / ll["p99_ttft_ms"] - 1
        if "beta" not in args.skip:
            rows = ex.run_all(ex.beta_runs(setup), args.jobs, _progress(say), args.seeds)
            out["beta"] = rows
            print()
            print(ex.fmt_table(rows, ("label", "mean_beta", "throughput_tok_s", "p99_ttft_ms", "p99_tbt_ms",
                                      "prefix_hit")))
            fixed = [r for r in rows if r["beta"] != "auto"]
            best = min(fixed, key=lambda r: r["p99_ttft_ms"])
            auto = next(r for r in rows if r["beta"] == "auto")
            gap = auto["p99_ttft_ms"] / best["p99_ttft_ms"] - 1
            out["auto_vs_best"] = {"best_beta": best["beta"], "best_p99_ttft_ms": best["p99_ttft_ms"],
                                   "auto_p99_ttft_ms": auto["p99_ttft_ms"], "gap": round(gap, 4)}
            targets[f"{kind}: P99 TTFT of auto-beta against the best fixed beta ({best['beta']})"] = gap
        if "load" not in args.skip:
            rows = ex.run_all(ex.load_runs(setup), args.jobs, _progress(say), args.seeds)
            out["load"] = rows
            print()
            print(ex.fmt_table(rows, ("label", "rate", "throughput_tok_s", "p99_ttft_ms", "p99_tbt_ms")))
            # P/D FlexLB auto against collocated least-loaded at each load (rows come in pairs)
            out["load_ttft_change"] = {f"x{f}": round(pd["p99_ttft_ms"] / ll["p99_ttft_ms"] - 1, 4)
                                       for f, ll, pd in zip(ex.LOADS, rows[0::2], rows[1::2])}
            print("P99 TTFT change, P/D FlexLB auto against collocated least-loaded: " +
                  ", ".join(f"{k} {v:+.0%}" for k, v in out["load_ttft_change"].items()))
        report["traces"][kind] = out
        if args.plot:
            _plot(args.plot, kind, out, say)
    print("\n## targets")
    for name, value in targets.items():
        print(f"  {name}: {value:+.1%}")
    print("  (goals: P/D FlexLB at most -50 % on the conversational trace; auto-beta at most +5 % "
          "on every trace)")
    report["targets"] = {k: round(v, 4) for k, v in targets.items()}
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report))
    return 0


def _progress(say):
    return lambda row: say(f"  {row['label']}: {row['throughput_tok_s']:.0f} tok/s, "
                           f"P99 TTFT {row['p99_ttft_ms']:.0f} ms ({row['wall_s']:.0f} s)")


def _scale(args, ex, device, model, kv, say) -> int:
    workers = args.workers or 1000
    requests = args.requests or 100_000
    setup = ex.plan_setup("conversational", requests=requests, workers=workers, load=args.load,
                          device=device, model=model, kv_tokens=kv, seed=args.seed)
    say(f"simulating {workers} workers ({setup.prefill} prefill + {workers - setup.prefill} decode), "
        f"{requests} requests at {setup.rate:.0f}/s ...")
    t0 = time.perf_counter()
    row = ex.simulate(ex.Run(setup, "pd", "flexlb", 0.65))[0]
    wall = time.perf_counter() - t0
    print(ex.fmt_table([row], ("label", "throughput_tok_s", "p99_ttft_ms", "p99_tbt_ms", "prefix_hit",
                               "finished", "wall_s")))
    print(f"{workers} workers x {requests} requests simulated in {wall:.0f} s (goal: under 300 s)")
    print(json.dumps({"workers": workers, "requests": requests, "wall_s": round(wall, 1), **row}))
    return 0


def _plot(directory: str, kind: str, out: dict, say) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("--plot: matplotlib is not installed (pip install matplotlib); no plots written")
        return
    import os

    os.makedirs(directory, exist_ok=True)
    if "beta" in out:
        fixed = [r for r in out["beta"] if r["beta"] != "auto"]
        auto = next(r for r in out["beta"] if r["beta"] == "auto")
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["beta"] for r in fixed], [r["p99_ttft_ms"] for r in fixed], "o-", label="fixed beta")
        ax.axhline(auto["p99_ttft_ms"], color="C1", ls="--", label=f"auto (mean beta {auto['mean_beta']})")
        ax.set(xlabel="beta", ylabel="P99 TTFT (ms)", title=f"{kind}: P/D FlexLB", yscale="log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(directory, f"{kind}_ttft_vs_beta.png"), dpi=120)
        plt.close(fig)
    if "load" in out:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name in ("collocated least-loaded", "pd flexlb auto"):
            rows = [r for r in out["load"] if r["label"].endswith(name)]
            ax.plot([r["rate"] for r in rows], [r["p99_ttft_ms"] for r in rows], "o-", label=name)
        ax.set(xlabel="arrival rate (requests/s)", ylabel="P99 TTFT (ms)", title=f"{kind}", yscale="log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(directory, f"{kind}_ttft_vs_load.png"), dpi=120)
        plt.close(fig)
    say(f"plots for {kind} written to {directory}")
