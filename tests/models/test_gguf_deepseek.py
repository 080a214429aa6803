"""DeepSeek-V2 and V3 GGUFs (llama.cpp's architecture `deepseek2`) against transformers.

A tiny random transformers DeepseekV2 (softmax routing: greedy, or group-limited with a routed
scaling factor) or DeepseekV3 (sigmoid, a correction bias, groups) is written as llama.cpp's converter
writes it (conversion/deepseek.py, DeepseekV2Model): MLA viewed as MQA in the metadata (head_count_kv
1, key_length the latent's, the heads' sizes in key_length_mla / value_length_mla), kv_b_proj split
into attn_k_b (each head's key rows transposed) and attn_v_b (or whole, as attn_kv_b, as older files
hold it), the experts stacked, the shared experts as ffn_*_shexp, the correction bias as
exp_probs_b.bias, YaRN's mscale_all_dim as 0.1 * it. rtp's loader reads it and its real runtime gives
transformers' logits; the experts are served from their blocks in bf16; a broken file is one error
naming the file and the tensor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from tiny_models import DEEPSEEK, YARN, hf_reference, prompts_of, random_hf_model, run_rtp

from rtp.checkpoint.gguf import GGUFCheckpoint, GGUFError
from rtp.checkpoint.records import CheckpointError

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

_V2 = {**DEEPSEEK, "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
       "routed_scaling_factor": 1.0, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
# (transformers config class, its keys): what each test model is
CONFIGS = {
    "v2-lite": (transformers.DeepseekV2Config, {**_V2, "q_lora_rank": None}),   # V2-Lite's shape: one q_proj
    "v2-groups-yarn": (transformers.DeepseekV2Config, {**_V2, "q_lora_rank": 48, "topk_method": "group_limited_greedy",
                                                       "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
                                                       "n_shared_experts": 2, "rope_parameters": YARN}),
    "v3": (transformers.DeepseekV3Config, {**DEEPSEEK, "q_lora_rank": 48}),
}

_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
          "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
          "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
          "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
          "mlp.shared_experts.down_proj": "ffn_down_shexp"}


def make(kind: str):
    cls, keys = CONFIGS[kind]
    hf = random_hf_model(cls(**keys))
    if kind == "v3":
        with torch.no_grad():
            for layer in hf.model.layers[hf.config.first_k_dense_replace:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)  # big enough to change the choice
    return hf


def _tensors(hf, split_kv_b: bool) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, array in torch order) of every tensor, as llama.cpp's converter names and splits them."""
    cfg = hf.config
    out = []
    for name, p in hf.state_dict().items():
        w = p.detach().float().numpy()
        stem, _, suffix = name.rpartition(".")
        if stem in _GLOBAL:
            out.append((f"{_GLOBAL[stem]}.{suffix}", w))
            continue
        _, _, layer, rest = stem.split(".", 3)
        if rest.endswith("mlp.experts"):  # [E, 2 * width, hidden], gate rows first; or down [E, hidden, width]
            width = cfg.moe_intermediate_size
            parts = {"gate": w[:, :width], "up": w[:, width:]} if suffix == "gate_up_proj" else {"down": w}
            out += [(f"blk.{layer}.ffn_{part}_exps.weight", np.ascontiguousarray(s)) for part, s in parts.items()]
        elif suffix == "e_score_correction_bias":
            out.append((f"blk.{layer}.exp_probs_b.bias", w))
        elif rest == "self_attn.kv_b_proj" and split_kv_b:
            kv_b = w.reshape(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
            out.append((f"blk.{layer}.attn_k_b.weight",
                        np.ascontiguousarray(kv_b[:, :cfg.qk_nope_head_dim].transpose(0, 2, 1))))
            out.append((f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, cfg.qk_nope_head_dim:])))
        elif rest == "self_attn.kv_b_proj":
            out.append((f"blk.{layer}.attn_kv_b.weight", w))
        else:
            out.append((f"blk.{layer}.{_LAYER[rest]}.{suffix}", w))
    return out


