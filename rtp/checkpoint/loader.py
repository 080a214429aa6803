"""Checkpoints in, a ready model out.

A checkpoint (a Hugging Face safetensors directory or a GGUF file) is first
described without reading its weights (rtp/checkpoint/formats.py: config and one
record per tensor, every header validated), then checked against the model: the
model's own weight loaders run once over placeholder tensors on the meta device,
so a missing tensor, one with no place, or one whose shape disagrees with the
config is a CheckpointError naming the file and tensor before a byte of data is
read. Only then are the weights streamed in file order (one reader thread, two
buffers, rtp/checkpoint/reader.py) and copied into the parameters by the
same per-parameter weight loaders, so this file knows no architecture.

The model's parameters are created uninitialised in their final dtype and on
their device; each tensor is copied from the reader's buffer into its parameter
(converting dtype on the way), so loading holds no second copy of the model in
host memory: two chunk buffers, and one staging buffer for tensors longer than a
chunk. On the CPU a second thread faults the parameters' pages in ahead of the
copies (rtp/checkpoint/prefault.py). An error anywhere raises: `load_model` never
returns a half-loaded model.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import torch

from rtp.checkpoint import Checkpoint, CheckpointError, TensorRecord, open_checkpoint, stream_tensors
from rtp.checkpoint.prefault import Prefault
from rtp.config import ModelConfig
from rtp.distributed import world_rank, world_size
from rtp.models import model_class

__all__ = ["CheckpointError", "LoadOptions", "check_against_model", "checkpoint_tensors", "load_model"]

if TYPE_CHECKING:
    from rtp.checkpoint.gguf import GGUFCheckpoint

log = logging.getLogger("rtp.loader")


@dataclass(frozen=True)
class LoadOptions:
    """How to read: the reader's chunk size (None: 32 MiB), O_DIRECT (None: unless the file
    looks cached; True or False forces it, though a filesystem that refuses it still gets buffered
    reads), and whether rank 0 reads for every rank and broadcasts (None: with more than one rank)."""

    chunk_bytes: int | None = None
    direct: bool | None = None
    broadcast: bool | None = None


def check_against_model(model_cls, config: ModelConfig, records: Sequence[TensorRecord],
                        path: Path) -> torch.nn.Module:
    """Run the model's weight loaders over meta-device placeholders of every record; return
    that meta model. Raises CheckpointError for a tensor the model has no place for, a shape
    or dtype that disagrees with the config, or a parameter no tensor fills."""
    with torch.device("meta"):
        shadow = model_cls(config)
    current: list[TensorRecord] = []

    def placeholders():
        for record in records:
            if not record.dtype.is_floating_point:
                raise CheckpointError(f"{record.path}: tensor {record.name} is {record.dtype}; "
                                      f"model weights must be floating point")
            current[:] = [record]
            yield record.name, torch.empty(record.shape, dtype=record.dtype, device="meta")

    try:
        loaded = shadow.load_weights(placeholders())
    except CheckpointError:
        raise
    except ValueError as e:  # the weight loaders name the tensor
        raise CheckpointError(f"{current[0].path if current else path}: {e}") from e
    missing = sorted(shadow.expected_weights() - loaded)
    if missing:
        raise CheckpointError(f"{path}: checkpoint lacks {len(missing)} tensors the model needs, "
                              f"e.g. {', '.join(_checkpoint_name(shadow, m) for m in missing[:3])}")
    return shadow


def _checkpoint_name(model: torch.nn.Module, target: str) -> str:
    """The checkpoint name that fills `target` ("...qkv_proj.weight#k" -> "...k_proj.weight")."""
    fused, _, shard = target.partition("#")
    for part, (fused_part, shard_id) in getattr(model, "packed_modules_mapping", {}).items():
        if shard and str(shard_id) == shard and f".{fused_part}." in fused:
            return fused.replace(f".{fused_part}.", f".{part}.")
    return target


def checkpoint_tensors(records: Sequence[TensorRecord], device: torch.device,
                       options: LoadOptions, progress: Callable[[int], None] | None = None
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor on `device`) for every record, in file order.

    With more than one rank (tensor or expert parallelism, DESIGN.md "Loading") only
    rank 0 runs the reader and broadcasts each tensor over torch.distributed, in this
    same order; the other ranks know every name, shape and dtype from the records they
    built from the headers, receive into a buffer of that shape, and yield it. Each
    rank's weight loaders then keep their own shard (rtp/models/layers.py, moe.py), so
    nothing above changes, and the disk is read once rather than once per rank.

    On CUDA each tensor leaves the reader's pinned buffer with a non-blocking copy; the
    reader refills a buffer only after the copies out of it have run.
    """
    if options.broadcast if options.broadcast is not None else world_size() > 1:
        yield from _broadcast_tensors(records, device, options, progress)
        return
    cuda = device.type == "cuda"
    with contextlib.closing(stream_tensors(records, chunk_bytes=options.chunk_bytes, direct=options.direct,
                                           device=device, progress=progress)) as stream:
        for record, tensor in stream:
            yield record.name, tensor.to(device, non_blocking=True) if cuda else tensor


