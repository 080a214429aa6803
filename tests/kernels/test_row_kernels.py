"""rtp/kernels/csrc/row_kernels.c and the scaled embedding lookup against torch, in fp32 (or fp64).

Each kernel computes in fp32 and rounds once to its output dtype, so a bf16 output is within half
a bf16 ulp (2^-8 of the value at most) of the reference, plus the last fp32 bits of a different
summation order or tanh approximation. Widths that are not multiples of 16
(a masked last vector) and row strides past the width are in every case; each call writes inside
its output only, and a replay of its recorded call over fewer rows (as a CPU graph replays it)
writes only those rows (tests/kernels/test_kernel_bounds.py).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_kernel_bounds import Canaries, run_and_replay

from rtp.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.tiles_available(), reason="needs a CPU with AVX-512 BF16")

BF16_REL = 2.0**-8  # half a bf16 ulp is at most this share of the value


def assert_rounded_once(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-30) -> None:
    """got (bf16 or fp32) is want (fp32) rounded once to got's dtype, give or take fp32 noise."""
    rel = BF16_REL * (1 + 1e-3) if got.dtype == torch.bfloat16 else 1e-5
    err = (got.float() - want).abs()
    bound = want.abs() * rel + atol
    over = err - bound
    assert torch.all(over <= 0), f"{over.max().item()} past the bound at flat index {int(over.argmax())}"


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.double()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.double()).float()


# -- RMSNorm of any rows -------------------------------------------------------------------------------

@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,h", [(1, 64), (3, 50), (17, 1152), (40, 7)])
def test_rms_norm_matches_torch(x_dtype, weight_dtype, tokens, h):
    from rtp.models.layers import RMSNorm

    g = torch.Generator().manual_seed(1)
    wide = (torch.randn(tokens, h + 24, generator=g) * 3).to(x_dtype)
    x = wide[:, :h]  # rows strided past the width
    norm = RMSNorm(h, 1e-6)
    norm.weight.data = (torch.randn(h, generator=g) + 1).to(weight_dtype)
    assert cpu_kernels.rms_norm_supported(x, norm.weight)
    got = cpu_kernels.rms_norm(x, norm.weight, 1e-6)
    assert got.dtype == x_dtype and got.shape == (tokens, h)
    assert_rounded_once(got, reference_rms_norm(x, norm.weight, 1e-6), atol=1e-6)
    assert torch.equal(norm(x), got)  # the layer takes the kernel


@pytest.mark.parametrize("t", [1, 5, 17])
@pytest.mark.parametrize("h", [16, 50])
@pytest.mark.parametrize("x_bf16,out_bf16", [(True, True), (False, True), (True, False)])
def test_rms_norm_writes_only_its_output(t, h, x_bf16, out_bf16):
    xd = torch.bfloat16 if x_bf16 else torch.float32
    od = torch.bfloat16 if out_bf16 else torch.float32
    a = Canaries(11)
    x = a.place("x", torch.randn(t, h + 8).to(xd), lambda v: v[:, :h])
    weight = a.place("weight", torch.randn(h))
    out = a.place("out", torch.zeros(t, h + 16, dtype=od), lambda v: v[:, :h], lambda e, r: e[:r, :h])
    run_and_replay(a, lambda: cpu_kernels._k.rms_norm(x.data_ptr(), x.stride(0), x_bf16, weight.data_ptr(), False,
                                                      1e-6, out.data_ptr(), out.stride(0), out_bf16, t, h),
                   t, (1, t - 1) if t > 2 else (1,))


# -- q/k norm per head, in place inside the fused qkv output ---------------------------------------------

@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 32), (3, 1, 50), (8, 8, 256)])
@pytest.mark.parametrize("tokens", [1, 6, 19])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_qk_rms_norm_norms_q_and_k_heads_in_place(heads, kv_heads, dim, tokens, weight_dtype):
    g = torch.Generator().manual_seed(2)
    width = (heads + 2 * kv_heads) * dim
    wide = (torch.randn(tokens, width + 40, generator=g) * 2).bfloat16()
    qkv = wide[:, :width]
    before = wide.clone()
    qw = (torch.randn(dim, generator=g) + 1).to(weight_dtype)
    kw = (torch.randn(dim, generator=g) + 1).to(weight_dtype)
    assert cpu_kernels.qk_norm_supported(qkv, qw, kw, heads, kv_heads)
    cpu_kernels.qk_rms_norm(qkv, qw, kw, heads, kv_heads, 1e-6)
    q, k, v = before[:, :width].split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    want_q = reference_rms_norm(q.reshape(tokens, heads, dim), qw, 1e-6)
    want_k = reference_rms_norm(k.reshape(tokens, kv_heads, dim), kw, 1e-6)
    assert_rounded_once(qkv[:, :heads * dim].reshape(tokens, heads, dim), want_q, atol=1e-6)
    assert_rounded_once(qkv[:, heads * dim:(heads + kv_heads) * dim].reshape(tokens, kv_heads, dim), want_k,
                        atol=1e-6)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v)  # v as it was
    assert torch.equal(wide[:, width:], before[:, width:])  # past the row: untouched


