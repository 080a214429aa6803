"""The int8 KV cache (--kv-cache-dtype int8): rtp's RoPE + KV-write kernel quantizes exactly as
rtp.models.attention.quantize_kv does, and both attention kernels over int8 K/V and their scales
match an fp32 reference of the dequantized cache (quantize -> dequantize -> attention)."""

import pytest
import torch

from rtp.kernels import cpu_kernels
from rtp.models.attention import (AttentionMetadata, PagedAttention, PrefillRow, causal_attention, decode_attention,
                                  dequantize_kv, forward_context, hadamard, quantize_kv, rotates_kv)

kernels = pytest.mark.skipif(not cpu_kernels.tiles_available(), reason="needs a CPU with AVX-512 BF16")


def int8_cache(blocks, block_size, kv_heads, dim, generator):
    """A random int8 cache [2, blocks, block_size, Hkv, D] and its scales [2, blocks, block_size, Hkv], as
    quantize_kv writes them (every row reaches +-127 somewhere, scales spread over two decades)."""
    x = torch.randn(2, blocks, block_size, kv_heads, dim, generator=generator)
    x *= torch.rand(2, blocks, block_size, kv_heads, 1, generator=generator) * 3 + 0.03
    return quantize_kv(x)


def test_quantize_kv_round_trips_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g).bfloat16() * 5
    x[7, 1] = 0  # a row of zeros: scale 0, values 0, dequantized to zeros
    q, s = quantize_kv(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (50, 3)
    assert s[7, 1] == 0 and torch.all(q[7, 1] == 0)
    assert q.abs().amax(-1)[s > 0].min() == 127  # each row's absmax lands on 127
    back = dequantize_kv(q, s, torch.float32)
    assert torch.all((back - x.float()).abs() <= s.unsqueeze(-1) * (0.5 + 1e-4))  # fp32 rounding of q * s


@kernels
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 128), (8, 1, 32), (6, 2, 96)])
@pytest.mark.parametrize("tokens", [1, 5, 17])  # 17: the kernel's parallel loop
def test_rope_store_kv_int8_quantizes_as_torch(heads, kv_heads, dim, tokens):
    """The fused kernel writes quantize_kv(rotary k) and quantize_kv(v) at the slots, bit for bit,
    scales included; q as the bf16 kernel; every other slot untouched. The torch store path of the
    layer (forward with k and v given) writes the same bytes."""
    from rtp.models.rotary import get_rope

    g = torch.Generator().manual_seed(4)
    blocks, block_size = 12, 4
    rope = get_rope(dim, None, 256, 10000.0, None)
    attn = PagedAttention(heads, kv_heads, dim, dim**-0.5)
    attn.kv_cache = torch.zeros(2, blocks, block_size, kv_heads, dim, dtype=torch.int8)
    attn.kv_scales = torch.zeros(2, blocks, block_size, kv_heads)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g) * 3).bfloat16()
    qkv[0, (heads + kv_heads) * dim:(heads + kv_heads + 1) * dim] = 0  # a V row of zeros
    positions = torch.randint(0, 256, (tokens,), dtype=torch.int32, generator=g)
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens].to(torch.int64)
    assert attn.can_rope_and_store(qkv, positions, rope)
    with forward_context(AttentionMetadata(slot_mapping=slots, block_size=block_size)):
        q = attn.rope_and_store(qkv, positions, rope)
    q_ref, k_ref, v_ref = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q_ref, k_ref = rope(positions, q_ref.view(tokens, heads, dim), k_ref.view(tokens, kv_heads, dim))
    q_plain, k_plain = q_ref, k_ref
    if rotates_kv(dim):  # K times the Hadamard matrix, q alike: the same scores
        q_ref, k_ref = hadamard(q_ref).bfloat16(), hadamard(k_ref)
        scores, plain = (q_ref.float() * k_ref[:, :1]).sum(-1), (q_plain.float() * k_plain[:, :1].float()).sum(-1)
        assert torch.allclose(scores, plain, rtol=0.02, atol=0.5)
    assert torch.equal(q, q_ref)
    flat = attn.kv_cache.view(2, -1, kv_heads, dim)
    flat_scales = attn.kv_scales.view(2, -1, kv_heads)
    for part, x in ((0, k_ref), (1, v_ref.view(tokens, kv_heads, dim))):
        want, want_scales = quantize_kv(x)
        assert torch.equal(flat[part, slots], want)
        assert torch.equal(flat_scales[part, slots], want_scales)
    assert torch.all(flat_scales[1, slots[0], 0] == 0) and torch.all(flat[1, slots[0], 0] == 0)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert torch.all(flat[:, untouched] == 0) and torch.all(flat_scales[:, untouched] == 0)

    # the torch path (a model whose k leaves the kernel, e.g. after a q/k norm) stores the same bytes
    torch_path = PagedAttention(heads, kv_heads, dim, dim**-0.5)
    torch_path.kv_cache = torch.zeros_like(attn.kv_cache)
    torch_path.kv_scales = torch.zeros_like(attn.kv_scales)
    meta = AttentionMetadata(slot_mapping=slots, block_size=block_size, num_decode=tokens,
                             decode_block_tables=torch.zeros(tokens, 1, dtype=torch.int32),
                             decode_seq_lens=torch.ones(tokens, dtype=torch.int32))
    with forward_context(meta):
        torch_path(q_plain, k_plain, v_ref.view(tokens, kv_heads, dim))
    assert torch.equal(torch_path.kv_cache, attn.kv_cache) and torch.equal(torch_path.kv_scales, attn.kv_scales)


