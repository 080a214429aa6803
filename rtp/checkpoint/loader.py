"""Checkpoints in, a ready model out.

A checkpoint (a Hugging Face safetensors directory or a GGUF file) is first
described without reading its weights (rtp/checkpoint/formats.py: config and one
record per tensor, every header validated); its config's sizes are held against
the tensors the records describe and the memory free (check_config_fits_checkpoint,
check_memory: one line naming the key, before anything is built); then it is checked
against the model: the model's own weight loaders run once over placeholder tensors
on the meta device, so a missing tensor, one with no place, or one whose shape disagrees with the
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
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import torch

from rtp._libc import malloc_trim
from rtp.checkpoint import Checkpoint, CheckpointError, TensorRecord, open_checkpoint, stream_tensors
from rtp.checkpoint.records import is_gguf
from rtp.checkpoint.prefault import Prefault
from rtp.config import ModelConfig
from rtp.distributed import world_rank, world_size
from rtp.models import model_class

__all__ = ["CheckpointError", "LoadOptions", "check_against_model", "check_config_fits_checkpoint",
           "check_memory", "checkpoint_tensors", "config_parameters", "load_model"]

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
    or dtype that disagrees with the config, or a parameter no tensor fills; first, for a config
    that implies far more parameters than the records hold (check_config_fits_checkpoint)."""
    check_config_fits_checkpoint(config, records, path)
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


# -- the config's sizes against the files' and the machine's -------------------------------------------
#
# ModelConfig.from_hf has checked each size on its own; here the sizes together, before anything is
# built: the parameters they imply (counted in Python integers, which cannot overflow) against the
# elements the checkpoint's headers describe, then against the memory free. Elements, not bytes: a
# quantized GGUF holds a few bits a weight, but its records give every tensor's dense shape.

# a config may imply at most this many times the parameters its checkpoint holds, plus _SLACK: the
# estimate leaves out norms and biases and is near, not exact, for DeepSeek's MLA, and a checkpoint
# may hold tensors rtp does not load (MTP layers); a config that misses by one layer is left to the
# tensor-by-tensor check, which names the tensor
_RATIO, _SLACK = 2, 1 << 20
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def config_parameters(config: ModelConfig) -> dict[str, int]:
    """The parameters `config` implies, by part (norms and biases left out: they are few); the
    `redundant` part is EPLB's spare expert slots, which no checkpoint holds."""
    h, layers = config.hidden_size, config.num_hidden_layers
    dense = set(config.mlp_only_layers)  # ModelConfig.is_moe_layer's rule, over a set
    moe = sum(1 for i in range(layers) if i not in dense and (i + 1) % config.decoder_sparse_step == 0
              ) if config.num_experts else 0
    expert = 3 * h * config.moe_intermediate_size
    return {
        "embedding": config.vocab_size * h,
        "lm_head": 0 if config.tie_word_embeddings else config.vocab_size * h,
        "attention": layers * 2 * h * config.head_dim * (config.num_attention_heads + config.num_key_value_heads),
        "mlp": (layers - moe) * 3 * h * config.intermediate_size,
        "experts": moe * config.num_experts * (expert + h),
        "shared_expert": moe * 3 * h * config.shared_expert_intermediate_size,
        "redundant": moe * config.num_redundant_experts * expert,
    }


def config_source(path: Path) -> str:
    """The file a checkpoint's config came from: its config.json, or the GGUF itself."""
    return str(path if is_gguf(path) else path / "config.json")


def check_config_fits_checkpoint(config: ModelConfig, records: Sequence[TensorRecord], path: Path) -> None:
    """CheckpointError naming the key most likely wrong when `config` implies far more parameters
    than `records` hold (_RATIO): 1,000 layers in the config of a checkpoint of 2."""
    implied = config_parameters(config)
    wanted = sum(implied.values()) - implied["redundant"]
    held = sum(math.prod(r.shape) for r in records)
    if wanted <= _RATIO * held + _SLACK:
        return
    key, why = _likely_wrong_key(config, records, implied)
    times = f", {wanted / held:,.0f}x" if held else ""
    raise CheckpointError(f"{config_source(path)} {key} = {config.raw.get(key, getattr(config, key, None))} "
                          f"implies {_amount(wanted)} parameters{times} the {_amount(held)} in its checkpoint "
                          f"({why})")


