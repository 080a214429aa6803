#!/usr/bin/env python3
"""Checks rtp's CUDA paths on a GPU and records figures: one prepared run, each part on its own.

What it checks (each section reports, and a failure is recorded and the next one runs):

  fidelity   rtp fp32 eager on CUDA against transformers fp32 on CUDA (TF32 off): greedy
             continuations of 8 prompts of different lengths, batched; tokens equal, and
             rtp's prefill logits of one prompt against transformers' (max abs diff).
  graphs     rtp bf16 with CUDA graphs (torch.compile mode="reduce-overhead", one graph per
             batch bucket) against rtp bf16 eager: the same greedy tokens, the warm-up time,
             and how many steps ran through a captured graph.
  offline    the offline workload of tools/bench_offline.py (prompts 32-512, outputs 16-256,
             greedy, eos ignored) through rtp bf16 with graphs and eager, and transformers'
             `generate` at static batch sizes 32 and 64 (sorted, left padded): gen tok/s.
  single     one request, 32-token prompt, 256 new tokens: decode ms/step with graphs and eager.

The model is SmolLM2-135M's architecture (config.json and tokenizer of the default model,
`--assets`) with random weights (seeded), since the 98 MB GGUF does not travel to a lent GPU
machine; speed does not depend on the weights' values. Output: a table on stdout, and as the
LAST line one JSON object with every figure; `--out DIR` also writes cuda_check.json there.

    python tools/cuda_check.py --assets .cuda_assets --out /tmp/out
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback

import torch

import _common  # noqa: F401 - this checkout's rtp first on sys.path

RESULTS: dict = {}
MODES = [("rtp_graphs", True), ("rtp_eager", False)]
DEVICE = "cuda"  # --device cpu: a dry run of the script itself, where no GPU is


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def log(msg: str) -> None:
    print(f"[cuda_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def section(name: str):
    def wrap(fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            log(f"{name} ...")
            try:
                RESULTS[name] = fn(*args, **kwargs)
            except Exception as exc:  # one broken path must not hide the others' figures
                RESULTS[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
                log(f"{name} FAILED: {exc}")
            RESULTS[name]["seconds"] = round(time.perf_counter() - start, 1)
            log(f"{name} done in {RESULTS[name]['seconds']} s: "
                + json.dumps({k: v for k, v in RESULTS[name].items() if k != 'traceback'})[:600])
        return run
    return wrap


def make_model(assets: str, dst: str) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    for name in os.listdir(assets):
        shutil.copy(os.path.join(assets, name), dst)
    config = AutoConfig.from_pretrained(dst)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(dst, safe_serialization=True)
    return dst


def workload(vocab: int, n: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int], seed: int):
    import random

    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(n):
        prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_lens))])
        outs.append(rng.randint(*output_lens))
    return prompts, outs


_LLMS: dict = {}


def rtp_llm(model_dir: str, dtype: str, compile: bool):
    """One engine per (dtype, compile), kept for every section: each compile costs minutes."""
    import rtp

    key = (dtype, compile)
    if key not in _LLMS:
        start = time.perf_counter()
        _LLMS[key] = rtp.LLM(model=model_dir, dtype=dtype, device=DEVICE, compile=compile, max_model_len=1024,
                             kv_cache_memory=4 << 30)
        _LLMS[key].startup_seconds = time.perf_counter() - start
    return _LLMS[key]


def rtp_generate(llm, prompts, max_tokens):
    import rtp

    params = [rtp.SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def free() -> None:
    import gc

    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def hf_greedy(model, prompts, max_new: int, pad: int) -> list[list[int]]:
    """Left-padded batched greedy generate; the new tokens of each prompt."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = model.generate(input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE), max_new_tokens=max_new,
                         min_new_tokens=max_new, do_sample=False, pad_token_id=pad)
    return out[:, width:].tolist()


@section("env")
def env():
    if DEVICE != "cuda":
        return {"torch": torch.__version__, "device": DEVICE}
    props = torch.cuda.get_device_properties(0)
    return {"torch": torch.__version__, "gpu": props.name, "sms": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1)}


@section("fidelity")
def fidelity(model_dir: str, vocab: int):
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    prompts, _ = workload(vocab, 8, (8, 200), (1, 1), seed=1)
    new = 32
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="sdpa").to(DEVICE)
    ref = hf_greedy(hf, prompts, new, pad=0)
    with torch.no_grad():
        hf_logits = hf(torch.tensor([prompts[0]]).to(DEVICE)).logits[0, -1].float()
    del hf
    free()
    llm = rtp_llm(model_dir, "float32", compile=False)
    got = rtp_generate(llm, prompts, [new] * len(prompts))
    import rtp

    lp = llm.generate([prompts[0]], rtp.SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)
    top = lp[0].outputs[0].logprobs[0]
    # compare log-softmax of the top-5 tokens rtp reports against transformers' log-softmax
    ref_lp = torch.log_softmax(hf_logits, -1)
    diffs = [abs(float(ref_lp[t]) - (v.logprob if hasattr(v, "logprob") else float(v))) for t, v in top.items()]
    same = sum(a == b for a, b in zip(got, ref))
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(got, ref)]
    return {"prompts": len(prompts), "new_tokens": new, "equal_sequences": same, "common_prefix": prefix,
            "top5_logprob_max_abs_diff": max(diffs)}


