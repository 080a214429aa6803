"""A checkpoint's config is validated before anything is built from it (rtp/config.py
ModelConfig.from_hf, rtp/checkpoint/loader.py check_config_fits_checkpoint and check_memory):
every size an integer within bounds, the architecture one rtp has a model for (checked first),
the sizes together no larger than the checkpoint's tensors and the free memory. Each error is one
line naming the file and the key, raised before a byte of the weights is read.

Real tiny checkpoints (config.json + one safetensors file, or a GGUF) with absurd values.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rtp.checkpoint import CheckpointError
from rtp.checkpoint import loader
from rtp.checkpoint.loader import load_model

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 160, "hidden_size": 64,
          "intermediate_size": 112, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "rms_norm_eps": 1e-5, "max_position_embeddings": 128, "tie_word_embeddings": False}
HEAD_DIM = 16


def llama_tensors() -> dict[str, torch.Tensor]:
    """CONFIG's tensors, HF-named, random bf16 (fp32 norms)."""
    h, inter, vocab, d = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"], HEAD_DIM
    heads, kv = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (heads * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
                   p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, heads * d),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter)}
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=g).to(torch.float32 if len(shape) == 1 else torch.bfloat16)
            for name, shape in shapes.items()}


def write(path: Path, config: dict, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """A checkpoint directory: `config` as config.json (None values left out) and one safetensors file."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    save_file(llama_tensors() if tensors is None else tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture
def no_reads(monkeypatch):
    """Any read of the weights fails the test: every error below must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("weights were read before the config was refused")
    monkeypatch.setattr(loader, "stream_tensors", refuse)


def at(path: Path) -> str:
    """A pattern matching `path` as it is."""
    return re.escape(str(path))


def refused(path: Path, match: str, error=ValueError, dtype=torch.bfloat16) -> str:
    with pytest.raises(error, match=match) as info:
        load_model(path, dtype, torch.device("cpu"))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_sane_checkpoint_loads(tmp_path):
    """The control: the tiny checkpoint these tests spoil loads as it is."""
    model, config = load_model(write(tmp_path / "ok", CONFIG), torch.bfloat16, torch.device("cpu"))
    assert config.num_hidden_layers == 2 and model.lm_head.weight.shape == (160, 64)


@pytest.mark.parametrize("key, value, message", [
    # 1e9 is a float in JSON: sizes are integers, even whole floats (as in GGUF metadata)
    ("hidden_size", 1e9, r"hidden_size = 1000000000\.0 is not a positive integer"),
    ("hidden_size", 10**9, r"hidden_size = 1000000000 is larger than rtp takes \(at most 1048576\)"),
    ("num_attention_heads", -4, r"num_attention_heads = -4 is not a positive integer"),
    ("num_key_value_heads", 2.0, r"num_key_value_heads = 2\.0 is not a positive integer"),
    ("num_hidden_layers", True, r"num_hidden_layers = True is not a positive integer"),
    ("intermediate_size", "112", r"intermediate_size = '112' is not a positive integer"),
    ("head_dim", 0, r"head_dim = 0 is not a positive integer"),
    ("vocab_size", 2**62, r"vocab_size = 4611686018427387904 is larger than rtp takes \(at most 2147483647\)"),
    ("max_position_embeddings", 2**40, r"max_position_embeddings = 1099511627776 is larger than rtp takes"),
    ("sliding_window", -1, r"sliding_window = -1 is not an integer >= 0"),
    ("num_local_experts", "eight", r"num_local_experts = 'eight' is not an integer >= 0"),
    ("eos_token_id", [2, "</s>"], r"eos_token_id = '</s>' is not a token id"),
    ("mlp_only_layers", [0, -1], r"mlp_only_layers = \[0, -1\] is not a list of layer indices"),
    ("kv_lora_rank", 0, r"kv_lora_rank = 0 is not a positive integer"),
])
def test_each_size_is_an_integer_within_bounds(tmp_path, no_reads, key, value, message):
    path = write(tmp_path / "ckpt", {**CONFIG, key: value})
    refused(path, rf"^{at(path / 'config.json')} {message}")


def test_an_unknown_architecture_is_named_before_any_key_is_read(tmp_path, no_reads):
    """Another family's config lacks the keys rtp reads: its architecture is what is wrong."""
    path = write(tmp_path / "foo", {"architectures": ["FooForCausalLM"], "vocab_size": 160, "n_embd": 64})
    message = refused(path, rf"^{at(path / 'config.json')} names architecture 'FooForCausalLM', which rtp "
                            r"does not support \(supported: .*LlamaForCausalLM")
    assert "lacks" not in message
    path = write(tmp_path / "str", {**CONFIG, "architectures": "LlamaForCausalLM"})
    refused(path, r"config\.json architectures = 'LlamaForCausalLM' is not a list of names")


@pytest.mark.parametrize("key, value, why", [
    ("num_hidden_layers", 1000, r"\(whose tensors are of 2 layers\)"),
    ("vocab_size", 10**6, r"\(whose model\.embed_tokens\.weight is 160 x 64\)"),
    ("intermediate_size", 10**5, r"\(the config's mlp alone is 38\.4 M\)"),
    ("head_dim", 4096, r"\(the config's attention alone is 6\.3 M\)"),
])
def test_a_config_far_larger_than_its_checkpoint_names_the_key(tmp_path, no_reads, key, value, why):
    """Each size within bounds, together far more parameters than the tensors hold: the key the
    tensors contradict (their layers, the embedding's shape), else the dominant part's key."""
    path = write(tmp_path / "ckpt", {**CONFIG, key: value})
    message = refused(path, rf"^{at(path / 'config.json')} {key} = {value} implies .* parameters, [\d,]+x "
                            rf"the 88\.4 K in its checkpoint {why}$", CheckpointError)
    assert "Storage" not in message


def test_the_expert_count_is_named_as_the_config_spells_it(tmp_path, monkeypatch, no_reads):
    """A Mixtral config of 4096 experts over a checkpoint of 4: num_local_experts, its own key."""
    h, inter, vocab, d, experts = 64, 112, 160, HEAD_DIM, 4
    config = {**CONFIG, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4096,
              "num_experts_per_tok": 2, "num_hidden_layers": 1}
    p = "model.layers.0."
    tensors = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h),
               p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
               p + "self_attn.q_proj.weight": (4 * d, h), p + "self_attn.k_proj.weight": (2 * d, h),
               p + "self_attn.v_proj.weight": (2 * d, h), p + "self_attn.o_proj.weight": (h, 4 * d),
               p + "block_sparse_moe.gate.weight": (experts, h)}
    for e in range(experts):
        q = f"{p}block_sparse_moe.experts.{e}."
        tensors |= {q + "w1.weight": (inter, h), q + "w2.weight": (h, inter), q + "w3.weight": (inter, h)}
    tensors = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in tensors.items()}
    path = write(tmp_path / "mixtral", config, tensors)
    refused(path, r"config\.json num_local_experts = 4096 implies .* \(whose tensors are of 4 experts\)$",
            CheckpointError)
    write(path, {**config, "num_local_experts": 4}, tensors)  # the control: with its own count it loads
    monkeypatch.undo()  # reads allowed
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    assert model is not None


