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

With `--kv-cache-dtype int8` the cache is int8 and the layer also holds `kv_scales`, fp32
[2, num_blocks, block_size, num_kv_heads]: one scale per token and kv head, indexed by the same
block ids (so the allocator, prefix cache and preemption need nothing new). A row is written as
`quantize_kv` says (symmetric absmax / 127; rtp's RoPE + KV-write kernel computes the same
numbers) and read back as scale * q: the kernels apply the scales to the scores and the
probabilities, the torch paths below dequantize the gathered blocks. K goes in times the
normalized Hadamard matrix where `rotates_kv(head_dim)` (q rotated alike, so every score is
unchanged): a head's few large channels, spread over all of them, no longer set one scale that
rounds the rest to a few levels.

The metadata reaches every layer through `forward_context(meta)`, a scoped
context the runner sets around the model call, not through each signature.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from rtp.kernels import cpu_kernels, quant


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
        """Bytes one token costs in dtype; int8 caches add their fp32 scale per part and head."""
        size = self.parts * self.heads * self.dim * torch.empty((), dtype=dtype).element_size()
        return size + (self.parts * self.heads * 4 if dtype == torch.int8 else 0)


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
    """Within: the step's attention metadata, and its decode rows for the linear layers
    (quant.decode_rows: --activation-dtype int8-prefill keeps them bf16)."""
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, meta
    try:
        with quant.decode_rows(meta.num_decode):
            yield meta
    finally:
        _CONTEXT = previous


def get_forward_context() -> AttentionMetadata:
    if _CONTEXT is None:
        raise RuntimeError("attention ran outside forward_context(): the runner sets the step metadata")
    return _CONTEXT


def rotates_kv(head_dim: int) -> bool:
    """Whether an int8 cache holds K times the normalized Hadamard matrix, q rotated alike so the
    scores are unchanged (a head dim that is a power of two, 16 or more): the rotation spreads a
    head's few large channels over all of them, so one absmax scale a row loses far less."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] times the normalized Sylvester Hadamard matrix, in fp32: the butterflies of a fast
    Walsh-Hadamard transform (a + b, a - b for each pair, strides 1, 2, 4, ...), then times 1/sqrt(D),
    in the order rtp_rope_store_kv runs them, so both give the same bits."""
    x = x.float()
    d, h = x.shape[-1], 1
    while h < d:
        pairs = x.unflatten(-1, (d // (2 * h), 2, h))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return x * (1.0 / math.sqrt(d))


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D], fp32 scales [...]): per row, symmetric absmax / 127, rounded to
    nearest even; a row of zeros gets scale 0. x is taken in its own dtype first (bf16 K/V: as a bf16
    cache would hold them), then computed in fp32 exactly as rtp_rope_store_kv does."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    q = torch.round(x * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, amax.div(127.0)


