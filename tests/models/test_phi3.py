"""Phi-3 / Phi-4-mini (transformers' Phi3ForCausalLM) against transformers, logit for logit.

As tests/models/test_models.py: a seeded random transformers model (fp32, eager) saved as a
real checkpoint, loaded by rtp's loader and driven through the real runtime (paged KV cache,
prefix cache, chunked prefill), every sampled row's logits compared with transformers'.
What Phi-3 adds is checked on top: the fused qkv_proj / gate_up_proj tensors split into
rtp's parts (and sharded over two tensor-parallel ranks), a sliding window, partial rotary
(Phi-4-mini rotates 3/4 of each head), LongRoPE's short and long factor sets with their
attention factor, config.json in transformers' 4.x layout (and the legacy type "su"), and GGUFs
written the way llama.cpp's converter writes Phi-3 (fused attn_qkv and ffn_up, the factors
as rope_factors_* tensors).

LongRoPE: rtp picks one factor set per model, by transformers' rule applied to the longest
sequence it serves (rtp/models/rotary.py, _longrope). The models here serve 256 positions
over an original context of 64, so they use the long set, and their prompts are longer than
64 tokens, where transformers uses the long set too; "longrope-short-set" serves no more
than its original context, so both use the short set.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import transformers
from tiny_models import hf_reference, prompts_of, random_hf_model, run_model, run_rtp, write_word_tokenizer

from rtp.checkpoint.loader import CheckpointError, load_model
from rtp.models.rotary import get_rope, rope_config_from_hf

PHI3 = dict(vocab_size=160, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
HEAD_DIM = 16


def _factors(n: int, low: float, high: float, seed: int) -> list[float]:
    return np.random.default_rng(seed).uniform(low, high, n).round(4).tolist()


def _longrope(rotary_dim: int, **extra) -> dict:
    return {"type": "longrope", "short_factor": _factors(rotary_dim // 2, 1.0, 1.5, 0),
            "long_factor": _factors(rotary_dim // 2, 1.0, 8.0, 1), **extra}


# kind -> (Phi3Config fields over PHI3, prompt lengths)
KINDS = {
    # Phi-3-mini-4k: plain RoPE, a sliding window
    "phi3-4k-sliding": (dict(max_position_embeddings=256, original_max_position_embeddings=256, sliding_window=12),
                        (5, 23, 40)),
    # Phi-3-mini-128k: LongRoPE over the whole head, 4x the original context
    "phi3-longrope": (dict(max_position_embeddings=256, original_max_position_embeddings=64,
                           rope_scaling=_longrope(HEAD_DIM)), (70, 101)),
    # Phi-4-mini: LongRoPE over 3/4 of each head, tied embeddings
    "phi4-mini": (dict(max_position_embeddings=256, original_max_position_embeddings=64, partial_rotary_factor=0.75,
                       tie_word_embeddings=True, rope_scaling=_longrope(12)), (66, 97)),
    # no longer than the original context: the short set, an attention factor from an explicit factor
    "longrope-short-set": (dict(max_position_embeddings=128, original_max_position_embeddings=128,
                                rope_scaling=_longrope(HEAD_DIM, factor=4.0)), (5, 23, 40)),
}


def make_phi3(kind: str, path):
    model = random_hf_model(transformers.Phi3Config(**PHI3, **KINDS[kind][0]))
    model.save_pretrained(path)
    return path, model


def _legacy_layout(path) -> None:
    """config.json rewritten as the released Phi-3 / Phi-4-mini files are (transformers 4.x): rope_theta,
    partial_rotary_factor and original_max_position_embeddings at the top level, rope_scaling with `type`."""
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["partial_rotary_factor"] = rope["partial_rotary_factor"]
    cfg["rope_scaling"] = {"type": "longrope", "short_factor": rope["short_factor"], "long_factor": rope["long_factor"]}
    (path / "config.json").write_text(json.dumps(cfg))


# -- logits -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_logits_match_transformers(kind, tmp_path):
    path, hf = make_phi3(kind, tmp_path)
    prompts = prompts_of(KINDS[kind][1], seed=1)
    # 64-token steps: the longer prompts prefill in two or three chunks, each rotated like the whole
    worst, _ = run_rtp(path, prompts, hf_reference(hf, prompts), max_batched=64)
    assert worst < 1e-4, f"{kind}: max abs logit difference {worst}"


def test_released_config_layout_loads_the_same(tmp_path):
    path, hf = make_phi3("phi4-mini", tmp_path)
    _legacy_layout(path)
    assert transformers.AutoConfig.from_pretrained(path).rope_parameters["rope_type"] == "longrope"
    prompts = prompts_of(KINDS["phi4-mini"][1], seed=2)
    worst, _ = run_rtp(path, prompts, hf_reference(hf, prompts))
    assert worst < 1e-4


def test_tp2_splits_the_fused_projections_by_part(tmp_path):
    """Two gloo ranks: each takes its own q, k and v heads out of the fused qkv_proj and its half of
    gate and of up out of gate_up_proj (not a contiguous half of the fused rows)."""
    from ranks import run_tensor_parallel

    path, hf = make_phi3("phi3-longrope", tmp_path / "ckpt")
    prompts = prompts_of(KINDS["phi3-longrope"][1], seed=3)
    worst = run_tensor_parallel(path, prompts, hf_reference(hf, prompts), tmp_path)
    assert max(worst) < 1e-4, worst


# -- greedy generation through rtp.LLM ---------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_generation_matches_transformers(kind, tmp_path):
    from rtp import LLM, SamplingParams

    path, hf = make_phi3(kind, tmp_path)
    write_word_tokenizer(path, PHI3["vocab_size"])
    prompts = prompts_of(KINDS[kind][1], seed=4)
    new_tokens = 32
    llm = LLM(model=str(path), dtype="float32", compile=False, max_model_len=160)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref


# -- LongRoPE, the rotary module alone -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["phi3-longrope", "phi4-mini", "longrope-short-set"])
def test_rope_table_is_transformers_for_the_longest_sequence(kind):
    """rtp's cos/sin table equals transformers' rotation of a sequence of max_position tokens: the
    long set (and the attention factor) when that exceeds the original context, else the short set."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    hf_config = transformers.Phi3Config(**PHI3, **KINDS[kind][0])
    base, scaling, partial = rope_config_from_hf(hf_config.to_dict())
    max_pos = hf_config.max_position_embeddings
    rope = get_rope(HEAD_DIM, None, max_pos, base, scaling, partial_rotary_factor=partial)
    hf_rope = Phi3RotaryEmbedding(hf_config)
    half = rope.rotary_dim // 2

    def hf_table(length: int) -> torch.Tensor:  # transformers' rotation of a sequence of `length` tokens
        cos, sin = hf_rope(torch.zeros(1), torch.arange(length)[None])
        return torch.cat((cos[0, :, :half], sin[0, :, :half]), dim=-1)

    assert rope.rotary_dim == int(HEAD_DIM * partial) == 2 * len(scaling["short_factor"])
    assert torch.allclose(rope.cos_sin_cache, hf_table(max_pos), rtol=0, atol=1e-6)
    assert rope.attention_factor == pytest.approx(hf_rope.attention_scaling) and rope.attention_factor > 1.05
    original = scaling["original_max_position_embeddings"]
    if max_pos > original:  # the long set: shorter sequences rotate otherwise in transformers
        assert not torch.allclose(rope.cos_sin_cache[:original], hf_table(original), rtol=0, atol=1e-3)


