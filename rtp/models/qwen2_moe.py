"""Qwen2-MoE and Qwen3-MoE: Mixtral's sparse topology with Qwen's names and options.

Qwen2-MoE adds a shared expert to every sparse block, an MLP every token goes
through, scaled by a sigmoid gate of its own; Qwen3-MoE has none, and takes
Qwen3's q/k norm instead (ModelConfig.qk_norm). Both may keep some layers dense
(`decoder_sparse_step`, `mlp_only_layers`: ModelConfig.is_moe_layer), with an
ordinary MLP of `intermediate_size`.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from rtp.config import ModelConfig
from rtp.kernels import cpu_kernels
from rtp.models.layers import ReplicatedLinear
from rtp.models.llama import LlamaMLP
from rtp.models.mixtral import MixtralForCausalLM
from rtp.models.moe import SparseMoeBlock


class SharedExpertMoeBlock(SparseMoeBlock):
    """Routed experts plus sigmoid(shared_expert_gate(x)) * shared_expert(x)."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.shared_expert = LlamaMLP(config, config.shared_expert_intermediate_size)
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        gate, shared = self.shared_expert_gate(x), self.shared_expert(x)
        if cpu_kernels.add_sigmoid_gated_supported(out, gate, shared):  # one kernel: the step stays capturable
            return cpu_kernels.add_sigmoid_gated(out, gate, shared)
        return out.add_(torch.sigmoid(gate.float()) * shared.float())


class Qwen2MoeForCausalLM(MixtralForCausalLM):
    renamed_modules: ClassVar[dict[str, str]] = {}
    expert_parts: ClassVar[dict[str, str]] = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    def make_mlp(self, layer: int) -> nn.Module:
        if self.config.is_moe_layer(layer) and self.config.shared_expert_intermediate_size:
            return SharedExpertMoeBlock(self.config)
        return super().make_mlp(layer)
