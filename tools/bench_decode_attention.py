#!/usr/bin/env python3
"""rtp's decode attention kernel alone, over a model's worth of layers' KV caches.

tools/bench_decode_step.py times the kernel inside a replayed step, where the linears before it
leave the caches as a step does. This one calls rtp's paged decode attention on its own, layer
after layer over --layers separate caches (SmolLM2-135M's shape by default: 9 query heads, 3 kv
heads, head dim 64, 16-token blocks), with each request's blocks dealt at random from the pool as
a long-running server's allocator leaves them. Per shape it prints the median milliseconds per
layer and the GB/s of K and V read. With --layers 1 the caches of a small shape stay in L2 or L3
and the figure is the kernel's own work; by default each shape gets as many layers as take
MEMORY_MIB of caches (at least 30), so that they come from memory as in a step, where the weights
stream through L3 between layers: 30 layers of one row of 256 keys are 6 MB, which L3 holds, and
measured that row 2x faster than a replayed step does. Each call here also carries about 9 us of
Python dispatch that a replayed step (a CPU graph, calling from C) does not: shapes that take tens of
microseconds a layer read high by that much; tools/bench_decode_step.py times them inside the step.

The script prints a table, then (as the last line of stdout) one JSON object.

    python tools/bench_decode_attention.py                               # 64x256,16x2048,64x2048 rows x keys
    python tools/bench_decode_attention.py --shapes 16x512 --layers 1 --repeats 50 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import _common  # noqa: F401 - this checkout's rtp first on sys.path
from rtp.kernels import cpu_kernels

MEMORY_MIB = 128  # the caches a shape's default layers add up to: four times the L3 of the VMs this ran on


def bench_shape(rows: int, keys: int, args, gen: torch.Generator) -> dict:
    blocks = rows * (-(-keys // args.block_size))
    layer_bytes = 2 * (blocks + 1) * args.block_size * args.kv_heads * args.head_dim * 2
    layers = args.layers or max(30, -(-(MEMORY_MIB << 20) // layer_bytes))
    caches = [torch.randn(2, blocks + 1, args.block_size, args.kv_heads, args.head_dim, generator=gen).bfloat16()
              for _ in range(layers)]
    tables = (torch.randperm(blocks, generator=gen) + 1).view(rows, -1).to(torch.int32).contiguous()
    lens = torch.full((rows,), keys, dtype=torch.int32)
    q = torch.randn(rows, args.heads, args.head_dim, generator=gen).bfloat16()
    out = torch.empty_like(q)
    times = []
    for _ in range(args.repeats + 1):  # the first pass warms the threads and pages
        start = time.perf_counter()
        for kv in caches:
            cpu_kernels.paged_decode_attention_into(q, kv[0], kv[1], tables, lens, args.head_dim ** -0.5, 0, out)
        times.append((time.perf_counter() - start) / layers)
    ms = statistics.median(times[1:]) * 1e3
    kv_bytes = rows * keys * args.kv_heads * args.head_dim * 2 * 2
    return {"rows": rows, "keys": keys, "layers": layers, "ms_per_layer": round(ms, 4),
            "min_ms": round(min(times[1:]) * 1e3, 4), "kv_gb_per_s": round(kv_bytes / ms / 1e6, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shapes", default="64x256,16x2048,64x2048", help="ROWSxKEYS, comma separated")
    ap.add_argument("--layers", type=int, default=None,
                    help=f"separate caches attended in turn (default: {MEMORY_MIB} MiB of them, at least 30)")
    ap.add_argument("--repeats", type=int, default=5, help="timed passes over every layer (default 5)")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("rtp's CPU kernels are not available on this machine")
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    results = []
    print(f"decode attention, {args.heads} heads / {args.kv_heads} kv heads x {args.head_dim}, "
          f"{args.layers or 'default'} layers, {torch.get_num_threads()} threads")
    print(f"{'rows':>5} {'keys':>6} {'layers':>6} {'ms/layer':>9} {'min':>8} {'KV GB/s':>8}")
    for shape in args.shapes.split(","):
        rows, keys = (int(v) for v in shape.lower().split("x"))
        r = bench_shape(rows, keys, args, gen)
        results.append(r)
        print(f"{rows:>5} {keys:>6} {r['layers']:>6} {r['ms_per_layer']:>9.3f} {r['min_ms']:>8.3f} "
              f"{r['kv_gb_per_s']:>8.1f}", flush=True)
    print(json.dumps({"decode_attention": results, "layers": args.layers, "threads": torch.get_num_threads(),
                      "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim}))


if __name__ == "__main__":
    main()
