"""Attention over the paged KV cache, and the forward context that carries a step's metadata.

KV cache of one layer: a tensor [2, num_blocks, block_size, num_kv_heads, head_dim]
(K then V), as its `KVCacheSpec` says: the engine sizes and allocates each layer's
cache from the layer's spec, so MLA (rtp/models/mla.py) declares one of its own. A
step writes its new tokens' K/V at `slot_mapping` (slot = block * block_size +
offset) and then attends:

| rows                     | query tokens          | how                                            |
|--------------------------|-----------------------|------------------------------------------------|
| decode, [0, num_decode)  | one each, [0, nd)     | on a CPU with AVX-512 BF16: rtp's paged kernel |
|                          |                       | (reads blocks in place, online fp32 softmax);  |
|                          |                       | else gather each row's blocks, grouped matmul  |
|                          |                       | + fp32 softmax (on CPU 5-12x faster than bf16  |
|                          |                       | SDPA, see PERF_NOTES.md), masked by seq_lens   |
| prefill chunks           | a range each          | bf16 on a CPU with AVX-512 BF16: rtp's kernel  |
|                          |                       | (all chunks in one call, blocks read in place, |
|                          |                       | AMX tiles, online fp32 softmax); else gather   |
|                          |                       | the row's blocks (cached prefix + the chunk),  |
|                          |                       | scaled_dot_product_attention, causal from the  |
|                          |                       | chunk's offset                                 |

The metadata reaches every layer through `forward_context(meta)`, a scoped
context the runner sets around the model call, not through each signature.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from rtp.kernels import cpu_kernels


class KVCacheSpec(NamedTuple):
    """What one attention layer caches per token: `parts` tensors of [heads, dim] each (K and
    V: 2; MLA's compressed latent and rope key, side by side: 1).

    The layer's cache is [parts, num_blocks, block_size, heads, dim]. The block index is
    dim 1 for every model, so code that sizes, allocates or moves blocks (the engine, a
    prefill-to-decode transfer) needs nothing else from the model."""

    parts: int
    heads: int
    dim: int

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        return (self.parts, num_blocks, block_size, self.heads, self.dim)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.parts * self.heads * self.dim * torch.empty((), dtype=dtype).element_size()


@dataclass
class PrefillRow:
    query_start: int          # token range [query_start, query_end) in the step
    query_end: int
    context_len: int          # tokens of KV the row attends to, this chunk included
    block_ids: torch.Tensor   # the row's blocks, cdiv(context_len, block_size) of them


@dataclass
class PlanRows:
    """A step plan's per-row arrays (rtp/runtime/step_plan.pyx), as the runner holds them: what rtp's
    prefill kernel reads directly, so that a captured step replays whatever rows the next step has."""

    query_start_loc: torch.Tensor   # int32 [R + 1]: row r's tokens are [qsl[r], qsl[r + 1])
    seq_lens: torch.Tensor          # int32 [R]: keys row r attends to, this step's included
    block_tables: torch.Tensor      # int32 [R, W], rows contiguous


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor            # [T] int64
    block_size: int
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None   # [Bd, W] int32, zero past each row's blocks
    decode_seq_lens: torch.Tensor | None = None       # [Bd] int32
    prefill: list[PrefillRow] = field(default_factory=list)
    # the plan's arrays, when its prefill rows follow its decode rows token after token (the runner's
    # steps); prefill rows are then plan rows num_decode .. num_decode + len(prefill)
    plan: PlanRows | None = None
    _prefill_args: tuple | None = field(default=None, repr=False)

    def prefill_kernel_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int] | None:
        """The prefill rows as rtp's prefill kernel takes them: (query_start_loc, seq_lens, block_tables,
        first row, rows), the plan's own arrays when the runner gave them, else built once from the
        rows (every layer reuses them). None when the rows do not follow the decode rows token after
        token (the kernel writes its rows in place)."""
        if self.plan is not None:
            p = self.plan
            return p.query_start_loc, p.seq_lens, p.block_tables, self.num_decode, len(self.prefill)
        if self._prefill_args is None:
            next_token = self.num_decode
            for row in self.prefill:
                if row.query_start != next_token:
                    self._prefill_args = ()
                    return None
                next_token = row.query_end
            nd, n = self.num_decode, len(self.prefill)
            width = max(int(row.block_ids.shape[0]) for row in self.prefill)
            qsl = torch.zeros(nd + n + 1, dtype=torch.int32)
            lens = torch.zeros(nd + n, dtype=torch.int32)
            tables = torch.zeros(nd + n, max(width, 1), dtype=torch.int32)
            for i, row in enumerate(self.prefill):
                qsl[nd + i], qsl[nd + i + 1] = row.query_start, row.query_end
                lens[nd + i] = row.context_len
                tables[nd + i, : row.block_ids.shape[0]] = row.block_ids
            self._prefill_args = (qsl, lens, tables, nd, n)
        return self._prefill_args or None


_CONTEXT: AttentionMetadata | None = None


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata):
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, meta
    try:
        yield meta
    finally:
        _CONTEXT = previous


def get_forward_context() -> AttentionMetadata:
    if _CONTEXT is None:
        raise RuntimeError("attention ran outside forward_context(): the runner sets the step metadata")
    return _CONTEXT


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     sliding_window: int | None, softcap: float | None = None) -> torch.Tensor:
    """One query token per row. q [B, H, D] -> [B, H, D]. softcap: scores -> softcap * tanh(scores /
    softcap) before the mask (Gemma 2's attention logit softcapping)."""
    b, h, d = q.shape
    kv_heads = k_cache.shape[2]
    # index_select on the flat table: 2-3x faster than advanced indexing on the CPU
    flat = block_tables.reshape(-1)
    k = k_cache.index_select(0, flat).view(b, -1, kv_heads, d)  # [B, W * block_size, Hkv, D]
    v = v_cache.index_select(0, flat).view(b, -1, kv_heads, d)
    q = q.view(b, kv_heads, h // kv_heads, d)
    scores = torch.einsum("bhgd,blhd->bhgl", q, k).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    pos = torch.arange(k.shape[1], device=q.device)
    lens = seq_lens.clamp_min(1)[:, None]  # padded rows (length 0) read the null block, not NaN
    visible = pos[None, :] < lens
    if sliding_window is not None:
        visible &= pos[None, :] > lens - 1 - sliding_window
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.einsum("bhgl,blhd->bhgd", probs, v).reshape(b, h, d)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      row: PrefillRow, scale: float, sliding_window: int | None,
                      softcap: float | None = None) -> torch.Tensor:
    """A chunk of n query tokens at the end of a context of row.context_len. q [n, H, D]."""
    length = row.context_len
    k = k_cache[row.block_ids].flatten(0, 1)[:length]  # [L, Hkv, D]
    v = v_cache[row.block_ids].flatten(0, 1)[:length]
    return causal_attention(q, k, v, scale, sliding_window, softcap)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """n query tokens at the end of a context of L tokens: q [n, H, D], k [L, Hkv, D],
    v [L, Hkv, Dv] -> [n, H, Dv]. softcap: as decode_attention's (SDPA has none: plain matmuls)."""
    n, length = q.shape[0], k.shape[0]
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, L, D]
    # A leading batch dim of 1: with 4-D operands torch takes its flash kernel on the CPU;
    # the 3-D path falls back to the unfused math kernel.
    qh, k, v = q.transpose(0, 1)[None], k[None], v[None]  # [1, H, n, D], [1, Hkv, L, D]
    if n == length and sliding_window is None and softcap is None:
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        q_pos = torch.arange(length - n, length, device=q.device)[:, None]
        k_pos = torch.arange(length, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        if softcap is None:
            out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            rep = qh.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            scores = (qh @ k.transpose(-1, -2)).float() * scale
            scores = (torch.tanh(scores / softcap) * softcap).masked_fill(~mask, float("-inf"))
            out = torch.softmax(scores, dim=-1).to(v.dtype) @ v
    return out[0].transpose(0, 1)


class PagedAttention(nn.Module):
    """Writes this step's K/V into the layer's cache, then attends over the cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        # attention logit softcapping (Gemma 2): rtp's attention kernels have none, so such a
        # layer always attends through the torch paths below
        self.softcap = softcap
        # bound by the runner once the cache is allocated: [2, blocks, block_size, Hkv, D]
        self.kv_cache: torch.Tensor | None = None

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(2, self.num_kv_heads, self.head_dim)

    def can_rope_and_store(self, qkv: torch.Tensor, positions: torch.Tensor, rotary) -> bool:
        """Whether rope_and_store takes this fused qkv output (rtp's CPU kernel; a rotary_dim below
        head_dim, Phi-4-mini's partial rotary, passes the other dims through as RotaryEmbedding does)."""
        return (qkv.shape[-1] == (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
                and cpu_kernels.rope_supported(qkv, self.kv_cache, rotary.cos_sin_cache, positions, self.head_dim))

    def rope_and_store(self, qkv: torch.Tensor, positions: torch.Tensor, rotary) -> torch.Tensor:
        """Rotate q and k of qkv [T, (H + 2 Hkv) D] in one pass, write k and v into the cache;
        returns q [T, H, D]. Attend with forward(q, None, None)."""
        meta = get_forward_context()
        return cpu_kernels.rope_store_kv(qkv, positions, rotary.cos_sin_cache, self.kv_cache,
                                         meta.slot_mapping, self.num_heads, self.num_kv_heads)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (None: rope_and_store already wrote them) -> [T, H * D]."""
        meta = get_forward_context()
        k_cache, v_cache = self.kv_cache[0], self.kv_cache[1]
        if k is not None:
            flat_k = k_cache.view(-1, self.num_kv_heads, self.head_dim)
            flat_v = v_cache.view(-1, self.num_kv_heads, self.head_dim)
            flat_k.index_copy_(0, meta.slot_mapping, k.to(flat_k.dtype))
            flat_v.index_copy_(0, meta.slot_mapping, v.to(flat_v.dtype))
        q = q.to(k_cache.dtype)
        nd = meta.num_decode
        args = (meta.prefill_kernel_args() if meta.prefill and self.softcap is None
                and cpu_kernels.prefill_attention_supported(q, k_cache) else None)
        if args is not None:  # every prefill row in one call, written in place after the decode rows
            out = torch.empty_like(q)
            if nd:
                self._decode(q[:nd], k_cache, v_cache, meta, out=out[:nd])
            cpu_kernels.prefill_attention(q, k_cache, v_cache, *args, self.scale, self.sliding_window or 0, out=out)
            return out.reshape(-1, self.num_heads * self.head_dim)
        parts = [self._decode(q[:nd], k_cache, v_cache, meta)] if nd else []
        for row in meta.prefill:
            parts.append(prefill_attention(q[row.query_start:row.query_end], k_cache, v_cache, row,
                                           self.scale, self.sliding_window, self.softcap))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """The decode rows' attention, written into out when given (rows of the step's output)."""
        if self.softcap is None and cpu_kernels.attention_supported(q, k_cache):
            if out is not None:
                return cpu_kernels.paged_decode_attention_into(q, k_cache, v_cache, meta.decode_block_tables,
                                                               meta.decode_seq_lens, self.scale,
                                                               self.sliding_window or 0, out)
            return cpu_kernels.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                                      meta.decode_seq_lens, self.scale, self.sliding_window or 0)
        result = decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens,
                                  self.scale, self.sliding_window, self.softcap)
        if out is not None:
            out.copy_(result)
            return out
        return result
