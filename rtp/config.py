"""One config object, built and validated once, passed down.

`ModelConfig` is what rtp reads from a checkpoint's config.json (or a GGUF's
metadata, turned into the same dict). `EngineConfig` is the engine's own knobs,
composed of one sub-config per component (load, cache, scheduler, parallel, EPLB),
each handed to the component it configures. Runtime facts (block counts, eos ids
the tokenizer adds) live in their own objects, never written back here. This
module imports nothing of rtp: everything else builds on it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Annotated, Any

import msgspec


class ModelConfig(msgspec.Struct, kw_only=True, frozen=True):
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False          # Qwen2; or config.attention_bias
    o_bias: bool = False            # config.attention_bias also biases o_proj (Llama)
    mlp_bias: bool = False
    qk_norm: bool = False           # Qwen3: RMSNorm over each head of q and k before RoPE
    sliding_window: int | None = None
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    # Mixture of experts (num_experts 0: a dense model). Layer i is sparse when it is not in
    # mlp_only_layers and (i + 1) is a multiple of decoder_sparse_step (Qwen MoE's rule; Mixtral: all).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one shared expert behind a sigmoid gate
    norm_topk_prob: bool = False              # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # physical expert slots per MoE layer beyond num_experts, for EPLB's replicas: not from
    # config.json, the deployment's choice (load_model's redundant_experts)
    num_redundant_experts: int = 0
    raw: dict[str, Any] = msgspec.field(default_factory=dict)  # the whole config.json (rope, ...)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a Hugging Face config.json dict; `source` is the file errors name (a GGUF's
        config, made from its metadata, names the GGUF). The architecture is checked before any
        other key is read, so an architecture rtp has no model for is named as such, not as a key
        its config lacks; then every size is an integer within _SIZE_LIMITS (tests:
        tests/checkpoint/test_config_validation.py). Each error is one line naming `source` and a key."""
        arch = _architecture(hf, source)

        def count(key: str, default: Any = _MISSING, minimum: int = 1) -> Any:
            return _count(hf, key, default, minimum=minimum, source=source)

        heads = count("num_attention_heads")
        hidden = count("hidden_size")
        head_dim = count("head_dim", None)
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"{source} hidden_size {hidden} is not a multiple of num_attention_heads "
                                 f"{heads}, and no head_dim says the head size")
            head_dim = hidden // heads
        layers = count("num_hidden_layers")
        intermediate = count("intermediate_size")
        eos = hf.get("eos_token_id")
        eos_ids = _token_ids(eos if isinstance(eos, list) else [eos], "eos_token_id", source)
        attention_bias = bool(hf.get("attention_bias", False))
        sliding = count("sliding_window", None, minimum=0)
        if arch.startswith("Qwen") and not hf.get("use_sliding_window", False):
            sliding = None  # Qwen configs carry a window size they do not use
        # the first of these a config sets names its routed experts (Qwen, Mixtral, DeepSeek)
        num_experts = next((n for n in (count(k, 0, minimum=0) for k in _EXPERT_COUNT_KEYS) if n), 0)
        for key in _OPTIONAL_SIZES:  # sizes only some architectures read (from raw)
            count(key, None, minimum=_OPTIONAL_SIZES[key])
        cfg = cls(
            architecture=arch,
            vocab_size=count("vocab_size"),
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=count("num_key_value_heads", heads),
            head_dim=head_dim,
            rms_norm_eps=_positive_number(hf, "rms_norm_eps", 1e-6, source),
            max_position_embeddings=count("max_position_embeddings", 4096),
            # Gemma's configs leave it out and mean transformers' default, tied
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", arch in _GEMMA_ACTIVATIONS)),
            qkv_bias=(attention_bias or arch == "Qwen2ForCausalLM"
                      or (arch == "Qwen2MoeForCausalLM" and bool(hf.get("qkv_bias", True)))),
            o_bias=attention_bias and arch in ("LlamaForCausalLM", "MistralForCausalLM"),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_window=sliding or None,
            # Gemma 2 and 3 compute with hidden_activation (a Gemma 2 config carries both keys)
            hidden_act=(hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
                        if arch in _GEMMA_ACTIVATIONS else hf.get("hidden_act", "silu")),
            bos_token_id=next(iter(_token_ids([hf.get("bos_token_id")], "bos_token_id", source)), None),
            eos_token_ids=eos_ids,
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
            num_experts=num_experts,
            num_experts_per_tok=count("num_experts_per_tok", 0, minimum=0),
            # Mixtral's and OLMoE's experts are intermediate_size wide; Qwen's have a size of their own
            moe_intermediate_size=(intermediate if arch in ("MixtralForCausalLM", "OlmoeForCausalLM")
                                   else count("moe_intermediate_size", 0, minimum=0)) if num_experts else 0,
            shared_expert_intermediate_size=count("shared_expert_intermediate_size", 0, minimum=0),
            # Mixtral always renormalises; its config has no flag for it
            norm_topk_prob=arch == "MixtralForCausalLM" or bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=count("decoder_sparse_step", 0, minimum=0) or 1,
            mlp_only_layers=(_layer_list(hf, "mlp_only_layers", source)
                             or _deepseek_dense_layers(hf, layers)),
            raw=dict(hf),
        )
        cfg.validate(source)
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        with open(path) as f:
            return cls.from_hf(json.load(f))

    def is_moe_layer(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def check_tensor_parallel(self, tp: int) -> None:
        """Refuse a tensor-parallel size this model's layers cannot split over (the same rules the
        parallel layers apply as they are built), before any rank is started to find out."""
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads % tp or (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            raise ValueError(f"--tp {tp}: {heads} attention heads and {kv} kv heads do not split over {tp} "
                             f"tensor-parallel ranks")
        if self.vocab_size % tp:
            raise ValueError(f"--tp {tp}: a vocabulary of {self.vocab_size} does not split over {tp} ranks")
        if self.architecture == "OlmoeForCausalLM" and tp > 1:
            raise ValueError(f"--tp {tp}: OLMoE's q/k norm spans all heads, which tensor parallelism splits")
        if self.intermediate_size % tp:
            raise ValueError(f"--tp {tp}: an intermediate size of {self.intermediate_size} does not split "
                             f"over {tp} ranks")

    def validate(self, source: str = "config") -> None:
        """The relations between sizes (from_hf has checked each on its own); `source` as there."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{source} {name} must be positive")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"{source} num_experts_per_tok {self.num_experts_per_tok} must be between 1 and "
                             f"num_experts {self.num_experts}")
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ValueError(f"{source} moe_intermediate_size must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{source} num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.hidden_act not in _GEMMA_ACTIVATIONS.get(self.architecture, ("silu", "swish")):
            raise ValueError(f"{source} hidden_act {self.hidden_act!r} is not supported for {self.architecture} "
                             f"(rtp supports {', '.join(_GEMMA_ACTIVATIONS.get(self.architecture, ('silu',)))})")


# the activations of Gemma's GeGLU MLP rtp computes (rtp/models/gemma.py); every other model: SiLU
_GEMMA_ACTIVATIONS = {arch: ("gelu_pytorch_tanh", "gelu")
                      for arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")}


def _deepseek_dense_layers(hf: dict[str, Any], layers: int) -> tuple[int, ...]:
    """DeepSeek's dense layers: the first first_k_dense_replace, and those off moe_layer_freq
    (both checked by from_hf, as _OPTIONAL_SIZES)."""
    if "first_k_dense_replace" not in hf:
        return ()
    first, freq = hf["first_k_dense_replace"] or 0, hf.get("moe_layer_freq") or 1
    return tuple(i for i in range(layers) if i < first or i % freq)


def _architecture(hf: dict[str, Any], source: str) -> str:
    """The config's architecture, which rtp must have a model for: checked before any other key,
    so that another model family's config is refused as that, not for a key it names differently."""
    archs = hf.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise ValueError(f"{source} architectures = {archs!r} is not a list of names")
    archs = [a for a in archs or [] if a]
    if not archs:
        raise ValueError(f"{source} names no architecture (its \"architectures\" list is empty)")
    # the model registry is the one list of architectures (rtp/models/__init__.py); it imports
    # nothing but importlib, and only from here on, so this module stays importable without torch
    from rtp.models import supported_architectures

    supported = supported_architectures()
    if archs[0] not in supported:
        raise ValueError(f"{source} names architecture {archs[0]!r}, which rtp does not support "
                         f"(supported: {', '.join(supported)})")
    return archs[0]


_MISSING = object()
_INT32_MAX = 2**31 - 1
# The most each size may be. Far past every released model (hidden sizes under 2**15, layers under
# 2**8, experts under 2**10), and low enough that no tensor a model builds from them overflows int64 storage
# arithmetic (the largest, a layer's experts: 2**16 x 2**21 x 2**20 elements x 4 bytes = 2**59 bytes):
# a config beyond them is a typo, refused here by name rather than by torch in a traceback. What the
# machine can hold is the loader's to check (rtp/checkpoint/loader.py: check_config_fits_checkpoint,
# check_memory).
_WIDTH, _COUNT = 2**20, 2**16
_SIZE_LIMITS = {
    "vocab_size": _INT32_MAX,  # the runtime holds token ids as int32
    "max_position_embeddings": _INT32_MAX,  # and positions
    "sliding_window": _INT32_MAX,
    "hidden_size": _WIDTH, "intermediate_size": _WIDTH, "moe_intermediate_size": _WIDTH,
    "shared_expert_intermediate_size": _WIDTH, "q_lora_rank": _WIDTH, "kv_lora_rank": _WIDTH,
    "num_hidden_layers": _COUNT, "num_attention_heads": _COUNT, "num_key_value_heads": _COUNT, "head_dim": _COUNT,
    "qk_nope_head_dim": _COUNT, "qk_rope_head_dim": _COUNT, "v_head_dim": _COUNT,
    "num_experts": _COUNT, "num_local_experts": _COUNT, "n_routed_experts": _COUNT, "n_shared_experts": _COUNT,
    "num_experts_per_tok": _COUNT, "n_group": _COUNT, "topk_group": _COUNT, "decoder_sparse_step": _COUNT,
    "first_k_dense_replace": _COUNT, "moe_layer_freq": _COUNT,
}
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
# sizes read from `raw` by the architectures that have them (DeepSeek's MLA and MoE), each with
# its least value; checked when present so that their models never meet a string or a zero
_OPTIONAL_SIZES = {"q_lora_rank": 1, "kv_lora_rank": 1, "qk_nope_head_dim": 1, "qk_rope_head_dim": 1,
                   "v_head_dim": 1, "n_shared_experts": 0, "n_group": 1, "topk_group": 1,
                   "first_k_dense_replace": 0, "moe_layer_freq": 0}


def size_limit(key: str) -> int:
    """The most config.json's size `key` may be (a GGUF's metadata is held to the same)."""
    return _SIZE_LIMITS.get(key, _INT32_MAX)


def _count(hf: dict[str, Any], key: str, default: Any = _MISSING, *, minimum: int = 1,
           source: str = "config.json") -> Any:
    """An integer of config.json, at least `minimum` and at most _SIZE_LIMITS[key] (null or absent:
    default; no default: required). A float is refused even when whole (1e9 is JSON's float), as
    GGUF metadata's counts are: sizes are integers. Checked here, so that a config holding nonsense
    (a string, 0, 2**62) fails naming its key, not in a division or an allocation below."""
    value = hf.get(key)
    if value is None:
        if default is _MISSING:
            raise ValueError(f"{source} lacks {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{source} {key} = {value!r} is not {kind}")
    limit = size_limit(key)
    if value > limit:
        raise ValueError(f"{source} {key} = {value} is larger than rtp takes (at most {limit})")
    return value


def _positive_number(hf: dict[str, Any], key: str, default: float, source: str = "config.json") -> float:
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{source} {key} = {value!r} is not a positive number")
    return float(value)


def _token_ids(values: list[Any], key: str, source: str) -> tuple[int, ...]:
    """The token ids of `key` (nulls dropped): each an integer >= 0, as the runtime compares them."""
    for value in values:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 0 <= value <= _INT32_MAX):
            raise ValueError(f"{source} {key} = {value!r} is not a token id")
    return tuple(v for v in values if v is not None)


def _layer_list(hf: dict[str, Any], key: str, source: str) -> tuple[int, ...]:
    """A list of layer indices (null or absent: empty)."""
    value = hf.get(key) or []
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= _COUNT
                                              for i in value):
        raise ValueError(f"{source} {key} = {value!r} is not a list of layer indices")
    return tuple(value)


