#!/usr/bin/env python3
"""Decode speed by GGUF quantization type, on a Llama-shaped model written by this tool.

For each --types entry the tool writes one GGUF of the same shape (default 0.50 B
parameters: hidden 1024, 40 layers, FFN 2816, 16 heads, 4 KV heads, the default model's
49,152-token vocabulary and tokenizer) whose linear layers hold random blocks of that type
(sane fp16 scales), the embeddings and norms F32 (the LM head is tied). It loads each
through rtp's real loader (`LLM`) and measures, in one run:

  1 row     ms per decode step of one request, and its tok/s
  batch     ms per decode step of --batch requests at once, and the batch's tok/s

A step's time is (t(N tokens) - t(1 token)) / (N - 1) over the same prompts, so prompt
processing and start-up are left out. The BF16 row is the same shape stored as bf16:
what every type is weighed against. rtp multiplies every type here from its blocks, repacked
exactly at load (rtp/kernels/quant.py): Q4_0, Q4_1 and Q4_K as q4_1 (0.75 bytes a weight),
Q8_0 as q8_0 (1.13), Q5_0, Q5_1 and Q5_K as q8_1 and Q6_K as q8_16 (1.25 each); BF16
reads 2.

With --llama-bench and --llama-batched-bench, llama.cpp decodes each same file beside: one row
(llama-bench tg, --tokens tokens) and --batch sequences of the same 32-token prompt length at
once (llama-batched-bench's S_TG: generated tokens over generation time), both cores.

Output: a table, then as the last line of stdout one JSON object.

    python tools/bench_quant.py                              # every type, 0.5 B shape
    python tools/bench_quant.py --llama-bench B --llama-batched-bench BB  # llama.cpp beside, same files
    python tools/bench_quant.py --types Q4_K,BF16 --layers 4  # a quick look
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import _common  # this checkout's rtp first on sys.path

def llama_bench(binary: str, path: Path, tokens: int) -> float | None:
    """llama.cpp's one-row decode tok/s on the GGUF (llama-bench tg, both cores), None if it fails."""
    import subprocess

    done = subprocess.run([binary, "-m", str(path), "-t", "2", "-p", "0", "-n", str(tokens), "-r", "3", "-o", "json"],
                          capture_output=True, text=True, timeout=1200)
    try:
        return float(json.loads(done.stdout)[0]["avg_ts"])
    except (ValueError, KeyError, IndexError):
        print(f"llama-bench failed on {path.name}: {done.stderr[-400:]}", file=sys.stderr)
        return None


def llama_batched_bench(binary: str, path: Path, batch: int, prompt: int, tokens: int) -> float | None:
    """llama.cpp's decode tok/s of `batch` sequences at once (llama-batched-bench's S_TG: batch x
    tokens over the generation time, prompts left out), None if it fails."""
    import subprocess

    ctx = batch * (prompt + tokens + 16)
    done = subprocess.run([binary, "-m", str(path), "-t", "2", "-tb", "2", "-c", str(ctx), "-b", "2048",
                           "-ub", "512", "-npp", str(prompt), "-ntg", str(tokens), "-npl", str(batch),
                           "--output-format", "jsonl"], capture_output=True, text=True, timeout=1800)
    for line in (done.stdout + done.stderr).splitlines():
        if line.startswith("{") and '"speed_tg"' in line:
            return float(json.loads(line)["speed_tg"])
    print(f"llama-batched-bench failed on {path.name}: {done.stderr[-400:]}", file=sys.stderr)
    return None


