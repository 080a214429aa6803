"""Model definitions: plain PyTorch modules, chosen by config.json's `architectures`.

A new architecture is one file here plus one line in `_REGISTRY`. Nothing in this
package knows about HTTP, requests or scheduling: a model maps (token ids,
positions, the step's attention metadata) to hidden states and logits.
"""

from __future__ import annotations

import importlib

# HF "architectures" name -> (module, class)
_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("rtp.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("rtp.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("rtp.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("rtp.models.llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("rtp.models.mixtral", "MixtralForCausalLM"),
    "DeepseekV2ForCausalLM": ("rtp.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "DeepseekV3ForCausalLM": ("rtp.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("rtp.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("rtp.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "Gemma2ForCausalLM": ("rtp.models.gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("rtp.models.gemma", "GemmaForCausalLM"),
    "Phi3ForCausalLM": ("rtp.models.phi3", "Phi3ForCausalLM"),
    "OlmoeForCausalLM": ("rtp.models.olmoe", "OlmoeForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def model_class(architectures: list[str]):
    """The rtp class for the first supported name in config.json's `architectures`."""
    for name in architectures or []:
        if name in _REGISTRY:
            module, cls = _REGISTRY[name]
            return getattr(importlib.import_module(module), cls)
    raise ValueError(f"unsupported architecture {architectures}; rtp supports: "
                     f"{', '.join(supported_architectures())}")
