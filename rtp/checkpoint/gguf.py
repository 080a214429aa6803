"""GGUF checkpoints: an HF-style config, HF-named fp32 tensors, tokenizer metadata.

A GGUF file (llama.cpp's format) holds metadata key/values and tensors under
llama.cpp's names, with shapes written fastest-moving dimension first. This
module reads its header (rtp/checkpoint/gguf_header.py, over a memory map) and presents it
the way a Hugging Face checkpoint looks:

    ckpt = GGUFCheckpoint("model.gguf")
    ckpt.config                   # config.json-style dict
    ckpt.records()                # where each tensor lies, how it dequantizes (rtp/checkpoint/formats.py)
    for name, tensor in ckpt.tensors():   # file order, fp32, HF names and shapes
        ...

Tensor data is not read through the memory map but streamed in file order by
rtp's loader (rtp/checkpoint/reader.py) and dequantized tensor by tensor.

Three things llama.cpp's converter did are undone here:
  names    token_embd -> model.embed_tokens, blk.N.attn_q -> model.layers.N.self_attn.q_proj, ...
  shapes   GGUF `ne` order is the reverse of torch's; we reverse it back
  q/k rows for llama-arch models the converter permuted q_proj/k_proj rows from HF's
           rotate-half layout to interleaved pairs (llama.cpp's "normal" rope); see `_unpermute_qk`

Mixture-of-experts files (qwen2moe, qwen3moe, olmoe, deepseek2, Mixtral as llama with experts) stack
a layer's experts per projection; rtp/checkpoint/gguf_moe.py reads their config and gives each expert a
record of its own; rtp/checkpoint/gguf_deepseek.py what DeepSeek's MLA and routing add.

`GGUFFile` (rtp/checkpoint/gguf_header.py, no torch) is the architecture-agnostic part (metadata,
tokenizer fields) that the tokenizer uses; `GGUFCheckpoint` adds the architecture check, the
config and tensors.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rtp.checkpoint import gguf_deepseek
from rtp.checkpoint.gguf_header import GGUFError, GGUFFile
from rtp.checkpoint.gguf_moe import MOE_ARCHITECTURES, expert_records, is_expert_tensor, moe_layout
from rtp.checkpoint.records import CheckpointError, TensorRecord
from rtp.config import ModelConfig, size_limit

if TYPE_CHECKING:
    from rtp.kernels.quant import BlockQuantized

log = logging.getLogger("rtp.gguf")

# the GGUF types whose blocks rtp's kernels multiply, and how each is repacked exactly (GGUFCheckpoint.quantized):
# a BlockQuantized constructor, with its arguments before the raw blocks
_REPACK = {"Q4_1": ("from_gguf", "q4_1"), "Q8_0": ("from_gguf", "q8_0"), "Q4_K": ("from_q4_k",),
           "Q4_0": ("from_q4_0",), "Q5_0": ("from_q5_0",), "Q5_1": ("from_q5_1",), "Q5_K": ("from_q5_k",),
           "Q6_K": ("from_q6_k",), "IQ4_NL": ("from_iq4_nl",), "IQ4_XS": ("from_iq4_xs",)}
# the types records() reads without a log line: the packed ones and the plain floats
_QUIET_TYPES = frozenset(_REPACK) | {"F32", "F16", "BF16", "F64"}

# GGUF general.architecture -> (HF model_type, HF architectures[0])
_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "olmoe": ("olmoe", "OlmoeForCausalLM"),
    "deepseek2": ("deepseek_v2", "DeepseekV2ForCausalLM"),  # V3's when its experts are sigmoid-routed
}
# the config.json key each GGUF count becomes (_build_config), whose limit it is held to
_CONFIG_KEYS = {"embedding_length": "hidden_size", "attention.head_count": "num_attention_heads",
                "attention.head_count_kv": "num_key_value_heads", "block_count": "num_hidden_layers",
                "feed_forward_length": "intermediate_size", "attention.key_length": "head_dim",
                "rope.dimension_count": "head_dim", "context_length": "max_position_embeddings",
                "attention.sliding_window": "sliding_window", "expert_count": "num_experts",
                "expert_used_count": "num_experts_per_tok", "expert_feed_forward_length": "moe_intermediate_size",
                "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}
# llama.cpp's converter permutes q/k rows only for models it converts through its
# LlamaModel class (Llama, Mistral); Qwen uses NEOX-style rope and is written as is.
_PERMUTED_QK = {"llama", "mistral"}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # a sparse layer's router and shared expert (rtp/checkpoint/gguf_moe.py: the routed experts)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Where an architecture's layer tensor is another HF parameter: llama.cpp writes Phi-3's fused
# gate_up_proj whole (gate rows, then up rows) as ffn_up.
_ARCH_LAYER_NAMES = {"phi3": {"ffn_up": "mlp.gate_up_proj"}}
# Gemma's four norms a layer (gguf's MODEL_TENSORS for gemma2/gemma3: ATTN_POST_NORM,
# FFN_PRE_NORM written as ffn_norm, FFN_POST_NORM)
_GEMMA_LAYER_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_LAYER_NAMES.update(gemma2=_GEMMA_LAYER_NAMES, gemma3=_GEMMA_LAYER_NAMES, deepseek2=gguf_deepseek.LAYER_NAMES)
# llama.cpp's converter stores Gemma's RMSNorm weights w (applied as x * (1 + w)) as 1 + w, in
# fp32: every *norm.weight of these architectures. Read back as w, less 1 in fp32, so the model loads
# GGUF and HF checkpoints alike: rtp/models/gemma.py adds the 1 back in fp32, which gives the file's
# 1 + w bit for bit (and w itself is exact for the bf16 and fp16 weights checkpoints ship).
_NORM_PLUS_ONE = {"gemma2", "gemma3"}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors llama.cpp adds that have no HF parameter. rope_freqs carries llama3-style
# rope scaling as per-dimension factors, which HF instead derives from config.
_SKIPPED = {"rope_freqs.weight"}
# LongRoPE's per-dimension factors (Phi-3), which HF keeps in config.json's rope_scaling: read
# into the config, not loaded as parameters
_ROPE_FACTORS = {"rope_factors_short.weight": "short_factor", "rope_factors_long.weight": "long_factor"}


def hf_tensor_name(gguf_name: str, arch: str | None = None) -> str:
    """The HF parameter name of a llama.cpp tensor name (in a GGUF of architecture `arch`);
    GGUFError if it has none."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    m = _LAYER_TENSOR.fullmatch(gguf_name)
    names = _ARCH_LAYER_NAMES.get(arch, {})
    if m and (m.group(2) in names or m.group(2) in _LAYER_NAMES):
        hf = names.get(m.group(2)) or _LAYER_NAMES[m.group(2)]
        if isinstance(hf, dict):  # a parameter of its own per suffix (DeepSeek's exp_probs_b.bias)
            if m.group(3) in hf:
                return f"model.layers.{m.group(1)}.{hf[m.group(3)]}"
        else:
            return f"model.layers.{m.group(1)}.{hf}.{m.group(3)}"
    raise GGUFError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name")


