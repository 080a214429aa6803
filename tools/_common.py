"""What the tools in tools/ share; every tool imports it before anything from rtp.

`python tools/x.py` puts tools/ on sys.path, not the repository's root. Importing this module
puts the root first, so a tool runs the rtp of the checkout it sits in, installed or not (and
not another checkout's installed in the venv). The child processes a tool starts are left to
their own sys.path: PYTHONPATH still picks the build they run.

The rest is what more than one tool uses, kept here rather than imported from another tool:
progress lines, the machine's description and the other processes' load on it, the bf16 matmul
probe, a Llama-family model's linear shapes and oneDNN's time over them, and the offline
workload (tools/bench_offline.py runs it against other engines, tools/bench_roofline.py
against the machine's limits: the same requests for the same seed).
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

START = time.perf_counter()  # the tool's start, as near as its imports allow


def note(msg: str) -> None:
    """A progress line on stderr, stamped with the seconds since START."""
    print(f"[{time.perf_counter() - START:7.1f}s] {msg}", file=sys.stderr, flush=True)


def error_text(e: BaseException) -> str:
    """An exception as one line of at most 300 characters, for a results table."""
    text = f"{type(e).__name__}: {e}".strip()
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:297] + "..."


def parser_from_doc(doc: str) -> argparse.ArgumentParser:
    """An argument parser whose help is the module docstring, its "Examples:" part as the epilog."""
    description, _, examples = doc.partition("Examples:")
    return argparse.ArgumentParser(description=description.strip(), epilog="Examples:" + examples,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def free_port() -> int:
    """A loopback port nothing listens on now (for a server the tool starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------
# The machine, and what else ran on it while a tool measured
# ---------------------------------------------------------------------------------------

def cpu_description() -> str | None:
    """The CPU model and the matmul extensions that decide bf16 speed (AMX, AVX512_BF16)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    extras = [f for f in ("amx_bf16", "avx512_bf16", "avx512f") if f in flags]
    return f"{name} ({', '.join(extras) or 'no AVX-512'})"


def _busy_cpu_seconds() -> float | None:
    """All processes' busy CPU time since boot (from /proc/stat), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal ...
    values = [int(v) for v in fields[1:]]
    busy = values[0] + values[1] + values[2] + values[5] + values[6] + (values[7] if len(values) > 7 else 0)
    return busy / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class CpuWatch:
    """Other processes' CPU seconds over a `with` block: other_s as measured, other_cpu_s rounded
    to 0.01 s (both None where /proc/stat is missing). A figure taken while they are high is not
    to be trusted on a shared machine."""

    def __enter__(self) -> "CpuWatch":
        self.busy0, self.own0 = _busy_cpu_seconds(), _own_cpu_seconds()
        self.other_s = self.other_cpu_s = None
        return self

    def __exit__(self, *exc) -> None:
        busy1 = _busy_cpu_seconds()
        if self.busy0 is not None and busy1 is not None:
            self.other_s = max(0.0, (busy1 - self.busy0) - (_own_cpu_seconds() - self.own0))
            self.other_cpu_s = round(self.other_s, 2)


def native_bf16() -> bool:
    """Whether oneDNN multiplies bf16 natively here (AVX-512 BF16, AMX): else torch emulates bf16 products,
    far below the CPU's rate (minutes for one 2048-cube bf16 matmul on an AVX2 CPU)."""
    import torch

    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bench_matmul(n: int = 2048, dtype=None, repeats: int = 8) -> float:
    """This machine's matmul GFLOP/s at n x n x n (best of repeats; dtype default bf16 where native_bf16(),
    else fp32), with the current thread count."""
    import torch

    dtype = (torch.bfloat16 if native_bf16() else torch.float32) if dtype is None else dtype
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    for _ in range(2):
        torch.matmul(a, b, out=out)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


# ---------------------------------------------------------------------------------------
# A model's linear layers
# ---------------------------------------------------------------------------------------

def count_params(model) -> int:
    """Parameters counted once per storage (a tied embedding / lm_head counts once). A layer whose weights
    live in quantized blocks keeps its weight on the meta device (data_ptr 0 for all of them): each such
    one counts on its own, or the whole model would count one layer's worth of them."""
    seen: dict[tuple[int, int], int] = {}
    for i, p in enumerate(model.parameters()):
        seen[(p.data_ptr(), p.numel()) if not p.is_meta else (-1, i)] = p.numel()
    return sum(seen.values())


def linear_layers(config) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear of a Llama-family layer (fused qkv and gate_up, as rtp runs them),
    then of the LM head."""
    h, i = config.hidden_size, config.intermediate_size
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    return {"qkv_proj": ((config.num_attention_heads + 2 * config.num_key_value_heads) * d, h),
            "o_proj": (config.num_attention_heads * d, h), "gate_up_proj": (2 * i, h), "down_proj": (h, i),
            "lm_head": (config.vocab_size, h)}


def linear_shapes(config) -> list[tuple[int, int]] | None:
    """(N, K) of every linear a dense Llama-family decode step runs, in model order: each layer's
    four, then the LM head. None for MoE configs."""
    if any(getattr(config, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        return None
    *layer, head = linear_layers(config).values()
    return layer * config.num_hidden_layers + [head]


def bench_onednn_linears(config, rows: int, peak_gflops: float, repeats: int = 8) -> dict | None:
    """The linear layers of one decode step over `rows` rows through oneDNN with bf16 weights
    prepacked for it (as Inductor's freezing does; no dequantisation, no attention, no norms):
    what a tuned vendor GEMM reaches at this model's shapes on this machine, run in model order
    over distinct weights so they stream from memory as a real step's do. Median ms of a pass,
    and the share of peak_gflops (this run's bf16 matmul rate) that makes."""
    import torch
    from tqdm import tqdm

    shapes = linear_shapes(config)
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if shapes is None or reorder is None or not native_bf16():  # its bf16 reorder needs AVX-512 or AMX
        return None
    gen = torch.Generator().manual_seed(0)
    layers = []
    for n, k in tqdm(shapes, desc="oneDNN reference: packing weights", unit="matrix", file=sys.stderr, leave=False):
        w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
        layers.append((torch.randn(rows, k, generator=gen).to(torch.bfloat16), reorder(w, rows)))
    linear = torch.ops.mkldnn._linear_pointwise
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        for x, w in layers:
            linear(x, w, None, "none", [], "")
        times.append(time.perf_counter() - t)
    ms = statistics.median(times[1:]) * 1e3
    gflops = sum(2.0 * rows * n * k for n, k in shapes) / ms / 1e6
    return {"rows": rows, "ms": round(ms, 3), "gflops": round(gflops, 1), "utilisation": round(gflops / peak_gflops, 4),
            "matrices": len(shapes)}


# ---------------------------------------------------------------------------------------
# The offline workload
# ---------------------------------------------------------------------------------------

class Workload:
    """Prompts (token id lists) and their output lengths; the same for every system."""

    def __init__(self, prompts: list[list[int]], output_lens: list[int]):
        self.prompts = prompts
        self.output_lens = output_lens

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def __len__(self) -> int:
        return len(self.prompts)


def allowed_token_ids(model_path: Path):
    """The vocabulary's ids without special (control) tokens and eos ids, from rtp's tokenizer:
    an int64 numpy array."""
    import numpy as np

    from rtp.checkpoint.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(model_path)
    special = {i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special}
    special |= set(tok.eos_token_ids)
    ids = np.array([i for i in range(tok.vocab_size) if i not in special], dtype=np.int64)
    return ids


def make_workload(ids, n: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int],
                  seed: int, stream: int = 0) -> Workload:
    """n requests: lengths uniform (inclusive) in the ranges, token ids uniform over ids."""
    import numpy as np

    rng = np.random.default_rng([seed, stream])
    plens = rng.integers(prompt_lens[0], prompt_lens[1] + 1, size=n)
    olens = rng.integers(output_lens[0], output_lens[1] + 1, size=n)
    prompts = [ids[rng.integers(0, len(ids), size=int(k))].tolist() for k in plens]
    return Workload(prompts, [int(k) for k in olens])


# ---------------------------------------------------------------------------------------
# Engines on one GGUF: rtp's decode and prompt figures, llama.cpp's on the same file, the
# machine's streaming bandwidth, and random quant blocks to write files of any type with
# ---------------------------------------------------------------------------------------

PROMPT = 32  # tokens of each decode measurement's prompts


def engine_figures(model: str, streams: list[int], tokens: int, prefill: int, deterministic: bool = True) -> dict:
    """rtp's decode tok/s of each number of streams (`PROMPT`-token prompts; a step's time is
    t(tokens) - t(1 token) over tokens - 1) and its prompt tok/s of one `prefill`-token prompt
    (warm; a fresh prompt each run, no prefix-cache hit), both cores; the ISA path and the
    kernels are what the process's environment selects (deterministic=False: --no-deterministic)."""
    import numpy as np

    from rtp import LLM, SamplingParams
    from rtp.kernels import cpu_kernels

    llm = LLM(model=model, compile=False, max_model_len=max(prefill + 8, PROMPT + tokens + 8),
              max_num_seqs=max(streams), deterministic=deterministic)
    g = np.random.default_rng(0)
    prompts = [g.integers(100, 40000, size=PROMPT).tolist() for _ in range(max(streams))]

    def seconds(batch, n):
        start = time.perf_counter()
        llm.generate(batch, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - start

    out = {"isa": cpu_kernels.isa() or "torch"}
    for b in streams:
        seconds(prompts[:b], 2)  # warm
        step = (seconds(prompts[:b], tokens) - seconds(prompts[:b], 1)) / (tokens - 1)
        out[f"decode_{b}_tok_s"] = b / step
    # a fresh prompt each time: the prefix cache would serve a repeated one
    seconds([g.integers(100, 40000, size=prefill).tolist()], 1)
    out[f"pp{prefill}_tok_s"] = prefill / min(seconds([g.integers(100, 40000, size=prefill).tolist()], 1)
                                              for _ in range(2))
    return out


def child_figures(argv: list[str], env: dict, what: str, timeout: float) -> dict | None:
    """The JSON object a child Python process (argv: a script and its arguments, in `env`) prints as
    its last stdout line; None, with its stderr's end, when it failed."""
    import json
    import subprocess

    done = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout)
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        print(f"{what} failed: {done.stderr[-800:]}", file=sys.stderr)
        return None


def add_tokenizer(writer, tok: dict) -> None:
    """A GGUF tokenizer's metadata (GGUFFile.tokenizer_metadata) written by a gguf.GGUFWriter."""
    writer.add_tokenizer_model(tok["model"])
    writer.add_tokenizer_pre(tok.get("pre") or "default")
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["token_type"])
    writer.add_token_merges(tok["merges"])
    writer.add_bos_token_id(tok["bos_token_id"])
    writer.add_eos_token_id(tok["eos_token_id"])


def llama_cpp_figures(bench: str | None, batched: str | None, model: str, streams: list[int], tokens: int,
                      prefill: int) -> dict:
    """The same figures from llama.cpp on the same file: llama-bench's pp and tg (one stream), and
    llama-batched-bench's S_TG for each number of streams past one (`PROMPT`-token prompts)."""
    import json
    import subprocess

    out = {}
    if bench:
        done = subprocess.run([bench, "-m", model, "-t", "2", "-p", str(prefill), "-n", str(tokens), "-r", "3",
                               "-o", "json"], capture_output=True, text=True, timeout=1800)
        try:
            for r in json.loads(done.stdout):
                key = f"pp{prefill}_tok_s" if r["n_prompt"] else "decode_1_tok_s"
                out[key] = float(r["avg_ts"])
        except (ValueError, KeyError):
            print(f"llama-bench failed: {done.stderr[-400:]}", file=sys.stderr)
    if batched:
        for b in [s for s in streams if s > 1]:
            done = subprocess.run([batched, "-m", model, "-t", "2", "-tb", "2", "-c", str(b * (PROMPT + tokens + 16)),
                                   "-b", "2048", "-ub", "512", "-npp", str(PROMPT), "-ntg", str(tokens), "-npl", str(b),
                                   "--output-format", "jsonl"], capture_output=True, text=True, timeout=1800)
            lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.startswith("{") and "speed_tg" in ln]
            if lines:
                out[f"decode_{b}_tok_s"] = float(json.loads(lines[-1])["speed_tg"])
            else:
                print(f"llama-batched-bench failed: {done.stderr[-400:]}", file=sys.stderr)
    return out


