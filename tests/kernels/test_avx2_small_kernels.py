"""The avx2 path's row kernels (rtp/kernels/csrc/avx2/: norms, activations, the embedding, RoPE + KV write)
and the sampler's kernels on that path, against torch, with the tolerances the avx512bf16 path's tests
hold its kernels to (test_cpu_kernels.py, test_row_kernels.py, test_int8_kv.py). Every kernel runs under
on_isa("avx2"), so a CPU with AVX-512 BF16 tests these variants too.

Each kernel computes in fp32 and rounds once to its output dtype: a bf16 output is within half a bf16 ulp
(2^-8 of the value) of an fp64 reference, plus the last fp32 bits of a summation order or an exp/tanh
approximation. Widths that are not multiples of 8 or 16 (a row's partial last vector), odd row counts and
row strides past the width are in every case; a row's bits depend on that row alone.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_kernel_bounds import Canaries, run_and_replay

from rtp.kernels import cpu_kernels
from rtp.models.attention import hadamard, quantize_kv, rotates_kv
from rtp.models.rotary import get_rope

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs rtp's CPU kernels (AVX2 or later)")

BF16_REL = 2.0**-8  # half a bf16 ulp is at most this share of the value


@pytest.fixture(autouse=True)
def avx2_path():
    with cpu_kernels.on_isa("avx2") as isa:
        assert isa == "avx2"
        yield


def assert_rounded_once(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-30) -> None:
    """got (bf16 or fp32) is want (fp32) rounded once to got's dtype, give or take fp32 noise."""
    rel = BF16_REL * (1 + 1e-3) if got.dtype == torch.bfloat16 else 1e-5
    over = (got.float() - want).abs() - (want.abs() * rel + atol)
    assert torch.all(over <= 0), f"{over.max().item()} past the bound at flat index {int(over.argmax())}"


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.double()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.double()).float()


# -- norms ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("delta_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_add_rms_norm(delta_dtype, out_dtype, weight_dtype, tokens):
    g = torch.Generator().manual_seed(3)
    h = 96
    weight = (torch.randn(h, generator=g) + 1).to(weight_dtype)
    wide = torch.randn(tokens, h + 16, generator=g) * 4
    residual = wide[:, :h]  # its rows strided past the width
    before = wide.clone()
    delta = None if delta_dtype is None else torch.randn(tokens, h, generator=g).to(delta_dtype)
    want_res = before[:, :h] + (0 if delta is None else delta.float())
    got = cpu_kernels.add_rms_norm(residual, delta, weight, 1e-5, out_dtype)
    assert torch.equal(residual, want_res)  # the residual add is exact fp32
    assert torch.equal(wide[:, h:], before[:, h:])
    assert got.dtype == out_dtype and got.shape == (tokens, h)
    assert_rounded_once(got, reference_rms_norm(want_res, weight, 1e-5), atol=1e-6)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,h", [(1, 64), (3, 50), (17, 1152), (5, 7)])
def test_rms_norm(x_dtype, weight_dtype, tokens, h):
    g = torch.Generator().manual_seed(1)
    wide = (torch.randn(tokens, h + 24, generator=g) * 3).to(x_dtype)
    x = wide[:, :h]  # ldx != h
    weight = (torch.randn(h, generator=g) + 1).to(weight_dtype)
    assert cpu_kernels.rms_norm_supported(x, weight)
    got = cpu_kernels.rms_norm(x, weight, 1e-6)
    assert got.dtype == x_dtype and got.shape == (tokens, h)
    assert_rounded_once(got, reference_rms_norm(x, weight, 1e-6), atol=1e-6)


@pytest.mark.parametrize("t", [1, 5, 17])
@pytest.mark.parametrize("h", [16, 50])
@pytest.mark.parametrize("x_bf16,out_bf16", [(True, True), (False, False), (True, False)])
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


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 32), (3, 1, 50), (8, 8, 256)])
@pytest.mark.parametrize("tokens", [1, 19])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_qk_rms_norm_in_place(heads, kv_heads, dim, tokens, weight_dtype):
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
    assert_rounded_once(qkv[:, :heads * dim].reshape(tokens, heads, dim),
                        reference_rms_norm(q.reshape(tokens, heads, dim), qw, 1e-6), atol=1e-6)
    assert_rounded_once(qkv[:, heads * dim:(heads + kv_heads) * dim].reshape(tokens, kv_heads, dim),
                        reference_rms_norm(k.reshape(tokens, kv_heads, dim), kw, 1e-6), atol=1e-6)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v)
    assert torch.equal(wide[:, width:], before[:, width:])


