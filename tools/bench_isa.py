#!/usr/bin/env python3
"""rtp on each ISA path this CPU runs, beside its torch fallback and llama.cpp, on the same GGUF.

For each --paths entry (an ISA path rtp's kernels select with RTP_CPU_ISA, or `torch`: no kernels,
RTP_CPU_KERNELS=0, the dense bf16 weights on torch) a child process loads the model through the real
loader (`LLM`) and measures, both cores:

  1 stream     decode tok/s of one request (a step's time: t(N tokens) - t(1 token) over N - 1)
  16, 64       decode tok/s of 16 and 64 requests at once (generated tokens over the steps' time)
  pp512        prompt tok/s of one 512-token prompt (warm; a fresh prompt each run, no prefix-cache hit)

With --llama-bench and --llama-batched-bench, llama.cpp runs the same file: llama-bench's pp512 and
tg (one stream) and llama-batched-bench's S_TG at 16 and 64 sequences (32-token prompts, as rtp's).
Build llama.cpp for the path it is weighed against (AVX2 only: -DGGML_NATIVE=OFF -DGGML_AVX2=ON
-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF).

Output: a table, then as the last line of stdout one JSON object.

    python tools/bench_isa.py                                    # the default model, every path here
    python tools/bench_isa.py --paths avx2,torch --llama-bench B --llama-batched-bench BB
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import _common  # this checkout's rtp first on sys.path

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--paths", default=None,
                    help="comma-separated ISA paths (avx2, avx512, avx512bf16, amx) and `torch` (default: every "
                         "path this CPU runs, and torch)")
    ap.add_argument("--streams", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=33, help="tokens generated per measured run (default 33)")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--llama-bench", metavar="PATH")
    ap.add_argument("--llama-batched-bench", metavar="PATH")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]

    from rtp.checkpoint.default_model import default_model_path

    model = args.model or str(default_model_path())
    if args.child:
        print(json.dumps(_common.engine_figures(model, streams, args.tokens, args.prefill)))
        return 0

    from rtp.kernels import cpu_kernels, ops

    here = cpu_kernels._k.cpu_isa() if cpu_kernels.available() else 0
    paths = args.paths.split(",") if args.paths else [*ops.ISAS[:here], "torch"]
    rows = []
    for path in paths:
        env = dict(os.environ, **({"RTP_CPU_KERNELS": "0"} if path == "torch" else {"RTP_CPU_ISA": path}))
        _common.note(f"rtp on {path}")
        figures = _common.child_figures([__file__, "--child", "--model", model, "--streams", args.streams,
                                         "--tokens", str(args.tokens), "--prefill", str(args.prefill)],
                                        env, f"rtp on {path}", timeout=3600)
        if figures is not None:
            rows.append({"engine": f"rtp {path}", **figures})
    if args.llama_bench or args.llama_batched_bench:
        _common.note("llama.cpp")
        rows.append({"engine": "llama.cpp", **_common.llama_cpp_figures(args.llama_bench, args.llama_batched_bench, model,
                                                                 streams, args.tokens, args.prefill)})
    keys = [f"decode_{b}_tok_s" for b in streams] + [f"pp{args.prefill}_tok_s"]
    llama = next((r for r in rows if r["engine"] == "llama.cpp"), None)
    print(f"{'engine':<18}" + "".join(f"{k.removesuffix('_tok_s'):>14}" for k in keys)
          + ("   (tok/s; x: rtp / llama.cpp)" if llama else "   (tok/s)"))
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k)
            ratio = f" {v / llama[k]:.2f}x" if llama and r is not llama and v and llama.get(k) else ""
            cells.append(f"{(f'{v:.1f}' if v else '-') + ratio:>14}")
        print(f"{r['engine']:<18}" + "".join(cells))
    import platform

    print(json.dumps({"model": Path(model).name, "streams": streams, "tokens": args.tokens, "prefill": args.prefill,
                      "cpu": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M"),
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
