"""Phi-3 and Phi-4-mini (transformers' Phi3ForCausalLM): the Llama topology with fused checkpoints.

The decoder is Llama's, layer for layer: RMSNorm, attention without biases, SiLU-gated
MLP. What differs is outside the layers: the checkpoint holds q/k/v as one `qkv_proj` and
gate/up as one `gate_up_proj`, and the long-context models rotate with LongRoPE
(rtp/models/rotary.py), Phi-4-mini over the first 3/4 of each head only
(partial_rotary_factor). Both come from config.json through the Llama attention as is.

rtp's projections are fused the same way, but each takes its parts by shard id, so that
every tensor-parallel rank keeps its own heads of q, of k and of v (and its slice of gate
and of up): a fused checkpoint tensor is split into its parts here and each part goes
through the layer's loader, as Llama's separate q/k/v tensors do. A GGUF of Phi-3 is
presented under the same fused names (rtp/checkpoint/gguf.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from rtp.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint tensors with each fused qkv_proj / gate_up_proj split into the parts
        Llama's checkpoints name (q_proj, k_proj, v_proj; gate_proj, up_proj); the others as they are."""
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        fused = {
            ".self_attn.qkv_proj.": [("q_proj", q), ("k_proj", kv), ("v_proj", kv)],
            ".mlp.gate_up_proj.": [("gate_proj", c.intermediate_size), ("up_proj", c.intermediate_size)],
        }
        for name, tensor in weights:
            part = next((p for p in fused if p in name), None)
            if part is None:
                yield name, tensor
                continue
            names, sizes = zip(*fused[part])
            if tensor.shape[0] != sum(sizes):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} has {tensor.shape[0]} rows, "
                                 f"the config's {' + '.join(map(str, sizes))} = {sum(sizes)} "
                                 f"({', '.join(names)}) expected")
            stem = part.rsplit(".", 2)[0]  # ".self_attn" / ".mlp"
            for split_name, piece in zip(names, tensor.split(list(sizes), dim=0)):
                yield name.replace(part, f"{stem}.{split_name}."), piece
