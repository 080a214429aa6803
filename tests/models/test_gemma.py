"""Gemma 3 (text) and Gemma 2 against transformers, logit for logit (fp32, tiny random configs).

Every config mixes sliding-window (local) and global layers with a window of 8 tokens and
prompts of up to 40, so local layers really attend to their window only, in prefill (whole
and chunked) and decode; local and global layers rotate with different RoPE bases, the
attention scale is query_pre_attn_scalar's (not head_dim's), and the norm weights are drawn
away from zero so Gemma's x * (1 + w) shows. References are transformers' fp32 eager
attention: logits through rtp's runtime (tests/tiny_models.run_rtp), greedy generation
through rtp's LLM on the saved safetensors directory, and GGUF files written the way
llama.cpp's converter writes Gemma (norm weights stored as 1 + w).
"""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch
import transformers
from tiny_models import hf_reference, run_model, run_rtp, write_word_tokenizer

from rtp.checkpoint.loader import load_model
from rtp.config import ModelConfig
from rtp.kernels import cpu_kernels
from rtp.kernels import ops as op_table

VOCAB = 160
S, F = "sliding_attention", "full_attention"
BASE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 112, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "sliding_window": 8, "query_pre_attn_scalar": 24}

# the local layers' RoPE base apart from the global layers', which are also scaled (linear)
GEMMA3_ROPE = {S: {"rope_type": "default", "rope_theta": 100.0},
               F: {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}

CONFIGS = {
    "gemma3": (transformers.Gemma3TextConfig,
               {"num_hidden_layers": 5, "layer_types": [S, F, S, S, F], "rope_parameters": GEMMA3_ROPE}),
    # untied head, one kv head, wider heads, a local layer last
    "gemma3-untied-mqa": (transformers.Gemma3TextConfig,
                          {"num_hidden_layers": 4, "layer_types": [F, S, F, S], "num_key_value_heads": 1,
                           "head_dim": 32, "tie_word_embeddings": False, "rope_parameters": GEMMA3_ROPE}),
    # both softcaps, small enough to bite; every other layer local
    "gemma2": (transformers.Gemma2Config,
               {"num_hidden_layers": 4, "attn_logit_softcapping": 1.0, "final_logit_softcapping": 3.0}),
}


def random_gemma(config) -> torch.nn.Module:
    """transformers' fp32 model, seeded; matrices drawn wider than the default init, and the norm
    weights (zeros at init: x * (1 + 0)) drawn too."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08 if p.dim() > 1 else 0.3)
    return model


def make_gemma(kind: str, path, **overrides):
    cfg_cls, extra = CONFIGS[kind]
    model = random_gemma(cfg_cls(**{**BASE, **extra, **overrides}))
    model.save_pretrained(path)
    return path, model


def prompts_of(lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, n).tolist() for n in lengths]


# -- logits through the runtime ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(CONFIGS))
def test_logits_match_transformers(kind, tmp_path):
    path, hf = make_gemma(kind, tmp_path)
    prompts = prompts_of((5, 23, 40), seed=1)  # all but one longer than the window
    refs = hf_reference(hf, prompts)
    worst, _ = run_rtp(path, prompts, refs)
    assert worst < 1e-4, f"{kind}: max abs logit difference {worst}"
    # prompts in chunks of at most 16 tokens, the window crossing chunk and block boundaries
    worst, _ = run_rtp(path, prompts, refs, max_batched=16)
    assert worst < 1e-4, f"{kind} chunked: max abs logit difference {worst}"


def test_each_feature_shows(tmp_path):
    """The test above would catch each Gemma feature done wrong: the same checkpoint with the
    window, the local RoPE base or the attention scale changed is far off transformers."""
    path, hf = make_gemma("gemma3", tmp_path / "ckpt")
    prompts = prompts_of((23, 40), seed=2)
    refs = hf_reference(hf, prompts)
    config = json.loads((path / "config.json").read_text())
    wrong = {"no window": {"sliding_window": None},
             "one RoPE base": {"rope_parameters": {S: GEMMA3_ROPE[F], F: GEMMA3_ROPE[F]}},
             "head_dim scale": {"query_pre_attn_scalar": None}}
    for what, change in wrong.items():
        other = tmp_path / what.replace(" ", "-")
        shutil.copytree(path, other)
        (other / "config.json").write_text(json.dumps({**config, **change}))
        worst, _ = run_rtp(other, prompts, refs)
        assert worst > 0.05, f"{what}: {worst}"


def test_transformers_4_config_layout(tmp_path):
    """Hub configs written by transformers 4.x: rope_theta, rope_scaling (global layers),
    rope_local_base_freq, sliding_window_pattern instead of layer_types, and no
    tie_word_embeddings (transformers' default: tied)."""
    path, hf = make_gemma("gemma3", tmp_path, num_hidden_layers=6, layer_types=[S, S, F, S, S, F])
    config = json.loads((path / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "tie_word_embeddings"):
        del config[key]
    config |= {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
               "rope_local_base_freq": 100.0, "sliding_window_pattern": 3, "transformers_version": "4.52.4"}
    (path / "config.json").write_text(json.dumps(config))
    prompts = prompts_of((9, 30), seed=3)
    worst, _ = run_rtp(path, prompts, hf_reference(hf, prompts))
    assert worst < 1e-4, worst


# -- greedy generation through LLM --------------------------------------------------------------------

def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["gemma3", "gemma2"])
def test_greedy_generation_matches_transformers(kind, tmp_path):
    from rtp import LLM, SamplingParams

    path, hf = make_gemma(kind, tmp_path)
    write_word_tokenizer(path, VOCAB)
    prompts = prompts_of((3, 12, 30), seed=4)
    want = [hf_greedy(hf, p, 32) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm = LLM(model=str(path), dtype="float32", compile=False, max_model_len=128, kv_cache_memory=1 << 22,
              block_size=4)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert batched == want
    assert alone == want


# -- bf16: rtp's C kernels (windowed prefill and decode attention, fused add + norm) -------------------

@pytest.mark.skipif(not cpu_kernels.tiles_available(), reason="rtp's CPU kernels need AVX-512 BF16")
def test_bf16_kernels_keep_the_window(tmp_path, monkeypatch):
    """In bf16 the layers attend through rtp's prefill and decode kernels (head_dim 32), a local
    layer's window passed as the kernels' argument: close to transformers' fp32 logits, far from
    them with the window dropped."""
    path, hf = make_gemma("gemma3-untied-mqa", tmp_path)
    prompts = prompts_of((20, 40), seed=5)
    refs = hf_reference(hf, prompts)
    calls = []  # (kernel, its window argument)

    def spy(name: str):
        real = getattr(cpu_kernels, name)

        def call(*args, **kwargs):
            calls.append((name, args[-1]))  # the window: the last positional argument of both
            return real(*args, **kwargs)
        return call

    for name in ("paged_decode_attention", "prefill_attention"):
        monkeypatch.setattr(cpu_kernels, name, spy(name))

    def worst(window: bool) -> float:
        calls.clear()
        model, _ = load_model(path, torch.bfloat16, torch.device("cpu"))
        if not window:
            for layer in model.attention_layers():
                layer.sliding_window = None
        worst, _ = run_model(model, prompts, refs, kv_dtype=torch.bfloat16, warmup=False)
        assert {kernel for kernel, _ in calls} == {"paged_decode_attention", "prefill_attention"}
        assert {w for _, w in calls} == ({0, 8} if window else {0})
        return worst

    good, bad = worst(True), worst(False)
    assert good < 0.15, good
    assert bad > 4 * good, (good, bad)


# Gemma 3: scaled embedding, per-head q/k norm, the post-norms over bf16 outputs, GELU(tanh)-and-mul, final
# logit softcapping; Gemma 2 adds attention logit softcapping inside rtp's decode and prefill attention
# kernels (their softcap argument, recorded in each call). Every K a multiple of 32, as rtp's linear
# kernels take them (BASE's GeGLU of 112 would go to oneDNN), head_dim 32 for Gemma 2's attention kernels.
GRAPH_CASES = {
    "gemma3": ("gemma3-untied-mqa", dict(final_logit_softcapping=3.0, intermediate_size=128),
               {"embed_rows", "qk_rms_norm", "rope_store_kv", "decode_attention", "rms_norm", "gelu_tanh_mul",
                "softcap"}),
    "gemma2": ("gemma2", dict(head_dim=32, intermediate_size=128),
               {"embed_rows", "rope_store_kv", "decode_attention", "rms_norm", "gelu_tanh_mul", "softcap"}),
}


@pytest.mark.skipif(not cpu_kernels.tiles_available(), reason="rtp's CPU kernels need AVX-512 BF16")
@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_gemma_bf16_steps_replay_cpu_graphs(tmp_path, caplog, case):
    """Gemma 2 and 3 in bf16 on rtp's kernels alone: decode steps are captured as CPU graphs (one
    request's, and several requests' batches), prefill and mixed steps as the step graph (the tile
    kernels serve every linear, with AMX or without). With prompts past the sliding window, the replays give token for token what
    the same engine gives with every step eager, and logits close to transformers' fp32."""
    from rtp import LLM, SamplingParams

    name, overrides, kernels = GRAPH_CASES[case]
    path, hf = make_gemma(name, tmp_path, **overrides)
    write_word_tokenizer(path, VOCAB)
    llm = LLM(model=str(path), dtype="bfloat16", compile=False, max_model_len=128, kv_cache_memory=1 << 22,
              block_size=4, max_num_seqs=4, enable_prefix_caching=False)  # every prompt prefilled in full
    runner = llm.engine.runner
    assert runner.exact_graph is not None and runner.cpu_graphs and runner.step_graph is not None
    calls = runner.exact_graph.calls
    ops = {cpu_kernels.op_name(int(c[0])) for c in calls}
    assert kernels <= ops, ops
    # every decode attention call carries the layer's cap (its softcap field: a double's bits, as its scale), or none
    cap = op_table.BY_NAME["decode_attention"].field("softcap").word
    caps = {float(np.array([c[cap]], dtype=np.int64).view(np.float64)[0]) for c in calls
            if cpu_kernels.op_name(int(c[0])) == "decode_attention"}
    assert caps == {getattr(hf.config, "attn_logit_softcapping", None) or 0.0}, caps
    prompts = prompts_of((3, 12, 30), seed=8)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run():
        batch = llm.generate(prompts, params)
        alone = llm.generate(prompts[2:], params)
        return [o.outputs[0].token_ids for o in batch + alone]

    replayed = run()
    assert runner.graph_steps >= 2 * (24 - 1) + (2 if runner.step_graph is not None else 0)
    with runner.eager():
        eager = run()
    assert replayed == eager
    # the same graphs through the runtime, fed transformers' tokens: logits near its fp32 ones
    model, _ = load_model(path, torch.bfloat16, torch.device("cpu"))
    prompts = prompts_of((20, 40), seed=9)
    with caplog.at_level(logging.INFO, logger="rtp"):
        worst, _ = run_model(model, prompts, hf_reference(hf, prompts), kv_dtype=torch.bfloat16)
    assert "captured CPU graphs for decode steps" in caplog.text, caplog.text
    assert worst < 0.15, worst


# -- GGUF, as llama.cpp's converter writes Gemma -------------------------------------------------------

_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
            "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
            "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
            "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gemma_gguf(file, hf, arch: str, quantize: bool = False) -> None:
    """What convert_hf_to_gguf.py writes for Gemma2Model / Gemma3Model: its metadata keys only (no
    attention scale, layer pattern or local RoPE base: llama.cpp assumes those), every
    *norm.weight stored as 1 + w, no output.weight when tied, q/k rows as they are."""
    gguf = pytest.importorskip("gguf")
    c = hf.config
    writer = gguf.GGUFWriter(str(file), arch)
    writer.add_architecture()
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_sliding_window(c.sliding_window)
    writer.add_vocab_size(c.vocab_size)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    else:
        writer.add_rope_freq_base(c.rope_parameters[F]["rope_theta"])
        if c.rope_parameters[F]["rope_type"] == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(c.rope_parameters[F]["factor"])
    for name, w in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        w = w.float().numpy()
        if name.endswith("norm.weight"):
            w = w + 1
        stem = name.removesuffix(".weight")
        if stem in ("model.embed_tokens", "model.norm", "lm_head"):
            gguf_name = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}[stem]
        else:
            _, _, layer, rest = stem.split(".", 3)
            gguf_name = f"blk.{layer}.{_TO_GGUF[rest]}"
        if quantize and w.ndim == 2 and w.shape[1] % 32 == 0:
            q = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name + ".weight", gguf.quants.quantize(w, q), raw_dtype=q)
        else:
            writer.add_tensor(gguf_name + ".weight", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# what llama.cpp assumes and the converter does not write: scale by head_dim, every 6th layer global
# (Gemma 3) or every 2nd (Gemma 2), Gemma 3's local layers at RoPE base 10000
GGUF_CASES = {
    "gemma3": ("gemma3", {"num_hidden_layers": 7, "layer_types": [S, S, S, S, S, F, S], "query_pre_attn_scalar": 16,
                          "rope_parameters": {S: {"rope_type": "default", "rope_theta": 10000.0},
                                              F: {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}}}),
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 16}),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_gguf_matches_transformers(case, tmp_path):
    arch, overrides = GGUF_CASES[case]
    _, hf = make_gemma(case, tmp_path / "hf", **overrides)
    file = tmp_path / f"{case}.gguf"
    write_gemma_gguf(file, hf, arch)
    from rtp.checkpoint.gguf import GGUFCheckpoint

    ckpt = GGUFCheckpoint(file)
    config = ModelConfig.from_hf(ckpt.config)
    assert config.architecture == hf.config.architectures[0] and config.hidden_act == "gelu_pytorch_tanh"
    got = dict(ckpt.tensors())
    for name, w in hf.state_dict().items():  # the norms read back as transformers holds them: 1 + w the same
        if name.endswith("norm.weight"):
            assert torch.equal(got[name] + 1, w + 1), name
            assert torch.allclose(got[name], w, atol=1e-7), name
    prompts = prompts_of((9, 30), seed=6)
    worst, _ = run_rtp(file, prompts, hf_reference(hf, prompts))
    assert worst < 1e-4, worst


def test_quantized_gguf_generates(tmp_path, caplog):
    """A Q8_0 Gemma 3 GGUF in bf16: the quantized linears' kernels, close to transformers, with the
    decode steps replayed from CPU graphs where rtp's kernels run (logged)."""
    _, hf = make_gemma("gemma3", tmp_path / "hf", **{**GGUF_CASES["gemma3"][1], "head_dim": 32,
                                                     "query_pre_attn_scalar": 32, "intermediate_size": 128})
    file = tmp_path / "q8.gguf"
    write_gemma_gguf(file, hf, "gemma3", quantize=True)
    model, _ = load_model(file, torch.bfloat16, torch.device("cpu"))
    prompts = prompts_of((9, 30), seed=7)
    with caplog.at_level(logging.INFO, logger="rtp"):
        worst, _ = run_model(model, prompts, hf_reference(hf, prompts), kv_dtype=torch.bfloat16)
    assert worst < 0.3, worst
    assert sum(layer.quant is not None for layer in model.modules() if hasattr(layer, "quant")) > 0
    if cpu_kernels.tiles_available():
        assert "captured CPU graphs for decode steps of one request" in caplog.text, caplog.text


# -- config ------------------------------------------------------------------------------------------

def test_config_errors(tmp_path):
    path, _ = make_gemma("gemma3", tmp_path)
    config = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match="hidden_act 'relu'"):
        ModelConfig.from_hf({**config, "hidden_activation": "relu"})
    (path / "config.json").write_text(json.dumps({**config, "use_bidirectional_attention": True}))
    with pytest.raises(ValueError, match="causal"):
        load_model(path, torch.float32, torch.device("cpu"))
    (path / "config.json").write_text(json.dumps({**config, "layer_types": [S, F]}))
    with pytest.raises(ValueError, match="layer_types"):
        load_model(path, torch.float32, torch.device("cpu"))