def write_deepseek_gguf(path, hf, qtype=None, *, split_kv_b=True, mla_keys=True, gating_key=True, edit=None):
    """hf as llama.cpp writes DeepSeek; matrices in qtype where their rows split into its blocks (the
    routers stay F32, as llama.cpp's quantizer keeps them), hf's weights then replaced by the file's.
    gating_key=False leaves expert_gating_func out, as the converter does for a config.json without
    scoring_func (transformers' saved DeepseekV3Config)."""
    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(1)  # MLA as MQA
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(cfg.n_routed_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_group_count(cfg.n_group)
    writer.add_expert_group_used_count(cfg.topk_group)
    if isinstance(cfg, transformers.DeepseekV3Config) and gating_key:
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if mla_keys:
        writer.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        writer.add_value_length(cfg.kv_lora_rank)
        writer.add_key_length_mla(qk)
        writer.add_value_length_mla(cfg.v_head_dim)
    else:  # a file written before the _mla keys: the heads' own sizes
        writer.add_key_length(qk)
        writer.add_value_length(cfg.v_head_dim)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_shared_count(cfg.n_shared_experts)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    tensors = _tensors(hf, split_kv_b)
    if edit is not None:
        tensors = edit(writer, tensors)
    for name, w in tensors:
        if (qtype is not None and w.ndim >= 2 and w.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0
                and "norm" not in name and "ffn_gate_inp" not in name):
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if qtype is not None:
        _load_the_files_weights(hf, path)
    return path


def _load_the_files_weights(hf, path) -> None:
    """hf's weights replaced by what the file holds (its quantized matrices dequantized), read back
    through gguf's own reader and the converter's layout undone here, independently of rtp."""
    cfg = hf.config
    held = {t.name: np.array(gguf.quants.dequantize(t.data, t.tensor_type)).reshape([int(d) for d in reversed(t.shape)])
            for t in gguf.GGUFReader(str(path)).tensors}
    params = hf.state_dict()  # the model's own storage (the correction bias is a buffer)
    with torch.no_grad():
        for name, w in _tensors(hf, split_kv_b=any(".attn_k_b." in n for n in held)):
            p = _param_of(name, cfg)
            if p is None:
                continue
            layer, what = p
            if what == "kv_b":
                k_b, v_b = held[f"blk.{layer}.attn_k_b.weight"], held[f"blk.{layer}.attn_v_b.weight"]
                value = np.concatenate((k_b.transpose(0, 2, 1), v_b), axis=1).reshape(-1, k_b.shape[1])
                params[f"model.layers.{layer}.self_attn.kv_b_proj.weight"].copy_(torch.from_numpy(value))
            elif what in ("gate", "up", "down"):
                fused = params[f"model.layers.{layer}.mlp.experts.{'down_proj' if what == 'down' else 'gate_up_proj'}"]
                width = cfg.moe_intermediate_size
                rows = {"gate": slice(0, width), "up": slice(width, 2 * width), "down": slice(None)}[what]
                fused[:, rows].copy_(torch.from_numpy(held[name]))
            else:
                params[what].copy_(torch.from_numpy(held[name]).reshape(params[what].shape))


def _param_of(gguf_name: str, cfg):
    """Which hf parameter a written tensor came from: (layer, 'kv_b' | expert part) or (None, name)."""
    if ".attn_v_b." in gguf_name:
        return None  # with its k_b
    if ".attn_k_b." in gguf_name:
        return int(gguf_name.split(".")[1]), "kv_b"
    if "_exps." in gguf_name:
        return int(gguf_name.split(".")[1]), gguf_name.split(".")[2].split("_")[1]
    reverse = {f"{v}.weight": f"{k}.weight" for k, v in _GLOBAL.items()}
    if gguf_name in reverse:
        return None, reverse[gguf_name]
    _, layer, stem, suffix = gguf_name.split(".")
    if stem == "exp_probs_b":
        return None, f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
    hf = {**{v: k for k, v in _LAYER.items()}, "attn_kv_b": "self_attn.kv_b_proj"}[stem]
    return None, f"model.layers.{layer}.{hf}.{suffix}"


# -- config and logits -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_config_reads_as_transformers_reads_the_twin(kind, tmp_path):
    hf = make(kind)
    cfg = GGUFCheckpoint(write_deepseek_gguf(tmp_path / "ds.gguf", hf)).config
    want = hf.config
    assert cfg["architectures"] == [type(hf).__name__]
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "first_k_dense_replace",
                "routed_scaling_factor", "n_group", "topk_group", "num_attention_heads", "num_key_value_heads"):
        assert cfg[key] == getattr(want, key), key
    assert cfg["topk_method"] == getattr(want, "topk_method", "noaux_tc")  # V3's config has no such key
    assert cfg["norm_topk_prob"] == bool(want.norm_topk_prob)
    if want.rope_parameters.get("rope_type") == "yarn":
        scaling = cfg["rope_scaling"]
        assert scaling["factor"] == want.rope_parameters["factor"]
        assert scaling["mscale_all_dim"] == pytest.approx(want.rope_parameters["mscale_all_dim"])
    else:
        assert "rope_scaling" not in cfg