def test_the_cpu_kernel_rotates_part_of_each_head_as_the_module_does():
    """Phi-4-mini rotates 96 of its 128 dims: rtp's fused RoPE + KV-write kernel takes that (the
    other 32 pass through) and agrees with RotaryEmbedding bit for bit, so bf16 decode keeps the
    kernel (and with it the CPU graphs) rather than falling back to torch ops."""
    from rtp.kernels import cpu_kernels
    from rtp.models.attention import AttentionMetadata, PagedAttention, forward_context

    if not cpu_kernels.tiles_available():
        pytest.skip("rtp's CPU kernels are not built for this machine")
    heads, kv_heads, dim, tokens = 4, 2, 128, 24
    scaling = {"rope_type": "longrope", "short_factor": _factors(48, 1.0, 1.5, 0),
               "long_factor": _factors(48, 1.0, 8.0, 1), "original_max_position_embeddings": 64, "factor": 4.0}
    rope = get_rope(dim, None, 256, 10000.0, scaling, partial_rotary_factor=0.75)
    assert rope.rotary_dim == 96
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(torch.bfloat16)
    positions = torch.randint(0, 256, (tokens,), generator=g, dtype=torch.int32)
    attn = PagedAttention(heads, kv_heads, dim, dim**-0.5)
    attn.kv_cache = torch.zeros(2, 8, 4, kv_heads, dim, dtype=torch.bfloat16)
    assert attn.can_rope_and_store(qkv, positions, rope)
    with forward_context(AttentionMetadata(slot_mapping=torch.arange(tokens), block_size=4)):
        q = attn.rope_and_store(qkv, positions, rope)
    q_ref, k_ref, v_ref = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q_ref, k_ref = rope(positions, q_ref.view(tokens, heads, dim), k_ref.view(tokens, kv_heads, dim))
    assert torch.equal(q, q_ref)
    assert torch.equal(attn.kv_cache[0].view(-1, kv_heads, dim)[:tokens], k_ref)
    assert torch.equal(attn.kv_cache[1].view(-1, kv_heads, dim)[:tokens], v_ref.view(tokens, kv_heads, dim))


