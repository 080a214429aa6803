#!/usr/bin/env python3
"""Speculative decoding (n-gram / prompt lookup, or a draft model) against plain decoding, side by side.

Three workloads, each a set of chat requests to the default model (greedy, up to --max-tokens):
  summarise  summarise or quote a given text: the answer copies long runs of the prompt;
  code       edit a given function and return it whole: the answer repeats most of it;
  chat       open questions: little to copy, where drafting should cost nothing.
Each runs as one stream (the requests one after another) and as --streams streams (that many
at once), on two engines built in the same run: a plain one and one with --speculative ngram (or,
with --speculative-model, that draft model).
For each it prints tok/s of both and their ratio, the drafted tokens the model kept (acceptance
rate), the tokens a verifying step emitted on average (kept drafts + the model's own), and
whether every request's greedy output was identical (it must be). With --llama-lookup, llama.cpp's
lookup decoding (its llama-lookup binary, the same GGUF, the same chat-formatted prompts, greedy,
both cores) runs each single-stream workload with and without drafts too. The table, then (last
line of stdout) one JSON object.

    python tools/bench_speculative.py
    python tools/bench_speculative.py --num-speculative-tokens 6 --streams 8 --max-tokens 256
    python tools/bench_speculative.py --llama-lookup PATH/TO/llama.cpp/build/bin/llama-lookup
    python tools/bench_speculative.py --model BF16_DIR --speculative-model DEFAULT.gguf --streams 1
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
import time

from _common import CpuWatch, note

TEXTS = [
    "The Amazon rainforest covers much of the Amazon basin of South America. This basin encompasses seven "
    "million square kilometres, of which five and a half million square kilometres are covered by the "
    "rainforest. The region includes territory belonging to nine nations and 3,344 formally acknowledged "
    "indigenous territories. The majority of the forest, 60%, is in Brazil, followed by Peru with 13%, "
    "Colombia with 10%, and with minor amounts in Bolivia, Ecuador, French Guiana, Guyana, Suriname, and "
    "Venezuela.",
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 individual reefs "
    "and 900 islands stretching for over 2,300 kilometres over an area of approximately 344,400 square "
    "kilometres. The reef is located in the Coral Sea, off the coast of Queensland, Australia. It can be "
    "seen from outer space and is the world's biggest single structure made by living organisms.",
    "Mount Everest is Earth's highest mountain above sea level, located in the Mahalangur Himal sub-range of "
    "the Himalayas. The China-Nepal border runs across its summit point. Its elevation of 8,848.86 metres was "
    "most recently established in 2020 by the Chinese and Nepali authorities. Mount Everest attracts many "
    "climbers, including highly experienced mountaineers.",
    "The Sahara is a desert spanning North Africa. With an area of 9,200,000 square kilometres, it is the "
    "largest hot desert in the world and the third-largest desert overall, smaller only than the deserts of "
    "Antarctica and the northern Arctic. The name Sahara is derived from the Arabic word for desert.",
]
CODES = [
    '''def area(shapes):
    total = 0
    for shape in shapes:
        if shape.kind == "square":
            total += shape.side * shape.side
        elif shape.kind == "circle":
            total += 3.14159 * shape.radius * shape.radius
        elif shape.kind == "rectangle":
            total += shape.width * shape.height
    return total
''',
    '''class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, word):
        if word in self.counts:
            self.counts[word] += 1
        else:
            self.counts[word] = 1

    def most_common(self, n):
        items = sorted(self.counts.items(), key=lambda kv: kv[1], reverse=True)
        return items[:n]
''',
    '''def merge(left, right):
    result = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    result.extend(left[i:])
    result.extend(right[j:])
    return result
''',
]
CHATS = ["Write a short story about a lighthouse keeper.", "Explain how vaccines work.",
         "What are three tips for sleeping better?", "Describe the water cycle.",
         "Why is the sky blue?", "Give me a recipe for pancakes.", "What is machine learning?",
         "Write a poem about autumn."]


def workloads() -> dict[str, list[str]]:
    summarise = [f"Repeat this text exactly, then summarise it in one sentence:\n\n{t}" for t in TEXTS]
    summarise += [f"Summarise this text:\n\n{t}" for t in TEXTS]
    code = [f"Add a docstring to this Python code and return all of it:\n\n{c}" for c in CODES]
    code += [f"Rename the variables to longer names and return the whole code:\n\n{c}" for c in CODES]
    return {"summarise": summarise, "code": code, "chat": CHATS}


def run(llm, prompts: list[list[int]], streams: int, max_tokens: int) -> tuple[float, list[list[int]]]:
    """(wall seconds, each prompt's tokens), `streams` requests at a time."""
    from rtp import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), streams):
        outs += [o.outputs[0].token_ids for o in llm.generate(prompts[i:i + streams], sp, use_tqdm=False)]
    return time.perf_counter() - start, outs