@kernels
def test_rope_store_kv_int8_refuses_a_slot_outside_the_cache():
    from rtp.models.rotary import get_rope

    rope = get_rope(64, None, 64, 10000.0, None)
    cache = torch.zeros(2, 4, 4, 3, 64, dtype=torch.int8)
    scales = torch.zeros(2, 4, 4, 3)
    qkv = torch.randn(2, 15 * 64).bfloat16()
    with pytest.raises(IndexError, match="outside the KV cache"):
        cpu_kernels.rope_store_kv_int8(qkv, torch.zeros(2, dtype=torch.int32), rope.cos_sin_cache, cache, scales,
                                       torch.tensor([3, 16], dtype=torch.int64), 9, 3)
    written = torch.zeros(16, dtype=torch.bool)
    written[3] = True  # the slot inside the cache, written; nothing else
    assert torch.all(scales.view(2, 16, 3)[:, 3] > 0) and torch.all(scales.view(2, 16, 3)[:, ~written] == 0)
    assert torch.all(cache.view(2, 16, 3, 64)[:, ~written] == 0)
    with pytest.raises(ValueError, match="scales"):
        cpu_kernels.rope_store_kv_int8(qkv, torch.zeros(2, dtype=torch.int32), rope.cos_sin_cache, cache,
                                       scales[:, :, :2], torch.tensor([3, 4], dtype=torch.int64), 9, 3)


# (9, 3, 64) and (4, 4, 128) take unrolled copies of the kernel; the others its generic loop
@kernels
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (8, 1, 32), (14, 2, 96)])
@pytest.mark.parametrize("window", [0, 20, 300])
def test_paged_decode_attention_int8_matches_fp32_reference(heads, kv_heads, dim, window):
    """Over int8 K/V with per-token scales, the decode kernel gives the fp32 attention of the
    dequantized cache within its bf16 output rounding, at every length from one key to many blocks
    and past softmax spans; the same numbers whatever the batch (one task per row or per head)."""
    g = torch.Generator().manual_seed(1)
    blocks, block_size, batch, width = 80, 16, 8, 40
    kv, scales = int8_cache(blocks, block_size, kv_heads, dim, g)
    tables = torch.randint(1, blocks, (batch, width), dtype=torch.int32, generator=g)
    lens = torch.tensor([1, 16, 17, 100, 256, 257, width * block_size, 0], dtype=torch.int32)
    q = torch.randn(batch, heads, dim, generator=g).bfloat16()
    k, v = (dequantize_kv(kv[i], scales[i], torch.float32) for i in (0, 1))
    ref = decode_attention(q.float(), k, v, tables, lens, dim**-0.5, window or None)
    out = cpu_kernels.paged_decode_attention_int8(q, kv[0], kv[1], scales[0], scales[1], tables, lens, dim**-0.5,
                                                  window)
    assert out.dtype == torch.bfloat16
    live = lens > 0
    assert (out.float() - ref)[live].abs().max().item() < 8e-3 * v.abs().max().item() / 3
    assert torch.all(out[~live] == 0)
    # the torch path of the layer (dequantize the gathered blocks) computes the same attention
    torch_path = decode_attention(q, kv[0], kv[1], tables, lens, dim**-0.5, window or None,
                                  k_scales=scales[0], v_scales=scales[1])
    assert (torch_path.float() - ref)[live].abs().max().item() < 3e-2 * v.abs().max().item() / 3
    for rows in (1, 3):
        part = cpu_kernels.paged_decode_attention_int8(q[-rows:], kv[0], kv[1], scales[0], scales[1], tables[-rows:],
                                                       lens[-rows:], dim**-0.5, window)
        assert torch.equal(part, out[-rows:])