# -- the engine's own knobs -----------------------------------------------------------------------------
#
# Each component takes its own sub-config; EngineConfig composes them. Every field carries its help
# text (msgspec Meta description) and, where a field's flag is not its name, the flag in Meta.extra:
# the command line (rtp/cli_options.py) is generated from these fields, so `rtp generate`, `rtp serve`
# and the offline API `LLM(**flat)` take the same names and defaults and cannot drift.


def _field(type_, description: str, **extra):
    """A field's type with its help text; extra: flag (its command-line spelling), aliases, parse."""
    return Annotated[type_, msgspec.Meta(description=description, extra=extra or None)]


class LoadConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Which model, and how it is loaded and run."""

    model: _field(str | None, "a Hugging Face checkpoint directory or .gguf file, or a Hugging Face ID: ORG/NAME, "
                              "ORG/NAME:Q4_K_M (a GGUF repository's file of that type), ORG/NAME/FILE.gguf "
                              "(default: SmolLM2-135M-Instruct, fetched once into $RTP_HOME)") = None
    revision: _field(str | None, "the branch, tag or commit of a Hugging Face ID (default: main)") = None
    dtype: _field(str, "auto: bfloat16 where the hardware computes it natively or rtp's CPU kernels run, else float32",
                  choices=["auto", "bfloat16", "float16", "float32"]) = "auto"
    device: _field(str, "auto, cpu, cuda or cuda:N") = "auto"
    compile: _field(bool | None, "torch.compile the decode graphs (default: on CUDA only, where they are CUDA "
                                 "graphs; on a CPU, Inductor's graphs do not beat rtp's CPU graphs, "
                                 "docs/benchmarks.md)", negatable=True) = None
    seed: _field(int, "seed of the generator requests without a seed of their own share") = 0
    tokenizer: _field(str | None, "the tokenizer: a tokenizer.json, a Hugging Face directory, a .gguf or a "
                                  "Hugging Face ID (default: the model's own)", metavar="PATH") = None
    chat_template: _field(str | None, "the chat template: a Jinja file, or one rtp ships (chatml-tools: "
                                      "ChatML with tools, for SmolLM2) (default: the tokenizer's own)",
                          metavar="FILE") = None
    activation_dtype: _field(str, "what a GGUF's Q4_1 and Q8_0 linear layers (not the LM head) multiply their "
                                  "input rows in on a CPU with AVX-512 VNNI and no AMX: auto, the model's dtype; "
                                  "int8, each row quantized per 32 values (as llama.cpp does) and the weights "
                                  "never dequantized: faster batches, greedy output further from fp32 "
                                  "(docs/benchmarks.md); int8-prefill, only the prompt rows as int8, the decode "
                                  "rows in the model's dtype: faster prefill, greedy output about as close to "
                                  "fp32 as transformers' bf16",
                             choices=["auto", "int8", "int8-prefill"]) = "auto"
    deterministic: _field(bool, "a request's tokens and logprobs the same bits whatever runs beside it "
                                "(docs/determinism.md); --no-deterministic: a lone request's decode steps "
                                "multiply the GGUF's exact fp32 weights on the one-row kernels, so its output "
                                "can change when others join its steps; measured, a one-row decode step "
                                "2.0x faster on AMD Zen 4 (1.3-2.3x), 1.25-1.5x on a Xeon with AMX, larger steps "
                                "the same",
                          negatable=True) = True

    def validate(self) -> None:
        if self.dtype not in ("auto", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32", "float"):
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.activation_dtype not in ("auto", "int8", "int8-prefill"):
            raise ValueError(f"--activation-dtype must be auto, int8 or int8-prefill, got {self.activation_dtype!r}")


class CacheConfig(msgspec.Struct, kw_only=True, frozen=True):
    """The paged KV cache and the prefix cache over it."""

    block_size: _field(int, "tokens per KV block") = 16
    kv_cache_memory: _field(int | None, "memory for the KV cache, e.g. 2GiB (default: 1GiB on a CPU, 80% of "
                                        "the free memory on CUDA)", parse="bytes", metavar="BYTES") = None
    enable_prefix_caching: _field(bool, "reuse the KV blocks of prompts' common prefixes (radix cache)",
                                  negatable=True) = True
    kv_cache_dtype: _field(str, "what the KV cache holds: auto (the model's dtype), bf16, or int8: each token's K "
                                "and V per head as int8 with one fp32 scale, about half of bf16's bytes, so twice "
                                "the tokens in --kv-cache-memory and half the bytes decode attention reads (CPU, "
                                "not MLA models nor --role prefill/decode yet)",
                           choices=["auto", "bf16", "int8"]) = "auto"
    kv_host_cache_gb: _field(float, "a host RAM tier under the prefix cache: the KV of finished requests' "
                                    "prefixes is kept in this many GiB after the pool lets it go, and loaded "
                                    "back where that measures cheaper than recomputing it (0: off; "
                                    "docs/kv_tiers.md)", metavar="GIB") = 0.0
    kv_disk_cache: _field(str | None, "a disk tier under the host tier: a directory of checksummed KV block "
                                      "files that survives restarts and can be shared by several servers of "
                                      "the same model (default: off)", metavar="DIR") = None
    kv_disk_cache_gb: _field(float, "most GiB --kv-disk-cache holds for this model (least recently used files "
                                    "go first)", metavar="GIB") = 16.0

    def validate(self) -> None:
        _positive(self, "block_size")
        if not 0.0 <= self.kv_host_cache_gb < float("inf"):
            raise ValueError(f"--kv-host-cache-gb must be 0 (off) or a positive number, got {self.kv_host_cache_gb}")
        if not 0.0 < self.kv_disk_cache_gb < float("inf"):
            raise ValueError(f"--kv-disk-cache-gb must be a positive number, got {self.kv_disk_cache_gb}")
        if (self.kv_host_cache_gb or self.kv_disk_cache) and not self.enable_prefix_caching:
            raise ValueError("the KV cache tiers (--kv-host-cache-gb, --kv-disk-cache) extend the prefix cache: "
                             "not with --no-enable-prefix-caching")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.kv_cache_dtype not in ("auto", "bf16", "int8"):
            raise ValueError(f"--kv-cache-dtype must be auto, bf16 or int8, got {self.kv_cache_dtype!r}")


class SchedulerConfig(msgspec.Struct, kw_only=True, frozen=True):
    """What one step may hold, and in what order requests run."""

    max_num_seqs: _field(int, "most sequences in one batch") = 64
    max_num_batched_tokens: _field(int, "token budget of one step; longer prompts are prefilled in chunks") = 2048
    max_prefill_tokens_with_decodes: _field(
        int, "prompt tokens a step may take while other requests decode: each such step stalls every decode "
             "for as long as its chunks take. Smaller keeps inter-token latency low, larger prefills faster "
             "(0: up to --max-num-batched-tokens; with --step-time-target, the cap of the budget it sizes)") = 0
    step_time_target: _field(
        float, "while requests decode, size each step's prompt tokens from measured step costs so that a step "
               "takes about this long (the streams' inter-token gap), doubling the budget for every such span the "
               "oldest waiting request has waited past one (0: the fixed --max-prefill-tokens-with-decodes; rtp "
               "serve: 0.07)", metavar="SECONDS") = 0.0
    max_model_len: _field(int | None, "context length, prompt plus completion (default: the model's, at most "
                                      "8192)") = None
    scheduling_policy: _field(str, "fcfs, or lpm: longest prefix match first (aged, so cold requests do not "
                                   "starve)", choices=["fcfs", "lpm"]) = "fcfs"

    def validate(self) -> None:
        _positive(self, "max_num_seqs", "max_num_batched_tokens")
        if self.max_prefill_tokens_with_decodes < 0:
            raise ValueError(f"max_prefill_tokens_with_decodes must be 0 (no limit) or positive, "
                             f"got {self.max_prefill_tokens_with_decodes}")
        if not 0.0 <= self.step_time_target < float("inf"):
            raise ValueError(f"step_time_target must be 0 (off) or a positive number of seconds, "
                             f"got {self.step_time_target}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.scheduling_policy not in ("fcfs", "lpm"):
            raise ValueError(f"scheduling_policy must be fcfs or lpm, got {self.scheduling_policy!r}")


class ParallelConfig(msgspec.Struct, kw_only=True, frozen=True):
    """The ranks a model is split over (rtp/engine/tensor_parallel.py): rank 0 runs here and starts
    the others on this host, unless torchrun started them."""

    tensor_parallel_size: _field(int, "shard the model over this many processes on this host (heads and "
                                      "vocabulary must split evenly)", flag="--tp",
                                 aliases=["--tensor-parallel-size"]) = 1
    expert_parallel_size: _field(int, "split each MoE layer's experts over this many processes: 1 or the --tp "
                                      "size, or with --tp 1 attention runs replicated on every rank",
                                 flag="--ep", aliases=["--expert-parallel-size"]) = 1

    def validate(self) -> None:
        _positive(self, "tensor_parallel_size", "expert_parallel_size")
        ranks = max(self.tensor_parallel_size, self.expert_parallel_size)
        if {self.tensor_parallel_size, self.expert_parallel_size} - {1, ranks}:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} and expert_parallel_size "
                             f"{self.expert_parallel_size}: each must be 1 or the number of ranks ({ranks})")

    @property
    def ranks(self) -> int:
        return max(self.tensor_parallel_size, self.expert_parallel_size)


class EPLBConfig(msgspec.Struct, kw_only=True, frozen=True):
    """EPLB while serving (rtp/engine/expert_balancer.py), named as vLLM names it: every step_interval
    engine steps, the experts' loads over the last window_size steps make a new placement, and the
    weights move between steps. Flat names (flags, LLM keywords): eplb_<field>, enable_eplb."""

    enable: _field(bool, "MoE models: replicate and rebalance experts from their measured load while serving",
                   flat="enable_eplb") = False
    window_size: _field(int, "engine steps whose expert load a plan is made from", metavar="STEPS") = 1000
    step_interval: _field(int, "engine steps between rebalances", metavar="STEPS") = 3000
    num_redundant_experts: _field(int | None, "spare expert slots per MoE layer for replicas (default: "
                                              "--eplb-replica-share of the experts), capped by --eplb-memory-cap",
                                  flat="num_redundant_experts", metavar="N") = None
    replica_share: _field(float, "experts to replicate, as a share of all (0.05: the top 5%)",
                          metavar="FRACTION") = 0.05
    memory_cap: _field(float, "most replica memory, as a share of the memory free beside the weights",
                       metavar="FRACTION") = 0.15
    kv_pressure: _field(float, "KV cache usage above which replicas are dropped (they go first)",
                        metavar="FRACTION") = 0.85
    num_ranks: _field(int, "ranks to balance over in one process (with --ep: the EP ranks; 0: the largest of "
                           "8, 4, 2 that leaves each rank two experts or more)", metavar="N") = 0

    def validate(self) -> None:
        _positive(self, "window_size", "step_interval")
        for name in ("replica_share", "memory_cap", "kv_pressure"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"eplb_{name} must be between 0 and 1, got {getattr(self, name)}")
        if (self.num_redundant_experts or 0) < 0 or self.num_ranks < 0:
            raise ValueError("num_redundant_experts and eplb_num_ranks must not be negative")


class SpeculativeConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Speculative decoding: a decoding request verifies tokens drafted from its own text, or by a
    small draft model, in the same step (one row each), keeping those the model would have chosen
    itself, so its output is what it would have been. Flat names: speculative (the method),
    speculative_model, num_speculative_tokens, prompt_lookup_min/max, speculative_max_running,
    speculative_measured."""

    method: _field(str | None, "draft tokens for requests by ngram, prompt lookup: where the last n tokens "
                               "occurred before in the request's own text, the tokens that followed; or by "
                               "draft_model, the greedy continuation of --speculative-model (implied by it) "
                               "(default: off)", flat="speculative", choices=["ngram", "draft_model"]) = None
    model: _field(str | None, "the draft model: a checkpoint directory, .gguf file or Hugging Face ID rtp "
                              "loads, sharing the target's tokenizer (sets --speculative draft_model)",
                  flat="speculative_model") = None
    num_speculative_tokens: _field(int, "most tokens a request drafts a step (adapted per request to what it "
                                        "keeps)", flat="num_speculative_tokens") = 4
    prompt_lookup_min: _field(int, "shortest n-gram matched", flat="prompt_lookup_min") = 1
    prompt_lookup_max: _field(int, "longest n-gram matched (tried first)", flat="prompt_lookup_max") = 4
    max_running: _field(int, "draft only while at most this many requests run: past that a step is bound by "
                             "compute and verifying drafts stops being nearly free",
                        flat="speculative_max_running") = 16
    measured: _field(bool, "below --speculative-max-running, draft only at batch sizes where the engine's own "
                           "steps measured drafting cheaper a token than not (--no-speculative-measured: at "
                           "every size)", flat="speculative_measured", negatable=True) = True

    def validate(self) -> None:
        if self.method not in (None, "ngram", "draft_model"):
            raise ValueError(f"speculative must be ngram or draft_model (or off), got {self.method!r}")
        if self.model is not None and self.method == "ngram":
            raise ValueError("--speculative ngram drafts from the request's own text: it takes no "
                             "--speculative-model (that sets --speculative draft_model)")
        if self.method == "draft_model" and not self.model:
            raise ValueError("--speculative draft_model needs --speculative-model PATH")
        _positive(self, "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "max_running")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min {self.prompt_lookup_min} exceeds prompt_lookup_max "
                             f"{self.prompt_lookup_max}")

    @property
    def kind(self) -> str | None:
        """The drafter: "ngram", "draft_model" (also when only a model is named), or None (off)."""
        return "draft_model" if self.model else self.method

    @property
    def draft_tokens(self) -> int:
        """The most tokens a request drafts a step: 0 when speculative decoding is off."""
        return self.num_speculative_tokens if self.kind else 0


class StructuredOutputConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Bounds on the grammars requests bring (rtp/engine/grammar/): a spec past a limit is a 400 naming
    its field before anything is compiled; a compile runs in a child process, killed past its time or
    when its client has gone. Flat names: grammar_<field>."""

    compile_timeout: _field(float, "a grammar that takes longer to compile is a 400 (its compile is killed)",
                            flat="grammar_compile_timeout", metavar="SECONDS") = 2.0
    max_bytes: _field(int, "largest structured output (schema, regex, grammar or choices) as JSON",
                      flat="grammar_max_bytes", parse="bytes", metavar="BYTES") = 128 << 10
    max_choices: _field(int, "most strings a choice may list", flat="grammar_max_choices") = 4096
    max_repetition: _field(int, "most characters one bounded repetition (a{n}, x{n,m}, nested counts "
                                "multiplied) may spell out in a regex, a grammar or a schema's patterns",
                           flat="grammar_max_repetition") = 10_000

    def validate(self) -> None:
        if not 0.0 < self.compile_timeout < float("inf"):
            raise ValueError(f"grammar_compile_timeout must be a positive number of seconds, got "
                             f"{self.compile_timeout}")
        _positive(self, "max_bytes", "max_choices", "max_repetition")


class EngineConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Everything the engine is built from, one sub-config per component; validated once."""

    load: LoadConfig = msgspec.field(default_factory=LoadConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    eplb: EPLBConfig = msgspec.field(default_factory=EPLBConfig)
    speculative: SpeculativeConfig = msgspec.field(default_factory=SpeculativeConfig)
    structured: StructuredOutputConfig = msgspec.field(default_factory=StructuredOutputConfig)

    @classmethod
    def from_flat(cls, **flat) -> "EngineConfig":
        """From flat keyword names (the offline API's and the command line's: model, dtype,
        max_num_seqs, enable_eplb, eplb_window_size, ...); an unknown name is a TypeError."""
        parts: dict[str, dict] = {name: {} for name in cls.__struct_fields__}
        names = flat_names()
        for key, value in flat.items():
            if key not in names:
                raise TypeError(f"unknown engine option {key!r}; the options are: {', '.join(sorted(names))}")
            part, field = names[key]
            parts[part][field] = value
        config = cls(**{part: SUB_CONFIGS[part](**values) for part, values in parts.items()})
        config.validate()
        return config

    def validate(self) -> None:
        for part in self.__struct_fields__:
            getattr(self, part).validate()
        drafts = self.speculative.num_speculative_tokens
        rows = min(self.scheduler.max_num_seqs, self.scheduler.max_num_batched_tokens)
        if self.speculative.kind and drafts > rows - 1:
            # a request's drafts are verified as rows of one step beside its own token, and a step has
            # --max-num-seqs rows and --max-num-batched-tokens tokens: more could never be verified
            raise ValueError(f"--num-speculative-tokens {drafts} is more than one step can verify: a request's "
                             f"drafts take a row each beside its own token, and a step has {rows} rows "
                             f"(--max-num-seqs, --max-num-batched-tokens), so at most {rows - 1} drafts")


# rtp/server/reasoning_parsers.py's PARSERS, by name (config imports no server code)
REASONING_PARSERS = ("qwen3", "deepseek_r1")


class ServeConfig(msgspec.Struct, kw_only=True, frozen=True):
    """`rtp serve`'s own options: the HTTP server, admission, and its role in prefill/decode
    disaggregation (rtp/server/pd/)."""

    host: _field(str, "address to listen on (0.0.0.0 for all)") = "127.0.0.1"
    port: _field(int, "port to listen on") = 8000
    served_model_names: _field(list[str] | None, "the model name(s) clients send in \"model\" (default: --model "
                                                 "as given, or SmolLM2-135M-Instruct); the first is the one "
                                                 "reported", flag="--served-model-name", nargs="+",
                                                 metavar="NAME") = None
    api_key: _field(str | None, "require `Authorization: Bearer KEY` on every route but /health and /metrics "
                                "(and on /rpc/* when no --rpc-token is given)") = None
    max_body_bytes: _field(int, "largest request body accepted; larger ones get 413", parse="bytes",
                           metavar="BYTES") = 8 << 20
    max_queue: _field(int, "sequences (prompts x n) allowed to wait for their first token; past it a request "
                           "gets 503 with Retry-After") = 512
    grace_period: _field(float, "on SIGTERM, how long in-flight requests may take to finish",
                         metavar="SECONDS") = 30.0
    role: _field(str, "prefill/decode disaggregation: a prefill node runs prompts and hands their KV to a decode "
                      "node, which generates (collocated: both here)",
                 choices=["collocated", "prefill", "decode"]) = "collocated"
    decode_peer: _field(str | None, "prefill node: the decode node (e.g. http://10.0.0.2:8001) its requests are "
                                    "decoded on, the stream relayed back; the FlexLB master can name another "
                                    "per request", metavar="URL") = None
    rpc_token: _field(str | None, "shared secret of the internal /rpc routes (header x-rtp-rpc-token)",
                      metavar="SECRET") = None
    kv_lease: _field(float, "decode node: how long reserved KV blocks wait for the next piece of their KV "
                            "before returning to the pool", metavar="SECONDS") = 10.0
    tool_call_parser: _field(str | None, "how the model writes tool calls, to read them out of its text for "
                                         "tool_choice auto (\"required\" and named functions need none)",
                             choices=["hermes", "llama3_json", "mistral"]) = None
    reasoning_parser: _field(str | None, "how the model writes its thinking, to answer it apart as reasoning_content: "
                                         f"{', '.join(REASONING_PARSERS)} or none (default: the one the chat template "
                                         "calls for, if any; docs/serving.md)", metavar="NAME") = None
    kv_port: _field(int, "decode node: the TCP port prefill nodes stream KV to, announced in each reservation "
                         "(0: any free port; -1: none, KV goes over HTTP, which any proxy carries)",
                    metavar="PORT") = 0

    def validate(self) -> None:
        if self.role not in ("collocated", "prefill", "decode"):
            raise ValueError(f"--role must be collocated, prefill or decode, got {self.role!r}")
        if self.decode_peer and self.role != "prefill":
            raise ValueError("--decode-peer is for --role prefill")
        _positive(self, "max_body_bytes", "max_queue")
        if self.reasoning_parser is not None and self.reasoning_parser not in (*REASONING_PARSERS, "none"):
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)} or none, "
                             f"got {self.reasoning_parser!r}")