def _broadcast_tensors(records: Sequence[TensorRecord], device: torch.device, options: LoadOptions,
                       progress: Callable[[int], None] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """checkpoint_tensors with rank 0 reading and every tensor broadcast (as bytes: any dtype
    the backend can move) to the others. A rank that fails leaves the others in a broadcast
    until the collective timeout."""
    import torch.distributed as dist

    # NCCL moves device tensors only; gloo CPU ones
    where = device if device.type == "cuda" else torch.device("cpu")
    if world_rank() == 0:
        with contextlib.closing(stream_tensors(records, chunk_bytes=options.chunk_bytes, direct=options.direct,
                                               device=device, progress=progress)) as stream:
            for record, tensor in stream:
                tensor = tensor.to(where, non_blocking=True).contiguous()
                dist.broadcast(tensor.reshape(-1).view(torch.uint8), 0)
                yield record.name, tensor
        return
    for record in records:
        tensor = torch.empty(record.shape, dtype=record.dtype, device=where)
        dist.broadcast(tensor.reshape(-1).view(torch.uint8), 0)
        if progress is not None:
            progress(record.nbytes)
        yield record.name, tensor


class ProgressBar:
    """Bytes read, GB/s and ETA on stderr, shown only when stderr is a terminal."""

    def __init__(self, name: str, total: int):
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"loading {name}", unit="B", unit_scale=True, file=sys.stderr,
                            leave=False, dynamic_ncols=True)

    def update(self, nbytes: int) -> None:
        if self.bar is not None:
            self.bar.update(nbytes)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _fill_order(model: torch.nn.Module, records: Sequence[TensorRecord]) -> list[torch.Tensor]:
    """The model's parameters in the order the records fill them (as far as the model's
    `fused_target` tells; the rest after)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    fused_target = getattr(model, "fused_target", lambda name: (name, None))
    order: dict[int, torch.Tensor] = {}
    for record in records:
        param = params.get(fused_target(record.name)[0])
        if param is not None:
            order.setdefault(id(param), param.data)
    for param in params.values():
        order.setdefault(id(param), param.data)
    return list(order.values())


def load_model(path: Path, dtype: torch.dtype, device: torch.device, options: LoadOptions | None = None,
               *, redundant_experts: int = 0, checkpoint: Checkpoint | None = None
               ) -> tuple[torch.nn.Module, ModelConfig]:
    """Build the model named by the checkpoint's config and load its weights; MoE layers get
    `redundant_experts` spare slots for EPLB's replicas (empty until FusedMoE.place).
    `checkpoint`: `path` already opened (its headers parsed once, by the caller)."""
    options = options or LoadOptions()
    start = time.perf_counter()
    checkpoint = checkpoint or open_checkpoint(path)
    records = checkpoint.records
    config = ModelConfig.from_hf(checkpoint.config)
    if redundant_experts:
        config = msgspec.structs.replace(config, num_redundant_experts=redundant_experts)
    cls = model_class([config.architecture])
    check_against_model(cls, config, records, path)
    # parameters are created uninitialised (torch.empty) directly in their final dtype and device
    with _default_dtype(dtype), torch.device(device):
        model = cls(config)
    blocks_only: set[str] = set()
    if checkpoint.gguf is not None and dtype == torch.bfloat16 and device.type == "cpu":
        # the GGUF's blocks first: the dense weights they replace are neither read nor dequantized
        _attach_quantized(model, checkpoint.gguf)
        blocks_only = _drop_dense_weights(model)
        fused_target = getattr(model, "fused_target", lambda name: (name, None))
        records = [r for r in records if fused_target(r.name)[0] not in blocks_only]
    total = sum(r.nbytes for r in records)
    bar = ProgressBar(path.name, total)
    read_start = time.perf_counter()
    tensors = checkpoint_tensors(records, device, options, bar.update)
    try:
        with Prefault(_fill_order(model, records)):
            loaded = model.load_weights(tensors)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except ValueError as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path}: {e}") from e
    finally:
        tensors.close()  # stops the reader thread now, not when the traceback is collected
        bar.close()
    read_s = time.perf_counter() - read_start
    missing = {name for name in model.expected_weights() - loaded if name.split("#")[0] not in blocks_only}
    if missing:  # the meta-device check rules this out; a guard against loaders that differ off meta
        raise CheckpointError(f"{path}: checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    model.eval()
    if dtype == torch.bfloat16 and device.type == "cpu":
        _attach_dense(model)
    _pack_cpu_weights(model)
    log.info("loaded %.2f GB in %.2f s (%.2f GB/s): %s (%s, %.1f M params), ready in %.1f s", total / 1e9, read_s,
             total / 1e9 / max(read_s, 1e-9), path.name, config.architecture,
             sum(p.numel() for p in model.parameters()) / 1e6, time.perf_counter() - start)
    return model, config


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _pack_cpu_weights(model: torch.nn.Module) -> None:
    """Give bf16 CPU linears (and the LM head) a oneDNN-prepacked weight (rtp/kernels/packed.py),
    unless their GGUF blocks serve every batch."""
    from rtp.kernels import packed

    count = 0
    for module in model.modules():
        quant = getattr(module, "quant", None)
        if quant is not None and quant.serves_every_batch:
            continue
        if hasattr(module, "packed") and packed.supported(module.weight):
            module.packed = packed.pack(module.weight)
            count += 1
    if count:
        log.info("prepacked %d bf16 linear weights for oneDNN", count)


def _drop_dense_weights(model: torch.nn.Module) -> set[str]:
    """Put on the meta device (its shape and dtype, no storage) the dense bf16 weight of every layer
    whose GGUF blocks serve every batch (tile order): nothing multiplies it, so the loader neither
    reads nor dequantizes it (they were most of the weights' memory and of the load's time), and a
    path that would still read it fails loudly. A weight the layer shares (a tied LM head's, the
    embedding's) stays. Returns the dropped parameters' names."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Module)
                  and not hasattr(m, "quant") and isinstance(getattr(m, "weight", None), torch.nn.Parameter)}
    freed, dropped = 0, set()
    for name, module in model.named_modules():
        quant = getattr(module, "quant", None)
        if (quant is None or not quant.serves_every_batch or id(module.weight) in embeddings
                or quant.kind == "bf16"):  # a dense layer's blocks are its weight
            continue
        freed += module.weight.numel() * module.weight.element_size()
        module.weight = torch.nn.Parameter(torch.empty_like(module.weight, device="meta"), requires_grad=False)
        dropped.add(f"{name}.weight")
    if freed:
        log.info("no dense copy of %.1f MB of weights that the GGUF blocks replace", freed / 1e6)
    return dropped


