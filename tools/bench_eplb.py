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

Then a real run in this process (--real-run-ranks, 0 to skip): a small random DeepSeek-V3
(rtp's model, 64 routed experts, top-6 in 4 of 8 groups, 3 MoE layers) whose
e_score_correction_bias is skewed Zipf-like per layer, so some experts run hot. Random
prompts go through the real runtime (scheduler, paged MLA cache, FusedMoE) twice: the
first window's per-expert load counters make the plans, the second window's counters
judge them (per-rank loads with each expert's tokens split evenly over its copies, as the
dispatch deals them). The EPLB plan is then applied with FusedMoE.place (replicas in the
layers' spare slots) and the second window rerun: its logits must equal the identity
placement's bit for bit (fp32).

Then a serving run (--serve-prompts, 0 to skip): the same shape of model, built with
transformers (DeepseekV3ForCausalLM, the same skewed correction bias) and saved as a
checkpoint, served by rtp's engine (LLM, fp32) with --enable-eplb: a rebalance every
--serve-interval steps from the last --serve-window steps' counters, moved between steps.
It reports each rebalance (the current placement's max/min rank load on the window just
served, which for every rebalance but the first is the placement the previous one made, and
the new plan's on the same window), the time moving weights, and whether the greedy tokens
equal a run with EPLB off.

Output: a table, then as the LAST line one JSON object with the same figures.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import _common  # noqa: F401 - this checkout's rtp first on sys.path
from rtp.engine.eplb import (
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


def real_run(args) -> dict:
    """The small DeepSeek-V3 of the module docstring, through rtp's runtime; see there."""
    import msgspec
    import torch

    from rtp.config import ModelConfig
    from rtp.engine.runner import ModelRunner
    from rtp.models import model_class
    from rtp.models.moe import FusedMoE
    from rtp.runtime import BlockAllocator, Scheduler

    ranks, experts, vocab = args.real_run_ranks, 64, 512
    hf = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": vocab, "hidden_size": 256,
          "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": experts,
          "num_experts_per_tok": 6, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 1,
          "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "kv_lora_rank": 64,
          "q_lora_rank": 96, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
          "max_position_embeddings": 512, "rms_norm_eps": 1e-6}
    extra = replica_slots(experts, ranks, share=args.replica_share)
    config = msgspec.structs.replace(ModelConfig.from_hf(hf), num_redundant_experts=extra)
    torch.manual_seed(args.seed)
    model = model_class(hf["architectures"])(config).eval()
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                # Zipf-like popularity in a random expert order per layer: log-popularity as bias
                rank = torch.randperm(experts).float() + 1
                param.copy_(-args.bias_skew * torch.log(rank))
            elif param.dim() == 1:
                param.fill_(1.0)
            else:
                param.normal_(0, 0.05)
    block_size, prompts, prompt_len, new = 16, args.real_run_prompts, 64, 4
    blocks = prompts * -(-(prompt_len + new) // block_size) + 1
    runner = ModelRunner(model, num_blocks=blocks, block_size=block_size, max_num_seqs=prompts,
                         max_num_batched_tokens=1024, max_model_len=prompt_len + new,
                         kv_dtype=torch.float32, device=torch.device("cpu"))
    rng = np.random.default_rng(args.seed)
    windows = [rng.integers(1, vocab, (prompts, prompt_len)) for _ in range(2)]

    def run(window: np.ndarray) -> tuple[np.ndarray, list]:
        """Greedy decode of the window's prompts; (per-layer expert load, every step's logits)."""
        for layer in layers:
            layer.expert_load.zero_()
        alloc = BlockAllocator(blocks, block_size)
        sched = Scheduler(alloc, runner.plan, max_num_seqs=prompts, max_num_batched_tokens=1024,
                          max_model_len=prompt_len + new)
        for i, prompt in enumerate(window):
            sched.add_request(i, prompt.astype(np.int32), max_tokens=new, ignore_eos=True)
        seen = []
        while sched.has_unfinished:
            sched.schedule()
            logits = runner.forward()
            seen.append(logits.clone())
            sched.update(logits.argmax(dim=-1).numpy().astype(np.int64))
        return torch.stack([layer.expert_load for layer in layers]).numpy().copy(), seen

    start = time.perf_counter()
    window_load, _ = run(windows[0])
    judged_load, before = run(windows[1])
    plans = {
        "naive": naive_placement(len(layers), experts, ranks),
        "static": static_placement(window_load, ranks),
        "eplb": eplb_placement(window_load, ranks, extra),
    }
    for layer, slots in zip(layers, plans["eplb"].slots):
        layer.place(slots.reshape(-1).tolist())
    placed_load, after = run(windows[1])
    unchanged = (np.array_equal(placed_load, judged_load) and len(before) == len(after)
                 and all(torch.equal(a, b) for a, b in zip(before, after)))
    sorted_load = np.sort(judged_load, axis=1)[:, ::-1]
    results = {}
    for name, plan in plans.items():
        ratio = imbalance(plan.rank_loads(judged_load))
        results[name] = {"max_min_mean": round(float(ratio.mean()), 4), "max_min_worst": round(float(ratio.max()), 4),
                         "replica_memory_share": round((plan.slots.shape[2] * ranks - experts) / experts, 4)}
    return {"ranks": ranks, "experts": experts, "moe_layers": len(layers), "replica_slots": extra,
            "tokens_per_window": int(judged_load[0].sum() // hf["num_experts_per_tok"]),
            "hottest_over_median": round(float((sorted_load[:, 0] / np.maximum(sorted_load[:, experts // 2], 1)).mean()), 2),
            "results": results, "eplb_output_unchanged": bool(unchanged),
            "seconds": round(time.perf_counter() - start, 1)}


def serve_run(args) -> dict:
    """The serving run of the module docstring."""
    import tempfile

    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    from rtp import LLM, SamplingParams

    experts, vocab = 64, 512
    config = transformers.DeepseekV3Config(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=experts, num_experts_per_tok=6, n_group=8,
        topk_group=4, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        max_position_embeddings=512, rms_norm_eps=1e-6)
    torch.manual_seed(args.seed)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("e_score_correction_bias"):  # as in real_run: Zipf-like popularity per layer
                param.copy_(-args.bias_skew * torch.log(torch.randperm(experts).float() + 1))
            elif param.dim() > 1:
                param.normal_(0, 0.05)
    rng = np.random.default_rng(args.seed + 7)
    prompts = [rng.integers(1, vocab, 64).tolist() for _ in range(args.serve_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.serve_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.save(f"{tmp}/tokenizer.json")
        # a cache twice what the requests use: KV pressure (which drops the replicas) stays off
        kw = {"model": tmp, "dtype": "float32", "compile": False, "max_model_len": 2 * (64 + args.serve_tokens),
              "max_num_seqs": args.serve_prompts, "enable_prefix_caching": False}
        off = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, params, use_tqdm=False)]
        llm = LLM(**kw, enable_eplb=True, eplb_step_interval=args.serve_interval,
                  eplb_window_size=args.serve_window, eplb_num_ranks=args.real_run_ranks or 8)
        start = time.perf_counter()
        on = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        seconds = time.perf_counter() - start
    b = llm.engine.balancer
    return {"ranks": b.num_ranks, "experts": experts, "moe_layers": len(b.layers), "replica_slots": b.spare,
            "interval": args.serve_interval, "window": args.serve_window, "steps": b.steps,
            "rebalances": [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
                           for r in b.history],
            "move_ms_total": round(b.move_seconds * 1e3, 1), "generate_s": round(seconds, 1),
            "tokens_equal_eplb_off": on == off}


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
    p.add_argument("--real-run-ranks", type=int, default=8,
                   help="EP ranks of the real small-model run (0: skip it; default 8)")
    p.add_argument("--real-run-prompts", type=int, default=16,
                   help="real run: prompts of 64 tokens per window, each decoding 4 more (default 16)")
    p.add_argument("--bias-skew", type=float, default=0.12,
                   help="real run: correction bias = -skew * log(popularity rank) (default 0.12)")
    p.add_argument("--serve-prompts", type=int, default=32,
                   help="serving run: prompts of 64 tokens served together with EPLB on (0: skip it; default 32)")
    p.add_argument("--serve-tokens", type=int, default=64, help="serving run: tokens each decodes (default 64)")
    p.add_argument("--serve-interval", type=int, default=16, help="serving run: steps between rebalances (default 16)")
    p.add_argument("--serve-window", type=int, default=16, help="serving run: window in steps (default 16)")
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
    real = real_run(args) if args.real_run_ranks else None
    if real is not None:
        print(f"\nreal run: random DeepSeek-V3, {real['moe_layers']} MoE layers x {real['experts']} experts over "
              f"{real['ranks']} EP ranks, skewed router bias (hottest/median expert {real['hottest_over_median']:g}x), "
              f"{real['tokens_per_window']} tokens per window, {real['seconds']:g} s")
        print(f"{'placement':10s} {'max/min mean':>13s} {'max/min worst':>14s} {'replica mem':>12s}")
        for name, r in real["results"].items():
            print(f"{name:10s} {r['max_min_mean']:13.3f} {r['max_min_worst']:14.3f} "
                  f"{r['replica_memory_share'] * 100:11.1f}%")
        print(f"EPLB placement applied (FusedMoE.place): logits {'unchanged' if real['eplb_output_unchanged'] else 'CHANGED'}")
    serve = serve_run(args) if args.serve_prompts else None
    if serve is not None:
        print(f"\nserving run: rtp's engine with --enable-eplb, {serve['moe_layers']} MoE layers x "
              f"{serve['experts']} experts over {serve['ranks']} logical ranks, {serve['replica_slots']} replica "
              f"slots, a rebalance every {serve['interval']} steps from the last {serve['window']}")
        print(f"{'step':>5s} {'layers moved':>13s} {'slots rewritten':>16s} {'max/min mean: current':>22s} "
              f"{'-> plan':>8s} {'worst: current':>15s} {'-> plan':>8s} {'move ms':>8s}")
        for r in serve["rebalances"]:
            print(f"{r['step']:5d} {r['layers_moved']:13d} {r['slots_rewritten']:16d} {r['before_mean']:22.3f} "
                  f"{r['after_mean']:8.3f} {r['before_max']:15.3f} {r['after_max']:8.3f} {r['ms']:8.1f}")
        print(f"greedy tokens {'equal' if serve['tokens_equal_eplb_off'] else 'DIFFER FROM'} EPLB off; "
              f"{serve['move_ms_total']:g} ms moving weights in {serve['generate_s']:g} s of generation")
    print(json.dumps({"config": vars(args), "grouped_gemm_gflops": round(gflops, 1), "results": results,
                      "targets_met": met, "real_run": real, "serve_run": serve}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
