#!/usr/bin/env python3
"""One request's Gemma 3 decode steps, replayed from CPU graphs against run eagerly (under a minute).

Saves a random Gemma 3 text model (transformers' Gemma3ForCausalLM, bf16 safetensors; by default
hidden 512, 8 layers with every 6th global, 4 query heads over 1 kv head of 128, GeGLU 2048 wide,
a 32768-token vocabulary) in a temporary directory, opens it with rtp's LLM in bf16 and generates
--new greedy tokens for one request, --repeats times with the CPU graphs the runner captured and
as often with every step eager (ModelRunner.eager()), in turn. Each engine step (schedule,
forward, sample, update) and each runner.forward inside it is timed; the figures are the medians
over the decode steps (the prompt's step left out), which a busy neighbour on the cores moves
less than a mean.

    python tools/bench_gemma_decode.py
    python tools/bench_gemma_decode.py --hidden 640 --layers 18 --vocab 262144

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

import _common  # noqa: F401 - this checkout's rtp first on sys.path
from rtp import LLM, SamplingParams


def save_model(path: Path, args) -> None:
    config = transformers.Gemma3TextConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
        query_pre_attn_scalar=128, sliding_window=512, max_position_embeddings=2048)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(args.vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


def decode_steps(llm: LLM, prompt: list[int], new: int) -> tuple[list[float], list[float]]:
    """Seconds of each decode step of one greedy request, and of the forward inside each."""
    engine, runner = llm.engine, llm.engine.runner
    steps: list[float] = []
    forwards: list[float] = []
    step, forward = engine.step, runner.forward

    def timed(fn, into):
        def call(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            into.append(time.perf_counter() - start)
            return out
        return call

    engine.step, runner.forward = timed(step, steps), timed(forward, forwards)
    try:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1 + new, ignore_eos=True), use_tqdm=False)
    finally:
        engine.step, runner.forward = step, forward
    return steps[1:], forwards[1:]  # the first step computes the prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new", type=int, default=64, help="decode steps timed")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        save_model(path, args)
        llm = LLM(model=str(path), dtype="bfloat16", max_model_len=1024, max_num_seqs=1, kv_cache_memory=1 << 27)
        runner = llm.engine.runner
        prompt = [(7 * i) % (args.vocab - 1) + 1 for i in range(args.prompt)]
        times = {"graph": ([], []), "eager": ([], [])}
        before = runner.graph_steps
        for _ in range(args.repeats):
            for mode, (steps, forwards) in times.items():
                with runner.eager() if mode == "eager" else nullcontext():
                    s, f = decode_steps(llm, prompt, args.new)
                steps += s
                forwards += f
        replayed = runner.graph_steps - before
    ms = {mode: (statistics.median(s) * 1e3, statistics.median(f) * 1e3) for mode, (s, f) in times.items()}
    (graph, graph_fwd), (eager, eager_fwd) = ms["graph"], ms["eager"]
    print(f"one request, decode steps after a {args.prompt}-token prompt (medians of {len(times['graph'][0])}): "
          f"CPU graph {graph:.2f} ms/step (forward {graph_fwd:.2f}), eager {eager:.2f} ms/step (forward "
          f"{eager_fwd:.2f}): {eager / graph:.2f}x a step, {eager_fwd / graph_fwd:.2f}x its forward")
    print(json.dumps({"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
                      "threads": torch.get_num_threads(), "graph_captured": runner.exact_graph is not None,
                      "graph_steps": replayed, "graph_ms_per_step": round(graph, 3),
                      "graph_forward_ms": round(graph_fwd, 3), "eager_ms_per_step": round(eager, 3),
                      "eager_forward_ms": round(eager_fwd, 3),
                      "speedup_step": round(eager / graph, 2), "speedup_forward": round(eager_fwd / graph_fwd, 2)}))


if __name__ == "__main__":
    main()