@kernels
def test_decode_attention_int8_needs_its_scales():
    kv = torch.zeros(2, 4, 16, 2, 64, dtype=torch.int8)
    q = torch.zeros(1, 4, 64).bfloat16()
    tables, lens = torch.ones(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="needs contiguous fp32 scales"):
        cpu_kernels.paged_decode_attention_into(q, kv[0], kv[1], tables, lens, 0.125, 0, torch.empty_like(q))


def _prefill_rows(rows, block_size, generator):
    """PrefillRows (token after token, from token 0) over scattered blocks, never block 0."""
    blocks = sum(-(-ctx // block_size) for _, ctx in rows) + 3
    order = (torch.randperm(blocks - 1, generator=generator) + 1).to(torch.int32)
    chunks, start, used = [], 0, 0
    for n, ctx in rows:
        width = -(-ctx // block_size)
        chunks.append(PrefillRow(start, start + n, ctx, order[used:used + width]))
        start, used = start + n, used + width
    return chunks, blocks


# GQA 3, 1 and 4; one-token chunks, chunks after a cached prefix, lengths off the tiles and the
# 128-key softmax steps; a block size that is not a tile's multiple
@kernels
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (8, 2, 64)])
@pytest.mark.parametrize("window", [0, 50])
@pytest.mark.parametrize("block_size", [16, 7])
@pytest.mark.parametrize("amx", [True, False])
def test_prefill_attention_int8_is_the_bf16_kernel_over_the_dequantized_cache(heads, kv_heads, dim, window,
                                                                                block_size, amx):
    """The prefill kernel dequantizes int8 K/V to bf16 as it packs them: exactly the bf16 kernel's
    output over a bf16 cache holding dequantize_kv(int8, scales), and as close to the fp32
    attention of the dequantized cache as torch's bf16 SDPA over it."""
    if amx and not cpu_kernels.amx_available():
        pytest.skip("no AMX here")
    g = torch.Generator().manual_seed(3)
    rows = [(37, 37), (1, 50), (100, 300), (16, 16), (65, 129), (1, 1), (150, 400)]
    chunks, blocks = _prefill_rows(rows, block_size, g)
    kv, scales = int8_cache(blocks, block_size, kv_heads, dim, g)
    q = (torch.randn(sum(n for n, _ in rows), heads, dim, generator=g) * 2).bfloat16()
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), block_size=block_size, prefill=chunks)
    args = meta.prefill_kernel_args()
    scale = dim**-0.5
    out = cpu_kernels.prefill_attention(q, kv[0], kv[1], *args, scale, window, amx=amx, k_scales=scales[0],
                                        v_scales=scales[1])
    bf16 = dequantize_kv(kv, scales, torch.bfloat16)
    assert torch.equal(out, cpu_kernels.prefill_attention(q, bf16[0], bf16[1], *args, scale, window, amx=amx))
    fp32 = dequantize_kv(kv, scales, torch.float32)
    ref, sdpa = [], []
    for row in chunks:
        ids = row.block_ids.long()
        for cache, dtype, outs in ((fp32, torch.float32, ref), (bf16, torch.bfloat16, sdpa)):
            k, v = (cache[i][ids].flatten(0, 1)[:row.context_len] for i in (0, 1))
            outs.append(causal_attention(q[row.query_start:row.query_end].to(dtype), k, v, scale,
                                         window or None).float())
    ref, sdpa = torch.cat(ref), torch.cat(sdpa)
    err, sdpa_err = (out.float() - ref).abs(), (sdpa - ref).abs()
    assert err.max().item() <= 1.5 * sdpa_err.max().item()
    assert err.mean().item() < 1.1 * sdpa_err.mean().item()


