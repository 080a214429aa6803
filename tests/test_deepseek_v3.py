"""DeepSeek-V3 (MLA + sigmoid-routed MoE) against transformers, and what its latent cache costs.

The logit tests follow tests/test_models.py (and reuse its runner): a random transformers
model saved as a real checkpoint, loaded by rtp's loader, prompts of different lengths
batched through prefill and 16 decode steps on the real runtime, every row's logits
compared in fp32. The decode rows go through the absorbed form (W_UK folded into q, W_UV
into the output) and the prefill chunks through the decompressed one, so agreement with
transformers (which always decompresses) checks both.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from test_models import hf_reference, run_rtp, write_word_tokenizer

from rtp.engine.kv_cache import bytes_per_block
from rtp.engine.loader import load_model
from rtp.models.moe import FusedMoE

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}

# 3 layers: layer 0 dense (first_k_dense_replace 1), layers 1-2 sparse; 8 experts in 4 groups,
# routed within the best 2 groups; head dims chosen all different so a mixed-up split fails
SMALL = dict(vocab_size=160, hidden_size=64, intermediate_size=112, moe_intermediate_size=32,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
             n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
             norm_topk_prob=True, first_k_dense_replace=1, kv_lora_rank=32, qk_nope_head_dim=24,
             qk_rope_head_dim=16, v_head_dim=20, max_position_embeddings=256, rms_norm_eps=1e-5,
             rope_parameters=YARN)

CONFIGS = {
    "q-lora-yarn": dict(q_lora_rank=48),
    "no-q-lora-yarn": dict(q_lora_rank=None),
    # the plain RoPE, a softmax scale without mscale, pairs not interleaved, two dense layers
    "q-lora-rope-halves": dict(q_lora_rank=48, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                               rope_interleave=False, first_k_dense_replace=2, n_shared_experts=2),
}


def make_checkpoint(kind: str, path):
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**{**SMALL, **CONFIGS[kind]})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # larger weights than the default init, so logits and routing differ visibly
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
        for layer in model.model.layers[config.first_k_dense_replace:]:
            # a correction bias big enough to change which experts (and groups) win
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    model.save_pretrained(path)
    return path, model


def prompts_of(lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 160, n).tolist() for n in lengths]


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_logits_match_transformers(kind, tmp_path):
    path, hf = make_checkpoint(kind, tmp_path)
    prompts = prompts_of((5, 23, 40), seed=1)
    worst, _ = run_rtp(path, prompts, hf_reference(hf, prompts), max_batched=32)  # 40 tokens: two chunks
    assert worst < 1e-4, f"{kind}: max abs logit difference {worst}"
