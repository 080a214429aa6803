"""Checkpoints in, a ready model out.

A checkpoint is a Hugging Face directory (config.json + *.safetensors) or a GGUF
file. Tensors are read in file order and copied into parameters through the
model's per-parameter weight loaders, so this file knows no architecture. (The
pipelined reader that streams at the drive's sequential speed replaces
`_safetensors_tensors` in the loading work; its interface stays.)
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from rtp.config import ModelConfig
from rtp.models import model_class

log = logging.getLogger("rtp.loader")


class CheckpointError(ValueError):
    """A checkpoint that cannot be served: missing, malformed, or not matching its config."""


def checkpoint_config(path: Path) -> dict:
    """The HF-style config dict of a checkpoint directory or GGUF file."""
    if path.suffix == ".gguf":
        from rtp.engine.gguf import GGUFCheckpoint

        return GGUFCheckpoint(path).config
    config = path / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{path} has no config.json (expected a Hugging Face checkpoint "
                              f"directory or a .gguf file)")
    with open(config) as f:
        return json.load(f)


def checkpoint_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    if path.suffix == ".gguf":
        from rtp.engine.gguf import GGUFCheckpoint

        yield from GGUFCheckpoint(path).tensors()
        return
    yield from _safetensors_tensors(path)


def _safetensors_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors files")
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (OSError, RuntimeError, ValueError) as e:  # safetensors raises SafetensorError(Exception)
            raise CheckpointError(f"{file}: {e}") from e
        except Exception as e:
            if type(e).__name__ == "SafetensorError":
                raise CheckpointError(f"{file}: {e}") from e
            raise


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(path: Path, dtype: torch.dtype, device: torch.device) -> tuple[torch.nn.Module, ModelConfig]:
    """Build the model named by the checkpoint's config and load its weights."""
    config = ModelConfig.from_hf(checkpoint_config(path))
    cls = model_class([config.architecture])
    start = time.perf_counter()
    # parameters are created uninitialised (torch.empty) directly in their final dtype and device
    with _default_dtype(dtype), torch.device(device):
        model = cls(config)
    try:
        loaded = model.load_weights(checkpoint_tensors(path))
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from e
    missing = model.expected_weights() - loaded
    if missing:
        raise CheckpointError(f"{path}: checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    model.eval()
    if path.suffix == ".gguf" and dtype == torch.bfloat16 and device.type == "cpu":
        _attach_quantized(model, path)
    _pack_cpu_weights(model)
    log.info("loaded %s (%s, %.1f M params) in %.1f s", path.name, config.architecture,
             sum(p.numel() for p in model.parameters()) / 1e6, time.perf_counter() - start)
    return model, config


def _pack_cpu_weights(model: torch.nn.Module) -> None:
    """Give bf16 CPU linears (and the LM head) a oneDNN-prepacked weight (rtp/models/packed.py)."""
    from rtp.models import packed

    count = 0
    for module in model.modules():
        if hasattr(module, "packed") and packed.supported(module.weight):
            module.packed = packed.pack(module.weight)
            count += 1
    if count:
        log.info("prepacked %d bf16 linear weights for oneDNN", count)


def _attach_quantized(model: torch.nn.Module, path: Path) -> None:
    """Give linear layers the GGUF's packed blocks for small-batch decode (rtp/models/quant.py).

    A fused layer (qkv, gate_up) gets them only when every part is packed in one format;
    the LM head of a tied model takes the embedding's."""
    from rtp.engine.gguf import GGUFCheckpoint
    from rtp.models import cpu_kernels
    from rtp.models.quant import BlockQuantized

    if not cpu_kernels.available():
        return
    fused: dict[str, dict] = {}
    for name, blocks in GGUFCheckpoint(path).quantized():
        target, shard = model.fused_target(name)
        fused.setdefault(target.removesuffix(".weight"), {})[shard] = blocks
    modules = dict(model.named_modules())
    if getattr(model.config, "tie_word_embeddings", False) and "model.embed_tokens" in fused:
        fused.setdefault("lm_head", fused["model.embed_tokens"])
    attached = 0
    for name, parts in fused.items():
        layer = modules.get(name)
        if layer is None or not hasattr(layer, "quant"):
            continue
        order = getattr(layer, "shard_order", ()) or (None,)
        if set(parts) != set(order):
            continue
        blocks = BlockQuantized.cat([parts[s] for s in order])
        if blocks is not None and blocks.shape == tuple(layer.weight.shape):
            layer.quant = blocks.with_amx_layout()
            attached += 1
    log.info("%s: %d layers also keep their GGUF blocks for small-batch decode", path.name, attached)