def _unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    The converter reshapes each head's rows as (2, head_dim/2) -- HF's rotate-half
    halves -- and swaps those two axes, interleaving the halves into (x0, y0, x1, y1, ...)
    pairs. The inverse reads rows as (head_dim/2, 2) and swaps back.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFCheckpoint(GGUFFile):
    """A GGUF model checkpoint presented as an HF one: `.config` and `.tensors()`."""

    def __init__(self, path: str | Path):
        super().__init__(path)
        arch = self.architecture
        if arch not in _ARCHITECTURES:
            raise GGUFError(f"{self.path}: GGUF architecture {arch!r} is not supported; "
                            f"supported: {', '.join(sorted(_ARCHITECTURES))}")
        self.config: dict[str, Any] = self._build_config()
        try:  # checked here too, so that whatever is wrong with it names this file, not a config.json
            ModelConfig.from_hf(self.config, str(self.path))
        except ValueError as e:
            raise GGUFError(str(e)) from e

    def _build_config(self) -> dict[str, Any]:
        arch = self.architecture
        model_type, hf_arch = _ARCHITECTURES[arch]
        # llama.cpp writes Mistral 7B as arch "llama"; only the name tells them apart
        # (transformers uses the same rule).
        if arch == "llama" and "mistral" in str(self.get("general.name", "")).lower():
            model_type, hf_arch = _ARCHITECTURES["mistral"]

        def key(name, default=None):
            return self.get(f"{arch}.{name}", default)

        # a header can parse and still hold nonsense (a string head count, zero layers): each value the
        # config uses is checked here, so such a file fails naming its key, not in a division below
        def count(name, default=None, minimum=1):
            value = key(name, default)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
                raise GGUFError(f"{self.path}: metadata {arch}.{name} = {value!r} is not an integer >= {minimum}")
            limit = size_limit(_CONFIG_KEYS.get(name, name))
            if value > limit:
                raise GGUFError(f"{self.path}: metadata {arch}.{name} = {value} is larger than rtp takes "
                                f"(at most {limit})")
            return int(value)

        def positive(name, default):
            value = key(name, default)
            if (isinstance(value, bool) or not isinstance(value, (int, float, np.number))
                    or not 0 < value < float("inf")):
                raise GGUFError(f"{self.path}: metadata {arch}.{name} = {value!r} is not a positive number")
            return float(value)

        names = {t.name for _, t in self.all_tensors()}
        hidden = count("embedding_length")
        heads = count("attention.head_count")
        moe = moe_layout(self.path, arch, self.all_tensors(), key, count) if arch in MOE_ARCHITECTURES else None
        required = {"embedding_length": hidden, "attention.head_count": heads, "block_count": count("block_count"),
                    # a sparse model's dense layers are this wide; with none, the file need not say it
                    "feed_forward_length": count("feed_forward_length", moe.width if moe else None)}
        missing = [f"{arch}.{k}" for k, v in required.items() if v is None]
        if missing:
            raise GGUFError(f"{self.path}: metadata lacks {', '.join(missing)}")
        kv_heads = count("attention.head_count_kv", heads)
        if heads % kv_heads:
            raise GGUFError(f"{self.path}: metadata {arch}.attention.head_count = {heads} is not a multiple of "
                            f"{arch}.attention.head_count_kv = {kv_heads}")
        tokens = self.get("tokenizer.ggml.tokens")
        vocab = count("vocab_size") or (len(tokens) if isinstance(tokens, list) and tokens else None)
        if vocab is None:
            embd = next((t for _, t in self.all_tensors() if t.name == "token_embd.weight"), None)
            vocab = int(embd.shape[-1]) if embd is not None else None
        head_dim = count("attention.key_length")
        if head_dim is None:
            if hidden % heads:
                raise GGUFError(f"{self.path}: metadata {arch}.embedding_length = {hidden} is not a multiple of "
                                f"{arch}.attention.head_count = {heads}, and no attention.key_length says the "
                                "head size")
            head_dim = hidden // heads
        rope_dim = count("rope.dimension_count")
        if rope_dim is not None and rope_dim > head_dim:
            raise GGUFError(f"{self.path}: metadata {arch}.rope.dimension_count = {rope_dim} exceeds the head "
                            f"size {head_dim}")

        cfg: dict[str, Any] = {
            "architectures": [hf_arch],
            "model_type": model_type,
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": required["feed_forward_length"],
            "num_hidden_layers": key("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": positive("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": positive("rope.freq_base", 10000.0),
            "max_position_embeddings": count("context_length", 4096),
            "tie_word_embeddings": "output.weight" not in names,
        }
        if model_type in ("llama", "mistral"):
            cfg["attention_bias"] = "blk.0.attn_q.bias" in names
            cfg["mlp_bias"] = "blk.0.ffn_up.bias" in names
        if moe is not None and arch != "deepseek2":
            renormalize = key("expert_weights_norm", MOE_ARCHITECTURES[arch])
            cfg.update(moe.hf_config(arch, cfg["num_hidden_layers"], bool(renormalize),
                                     count("feed_forward_length")))
            if arch == "qwen2moe":
                cfg["qkv_bias"] = "blk.0.attn_q.bias" in names
        if arch == "olmoe" and key("attention.clamp_kqv") is not None:  # OLMo's clip_qkv, as llama.cpp names it
            cfg["clip_qkv"] = positive("attention.clamp_kqv", None)
        if rope_dim and rope_dim != head_dim:  # Phi-4-mini rotates 96 of its 128 dims
            cfg["partial_rotary_factor"] = rope_dim / head_dim
        sliding = count("attention.sliding_window", minimum=0)
        if sliding:  # llama.cpp writes 0 for none (Phi-4-mini)
            cfg["sliding_window"] = sliding
        rope_scaling = self._rope_scaling(arch)
        if rope_scaling:
            cfg["rope_scaling"] = rope_scaling
        if arch in _NORM_PLUS_ONE:
            cfg.update(_gemma_config(arch, key, cfg))
        if arch == "deepseek2":
            cfg = gguf_deepseek.deepseek2_config(self.path, cfg, moe, names, key, count, positive)
        for gguf_key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                                 ("padding_token_id", "pad_token_id")):
            value = self.get(f"tokenizer.ggml.{gguf_key}")
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                    raise GGUFError(f"{self.path}: metadata tokenizer.ggml.{gguf_key} = {value!r} is not a token id")
                cfg[hf_key] = int(value)
        return cfg

    def _rope_scaling(self, arch: str) -> dict[str, Any] | None:
        kind = self.get(f"{arch}.rope.scaling.type")
        factors = self._rope_factors()
        if factors:  # llama.cpp writes Phi-3's LongRoPE as its factor tensors, with no scaling type
            kind = "longrope"
        if kind in (None, "none"):
            return None
        scaling: dict[str, Any] = {"rope_type": kind, **factors}
        factor = self.get(f"{arch}.rope.scaling.factor")
        if factor is not None:
            scaling["factor"] = factor
        original = self.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = original
        for name in ("attn_factor", "yarn_beta_fast", "yarn_beta_slow"):
            value = self.get(f"{arch}.rope.scaling.{name}")
            if value is not None:
                scaling[name.removeprefix("yarn_").replace("attn_factor", "attention_factor")] = value
        return scaling

    def _rope_factors(self) -> dict[str, list[float]]:
        """short_factor and long_factor from the rope_factors_* tensors (none: {})."""
        from gguf import GGMLQuantizationType as Q

        factors = {}
        for path, t in self.all_tensors():
            if t.name in _ROPE_FACTORS:
                if t.tensor_type not in (Q.F32, Q.F16):
                    raise GGUFError(f"{path}: {t.name} is {t.tensor_type.name}, not F32 or F16")
                factors[_ROPE_FACTORS[t.name]] = np.asarray(t.data, dtype=np.float32).reshape(-1).tolist()
        if len(factors) == 1:
            raise GGUFError(f"{self.path}: LongRoPE needs both rope_factors_short and rope_factors_long, "
                            f"it has only {next(iter(factors)).replace('_factor', '')}")
        return factors

    @property
    def num_tensors(self) -> int:
        return sum(len(header.tensors) for _, header in self.parts)

    def records(self) -> list[TensorRecord]:
        """Where each model tensor's bytes lie and how they decode (to fp32, HF name and shape,
        q/k rows unpermuted), in file (data offset) order: what rtp's loader streams.

        Every tensor's name, type and extent is checked here, so a bad file fails before
        anything is read, not half-way through loading.
        """
        sizes = {path: path.stat().st_size for path, _ in self.parts}
        permute = self.architecture in _PERMUTED_QK
        heads = {"q_proj": self.config["num_attention_heads"], "k_proj": self.config["num_key_value_heads"]}
        records = []
        unpacked: dict[str, int] = {}  # quantized types no packed layout takes: tensors of each
        for path, t in self.all_tensors():
            if t.tensor_type.name not in _QUIET_TYPES:
                unpacked[t.tensor_type.name] = unpacked.get(t.tensor_type.name, 0) + 1
            if t.name in _SKIPPED:
                log.warning("%s: skipping %s (no HF parameter; rope scaling from it is not applied)",
                            path.name, t.name)
                continue
            if t.name in _ROPE_FACTORS:  # in the config already
                continue
            _check_dequantizable(t, path)
            end = int(t.data_offset) + int(t.n_bytes)
            if end > sizes[path]:
                raise CheckpointError(f"{path}: tensor {t.name} lies at [{int(t.data_offset)}, {end}), "
                                      f"past the end of the file ({sizes[path]} bytes): truncated or corrupt")
            if is_expert_tensor(t.name):  # each expert a record of its own, its bytes a run of whole blocks
                for name, begin, end, shape in expert_records(t, self.architecture):
                    decode = partial(_decode, qtype=t.tensor_type, shape=shape, name=t.name, unpermute_heads=None)
                    records.append(TensorRecord(name, path, begin, end, shape, torch.float32, decode))
                continue
            name = hf_tensor_name(t.name, self.architecture)
            begin = int(t.data_offset)
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            if name.endswith("shared_expert_gate.weight") and len(shape) == 1:
                shape = (1, shape[0])  # llama.cpp's shape for it, [hidden]; a linear to one output here
            proj = name.rsplit(".", 2)[-2] if permute else None
            decode = partial(_decode, qtype=t.tensor_type, shape=shape, name=t.name,
                             unpermute_heads=heads.get(proj))
            if self.architecture in _NORM_PLUS_ONE and name.endswith("norm.weight"):
                decode = partial(_minus_one, decode)
            records.append(TensorRecord(name, path, begin, end, shape, torch.float32, decode))
        for qtype, count in sorted(unpacked.items()):
            log.info("%s: %d %s tensors are dequantized to the model's dtype when read: rtp has no packed layout "
                     "for %s (the K-quants, Q4_0/1, Q5_0/1, Q8_0, IQ4_NL and IQ4_XS keep their blocks)",
                     self.path.name, count, qtype, qtype)
        return records

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, fp32 tensor in HF shape) for every model tensor, in file order, each a
        tensor of its own; read the way the loader reads them (`records`)."""
        from rtp.checkpoint.reader import stream_tensors

        for record, tensor in stream_tensors(self.records()):
            yield record.name, tensor

    def quantized(self) -> Iterator[tuple[str, "BlockQuantized"]]:
        """(HF name, packed blocks) of every weight matrix rtp's small-batch CPU kernels multiply
        from its blocks, q/k rows unpermuted like `tensors()`: Q4_1 and Q8_0 as the file has them,
        Q4_K and Q4_0 repacked exactly into q4_1, Q5_0, Q5_1 and Q5_K into q8_1, Q6_K into
        q8_16, IQ4_NL and IQ4_XS into q8_0 (rtp/kernels/quant.py). Other types (the other IQ types)
        are multiplied from their dequantized weights, which records() says once per type."""
        from gguf import GGMLQuantizationType as Q

        from rtp.kernels.quant import BlockQuantized

        kinds = {Q[name]: partial(getattr(BlockQuantized, method), *args) for name, (method, *args) in _REPACK.items()}
        permute = self.architecture in _PERMUTED_QK
        heads = {"q_proj": self.config["num_attention_heads"], "k_proj": self.config["num_key_value_heads"]}
        for _, t in self.all_tensors():
            if t.tensor_type in kinds and is_expert_tensor(t.name):  # each expert's run of blocks
                raw = t.data
                for name, begin, end, shape in expert_records(t, self.architecture):
                    lo = begin - int(t.data_offset)
                    yield name, kinds[t.tensor_type](raw[lo:lo + end - begin], shape[0])
                continue
            if (t.tensor_type not in kinds or t.name in _SKIPPED or t.name in _ROPE_FACTORS
                    or not t.name.endswith(".weight") or is_expert_tensor(t.name)
                    or t.name.split(".")[-2] in gguf_deepseek.UNPACKED):
                continue
            name = hf_tensor_name(t.name, self.architecture)
            rows = int(t.shape[-1]) if len(t.shape) > 1 else 1
            packed = kinds[t.tensor_type](t.data, rows)
            proj = name.rsplit(".", 2)[-2]
            if permute and proj in heads:
                packed = packed.rows(_unpermute_qk(torch.arange(rows), heads[proj]))
            yield name, packed


def _quant_types():
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    traits = getattr(quants, "_type_traits", None)
    extra = set(traits) if traits is not None else None  # unknown on other gguf versions: try at use
    return {Q.F32, Q.F16, Q.F64}, extra


def _check_dequantizable(t, path: Path) -> None:
    plain, quantized = _quant_types()
    if t.tensor_type in plain or quantized is None or t.tensor_type in quantized:
        return
    supported = sorted(q.name for q in plain | quantized)
    raise GGUFError(f"{path}: tensor {t.name} has quantization type {t.tensor_type.name}, which the "
                    f"installed gguf package cannot dequantize; supported: {', '.join(supported)}")


def _minus_one(decode, raw: torch.Tensor) -> torch.Tensor:
    """A Gemma norm weight as transformers holds it: llama.cpp's 1 + w, less 1 (_NORM_PLUS_ONE)."""
    return decode(raw).sub_(1.0)


