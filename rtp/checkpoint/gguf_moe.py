"""The mixture-of-experts part of a GGUF: its experts' config and where each expert's bytes lie.

llama.cpp writes a sparse layer as a router and the experts' three projections stacked into one
tensor each (torch order [experts, rows, columns]):

    blk.N.ffn_gate_inp.weight                      router [experts, hidden]
    blk.N.ffn_gate_exps / ffn_up_exps.weight       [experts, width, hidden]
    blk.N.ffn_down_exps.weight                     [experts, hidden, width]
    blk.N.ffn_gate_inp_shexp.weight                Qwen2-MoE: the shared expert's sigmoid gate [hidden]
    blk.N.ffn_{gate,up,down}_shexp.weight          Qwen2-MoE: the shared expert, an MLP

and files converted before the stacking (early Mixtral GGUFs) hold one tensor per expert,
blk.N.ffn_gate.E.weight. An expert is the slowest dimension, so each expert's bytes are one
contiguous run of whole quant blocks: `expert_records` gives every expert a record of its own
under its Hugging Face name (model.layers.N.mlp.experts.E.gate_proj.weight, Mixtral's w1 / w3 / w2),
and the model's loader fills its stacked expert slots from them as from a safetensors
checkpoint. The architectures are llama.cpp's: `qwen2moe` (top-k weights as the softmax gives
them, a shared expert), `qwen3moe` (renormalised top-k, q/k norm), `olmoe` (top-k as given, q/k
norm over all heads), `llama` with experts (Mixtral, renormalised) and `deepseek2` (whose routing and
shared experts rtp/checkpoint/gguf_deepseek.py reads). The counts come from the metadata as llama.cpp's loader reads them
(expert_count, expert_used_count, expert_feed_forward_length,
expert_shared_feed_forward_length), checked against the tensors, which decide where the two
disagree in what llama.cpp would also refuse to load: each mismatch is one error naming the
file and the tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtp.checkpoint.gguf_header import GGUFError

# GGUF architectures whose layers may be sparse -> whether the top-k weights are renormalised
# (llama.cpp's build_moe_ffn norm_w for each; a file's {arch}.expert_weights_norm overrides it)
MOE_ARCHITECTURES = {"qwen2moe": False, "qwen3moe": True, "llama": True, "olmoe": False, "deepseek2": False}
# architectures whose scaling, gating and shared experts their own config reads (rtp/checkpoint/gguf_deepseek.py)
_OWN_ROUTING = {"deepseek2"}
# the part of an expert each stacked tensor holds -> its projection's name in each family
_PARTS = ("gate", "up", "down")
_HF_PARTS = {"llama": {"gate": "w1", "up": "w3", "down": "w2"},
             "qwen": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}}
_STACKED = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
_PER_EXPERT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
_ROUTER = re.compile(r"blk\.(\d+)\.ffn_gate_inp\.weight")
_SHARED = re.compile(r"blk\.(\d+)\.ffn_gate_shexp\.weight")


def is_expert_tensor(name: str) -> bool:
    """Whether a GGUF tensor holds routed experts (stacked, or one expert of the old layout)."""
    return bool(_STACKED.fullmatch(name) or _PER_EXPERT.fullmatch(name))


@dataclass(frozen=True)
class MoELayout:
    """What the file's tensors say about its experts (the metadata checked against them)."""

    num_experts: int
    top_k: int
    width: int                 # an expert's intermediate size
    shared_width: int          # the shared expert's (0: none)
    sparse_layers: frozenset[int]

    def hf_config(self, arch: str, num_layers: int, renormalize: bool, dense_width: int | None) -> dict[str, Any]:
        """The config.json keys of this MoE for transformers' class of the architecture."""
        dense = [i for i in range(num_layers) if i not in self.sparse_layers]
        if arch == "llama":  # Mixtral: every layer sparse, experts as wide as intermediate_size
            return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                    "num_local_experts": self.num_experts, "num_experts_per_tok": self.top_k,
                    "intermediate_size": self.width}
        if arch == "olmoe":  # every layer sparse, experts as wide as intermediate_size
            return {"num_experts": self.num_experts, "num_experts_per_tok": self.top_k,
                    "norm_topk_prob": renormalize, "intermediate_size": self.width}
        cfg = {"num_experts": self.num_experts, "num_experts_per_tok": self.top_k,
               "moe_intermediate_size": self.width, "norm_topk_prob": renormalize,
               "decoder_sparse_step": 1, "mlp_only_layers": dense,
               "intermediate_size": dense_width or self.width}
        if self.shared_width:
            cfg["shared_expert_intermediate_size"] = self.shared_width
        return cfg


