"""The paged KV cache: one tensor per layer, sized from a memory budget.

Layer l's cache is [2, num_blocks, block_size, num_kv_heads, head_dim] (K, V).
Block 0 is the null block the runtime never hands out: padded tokens write
there and padded rows read from it.
"""

from __future__ import annotations

import torch

from rtp import hugepages
from rtp.config import ModelConfig


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, kv_heads: int) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * kv_heads * config.head_dim * itemsize


def num_kv_blocks(config: ModelConfig, *, block_size: int, dtype: torch.dtype, kv_heads: int,
                  max_model_len: int, max_num_seqs: int, budget_bytes: int | None,
                  device: torch.device) -> int:
    """Blocks to allocate (the null block included).

    The budget is kv_cache_memory bytes when given; otherwise 80 % of the free
    device memory on CUDA and 1 GiB on a CPU (SmolLM2 in bf16: about 46k tokens).
    Never more than max_num_seqs sequences of max_model_len can use, and never too
    few for one such sequence.
    """
    per_block = bytes_per_block(config, block_size, dtype, kv_heads)
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


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, kv_heads, head_dim)
    if device.type == "cpu":  # huge pages: decode reads blocks scattered over the whole cache
        return [hugepages.zeros(shape, dtype) for _ in range(num_layers)]
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