def _gemma_config(arch: str, key, cfg: dict[str, Any]) -> dict[str, Any]:
    """The config.json keys of a Gemma 2 / 3 GGUF beyond the Llama ones. llama.cpp's converter writes
    neither the attention scale, the local/global layer pattern nor (Gemma 3) the local layers' RoPE
    base; llama.cpp assumes them by architecture (src/llama-model.cpp), and so does this."""
    out: dict[str, Any] = {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}
    scale = key("attention.scale")
    if scale:
        out["query_pre_attn_scalar"] = scale**-2
    else:  # the 27B models scale by hidden_size / heads (46 and 62 layers), the others by head_dim
        big = cfg["num_hidden_layers"] == (46 if arch == "gemma2" else 62)
        out["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"]
    pattern = key("attention.sliding_window_pattern")
    if not cfg.get("sliding_window"):  # no window: llama.cpp makes every layer global
        out["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    elif isinstance(pattern, list):  # one flag per layer, true: a sliding-window layer
        out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:  # every pattern-th layer global
        out["sliding_window_pattern"] = pattern or (2 if arch == "gemma2" else 6)
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if key(name):
            out[name] = key(name)
    if arch == "gemma3":
        out["rope_local_base_freq"] = key("rope.freq_base_swa", 10000.0)
        out["rope_theta"] = key("rope.freq_base", 1_000_000.0)
    return out


def _decode(raw: torch.Tensor, *, qtype, shape: tuple[int, ...], name: str,
            unpermute_heads: int | None) -> torch.Tensor:
    """One tensor's raw file bytes -> a new fp32 tensor in HF shape (q/k rows unpermuted)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    data = raw.numpy()
    if qtype == Q.F32:
        arr = data.view(np.float32).copy()  # its own memory: the bytes belong to a reader buffer
    elif qtype == Q.F16:
        arr = data.view(np.float16).astype(np.float32)
    elif qtype == Q.F64:
        arr = data.view(np.float64).astype(np.float32)
    elif qtype == Q.Q8_0:
        # d q per block of 32, in torch (vectorised, both cores): the same bits as gguf's numpy
        # dequantize (tests/checkpoint/test_gguf.py), 0.15 s for the default model's embedding against 0.7
        blocks = raw.view(-1, 34)
        d = blocks[:, :2].contiguous().view(torch.float16).float()
        w = (blocks[:, 2:].contiguous().view(torch.int8).float() * d).reshape(shape)
        return w if unpermute_heads is None else _unpermute_qk(w, unpermute_heads)
    else:
        try:
            arr = quants.dequantize(data, qtype)
        except NotImplementedError as e:
            raise GGUFError(f"tensor {name}: cannot dequantize type {qtype.name}: {e}") from e
    w = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32).reshape(shape))
    return w if unpermute_heads is None else _unpermute_qk(w, unpermute_heads)