class RouteConfig(msgspec.Struct, kw_only=True, frozen=True):
    """`rtp route`'s options: the workers, the routing policy, and the master's own HTTP server
    (rtp/router/flexlb.py)."""

    prefill: _field(list[str], "prefill workers (rtp serve --role prefill)", nargs="+",
                    metavar="URL") = msgspec.field(default_factory=list)
    decode: _field(list[str], "decode workers (rtp serve --role decode)", nargs="+",
                   metavar="URL") = msgspec.field(default_factory=list)
    collocated: _field(list[str], "collocated workers (plain rtp serve), used when no prefill/decode pair is "
                                  "given", nargs="+", metavar="URL") = msgspec.field(default_factory=list)
    policy: _field(str, "routing policy (the others are for comparison)",
                   choices=["flexlb", "round-robin", "least-loaded", "cache-aware"]) = "flexlb"
    beta: _field(float | str, "FlexLB's weight of prefix affinity against queue time, in [0, 1], or 'auto' to "
                              "tune it online from the observed prefix sharing and queue imbalance",
                 parse="number_or_word", metavar="BETA") = 0.65
    gamma: _field(float, "decode choice: weight of the tokens running requests are still expected to generate "
                         "against free KV tokens") = 1.0
    model: _field(str | None, "the workers' model (its tokenizer and chat template; default: the default "
                              "model)") = None
    rpc_token: _field(str | None, "the workers' --rpc-token (stats RPC and P/D hand-off)", metavar="SECRET") = None
    poll_interval: _field(float, "seconds between stats polls of every worker", metavar="SECONDS") = 0.5
    request_timeout: _field(float, "longest a proxied request may take", metavar="SECONDS") = 600.0
    retries: _field(int, "times a request no engine saw (worker unreachable, or its queue full) is retried on "
                         "another worker") = 1
    host: _field(str, "address to listen on (0.0.0.0 for all)") = "127.0.0.1"
    port: _field(int, "port to listen on") = 8080
    grace_period: _field(float, "on SIGTERM, how long proxied requests may take to finish",
                         metavar="SECONDS") = 30.0

    def validate(self) -> None:
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("prefill/decode routing needs both --prefill and --decode workers")
        if not (self.prefill or self.collocated):
            raise ValueError("no workers: give --prefill and --decode URLs, or --collocated URLs")
        urls = self.prefill + self.decode + self.collocated
        if len(set(urls)) != len(urls):
            raise ValueError("a worker URL appears twice")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker URL {url!r} must start with http:// or https://")
        if self.beta != "auto" and (isinstance(self.beta, str) or not 0.0 <= self.beta <= 1.0):
            raise ValueError(f"--beta must be a number in [0, 1] or 'auto', got {self.beta!r}")
        if not self.poll_interval > 0:
            raise ValueError("--poll-interval must be positive")
        if not self.request_timeout > 0:
            raise ValueError("--request-timeout must be positive")
        if self.retries < 0:
            raise ValueError(f"--retries must be 0 or more, got {self.retries}")


