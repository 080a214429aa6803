"""Rotary position embeddings (RoPE) for Llama-family models.

One module, `RotaryEmbedding`, holds a precomputed fp32 `cos_sin_cache`
[max_position, rotary_dim] (cos in the first half of each row, sin in the second)
and rotates q and k by indexing it with the step's positions. The variants
(default, linear, dynamic NTK, YaRN, llama3, LongRoPE) differ only in the inverse
frequencies and the attention factor the cache is built from; each is a small
function below whose numbers follow transformers' `modeling_rope_utils`
operation for operation in fp32, so rtp and HF agree to the last bits or so.

Forward does no Python branching on data, no host sync and no allocation of
caches, so it traces whole under `torch.compile(fullgraph=True)` and replays
from CUDA graphs: a new position is a new tensor value, not a new graph.

Convention: HF's `rotate_half` ("neox"), the first half of the rotary dims pairs
with the second half. With rotary_dim < head_dim only the first rotary_dim dims
rotate; the rest pass through unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


class RotaryEmbedding(nn.Module):
    """Applies RoPE from a cache computed once at construction.

    `cos_sin_cache` is built on the CPU in fp32 and then placed on the default
    device (the loader builds models under `torch.device(device)`); it is a
    non-persistent buffer, so checkpoints neither carry nor expect it.
    """

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, inv_freq: torch.Tensor,
                 attention_factor: float = 1.0, rope_type: str = "default"):
        super().__init__()
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
        if inv_freq.shape != (rotary_dim // 2,):
            raise ValueError(f"inv_freq must have shape ({rotary_dim // 2},), got {tuple(inv_freq.shape)}")
        if max_position <= 0:
            raise ValueError(f"max_position must be positive, got {max_position}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.attention_factor = attention_factor
        self.rope_type = rope_type
        cache = _cos_sin_cache(inv_freq, max_position, attention_factor)
        self.register_buffer("cos_sin_cache", cache.to(torch.get_default_device()), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] (int32 or int64, each < max_position); q [T, heads, head_dim];
        k [T, kv_heads, head_dim]. Returns rotated q, k in their own dtypes.

        Positions are not range-checked (a check would be a host sync): one out of
        range raises on the CPU and is a device-side assert on CUDA.
        """
        cos, sin = self.cos_sin_cache.index_select(0, positions).unsqueeze(-2).chunk(2, dim=-1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., : self.rotary_dim].float().chunk(2, dim=-1)
        # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin): HF's x*cos + rotate_half(x)*sin
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        if self.rotary_dim < self.head_dim:  # static: fixed at construction
            out = torch.cat((out, x[..., self.rotary_dim:]), dim=-1)
        return out

    def extra_repr(self) -> str:
        return (f"rope_type={self.rope_type}, head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, "
                f"max_position={self.max_position}, attention_factor={self.attention_factor:g}")


def get_rope(head_dim: int, rotary_dim: int | None, max_position: int, base: float,
             rope_scaling: dict | None, dtype: torch.dtype = torch.float32,
             partial_rotary_factor: float = 1.0) -> RotaryEmbedding:
    """The RoPE module for a model.

    head_dim: size of one attention head. rotary_dim: dims that rotate (None: head_dim),
    scaled further by partial_rotary_factor as HF does (int(dim * factor)).
    max_position: rows of the cache, i.e. the longest sequence this module serves.
    base: rope_theta. rope_scaling: HF's dict (`rope_type` or legacy `type` key) or
    None; `rope_config_from_hf` turns a config.json into (base, rope_scaling,
    partial_rotary_factor). dtype: the model's compute dtype, accepted for vLLM-style
    call sites; the cache stays fp32 whatever it is, since rotation runs in fp32.

    Calls with equal arguments (under the same default device) return the same
    module, so the layers of one model share one cache instead of holding one each
    (Llama 3.1's 131072 x 128 fp32 cache is 64 MiB; 32 copies would be 2 GiB).
    """
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if partial_rotary_factor != 1.0:
        rotary_dim = int(rotary_dim * partial_rotary_factor)
    key = (head_dim, rotary_dim, max_position, float(base), _freeze(rope_scaling), dtype,
           str(torch.get_default_device()))
    rope = _ROPE_CACHE.get(key)
    if rope is None:
        rope = _ROPE_CACHE[key] = _build_rope(head_dim, rotary_dim, max_position, float(base), rope_scaling)
    return rope