def _attach_dense(model: torch.nn.Module) -> None:
    """Give the bf16 linear layers no GGUF blocks reached (a safetensors checkpoint's, or a GGUF's
    F16/BF16/F32 tensors, a tied LM head's embedding) their weight as rtp's kernels take it
    (BlockQuantized.from_dense): the one-row kernel over the weight as it lies, the tile kernels over a
    copy in tile order, so that their steps replay CPU graphs too."""
    from rtp.kernels import cpu_kernels
    from rtp.kernels.quant import BlockQuantized

    if not cpu_kernels.available():
        return
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (not hasattr(module, "quant") or module.quant is not None or not isinstance(weight, torch.Tensor)
                or weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2
                or weight.shape[1] % 32 or weight.stride(1) != 1):
            continue
        module.quant = BlockQuantized.from_dense(weight).with_tile_layout(glu=getattr(module, "silu_mul_after", False))
        count += 1
    if count:
        log.info("%d bf16 layers multiplied by rtp's kernels", count)


def _attach_quantized(model: torch.nn.Module, gguf: GGUFCheckpoint) -> None:
    """Give linear layers the GGUF's packed blocks for small-batch decode (rtp/kernels/quant.py).

    A fused layer (qkv, gate_up) gets them only when every part is packed in one format;
    the LM head of a tied model takes the embedding's."""
    from rtp.kernels import cpu_kernels
    from rtp.kernels.quant import BlockParts, BlockQuantized

    if not cpu_kernels.available():
        return
    fused: dict[str, dict] = {}
    for name, blocks in gguf.quantized():
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
        if set(parts) == {None}:
            order = (None,)  # one tensor fused as the layer is (Phi-3's attn_qkv, ffn_up)
        if set(parts) != set(order):
            continue
        blocks = BlockQuantized.cat([parts[s] for s in order])
        if blocks is None and not getattr(layer, "silu_mul_after", False):
            blocks = BlockParts([parts[s] for s in order])  # each part its own layout and kernels
        if blocks is not None and blocks.shape == tuple(layer.weight.shape):
            layer.quant = blocks.on_huge_pages().with_tile_layout(glu=getattr(layer, "silu_mul_after", False))
            attached += 1
    log.info("%s: %d layers also keep their GGUF blocks for small-batch decode", gguf.path.name, attached)
