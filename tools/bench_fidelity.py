#!/usr/bin/env python3
"""How faithful is rtp's bf16 to the fp32 reference, next to transformers' own bf16?

Small models have top-2 logit margins of a few bf16 steps, so bf16 greedy output
drifts from fp32 sooner or later. rtp keeps the residual stream, norms, softmax
and logits in fp32; this tool checks that its default dtype matches transformers'
fp32 greedy continuations at least as often as transformers' bf16 does.

For each prompt (chat questions through the template), greedy continuations from:
    reference   transformers, fp32 (the default GGUF dequantized)
    hf-bf16     transformers, bf16
    rtp-auto    rtp in its default dtype (bf16 on this CPU)
    rtp-fp32    rtp in fp32 (should equal the reference)
    rtp-int8kv  with --kv-cache-dtype int8: rtp in its default dtype over an int8 KV cache
    rtp-int8rows  with --activation-dtype int8: rtp in its default dtype, Q4_1 layers taking int8 rows
    rtp-int8prefill  with --activation-dtype int8-prefill: int8 rows for the prompts only, decode in bf16
and, against the reference: the share of prompts continued identically, and the
mean share of tokens produced before the first divergence.

    python tools/bench_fidelity.py              # 32 prompts x 48 tokens, a few minutes
    python tools/bench_fidelity.py --prompts 8 --tokens 16
    python tools/bench_fidelity.py --prompts 128 --tokens 32  # a wider sample: 96 templated prompts more
    python tools/bench_fidelity.py --prompts 288 --tokens 32  # the widest: 256 templated prompts
    python tools/bench_fidelity.py --kv-cache-dtype int8   # also rtp-auto over an int8 KV cache
    python tools/bench_fidelity.py --activation-dtype int8 # also rtp-auto with int8 rows into its linears
    python tools/bench_fidelity.py --activation-dtype int8 int8-prefill   # both, in one run
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import _common  # noqa: F401 - this checkout's rtp first on sys.path

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Name three primary colors.",
    "What is 12 times 7?", "Translate 'good morning' into Spanish.", "Give me one tip for learning to code.",
    "Who wrote Romeo and Juliet?", "Describe a cat in one sentence.", "Why is the sky blue?",
    "List two benefits of exercise.", "What does a compiler do?", "Explain photosynthesis simply.",
    "What is the boiling point of water?", "Suggest a name for a pet goldfish.",
    "How many legs does a spider have?", "What is the largest planet?", "Write a short greeting card message.",
    "What is machine learning?", "Give a synonym for 'happy'.", "How do airplanes fly?",
    "What is the square root of 81?", "Recommend a book for a long flight.", "What causes rain?",
    "Summarise the plot of Cinderella.", "What is an API?", "Write a limerick about a frog.",
    "Which ocean is the deepest?", "How do I boil an egg?", "What is the speed of light?",
    "Name a famous painter.", "What is a prime number?", "Tell me a fun fact about octopuses.",
]
# Past the 32 questions, a wider sample (a flip of 4 prompts in 32 is within the noise of a greedy-match
# count): each template over each topic, 96 more prompts.
TOPICS = [
    "volcanoes", "the Moon", "honey bees", "the Roman Empire", "electric cars", "coffee", "glaciers", "chess",
    "the human heart", "rainbows", "the internet", "penguins", "bread baking", "the Pacific Ocean", "earthquakes",
    "jazz music", "solar panels", "dinosaurs", "the printing press", "tides", "vaccines", "origami", "mountains",
    "libraries", "thunderstorms", "bicycles", "the Great Wall of China", "whales", "recycling", "telescopes",
    "gardening", "the Olympic Games",
]
TEMPLATES = ["Explain {} to a child in two sentences.", "Write a short poem about {}.", "List three facts about {}."]
# Wider still (a 2-prompt margin in 128 is within the noise too): 32 topics more, under the three templates
# and a fourth over all 64, appended so that the first 128 prompts stay as they were: 288 in all.
MORE_TOPICS = [
    "rivers", "the Eiffel Tower", "ants", "the Sahara", "trains", "tea", "deserts", "football", "the brain",
    "snowflakes", "smartphones", "owls", "cheese", "the Amazon rainforest", "hurricanes", "classical music",
    "wind turbines", "sharks", "the telephone", "comets", "antibiotics", "knitting", "caves", "museums",
    "fog", "skateboards", "the pyramids of Giza", "dolphins", "composting", "microscopes", "beekeeping",
    "the Tour de France",
]
FOURTH_TEMPLATE = "Give one surprising fact about {}."
PROMPTS = (QUESTIONS + [t.format(topic) for t in TEMPLATES for topic in TOPICS]
           + [t.format(topic) for t in TEMPLATES for topic in MORE_TOPICS]
           + [FOURTH_TEMPLATE.format(topic) for topic in TOPICS + MORE_TOPICS])


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def hf_greedy(model, prompts, tokens, eos):
    outs = []
    for i, ids in enumerate(prompts):
        print(f"\r  transformers {next(model.parameters()).dtype}: {i + 1}/{len(prompts)}", end="", file=sys.stderr)
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos[0])
        outs.append(out[0, len(ids):].tolist())
    print(file=sys.stderr)
    return outs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32,
                    help=f"how many chat prompts (at most {len(PROMPTS)}: 32 questions, then templated ones)")
    ap.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt")
    ap.add_argument("--compile", action="store_true", help="run rtp with its compiled decode graphs")
    ap.add_argument("--activation-dtype", choices=["int8", "int8-prefill"], nargs="+", default=[],
                    help="also run rtp-auto with each --activation-dtype named (rtp-int8rows, rtp-int8prefill)")
    ap.add_argument("--kv-cache-dtype", choices=["int8"], default=None,
                    help="also run rtp-auto over a KV cache of this dtype (rtp-int8kv), set beside rtp-auto")
    args = ap.parse_args(argv)

    import transformers

    from rtp import LLM, SamplingParams
    from rtp.checkpoint.default_model import default_model_path

    start = time.perf_counter()
    path = default_model_path()
    questions = PROMPTS[: args.prompts]
    params = SamplingParams(temperature=0, max_tokens=args.tokens)
    runs: dict[str, list[list[int]]] = {}
    rtp_runs = [("rtp-fp32", "float32", "auto", "auto"), ("rtp-auto", "auto", "auto", "auto")]
    if args.kv_cache_dtype:
        rtp_runs.append((f"rtp-{args.kv_cache_dtype}kv", "auto", args.kv_cache_dtype, "auto"))
    for act in args.activation_dtype:
        rtp_runs.append(({"int8": "rtp-int8rows", "int8-prefill": "rtp-int8prefill"}[act], "auto", "auto", act))
    for name, dtype, kv_dtype, act_dtype in rtp_runs:
        llm = LLM(model=str(path), dtype=dtype, compile=args.compile, max_num_seqs=8, max_model_len=1024,
                  kv_cache_dtype=kv_dtype, activation_dtype=act_dtype)
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True)
                   for q in questions]
        eos = llm.engine.eos_token_ids
        runs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if name == "rtp-auto":
            resolved = str(llm.engine.dtype).removeprefix("torch.")
        del llm
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    runs["reference"] = hf_greedy(hf, prompts, args.tokens, eos)
    runs["hf-bf16"] = hf_greedy(hf.to(torch.bfloat16), prompts, args.tokens, eos)

    ref = runs["reference"]
    figures = {}
    print(f"greedy fidelity against transformers fp32: {len(questions)} chat prompts x {args.tokens} tokens "
          f"(rtp-auto ran in {resolved}, compile={args.compile})")
    print(f"{'run':<12}{'identical':>12}{'tokens before divergence':>28}")
    for name in ("hf-bf16", "rtp-auto", *[r[0] for r in rtp_runs[2:]], "rtp-fp32"):
        same = sum(r == o for r, o in zip(ref, runs[name]))
        prefix = sum(common_prefix(r, o) / max(1, len(r)) for r, o in zip(ref, runs[name])) / len(ref)
        figures[name] = {"identical": same, "of": len(ref), "mean_prefix_share": round(prefix, 4)}
        print(f"{name:<12}{f'{same}/{len(ref)}':>12}{prefix:>27.1%}")
    for name, *_ in rtp_runs[2:]:  # the KV cache's / rows' dtype alone: against rtp-auto, the same model and dtype
        same = sum(a == o for a, o in zip(runs["rtp-auto"], runs[name]))
        prefix = sum(common_prefix(a, o) / max(1, len(a)) for a, o in zip(runs["rtp-auto"], runs[name])) / len(ref)
        figures[f"{name} vs rtp-auto"] = {"identical": same, "of": len(ref), "mean_prefix_share": round(prefix, 4)}
        print(f"{name} against rtp-auto (bf16 KV and rows): {same}/{len(ref)} identical, {prefix:.1%} of tokens before "
              f"divergence")
    ok = figures["rtp-auto"]["identical"] >= figures["hf-bf16"]["identical"]
    print(f"target: rtp-auto identical >= hf-bf16 identical: {'met' if ok else 'NOT met'} "
          f"({time.perf_counter() - start:.0f} s)")
    print(json.dumps({"fidelity": figures, "rtp_auto_dtype": resolved, "tokens": args.tokens,
                      "target_met": ok, "compile": args.compile}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