def test_a_rows_bits_depend_on_that_row_alone():
    """Each row alone, the rows together and one thread against several: the same bits."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(33, 200, generator=g) * 3).bfloat16()
    weight = torch.randn(200, generator=g) + 1
    gate_up = (torch.randn(33, 2 * 72, generator=g) * 3).bfloat16()
    logits = torch.randn(33, 5000, generator=g) * 40
    outs = []
    threads = torch.get_num_threads()
    for n in (threads, 1):
        torch.set_num_threads(n)
        try:
            capped = logits.clone()
            cpu_kernels.softcap(capped, 30.0)
            outs.append((cpu_kernels.rms_norm(x, weight, 1e-6), cpu_kernels.gelu_tanh_mul(gate_up), capped))
        finally:
            torch.set_num_threads(threads)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    norm, gelu, capped = outs[0]
    for r in (0, 16, 32):
        assert torch.equal(cpu_kernels.rms_norm(x[r:r + 1], weight, 1e-6), norm[r:r + 1])
        assert torch.equal(cpu_kernels.gelu_tanh_mul(gate_up[r:r + 1]), gelu[r:r + 1])
        one = logits[r:r + 1].clone()
        cpu_kernels.softcap(one, 30.0)
        assert torch.equal(one, capped[r:r + 1])


# -- activations -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens", [1, 5, 19])
def test_silu_mul(tokens):
    """silu(gate) * up in fp32, rounded once to bf16; extreme gates stay finite."""
    g = torch.Generator().manual_seed(5)
    wide = (torch.randn(tokens, 2 * 64 + 32, generator=g) * 4).bfloat16()
    wide[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0]).bfloat16()
    x = wide[:, :2 * 64]  # ldx != 2I
    assert cpu_kernels.silu_mul_supported(x)
    out = cpu_kernels.silu_mul(x)
    gate, up = x.float().chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, 64)
    assert torch.all(torch.isfinite(out.float()))
    assert torch.all((out.float() - want).abs() <= want.abs() * 2**-8 + 1e-30)


@pytest.mark.parametrize("tokens,inter", [(1, 64), (5, 50), (19, 7), (3, 6912)])
def test_gelu_tanh_mul(tokens, inter):
    """Rounded once to bf16 from fp32 that keeps its digits (against fp64, via the sigmoid form)."""
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
    assert_rounded_once(out, (gate * torch.sigmoid(2 * y) * up).float(), atol=1e-30)
    gate, up = x.float().chunk(2, dim=-1)
    torch_fp32 = F.gelu(gate, approximate="tanh") * up
    lost = 2**-23 * (gate * up).abs()  # an ulp of 1 + tanh, times 0.5 g u: what torch's fp32 may lose
    assert torch.all((out.float() - torch_fp32).abs() <= torch_fp32.abs() * BF16_REL * (1 + 1e-3) + lost + 1e-30)


@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("inter", [48, 21])
def test_gelu_tanh_mul_writes_only_its_output(t, inter):
    a = Canaries(13)
    x = a.place("x", torch.randn(t, 2 * inter + 16).bfloat16(), lambda v: v[:, :2 * inter])
    out = a.place("out", torch.zeros(t, inter + 16, dtype=torch.bfloat16), lambda v: v[:, :inter],
                  lambda e, r: e[:r, :inter])
    run_and_replay(a, lambda: cpu_kernels._k.gelu_tanh_mul(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0),
                                                           t, inter), t, (1, t - 1) if t > 2 else (1,))


@pytest.mark.parametrize("tokens,n", [(1, 15), (3, 4096 + 17), (2, 262144)])
@pytest.mark.parametrize("cap", [30.0, 3.0])
def test_softcap(tokens, n, cap):
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
    torch.testing.assert_close(x[0, 1:4], want[0, 1:4], rtol=1e-6, atol=0)  # tiny values keep their digits


@pytest.mark.parametrize("t,n", [(1, 7), (3, 70000)])
def test_softcap_writes_only_its_rows(t, n):
    a = Canaries(14)
    x = a.place("logits", torch.randn(t, n + 9) * 50, lambda v: v[:, :n], lambda e, r: e[:r, :n])
    run_and_replay(a, lambda: cpu_kernels._k.softcap(x.data_ptr(), x.stride(0), 30.0, t, n), t,
                   (1, t - 1) if t > 2 else (1,))


# -- the embedding -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h", [96, 50])
@pytest.mark.parametrize("scaled", [False, True])
def test_embed_rows(dtype, h, scaled):
    """table[ids] in fp32; scaled: the product in the table's dtype first, as torch's, bit for bit."""
    g = torch.Generator().manual_seed(6)
    wide = (torch.randn(60, h + 8, generator=g) * 0.7).to(dtype)
    table = wide[:, :h]  # ldt != h
    ids = torch.tensor([3, 0, 59, 3, 17], dtype=torch.int32)
    assert cpu_kernels.embed_supported(ids, table)
    if not scaled:
        got = cpu_kernels.embed_rows(ids, table)
        assert got.dtype == torch.float32 and torch.equal(got, F.embedding(ids, table).float())
        return
    factor = torch.tensor(h**0.5, dtype=torch.float32).to(dtype)
    got = cpu_kernels.embed_rows(ids, table, factor.item())
    assert torch.equal(got, (F.embedding(ids, table) * factor).float())


# -- RoPE + KV write --------------------------------------------------------------------------------------

def _rope_operands(heads, kv_heads, dim, tokens, seed=4):
    g = torch.Generator().manual_seed(seed)
    rope = get_rope(dim, None, 256, 10000.0, None)
    width = (heads + 2 * kv_heads) * dim
    qkv = (torch.randn(tokens, width + 24, generator=g) * 3).bfloat16()[:, :width]  # ldq != width
    positions = torch.randint(0, 256, (tokens,), dtype=torch.int32, generator=g)
    return rope, qkv, positions, g


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 128), (3, 1, 96)])
@pytest.mark.parametrize("tokens", [1, 5, 17])
def test_rope_store_kv(heads, kv_heads, dim, tokens):
    """The fused kernel (rotate q, k; write k, v at their slots) equals rotary + index_copy, bit for bit."""
    rope, qkv, positions, g = _rope_operands(heads, kv_heads, dim, tokens)
    blocks, block_size = 8, 4
    cache = torch.zeros(2, blocks, block_size, kv_heads, dim, dtype=torch.bfloat16)
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens].to(torch.int64)
    assert cpu_kernels.rope_supported(qkv, cache, rope.cos_sin_cache, positions, dim)
    q = cpu_kernels.rope_store_kv(qkv, positions, rope.cos_sin_cache, cache, slots, heads, kv_heads)
    q_ref, k_ref, v_ref = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q_ref, k_ref = rope(positions, q_ref.reshape(tokens, heads, dim), k_ref.reshape(tokens, kv_heads, dim))
    assert torch.equal(q, q_ref)
    flat = cache.view(2, -1, kv_heads, dim)
    assert torch.equal(flat[0, slots], k_ref)
    assert torch.equal(flat[1, slots], v_ref.reshape(tokens, kv_heads, dim))
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert torch.all(flat[:, untouched] == 0)


def test_rope_store_kv_rotates_a_partial_head():
    """rot < D (partial rotary): the dims past rot are copied as they are."""
    heads, kv_heads, dim, tokens = 2, 1, 64, 3
    rope = get_rope(dim, 32, 256, 10000.0, None)
    _, qkv, positions, _ = _rope_operands(heads, kv_heads, dim, tokens)
    cache = torch.zeros(2, 2, 4, kv_heads, dim, dtype=torch.bfloat16)
    slots = torch.tensor([5, 0, 7], dtype=torch.int64)
    q = cpu_kernels.rope_store_kv(qkv, positions, rope.cos_sin_cache, cache, slots, heads, kv_heads)
    q_ref, k_ref, v_ref = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q_ref, k_ref = rope(positions, q_ref.reshape(tokens, heads, dim), k_ref.reshape(tokens, kv_heads, dim))
    assert torch.equal(q, q_ref)
    assert torch.equal(cache.view(2, -1, kv_heads, dim)[0, slots], k_ref)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 1, 32), (6, 2, 96), (2, 2, 256)])
@pytest.mark.parametrize("tokens", [1, 17])
def test_rope_store_kv_int8(heads, kv_heads, dim, tokens):
    """quantize_kv(rotary k, times the Hadamard matrix where the head dim is a power of two) and
    quantize_kv(v) at the slots, scales included, bit for bit; q rotated alike; other slots untouched."""
    rope, qkv, positions, g = _rope_operands(heads, kv_heads, dim, tokens)
    qkv[0, (heads + kv_heads) * dim:(heads + kv_heads + 1) * dim] = 0  # a V row of zeros: scale 0
    blocks, block_size = 12, 4
    cache = torch.zeros(2, blocks, block_size, kv_heads, dim, dtype=torch.int8)
    scales = torch.zeros(2, blocks, block_size, kv_heads)
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens].to(torch.int64)
    assert cpu_kernels.rope_supported(qkv, cache, rope.cos_sin_cache, positions, dim)
    q = cpu_kernels.rope_store_kv_int8(qkv, positions, rope.cos_sin_cache, cache, scales, slots, heads, kv_heads)
    q_ref, k_ref, v_ref = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q_ref, k_ref = rope(positions, q_ref.reshape(tokens, heads, dim), k_ref.reshape(tokens, kv_heads, dim))
    if rotates_kv(dim):
        q_ref, k_ref = hadamard(q_ref).bfloat16(), hadamard(k_ref)
    assert torch.equal(q, q_ref)
    flat, flat_scales = cache.view(2, -1, kv_heads, dim), scales.view(2, -1, kv_heads)
    for part, x in ((0, k_ref), (1, v_ref.reshape(tokens, kv_heads, dim))):
        want, want_scales = quantize_kv(x)
        assert torch.equal(flat[part, slots], want)
        assert torch.equal(flat_scales[part, slots], want_scales)
    assert flat_scales[1, slots[0], 0] == 0 and torch.all(flat[1, slots[0], 0] == 0)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert torch.all(flat[:, untouched] == 0) and torch.all(flat_scales[:, untouched] == 0)


@pytest.mark.parametrize("int8", [False, True])
def test_rope_store_kv_refuses_a_slot_outside_the_cache(int8):
    rope = get_rope(64, None, 64, 10000.0, None)
    cache = torch.zeros(2, 4, 4, 3, 64, dtype=torch.int8 if int8 else torch.bfloat16)
    scales = torch.zeros(2, 4, 4, 3)
    qkv = torch.randn(3, 15 * 64).bfloat16()
    slots = torch.tensor([3, 16, -1], dtype=torch.int64)
    with pytest.raises(IndexError, match="outside the KV cache"):
        if int8:
            cpu_kernels.rope_store_kv_int8(qkv, torch.zeros(3, dtype=torch.int32), rope.cos_sin_cache, cache, scales,
                                           slots, 9, 3)
        else:
            cpu_kernels.rope_store_kv(qkv, torch.zeros(3, dtype=torch.int32), rope.cos_sin_cache, cache, slots, 9, 3)
    written = torch.zeros(16, dtype=torch.bool)
    written[3] = True  # the slot inside the cache, written; nothing else
    flat = cache.view(2, 16, 3, 64)
    assert torch.all(flat[:, 3].float().abs().amax(-1) > 0) and torch.all(flat[:, ~written] == 0)
    if int8:
        assert torch.all(scales.view(2, 16, 3)[:, 3] > 0) and torch.all(scales.view(2, 16, 3)[:, ~written] == 0)


# -- the sampler's kernels -------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 49152])
def test_argmax_rows_is_numpys(n):
    """NumPy's answer on random rows, ties (the first wins, across lanes and vectors), -inf rows, NaN
    (the first NaN wins) and a row stride past N."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(37, n + 3, generator=g)[:, :n]
    x[1] = 0.0
    x[2, n // 2] = x[2, n - 1] = 100.0
    x[3] = float("-inf")
    x[4, n // 3] = float("nan")
    x[5, -1] = float("nan")
    x[5, 0] = float("inf")
    x[6] = torch.randint(0, 3, (n,), generator=g).float()
    x[7, n // 2:] = float("nan")
    assert cpu_kernels.argmax_supported(x)
    got = cpu_kernels.argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, torch.from_numpy(x.numpy().argmax(axis=-1)))
    assert torch.equal(cpu_kernels.argmax_rows(x[2:3]), got[2:3])


@pytest.mark.parametrize("n", [5, 32, 77, 1000])
def test_apply_token_bitmask(n):
    """-inf exactly where the row's bit is 0, only on the listed rows, never past the vocabulary."""
    g = torch.Generator().manual_seed(n)
    words = (n + 31) // 32
    wide = torch.randn(6, n + 40, generator=g)
    x = wide[:, :n]
    before = wide.clone()
    mask = torch.randint(-2**31, 2**31, (4, words + 1), dtype=torch.int64, generator=g).to(torch.int32)
    mask[0, 0] = -1  # every token of the word allowed: skipped
    mask[1, -2] = 0  # the last word, all forbidden (its bits past n too)
    rows = torch.tensor([4, 0, 2], dtype=torch.int64)
    cpu_kernels.apply_token_bitmask(x, mask, rows)
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((mask[:3, :words].unsqueeze(-1) >> shifts) & 1).reshape(3, -1)[:, :n].bool()
    want = before[:, :n].clone()
    want[rows] = want[rows].masked_fill(~allowed, float("-inf"))
    assert torch.equal(x, want)
    assert torch.equal(wide[:, n:], before[:, n:])
