"""One config object, built and validated once, passed down.

`ModelConfig` is what rtp reads from a checkpoint's config.json (or a GGUF's
metadata, turned into the same dict); `CacheConfig`, `SchedulerConfig` and
`EngineConfig` are the engine's own knobs. Runtime facts (block counts, eos ids
the tokenizer adds) live in their own objects, never written back here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config.json dict."""
        from rtp.models import model_class

        archs = hf.get("architectures") or []
        model_class(archs)  # raises a clear error for unsupported architectures
        arch = next(a for a in archs if a)
        heads = _required(hf, "num_attention_heads")
        hidden = _required(hf, "hidden_size")
        head_dim = hf.get("head_dim") or hidden // heads
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        attention_bias = bool(hf.get("attention_bias", False))
        sliding = hf.get("sliding_window")
        if arch.startswith("Qwen") and not hf.get("use_sliding_window", False):
            sliding = None  # Qwen configs carry a window size they do not use
        num_experts = hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or 0
        cfg = cls(
            architecture=arch,
            vocab_size=_required(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required(hf, "intermediate_size"),
            num_hidden_layers=_required(hf, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=(attention_bias or arch == "Qwen2ForCausalLM"
                      or (arch == "Qwen2MoeForCausalLM" and bool(hf.get("qkv_bias", True)))),
            o_bias=attention_bias and arch in ("LlamaForCausalLM", "MistralForCausalLM"),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_window=sliding or None,
            hidden_act=hf.get("hidden_act", "silu"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
            num_experts=num_experts,
            num_experts_per_tok=hf.get("num_experts_per_tok") or 0,
            # Mixtral's experts are intermediate_size wide; Qwen's have a size of their own
            moe_intermediate_size=(hf.get("intermediate_size", 0) if arch == "MixtralForCausalLM"
                                   else hf.get("moe_intermediate_size") or 0) if num_experts else 0,
            shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size") or 0,
            # Mixtral always renormalises; its config has no flag for it
            norm_topk_prob=arch == "MixtralForCausalLM" or bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=hf.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or _deepseek_dense_layers(hf)),
            raw=dict(hf),
        )
        cfg.validate()
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
        if self.intermediate_size % tp:
            raise ValueError(f"--tp {tp}: an intermediate size of {self.intermediate_size} does not split "
                             f"over {tp} ranks")

    def validate(self) -> None:
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be between 1 and "
                             f"num_experts {self.num_experts}")
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ValueError("config moe_intermediate_size must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} (rtp supports silu)")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config {name} must be positive")


def _deepseek_dense_layers(hf: dict[str, Any]) -> tuple[int, ...]:
    """DeepSeek's dense layers: the first first_k_dense_replace, and those off moe_layer_freq."""
    if "first_k_dense_replace" not in hf:
        return ()
    first, freq = hf["first_k_dense_replace"] or 0, hf.get("moe_layer_freq") or 1
    return tuple(i for i in range(hf.get("num_hidden_layers", 0)) if i < first or i % freq)


def _required(hf: dict[str, Any], key: str) -> Any:
    if key not in hf:
        raise ValueError(f"config.json lacks {key!r}")
    return hf[key]


class EngineConfig(msgspec.Struct, kw_only=True):
    """Everything the engine is built from; validated once by `validate()`."""

    model: str | None = None          # HF checkpoint directory or .gguf file; None: the default model
    dtype: str = "auto"               # auto | bfloat16 | float16 | float32
    device: str = "auto"              # auto | cpu | cuda
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the KV cache; None: a default for the device
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # prompt tokens a step may take while decodes run: each such step stalls every decode for
    # as long as its chunks take (0: up to max_num_batched_tokens). Offline, throughput is all
    # that counts: no cap; `rtp serve` caps at 512 by default, for inter-token latency (as vLLM
    # sizes its token budget by usage context)
    max_prefill_tokens_with_decodes: int = 0
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped at 8192
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"   # fcfs | lpm
    # torch.compile the decode buckets. None (auto): on CUDA (CUDA graphs) but not on a CPU,
    # where Inductor's graphs do not yet beat eager here (see README, "Performance")
    compile: bool | None = None
    seed: int = 0
    # ranks the model is sharded over (rtp/engine/tensor_parallel.py): rank 0 runs here and
    # spawns the others on this host, unless torchrun started them
    tensor_parallel_size: int = 1
    # ranks the MoE layers' expert slots are split over (rtp/models/expert_parallel.py): the same
    # ranks as tensor parallelism (each size is 1 or the number of ranks); with tp 1 every rank
    # runs attention on the same tokens and only the experts are split
    expert_parallel_size: int = 1
    # EPLB while serving (rtp/engine/expert_balancer.py), named as vLLM names them: every
    # eplb_step_interval engine steps, the experts' loads over the last eplb_window_size steps
    # make a new placement and the weights move between steps
    enable_eplb: bool = False
    eplb_window_size: int = 1000
    eplb_step_interval: int = 3000
    # spare slots per MoE layer for replicas; None: eplb_replica_share of the experts (rounded up
    # to a multiple of the ranks), as many as eplb_memory_cap of the free memory pays for
    num_redundant_experts: int | None = None
    eplb_replica_share: float = 0.05
    eplb_memory_cap: float = 0.15
    # KV cache usage above which the next plan has no replicas (replicas are dropped first)
    eplb_kv_pressure: float = 0.85
    # ranks the planner balances over in one process (logical ranks; with --ep N: N). 0: the
    # largest of 8, 4, 2 that leaves each rank two experts or more
    eplb_num_ranks: int = 0

    def validate(self) -> None:
        if self.dtype not in ("auto", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32", "float"):
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "expert_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        ranks = max(self.tensor_parallel_size, self.expert_parallel_size)
        if {self.tensor_parallel_size, self.expert_parallel_size} - {1, ranks}:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} and expert_parallel_size "
                             f"{self.expert_parallel_size}: each must be 1 or the number of ranks ({ranks})")
        if self.max_prefill_tokens_with_decodes < 0:
            raise ValueError(f"max_prefill_tokens_with_decodes must be 0 (no limit) or positive, "
                             f"got {self.max_prefill_tokens_with_decodes}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        for name in ("eplb_window_size", "eplb_step_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("eplb_replica_share", "eplb_memory_cap", "eplb_kv_pressure"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1, got {getattr(self, name)}")
        if (self.num_redundant_experts or 0) < 0 or self.eplb_num_ranks < 0:
            raise ValueError("num_redundant_experts and eplb_num_ranks must not be negative")
        if self.scheduling_policy not in ("fcfs", "lpm"):
            raise ValueError(f"scheduling_policy must be fcfs or lpm, got {self.scheduling_policy!r}")
