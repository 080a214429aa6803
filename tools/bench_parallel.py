"""Expert-parallel overlap and tensor-parallel scaling on this host (gloo, 2 processes).

    python tools/bench_parallel.py                 # both parts
    python tools/bench_parallel.py --part ep       # one MoE layer: overlap and the all-to-all stall
    python tools/bench_parallel.py --part tp       # decode throughput, tp=1 against tp=2

EP overlap. One MoE layer at ep=2 (each rank one thread, half the expert slots), a
prefill-sized batch routed by a skewed router. For each placement (naive: contiguous
halves; EPLB: replicas of the hottest experts from the measured load, balanced over
the ranks) the layer runs with one synchronous exchange ("off") and with micro-chunks
whose all-to-all overlaps the expert GEMMs ("on"). Columns: the layer's time (median,
slowest rank), the "All-to-All Comm Stall" (the share of layer time a rank waits on
the exchange: counts, dispatch, combine, gather; a straggler's compute shows up here
as the other rank's wait), the share of the stall the overlap hides, 1 - stall(on) /
stall(off), and the layer time it saves as a share of the exchange's own time ("exchange
alone": the same exchange with no expert math). "on" chunks by expert range (each
expert's weights read once), "on-tokens" by token range (DeepEP's micro-batches).

TP scaling. Decode throughput of a random Llama (even head counts, so tp=2 splits
them) through rtp.LLM: tp=1 with both cores' threads, tp=2 with one thread per rank.

The last line is JSON with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

import _common  # noqa: F401 - this checkout's rtp first on sys.path
import rtp.distributed as dist
from rtp.engine.eplb import eplb_placement, naive_placement
from rtp.models.moe import FusedMoE, TopKRouter


def _routing(tokens: int, experts: int, top_k: int, hidden: int, skew: float, seed: int = 0):
    """Tokens, and router logits whose expert popularity follows a Zipf-like law (skew 0: uniform)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g) * 0.5
    bias = -skew * torch.log(torch.arange(1, experts + 1, dtype=torch.float32))
    bias = bias[torch.randperm(experts, generator=g)]
    logits = torch.randn(tokens, experts, generator=g) + bias
    weights, ids = TopKRouter(top_k, renormalize=True)(logits)
    return x, weights, ids


class _ExchangeOnly(FusedMoE):
    """The same exchange with no expert math (each row comes back as it went): its time is
    the exchange's own."""

    def grouped(self, x, row_source, group_end):
        return x.index_select(0, row_source)


def _ep_rank(rank: int, init: str, args, results) -> None:
    torch.set_num_threads(1)
    if args.pin and len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})  # one core each
    try:
        dist.init_parallel(tp=1, ep=2, rank=rank, backend="gloo", init_method=init, timeout_s=300)
        results.put((rank, _ep_measure(args), None))
    except Exception:  # noqa: BLE001 - reported by the parent
        results.put((rank, None, traceback.format_exc()))
    finally:
        dist.destroy_parallel()