def moe_layout(path: Path, arch: str, tensors: list, key, count) -> MoELayout | None:
    """The experts of a GGUF whose architecture may be sparse (None: a dense llama file).
    `tensors` are the file's (path, GGUFTensor) pairs; `key` and `count` read {arch}.* metadata
    (count checks an integer and its limit)."""
    by_name = {t.name: t for _, t in tensors}
    routers = {int(m[1]): by_name[m[0]] for name in by_name if (m := _ROUTER.fullmatch(name))}
    num_experts = count("expert_count", 0, minimum=0)
    if arch == "llama" and not num_experts and not routers:
        return None  # a dense Llama
    if not num_experts:
        raise GGUFError(f"{path}: metadata {arch}.expert_count is missing or 0, but the file is "
                        f"{'of architecture ' + arch if arch != 'llama' else 'holds expert routers'}")
    top_k = count("expert_used_count", 0, minimum=0)
    if not 0 < top_k <= num_experts:
        raise GGUFError(f"{path}: metadata {arch}.expert_used_count = {top_k} is not between 1 and "
                        f"{arch}.expert_count = {num_experts}")
    if not routers:
        raise GGUFError(f"{path}: metadata {arch}.expert_count = {num_experts}, but no layer has a router "
                        "(blk.N.ffn_gate_inp.weight)")
    scale = key("expert_weights_scale")
    if scale not in (None, 0, 0.0, 1, 1.0) and arch not in _OWN_ROUTING:
        raise GGUFError(f"{path}: metadata {arch}.expert_weights_scale = {scale!r}: scaled expert weights are "
                        f"not supported for {arch}")
    gating = key("expert_gating_func")
    if gating not in (None, 1) and arch not in _OWN_ROUTING:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise GGUFError(f"{path}: metadata {arch}.expert_gating_func = {gating!r}: only softmax (1) routes "
                        f"{arch} experts")
    stacked = any(_STACKED.fullmatch(n) for n in by_name)
    width = None
    for layer, router in sorted(routers.items()):
        rows = _torch_shape(router)
        if len(rows) != 2 or rows[0] != num_experts:
            raise GGUFError(f"{path}: router {router.name} has shape {rows}, not [{num_experts}, hidden] for "
                            f"{arch}.expert_count = {num_experts}")
        for part in _PARTS:
            shapes = _expert_shapes(path, by_name, layer, part, num_experts, stacked)
            inner = shapes[0] if part != "down" else shapes[1]
            if width is None:
                width = inner
            elif inner != width:
                name = f"blk.{layer}.ffn_{part}_exps.weight" if stacked else f"blk.{layer}.ffn_{part}.0.weight"
                raise GGUFError(f"{path}: tensor {name} has experts {inner} wide, where the others are {width}")
    stray = sorted({int(m[1]) for n in by_name if (m := _STACKED.fullmatch(n) or _PER_EXPERT.fullmatch(n))}
                   - set(routers))
    if stray:
        raise GGUFError(f"{path}: layer {stray[0]} holds expert tensors but no router blk.{stray[0]}.ffn_gate_inp.weight")
    said = count("expert_feed_forward_length", minimum=1)
    if said is not None and said != width:
        raise GGUFError(f"{path}: metadata {arch}.expert_feed_forward_length = {said}, but the expert tensors are "
                        f"{width} wide")
    shared = _shared_width(path, by_name, routers, arch, count)
    return MoELayout(num_experts, top_k, width, shared, frozenset(routers))


