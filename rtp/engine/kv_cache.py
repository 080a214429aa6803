"""The paged KV cache: one tensor per layer, sized from a memory budget.

Each attention layer declares what it caches per token (its `kv_cache_spec`,
rtp/models/attention.py): layer l's cache is spec.shape(num_blocks, block_size),
[2, num_blocks, block_size, num_kv_heads, head_dim] (K, V) for standard attention,
[1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim] for MLA. Block 0
is the null block the runtime never hands out: padded tokens write there and
padded rows read from it.

With EPLB the caches are allocated for the pool's capacity, not its size: the budget's
blocks plus those the memory of the replica slots would pay for, which the pool is lent
when the replicas are dropped (BlockAllocator.grow, rtp/engine/expert_balancer.py). On a
CPU that costs nothing until used: the caches are anonymous memory committed page by page
as blocks are first written (rtp/kernels/hugepages.py), and `release_blocks` gives the pages of
blocks the pool hands back (BlockAllocator.shrink) to the OS again. The tensors never move,
so graphs captured over them stay valid through every resize.

`--kv-cache-dtype int8` (CPU, standard attention layers): each layer's cache is int8 and comes
with a scales tensor, fp32 [parts, num_blocks, block_size, heads] (`allocate_kv_scales`), one
scale per token and head, indexed by the same block ids; a block costs D + 4 bytes per token
and head instead of bf16's 2 D (KVCacheSpec.bytes_per_token), so the same budget holds about
twice the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rtp.kernels import hugepages
from rtp.models.attention import KVCacheSpec


KV_CACHE_DTYPES = ("auto", "bf16", "int8")  # CacheConfig.kv_cache_dtype


def resolve_kv_dtype(name: str, model_dtype: torch.dtype, device: torch.device, layers: Sequence) -> torch.dtype:
    """The torch dtype of the caches for `--kv-cache-dtype name`: auto is the model's dtype. What int8
    cannot do yet is refused here, at start-up, rather than run wrong."""
    if name == "auto":
        return model_dtype
    if name == "bf16":
        if model_dtype != torch.bfloat16 and not all(getattr(layer, "accepts_int8_kv", False) for layer in layers):
            raise ValueError(f"--kv-cache-dtype bf16 with a {model_dtype} model: its MLA layers attend in the "
                             f"cache's dtype; use --kv-cache-dtype auto or --dtype bfloat16")
        return torch.bfloat16
    if name != "int8":
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    if device.type != "cpu":
        raise ValueError(f"--kv-cache-dtype int8 runs on a CPU only (the {device.type} attention paths read bf16 "
                         f"caches); use --kv-cache-dtype auto")
    refused = sorted({type(layer).__name__ for layer in layers if not getattr(layer, "accepts_int8_kv", False)})
    if refused:
        raise ValueError(f"--kv-cache-dtype int8 is not supported by this model's {', '.join(refused)} layers "
                         f"(multi-head latent attention caches its latent in the model's dtype); use "
                         f"--kv-cache-dtype auto")
    return torch.int8


def bytes_per_block(specs: Sequence[KVCacheSpec], block_size: int, dtype: torch.dtype) -> int:
    """One block of every layer: what a block id costs."""
    return block_size * sum(spec.bytes_per_token(dtype) for spec in specs)


def num_kv_blocks(specs: Sequence[KVCacheSpec], *, block_size: int, dtype: torch.dtype,
                  max_model_len: int, max_num_seqs: int, budget_bytes: int | None,
                  device: torch.device) -> int:
    """Blocks to allocate (the null block included).

    The budget is kv_cache_memory bytes when given; otherwise 80 % of the free
    device memory on CUDA and 1 GiB on a CPU (SmolLM2 in bf16: about 46k tokens).
    Never more than max_num_seqs sequences of max_model_len can use, and never too
    few for one such sequence.
    """
    per_block = bytes_per_block(specs, block_size, dtype)
    if budget_bytes is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget_bytes = int(free * 0.8)
        else:
            budget_bytes = 1 << 30
    per_seq = -(-max_model_len // block_size)
    blocks = min(budget_bytes // per_block, max_num_seqs * per_seq + 1)
    if blocks < per_seq + 1:
        raise ValueError(f"a KV cache of {budget_bytes} bytes holds {blocks} blocks of {per_block} bytes: "
                         f"too few for one sequence of max_model_len {max_model_len}")
    return int(blocks)


def allocate_kv_cache(specs: Sequence[KVCacheSpec], num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: torch.device, committed: int | None = None) -> list[torch.Tensor]:
    """One zeroed cache per layer, shaped by the layer's spec, for num_blocks (the capacity).

    On a CPU the first `committed` blocks (default all) are written now, so that serving
    never waits on the kernel zeroing their pages; the rest cost nothing until used."""
    shapes = [spec.shape(num_blocks, block_size) for spec in specs]
    if device.type == "cpu":  # huge pages: decode reads blocks scattered over the whole cache
        caches = [hugepages.zeros(shape, dtype) for shape in shapes]
        for cache in caches:
            cache[:, :committed].zero_()
        return caches
    return [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]


def allocate_kv_scales(specs: Sequence[KVCacheSpec], num_blocks: int, block_size: int, device: torch.device,
                       committed: int | None = None) -> list[torch.Tensor]:
    """The scales of int8 caches: fp32 [parts, num_blocks, block_size, heads] per layer, zeroed as
    allocate_kv_cache zeroes its caches (block 0, the null block, reads back as zeros)."""
    shapes = [spec.shape(num_blocks, block_size)[:-1] for spec in specs]
    if device.type == "cpu":
        scales = [hugepages.zeros(shape, torch.float32) for shape in shapes]
        for s in scales:
            s[:, :committed].zero_()
        return scales
    return [torch.zeros(shape, dtype=torch.float32, device=device) for shape in shapes]


def release_blocks(caches: Sequence[torch.Tensor], start: int, stop: int) -> int:
    """Give the memory of blocks [start, stop) of every layer back to the OS (CPU only; their
    KV reads back as zeros, which nothing reads before writing: the pool no longer lists
    them). Returns the bytes released; 0 on CUDA, where the cache stays allocated. Any tensor
    with the block index as dim 1 can be listed: an int8 cache's scales too."""
    return sum(hugepages.release(cache[part, start:stop]) for cache in caches for part in range(cache.shape[0]))