@section("graphs")
def graphs(model_dir: str, vocab: int):
    prompts, outs = workload(vocab, 24, (8, 300), (8, 64), seed=2)
    eager = rtp_llm(model_dir, "bfloat16", compile=False)
    ref = rtp_generate(eager, prompts, outs)
    llm = rtp_llm(model_dir, "bfloat16", compile=True)
    got = rtp_generate(llm, prompts, outs)
    runner = llm.engine.runner
    res = {"startup_s": round(llm.startup_seconds, 1), "warmup_s": round(llm.engine.warmup_seconds, 1),
           "buckets": sorted(runner.graphs), "graph_steps": runner.compiled_steps,
           "equal_sequences": sum(a == b for a, b in zip(got, ref)), "sequences": len(prompts)}
    return res


def timed_generate(llm, prompts, outs) -> float:
    sync()
    start = time.perf_counter()
    rtp_generate(llm, prompts, outs)
    sync()
    return time.perf_counter() - start


@section("offline")
def offline(model_dir: str, vocab: int, requests: int):
    from transformers import AutoModelForCausalLM

    prompts, outs = workload(vocab, requests, (32, 512), (16, 256), seed=0)
    total_gen = sum(outs)
    res = {"requests": requests, "generated_tokens": total_gen}
    for name, compile in MODES:
        llm = rtp_llm(model_dir, "bfloat16", compile=compile)
        rtp_generate(llm, [prompts[0][:16]], [4])  # lazy initialisation is not throughput
        wall = timed_generate(llm, prompts, outs)
        res[name] = {"wall_s": round(wall, 2), "gen_tok_s": round(total_gen / wall, 1)}
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16, attn_implementation="sdpa").to(DEVICE)
    order = sorted(range(requests), key=lambda i: len(prompts[i]))
    for b in (32, 64):
        sync()
        start = time.perf_counter()
        for i in range(0, requests, b):
            idx = order[i:i + b]
            hf_greedy(hf, [prompts[j] for j in idx], max(outs[j] for j in idx), pad=0)
        sync()
        wall = time.perf_counter() - start
        res[f"hf_generate_b{b}"] = {"wall_s": round(wall, 2), "gen_tok_s": round(total_gen / wall, 1)}
    del hf
    free()
    best_hf = max(res[f"hf_generate_b{b}"]["gen_tok_s"] for b in (32, 64))
    for name, _ in MODES:
        res[f"{name}_vs_hf"] = round(res[name]["gen_tok_s"] / best_hf, 2)
    return res


@section("single")
def single(model_dir: str, vocab: int):
    prompts, _ = workload(vocab, 1, (32, 32), (1, 1), seed=3)
    res = {}
    for name, compile in MODES:
        llm = rtp_llm(model_dir, "bfloat16", compile=compile)
        rtp_generate(llm, prompts, [8])
        first = timed_generate(llm, prompts, [1])
        wall = timed_generate(llm, prompts, [256])
        step_ms = (wall - first) / 255 * 1000
        res[name] = {"ms_per_step": round(step_ms, 2), "tok_s": round(1000 / step_ms, 1)}
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--assets", default=".cuda_assets", help="config.json + tokenizer files of the model shape")
    p.add_argument("--out", help="directory to write cuda_check.json into")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--only", help="comma-separated sections to run (env always runs)")
    p.add_argument("--device", default="cuda", help="cuda; cpu only to dry-run this script")
    p.add_argument("--no-graphs", action="store_true", help="skip the compiled (CUDA graph) runs")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    if args.no_graphs:
        MODES.pop(0)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("cuda_check: no CUDA device")
    only = set(args.only.split(",")) if args.only else None
    env()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(args.assets, tmp)
        vocab = json.load(open(os.path.join(tmp, "config.json")))["vocab_size"]
        if not only or "fidelity" in only:
            fidelity(model_dir, vocab)
        if not only or "graphs" in only:
            graphs(model_dir, vocab)
        if not only or "single" in only:
            single(model_dir, vocab)
        if not only or "offline" in only:
            offline(model_dir, vocab, args.requests)
    for name, r in RESULTS.items():
        print(f"{name:10s} " + json.dumps({k: v for k, v in r.items() if k != "traceback"}))
    line = json.dumps(RESULTS)
    if args.out:
        with open(os.path.join(args.out, "cuda_check.json"), "w") as f:
            f.write(line)
    print(line)


if __name__ == "__main__":
    main()
