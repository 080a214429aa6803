"""The text model inside a multimodal checkpoint.

Gemma 3 from 4 B parameters up ships as `Gemma3ForConditionalGeneration`: a language model
beside a vision tower and a projector, in one directory. rtp serves text, so such a checkpoint
opens as its language model (vLLM does the same with `--limit-mm-per-prompt` at zero): the
config becomes the text model's own (its `text_config`, over the defaults transformers fills
in for keys the file leaves out), the language model's tensors lose their wrapper prefix, and
the other towers' tensors are left unread on disk.

Two layouts are in use: transformers 4.x saved `language_model.model.*` (and
`language_model.lm_head.*`), transformers 5 saves `model.language_model.*` and `lm_head.*`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rtp.checkpoint.records import TensorRecord


@dataclass(frozen=True)
class TextOf:
    text_architecture: str
    # the text config's defaults (transformers' config class for it: what an omitted key means)
    text_defaults: dict[str, Any]
    # checkpoint prefix -> the text model's own; a tensor under no prefix belongs to another tower
    prefixes: dict[str, str]


# Gemma3TextConfig's defaults, the keys rtp reads (held against transformers in the tests). Its
# RoPE defaults (global base 1e6, local 1e4, five local layers to one global) are rtp/models/gemma.py's.
_GEMMA3_TEXT = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
    "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True,
    "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
}

WRAPPERS: dict[str, TextOf] = {
    "Gemma3ForConditionalGeneration": TextOf(
        "Gemma3ForCausalLM", _GEMMA3_TEXT,
        {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
         "model.language_model.": "model.", "lm_head.": "lm_head."}),
}

# keys of the wrapper's own config that speak for the text model when its text_config is silent
_INHERITED = ("eos_token_id", "bos_token_id", "pad_token_id", "torch_dtype", "dtype")


def wrapper_of(config: dict[str, Any]) -> TextOf | None:
    archs = config.get("architectures") or []
    return WRAPPERS.get(archs[0]) if archs else None


def text_config(config: dict[str, Any], wrapper: TextOf, *, has_head: bool) -> dict[str, Any]:
    """The language model's config.json, as its own checkpoint would carry it. has_head: the
    checkpoint holds an LM head of its own. Whether the head is tied is read off the tensors:
    transformers 4 tied by text_config's tie_word_embeddings, transformers 5 by the wrapper's, and
    a file saved tied holds no head."""
    own = config.get("text_config") or {}
    inherited = {k: config[k] for k in _INHERITED if config.get(k) is not None}
    return {**wrapper.text_defaults, **inherited, **own, "architectures": [wrapper.text_architecture],
            "tie_word_embeddings": not has_head}


def text_records(records: list[TensorRecord], wrapper: TextOf) -> list[TensorRecord]:
    """The language model's tensors under its own names, in the same (file, offset) order."""
    out = []
    for record in records:
        for prefix, own in wrapper.prefixes.items():
            if record.name.startswith(prefix):
                out.append(dataclasses.replace(record, name=own + record.name[len(prefix):]))
                break
    return out
