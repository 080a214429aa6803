"""DeepSeek-V3 (and V2): multi-head latent attention and a routed mixture of experts.

The Llama topology (fp32 residual stream, pre-norm layers) with two blocks of its own:

- attention (`DeepseekV3Attention`): queries through a low-rank bottleneck (q_a_proj,
  q_a_layernorm, q_b_proj; or one q_proj when q_lora_rank is None), keys and values
  from a compressed latent (kv_a_proj_with_mqa -> latent + one rope key shared by all
  heads; kv_b_proj expands the latent). Only the latent and the rope key are cached
  (rtp/models/mla.py). RoPE (YaRN for the released checkpoints) rotates only the
  qk_rope_head_dim dims; with YaRN the softmax scale grows by mscale(factor,
  mscale_all_dim)^2, as DeepSeek's reference does.
- feed-forward: the first `first_k_dense_replace` layers (and those off `moe_layer_freq`)
  are dense MLPs; the others route each token to top-k of n_routed_experts experts
  (`DeepseekV3Router`: sigmoid scores, a correction bias used only to choose, top-k
  within the best topk_group of n_group groups, routed_scaling_factor) computed by
  FusedMoE, plus n_shared_experts shared experts every token goes through. DeepSeek-V2
  (`DeepseekV2Router`, scoring_func softmax) scores by a softmax instead, with no bias,
  and limits the choice to the groups whose best score is highest.

DeepSeek's checkpoints lay each head's rope dims out as interleaved pairs (x0, x1),
(x2, x3), ... (config `rope_interleave`, on by default). The loader reorders those rows
of q_b_proj (q_proj) and kv_a_proj_with_mqa to evens then odds, which turns the pairwise
rotation into rtp's half-split one; q and k are reordered alike, so q . k is unchanged
and nothing is permuted per step.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from functools import partial
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from rtp.config import ModelConfig
from rtp.distributed import tp_rank, tp_size
from rtp.models.layers import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RMSNorm,
    RowParallelLinear,
    _copy_checked,
)
from rtp.models.llama import LlamaMLP
from rtp.models.mixtral import MixtralForCausalLM
from rtp.models.mla import MLAAttention
from rtp.models.moe import FusedMoE, TopKRouter
from rtp.models.rotary import get_rope, rope_config_from_hf

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(config: ModelConfig) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN with mscale_all_dim set."""
    raw = config.raw
    scale = (raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"]) ** -0.5
    _, scaling, _ = rope_config_from_hf(raw)
    if scaling and scaling.get("mscale_all_dim"):
        scale *= _yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


def _group_order(rows: int, row_group: int, rope: int) -> torch.Tensor:
    """The row order that moves the last `rope` rows of every `row_group` rows from interleaved pairs to
    evens then odds (see the module docstring): index i of the result is the source row of row i."""
    # built on the CPU whatever the default device (models are built under torch.device(...))
    first = row_group - rope
    order = torch.cat([torch.arange(a, b, step, device="cpu")
                       for a, b, step in ((0, first, 1), (first, row_group, 2), (first + 1, row_group, 2))])
    return (torch.arange(0, rows, row_group, device="cpu")[:, None] + order).reshape(-1)


def _deinterleaving(loader: Callable, row_group: int, rope: int) -> Callable:
    """A weight loader that first reorders the rows in `_group_order`."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] % row_group:
            raise ValueError(f"{loaded.shape[0]} rows are not groups of {row_group}")
        order = _group_order(loaded.shape[0], row_group, rope).to(loaded.device)
        loader(param, loaded.index_select(0, order), shard_id)

    return load


def _deinterleave_rope_rows(linear: nn.Module, row_group: int, rope: int) -> None:
    for param in (linear.weight, linear.bias):
        if param is not None:
            param.weight_loader = _deinterleaving(param.weight_loader, row_group, rope)
            # the loader's general hook for weights kept in another form (a GGUF's blocks): the same order
            param.row_order = partial(_group_order, row_group=row_group, rope=rope)


def _kv_b_loader(nope: int, v_head_dim: int) -> Callable:
    """kv_b_proj's loader: this rank's heads, their key rows (all heads) then their value rows
    (rtp/models/mla.py), from the checkpoint's per-head [H, N + V, C] rows."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        per_head = nope + v_head_dim
        if loaded.dim() != 2 or loaded.shape[0] % (per_head * tp_size()):
            raise ValueError(f"kv_b_proj: checkpoint shape {tuple(loaded.shape)} is not heads of {per_head} rows")
        heads = loaded.shape[0] // per_head // tp_size()
        w = loaded.reshape(-1, per_head, loaded.shape[1]).narrow(0, tp_rank() * heads, heads)
        _copy_checked(param.data, torch.cat((w[:, :nope].flatten(0, 1), w[:, nope:].flatten(0, 1))), "kv_b_proj")

    return load


class DeepseekV3Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        raw = config.raw
        hidden, heads = config.hidden_size, config.num_attention_heads
        if heads % tp_size():
            raise ValueError(f"{heads} attention heads do not split over {tp_size()} tensor-parallel ranks")
        self.num_heads = heads // tp_size()
        self.q_lora_rank = raw.get("q_lora_rank")
        self.kv_lora_rank = raw["kv_lora_rank"]
        self.qk_nope_head_dim = raw["qk_nope_head_dim"]
        self.qk_rope_head_dim = rope = raw["qk_rope_head_dim"]
        self.v_head_dim = raw["v_head_dim"]
        qk_head_dim = self.qk_nope_head_dim + rope
        bias = bool(raw.get("attention_bias", False))
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)  # DeepSeek's norms inside attention: eps 1e-6
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk_head_dim)
            q_out = self.q_b_proj
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_head_dim)
            q_out = self.q_proj
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim))
        self.kv_b_proj.weight.weight_loader = _kv_b_loader(self.qk_nope_head_dim, self.v_head_dim)
        self.o_proj = RowParallelLinear(heads * self.v_head_dim, hidden, bias=bias)
        if raw.get("rope_interleave", True):
            _deinterleave_rope_rows(q_out, qk_head_dim, rope)
            _deinterleave_rope_rows(self.kv_a_proj_with_mqa, self.kv_lora_rank + rope, rope)
        base, scaling, _ = rope_config_from_hf(raw)
        self.rotary_emb = get_rope(rope, None, config.max_position_embeddings, base, scaling)
        self.attn = MLAAttention(self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim, rope,
                                 self.v_head_dim, softmax_scale(config))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q_nope, q_pe = q.view(t, self.num_heads, -1).split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.unsqueeze(1))
        out = self.attn(q_nope, q_pe, self.kv_a_layernorm(latent), k_pe[:, 0], self.kv_b_proj)
        return self.o_proj(out)