def _likely_wrong_key(config: ModelConfig, records: Sequence[TensorRecord],
                      implied: dict[str, int]) -> tuple[str, str]:
    """(config.json key, why) for a config too large for its checkpoint: a size the tensors
    themselves contradict (their layer and expert indices, the embedding's shape), else the
    key of the part of the estimate that dominates it."""
    layers = {int(m.group(1)) for r in records if (m := _LAYER.search(r.name))}
    if layers and config.num_hidden_layers > max(layers) + 1:
        return "num_hidden_layers", f"whose tensors are of {max(layers) + 1} layers"
    embedding = next((r for r in records if r.name.endswith("embed_tokens.weight") and len(r.shape) == 2), None)
    if embedding is not None:
        for key, size in zip(("vocab_size", "hidden_size"), embedding.shape):
            if getattr(config, key) > size:
                return key, f"whose {embedding.name} is {embedding.shape[0]} x {embedding.shape[1]}"
    experts = {int(m.group(1)) for r in records if (m := _EXPERT.search(r.name))}
    expert_key = next((k for k in ("num_experts", "num_local_experts", "n_routed_experts") if config.raw.get(k)),
                      "num_experts")
    if experts and config.num_experts > max(experts) + 1:
        return expert_key, f"whose tensors are of {max(experts) + 1} experts"
    part = max((p for p in implied if p != "redundant"), key=implied.__getitem__)
    key = {"embedding": "vocab_size", "lm_head": "vocab_size",
           "attention": "head_dim" if config.raw.get("head_dim") else "num_attention_heads",
           "mlp": "intermediate_size",
           "experts": "intermediate_size" if config.architecture == "MixtralForCausalLM" else "moe_intermediate_size",
           "shared_expert": "shared_expert_intermediate_size"}[part]
    return key, f"the config's {part.replace('_', ' ')} alone is {_amount(implied[part])}"


def check_memory(config: ModelConfig, records: Sequence[TensorRecord], path: Path, dtype: torch.dtype,
                 device: torch.device, *, blocks: bool = False) -> None:
    """CheckpointError saying how many GiB the model needs and how many are free, when its weights
    (this rank's share) and its RoPE table cannot fit in the memory free on `device` now. A lower
    bound, so that a model that fits is never refused: the weights as few as the config implies
    or the records hold, in `dtype` (`blocks`: a GGUF whose quantized blocks replace the dense
    weights: as many bytes as the file holds, if fewer); the table fp32, as rtp/models/rotary.py
    builds it, one per model."""
    free = _free_bytes(device)
    if free is None:
        return
    implied = config_parameters(config)
    held = sum(math.prod(r.shape) for r in records)
    weights = (min(sum(implied.values()) - implied["redundant"], held) + implied["redundant"]) * dtype.itemsize
    if blocks:
        weights = min(weights, sum(r.nbytes for r in records))
    weights //= world_size()
    raw = config.raw
    rotary_dim = raw.get("qk_rope_head_dim") or config.head_dim
    partial = raw.get("partial_rotary_factor")
    if isinstance(partial, float) and 0 < partial < 1:
        rotary_dim = int(rotary_dim * partial)
    rotary = config.max_position_embeddings * rotary_dim * 4
    need = weights + rotary
    if need <= free:
        return
    table = (f" and a {_gib(rotary)} RoPE table for max_position_embeddings {config.max_position_embeddings}"
             if rotary >= need // 4 else "")
    where = "on this host" if device.type == "cpu" else f"on {device}"
    raise CheckpointError(f"{path}: the model needs {_gib(need)} ({_gib(weights)} of "
                          f"{str(dtype).removeprefix('torch.')} weights{table}), but only {_gib(free)} is free {where}")


def _free_bytes(device: torch.device) -> int | None:
    """Bytes free on `device` now (a CPU: the host's MemAvailable); None where it cannot be told."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _gib(n: int) -> str:
    """Bytes in GiB (in MiB below a tenth of one)."""
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 // 10 else f"{n / 2**20:.1f} MiB"


def _amount(n: int) -> str:
    """A count of parameters, short: 33.8 M, 1.2 T."""
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return str(n)


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
    config = ModelConfig.from_hf(checkpoint.config, config_source(path))
    if redundant_experts:
        config = msgspec.structs.replace(config, num_redundant_experts=redundant_experts)
    cls = model_class([config.architecture])
    blocks = checkpoint.gguf is not None and dtype == torch.bfloat16 and device.type == "cpu"
    # the config's sizes against the files' and the free memory, before anything is built (the meta
    # model's RoPE table is real memory); check_against_model repeats the first, for convert's sake
    check_config_fits_checkpoint(config, records, path)
    check_memory(config, records, path, dtype, device, blocks=blocks)
    check_against_model(cls, config, records, path)
    # parameters are created uninitialised (torch.empty) directly in their final dtype and device
    with _default_dtype(dtype), torch.device(device):
        model = cls(config)
    blocks_only: set[str] = set()
    if blocks:
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
        _kernel_biases(model)
    _pack_cpu_weights(model)
    if device.type == "cpu" and malloc_trim is not None:
        # the GGUF blocks' repacks and the copies tile layouts were made from, freed, are holes in
        # the heap that glibc keeps: a 4-layer Qwen3-30B-A3B-shaped Q4_K file held 5.1 GB resident
        # after loading, 2.6 GB after this
        malloc_trim(0)
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

    def drop(name: str, module: torch.nn.Module, param: str) -> None:
        nonlocal freed
        weight = getattr(module, param)
        freed += weight.numel() * weight.element_size()
        setattr(module, param, torch.nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False))
        dropped.add(f"{name}.{param}")

    for name, module in model.named_modules():
        if getattr(module, "blocks", None) is not None:  # a MoE layer's experts (FusedMoE)
            drop(name, module, "w13")
            drop(name, module, "w2")
            continue
        quant = getattr(module, "quant", None)
        if (quant is None or not quant.serves_every_batch or id(module.weight) in embeddings
                or quant.kind == "bf16"):  # a dense layer's blocks are its weight
            continue
        drop(name, module, "weight")
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

    if not cpu_kernels.has_op("linear_bf16"):
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


def _kernel_biases(model: torch.nn.Module) -> None:
    """Give each layer rtp's kernels multiply its bias in fp32 (LinearBase.kernel_bias: what the kernels
    add), made once here: converted per call, as before, the copy was a torch op in every step, and a
    CPU graph refused Qwen2's qkv bias (its steps ran eagerly)."""
    for module in model.modules():
        if getattr(module, "quant", None) is not None and getattr(module, "bias", None) is not None:
            module.kernel_bias = module.bias.detach().float()


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
        reorder = getattr(layer.weight, "row_order", None)
        if blocks is not None and reorder is not None:  # a loader that reorders rows (DeepSeek's rope pairs)
            blocks = blocks.rows(reorder(blocks.shape[0]))
        if blocks is None and not getattr(layer, "silu_mul_after", False):
            blocks = BlockParts([parts[s] for s in order])  # each part its own layout and kernels
        if blocks is not None and blocks.shape == tuple(layer.weight.shape) and blocks.runs_here:
            layer.quant = blocks.on_huge_pages().with_tile_layout(glu=getattr(layer, "silu_mul_after", False))
            attached += 1
    log.info("%s: %d layers also keep their GGUF blocks for small-batch decode", gguf.path.name, attached)
    _attach_expert_blocks(model, fused, gguf.path.name)


