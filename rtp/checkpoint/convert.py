"""`rtp convert`: a checkpoint rewritten as safetensors laid out in the order the model consumes it.

From a Hugging Face safetensors directory or a GGUF file, the destination gets

    model.safetensors       or model-0000N-of-0000M.safetensors + model.safetensors.index.json
    config.json             the source's (for a GGUF, its metadata as config.json), dtype updated
    tokenizer files         a directory's copied; for a GGUF, tokenizer.json built from its metadata
                            (rtp/checkpoint/tokenizer.py) with tokenizer_config.json (chat template,
                            special tokens) and generation_config.json

Tensors are written in the model's parameter order (q, k, v, o, gate, up, down of a
layer together, layer after layer), so loading the result fills the model front to
back in one sequential pass. The source is checked against the model first (as
loading does), then streamed in its own file order, and each tensor is written at
its precomputed offset: memory holds a tensor at a time, never the model. GGUF
weights are dequantized (exact in fp32; --dtype bf16 rounds them). The destination
appears whole or not at all: it is written under a temporary name beside it and
renamed when complete.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from rtp.checkpoint import Checkpoint, TensorRecord, open_checkpoint
from rtp.checkpoint.loader import LoadOptions, ProgressBar, check_against_model, checkpoint_tensors
from rtp.checkpoint.safetensors_format import SafetensorsWriter, write_index
from rtp.config import ModelConfig
from rtp.models import model_class

log = logging.getLogger("rtp.convert")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_SHARD_BYTES = 4 << 30
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".index.json")

Layout = list[tuple[str, tuple[int, ...], torch.dtype]]


def model_order(model: torch.nn.Module, records: list[TensorRecord]) -> list[TensorRecord]:
    """`records` sorted by the model parameter each one fills, fused parts in row order;
    tensors that fill no parameter go last, in file order."""
    position = {name: i for i, (name, _) in enumerate(model.named_parameters(remove_duplicate=False))}
    modules = dict(model.named_modules())
    fused_target = getattr(model, "fused_target", lambda name: (name, None))

    def key(item: tuple[int, TensorRecord]) -> tuple[int, int, int]:
        i, record = item
        target, shard = fused_target(record.name)
        if target not in position:
            return len(position), 0, i
        order = getattr(modules.get(target.rpartition(".")[0]), "shard_order", ())
        return position[target], order.index(shard) if shard in order else 0, i

    return [record for _, record in sorted(enumerate(records), key=key)]


def _shards(layout: Layout, shard_bytes: int) -> list[Layout]:
    shards: list[Layout] = [[]]
    size = 0
    for entry in layout:
        nbytes = math.prod(entry[1]) * entry[2].itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _write_config(dst: Path, checkpoint: Checkpoint, dtype: torch.dtype | None) -> None:
    config = dict(checkpoint.config)
    if dtype is None and checkpoint.gguf is not None:
        dtype = torch.float32  # what its blocks dequantize to
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        keys = [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]
        config.update({k: name for k in keys})
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _write_tokenizer(dst: Path, checkpoint: Checkpoint) -> None:
    if checkpoint.gguf is None:
        for file in sorted(checkpoint.path.iterdir()):
            if file.is_file() and file.name != "config.json" and not file.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(file, dst / file.name)
        return
    from rtp.checkpoint.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(checkpoint.path)
    tokenizer.backend.save(str(dst / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token, "unk_token": tokenizer.unk_token,
        "chat_template": tokenizer.chat_template,
        "model_max_length": checkpoint.config.get("max_position_embeddings"),
        "clean_up_tokenization_spaces": False,
    }
    (dst / "tokenizer_config.json").write_text(
        json.dumps({k: v for k, v in tokenizer_config.items() if v is not None}, indent=2) + "\n")
    generation = {k: checkpoint.config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if k in checkpoint.config}
    if generation:
        (dst / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def convert(src: Path, dst: Path, dtype: torch.dtype | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES,
            options: LoadOptions | None = None) -> dict:
    """Write `src` (HF directory or GGUF) to the new directory `dst`; float tensors in `dtype`
    (None: as stored; a GGUF's as dequantized, fp32). Returns a summary (tensors, bytes, seconds)."""
    if dst.exists():
        raise FileExistsError(f"{dst} already exists; rtp convert writes a new directory")
    start = time.perf_counter()
    checkpoint = open_checkpoint(src)
    config = ModelConfig.from_hf(checkpoint.config)
    shadow = check_against_model(model_class([config.architecture]), config, checkpoint.records, src)
    layout = [(r.name, r.shape, dtype if dtype is not None and r.dtype.is_floating_point else r.dtype)
              for r in model_order(shadow, checkpoint.records)]
    out_dtype = {name: d for name, _, d in layout}
    shards = _shards(layout, shard_bytes)
    names = _shard_names(len(shards))

    dst.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    umask = os.umask(0)
    os.umask(umask)
    scratch.chmod(0o777 & ~umask)  # mkdtemp's 0700 is for the scratch name, not the published directory
    try:
        writers = [SafetensorsWriter(scratch / name, shard) for name, shard in zip(names, shards)]
        owner = {entry[0]: writer for writer, shard in zip(writers, shards) for entry in shard}
        bar = ProgressBar(src.name, sum(r.nbytes for r in checkpoint.records))
        done = False
        tensors = checkpoint_tensors(checkpoint.records, torch.device("cpu"), options or LoadOptions(), bar.update)
        try:
            for name, tensor in tensors:
                owner[name].write(name, tensor.to(out_dtype[name]))
            done = True
        finally:
            tensors.close()
            bar.close()
            for writer in writers:
                writer.close(sync=done)
        if len(shards) > 1:
            write_index(scratch, {entry[0]: name for name, shard in zip(names, shards) for entry in shard},
                        sum(w.nbytes - w.data_start for w in writers))
        _write_config(scratch, checkpoint, dtype)
        _write_tokenizer(scratch, checkpoint)
        os.replace(scratch, dst)  # atomic: a reader sees no directory or a whole one
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = {"tensors": len(layout), "bytes": sum(w.nbytes for w in writers), "files": len(writers),
               "seconds": round(time.perf_counter() - start, 2)}
    log.info("wrote %s: %d tensors, %.2f GB in %d file(s), %.1f s", dst, summary["tensors"],
             summary["bytes"] / 1e9, summary["files"], summary["seconds"])
    return summary