@pytest.mark.parametrize("kind, qtype, split, gating", [
    ("v2-lite", None, True, True), ("v2-lite", Q.Q8_0, True, True), ("v2-groups-yarn", None, True, True),
    ("v3", None, True, True), ("v3", Q.Q8_0, False, True), ("v3", None, True, False)],
    ids=["v2-lite-f32", "v2-lite-q8_0", "v2-groups-yarn-f32", "v3-f32", "v3-q8_0-kv_b-whole", "v3-no-gating-key"])
def test_logits_match_transformers(kind, qtype, split, gating, tmp_path):
    """Through rtp's runtime (paged latent cache, prefix cache, chunked prefill, batched) in fp32."""
    hf = make(kind)
    path = write_deepseek_gguf(tmp_path / "ds.gguf", hf, qtype, split_kv_b=split, gating_key=gating)
    prompts = prompts_of((5, 23, 40), seed=1)
    worst, _ = run_rtp(path, prompts, hf_reference(hf, prompts))
    assert worst < 1e-4, f"{kind}: max abs logit difference {worst}"


def test_a_file_without_the_mla_keys_reads_the_heads_sizes_from_key_length(tmp_path):
    hf = make("v2-lite")
    path = write_deepseek_gguf(tmp_path / "old.gguf", hf, split_kv_b=False, mla_keys=False)
    prompts = prompts_of((9, 30), seed=3)
    worst, _ = run_rtp(path, prompts, hf_reference(hf, prompts))
    assert worst < 1e-4, worst


def test_quantized_experts_are_served_from_their_blocks_in_one_call(tmp_path):
    """bf16, Q8_0: every sparse layer's experts from the GGUF's blocks in one layout, no dense copy, and V2's
    plain top k routed by the one-call MoE kernel (csrc/moe.c); the logits as near transformers' on the
    file's weights as transformers' own bf16 is, or within 3 % of their range."""
    import copy

    from tiny_models import run_model

    from rtp.checkpoint.loader import load_model
    from rtp.kernels import cpu_kernels
    from rtp.models.moe import FusedMoE

    if not cpu_kernels.has_op("moe_experts"):
        pytest.skip("no one-call MoE op on this ISA path")
    cls, keys = CONFIGS["v2-lite"]
    hf = random_hf_model(cls(**{**keys, "moe_intermediate_size": 64, "hidden_size": 128, "kv_lora_rank": 64}))
    path = write_deepseek_gguf(tmp_path / "ds.gguf", hf, Q.Q8_0)
    model, _ = load_model(path, torch.bfloat16, torch.device("cpu"))
    sparse = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(sparse) == 2 and all(m.blocks is not None and m.blocks.one_call for m in sparse)
    assert all(m.w13.device.type == "meta" for m in sparse)
    assert all(layer.mlp.gate.softmax_top_k for layer in model.model.layers[1:])
    for m in sparse:
        m.expert_load.zero_()
    prompts = prompts_of((6, 19, 33, 3), seed=5)
    refs = hf_reference(hf, prompts)
    worst, _ = run_model(model, prompts, refs, kv_dtype=torch.bfloat16, num_blocks=256, max_num_seqs=4,
                         max_batched=128, prefix_cache=False, warmup=False)
    assert all(m.expert_load.sum().item() > 0 for m in sparse)  # counted by the one call
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    with torch.no_grad():
        theirs = max((hf16(torch.tensor([tokens])).logits[0].float() - logits).abs().max().item()
                     for tokens, logits in refs)
    scale = max(logits.abs().max().item() for _, logits in refs)
    assert worst <= max(2 * theirs, 0.03 * scale), (worst, theirs, scale)