def rope_config_from_hf(config: dict[str, Any]) -> tuple[float, dict | None, float]:
    """(base, rope_scaling or None, partial_rotary_factor) from a config.json dict.

    Understands the transformers 4.x layout (`rope_theta`, `rope_scaling`,
    `partial_rotary_factor` at the top level) and the 5.x one (`rope_parameters`
    holding `rope_type`, `rope_theta`, ... ). As in transformers, `rope_scaling`
    wins over `rope_parameters` when both are set, and a value inside the dict wins
    over the same key at the top level. The returned scaling dict has `rope_type`
    set and gets the defaults HF fills in from the config:
    `original_max_position_embeddings` (from `max_position_embeddings`) for yarn,
    llama3 and longrope, a top-level `original_max_position_embeddings` overriding it
    (Phi-3's layout), yarn's and longrope's `factor` from the ratio of the two when
    absent, and for dynamic the length HF actually scales against,
    `max_position_embeddings`. Phi-3's legacy rope type "su" comes back as "longrope".
    """
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if params and not {"rope_type", "type", "rope_theta"} & params.keys() \
            and all(isinstance(v, dict) or v is None for v in params.values()):
        raise ValueError(f"per-layer-type rope parameters ({sorted(params)}) are not supported")
    params = dict(params)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "su":
        rope_type = "longrope"  # what the first Phi-3 configs called it; transformers reads it so too
    base = params.pop("rope_theta", None)
    base = config.get("rope_theta", 10000.0) if base is None else base
    partial = params.pop("partial_rotary_factor", None)
    partial = config.get("partial_rotary_factor", 1.0) if partial is None else partial
    if rope_type == "default":
        return float(base), None, float(partial)
    params["rope_type"] = rope_type
    max_pos = config.get("max_position_embeddings")
    if rope_type in ("yarn", "llama3", "longrope"):
        if config.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        elif max_pos is not None:
            params.setdefault("original_max_position_embeddings", max_pos)
        if rope_type in ("yarn", "longrope") and params.get("factor") is None and max_pos is not None:
            params["factor"] = max_pos / params["original_max_position_embeddings"]
    elif rope_type == "dynamic" and max_pos is not None:
        # HF's dynamic NTK scales against max_position_embeddings, never a key in the dict
        params["original_max_position_embeddings"] = max_pos
    return float(base), params, float(partial)


# -- building the cache ------------------------------------------------------------------

_ROPE_CACHE: dict[tuple, RotaryEmbedding] = {}


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _build_rope(head_dim: int, rotary_dim: int, max_position: int, base: float,
                scaling: dict | None) -> RotaryEmbedding:
    scaling = dict(scaling or {})
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; rtp supports: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
    inv_freq, attention_factor = _INV_FREQ[rope_type](base, rotary_dim, max_position, scaling)
    return RotaryEmbedding(head_dim, rotary_dim, max_position, inv_freq, attention_factor, rope_type)


def _cos_sin_cache(inv_freq: torch.Tensor, max_position: int, attention_factor: float) -> torch.Tensor:
    # HF: freqs = position.float() * inv_freq; cos = cos(freqs) * attention_scaling, all fp32
    t = torch.arange(max_position, dtype=torch.int64, device="cpu").to(torch.float32)
    freqs = t[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1)


def _required(scaling: dict, key: str) -> Any:
    if scaling.get(key) is None:
        raise ValueError(f"rope_scaling of type {scaling.get('rope_type') or scaling.get('type')!r} "
                         f"needs {key!r}, got {scaling}")
    return scaling[key]


