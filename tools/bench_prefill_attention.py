#!/usr/bin/env python3
"""Prefill attention, old path against new, side by side on this CPU.

old   what PagedAttention ran before rtp's prefill kernel, and still runs with
      RTP_PREFILL_ATTENTION=0: per chunk, gather its blocks, then torch's
      scaled_dot_product_attention (its CPU flash kernel), then one concatenation;
new   rtp/kernels/csrc/prefill_attention.c: every chunk in one call, blocks read in place,
      AMX tiles for Q K^T and P V (--no-amx: its AVX-512 BF16 loops).

For each token count, two layouts of a step: one prompt of that many tokens, and
prompts of --chunk tokens packed into one step (the offline workload's prompts
are 32-512 tokens, so its prefill steps look like the second). Default shapes:
SmolLM2-135M's attention (9 query heads, 3 kv heads, head_dim 64), bf16, 16-token
blocks scattered over the cache. Old and new alternate within each repeat, so
machine load hits both alike; the figures are medians. Other processes' CPU time
during the run is reported: this machine's 2 cores are shared.

The script prints a table, then (as the last line of stdout) one JSON object.

    python tools/bench_prefill_attention.py                      # 512, 2048, 4096 tokens
    python tools/bench_prefill_attention.py --tokens 2048 --repeats 15 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from _common import CpuWatch
from rtp.kernels import cpu_kernels
from rtp.models.attention import AttentionMetadata, PrefillRow, prefill_attention


def make_step(tokens: int, chunk: int, heads: int, kv_heads: int, dim: int, block_size: int, seed: int):
    """q, a paged cache holding every prompt's K/V, the rows as PagedAttention sees them, and the
    kernel's plan arrays (AttentionMetadata.prefill_kernel_args)."""
    g = torch.Generator().manual_seed(seed)
    lens = [chunk] * (tokens // chunk) + ([tokens % chunk] if tokens % chunk else [])
    blocks = sum(-(-n // block_size) for n in lens) + 1
    kv = torch.randn(2, blocks, block_size, kv_heads, dim, generator=g).bfloat16()
    order = (torch.randperm(blocks - 1, generator=g) + 1).to(torch.int32)
    q = torch.randn(tokens, heads, dim, generator=g).bfloat16()
    rows, start, used = [], 0, 0
    for n in lens:
        width = -(-n // block_size)
        rows.append(PrefillRow(start, start + n, n, order[used:used + width]))
        start, used = start + n, used + width
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), block_size=block_size, prefill=rows)
    return q, kv, rows, meta.prefill_kernel_args()


def run_case(tokens: int, chunk: int, args) -> dict:
    q, kv, rows, plan = make_step(tokens, chunk, args.heads, args.kv_heads, args.head_dim,
                                          args.block_size, args.seed)
    scale = args.head_dim**-0.5

    def old():
        return torch.cat([prefill_attention(q[r.query_start:r.query_end], kv[0], kv[1], r, scale, None,
                                            args.softcap or None) for r in rows])

    def new():
        return cpu_kernels.prefill_attention(q, kv[0], kv[1], *plan, scale, 0, amx=args.amx, softcap=args.softcap)

    diff = (old().float() - new().float()).abs().max().item()  # also the warm-up
    times = {"old": [], "new": []}
    for i in range(args.repeats):
        for name in (("old", "new") if i % 2 == 0 else ("new", "old")):
            fn = old if name == "old" else new
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    lens = [r.query_end - r.query_start for r in rows]
    flop = sum(4 * args.head_dim * args.heads * n * (n + 1) / 2 for n in lens)  # causal: half the scores
    old_s, new_s = statistics.median(times["old"]), statistics.median(times["new"])
    return {"tokens": tokens, "prompts": len(lens), "prompt_len": chunk if tokens >= chunk else tokens,
            "old_ms": round(old_s * 1e3, 3), "new_ms": round(new_s * 1e3, 3),
            "old_gflops": round(flop / old_s / 1e9, 1), "new_gflops": round(flop / new_s / 1e9, 1),
            "speedup": round(old_s / new_s, 2), "max_abs_diff": round(diff, 4)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="512,2048,4096", help="comma-separated token counts per step")
    p.add_argument("--chunk", type=int, default=256, help="prompt length of the packed layout (0: skip it)")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=0, help="torch / OpenMP threads (0: torch's default)")
    p.add_argument("--no-amx", dest="amx", action="store_false", help="the kernel's AVX-512 BF16 loops")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--softcap", type=float, default=0.0, help="attention logit softcapping (Gemma 2: 50; 0: none)")
    args = p.parse_args(argv)
    if not cpu_kernels.prefill_attention_supported(torch.empty(1, args.heads, args.head_dim, dtype=torch.bfloat16),
                                                   torch.empty(1, 1, args.kv_heads, args.head_dim,
                                                               dtype=torch.bfloat16)):
        print("rtp's prefill kernel is not available here (needs AVX-512 BF16; RTP_PREFILL_ATTENTION=0?)",
              file=sys.stderr)
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        cases.append((tokens, tokens))
        if 0 < args.chunk < tokens:
            cases.append((tokens, args.chunk))
    wall0 = time.perf_counter()
    results = []
    with CpuWatch() as cpu:
        for tokens, chunk in cases:
            print(f"{tokens} tokens as prompts of {chunk} ...", file=sys.stderr)
            results.append(run_case(tokens, chunk, args))
    wall = time.perf_counter() - wall0
    others = cpu.other_s or 0.0
    amx = args.amx and cpu_kernels.amx_available()
    print(f"Prefill attention, bf16, {args.heads} heads / {args.kv_heads} kv heads, head_dim {args.head_dim}, "
          f"{torch.get_num_threads()} threads, kernel on {'AMX tiles' if amx else 'AVX-512 BF16'}; "
          f"medians of {args.repeats}, old and new alternating")
    print(f"{'tokens':>7} {'prompts':>8} {'old ms':>9} {'new ms':>9} {'old GF/s':>9} {'new GF/s':>9} "
          f"{'speedup':>8} {'max |diff|':>10}")
    for r in results:
        print(f"{r['tokens']:>7} {str(r['prompts']) + ' x ' + str(r['prompt_len']):>8} {r['old_ms']:>9.2f} "
              f"{r['new_ms']:>9.2f} {r['old_gflops']:>9.0f} {r['new_gflops']:>9.0f} {r['speedup']:>7.2f}x "
              f"{r['max_abs_diff']:>10.4f}")
    print(f"other processes' CPU time during the run: {others:.1f} s of {wall:.1f} s wall")
    print(json.dumps({"threads": torch.get_num_threads(), "amx": amx, "cases": results,
                      "others_cpu_s": round(others, 1), "wall_s": round(wall, 1)}, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