# -- a broken file --------------------------------------------------------------------------------------------


def _drop(name):
    return lambda writer, tensors: [(n, w) for n, w in tensors if n != name]


def _set(key, value):
    def edit(writer, tensors):
        writer.add_uint32(f"deepseek2.{key}", value)  # written again: the later value stands
        return tensors
    return edit


@pytest.mark.parametrize("edit, says, error", [
    (_drop("blk.1.attn_v_b.weight"), r"k_b_proj has no v_b_proj", CheckpointError),
    (_set("expert_shared_count", 3), r"expert_shared_count = 3 experts of 32, but the shared experts .* are 32 wide",
     GGUFError),
    (_set("leading_dense_block_count", 2), r"leading_dense_block_count = 2 says layers 2\.\.2 are sparse, but the "
     r"routers .* are in layers \[1, 2\]", GGUFError),
    (_set("expert_gating_func", 3), r"expert_gating_func = 3", GGUFError),
    (_drop("blk.2.ffn_down_exps.weight"), r"layer 2 has a router but no expert tensor blk\.2\.ffn_down_exps", GGUFError),
    (_drop("blk.1.ffn_up_shexp.weight"), r"layer 1 has a shared expert but no blk\.1\.ffn_up_shexp\.weight", GGUFError),
], ids=["kv_b-half-missing", "shared-count-not-as-wide", "dense-layers-not-as-said", "unknown-gating",
        "expert-tensor-missing", "shared-part-missing"])
def test_a_broken_deepseek_file_is_one_error_naming_it(edit, says, error, tmp_path):
    """The header's errors when the file is opened; a lone half of kv_b when the tensors meet the model."""
    from rtp.checkpoint.loader import load_model

    path = write_deepseek_gguf(tmp_path / "broken.gguf", make("v2-lite"), edit=edit)
    with pytest.raises(error, match=says) as e:
        GGUFCheckpoint(path)
        load_model(path, torch.float32, torch.device("cpu"))
    assert str(path) in str(e.value)


def _ep2_rank(rank: int, init: str, path, prompts, refs) -> float:
    import rtp.distributed as dist

    dist.init_parallel(tp=1, ep=2, rank=rank, backend="gloo", init_method=init, timeout_s=60)
    worst, _ = run_rtp(path, prompts, refs)
    return worst


def test_a_deepseek_gguf_at_ep2_gives_transformers_logits(tmp_path):
    """--ep 2 on V3 (sigmoid routing with the correction bias, groups): half the experts a rank."""
    from ranks import run_ranks

    hf = make("v3")
    path = write_deepseek_gguf(tmp_path / "ds.gguf", hf, Q.Q8_0)
    prompts = prompts_of((5, 23, 40), seed=6)
    worst = run_ranks(_ep2_rank, path, prompts, hf_reference(hf, prompts), tmp_path=tmp_path)
    assert max(worst) < 1e-4, worst
