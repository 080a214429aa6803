#!/usr/bin/env python3
"""A MoE of Qwen3-30B-A3B's layer shape, served from its GGUF blocks, beside its dense experts and llama.cpp.

The tool writes a qwen3moe GGUF of Qwen3-30B-A3B's layer shape (hidden 2048, 128 experts, 8
active, expert width 768, GQA 32/4, head 128, q/k norm) with --layers layers and the default
model's tokenizer (49,152 tokens), random blocks of sane scales: the experts and the attention
--type (default Q4_K), the LM head Q6_K, the embedding Q8_0, norms and routers F32. Each
configuration runs in a child process of its own (both cores) and is measured alike
(tools/_common.py engine_figures): decode tok/s of 1, 16 and 64 streams (32-token prompts; a
step is t(N tokens) - t(1 token) over N - 1) and prompt tok/s of one 512-token prompt:

  rtp blocks   the experts multiplied from their blocks (rtp/models/expert_blocks.py), each MoE
               layer one kernel call (rtp/kernels/csrc/moe.c), every step replayed from a CPU graph
  rtp eager    the same, every step run eagerly (RTP_CPU_GRAPHS=0): what the graphs save
  rtp nondet   rtp blocks with --no-deterministic (a lone stream's dense layers on the one-row kernels)
  rtp dense    the experts dequantized to bf16 at load and computed by torch's grouped GEMM
               (RTP_EXPERT_BLOCKS=0), eagerly
  llama.cpp    with --llama-bench / --llama-batched-bench: llama-bench pp512 and tg, and
               llama-batched-bench S_TG at 16 and 64 sequences, on the same file

Last, the one-stream roofline: the bytes of the file a one-stream step reads (attention and
router of every layer, the 8 active experts' blocks of each, the LM head; the embedding's one
row left out) against the streaming-read bandwidth of rtp's read kernel measured in the same run.

Output: a table, then as the last line of stdout one JSON object.

    python tools/bench_moe.py                        # 4 layers, rtp blocks, eager and dense
    python tools/bench_moe.py --llama-bench B --llama-batched-bench BB --layers 8
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import _common  # this checkout's rtp first on sys.path

# Qwen3-30B-A3B's layer
SHAPE = dict(hidden=2048, experts=128, active=8, width=768, heads=32, kv_heads=4, head_dim=128, dense_ffn=6144)


def write_model(path: Path, layers: int, qtype: str, seed: int) -> dict[str, int]:
    """The GGUF; its tensors' bytes by what a one-stream step reads of them."""
    import gguf
    import numpy as np

    from rtp.checkpoint.default_model import default_model_path
    from rtp.checkpoint.gguf import GGUFFile

    tok = GGUFFile(default_model_path()).tokenizer_metadata
    g = np.random.default_rng(seed)
    h, e, w, hd = SHAPE["hidden"], SHAPE["experts"], SHAPE["width"], SHAPE["head_dim"]
    q_rows, kv_rows = SHAPE["heads"] * hd, SHAPE["kv_heads"] * hd
    vocab = len(tok["tokens"])
    out = gguf.GGUFWriter(str(path), "qwen3moe")
    out.add_context_length(4096)
    out.add_embedding_length(h)
    out.add_feed_forward_length(SHAPE["dense_ffn"])
    out.add_expert_feed_forward_length(w)
    out.add_expert_count(e)
    out.add_expert_used_count(SHAPE["active"])
    out.add_block_count(layers)
    out.add_head_count(SHAPE["heads"])
    out.add_head_count_kv(SHAPE["kv_heads"])
    out.add_key_length(hd)
    out.add_value_length(hd)
    out.add_rope_dimension_count(hd)
    out.add_rope_freq_base(1e6)
    out.add_layer_norm_rms_eps(1e-6)
    out.add_vocab_size(vocab)
    _common.add_tokenizer(out, tok)
    read = {"attention": 0, "experts_all": 0, "router_norms": 0, "lm_head": 0}
    q = gguf.GGMLQuantizationType

    def blocks(name, kind, rows, cols, stack=None, part="attention"):
        raw = _common.random_blocks(g, kind, rows * (stack or 1), cols)
        if stack:
            raw = raw.reshape(stack, rows, -1)
        out.add_tensor(name, raw, raw_dtype=q[kind])
        read[part] += raw.nbytes

    def plain(name, array, part="router_norms"):
        out.add_tensor(name, array)
        read[part] += array.nbytes

    blocks("token_embd.weight", "Q8_0", vocab, h, part="router_norms")
    read["router_norms"] -= vocab * h * 34 // 32  # one row of it a step
    plain("output_norm.weight", np.ones(h, dtype=np.float32))
    blocks("output.weight", "Q6_K", vocab, h, part="lm_head")
    for i in range(layers):
        p = f"blk.{i}."
        for norm, n in (("attn_norm", h), ("ffn_norm", h), ("attn_q_norm", hd), ("attn_k_norm", hd)):
            plain(p + norm + ".weight", np.ones(n, dtype=np.float32))
        blocks(p + "attn_q.weight", qtype, q_rows, h)
        blocks(p + "attn_k.weight", qtype, kv_rows, h)
        blocks(p + "attn_v.weight", qtype, kv_rows, h)
        blocks(p + "attn_output.weight", qtype, h, q_rows)
        plain(p + "ffn_gate_inp.weight", (g.standard_normal((e, h)) * 0.02).astype(np.float32))
        blocks(p + "ffn_gate_exps.weight", qtype, w, h, stack=e, part="experts_all")
        blocks(p + "ffn_up_exps.weight", qtype, w, h, stack=e, part="experts_all")
        blocks(p + "ffn_down_exps.weight", qtype, h, w, stack=e, part="experts_all")
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    read["experts_active"] = read["experts_all"] * SHAPE["active"] // e
    return read


