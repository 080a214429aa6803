"""Mixtral: the Llama topology with a sparse mixture-of-experts block in every layer.

The experts of a layer are stacked into one FusedMoE (rtp/models/moe.py); each
checkpoint tensor `block_sparse_moe.experts.{i}.w1|w3|w2` is loaded into expert i's
gate, up or down part. The Qwen MoE models (rtp/models/qwen2_moe.py) reuse this
class with their own tensor names.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from rtp.models.llama import LlamaForCausalLM
from rtp.models.moe import ExpertShard, FusedMoE, SparseMoeBlock, expert_target


class MixtralForCausalLM(LlamaForCausalLM):
    # checkpoint name part -> ours: the sparse block is every layer's `mlp` here
    renamed_modules: ClassVar[dict[str, str]] = {".block_sparse_moe.": ".mlp."}
    # per-expert checkpoint tensor -> the part of the stacked expert weights it fills
    expert_parts: ClassVar[dict[str, str]] = {"w1": "gate", "w3": "up", "w2": "down"}

    def make_mlp(self, layer: int) -> nn.Module:
        if self.config.is_moe_layer(layer):
            return SparseMoeBlock(self.config)
        return super().make_mlp(layer)

    def fused_target(self, name: str) -> tuple[str, str | int | ExpertShard | None]:
        for checkpoint_part, ours in self.renamed_modules.items():
            name = name.replace(checkpoint_part, ours)
        return expert_target(name, self.expert_parts) or super().fused_target(name)

    def expected_weights(self) -> set[str]:
        names = super().expected_weights()
        for prefix, module in self.named_modules():
            if isinstance(module, FusedMoE):
                for param, shards in module.expected_shards().items():
                    names.discard(f"{prefix}.{param}")
                    names |= {f"{prefix}.{param}#{shard}" for shard in shards}
        return names
