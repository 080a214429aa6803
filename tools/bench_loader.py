#!/usr/bin/env python3
"""Cold-cache checkpoint loading: rtp's pipelined loader against safetensors and transformers.

The checkpoint is a random-weight Llama shape (TinyLlama's: hidden 2048, intermediate
5632, 32 heads, 4 kv heads, vocab 32000, untied head) with --layers layers (default
10: 1.14 GB in bf16), written once by this tool with safetensors' own `save_file` in
--shards shards plus an index, as Hugging Face writes them, under --dir (default
/tmp/rtp-bench-loader), and reused while its files are there.

Before every measurement each shard's pages are evicted from the page cache
(posix_fadvise(DONTNEED); the files were fsynced when written), so every figure is
a read from the drive. Measured in one process, in this order, --repeats rounds:

  raw read          a plain read loop (readinto a 32 MiB buffer) over the shards: the
                    drive's sequential speed through the page cache, the limit
  raw read, direct  the same loop with O_DIRECT and aligned buffers (no page cache)
  rtp               load_model(dir, bf16, cpu): headers, the meta-device check, the
                    model built, weights streamed in. load_model then prepacks the
                    linear weights for oneDNN (a compute-side step the baselines do
                    not take): its time is reported as "ready", apart
  rtp, buffered     the same with O_DIRECT off (LoadOptions(direct=False))
  safetensors       safetensors.torch.load_file of every shard, then load_state_dict
                    (assign=True: no copy, the baseline's best case) into transformers'
                    LlamaForCausalLM built on the meta device
  transformers      AutoModelForCausalLM.from_pretrained(dir, dtype=bfloat16)

Every contender's time ends after a byte of every page of every parameter has been
read (a loader that maps the file lazily has then read it, as a first forward pass
would). GB/s is the checkpoint's tensor bytes over that wall time, best of the rounds.
Targets: rtp >= 2x the faster of safetensors and transformers, and >= 80 % of the
raw read. Other processes' CPU seconds during each measurement are recorded: this
machine may be shared.

Output: progress on stderr; a table on stdout, then as the LAST line of stdout one
JSON object with the same figures (`| tail -n1 | python -m json.tool`).

Examples:
    python tools/bench_loader.py
    python tools/bench_loader.py --layers 22 --repeats 2      # TinyLlama's full 2.2 GB
    python tools/bench_loader.py --dir /mnt/nvme/bench --chunk-size 64MiB
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import time
from pathlib import Path

import torch

from _common import CpuWatch, cpu_description, error_text, evict_from_page_cache, note
from rtp.cli_options import byte_size

TARGET_VS_BASELINE = 2.0
TARGET_VS_RAW = 0.8
SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4,
             vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False)
READ_BUFFER = 32 << 20


# ---------------------------------------------------------------------------------------
# The checkpoint
# ---------------------------------------------------------------------------------------

def tensor_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    h, inter, vocab = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    kv = h // SHAPE["num_attention_heads"] * SHAPE["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter)}
    return shapes | {"model.norm.weight": (h,), "lm_head.weight": (vocab, h)}


def write_checkpoint(directory: Path, layers: int, shards: int) -> list[Path]:
    """The checkpoint's shard files, written (random bf16 weights, fsynced) unless already there."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    shapes = tensor_shapes(layers)
    names = list(shapes)
    files = [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
    index = directory / "model.safetensors.index.json"
    if index.is_file() and all((directory / f).is_file() for f in files):
        weight_map = json.loads(index.read_text())["weight_map"]
        config = json.loads((directory / "config.json").read_text())
        if set(weight_map) == set(names) and config.get("architectures") == ["LlamaForCausalLM"]:
            return [directory / f for f in files]
    note(f"writing a {layers}-layer random bf16 checkpoint in {shards} shards under {directory} (once)")
    directory.mkdir(parents=True, exist_ok=True)
    per_shard = -(-len(names) // shards)
    weight_map = {}
    gen = torch.Generator().manual_seed(0)
    for k, file in enumerate(files):
        part = names[k * per_shard: (k + 1) * per_shard]
        tensors = {n: (torch.randn(shapes[n], generator=gen) * 0.02).to(torch.bfloat16) for n in part}
        save_file(tensors, directory / file, metadata={"format": "pt"})
        with open(directory / file, "rb+") as f:
            os.fsync(f.fileno())
        weight_map |= {n: file for n in part}
        del tensors
        gc.collect()
    LlamaConfig(num_hidden_layers=layers, dtype="bfloat16", architectures=["LlamaForCausalLM"],
                **SHAPE).save_pretrained(directory)
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    return [directory / f for f in files]


def tensor_bytes(files: list[Path]) -> int:
    from rtp.checkpoint.safetensors_format import read_header

    return sum(r.nbytes for f in files for r in read_header(f))


# ---------------------------------------------------------------------------------------
# The contenders
# ---------------------------------------------------------------------------------------

def raw_read(files: list[Path], direct: bool) -> None:
    buf = mmap.mmap(-1, READ_BUFFER)  # page-aligned, as O_DIRECT needs
    total = 0
    for file in files:
        fd = os.open(file, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            if not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while n := os.readv(fd, [buf]):
                total += n
        finally:
            os.close(fd)
    if total != sum(f.stat().st_size for f in files):
        raise RuntimeError(f"read {total} bytes, the files hold {sum(f.stat().st_size for f in files)}")


def touch(model: torch.nn.Module) -> None:
    """Read a byte of every page of every parameter: a loader that maps the file lazily
    (transformers 5 does) has then read it too, as a first forward pass would."""
    for p in model.parameters():
        p.detach().reshape(-1).view(torch.uint8)[::4096].sum()


def rtp_load(directory: Path, direct: bool | None, chunk_bytes: int | None) -> dict:
    """load_model, timed to ready and, without its final oneDNN prepacking, to the weights in place."""
    from rtp.checkpoint import loader

    pack = loader._pack_cpu_weights
    pack_s = []

    def timed_pack(model):
        t = time.perf_counter()
        pack(model)
        pack_s.append(time.perf_counter() - t)

    loader._pack_cpu_weights = timed_pack
    try:
        t = time.perf_counter()
        model, _ = loader.load_model(directory, torch.bfloat16, torch.device("cpu"),
                                     loader.LoadOptions(chunk_bytes, direct))
        ready = time.perf_counter() - t
    finally:
        loader._pack_cpu_weights = pack
    touch(model)
    del model
    return {"weights_s": ready - sum(pack_s), "ready_s": ready}


def safetensors_load(directory: Path, files: list[Path]) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(AutoConfig.from_pretrained(directory))
    state = {}
    for file in files:
        state |= load_file(file)
    model.load_state_dict(state, assign=True, strict=True)
    touch(model)
    del model, state


def transformers_load(directory: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    touch(model)
    del model


# ---------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------

def measure(name: str, files: list[Path], nbytes: int, fn) -> dict:
    evict_from_page_cache(files)
    gc.collect()
    note(f"{name} ...")
    try:
        with CpuWatch() as cpu:
            t = time.perf_counter()
            extra = fn() or {}
            seconds = time.perf_counter() - t
    except Exception as e:  # noqa: BLE001 - report it in the table, run the others
        note(f"{name} failed: {error_text(e)}")
        return {"error": error_text(e)}
    gc.collect()
    if "weights_s" in extra:  # rtp's figure is the load; the prepacking after it is reported apart
        seconds -= extra["ready_s"] - extra["weights_s"]
    result = {"s": round(seconds, 3), "gb_s": round(nbytes / 1e9 / seconds, 3), "other_cpu_s": cpu.other_cpu_s}
    if "weights_s" in extra:
        result["ready_s"] = round(extra["ready_s"], 3)
    note(f"{name}: {result}")
    return result


def best(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    return min(ok, key=lambda r: r["s"]) if ok else runs[0]


def print_report(results: dict) -> None:
    cfg = results["config"]
    print(f"rtp loader benchmark: {cfg['layers']}-layer Llama (hidden 2048), {cfg['tensor_bytes'] / 1e9:.2f} GB "
          f"bf16 in {cfg['shards']} shards, page cache evicted before each run; best of {cfg['repeats']}")
    print(f"dir {cfg['dir']}; chunk {cfg['chunk_bytes'] or 'default (32 MiB)'}; torch {cfg['torch']}; "
          f"CPU {cfg['cpu'] or '?'} ({cfg['cores']} cores)")
    print()
    print(f"{'what':<26}{'seconds':>9}{'GB/s':>8}{'vs raw':>8}{'other CPU s':>13}")
    raw = results["runs"]["raw"].get("gb_s")
    for key, label in [("raw", "raw read"), ("raw_direct", "raw read, O_DIRECT"), ("rtp", "rtp load_model"),
                       ("rtp_buffered", "rtp, buffered reads"), ("safetensors", "safetensors load_file"),
                       ("transformers", "transformers from_pretrained")]:
        r = results["runs"][key]
        if "error" in r:
            print(f"{label:<26}FAILED: {r['error']}")
            continue
        share = f"{r['gb_s'] / raw:.0%}" if raw else "-"
        other = "-" if r["other_cpu_s"] is None else f"{r['other_cpu_s']:.1f}"
        print(f"{label:<26}{r['s']:>9.2f}{r['gb_s']:>8.2f}{share:>8}{other:>13}")
        if "ready_s" in r:
            print(f"{'':<4}then oneDNN prepacking: ready after {r['ready_s']:.2f} s")
    print()
    t = results["targets"]
    print(f"rtp vs the faster baseline ({t['faster_baseline']}): {t['vs_baseline']}x "
          f"(target >= {TARGET_VS_BASELINE}x: {'met' if t['vs_baseline_met'] else 'NOT met'})")
    print(f"rtp vs raw read: {t['vs_raw']:.0%} (target >= {TARGET_VS_RAW:.0%}: "
          f"{'met' if t['vs_raw_met'] else 'NOT met'})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=Path("/tmp/rtp-bench-loader"), help="where the checkpoint lives")
    p.add_argument("--layers", type=int, default=10, help="decoder layers (default 10: 1.14 GB)")
    p.add_argument("--shards", type=int, default=2, help="safetensors shards (default 2)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of all measurements; the best counts")
    p.add_argument("--chunk-size", type=byte_size, default=None, help="rtp's read size (default 32MiB)")
    args = p.parse_args(argv)

    files = write_checkpoint(args.dir, args.layers, args.shards)
    nbytes = tensor_bytes(files)
    contenders = {
        "raw": lambda: raw_read(files, direct=False),
        "raw_direct": lambda: raw_read(files, direct=True),
        "rtp": lambda: rtp_load(args.dir, None, args.chunk_size),
        "rtp_buffered": lambda: rtp_load(args.dir, False, args.chunk_size),
        "safetensors": lambda: safetensors_load(args.dir, files),
        "transformers": lambda: transformers_load(args.dir),
    }
    runs: dict[str, list[dict]] = {k: [] for k in contenders}
    for _ in range(args.repeats):
        for key, fn in contenders.items():
            runs[key].append(measure(key, files, nbytes, fn))
    results = {
        "config": {"dir": str(args.dir), "layers": args.layers, "shards": args.shards, "repeats": args.repeats,
                   "tensor_bytes": nbytes, "chunk_bytes": args.chunk_size, "torch": torch.__version__,
                   "cpu": cpu_description(), "cores": len(os.sched_getaffinity(0))},
        "runs": {k: best(v) for k, v in runs.items()},
        "all_runs": runs,
    }
    r = results["runs"]
    baselines = {k: r[k]["gb_s"] for k in ("safetensors", "transformers") if "gb_s" in r[k]}
    faster = max(baselines, key=baselines.get) if baselines else None
    rtp_gbs = r["rtp"].get("gb_s", 0.0)
    vs_baseline = round(rtp_gbs / baselines[faster], 2) if faster else None
    vs_raw = round(rtp_gbs / r["raw"]["gb_s"], 3) if "gb_s" in r["raw"] else 0.0
    results["targets"] = {"faster_baseline": faster, "vs_baseline": vs_baseline,
                          "vs_baseline_met": bool(vs_baseline and vs_baseline >= TARGET_VS_BASELINE),
                          "vs_raw": vs_raw, "vs_raw_met": vs_raw >= TARGET_VS_RAW}
    print_report(results)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