class DeepseekV3Router(TopKRouter):
    """logits [T, E] -> (weights [T, k] fp32, expert ids [T, k]), DeepSeek-V3's noaux_tc routing.

    Scores are sigmoid(logits) (the gate's logits in fp32, as DeepSeek keeps the gate in
    fp32). Experts are *chosen* by score + e_score_correction_bias (the bias balances load
    without an auxiliary loss) within the topk_group groups whose two best biased scores sum
    highest, and *weighted* by their unbiased scores, renormalised to 1 when norm_topk_prob,
    then scaled by routed_scaling_factor. Holds the gate's weight itself, so checkpoint
    names (`mlp.gate.weight`, `mlp.gate.e_score_correction_bias`) map as they are; called on
    the logits (`logits`), as every router is."""

    softmax_top_k = False

    def __init__(self, config: ModelConfig):
        raw = config.raw
        super().__init__(config.num_experts_per_tok, config.norm_topk_prob)
        experts = config.num_experts
        self.n_group = raw.get("n_group") or 1
        self.topk_group = raw.get("topk_group") or self.n_group
        self.routed_scaling_factor = float(raw.get("routed_scaling_factor") or 1.0)
        if experts % self.n_group or experts // self.n_group < 2 or not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"{experts} experts in n_group {self.n_group} (topk_group {self.topk_group}): groups "
                             f"must split the experts evenly, two or more each")
        if self.top_k > self.topk_group * (experts // self.n_group):
            raise ValueError(f"top-{self.top_k} does not fit in {self.topk_group} groups of {experts // self.n_group}")
        if raw.get("scoring_func", "sigmoid") != "sigmoid" or raw.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError(f"DeepSeek-V3 routing is sigmoid / noaux_tc, got {raw.get('scoring_func')} / "
                             f"{raw.get('topk_method')}")
        self.weight = nn.Parameter(torch.empty(experts, config.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.empty(experts, dtype=torch.float32))

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(logits.float())

    def select(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, experts = scores.shape
        biased = scores + self.e_score_correction_bias
        grouped = biased.view(tokens, self.n_group, experts // self.n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)                 # [T, G]
        biased = _in_best_groups(grouped, group_score, self.topk_group, float("-inf"))
        ids = biased.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The gate's logits [T, E], in fp32 as DeepSeek keeps the gate."""
        return F.linear(x.float(), self.weight)


class DeepseekV2Router(TopKRouter):
    """logits [T, E] -> (weights [T, k] fp32, expert ids [T, k]), DeepSeek-V2's routing (scoring_func softmax).

    Scores are the softmax of the gate's fp32 logits; topk_method "greedy" takes the top k of all experts,
    "group_limited_greedy" the top k within the topk_group of n_group groups whose best score is highest.
    The weights are the chosen scores, renormalised to 1 when norm_topk_prob (DeepSeek's own code does;
    the released V2 models say False), times routed_scaling_factor. Holds the gate's weight itself, as
    DeepseekV3Router does."""

    def __init__(self, config: ModelConfig):
        raw = config.raw
        super().__init__(config.num_experts_per_tok, bool(config.norm_topk_prob))
        experts = config.num_experts
        method = raw.get("topk_method") or "greedy"
        self.n_group = (raw.get("n_group") or 1) if method == "group_limited_greedy" else 1
        self.topk_group = (raw.get("topk_group") or self.n_group) if self.n_group > 1 else 1
        self.routed_scaling_factor = float(raw.get("routed_scaling_factor") or 1.0)
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"DeepSeek-V2 routing is topk_method greedy or group_limited_greedy, got {method!r}")
        if experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"{experts} experts in n_group {self.n_group} (topk_group {self.topk_group}): groups "
                             "must split the experts evenly")
        if self.top_k > self.topk_group * (experts // self.n_group):
            raise ValueError(f"top-{self.top_k} does not fit in {self.topk_group} groups of {experts // self.n_group}")
        # the plain softmax top k, unscaled: what the one-call MoE kernel routes with itself
        self.softmax_top_k = self.n_group == 1 and self.routed_scaling_factor == 1.0
        self.weight = nn.Parameter(torch.empty(experts, config.hidden_size, dtype=torch.float32))

    def select(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.n_group > 1:
            tokens, experts = scores.shape
            grouped = scores.view(tokens, self.n_group, experts // self.n_group)
            scores = _in_best_groups(grouped, grouped.amax(dim=-1), self.topk_group, 0.0)
        weights, ids = super().select(scores)
        return weights * self.routed_scaling_factor, ids

    logits = DeepseekV3Router.logits


def _in_best_groups(grouped: torch.Tensor, group_score: torch.Tensor, topk_group: int, fill: float) -> torch.Tensor:
    """grouped [T, G, E/G] as [T, E], `fill` where an expert is outside the topk_group groups of the highest
    group_score [T, G]: group-limited routing's choice, V3's and V2's alike."""
    best_groups = group_score.topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best_groups, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), fill).flatten(1)


def _v2_routing(config: ModelConfig) -> bool:
    """Whether the experts are routed as DeepSeek-V2's (softmax scores), not V3's (sigmoid, noaux_tc)."""
    default = "softmax" if config.raw.get("model_type") == "deepseek_v2" else "sigmoid"  # V2 configs may not say
    return config.raw.get("scoring_func", default) == "softmax"


class DeepseekV3MoE(nn.Module):
    """Routed experts (FusedMoE) plus the shared experts, one MLP of n_shared_experts * moe_intermediate_size."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = DeepseekV2Router(config) if _v2_routing(config) else DeepseekV3Router(config)
        self.experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                num_slots=config.num_experts + config.num_redundant_experts)
        shared = config.raw.get("n_shared_experts") or 0
        self.shared_experts = LlamaMLP(config, config.moe_intermediate_size * shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden] fp32."""
        # one kernel call where the experts are GGUF blocks and the router is V2's plain top k (FusedMoE.routed)
        out = self.experts.routed(x, self.gate.logits(x), self.gate)
        if self.shared_experts is not None:
            out = out.add_(self.shared_experts(x).float())
        return out


def _joined_kv_b(weights: Iterable[tuple[str, torch.Tensor]], nope: int, v_head_dim: int):
    """weights with each layer's k_b_proj [H, C, N] and v_b_proj [H, V, C] (llama.cpp's split of kv_b_proj,
    rtp/checkpoint/gguf_deepseek.py) replaced by kv_b_proj [H * (N + V), C], the checkpoint's rows: per
    head its N key rows (k_b transposed back), then its V value rows. Either half waits for the other."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        stem, _, part = name.rpartition(".self_attn.")
        if part not in ("k_b_proj.weight", "v_b_proj.weight"):
            yield name, tensor
            continue
        pair = halves.setdefault(stem, {})
        pair[part] = tensor
        if len(pair) < 2:
            continue
        pair = halves.pop(stem)
        k_b, v_b = pair["k_b_proj.weight"], pair["v_b_proj.weight"]
        if (k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]
                or k_b.shape[2] != nope or v_b.shape[1] != v_head_dim):
            raise ValueError(f"{stem}.self_attn: k_b_proj {tuple(k_b.shape)} and v_b_proj {tuple(v_b.shape)} are not "
                             f"[heads, kv_lora_rank, {nope}] and [heads, {v_head_dim}, kv_lora_rank]")
        yield f"{stem}.self_attn.kv_b_proj.weight", torch.cat((k_b.transpose(1, 2), v_b), dim=1).flatten(0, 1)
    if halves:
        stem, pair = next(iter(halves.items()))
        other = "v_b_proj" if "k_b_proj.weight" in pair else "k_b_proj"
        raise ValueError(f"{stem}.self_attn.{next(iter(pair)).removesuffix('.weight')} has no {other} to join into "
                         "kv_b_proj")


class DeepseekV3ForCausalLM(MixtralForCausalLM):
    # only the MLPs' gate/up are fused (DeepSeek's q_proj is not a part of a qkv projection)
    packed_modules_mapping: ClassVar[dict] = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    renamed_modules: ClassVar[dict[str, str]] = {}
    expert_parts: ClassVar[dict[str, str]] = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    def __init__(self, config: ModelConfig):
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not config.raw.get(key):
                raise ValueError(f"DeepSeek-V3 config.json lacks {key!r}")
        super().__init__(config)

    def make_attention(self, layer: int) -> nn.Module:
        return DeepseekV3Attention(self.config)

    def make_mlp(self, layer: int) -> nn.Module:
        return DeepseekV3MoE(self.config) if self.config.is_moe_layer(layer) else LlamaMLP(self.config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._without_extra_layers(weights))

    def _without_extra_layers(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """The released checkpoints append multi-token-prediction layers (model.layers.61 of 61):
        a speculative-decoding head rtp does not run, skipped as transformers skips it. A GGUF's
        split kv_b_proj (k_b_proj, v_b_proj) is joined back (_joined_kv_b)."""
        for name, tensor in _joined_kv_b(weights, self.config.raw["qk_nope_head_dim"], self.config.raw["v_head_dim"]):
            if name.endswith("_scale_inv"):
                raise ValueError(f"{name}: FP8 block-quantized checkpoints are not supported; "
                                 f"dequantize to bf16 first")
            match = _LAYER.match(name)
            if match and int(match[1]) >= self.config.num_hidden_layers:
                continue
            yield name, tensor
