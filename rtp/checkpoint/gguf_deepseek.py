"""DeepSeek-V2 / V3 GGUFs: llama.cpp's architecture `deepseek2` as the config and names of rtp's MLA model.

llama.cpp writes DeepSeek-V2, V2-Lite, V2.5, V3 and R1 (and their distills' relatives with MLA) as one
architecture. What differs from the other MoE files (rtp/checkpoint/gguf_moe.py has what they share):

    attention  MLA's projections under their own names (attn_q_a, attn_q_a_norm, attn_q_b or attn_q,
               attn_kv_a_mqa, attn_kv_a_norm) and kv_b_proj either whole (attn_kv_b, older files) or as
               llama.cpp's converter splits it for its absorbed attention: attn_k_b, each head's key part
               transposed ([heads, kv_lora_rank, nope]), and attn_v_b ([heads, v_head_dim, kv_lora_rank]).
               rtp's model joins the two back into kv_b_proj's rows (rtp/models/deepseek_v3.py); being
               transposed, k_b's blocks are not kv_b's, so both are read dequantized (they are small: a
               layer's kv_b is 2 M weights in V2-Lite).
    sizes      head_count_kv is written as 1 and key_length / value_length as the latent's (MLA viewed as
               MQA); the heads' own sizes are key_length_mla / value_length_mla, or, in files written
               before those keys existed, key_length / value_length themselves.
    routing    expert_gating_func: softmax (V2) or sigmoid with a correction bias exp_probs_b (V3, noaux_tc).
               Where a file does not say, llama.cpp's loader assumes softmax (V2 files predate the key);
               rtp does too, unless the file holds the correction bias, which only V3's routing has (the
               converter leaves the key out for a V3 whose config.json lacks scoring_func, as
               transformers' saved configs do);
               expert_weights_scale is the routed scaling factor; expert_group_count and
               expert_group_used_count the group-limited routing (V2 takes a group's best expert as its
               score, V3 the sum of its best two, as DeepSeek's own code and transformers do; llama.cpp
               scores groups by the sum of two for both); expert_weights_norm renormalises the top k.
    experts    routed experts stacked as in the other MoE files; n_shared_experts shared experts as one
               MLP (ffn_*_shexp, no gate), as wide as expert_shared_count experts.
    rope       the rope dims keep DeepSeek's interleaved pairs (llama.cpp rotates them as pairs too); YaRN's
               mscale_all_dim is written as 0.1 * it, yarn_log_multiplier (llama.cpp undoes the 0.1 the same
               way).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rtp.checkpoint.gguf_header import GGUFError

# llama.cpp's layer tensor -> rtp's parameter under model.layers.N (a dict: a parameter per suffix)
LAYER_NAMES: dict[str, Any] = {
    "attn_q": "self_attn.q_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",   # joined with v_b_proj into kv_b_proj by the model
    "attn_v_b": "self_attn.v_b_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "exp_probs_b": {"bias": "mlp.gate.e_score_correction_bias"},
}
# tensors no kernel multiplies from their blocks: k_b's blocks run along another axis than kv_b's
UNPACKED = ("attn_k_b", "attn_v_b")
_SOFTMAX, _SIGMOID = 1, 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE values


def deepseek2_config(path: Path, cfg: dict[str, Any], moe, names: set[str], key, count, positive) -> dict[str, Any]:
    """cfg (the keys every GGUF gets, from gguf.py) made DeepSeek-V2's or V3's config.json. `moe` is the
    file's MoELayout, `names` its tensors' names; key / count / positive read and check {arch}.* metadata."""
    if moe is None:
        raise GGUFError(f"{path}: a deepseek2 file without experts (expert_count) is not supported")
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    rope = count("rope.dimension_count")
    kv_lora = count("attention.kv_lora_rank")
    if rope is None or kv_lora is None:
        raise GGUFError(f"{path}: metadata lacks deepseek2.{'rope.dimension_count' if rope is None else 'attention.kv_lora_rank'}")
    qk, v = count("attention.key_length_mla"), count("attention.value_length_mla")
    if qk is None:  # written before the _mla keys: the heads' sizes themselves
        qk, v = count("attention.key_length"), count("attention.value_length")
    if qk is None or v is None or qk <= rope:
        raise GGUFError(f"{path}: metadata deepseek2.attention.key_length_mla = {qk} (a head's query and key size) "
                        f"must exceed rope.dimension_count = {rope}, and value_length_mla must be given")
    dense = count("leading_dense_block_count", 0, minimum=0)
    if moe.sparse_layers != frozenset(range(dense, layers)):
        raise GGUFError(f"{path}: metadata deepseek2.leading_dense_block_count = {dense} says layers {dense}..{layers - 1} "
                        f"are sparse, but the routers (blk.N.ffn_gate_inp.weight) are in layers "
                        f"{sorted(moe.sparse_layers)}")
    biased = any(name.endswith(".exp_probs_b.bias") for name in names)
    gating = key("expert_gating_func", _SIGMOID if biased else _SOFTMAX)
    if gating not in (_SOFTMAX, _SIGMOID):
        raise GGUFError(f"{path}: metadata deepseek2.expert_gating_func = {gating!r}: softmax (1) and sigmoid (2) "
                        "route DeepSeek experts")
    shared = count("expert_shared_count", 0, minimum=0)
    if moe.shared_width != shared * moe.width:
        raise GGUFError(f"{path}: metadata deepseek2.expert_shared_count = {shared} experts of {moe.width}, but "
                        f"the shared experts (blk.N.ffn_gate_shexp.weight) are {moe.shared_width} wide")
    groups = count("expert_group_count", 1)
    used = count("expert_group_used_count", groups)
    sigmoid = gating == _SIGMOID
    out = {"architectures": ["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
           "model_type": "deepseek_v3" if sigmoid else "deepseek_v2",
           "num_key_value_heads": heads, "head_dim": rope,
           "q_lora_rank": count("attention.q_lora_rank"), "kv_lora_rank": kv_lora,
           "qk_nope_head_dim": qk - rope, "qk_rope_head_dim": rope, "v_head_dim": v,
           "first_k_dense_replace": dense, "moe_layer_freq": 1,
           "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
           "moe_intermediate_size": moe.width, "n_shared_experts": shared,
           "routed_scaling_factor": positive("expert_weights_scale", 1.0),
           "norm_topk_prob": bool(key("expert_weights_norm", False)),
           "n_group": groups, "topk_group": used, "scoring_func": "sigmoid" if sigmoid else "softmax",
           "topk_method": "noaux_tc" if sigmoid else "group_limited_greedy" if groups > 1 else "greedy",
           "rope_interleave": True}
    scaling = cfg.get("rope_scaling")
    log_mul = key("rope.scaling.yarn_log_multiplier")
    if scaling and scaling.get("rope_type") == "yarn" and log_mul:
        # mscale as mscale_all_dim: cos and sin unscaled, the softmax scale by mscale_all_dim (llama.cpp's reading)
        scaling["mscale"] = scaling["mscale_all_dim"] = positive("rope.scaling.yarn_log_multiplier", None) / 0.1
    return {**{k: v for k, v in cfg.items() if k != "partial_rotary_factor"}, **out}
