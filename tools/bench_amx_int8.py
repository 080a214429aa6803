"""What the lane kernel's numerics would cost on AMX-INT8 tiles: docs/determinism.md's plan, measured.

On a CPU with AMX, rtp's linears multiply bf16 tiles (the weights turned into bf16, AMX-BF16), and at one
row the avx512 path's lane kernel (exact integer block sums, one fp32 chain per output) is 2.5x faster but
gives other bits, so a deterministic engine cannot take it for small batches only. The plan: the lane
kernel's numerics from AMX-INT8 for larger batches. tools/amx_int8_lanes.c computes them that way (Q8_0
records in lane order, TDPBSUD per block of 32, the lane kernel's epilogue on each stored tile); this tool
builds it with gcc, checks that its outputs are the lane kernel's bits, and times it beside the lane kernel
and the AMX-BF16 tile kernel on the same Q8_0 matrix, at several row counts, on both cores.

    python tools/bench_amx_int8.py                   # 5,120 x 2,048, rows 1..512
    python tools/bench_amx_int8.py --n 2048 --k 768  # a Qwen3-30B-A3B expert's down projection

Output: a table, then as the last line of stdout one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, note

X_STEPS = 16256.0  # rtp/kernels/csrc/int8_blocks.h


def int8_rows(x):
    """x fp32 [M, K] as rtp's integer blocks (csrc/avx2/int8_rows.h quantize_row, in numpy): h, l int8 [M, K],
    d fp32 [M, K/32], qsum int32 [M, K/16]."""
    import numpy as np

    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32).astype(np.float32)
    top = np.abs(blocks).max(axis=2)
    inv = np.where(top > 0, np.float32(X_STEPS) / np.where(top > 0, top, 1), 0).astype(np.float32)
    q = np.rint(blocks * inv[..., None]).astype(np.int32)  # nearest even, as _mm256_cvtps_epi32
    h = (q + 64) >> 7
    low = q - (h << 7)
    d = (top / np.float32(X_STEPS)).astype(np.float32)
    qsum = q.reshape(m, k // 16, 16).sum(axis=2).astype(np.int32)
    return h.reshape(m, k).astype(np.int8), low.reshape(m, k).astype(np.int8), d, qsum


def build(out: Path) -> ctypes.CDLL:
    lib = out / "amx_int8_lanes.so"
    subprocess.run(["gcc", "-O3", "-fopenmp", "-shared", "-fPIC", "-o", str(lib), str(REPO / "tools" / "amx_int8_lanes.c")],
                   check=True)
    return ctypes.CDLL(str(lib))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=5120)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--rows", default="16,64,256,512")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    import gguf
    import numpy as np
    import torch

    from rtp.kernels import cpu_kernels
    from rtp.kernels.quant import TILE_KIND, BlockQuantized

    if not (cpu_kernels.tiles_available() and cpu_kernels.isa() == "amx" and cpu_kernels.has_op("linear_lanes")):
        print(json.dumps({"error": f"needs AMX and VNNI (this CPU's path: {cpu_kernels.isa()})"}))
        return 1
    lib = build(Path(tempfile.mkdtemp(prefix="rtp-amx-int8-")))
    if not lib.amx_int8_ready():
        print(json.dumps({"error": "the kernel refused AMX tile data (arch_prctl)"}))
        return 1
    g = np.random.default_rng(0)
    w = (g.standard_normal((args.n, args.k)) * 0.05).astype(np.float32)
    blocks = BlockQuantized.from_gguf("q8_0", gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0), args.n)
    lanes, tiles = blocks.lane_layout(), blocks.tile_layout()
    rows = []
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.from_numpy((g.standard_normal((m, args.k)) * 0.5).astype(np.float32))
        x = x.bfloat16().float()  # what a bf16 model's activations hold: the tile kernel takes the same values
        h, low, d, qsum = (np.ascontiguousarray(a) for a in int8_rows(x.numpy()))
        ours = torch.empty(m, args.n)
        ptr = ctypes.c_void_p

        def amx():
            lib.amx_int8_lanes_q8_0(ptr(h.ctypes.data), ptr(low.ctypes.data), ptr(d.ctypes.data),
                                    ptr(qsum.ctypes.data), ptr(lanes.data_ptr()), ptr(ours.data_ptr()),
                                    ctypes.c_int64(m), ctypes.c_int64(args.n), ctypes.c_int64(args.k))

        lane_out = torch.empty(m, args.n)
        xb = x.bfloat16()

        def lane():
            cpu_kernels.linear_lanes_into(x, TILE_KIND["q8_0"], lanes, None, lane_out)

        def tile():
            cpu_kernels.linear_tiles(xb, TILE_KIND["q8_0"], tiles, None, torch.float32)

        timings = {}
        for name, fn in (("amx_int8", amx), ("lanes", lane), ("amx_bf16_tiles", tile)):
            fn()
            samples = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - start)
            timings[name] = statistics.median(samples) * 1e6
        same = bool(torch.equal(ours, lane_out))
        rows.append({"rows": m, "us": timings, "bits_equal_lanes": same})
        note(f"{m} rows: {timings} equal={same}")
    print(f"{args.n} x {args.k} Q8_0, both cores, median of {args.repeats} (microseconds)")
    print(f"{'rows':>6}{'AMX-INT8 lanes':>16}{'lane kernel':>13}{'AMX-BF16 tiles':>16}{'bits = lanes':>14}")
    for r in rows:
        t = r["us"]
        print(f"{r['rows']:>6}{t['amx_int8']:>16.0f}{t['lanes']:>13.0f}{t['amx_bf16_tiles']:>16.0f}"
              f"{str(r['bits_equal_lanes']):>14}")
    print(json.dumps({"n": args.n, "k": args.k, "type": "Q8_0", "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