def _attach_expert_blocks(model: torch.nn.Module, fused: dict[str, dict], file: str) -> None:
    """Serve each MoE layer's routed experts from the GGUF's blocks (rtp/models/expert_blocks.py), where
    every expert of the layer came packed and its blocks serve every batch here: this rank's slots'
    experts (expert parallelism: where each is one records tensor, which a placement sends between ranks)."""
    from rtp.distributed import ep_size
    from rtp.models.expert_blocks import ExpertBlocks
    from rtp.models.moe import ExpertShard, FusedMoE

    if os.environ.get("RTP_EXPERT_BLOCKS", "1") == "0":  # dense experts, as before (tools/bench_moe.py)
        return
    served = dense = 0
    for name, module in model.named_modules():
        if not isinstance(module, FusedMoE):
            continue
        w13, w2 = fused.get(f"{name}.w13", {}), fused.get(f"{name}.w2", {})
        if len(w2) != module.num_experts or len(w13) != 2 * module.num_experts:  # some expert not packed
            dense += 1
            continue
        # the identity placement: this rank's slot i holds expert slot_offset + i, the slots past the experts empty
        experts = range(module.slot_offset, min(module.slot_offset + module.local_slots, module.num_experts))
        parts = [[w13.get(ExpertShard(e, "gate")) for e in experts], [w13.get(ExpertShard(e, "up")) for e in experts],
                 [w2.get(ExpertShard(e, "down")) for e in experts]]
        blocks = ExpertBlocks.build(*parts, module.local_slots) if len(experts) else None
        if blocks is not None and ep_size() > 1 and not blocks.movable:
            blocks = None  # the avx2 path's blocks are several tensors an expert: its slots stay dense
        if blocks is None:
            dense += 1
            continue
        module.blocks = blocks
        served += 1
    if served or dense:
        log.info("%s: %d MoE layers serve their experts from the GGUF blocks%s", file, served,
                 f", {dense} from dense weights (their experts are not all packed in kinds rtp's kernels "
                 "multiply here)" if dense else "")
