"""RoPE against transformers: every supported rope type, both config layouts, partial rotary.

transformers' own rotary class and `apply_rotary_pos_emb` are the reference; rtp must
agree within 1e-5 (max abs, fp32) at random positions.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GPTNeoXConfig, LlamaConfig  # noqa: E402
from transformers.models.gpt_neox import modeling_gpt_neox  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from rtp.models import rotary  # noqa: E402
from rtp.models.rotary import RotaryEmbedding, get_rope, rope_config_from_hf  # noqa: E402

HEAD_DIM, HEADS, KV_HEADS, MAX_POS = 64, 4, 2, 256
LLAMA = dict(hidden_size=HEAD_DIM * HEADS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
             head_dim=HEAD_DIM, max_position_embeddings=MAX_POS)

# transformers 4.x layout (rope_theta + rope_scaling); the 5.x layout is derived from each via to_dict()
def _rope(name: str) -> dict:
    return copy.deepcopy(ROPES[name])  # HF's config writes into the rope dict it is given


ROPES = {
    "default": dict(rope_theta=10000.0),
    "linear": dict(rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 2.0}),  # legacy `type` key
    "dynamic": dict(rope_theta=10000.0, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "yarn": dict(rope_theta=10000.0, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1}),
    "yarn-mscale": dict(rope_theta=10000.0, rope_scaling={  # DeepSeek-V2/V3 style, attention factor != 1
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.707, "mscale_all_dim": 1.0}),
    "yarn-attention-factor": dict(rope_theta=50000.0, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "attention_factor": 1.25, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}),
    "llama3": dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
}


def _qk(t: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, HEADS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    return q, k


def _hf_rotate(hf_rope: torch.nn.Module, apply, seq_positions: torch.Tensor, rows: torch.Tensor, q, k):
    """HF's rotation of q, k at seq_positions[rows], with cos/sin computed for the whole
    sequence `seq_positions` (what HF's dynamic rope keys its frequencies on)."""
    cos, sin = hf_rope(q, seq_positions[None].long())
    cos, sin = cos[:, rows], sin[:, rows]
    q_hf, k_hf = apply(q[None], k[None], cos, sin, unsqueeze_dim=2)
    return q_hf[0], k_hf[0]


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("layout", ["old", "new"])
@pytest.mark.parametrize("name", sorted(ROPES))
def test_matches_transformers(name: str, layout: str):
    hf_config = LlamaConfig(**LLAMA, **_rope(name))
    raw = {**LLAMA, **_rope(name)} if layout == "old" else hf_config.to_dict()
    if layout == "new":
        assert "rope_parameters" in raw and "rope_scaling" not in raw
    base, scaling, partial = rope_config_from_hf(raw)
    rope = get_rope(HEAD_DIM, None, MAX_POS, base, scaling, partial_rotary_factor=partial)
    hf_rope = modeling_llama.LlamaRotaryEmbedding(hf_config)

    positions = torch.randint(0, MAX_POS, (48,), generator=torch.Generator().manual_seed(1))
    positions[0] = MAX_POS - 1  # the last row of the cache too
    q, k = _qk(len(positions))
    # for dynamic, all positions < max_position_embeddings: HF stays at plain RoPE
    q_hf, k_hf = _hf_rotate(hf_rope, modeling_llama.apply_rotary_pos_emb, positions, slice(None), q, k)
    q_rtp, k_rtp = rope(positions, q, k)
    assert q_rtp.shape == q.shape and k_rtp.shape == k.shape
    assert _max_err(q_rtp, q_hf) < 1e-5 and _max_err(k_rtp, k_hf) < 1e-5
    if name.startswith("yarn"):
        assert rope.attention_factor == pytest.approx(hf_rope.attention_scaling)


@pytest.mark.parametrize("long", [2 * MAX_POS, 16 * MAX_POS])
def test_dynamic_long_sequence_matches_transformers_at_cache_length(long: int):
    """A cache built for `long` > the original length equals HF on a sequence of exactly that length
    (HF then scales the base for `long`; see the comment in rotary._dynamic for shorter ones)."""
    hf_config = LlamaConfig(**LLAMA, **_rope("dynamic"))
    base, scaling, partial = rope_config_from_hf({**LLAMA, **_rope("dynamic")})
    rope = get_rope(HEAD_DIM, None, long, base, scaling, partial_rotary_factor=partial)
    hf_rope = modeling_llama.LlamaRotaryEmbedding(hf_config)

    rows = torch.randint(0, long, (64,), generator=torch.Generator().manual_seed(2))
    rows[:2] = torch.tensor([3, long - 1])
    q, k = _qk(len(rows))
    q_hf, k_hf = _hf_rotate(hf_rope, modeling_llama.apply_rotary_pos_emb, torch.arange(long), rows, q, k)
    q_rtp, k_rtp = rope(rows, q, k)
    assert _max_err(q_rtp, q_hf) < 1e-5 and _max_err(k_rtp, k_hf) < 1e-5
    # and it really is scaled: plain RoPE would differ at the far positions
    plain = get_rope(HEAD_DIM, None, long, base, None)
    assert _max_err(plain(rows, q, k)[0], q_hf) > 1e-2


@pytest.mark.parametrize("name", ["default", "linear", "yarn", "llama3"])
def test_partial_rotary_matches_gpt_neox(name: str):
    extra = {k: v for k, v in _rope(name).items() if k != "rope_theta"}
    hf_config = GPTNeoXConfig(hidden_size=HEAD_DIM * HEADS, num_attention_heads=HEADS,
                              max_position_embeddings=MAX_POS, rotary_pct=0.5, rope_theta=10000.0, **extra)
    raw = hf_config.to_dict()
    base, scaling, partial = rope_config_from_hf(raw)
    assert partial == 0.5
    rope = get_rope(HEAD_DIM, None, MAX_POS, base, scaling, partial_rotary_factor=partial)
    assert rope.rotary_dim == HEAD_DIM // 2

    positions = torch.randint(0, MAX_POS, (32,), generator=torch.Generator().manual_seed(3))
    q, k = _qk(len(positions))
    q_hf, k_hf = _hf_rotate(modeling_gpt_neox.GPTNeoXRotaryEmbedding(hf_config),
                            modeling_gpt_neox.apply_rotary_pos_emb, positions, slice(None), q, k)
    q_rtp, k_rtp = rope(positions, q, k)
    assert _max_err(q_rtp, q_hf) < 1e-5 and _max_err(k_rtp, k_hf) < 1e-5
    assert torch.equal(q_rtp[..., HEAD_DIM // 2:], q[..., HEAD_DIM // 2:])  # pass-through untouched


def test_rope_parameters_layout_and_precedence():
    new = {"max_position_embeddings": 4096,
           "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                               "partial_rotary_factor": 0.5}}
    base, scaling, partial = rope_config_from_hf(new)
    assert (base, partial) == (1e6, 0.5)
    assert scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    # default type -> no scaling; a missing theta -> HF's default
    assert rope_config_from_hf({"rope_parameters": {"rope_type": "default"}}) == (10000.0, None, 1.0)
    assert rope_config_from_hf({"rope_theta": 5e5, "rope_scaling": None}) == (5e5, None, 1.0)
    # yarn without factor: the ratio of the lengths, as in HF
    _, scaling, _ = rope_config_from_hf({"max_position_embeddings": 8192, "rope_scaling": {
        "type": "yarn", "original_max_position_embeddings": 2048}})
    assert scaling["factor"] == 4.0
    with pytest.raises(ValueError, match="per-layer"):
        rope_config_from_hf({"rope_parameters": {"full_attention": {"rope_type": "default"},
                                                 "sliding_attention": {"rope_type": "default"}}})


def test_int32_positions():
    base, scaling, _ = rope_config_from_hf({**LLAMA, **_rope("llama3")})
    rope = get_rope(HEAD_DIM, None, MAX_POS, base, scaling)
    positions = torch.randint(0, MAX_POS, (16,), generator=torch.Generator().manual_seed(4))
    q, k = _qk(16)
    for a, b in zip(rope(positions.int(), q, k), rope(positions.long(), q, k)):
        assert torch.equal(a, b)


def test_bf16_in_bf16_out():
    base, scaling, _ = rope_config_from_hf({**LLAMA, **_rope("yarn")})
    rope = get_rope(HEAD_DIM, None, MAX_POS, base, scaling, dtype=torch.bfloat16)
    positions = torch.randint(0, MAX_POS, (16,), generator=torch.Generator().manual_seed(5))
    q, k = _qk(16, torch.bfloat16)
    q_out, k_out = rope(positions, q, k)
    assert q_out.dtype == k_out.dtype == torch.bfloat16
    q_ref, k_ref = rope(positions, q.float(), k.float())  # the same inputs, rotated in fp32
    torch.testing.assert_close(q_out.float(), q_ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(k_out.float(), k_ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("name", sorted(ROPES))
def test_cache_is_fp32_under_a_bf16_default_dtype(name: str):
    # the loader builds models under torch.set_default_dtype(model dtype)
    _, scaling, _ = rope_config_from_hf({**LLAMA, **_rope(name)})
    reference = rotary._build_rope(HEAD_DIM, HEAD_DIM, 2 * MAX_POS, 10000.0, scaling)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        rope = rotary._build_rope(HEAD_DIM, HEAD_DIM, 2 * MAX_POS, 10000.0, scaling)
    finally:
        torch.set_default_dtype(previous)
    assert rope.cos_sin_cache.dtype == torch.float32 and rope.cos_sin_cache.shape == (2 * MAX_POS, HEAD_DIM)
    assert torch.equal(rope.cos_sin_cache, reference.cos_sin_cache)


def test_same_arguments_share_one_module():
    a = get_rope(HEAD_DIM, None, MAX_POS, 10000.0, {"rope_type": "linear", "factor": 2.0})
    b = get_rope(HEAD_DIM, None, MAX_POS, 10000.0, {"rope_type": "linear", "factor": 2.0})
    c = get_rope(HEAD_DIM, None, MAX_POS, 10000.0, {"rope_type": "linear", "factor": 4.0})
    assert a is b and a is not c
    assert "cos_sin_cache" not in a.state_dict()


def test_compiles_fullgraph_without_recompiling():
    torch._dynamo.reset()
    rope = RotaryEmbedding(HEAD_DIM, HEAD_DIM // 2, 64,
                           1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM // 2, 2).float() / (HEAD_DIM // 2)))
    compiled = torch.compile(rope, fullgraph=True, dynamic=False)
    q, k = _qk(8)
    positions = torch.arange(8, dtype=torch.int32)
    for step in range(3):  # new position values each step: same graph
        out = compiled(positions + step, q, k)
        ref = rope(positions + step, q, k)
        torch.testing.assert_close(out[0], ref[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(out[1], ref[1], atol=1e-5, rtol=0)
        if step == 0:
            torch.compiler.set_stance("fail_on_recompile")
    torch.compiler.set_stance("default")


@pytest.mark.parametrize("scaling", [{"rope_type": "proportional", "factor": 2.0}, {"type": "su"}])
def test_unknown_rope_type(scaling):
    with pytest.raises(ValueError, match=r"unsupported rope_type .*default, linear, dynamic, yarn, llama3"):
        get_rope(HEAD_DIM, None, MAX_POS, 10000.0, scaling)


def test_bad_arguments():
    with pytest.raises(ValueError, match="needs 'low_freq_factor'"):
        get_rope(HEAD_DIM, None, MAX_POS, 10000.0, {"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="rotary_dim"):
        get_rope(HEAD_DIM, 66, MAX_POS, 10000.0, None)