def dequantize_kv(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., D] with fp32 scales [...] -> [..., D] in dtype (the product in fp32, rounded once)."""
    return (q.float() * scales.unsqueeze(-1)).to(dtype)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     sliding_window: int | None, softcap: float | None = None,
                     k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per row. q [B, H, D] -> [B, H, D]. softcap: scores -> softcap * tanh(scores /
    softcap) before the mask (Gemma 2's attention logit softcapping). An int8 cache comes with its
    scales [blocks, block_size, Hkv]: the gathered blocks are dequantized to q's dtype."""
    b, h, d = q.shape
    kv_heads = k_cache.shape[2]
    # index_select on the flat table: 2-3x faster than advanced indexing on the CPU
    flat = block_tables.reshape(-1)
    k = k_cache.index_select(0, flat).view(b, -1, kv_heads, d)  # [B, W * block_size, Hkv, D]
    v = v_cache.index_select(0, flat).view(b, -1, kv_heads, d)
    if k_scales is not None:
        k = dequantize_kv(k, k_scales.index_select(0, flat).view(b, -1, kv_heads), q.dtype)
        v = dequantize_kv(v, v_scales.index_select(0, flat).view(b, -1, kv_heads), q.dtype)
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
                      softcap: float | None = None, k_scales: torch.Tensor | None = None,
                      v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """A chunk of n query tokens at the end of a context of row.context_len. q [n, H, D]. An int8
    cache comes with its scales, as decode_attention's."""
    length = row.context_len
    k = k_cache[row.block_ids].flatten(0, 1)[:length]  # [L, Hkv, D]
    v = v_cache[row.block_ids].flatten(0, 1)[:length]
    if k_scales is not None:
        k = dequantize_kv(k, k_scales[row.block_ids].flatten(0, 1)[:length], q.dtype)
        v = dequantize_kv(v, v_scales[row.block_ids].flatten(0, 1)[:length], q.dtype)
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
        # attention logit softcapping (Gemma 2): cap * tanh(scores / cap) before the mask, in rtp's
        # decode and prefill kernels (their softcap argument, 0 for none) and the torch paths alike
        self.softcap = softcap
        # bound by the runner once the cache is allocated: [2, blocks, block_size, Hkv, D]; with an
        # int8 cache also its scales, fp32 [2, blocks, block_size, Hkv] (module docstring)
        self.kv_cache: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None

    # rtp/engine/kv_cache.py: this layer reads and writes int8 caches (MLA's latent cache does not yet)
    accepts_int8_kv = True

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
        if self.kv_scales is not None:
            return cpu_kernels.rope_store_kv_int8(qkv, positions, rotary.cos_sin_cache, self.kv_cache, self.kv_scales,
                                                  meta.slot_mapping, self.num_heads, self.num_kv_heads)
        return cpu_kernels.rope_store_kv(qkv, positions, rotary.cos_sin_cache, self.kv_cache,
                                         meta.slot_mapping, self.num_heads, self.num_kv_heads)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (None: rope_and_store already wrote them) -> [T, H * D]."""
        meta = get_forward_context()
        k_cache, v_cache = self.kv_cache[0], self.kv_cache[1]
        scales = (None, None) if self.kv_scales is None else (self.kv_scales[0], self.kv_scales[1])
        if k is not None:
            if self.kv_scales is not None and rotates_kv(self.head_dim):  # as rtp_rope_store_kv writes int8 K
                q, k = hadamard(q).to(q.dtype), hadamard(k)
            self._store(k_cache, scales[0], meta.slot_mapping, k)
            self._store(v_cache, scales[1], meta.slot_mapping, v)
        dtype = q.dtype
        if self.kv_scales is None:  # attend in the cache's dtype; an int8 cache's is the model's
            q = q.to(k_cache.dtype)
        nd = meta.num_decode
        args = (meta.prefill_kernel_args() if meta.prefill and cpu_kernels.prefill_attention_supported(q, k_cache)
                else None)
        if args is not None:  # every prefill row in one call, written in place after the decode rows
            out = torch.empty_like(q)
            if nd:
                self._decode(q[:nd], k_cache, v_cache, meta, out=out[:nd])
            cpu_kernels.prefill_attention(q, k_cache, v_cache, *args, self.scale, self.sliding_window or 0, out=out,
                                          k_scales=scales[0], v_scales=scales[1], softcap=self.softcap or 0.0)
            return out.reshape(-1, self.num_heads * self.head_dim).to(dtype)
        parts = [self._decode(q[:nd], k_cache, v_cache, meta)] if nd else []
        for row in meta.prefill:
            parts.append(prefill_attention(q[row.query_start:row.query_end], k_cache, v_cache, row,
                                           self.scale, self.sliding_window, self.softcap, *scales))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim).to(dtype)

    def _store(self, cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, x: torch.Tensor) -> None:
        """K or V [T, Hkv, D] into the cache at slots: as they are, or quantized with their scales."""
        flat = cache.view(-1, self.num_kv_heads, self.head_dim)
        if scales is None:
            flat.index_copy_(0, slots, x.to(flat.dtype))
            return
        values, row_scales = quantize_kv(x)
        flat.index_copy_(0, slots, values)
        scales.view(-1, self.num_kv_heads).index_copy_(0, slots, row_scales)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """The decode rows' attention, written into out when given (rows of the step's output)."""
        scales = (None, None) if self.kv_scales is None else (self.kv_scales[0], self.kv_scales[1])
        if cpu_kernels.attention_supported(q, k_cache):
            window, cap = self.sliding_window or 0, self.softcap or 0.0
            if out is not None:
                return cpu_kernels.paged_decode_attention_into(q, k_cache, v_cache, meta.decode_block_tables,
                                                               meta.decode_seq_lens, self.scale, window, out, *scales,
                                                               softcap=cap)
            if scales[0] is not None:
                return cpu_kernels.paged_decode_attention_int8(q, k_cache, v_cache, *scales, meta.decode_block_tables,
                                                               meta.decode_seq_lens, self.scale, window, softcap=cap)
            return cpu_kernels.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                                      meta.decode_seq_lens, self.scale, window, softcap=cap)
        result = decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens,
                                  self.scale, self.sliding_window, self.softcap, *scales)
        if out is not None:
            out.copy_(result)
            return out
        return result
