"""Gemma 2 and Gemma 3 (text): transformers' Gemma2ForCausalLM and Gemma3ForCausalLM.

The Llama topology (fused qkv and gate_up, the same weight loaders and tensor-parallel
shards, an fp32 residual stream) with Gemma's differences:

  embeddings    scaled by sqrt(hidden_size), the factor and the product in the model's
                dtype as transformers computes them; the LM head shares the unscaled table
  RMSNorm       x * (1 + weight): the +1 is folded into the weight as it loads (GemmaRMSNorm),
                so rtp's RMSNorm and its fused add + norm kernel apply unchanged
  four norms    per layer: input, post-attention (on the attention's output, before the
                residual add), pre-feedforward, post-feedforward (on the MLP's output)
  q/k norm      Gemma 3: an RMSNorm over each head of q and k before RoPE
  MLP           GeGLU: gelu(gate) * up, tanh-approximated (hidden_activation gelu_pytorch_tanh)
  attention     scaled by query_pre_attn_scalar ** -0.5; local layers (layer_types, or every
                layer but each sliding_window_pattern-th) see their last sliding_window tokens
                only, global layers everything; Gemma 3 rotates local layers with
                rope_local_base_freq and global ones with rope_theta and rope_scaling
  softcapping   attn_logit_softcapping (Gemma 2): cap * tanh(scores / cap) before the mask and the
                softmax, by PagedAttention (rtp's decode and prefill kernels take the cap, and so do
                its torch paths); final_logit_softcapping the same on the logits

The sliding window is applied by PagedAttention per layer, in prefill (rtp's kernel and the
torch path) and decode alike; the paged KV cache still keeps every token's K/V of a local
layer (blocks outside the window are not freed early).

GGUF: llama.cpp stores the norm weights as 1 + w; rtp/checkpoint/gguf.py gives them back as w,
so both formats load through the same loaders.

CPU graphs (rtp/kernels/cpu_graph.py): in bf16 on a CPU with rtp's kernels, every op of a Gemma 2
or Gemma 3 step is one of them, so its decode, prefill and mixed steps are captured and replayed as
the Llama family's are: the embedding scale inside the embedding kernel (the product rounded to the
table's dtype, as transformers rounds it), the (Gemma 3) q/k norm of each head in place inside the fused qkv output
and then the same RoPE + KV-write kernel as Llama's, the post-attention and post-feedforward
RMSNorms over the bf16 block outputs, GELU(tanh)-and-mul, and the final logit softcapping in
place on the fp32 logits (rtp/kernels/csrc/activation.c), and Gemma 2's attn_logit_softcapping
inside the attention kernels, on each scaled score before the online softmax (a word of their
recorded calls, as the scale; 0 for Gemma 3, which then runs the kernels' uncapped loops). fp32
models are refused capture and run eagerly (torch's linears), as Llama's are. One
request's decode step of a random bf16 Gemma 3, hidden 512 and 8 layers, on 2 cores with AMX
(python tools/bench_gemma_decode.py, medians): 2.1-2.2 ms replayed, 3.9-4.2 ms eager.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rtp.config import ModelConfig
from rtp.kernels import cpu_kernels
from rtp.models.attention import PagedAttention
from rtp.models.layers import (
    GeluAndMul,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    _copy_checked,
)
from rtp.models.llama import LlamaAttention, LlamaForCausalLM
from rtp.models.rotary import get_rope, rope_config_from_hf

SLIDING, FULL = "sliding_attention", "full_attention"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm, norm(x) * (1 + weight), as rtp's RMSNorm: the checkpoint's weight w is
    stored as 1 + w when it loads. The parameter stays fp32 whatever the model's dtype: transformers
    adds the 1 in fp32, and 1 + w rounded to bf16 would lose most of w (its bits below 2^-8)."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.weight.weight_loader = self.weight_loader

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy_checked(param.data, loaded.float() + 1.0, "Gemma RMSNorm weight")


def layer_types(config: ModelConfig) -> list[str]:
    """Each layer's kind, sliding_attention (local) or full_attention (global): config.json's
    layer_types, else every sliding_window_pattern-th layer global (Gemma 3: 6, Gemma 2: 2)."""
    raw, n = config.raw, config.num_hidden_layers
    types = raw.get("layer_types")
    if types is None:
        default = 6 if config.architecture == "Gemma3ForCausalLM" else 2
        pattern = raw.get("sliding_window_pattern") or default
        return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    if len(types) < n or set(types[:n]) - {SLIDING, FULL}:
        raise ValueError(f"config layer_types must name {SLIDING} or {FULL} for each of {n} layers, got {types}")
    return list(types[:n])


def rope_for(config: ModelConfig, kind: str) -> tuple[float, dict | None, float]:
    """(base, rope_scaling, partial factor) of a layer kind, from either config layout:
    transformers 5 writes rope_parameters with one dict per layer kind; 4.x configs carry
    rope_theta and rope_scaling (global layers) and rope_local_base_freq (Gemma 3's local ones)."""
    raw = config.raw
    gemma3 = config.architecture == "Gemma3ForCausalLM"
    params = raw.get("rope_parameters")
    rest = {k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    if isinstance(params, dict) and {SLIDING, FULL} & params.keys():
        own = dict(params.get(kind) or {"rope_type": "default"})  # transformers' default for a missing kind
        own.setdefault("rope_theta", 10_000.0 if kind == SLIDING or not gemma3 else 1_000_000.0)
        return rope_config_from_hf({**rest, "rope_parameters": own})
    if gemma3 and kind == SLIDING:  # local layers: their own base, never scaled
        return rope_config_from_hf({**rest, "rope_theta": raw.get("rope_local_base_freq", 10_000.0)})
    if gemma3 and "rope_theta" not in raw and not (params or {}).get("rope_theta"):
        return rope_config_from_hf({**raw, "rope_theta": 1_000_000.0})
    return rope_config_from_hf(raw)


class GemmaAttention(LlamaAttention):
    """Llama's attention step (fused qkv, q/k norm before RoPE, paged attention) over Gemma's parts:
    its own scale, per-kind window and RoPE base, (1 + w) q/k norms, logit softcapping."""

    def __init__(self, config: ModelConfig, kind: str):
        nn.Module.__init__(self)  # the parts differ from Llama's throughout: built here, not there
        raw = config.raw
        d = config.head_dim
        bias = bool(raw.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = d
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size, bias=bias)
        base, scaling, partial = rope_for(config, kind)
        self.rotary_emb = get_rope(d, None, config.max_position_embeddings, base, scaling,
                                   partial_rotary_factor=partial)
        gemma3 = config.architecture == "Gemma3ForCausalLM"
        self.q_norm = GemmaRMSNorm(d, config.rms_norm_eps) if gemma3 else None
        self.k_norm = GemmaRMSNorm(d, config.rms_norm_eps) if gemma3 else None
        window = raw.get("sliding_window") if kind == SLIDING else None
        scale = float(raw.get("query_pre_attn_scalar") or d) ** -0.5
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, scale, window or None,
                                   softcap=raw.get("attn_logit_softcapping") or None)


class GemmaMLP(nn.Module):
    """down(gelu(gate) * up); the activation tanh-approximated for gelu_pytorch_tanh (rtp's GELU(tanh)-and-mul
    kernel on bf16 rows)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=False)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=False)
        self.act = GeluAndMul("none" if config.hidden_act == "gelu" else "tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kind: str):
        super().__init__()
        self.self_attn = GemmaAttention(config, kind)
        self.mlp = GemmaMLP(config)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, residual: torch.Tensor,
                delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """residual [T, hidden] fp32 and the previous layer's output `delta` (its add fuses
        into this layer's first norm) -> (residual, this layer's output)."""
        dtype = self.self_attn.o_proj.weight.dtype
        residual, x = self.input_layernorm.add_norm(residual, delta, dtype)
        h = self.post_attention_layernorm(self.self_attn(positions, x))
        residual, x = self.pre_feedforward_layernorm.add_norm(residual, h, dtype)
        return residual, self.post_feedforward_layernorm(self.mlp(x))


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, kind) for kind in layer_types(config))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # sqrt(hidden_size) rounded to the model's dtype, as transformers rounds it (in bf16,
        # sqrt(3072) = 55.43 becomes 55.5); a Python float, exact in that dtype
        dtype = torch.get_default_dtype()
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32,
                                        device="cpu").to(dtype).item()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        residual = self.embed_tokens.embed_fp32(input_ids, self.embed_scale)  # the product in the model's dtype
        delta = None
        for layer in self.layers:
            residual, delta = layer(positions, residual, delta)
        return self.norm.add_norm(residual, delta, torch.float32)[1]


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (model_type gemma2, gemma3_text). Checkpoint names
    and weight loading are the Llama family's (LlamaForCausalLM.load_weights)."""

    def __init__(self, config: ModelConfig):
        nn.Module.__init__(self)
        raw: dict[str, Any] = config.raw
        if raw.get("use_bidirectional_attention"):
            raise ValueError(f"{config.architecture} with use_bidirectional_attention (an embedding model) is "
                             "not supported: rtp's attention is causal")
        self.config = config
        self.model = GemmaModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_logit_softcapping = raw.get("final_logit_softcapping") or None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.final_logit_softcapping
        if cap is not None:
            if cpu_kernels.softcap_supported(logits):
                cpu_kernels.softcap(logits, cap)  # in place: the LM head's fp32 output is the step's own
            else:
                logits = torch.tanh(logits / cap) * cap
        return logits