@kernels
def test_layer_over_an_int8_cache_kernels_match_torch_paths(monkeypatch):
    """PagedAttention over an int8 cache, a step of two decode rows and two prefill chunks (one after a
    cached prefix): rtp's kernels are as close to the layer's torch paths in fp32 (dequantize, SDPA /
    grouped matmul) as those paths in bf16 are."""
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    g = torch.Generator().manual_seed(6)
    attn = PagedAttention(heads, kv_heads, dim, dim**-0.5)
    attn.kv_cache, attn.kv_scales = int8_cache(40, block_size, kv_heads, dim, g)
    tables = torch.arange(1, 37, dtype=torch.int32).view(4, 9)
    lens = [70, 33, 40, 130]
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), block_size=block_size, num_decode=2,
                             decode_block_tables=tables[:2], decode_seq_lens=torch.tensor(lens[:2], dtype=torch.int32),
                             prefill=[PrefillRow(2, 42, 40, tables[2, :3]), PrefillRow(42, 102, 130, tables[3])])
    q = torch.randn(102, heads, dim, generator=g).bfloat16()
    with forward_context(meta):
        assert cpu_kernels.prefill_attention_supported(q, attn.kv_cache[0])
        assert cpu_kernels.attention_supported(q, attn.kv_cache[0])
        fused = attn(q, None, None)
        monkeypatch.setattr(cpu_kernels, "_PREFILL", False)
        monkeypatch.setattr(cpu_kernels, "_AVAILABLE", False)
        meta._prefill_args = None
        eager = attn(q, None, None)
        fp32 = attn(q.float(), None, None)  # the same paths in fp32: the reference
    assert fused.shape == eager.shape == (102, heads * dim) and fused.dtype == eager.dtype == torch.bfloat16
    assert fp32.dtype == torch.float32
    err, eager_err = (fused.float() - fp32).abs(), (eager.float() - fp32).abs()
    # the kernels keep K/V products in fp32 (decode) or round them once to bf16 (prefill): at least as
    # close to fp32 as the torch paths in bf16 (whose largest errors are the output's bf16 rounding)
    assert err.max().item() <= eager_err.max().item()
    assert err.mean().item() <= eager_err.mean().item()


def test_the_hadamard_rotation_keeps_scores_and_spreads_an_outlier_channel():
    """H is orthonormal (q H . k H == q . k) and applied twice gives x back; K rows whose one channel
    runs at 8x the others' rms (SmolLM2's run at ~5x) lose over twice less to one int8 scale a row
    once rotated: the scores from the dequantized cache stay closer to the exact ones."""
    g = torch.Generator().manual_seed(11)
    for d in (16, 32, 64, 128, 256):
        x = torch.randn(50, d, generator=g)
        assert torch.allclose(hadamard(hadamard(x)), x, atol=1e-5)
        assert torch.allclose(hadamard(x) @ hadamard(x).T, x @ x.T, atol=1e-3)
    assert [rotates_kv(d) for d in (8, 16, 64, 96, 128, 256)] == [False, True, True, False, True, True]
    k, q = torch.randn(2048, 64, generator=g), torch.randn(64, 64, generator=g)
    k[:, 7] *= 8
    exact = q @ k.T

    def error(rotate: bool) -> float:
        kk, qq = (hadamard(k), hadamard(q)) if rotate else (k, q)
        back = dequantize_kv(*quantize_kv(kk), torch.float32)
        return ((qq @ back.T - exact).norm() / exact.norm()).item()

    assert error(True) < error(False) / 2, (error(True), error(False))  # 0.0053 vs 0.0132
