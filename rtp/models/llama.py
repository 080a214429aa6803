"""The Llama-family topology: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

HF-shaped (Attention / MLP / DecoderLayer / Model / ForCausalLM) so checkpoint
names map one to one, with q/k/v and gate/up fused into one matmul each. The
residual stream is kept in fp32 whatever the compute dtype: it is cheap and it
keeps bf16 greedy output close to the fp32 reference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from rtp.config import ModelConfig
from rtp.kernels import cpu_kernels
from rtp.models.attention import PagedAttention
from rtp.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    default_weight_loader,
)
from rtp.models.rotary import get_rope, rope_config_from_hf


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.qkv_bias)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = d
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size, bias=config.o_bias)
        base, scaling, partial = rope_config_from_hf(config.raw)
        self.rotary_emb = get_rope(d, None, config.max_position_embeddings, base, scaling,
                                   partial_rotary_factor=partial)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, d**-0.5, config.sliding_window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.attn.can_rope_and_store(qkv, positions, self.rotary_emb) and self._qk_norm_in_place(qkv):
            q = self.attn.rope_and_store(qkv, positions, self.rotary_emb)
            return self.o_proj(self.attn(q, None, None))
        q, k, v = qkv.split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
             self.num_kv_heads * self.head_dim], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))

    def _qk_norm_in_place(self, qkv: torch.Tensor) -> bool:
        """Whether qkv is ready for the fused RoPE + KV write: no q/k norm, or rtp's kernel just normed
        its q and k heads in place (False, qkv untouched: forward norms them in torch)."""
        if self.q_norm is None:
            return True
        if not cpu_kernels.qk_norm_supported(qkv, self.q_norm.weight, self.k_norm.weight, self.num_heads,
                                             self.num_kv_heads):
            return False
        cpu_kernels.qk_rms_norm(qkv, self.q_norm.weight, self.k_norm.weight, self.num_heads, self.num_kv_heads,
                                self.q_norm.eps)
        return True


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=config.mlp_bias)
        self.act = SiluAndMul()
        self.gate_up_proj.silu_mul_after = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj.silu_mul(x)  # one kernel on a CPU's packed blocks, else None
        return self.down_proj(self.act(self.gate_up_proj(x)) if h is None else h)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, residual: torch.Tensor,
                delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """residual [T, hidden] fp32 and the previous layer's output `delta` (not yet added:
        the add fuses into this layer's first norm) -> (residual, this layer's output)."""
        dtype = self.self_attn.o_proj.weight.dtype
        residual, x = self.input_layernorm.add_norm(residual, delta, dtype)
        h = self.self_attn(positions, x)
        residual, x = self.post_attention_layernorm.add_norm(residual, h, dtype)
        return residual, self.mlp(x)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, make_attention: Callable[[int], nn.Module],
                 make_mlp: Callable[[int], nn.Module]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, make_attention(i), make_mlp(i))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        residual = self.embed_tokens.embed_fp32(input_ids)
        delta = None
        for layer in self.layers:
            residual, delta = layer(positions, residual, delta)
        return self.norm.add_norm(residual, delta, torch.float32)[1]


class LlamaForCausalLM(nn.Module):
    # checkpoint name part -> (fused parameter name part, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.make_attention, self.make_mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_attention(self, layer: int) -> nn.Module:
        """The attention block of decoder layer `layer` (DeepSeek's MLA overrides this); it has
        an `o_proj` whose weight dtype is the layer's compute dtype."""
        return LlamaAttention(self.config)

    def make_mlp(self, layer: int) -> nn.Module:
        """The feed-forward block of decoder layer `layer` (mixture-of-experts models override this)."""
        return LlamaMLP(self.config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states [T, hidden] (fp32); logits come from compute_logits."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def fused_target(self, name: str) -> tuple[str, str | int | None]:
        """(our parameter name, shard id) of a checkpoint tensor: q/k/v and gate/up parts go
        to their fused projection; everything else maps to itself (shard None)."""
        for part, (fused, shard_id) in self.packed_modules_mapping.items():
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), shard_id
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into parameters; returns the parameters loaded."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the head
            target, shard = self.fused_target(name)
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {self.config.architecture}")
            loader = getattr(param, "weight_loader", default_weight_loader)
            with torch.no_grad():
                try:
                    loader(param, tensor, shard)
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from e
            loaded.add(target if shard is None else f"{target}#{shard}")
        return loaded

    def expected_weights(self) -> set[str]:
        """What load_weights must have seen for the model to be complete."""
        names = set()
        for name, _ in self.named_parameters():
            if ".qkv_proj." in name:
                names |= {f"{name}#q", f"{name}#k", f"{name}#v"}
            elif ".gate_up_proj." in name:
                names |= {f"{name}#0", f"{name}#1"}
            else:
                names.add(name)
        return names