@pytest.mark.parametrize("t", [1, 4, 17])
def test_qk_rms_norm_writes_only_q_and_k(t):
    heads, kv_heads, dim = 3, 2, 48
    width = (heads + 2 * kv_heads) * dim
    a = Canaries(12)
    qkv = a.place("qkv", torch.randn(t, width + 32).bfloat16(), lambda v: v[:, :width],
                  lambda e, r: e[:r, :(heads + kv_heads) * dim])
    qw, kw = a.place("q_weight", torch.randn(dim)), a.place("k_weight", torch.randn(dim))
    run_and_replay(a, lambda: cpu_kernels._k.qk_rms_norm(qkv.data_ptr(), qkv.stride(0), qw.data_ptr(), kw.data_ptr(),
                                                         False, 1e-6, t, heads, kv_heads, dim),
                   t, (1, t - 1) if t > 2 else (1,))


def test_qk_norm_in_the_attention_layer_equals_the_torch_path(monkeypatch):
    """LlamaAttention (Qwen3, Gemma 3) norms q/k with the kernel, then takes the fused RoPE + KV write:
    its output and the K/V it caches are the torch path's (q/k norm in torch, RoPE, index_copy) to
    bf16 rounding."""
    from rtp.config import ModelConfig
    from rtp.models.attention import AttentionMetadata, forward_context
    from rtp.models.llama import LlamaAttention

    config = ModelConfig.from_hf({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 128,
                                  "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256})
    torch.manual_seed(3)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as the loader builds a bf16 model: RoPE's table stays fp32
    try:
        attn = LlamaAttention(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(1.0, 0.3) if p.dim() == 1 else p.normal_(0.0, 0.05)
    tokens, blocks, block_size = 5, 4, 4
    x = torch.randn(tokens, 128).bfloat16()
    positions = torch.tensor([0, 3, 9, 200, 17], dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=torch.tensor([1, 6, 7, 12, 15]), block_size=block_size, num_decode=tokens,
                             decode_block_tables=torch.tensor([[0, 1, 2, 3]] * tokens, dtype=torch.int32),
                             decode_seq_lens=torch.tensor([2, 7, 8, 13, 16], dtype=torch.int32))
    calls = []
    real = cpu_kernels.qk_rms_norm
    monkeypatch.setattr(cpu_kernels, "qk_rms_norm", lambda *args: calls.append(args) or real(*args))

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        attn.attn.kv_cache = torch.zeros(2, blocks, block_size, 2, 32, dtype=torch.bfloat16)
        with torch.no_grad(), forward_context(meta):
            return attn(positions, x).float(), attn.attn.kv_cache.float()

    out, cache = run()
    assert len(calls) == 1
    monkeypatch.setattr(cpu_kernels, "qk_norm_supported", lambda *args: False)
    want_out, want_cache = run()
    assert len(calls) == 1  # the torch path
    assert (cache - want_cache).abs().max() <= 2**-7 * want_cache.abs().max()
    assert (out - want_out).abs().max() <= 2**-6 * want_out.abs().max()


# -- GELU(tanh)-and-mul -----------------------------------------------------------------------------

@pytest.mark.parametrize("tokens,inter", [(1, 64), (5, 50), (20, 7), (3, 6912)])
def test_gelu_tanh_mul_matches_torch(tokens, inter):
    """gelu(gate, approximate="tanh") * up rounded once to bf16 from fp32 that keeps its digits (against
    fp64), so torch's fp32 result too, but where 1 + tanh leaves torch few (a gate below about -4,
    where gelu is nearly 0); extreme gates stay finite (gelu(-200) is 0, gelu(200) is 200)."""
    g = torch.Generator().manual_seed(4)
    wide = (torch.randn(tokens, 2 * inter + 16, generator=g) * 3).bfloat16()
    wide[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0]).bfloat16()
    wide[-1, 4:7] = torch.tensor([-6.0, -3.0, 1e4]).bfloat16()
    x = wide[:, :2 * inter]
    assert cpu_kernels.gelu_tanh_mul_supported(x)
    out = cpu_kernels.gelu_tanh_mul(x)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, inter)
    assert torch.all(torch.isfinite(out.float()))
    gate, up = x.double().chunk(2, dim=-1)
    y = math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)
    exact = gate * torch.sigmoid(2 * y) * up  # 0.5 (1 + tanh y) = sigmoid(2 y): even fp64's 1 + tanh loses gelu(-8)
    assert_rounded_once(out, exact.float(), atol=1e-30)
    gate, up = x.float().chunk(2, dim=-1)
    torch_fp32 = F.gelu(gate, approximate="tanh") * up
    lost = 2**-23 * (gate * up).abs()  # an ulp of 1 + tanh, times 0.5 g u: what torch's fp32 may lose
    assert torch.all((out.float() - torch_fp32).abs() <= torch_fp32.abs() * BF16_REL * (1 + 1e-3) + lost + 1e-30)