SUB_CONFIGS: dict[str, type] = {"load": LoadConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                                "parallel": ParallelConfig, "eplb": EPLBConfig, "speculative": SpeculativeConfig,
                                "structured": StructuredOutputConfig}


@functools.cache
def struct_fields(cls: type) -> dict[str, msgspec.structs.FieldInfo]:
    """A config struct's fields by name, resolved once: msgspec resolves every annotation of the
    class on each call, and the command line asks for each field (a quarter of a second a start)."""
    return {f.name: f for f in msgspec.structs.fields(cls)}


def field_meta(cls: type, field: str) -> msgspec.Meta | None:
    """The Meta (help text, flag) a config field was declared with."""
    info = struct_fields(cls)[field]
    return next((m for m in getattr(info.type, "__metadata__", ()) if isinstance(m, msgspec.Meta)), None)


def flat_names() -> dict[str, tuple[str, str]]:
    """Flat option name -> (sub-config, field): the field's name, or its Meta's `flat`, or for EPLB
    eplb_<field>."""
    names = {}
    for part, cls in SUB_CONFIGS.items():
        for field in cls.__struct_fields__:
            meta = field_meta(cls, field)
            flat = (meta.extra or {}).get("flat") if meta is not None else None
            names[flat or (f"eplb_{field}" if part == "eplb" else field)] = (part, field)
    return names


def _positive(config, *names: str) -> None:
    for name in names:
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be positive, got {getattr(config, name)}")