def test_compiled_decode_matches_transformers(tmp_path):
    """torch.compile'd decode steps (rtp's CUDA path, on the CPU here): Gemma 2's softcapped,
    windowed attention traced into the graph, mixed with eager prefill chunks."""
    import torch._dynamo

    torch._dynamo.reset()
    path, hf = make_gemma("gemma2", tmp_path)
    prompts = prompts_of((3, 30, 9), seed=3)
    worst, _ = run_rtp(path, prompts, hf_reference(hf, prompts), compile=True, max_num_seqs=2, max_batched=16)
    assert worst < 1e-4, worst


# -- Gemma 3 as its 4 B+ checkpoints ship: the language model of Gemma3ForConditionalGeneration --------

def test_gemma3_text_defaults_are_transformers():
    """An omitted text_config key means what transformers' Gemma3TextConfig says; rtp's RoPE and
    layer-pattern defaults for an omitted key are transformers' too."""
    from rtp.checkpoint.multimodal import WRAPPERS, text_config
    from rtp.models.gemma import layer_types, rope_for

    want = transformers.Gemma3TextConfig()
    wrapper = WRAPPERS["Gemma3ForConditionalGeneration"]
    for key, value in wrapper.text_defaults.items():
        assert getattr(want, key) == value, key
    config = ModelConfig.from_hf(text_config({"architectures": ["Gemma3ForConditionalGeneration"]}, wrapper,
                                             has_head=False))
    assert layer_types(config) == want.layer_types
    for kind in (S, F):
        assert rope_for(config, kind)[0] == want.rope_parameters[kind]["rope_theta"], kind


