"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of compressed latents.

Per token, MLA caches one vector shared by every head: c = [latent (kv_lora_rank C) |
rotated rope key (qk_rope_head_dim R)]. The layer's cache is [1, num_blocks,
block_size, 1, C + R] (KVCacheSpec(1, 1, C + R)), so a token costs (C + R) * itemsize
bytes per layer (DeepSeek-V3: 576 values) where multi-head attention would cache
2 * heads * head_dim (DeepSeek-V3's 128 heads: 40960 values).

kv_b_proj expands a latent into each head's key part, W_UK [H, N, C] (N = qk_nope_head_dim),
and value, W_UV [H, V, C]. The checkpoint interleaves them per head ([H, N + V, C]); the
loader stores them apart, W = [W_UK as [H * N, C] | W_UV as [H * V, C]] (the same rows
reordered), so decode reads each as one contiguous [H, *, C] batch of matrices (bmm over a
strided batch ran slower in bf16 on this CPU) and prefill's one matmul still yields every
head's key part and value. A head's score for a cached token is
q_nope . (W_UK c) + q_pe . k_pe = (W_UK^T q_nope) . c + q_pe . k_pe, and its output is
W_UV (sum_j p_j c_j), so attention can run in either form:

| rows    | form                                                                        |
|---------|-----------------------------------------------------------------------------|
| decode  | absorbed: q' = [W_UK^T q_nope | q_pe], [B, H, C + R], attends over the      |
|         | cached vectors as one shared head (values: their latent part), then W_UV    |
|         | maps each head's latent output to V dims. Reads C + R values per cached     |
|         | token, whatever the head count, and expands nothing                         |
| prefill | decompressed: K = [W_UK c | k_pe], V = W_UV c for the chunk and its cached  |
|         | prefix, then causal SDPA with head dims N + R and V: n queries share one     |
|         | expansion, cheaper than absorbing once n is large                           |

Both read the latents back from the cache after this step's are written, so the two forms
see the same (cache-dtype) values.
"""

from __future__ import annotations

import torch
from torch import nn

from rtp.models.attention import KVCacheSpec, causal_attention, get_forward_context


def absorbed_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per row: q_nope [B, H, N], q_pe [B, H, R], cache [blocks, block_size, C + R],
    w_uk [H, N, C], w_uv [H, V, C] -> [B, H, V]."""
    b = q_nope.shape[0]
    latent_dim = w_uk.shape[2]
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, C]
    q = torch.cat((q_latent, q_pe), dim=-1)                         # [B, H, C + R]
    # index_select on the flat table: 2-3x faster than advanced indexing on the CPU
    kv = cache.index_select(0, block_tables.reshape(-1)).view(b, -1, cache.shape[-1])  # [B, L, C + R]
    scores = torch.bmm(q, kv.transpose(1, 2)).float() * scale     # [B, H, L]
    pos = torch.arange(kv.shape[1], device=q.device)
    visible = pos[None, :] < seq_lens.clamp_min(1)[:, None]  # padded rows (length 0) read the null block
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(kv.dtype)
    out_latent = torch.bmm(probs, kv[..., :latent_dim])             # [B, H, C]
    return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [B, H, V]


class MLAAttention(nn.Module):
    """Writes this step's latents and rope keys into the layer's cache, then attends over it."""

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.scale = scale
        # bound by the runner once the cache is allocated: [1, blocks, block_size, 1, C + R]
        self.kv_cache: torch.Tensor | None = None

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(1, 1, self.kv_lora_rank + self.qk_rope_head_dim)

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                kv_b_proj: nn.Module) -> torch.Tensor:
        """q_nope [T, H, N], q_pe [T, H, R] (rotated), latent [T, C] (normed), k_pe [T, R] (rotated);
        kv_b_proj: the layer's C -> H * (N + V) projection, rows [W_UK | W_UV] (module docstring).
        Returns [T, H * V]."""
        meta = get_forward_context()
        cache = self.kv_cache[0, :, :, 0]  # [blocks, block_size, C + R]
        width = cache.shape[-1]
        cache.view(-1, width).index_copy_(0, meta.slot_mapping, torch.cat((latent, k_pe), dim=-1).to(cache.dtype))
        q_nope, q_pe = q_nope.to(cache.dtype), q_pe.to(cache.dtype)
        heads, nope, rope = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        nd = meta.num_decode
        parts = []
        if nd:
            w_uk, w_uv = kv_b_proj.weight.split([heads * nope, heads * self.v_head_dim])
            parts.append(absorbed_decode(q_nope[:nd], q_pe[:nd], cache, meta.decode_block_tables,
                                         meta.decode_seq_lens, w_uk.view(heads, nope, -1),
                                         w_uv.view(heads, self.v_head_dim, -1), self.scale))
        for row in meta.prefill:
            context = cache[row.block_ids].flatten(0, 1)[:row.context_len]  # [L, C + R]
            length = context.shape[0]
            k_nope, v = kv_b_proj(context[:, :self.kv_lora_rank]).split([heads * nope, heads * self.v_head_dim], dim=-1)
            k_nope, v = k_nope.view(length, heads, nope), v.view(length, heads, self.v_head_dim)
            k = torch.cat((k_nope, context[:, None, self.kv_lora_rank:].expand(length, heads, rope)), dim=-1)
            rows = slice(row.query_start, row.query_end)
            q = torch.cat((q_nope[rows], q_pe[rows]), dim=-1)
            parts.append(causal_attention(q, k, v, self.scale))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return out.reshape(out.shape[0], heads * self.v_head_dim)
