"""The paged KV cache: one tensor per layer, sized from a memory budget.

Layer l's cache is [2, num_blocks, block_size, num_kv_heads, head_dim] (K, V).
Block 0 is the null block the runtime never hands out: padded tokens write
there and padded rows read from it.
"""

from __future__ import annotations

import torch

from rtp.config import ModelConfig


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, kv_heads: int) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * kv_heads * config.head_dim * itemsize


def num_blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, kv_heads: int,
                          budget_bytes: int) -> int:
    """Blocks (the null block included) that fit in budget_bytes."""
    return budget_bytes // bytes_per_block(config, block_size, dtype, kv_heads)


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    return [torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)]