def make_gemma3_multimodal(path, layout: str, tied: bool):
    """transformers' Gemma3ForConditionalGeneration (a tiny SigLIP tower beside the tiny text model),
    saved as transformers saves it (4.x names: language_model.model.*), or renamed to the names
    transformers 5 holds in memory (model.language_model.*, lm_head.*); its text_config cut to the
    keys that differ from Gemma3TextConfig's defaults, as 4.x Hub configs are."""
    from safetensors.torch import load_file, save_file

    text = transformers.Gemma3TextConfig(**{**BASE, **CONFIGS["gemma3"][1]})
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=32, patch_size=8)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=150, boi_token_index=151, eoi_token_index=152,
                                       tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08 if p.dim() > 1 else 0.3)
    model.config._attn_implementation = "eager"
    model.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    assert any(k.startswith("language_model.model.") for k in tensors)
    assert any(k.startswith("vision_tower.") for k in tensors)
    if layout == "transformers-5":
        renamed = {}
        for k, v in tensors.items():
            for old, new in (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                             ("vision_tower.", "model.vision_tower."),
                             ("multi_modal_projector.", "model.multi_modal_projector.")):
                if k.startswith(old):
                    k = new + k[len(old):]
                    break
            renamed[k] = v
        save_file(renamed, path / "model.safetensors", metadata={"format": "pt"})
    saved = json.loads((path / "config.json").read_text())
    defaults = transformers.Gemma3TextConfig().to_dict()
    saved["text_config"] = {k: v for k, v in saved["text_config"].items() if defaults.get(k, object()) != v}
    (path / "config.json").write_text(json.dumps(saved))
    return model


@pytest.mark.parametrize("layout,tied", [("transformers-4", True), ("transformers-5", False)])
def test_multimodal_checkpoint_serves_its_language_model(layout, tied, tmp_path):
    """A Gemma3ForConditionalGeneration directory opens as its language model: the text config over
    transformers' defaults, the language model's tensors under their own names, the vision tower's
    left unread; logits equal transformers' multimodal model fed text only."""
    from rtp.checkpoint import open_checkpoint

    hf = make_gemma3_multimodal(tmp_path, layout, tied)
    checkpoint = open_checkpoint(tmp_path)
    assert checkpoint.config["architectures"] == ["Gemma3ForCausalLM"]
    assert checkpoint.config["tie_word_embeddings"] == tied
    names = {r.name for r in checkpoint.records}
    assert ("lm_head.weight" in names) == (not tied) and "model.embed_tokens.weight" in names
    assert all(n.startswith(("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head.")) for n in names)
    prompts = prompts_of((5, 23, 40), seed=7)
    worst, _ = run_rtp(tmp_path, prompts, hf_reference(hf, prompts))
    assert worst < 1e-4, worst
