#!/usr/bin/env python3
"""What dropping EPLB's replicas lends the KV cache, for one model shape (default
Qwen3-30B-A3B in bf16: 48 MoE layers of 128 experts, hidden 2048, expert intermediate
768, 4 KV heads of 128 in 48 attention layers, 8 spare slots per layer).

One real FusedMoE layer of that shape is built (its stacks are page-aligned anonymous
memory, rtp/kernels/hugepages.py), its spare slots are written (as replicas would be) and then
released as a KV-pressure rebalance releases them (FusedMoE.release). It prints the bytes
each slot gives back, the resident memory that went and the time it took, and the KV
blocks the pool is lent for all layers (lendable_kv_blocks, what the engine sizes the
cache's capacity by). Output: a table, then as the LAST line one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import _common  # noqa: F401 - this checkout's rtp first on sys.path
from rtp.engine.expert_balancer import lendable_kv_blocks
from rtp.engine.kv_cache import bytes_per_block
from rtp.models.attention import KVCacheSpec
from rtp.models.moe import FusedMoE

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=48, help="MoE layers (and attention layers)")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--spare", type=int, default=8, help="replica slots per MoE layer")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--moe-inter", type=int, default=768)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    args = p.parse_args()
    dtype = DTYPES[args.dtype]
    torch.set_default_dtype(dtype)
    layer = FusedMoE(args.experts, args.hidden, args.moe_inter, num_slots=args.experts + args.spare)
    spare = range(args.experts, args.experts + args.spare)
    for k in spare:  # replicas written: their pages are committed
        layer.w13.data[k].fill_(1)
        layer.w2.data[k].fill_(1)
    before = rss_bytes()
    start = time.perf_counter()
    released = sum(layer.release(k) for k in spare)
    seconds = time.perf_counter() - start
    rss_drop = before - rss_bytes()
    block = bytes_per_block([KVCacheSpec(2, args.kv_heads, args.head_dim)] * args.layers, args.block_size, dtype)
    lent = lendable_kv_blocks([layer] * args.layers, block)
    slot = (layer.w13.data[0].numel() + layer.w2.data[0].numel()) * layer.w13.element_size()
    figures = {"slot_bytes": slot, "slot_bytes_released": layer.releasable(args.experts),
               "layer_bytes_released": released, "layer_rss_drop_bytes": rss_drop,
               "layer_release_ms": seconds * 1e3, "kv_block_bytes": block, "kv_blocks_lent": lent,
               "kv_tokens_lent": lent * args.block_size}
    print(f"one slot: {slot / 2**20:.2f} MiB, {figures['slot_bytes_released'] / 2**20:.2f} MiB of whole pages")
    print(f"one layer's {args.spare} spare slots released: {released / 2**20:.1f} MiB, resident memory "
          f"{rss_drop / 2**20:.1f} MiB lower, {seconds * 1e3:.1f} ms")
    print(f"{args.layers} layers lend the KV pool {lent} blocks of {block / 2**20:.2f} MiB "
          f"({lent * args.block_size} tokens)")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