def _ep_measure(args) -> dict:
    import torch.distributed as tdist

    dtype = getattr(torch, args.dtype)
    experts, spare = args.experts, args.replicas
    layer = FusedMoE(experts, args.hidden, args.inter, num_slots=experts + spare).to(dtype)
    bare = _ExchangeOnly(experts, args.hidden, args.inter, num_slots=experts + spare).to(dtype)
    bare.count_load = False
    torch.manual_seed(dist.ep_rank())
    with torch.no_grad():
        layer.w13.normal_(0, 0.02)
        layer.w2.normal_(0, 0.02)
    x, weights, ids = _routing(args.tokens, experts, args.top_k, args.hidden, args.skew)
    x = x.to(dtype)
    layer.count_load = False
    load = torch.bincount(ids.flatten(), minlength=experts).numpy()[None]
    naive = naive_placement(1, experts, 2).slots[0]  # contiguous halves; the spare slots left empty
    naive = np.concatenate([naive, np.full((2, spare // 2), -1)], axis=1)
    placements = {"naive": naive.reshape(-1).tolist(),
                  "eplb": eplb_placement(load, 2, spare).slots[0].reshape(-1).tolist()}
    modes = {"off": (layer, 1, False, "experts"), "on": (layer, args.chunks, True, "experts"),
             "on-tokens": (layer, args.chunks, True, "tokens"), "exchange": (bare, 1, False, "experts")}
    out = {}
    with torch.no_grad():
        for name, slots in placements.items():
            layer.place(slots)
            bare.place(slots)
            for mode, (module, chunks, overlap, split) in modes.items():
                exchange = module.exchange
                exchange.chunks, exchange.overlap, exchange.split, exchange.min_chunk_tokens = chunks, overlap, split, 8
                times, stalls = [], []
                for rep in range(args.warmup + args.reps):
                    tdist.barrier()
                    exchange.stall_s, exchange.timing = 0.0, True
                    start = time.perf_counter()
                    module(x, weights, ids)
                    elapsed = time.perf_counter() - start
                    if rep >= args.warmup:
                        times.append(elapsed)
                        stalls.append(exchange.stall_s)
                exchange.timing = False
                out[(name, mode)] = (times, stalls)
    return {f"{k[0]}/{k[1]}": v for k, v in out.items()}


def bench_ep(args) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rendezvous"
        procs = [ctx.Process(target=_ep_rank, args=(r, init, args, results)) for r in range(2)]
        for p in procs:
            p.start()
        got = sorted(results.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    errors = [e for *_, e in got if e]
    if errors:
        raise RuntimeError(errors[0])
    ranks = [r for _, r, _ in got]
    rows = []
    print(f"\nEP overlap: one MoE layer, {args.tokens} tokens, {args.experts} experts (+{args.replicas} replica "
          f"slots) top-{args.top_k}, hidden {args.hidden}, expert inter {args.inter}, {args.dtype}, "
          f"router skew {args.skew}, ep=2 (1 thread per rank), {args.chunks} micro-chunks when on")
    print(f"{'placement':<10}{'overlap':<11}{'layer ms':>10}{'All-to-All Comm Stall':>24}{'stall ms':>10}"
          f"{'hidden':>9}{'saved/exch':>12}")
    def best(key: str) -> tuple[float, float]:
        # per repetition the slowest rank ends the layer; the least disturbed repetition counts
        layer = np.max([r[key][0] for r in ranks], axis=0)
        stall = np.max([r[key][1] for r in ranks], axis=0)
        i = int(np.argmin(layer)) if args.best else int(np.argsort(layer)[len(layer) // 2])
        return float(layer[i]), float(stall[i])

    for name in ("naive", "eplb"):
        off, exposed = best(f"{name}/off")
        alone = best(f"{name}/exchange")[0]
        for mode in ("off", "on", "on-tokens"):
            layer_s, stall_s = best(f"{name}/{mode}")
            hidden = 1 - stall_s / exposed if mode != "off" else None
            saved = (off - layer_s) / alone if mode != "off" else None
            rows.append({"placement": name, "overlap": mode, "layer_ms": round(layer_s * 1e3, 2),
                         "stall_share": round(stall_s / layer_s, 4), "stall_ms": round(stall_s * 1e3, 2),
                         "hidden": None if hidden is None else round(hidden, 3),
                         "saved_over_exchange": None if saved is None else round(saved, 3),
                         "exchange_alone_ms": round(alone * 1e3, 2)})
            print(f"{name:<10}{mode:<11}{layer_s * 1e3:>10.1f}{100 * stall_s / layer_s:>23.1f}%"
                  f"{stall_s * 1e3:>10.1f}{'' if hidden is None else f'{100 * hidden:.0f} %':>9}"
                  f"{'' if saved is None else f'{100 * saved:.0f} %':>12}")
        print(f"{name:<10}{'exchange alone (no expert math)':<45}{alone * 1e3:>6.1f} ms")
    return {"ep_overlap": rows}


# -- tensor-parallel decode scaling ------------------------------------------------------

def _random_llama(path: Path, args) -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.tp_hidden, intermediate_size=args.tp_hidden * 11 // 4,
        num_hidden_layers=args.tp_layers, num_attention_heads=args.tp_heads, num_key_value_heads=args.tp_heads // 2,
        max_position_embeddings=2048, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(path)
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(args.vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


def _decode_throughput(path: Path, tp: int, threads: int, args) -> dict:
    from rtp import LLM, SamplingParams

    torch.set_num_threads(threads)  # rank 0's; tp=2 followers take cores // 2 each
    llm = LLM(model=str(path), dtype=args.tp_dtype, tensor_parallel_size=tp, max_model_len=512,
              max_num_seqs=args.batch, compile=False, enable_prefix_caching=False)
    try:
        rng = np.random.default_rng(0)
        params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
        llm.generate([rng.integers(1, args.vocab, 8).tolist() for _ in range(args.batch)],
                     SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm
        prompts = [rng.integers(1, args.vocab, 16).tolist() for _ in range(args.batch)]
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    finally:
        llm.engine.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tp": tp, "threads_per_rank": threads, "tokens": tokens,
            "seconds": round(elapsed, 3), "tokens_per_s": round(tokens / elapsed, 1)}


def bench_tp(args) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama"
        _random_llama(path, args)
        cores = os.cpu_count() or 1
        # tp=1 on every core, tp=1 on one core (a rank's share at tp=2), tp=2 with the cores split
        for tp, threads in ((1, cores), (1, max(1, cores // 2)), (2, max(1, cores // 2))):
            rows.append(_decode_throughput(path, tp, threads, args))
    params_m = (args.tp_layers * (4 * args.tp_hidden ** 2 * 3 // 4 + 3 * args.tp_hidden * args.tp_hidden * 11 // 4)
                + 2 * args.vocab * args.tp_hidden) / 1e6
    print(f"\nTP scaling: decode of a random Llama ({params_m:.0f} M params, {args.tp_layers} layers, hidden "
          f"{args.tp_hidden}, {args.tp_heads} heads, {args.tp_dtype}), {args.batch} sequences x "
          f"{args.new_tokens} new tokens, {os.cpu_count()} cores")
    print(f"{'tp':<4}{'threads/rank':>14}{'tokens/s':>10}{'seconds':>9}")
    for r in rows:
        print(f"{r['tp']:<4}{r['threads_per_rank']:>14}{r['tokens_per_s']:>10.1f}{r['seconds']:>9.2f}")
    speedup = rows[2]["tokens_per_s"] / rows[0]["tokens_per_s"]
    print(f"tp=2 / tp=1 (all cores): {speedup:.2f}x")
    return {"tp_scaling": rows, "tp2_over_tp1": round(speedup, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["ep", "tp", "all"], default="all")
    p.add_argument("--tokens", type=int, default=1024, help="EP: tokens in the layer's batch")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--replicas", type=int, default=4, help="EP: spare slots for EPLB replicas (a multiple of 2)")
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=1408)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--skew", type=float, default=1.0, help="EP: Zipf exponent of expert popularity")
    p.add_argument("--chunks", type=int, default=4, help="EP: micro-chunks with overlap on")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=False,
                   help="EP: pin each rank to its own core (its gloo threads with it)")
    p.add_argument("--best", action=argparse.BooleanOptionalAction, default=True,
                   help="EP: report the fastest repetition (default; on a shared machine the others "
                        "measure the neighbours), else the median")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tp-hidden", type=int, default=1024)
    p.add_argument("--tp-heads", type=int, default=16)
    p.add_argument("--tp-layers", type=int, default=12)
    p.add_argument("--tp-dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=8, help="TP: sequences decoding together")
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()
    report = {}
    if args.part in ("ep", "all"):
        report.update(bench_ep(args))
    if args.part in ("tp", "all"):
        report.update(bench_tp(args))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