def test_released_phi4_mini_config_reads_as_transformers_reads_it():
    released = {"architectures": ["Phi3ForCausalLM"], "hidden_size": 3072, "num_attention_heads": 24,
                "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                "partial_rotary_factor": 0.75, "rope_theta": 10000.0,
                "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}}
    base, scaling, partial = rope_config_from_hf(released)
    assert (base, partial) == (10000.0, 0.75)
    assert scaling == {"rope_type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48,
                       "original_max_position_embeddings": 4096, "factor": 32.0}
    su = rope_config_from_hf({**released, "rope_scaling": {**released["rope_scaling"], "type": "su"}})
    assert su == (base, scaling, partial)
    with pytest.raises(ValueError, match="one factor per rotary frequency"):
        get_rope(128, None, 8192, base, {**scaling, "long_factor": [2.0] * 64}, partial_rotary_factor=partial)


def test_a_fused_tensor_of_the_wrong_size_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = make_phi3("phi3-4k-sliding", tmp_path)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-HEAD_DIM].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"qkv_proj.*112 rows.*128"):
        load_model(path, torch.float32, torch.device("cpu"))


# -- GGUF ----------------------------------------------------------------------------------------------

_TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
            "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
            "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
            "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_phi3_gguf(path, hf, qtype_for=None):
    """hf's weights in a GGUF of architecture phi3, written as llama.cpp's Phi3MiniModel converter
    writes it: fused attn_qkv and ffn_up, no output.weight when tied, LongRoPE's factors as
    rope_factors_short/long tensors and its attention factor in the metadata."""
    gguf = pytest.importorskip("gguf")
    cfg = hf.config
    rope = cfg.rope_parameters
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_architecture()
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(int(HEAD_DIM * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(cfg.sliding_window or 0)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if rope["rope_type"] == "longrope":
        scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
        original = cfg.original_max_position_embeddings
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    for name, w in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stem = name.removesuffix(".weight")
        if stem not in _TO_GGUF:
            _, _, layer, rest = stem.split(".", 3)
            stem = f"blk.{layer}.{_TO_GGUF[rest]}"
        else:
            stem = _TO_GGUF[stem]
        w = w.numpy()
        qtype = qtype_for(name) if qtype_for else None
        if qtype is None:
            writer.add_tensor(f"{stem}.weight", w)
        else:
            writer.add_tensor(f"{stem}.weight", gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("kind", ["phi3-4k-sliding", "phi3-longrope", "phi4-mini"])
def test_gguf_gives_the_same_logits(kind, tmp_path):
    from rtp.checkpoint.gguf import GGUFCheckpoint

    _, hf = make_phi3(kind, tmp_path / "hf")
    path = write_phi3_gguf(tmp_path / "phi3.gguf", hf)
    cfg = GGUFCheckpoint(path).config
    assert cfg["architectures"] == ["Phi3ForCausalLM"]
    assert cfg["tie_word_embeddings"] == hf.config.tie_word_embeddings
    assert cfg.get("sliding_window") == hf.config.sliding_window
    assert cfg.get("partial_rotary_factor", 1.0) == hf.config.rope_parameters["partial_rotary_factor"]
    if hf.config.rope_parameters["rope_type"] == "longrope":
        assert cfg["rope_scaling"]["rope_type"] == "longrope"
        assert cfg["rope_scaling"]["long_factor"] == pytest.approx(hf.config.rope_parameters["long_factor"])
    prompts = prompts_of(KINDS[kind][1], seed=5)
    worst, _ = run_rtp(path, prompts, hf_reference(hf, prompts), max_batched=64)
    assert worst < 1e-4, f"{kind}: max abs logit difference {worst}"


def test_quantized_gguf_keeps_its_fused_blocks_for_decode(tmp_path, monkeypatch):
    """A Q8_0 Phi-3 GGUF in bf16 on a CPU with rtp's kernels: the fused attn_qkv and ffn_up blocks
    go to qkv_proj and gate_up_proj whole, and decode rows through them give transformers' logits on
    the same (dequantized) weights, to bf16's precision."""
    gguf = pytest.importorskip("gguf")
    from rtp.kernels import cpu_kernels
    from rtp.kernels.quant import BlockQuantized

    if not cpu_kernels.tiles_available():
        pytest.skip("rtp's CPU kernels are not built for this machine")
    Q = gguf.GGMLQuantizationType
    _, hf = make_phi3("phi4-mini", tmp_path / "hf")

    def quantized(name):  # rows of 64 inputs quantize in blocks of 32; down_proj's 112 do not, and stay F32
        return Q.Q8_0 if "qkv_proj" in name or "gate_up" in name or "o_proj" in name else None

    path = write_phi3_gguf(tmp_path / "phi3.gguf", hf, quantized)
    with torch.no_grad():  # transformers on the weights the file holds
        for name, p in hf.named_parameters():
            if quantized(name):
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), Q.Q8_0), Q.Q8_0)))
    prompts = prompts_of((70, 81), seed=6)
    refs = hf_reference(hf, prompts)

    model, _ = load_model(path, torch.bfloat16, torch.device("cpu"))
    fused = [m for layer in model.model.layers for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj)]
    assert all(m.quant is not None and m.quant.shape == tuple(m.weight.shape) for m in fused)
    used = set()

    def spy(run):
        def recorded(self, *args):
            used.add(id(self))
            return run(self, *args)
        return recorded

    for method in ("linear", "silu_mul"):  # silu_mul: gate_up's blocks in AMX's interleaved tiles
        monkeypatch.setattr(BlockQuantized, method, spy(getattr(BlockQuantized, method)))
    # the decode rows: the small batches GGUF blocks serve
    with_blocks, _ = run_model(model, prompts, refs, kv_dtype=torch.bfloat16, num_blocks=128, max_num_seqs=4,
                               max_batched=128, prefix_cache=False, warmup=False, decode_only=True)
    assert {id(m.quant) for m in fused} <= used  # the decode rows went through them
    # bf16 rounding: about 0.02 here; gate and up blocks in the wrong order: above 1
    assert with_blocks < 0.1, with_blocks
