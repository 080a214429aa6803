"""OLMoE (AllenAI's OLMoE-1B-7B): a sparse block in every layer, with Qwen2-MoE's tensor names and router
(softmax over the experts, top-k, renormalised only where the config says), experts as wide as
`intermediate_size` and no shared expert; its attention norms the whole q and k projections (one
RMSNorm over all heads, where Qwen3 norms each head) before RoPE, then clamps q, k and v to
+-clip_qkv where the config sets it.
"""

from __future__ import annotations

import torch
from torch import nn

from rtp.config import ModelConfig
from rtp.models.layers import RMSNorm
from rtp.models.llama import LlamaAttention
from rtp.models.qwen2_moe import Qwen2MoeForCausalLM


class OlmoeAttention(LlamaAttention):
    def __init__(self, config: ModelConfig):
        super().__init__(config)
        if self.num_heads != config.num_attention_heads:
            # the norm spans every head: a rank holding some of them cannot compute it alone
            raise ValueError("OLMoE's q/k norm spans all heads: not with tensor parallelism")
        d = self.head_dim
        self.q_norm = RMSNorm(self.num_heads * d, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.num_kv_heads * d, config.rms_norm_eps)
        self.clip_qkv = config.raw.get("clip_qkv")

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        nq, nk = self.num_heads * d, self.num_kv_heads * d
        qkv = self.qkv_proj(x)
        q, k = qkv[:, :nq], qkv[:, nq:nq + nk]
        # normed in place, so that the fused RoPE + KV write below takes qkv as it does Llama's
        q.copy_(self.q_norm(q))
        k.copy_(self.k_norm(k))
        if self.clip_qkv is not None:
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        if self.attn.can_rope_and_store(qkv, positions, self.rotary_emb):
            return self.o_proj(self.attn(self.attn.rope_and_store(qkv, positions, self.rotary_emb), None, None))
        q, k, v = qkv.split([nq, nk, nk], dim=-1)
        q, k = self.rotary_emb(positions, q.reshape(t, self.num_heads, d), k.reshape(t, self.num_kv_heads, d))
        return self.o_proj(self.attn(q, k, v.reshape(t, self.num_kv_heads, d)))


class OlmoeForCausalLM(Qwen2MoeForCausalLM):
    def make_attention(self, layer: int) -> nn.Module:
        return OlmoeAttention(self.config)