def _default_inv_freq(base: float | torch.Tensor, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    return 1.0 / (base ** exponents)


def _default(base: float, dim: int, max_position: int, scaling: dict) -> tuple[torch.Tensor, float]:
    return _default_inv_freq(base, dim), 1.0


def _linear(base: float, dim: int, max_position: int, scaling: dict) -> tuple[torch.Tensor, float]:
    # HF divides the frequencies, not the positions: same angles, same fp32 rounding as HF
    return _default_inv_freq(base, dim) / _required(scaling, "factor"), 1.0


def _dynamic(base: float, dim: int, max_position: int, scaling: dict) -> tuple[torch.Tensor, float]:
    # transformers recomputes dynamic NTK frequencies in forward from the batch's
    # largest position: L = max(position_ids) + 1, and for L > original (HF's
    # config.max_position_embeddings) base' = base * (factor * L / original - (factor - 1))
    # ** (dim / (dim - 2)); for L <= original it is plain RoPE. Its state also
    # depends on call history: the frequencies grow with L but reset only once a
    # call's L drops below original.
    #
    # A static cache cannot follow L per batch, and in a paged KV cache a key's
    # rotation is frozen when it is written, so per-batch frequencies would make
    # old keys and new queries disagree. rtp fixes L once, at max_position (the
    # longest sequence the cache serves), for every position, like vLLM (which
    # scales for original * factor):
    #   max_position <= original: plain RoPE, equal to HF for every sequence that fits;
    #   max_position >  original: the frequencies HF uses for a sequence of exactly
    #       max_position tokens; shorter sequences rotate a little slower than HF
    #       would rotate them, but q.k stays a function of relative position only.
    factor = _required(scaling, "factor")
    original = scaling.get("original_max_position_embeddings") or max_position
    if dim <= 2:
        raise ValueError(f"dynamic NTK needs rotary_dim > 2, got {dim}")
    if max_position > original:
        # HF computes this in forward from a tensor L, so in fp32; do the same so the bits agree
        seq_len = torch.tensor(max_position, dtype=torch.float32, device="cpu")
    else:
        seq_len = original  # HF's construction-time path, in Python floats (base * 1.0)
    base = base * ((factor * seq_len / original) - (factor - 1)) ** (dim / (dim - 2))
    return _default_inv_freq(base, dim), 1.0


def _yarn(base: float, dim: int, max_position: int, scaling: dict) -> tuple[torch.Tensor, float]:
    factor = _required(scaling, "factor")
    original = scaling.get("original_max_position_embeddings") or max_position
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        # DeepSeek-style mscale / mscale_all_dim (both must be set and nonzero, as in HF)
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # the dim index whose wavelength makes `rotations` turns over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero, as HF does
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp  # 1: keep the original frequency (fast dims), 0: interpolate
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _llama3(base: float, dim: int, max_position: int, scaling: dict) -> tuple[torch.Tensor, float]:
    factor = _required(scaling, "factor")
    low_freq_factor = _required(scaling, "low_freq_factor")
    high_freq_factor = _required(scaling, "high_freq_factor")
    original = _required(scaling, "original_max_position_embeddings")
    inv_freq = _default_inv_freq(base, dim)
    low_freq_wavelen, high_freq_wavelen = original / low_freq_factor, original / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by factor, short ones kept, the band between blended
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def _longrope(base: float, dim: int, max_position: int, scaling: dict) -> tuple[torch.Tensor, float]:
    # LongRoPE (Phi-3, Phi-4-mini): each frequency divided by a factor of its own, from one
    # set for sequences up to original_max_position_embeddings (short_factor) and another for
    # longer ones (long_factor); both scaled by one attention factor. transformers picks the
    # set per forward from the batch's longest sequence, and when a generation crosses the
    # threshold it drops its KV cache and recomputes every key with the long set.
    #
    # rtp's paged cache keeps each key as rotated when written (and shares prefixes between
    # sequences of any length), so one set must serve every position of every sequence. As
    # for dynamic NTK, rtp applies transformers' rule once, to max_position (the longest
    # sequence the cache serves); vLLM decides the same way, by its max_model_len:
    #   max_position <= original: the short set, equal to HF for every sequence that fits;
    #   max_position >  original: the long set, equal to HF for sequences longer than
    #       original; shorter ones rotate by the long set where HF would use the short one
    #       (what Phi-3-128k / Phi-4-mini get: a little short-context quality for the long context).
    short_factor, long_factor = _required(scaling, "short_factor"), _required(scaling, "long_factor")
    original = _required(scaling, "original_max_position_embeddings")
    for name, factors in (("short_factor", short_factor), ("long_factor", long_factor)):
        if len(factors) != dim // 2:
            raise ValueError(f"longrope {name} needs one factor per rotary frequency ({dim // 2}), "
                             f"got {len(factors)}")
    # HF's default factor is the context extension, config max_position_embeddings / original
    factor = scaling.get("factor")
    factor = max_position / original if factor is None else factor
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(long_factor if max_position > original else short_factor, dtype=torch.float32, device="cpu")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    return 1.0 / (ext * base ** exponents), float(attention_factor)  # HF's order of operations, in fp32


_INV_FREQ = {"default": _default, "linear": _linear, "dynamic": _dynamic, "yarn": _yarn, "llama3": _llama3,
             "longrope": _longrope}