def test_gelu_and_mul_layer_takes_the_kernel():
    from rtp.models.layers import GeluAndMul

    x = torch.randn(3, 2 * 40).bfloat16()
    assert torch.equal(GeluAndMul("tanh")(x), cpu_kernels.gelu_tanh_mul(x))
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(GeluAndMul("none")(x), F.gelu(gate) * up)  # exact GELU: torch


@pytest.mark.parametrize("t", [1, 5, 17])
@pytest.mark.parametrize("inter", [48, 21])
def test_gelu_tanh_mul_writes_only_its_output(t, inter):
    a = Canaries(13)
    x = a.place("x", torch.randn(t, 2 * inter + 16).bfloat16(), lambda v: v[:, :2 * inter])
    out = a.place("out", torch.zeros(t, inter + 16, dtype=torch.bfloat16), lambda v: v[:, :inter],
                  lambda e, r: e[:r, :inter])
    run_and_replay(a, lambda: cpu_kernels._k.gelu_tanh_mul(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0),
                                                           t, inter), t, (1, t - 1) if t > 2 else (1,))


# -- final logit softcapping -------------------------------------------------------------------------

@pytest.mark.parametrize("tokens,n", [(1, 15), (3, 4096 + 17), (2, 262144)])
@pytest.mark.parametrize("cap", [30.0, 3.0])
def test_softcap_matches_torch(tokens, n, cap):
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(tokens, n + 5, generator=g) * 20
    wide[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-6, 1e30, -math.inf, math.inf, math.nan])
    x = wide[:, :n]
    before = wide.clone()
    want = torch.tanh(x / cap) * cap
    assert cpu_kernels.softcap_supported(x)
    cpu_kernels.softcap(x, cap)
    torch.testing.assert_close(x, want, rtol=1e-6, atol=1e-6 * cap, equal_nan=True)
    assert torch.equal(wide[:, n:], before[:, n:])
    # tanh's odd polynomial keeps tiny values' digits (1 - e over 1 + e would lose them)
    torch.testing.assert_close(x[0, 1:4], want[0, 1:4], rtol=1e-6, atol=0)


@pytest.mark.parametrize("t", [1, 3, 9])
@pytest.mark.parametrize("n", [7, 70000])
def test_softcap_writes_only_its_rows(t, n):
    a = Canaries(14)
    x = a.place("logits", torch.randn(t, n + 9) * 50, lambda v: v[:, :n], lambda e, r: e[:r, :n])
    run_and_replay(a, lambda: cpu_kernels._k.softcap(x.data_ptr(), x.stride(0), 30.0, t, n), t,
                   (1, t - 1) if t > 2 else (1,))


# -- the scaled embedding lookup (Gemma) -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h", [96, 50, 1152])
def test_scaled_embedding_is_transformers_product(dtype, h):
    """table[ids] * sqrt(h), the factor and the product in the table's dtype, as transformers' Gemma
    computes it (a 0-dim tensor of the model's dtype), then fp32: equal bit for bit."""
    from rtp.models.layers import VocabParallelEmbedding

    emb = VocabParallelEmbedding(60, h)
    emb.weight.data = (torch.randn(60, h) * 0.7).to(dtype)
    ids = torch.tensor([3, 0, 59, 3, 17, 41], dtype=torch.int32)
    factor = torch.tensor(h**0.5, dtype=torch.float32).to(dtype)  # transformers' embed_scale buffer, cast
    want = (F.embedding(ids, emb.weight) * factor).float()
    got = cpu_kernels.embed_rows(ids, emb.weight, factor.item())
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(emb.embed_fp32(ids, factor.item()), want)
    if dtype == torch.bfloat16:  # the rounding shows: an fp32 product differs
        assert not torch.equal(got, F.embedding(ids, emb.weight).float() * factor.float())


@pytest.mark.parametrize("h", [16, 50])
@pytest.mark.parametrize("bf16", [False, True])
def test_scaled_embedding_writes_only_its_output(h, bf16):
    vocab, t = 40, 6
    a = Canaries(15)
    table = a.place("table", torch.randn(vocab, h + 8).to(torch.bfloat16 if bf16 else torch.float32),
                    lambda v: v[:, :h])
    ids = a.place("ids", torch.tensor([vocab - 1, 0, 7, vocab - 1, 3, 1], dtype=torch.int32))
    out = a.place("out", torch.zeros(t, h + 4), lambda v: v[:, :h], lambda e, r: e[:r, :h])
    run_and_replay(a, lambda: cpu_kernels._k.embed_rows(table.data_ptr(), bf16, table.stride(0), ids.data_ptr(),
                                                        out.data_ptr(), out.stride(0), t, h, 8.0), t, (1, 5))