def evict_from_page_cache(files) -> None:
    """Files out of the page cache (posix_fadvise DONTNEED), so that their next read comes from the drive;
    what was written must be on the drive first (fsync, or os.sync())."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def stream_gbps(mib: int, repeats: int = 5) -> float:
    """GB/s of rtp's streaming-read kernel over a buffer of `mib` MiB, both cores (best of repeats)."""
    import torch

    from rtp.kernels import cpu_kernels

    buf = torch.empty((mib << 20) + 64, dtype=torch.uint8)
    off = (-buf.data_ptr()) % 64
    view = buf[off: off + (mib << 20)]
    view.fill_(1)  # fault every page in before timing
    cpu_kernels.stream_read(view)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        cpu_kernels.stream_read(view)
        best = min(best, time.perf_counter() - t)
    return (mib << 20) / best / 1e9


# bytes per block, weights per block, offsets of the fp16 scale fields in a block
BLOCKS = {"Q4_0": (18, 32, (0,)), "Q4_1": (20, 32, (0, 2)), "Q5_0": (22, 32, (0,)), "Q5_1": (24, 32, (0, 2)),
          "Q8_0": (34, 32, (0,)), "Q4_K": (144, 256, (0, 2)), "Q5_K": (176, 256, (0, 2)), "Q6_K": (210, 256, (208,))}


def random_blocks(g, qtype: str, rows: int, cols: int):
    """[rows, bytes] of random `qtype` blocks (a numpy Generator's) whose fp16 scales are small positive
    numbers: sane weights of that type without quantizing any."""
    import numpy as np

    size, per, scales = BLOCKS[qtype]
    raw = g.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
    for off in scales:
        scale = g.uniform(2e-4, 2e-3, (rows, cols // per)).astype(np.float16)
        raw[:, :, off:off + 2] = scale[..., None].view(np.uint8)
    return raw.reshape(rows, -1)