def llama_lookup(binary: str, model: str, texts: list[str], draft: int, max_tokens: int) -> tuple[int, float]:
    """(tokens decoded, seconds decoding) of llama.cpp's llama-lookup over each prompt in turn."""
    tokens, seconds = 0, 0.0
    for text in texts:
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
            f.write(text)
            f.flush()
            out = subprocess.run([binary, "-m", model, "-t", "2", "-f", f.name, "-n", str(max_tokens), "--temp", "0",
                                  "--spec-draft-n-max", str(draft)], capture_output=True, text=True, timeout=600)
        found = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", out.stdout + out.stderr)
        if out.returncode or not found:
            raise SystemExit(f"llama-lookup failed: {(out.stderr or out.stdout)[-800:]}")
        tokens += int(found.group(1))
        seconds += float(found.group(2))
    return tokens, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default=None, help="checkpoint directory, GGUF file or ID (default: SmolLM2-135M)")
    ap.add_argument("--speculative-model", metavar="PATH", default=None,
                    help="draft with this model (directory, GGUF or ID sharing --model's tokenizer) instead of ngram")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--speculative-max-running", type=int, default=None,
                    help="draft only while at most this many requests run (default: the engine's)")
    ap.add_argument("--streams", type=int, default=8, help="requests at once in the batched runs (default 8)")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--workloads", default="summarise,code,chat")
    ap.add_argument("--requests", type=int, default=None, help="the first N requests of each workload (default all)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each case; the fastest counts (default 1)")
    ap.add_argument("--llama-lookup", metavar="PATH", help="llama.cpp's llama-lookup binary, run beside rtp")
    args = ap.parse_args()

    from rtp import LLM

    drafter = ({"speculative_model": args.speculative_model} if args.speculative_model
               else {"speculative": "ngram"})
    note(f"loading a plain engine and one with speculative decoding ({args.speculative_model or 'ngram'})")
    plain = LLM(model=args.model, dtype="bfloat16", max_num_seqs=max(16, args.streams * 2))
    spec = LLM(model=args.model, dtype="bfloat16", max_num_seqs=max(16, args.streams * 2),
               num_speculative_tokens=args.num_speculative_tokens, **drafter,
               **({} if args.speculative_max_running is None
                  else {"speculative_max_running": args.speculative_max_running}))
    tok = plain.engine.tokenizer
    chosen = {name: asks[: args.requests] for name, asks in workloads().items() if name in args.workloads.split(",")}
    rows = []
    with CpuWatch() as cpu:
        for name, asks in chosen.items():
            prompts = [tok.apply_chat_template([{"role": "user", "content": a}], tokenize=True) for a in asks]
            for streams in sorted({1, args.streams}):
                note(f"{name}, {streams} stream(s), {len(prompts)} requests")
                s = spec.engine.scheduler
                before = (s.spec_verifications, s.spec_draft_tokens, s.spec_accepted_tokens, s.spec_emitted_tokens)
                best = {}
                for _ in range(args.repeats):
                    for label, llm in (("plain", plain), ("spec", spec)):
                        seconds, outs = run(llm, prompts, streams, args.max_tokens)
                        if label not in best or seconds < best[label][0]:
                            best[label] = (seconds, outs)
                verifications, drafted, accepted, emitted = (
                    now - then for now, then in zip((s.spec_verifications, s.spec_draft_tokens, s.spec_accepted_tokens,
                                                     s.spec_emitted_tokens), before))
                tokens = sum(len(o) for o in best["plain"][1])
                rows.append({
                    "workload": name, "streams": streams, "requests": len(prompts), "tokens": tokens,
                    "plain_tok_s": round(tokens / best["plain"][0], 1), "spec_tok_s": round(tokens / best["spec"][0], 1),
                    "speedup": round(best["plain"][0] / best["spec"][0], 3),
                    "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                    "tokens_per_verification": round(emitted / verifications, 2) if verifications else None,
                    "identical": best["plain"][1] == best["spec"][1],
                })
                if args.llama_lookup and streams == 1:
                    note(f"{name}: llama.cpp llama-lookup, without and with drafts")
                    texts = [tok.apply_chat_template([{"role": "user", "content": a}]) for a in asks]
                    model_path = str(plain.engine.model_path)
                    n0, t0 = llama_lookup(args.llama_lookup, model_path, texts, 0, args.max_tokens)
                    n1, t1 = llama_lookup(args.llama_lookup, model_path, texts, args.num_speculative_tokens,
                                          args.max_tokens)
                    rows[-1]["llama_cpp_tok_s"] = round(n0 / t0, 1)
                    rows[-1]["llama_cpp_lookup_tok_s"] = round(n1 / t1, 1)
                    rows[-1]["llama_cpp_speedup"] = round((n1 / t1) / (n0 / t0), 3)
    print(f"\n{'workload':<10} {'streams':>7} {'tokens':>7} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>8} "
          f"{'accepted':>9} {'tok/verify':>10} {'identical':>9}" + (f" {'llama.cpp tok/s, lookup, ratio':>33}"
                                                                    if args.llama_lookup else ""))
    for r in rows:
        acc = f"{r['acceptance_rate']:.0%}" if r["acceptance_rate"] is not None else "-"
        per = f"{r['tokens_per_verification']:.2f}" if r["tokens_per_verification"] is not None else "-"
        peer = (f" {r['llama_cpp_tok_s']:>12,.1f} {r['llama_cpp_lookup_tok_s']:>10,.1f} {r['llama_cpp_speedup']:>8.2f}x"
                if "llama_cpp_tok_s" in r else "")
        print(f"{r['workload']:<10} {r['streams']:>7} {r['tokens']:>7} {r['plain_tok_s']:>11,.1f} "
              f"{r['spec_tok_s']:>10,.1f} {r['speedup']:>7.2f}x {acc:>9} {per:>10} {str(r['identical']):>9}" + peer)
    print(json.dumps({"num_speculative_tokens": args.num_speculative_tokens, "max_tokens": args.max_tokens,
                      "drafter": args.speculative_model or "ngram",
                      "other_cpu_s": cpu.other_cpu_s, "rows": rows,
                      "measured_ms_per_token": spec.engine.stats().get("speculation")}))


if __name__ == "__main__":
    main()