def _torch_shape(t) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def _expert_shapes(path: Path, by_name: dict, layer: int, part: str, num_experts: int,
                   stacked: bool) -> tuple[int, int]:
    """One expert's [rows, columns] for a layer's part, every expert present and alike."""
    if stacked:
        name = f"blk.{layer}.ffn_{part}_exps.weight"
        t = by_name.get(name)
        if t is None:
            raise GGUFError(f"{path}: layer {layer} has a router but no expert tensor {name}")
        shape = _torch_shape(t)
        if len(shape) != 3 or shape[0] != num_experts:
            raise GGUFError(f"{path}: tensor {name} has shape {shape}: not {num_experts} experts "
                            f"(metadata expert_count) of [rows, columns]")
        if t.n_bytes % num_experts:
            raise GGUFError(f"{path}: tensor {name} is {t.n_bytes} bytes, which {num_experts} experts do not split")
        return shape[1], shape[2]
    first = None
    for expert in range(num_experts):
        name = f"blk.{layer}.ffn_{part}.{expert}.weight"
        t = by_name.get(name)
        if t is None:
            raise GGUFError(f"{path}: layer {layer} has a router of {num_experts} experts but no expert tensor {name}")
        shape = _torch_shape(t)
        if first is None:
            first = shape
        elif shape != first:
            raise GGUFError(f"{path}: tensor {name} has shape {shape}, expert 0's is {first}")
    extra = f"blk.{layer}.ffn_{part}.{num_experts}.weight"
    if extra in by_name:
        raise GGUFError(f"{path}: tensor {extra} is an expert past {num_experts} (metadata expert_count)")
    if len(first) != 2:
        raise GGUFError(f"{path}: tensor blk.{layer}.ffn_{part}.0.weight has shape {first}, not [rows, columns]")
    return first


def _shared_width(path: Path, by_name: dict, routers: dict, arch: str, count) -> int:
    """The shared expert's width (Qwen2-MoE), the same in every sparse layer; 0 for none."""
    widths = {int(m[1]): _torch_shape(by_name[n])[0] for n in by_name if (m := _SHARED.fullmatch(n))}
    if not widths:
        return 0
    missing = sorted(set(routers) - set(widths))
    if missing:
        raise GGUFError(f"{path}: layer {missing[0]} lacks its shared expert blk.{missing[0]}.ffn_gate_shexp.weight")
    if len(set(widths.values())) > 1:
        raise GGUFError(f"{path}: shared experts of different widths {sorted(set(widths.values()))}")
    width = next(iter(widths.values()))
    said = count("expert_shared_feed_forward_length", minimum=1)
    if said is not None and said != width:
        raise GGUFError(f"{path}: metadata {arch}.expert_shared_feed_forward_length = {said}, but "
                        f"blk.N.ffn_gate_shexp.weight is {width} wide")
    for layer in widths:
        gate = () if arch in _OWN_ROUTING else (f"blk.{layer}.ffn_gate_inp_shexp.weight",)  # DeepSeek's: no gate
        for name in (f"blk.{layer}.ffn_up_shexp.weight", f"blk.{layer}.ffn_down_shexp.weight", *gate):
            if name not in by_name:
                raise GGUFError(f"{path}: layer {layer} has a shared expert but no {name}")
    return width


def expert_records(t, arch: str) -> list[tuple[str, int, int, tuple[int, int]]]:
    """(HF name, begin, end, shape) of each expert in an expert tensor (absolute file offsets)."""
    parts = _HF_PARTS["llama" if arch == "llama" else "qwen"]
    m = _STACKED.fullmatch(t.name)
    begin = int(t.data_offset)
    if m is None:  # one expert's tensor
        m = _PER_EXPERT.fullmatch(t.name)
        layer, part, expert = int(m[1]), m[2], int(m[3])
        shape = _torch_shape(t)
        return [(_expert_name(layer, expert, parts[part]), begin, begin + int(t.n_bytes), shape)]
    layer, part = int(m[1]), m[2]
    experts, rows, cols = _torch_shape(t)
    each = int(t.n_bytes) // experts
    return [(_expert_name(layer, e, parts[part]), begin + e * each, begin + (e + 1) * each, (rows, cols))
            for e in range(experts)]


def _expert_name(layer: int, expert: int, part: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{part}.weight"