def test_a_model_larger_than_the_free_memory_says_how_many_gib(tmp_path, monkeypatch, no_reads):
    """The weights (in the loader's dtype) and the RoPE table against the memory free now."""
    monkeypatch.setattr(loader, "_free_bytes", lambda device: 2 << 30)
    path = write(tmp_path / "rope", {**CONFIG, "max_position_embeddings": 2**26})  # a 4 GiB fp32 table
    refused(path, rf"^{at(path)}: the model needs 4\.0 GiB \(0\.2 MiB of bfloat16 weights and a 4\.0 GiB RoPE "
                  r"table for max_position_embeddings 67108864\), but only 2\.0 GiB is free on this host$",
            CheckpointError)
    monkeypatch.setattr(loader, "_free_bytes", lambda device: 100_000)  # fewer bytes than the weights
    path = write(tmp_path / "weights", CONFIG)
    refused(path, r"the model needs 0\.3 MiB \(0\.3 MiB of float32 weights\), but only 0\.1 MiB is free",
            CheckpointError, dtype=torch.float32)


def test_the_existing_tensor_checks_still_name_the_tensor(tmp_path):
    """Within the ratio, the tensor-by-tensor check on the meta device speaks as before."""
    path = write(tmp_path / "three", {**CONFIG, "num_hidden_layers": 3})
    refused(path, r"checkpoint lacks 9 tensors the model needs, e\.g\. model\.layers\.2\.", CheckpointError)
    path = write(tmp_path / "wide", {**CONFIG, "intermediate_size": 128})
    refused(path, r"shape", CheckpointError)