def write_model(path: Path, qtype: str, args, tokenizer: dict) -> int:
    import gguf

    g = np.random.default_rng(args.seed)
    h, ffn, heads, kv, layers = args.hidden, args.ffn, args.heads, args.kv_heads, args.layers
    head_dim = h // heads
    vocab = len(tokenizer["tokens"])
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_architecture()
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_feed_forward_length(ffn)
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    _common.add_tokenizer(w, tokenizer)
    matrices = {"attn_q": (heads * head_dim, h), "attn_k": (kv * head_dim, h), "attn_v": (kv * head_dim, h),
                "attn_output": (h, heads * head_dim), "ffn_gate": (ffn, h), "ffn_up": (ffn, h), "ffn_down": (h, ffn)}
    w.add_tensor("token_embd.weight", (g.standard_normal((vocab, h)) * 0.02).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, dtype=np.float32))
        for name, (rows, cols) in matrices.items():
            if qtype == "BF16":
                dense = (g.standard_normal((rows, cols), dtype=np.float32) * 0.02)
                bits = (dense.view(np.uint32) >> 16).astype(np.uint16)  # bf16: the top half of fp32
                w.add_tensor(f"blk.{i}.{name}.weight", bits.view(np.uint8).reshape(rows, -1),
                             raw_dtype=gguf.GGMLQuantizationType.BF16)
            else:
                w.add_tensor(f"blk.{i}.{name}.weight", _common.random_blocks(g, qtype, rows, cols),
                             raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.stat().st_size


def step_ms(llm, prompts, tokens: int) -> float:
    """Milliseconds per decode step: the difference between N and 1 generated tokens."""
    from rtp import SamplingParams

    def run(n):
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - start

    run(2)  # warm
    return 1000 * (run(tokens) - run(1)) / (tokens - 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_0,Q4_1,Q4_K,Q5_0,Q8_0,Q5_K,Q6_K,BF16")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=33, help="tokens generated per measured run (default 33)")
    ap.add_argument("--batch", type=int, default=64, help="requests of the batched measurement (default 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="where the GGUFs go (default: a temporary directory)")
    ap.add_argument("--llama-bench", metavar="PATH", help="llama.cpp's llama-bench binary: its one-row decode "
                                                          "(tg) on each type's GGUF, beside rtp's")
    ap.add_argument("--llama-batched-bench", metavar="PATH", help="llama.cpp's llama-batched-bench binary: its "
                                                                  "decode of --batch sequences at once (S_TG) on "
                                                                  "each type's GGUF, beside rtp's")
    args = ap.parse_args()

    import torch

    from rtp import LLM
    from rtp.checkpoint.default_model import default_model_path
    from rtp.checkpoint.gguf import GGUFFile

    tokenizer = GGUFFile(default_model_path()).tokenizer_metadata
    out = Path(args.dir or tempfile.mkdtemp(prefix="rtp-bench-quant-"))
    out.mkdir(parents=True, exist_ok=True)
    g = np.random.default_rng(args.seed)
    prompt_len = 32
    prompt_ids = [g.integers(100, 40000, size=prompt_len).tolist() for _ in range(args.batch)]
    rows = []
    for qtype in args.types.split(","):
        path = out / f"bench-{qtype}.gguf"
        print(f"[{qtype}] writing {path}", file=sys.stderr, flush=True)
        size = write_model(path, qtype, args, tokenizer)
        llm = LLM(model=str(path), compile=False, max_model_len=256, max_num_seqs=args.batch)
        params = sum(p.numel() for p in llm.engine.model.parameters())
        packed = sum(getattr(m, "quant", None) is not None for m in llm.engine.model.modules())
        one = step_ms(llm, prompt_ids[:1], args.tokens)
        many = step_ms(llm, prompt_ids, args.tokens)
        rows.append({"type": qtype, "file_mb": size / 1e6, "params_m": params / 1e6, "packed_layers": packed,
                     "one_row_ms": one, "one_row_tok_s": 1000 / one, "batch_ms": many,
                     "batch_tok_s": 1000 * args.batch / many})
        print(f"[{qtype}] 1 row {one:.2f} ms, {args.batch} rows {many:.1f} ms", file=sys.stderr, flush=True)
        if args.llama_bench:
            rows[-1]["llama_cpp_tok_s"] = llama_bench(args.llama_bench, path, args.tokens)
        if args.llama_batched_bench:
            rows[-1]["llama_cpp_batch_tok_s"] = llama_batched_bench(args.llama_batched_bench, path, args.batch,
                                                                    prompt_len, args.tokens)
        del llm
        path.unlink()
    base = next((r for r in rows if r["type"] == "BF16"), None)
    print(f"{'type':<6}{'file MB':>9}{'packed':>8}{'1 row ms':>10}{'tok/s':>8}{'vs bf16':>9}"
          f"{args.batch:>5} rows ms{'tok/s':>8}{'vs bf16':>9}"
          + (f"{'llama.cpp 1 row':>17}{'rtp/llama.cpp':>15}" if args.llama_bench else "")
          + (f"{f'llama.cpp {args.batch} rows':>19}{'rtp/llama.cpp':>15}" if args.llama_batched_bench else ""))
    for r in rows:
        r["one_row_vs_bf16"] = base["one_row_ms"] / r["one_row_ms"] if base else None
        r["batch_vs_bf16"] = base["batch_ms"] / r["batch_ms"] if base else None
        print(f"{r['type']:<6}{r['file_mb']:>9.0f}{r['packed_layers']:>8}{r['one_row_ms']:>10.2f}"
              f"{r['one_row_tok_s']:>8.1f}{(r['one_row_vs_bf16'] or 0):>9.2f}{r['batch_ms']:>13.1f}"
              f"{r['batch_tok_s']:>8.0f}{(r['batch_vs_bf16'] or 0):>9.2f}"
              + (f"{r['llama_cpp_tok_s']:>17.1f}{r['one_row_tok_s'] / r['llama_cpp_tok_s']:>14.2f}x"
                 if r.get("llama_cpp_tok_s") else "")
              + (f"{r['llama_cpp_batch_tok_s']:>19.0f}{r['batch_tok_s'] / r['llama_cpp_batch_tok_s']:>14.2f}x"
                 if r.get("llama_cpp_batch_tok_s") else ""))
    import platform

    print(json.dumps({"shape": {k: getattr(args, k) for k in ("hidden", "ffn", "heads", "kv_heads", "layers")},
                      "vocab": len(tokenizer["tokens"]), "tokens": args.tokens, "batch": args.batch,
                      "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
                      "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