def main() -> int:
    ap = _common.parser_from_doc(__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=SHAPE["experts"], help="experts a layer (default 128; fewer for "
                                                                          "a quick look)")
    ap.add_argument("--type", default="Q4_K", help="the experts' and attention's quant type (default Q4_K)")
    ap.add_argument("--streams", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=33, help="tokens generated per measured run (default 33)")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--configs", default="blocks,eager,dense",
                    help="rtp configurations: blocks, eager, dense, nondet (blocks with --no-deterministic)")
    ap.add_argument("--dir", default=None, help="where the GGUF goes (default: a temporary directory)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama-bench", metavar="PATH")
    ap.add_argument("--llama-batched-bench", metavar="PATH")
    ap.add_argument("--child", metavar="GGUF", help=argparse.SUPPRESS)
    ap.add_argument("--child-nondeterministic", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    if args.child:
        print(json.dumps(_common.engine_figures(args.child, streams, args.tokens, args.prefill,
                                                deterministic=not args.child_nondeterministic)))
        return 0

    SHAPE["experts"] = args.experts
    out = Path(args.dir or tempfile.mkdtemp(prefix="rtp-bench-moe-"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"qwen3moe-{args.layers}l-{args.type}.gguf"
    _common.note(f"writing {path}")
    read = write_model(path, args.layers, args.type, args.seed)
    rows = []
    for config in args.configs.split(","):
        env = dict(os.environ, RTP_EXPERT_BLOCKS="0" if config == "dense" else "1",
                   RTP_CPU_GRAPHS="0" if config == "eager" else os.environ.get("RTP_CPU_GRAPHS", "1"))
        _common.note(f"rtp {config}")
        figures = _common.child_figures([__file__, "--child", str(path), "--streams", args.streams,
                                         "--tokens", str(args.tokens), "--prefill", str(args.prefill),
                                         *(["--child-nondeterministic"] if config == "nondet" else [])],
                                        env, f"rtp {config}", timeout=5400)
        if figures is not None:
            rows.append({"engine": f"rtp {config}", **figures})
    if args.llama_bench or args.llama_batched_bench:
        _common.note("llama.cpp")
        rows.append({"engine": "llama.cpp", **_common.llama_cpp_figures(
            args.llama_bench, args.llama_batched_bench, str(path), streams, args.tokens, args.prefill)})
    from rtp.kernels import cpu_kernels

    _common.note("streaming bandwidth")
    # the read kernel is AVX-512's (tools/bench_roofline.py): no roofline on a CPU without it
    gbps = _common.stream_gbps(1024) if cpu_kernels.tiles_available() else None
    step_bytes = read["attention"] + read["experts_active"] + read["router_norms"] + read["lm_head"]
    limit = gbps * 1e9 / step_bytes if gbps else None  # one-stream tok/s at the bandwidth
    keys = [f"decode_{b}_tok_s" for b in streams] + [f"pp{args.prefill}_tok_s"]
    llama = next((r for r in rows if r["engine"] == "llama.cpp"), None)
    dense = next((r for r in rows if r["engine"] == "rtp dense"), None)
    print(f"{'engine':<14}" + "".join(f"{k.removesuffix('_tok_s'):>16}" for k in keys)
          + "   (tok/s; x: against llama.cpp, else against rtp dense)")
    for r in rows:
        # rtp's rows against llama.cpp where it ran, else blocks against dense; llama.cpp's row alone
        base = (None if r is llama or r is dense and llama is None
                else llama if llama is not None else dense)
        cells = []
        for k in keys:
            v = r.get(k)
            ratio = f" {v / base[k]:.2f}x" if base and v and base.get(k) else ""
            cells.append(f"{(f'{v:.1f}' if v else '-') + ratio:>16}")
        print(f"{r['engine']:<14}" + "".join(cells))
        if r["engine"].startswith("rtp") and r.get("decode_1_tok_s") and limit:
            r["one_stream_of_limit"] = r["decode_1_tok_s"] / limit
    print(f"one stream reads {step_bytes / 1e6:.0f} MB of the file a token (experts {read['experts_active'] / 1e6:.0f}, "
          f"attention {read['attention'] / 1e6:.0f}, LM head {read['lm_head'] / 1e6:.0f})"
          + (f"; at {gbps:.1f} GB/s that is {limit:.1f} tok/s: " + ", ".join(
              f"{r['engine']} {100 * r['one_stream_of_limit']:.0f} %" for r in rows if "one_stream_of_limit" in r)
             if limit else "; no bandwidth probe on this CPU (AVX-512's read kernel)"))
    import platform

    print(json.dumps({"shape": {**SHAPE, "layers": args.layers, "type": args.type}, "file_mb": path.stat().st_size / 1e6,
                      "streams": streams, "tokens": args.tokens, "prefill": args.prefill, "stream_gbps": gbps,
                      "one_stream_bytes": step_bytes, "one_stream_limit_tok_s": limit,
                      "cpu": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M"),
                      "rows": rows}))
    if not args.dir:
        path.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