def write_gguf(file: Path, **overrides) -> Path:
    """A llama GGUF of CONFIG's tensors (F32), its metadata counts overridden by name."""
    gguf = pytest.importorskip("gguf")
    from rtp.checkpoint import gguf as rtp_gguf

    to_gguf = {hf: name for name, hf in rtp_gguf._GLOBAL_NAMES.items()}
    to_layer = {hf: name for name, hf in rtp_gguf._LAYER_NAMES.items()}
    counts = {"context_length": 128, "embedding_length": 64, "feed_forward_length": 112, "block_count": 2,
              "head_count": 4, "head_count_kv": 2, "vocab_size": 160, **overrides}
    writer = gguf.GGUFWriter(str(file), "llama")  # which writes general.architecture
    for name, value in counts.items():
        getattr(writer, f"add_{name}")(value)
    writer.add_layer_norm_rms_eps(1e-5)
    for name, t in llama_tensors().items():
        stem = name.removesuffix(".weight")
        if stem in to_gguf:
            gguf_name = to_gguf[stem]
        else:  # model.layers.N.rest
            _, _, layer, rest = stem.split(".", 3)
            gguf_name = f"blk.{layer}.{to_layer[rest]}"
        writer.add_tensor(gguf_name + ".weight", t.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return file


def test_a_gguf_names_itself_and_its_metadata_key(tmp_path, monkeypatch, no_reads):
    """A GGUF's config comes from its metadata: its errors name the .gguf, never a config.json."""
    from rtp.checkpoint.gguf import GGUFError

    file = write_gguf(tmp_path / "deep.gguf", block_count=10**6)
    refused(file, rf"^{at(file)}: metadata llama\.block_count = 1000000 is larger than rtp takes "
                  r"\(at most 65536\)$", GGUFError)
    file = write_gguf(tmp_path / "long.gguf", block_count=1000)
    message = refused(file, rf"^{at(file)} num_hidden_layers = 1000 implies .* \(whose tensors are of 2 layers\)$",
                      CheckpointError)
    assert "config.json" not in message
    monkeypatch.undo()  # reads allowed
    model, _ = load_model(write_gguf(tmp_path / "ok.gguf"), torch.float32, torch.device("cpu"))  # the control
    assert model is not None


@pytest.mark.parametrize("config, key", [
    ({**CONFIG, "num_hidden_layers": 1000}, "num_hidden_layers = 1000"),
    ({**CONFIG, "hidden_size": 10**9}, "hidden_size = 1000000000"),
    ({"architectures": ["FooForCausalLM"], "n_layer": 2}, "architecture 'FooForCausalLM'"),
])
def test_the_cli_reports_one_line(tmp_path, config, key):
    """`rtp generate` on such a checkpoint: a one-line error on stderr naming the key, no traceback."""
    path = write(tmp_path / "ckpt", config)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-m", "rtp", "generate", "--model", str(path), "--prompt", "hi",
                           "--max-tokens", "1", "--device", "cpu"], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("rtp generate: ") and "config.json" in last and key in last, done.stderr
