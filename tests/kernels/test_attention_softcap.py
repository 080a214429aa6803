"""Gemma 2's attention logit softcapping inside rtp's attention kernels: each scaled score becomes
softcap * tanh(score / softcap) before the mask and the softmax. The decode kernel (bf16 and int8
caches, its unrolled and generic copies) and the prefill kernel (AMX and AVX-512 products, bf16 and
int8 caches) against the torch references in rtp.models.attention, which cap the same way as
transformers' Gemma2; and a cap of 0 is no cap, bit for bit. The caps here are small enough that
leaving them out moves the output far past the tolerances."""

import struct

import pytest
import torch

from rtp.kernels import cpu_kernels, ops
from rtp.models.attention import (AttentionMetadata, PrefillRow, causal_attention, decode_attention, dequantize_kv,
                                  quantize_kv)

pytestmark = pytest.mark.skipif(not cpu_kernels.tiles_available(), reason="needs a CPU with AVX-512 BF16")

CAP = 2.0  # scores here spread over about +-8 (q and k of std 2): a cap of 2 reshapes every softmax


def _cache(kind, blocks, block_size, kv_heads, dim, g):
    """A random cache [2, blocks, block_size, Hkv, D] (bf16, or int8 with its scales), the fp32 K/V it
    holds and the scales (None for bf16)."""
    x = torch.randn(2, blocks, block_size, kv_heads, dim, generator=g) * 2
    if kind == "bf16":
        kv = x.bfloat16()
        return kv, kv.float(), None
    kv, scales = quantize_kv(x)
    return kv, dequantize_kv(kv, scales, torch.float32), scales


# (9, 3, 64) and (4, 4, 128) take unrolled copies of the kernel; the others its generic loop
@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (8, 1, 32), (14, 2, 96)])
@pytest.mark.parametrize("window", [0, 20])
def test_decode_attention_softcap_matches_fp32_reference(kind, heads, kv_heads, dim, window):
    g = torch.Generator().manual_seed(11)
    blocks, block_size, batch, width = 60, 16, 8, 30
    kv, fp32, scales = _cache(kind, blocks, block_size, kv_heads, dim, g)
    tables = torch.randint(1, blocks, (batch, width), dtype=torch.int32, generator=g)
    # one key, block edges, softmax spans of 256 keys and their edges; 0: a padding row
    lens = torch.tensor([1, 16, 17, 100, 256, 257, width * block_size, 0], dtype=torch.int32)
    q = (torch.randn(batch, heads, dim, generator=g) * 2).bfloat16()
    scale = dim**-0.5
    ref = decode_attention(q.float(), fp32[0], fp32[1], tables, lens, scale, window or None, CAP)
    uncapped = decode_attention(q.float(), fp32[0], fp32[1], tables, lens, scale, window or None)
    ks = () if scales is None else (scales[0], scales[1])

    def kernel(rows, cap):
        args = (q[-rows:], kv[0], kv[1], *ks, tables[-rows:], lens[-rows:], scale, window)
        if scales is None:
            return cpu_kernels.paged_decode_attention(*args, softcap=cap)
        return cpu_kernels.paged_decode_attention_int8(*args, softcap=cap)

    out = kernel(batch, CAP)
    live = lens > 0
    err = (out.float() - ref)[live].abs().max().item()
    # bf16 output rounding of values up to about 6 (2 ulps), as the uncapped kernels' tests
    assert err < 3e-2, err
    assert (uncapped - ref)[live].abs().max().item() > 20 * err  # the cap shows
    assert torch.all(out[~live] == 0)
    # one task per (row, kv head) with fewer rows: the same numbers
    for rows in (1, 3):
        assert torch.equal(kernel(rows, CAP), out[-rows:])
    # softcap 0: no cap, exactly the kernel without the argument
    plain = (cpu_kernels.paged_decode_attention(q, kv[0], kv[1], tables, lens, scale, window) if scales is None else
             cpu_kernels.paged_decode_attention_int8(q, kv[0], kv[1], *ks, tables, lens, scale, window))
    assert torch.equal(kernel(batch, 0.0), plain)


def test_decode_attention_softcap_is_recorded_in_the_call():
    """The cap travels as a word of the recorded call (a double's bits, as the scale does), so a
    captured step replays it; a replay gives what the eager call gave."""
    g = torch.Generator().manual_seed(12)
    kv, _, _ = _cache("bf16", 8, 16, 2, 64, g)
    tables = torch.randint(1, 8, (2, 4), dtype=torch.int32, generator=g)
    lens = torch.tensor([40, 9], dtype=torch.int32)
    q = (torch.randn(2, 4, 64, generator=g) * 2).bfloat16()
    cpu_kernels.record_start()
    try:
        out = cpu_kernels.paged_decode_attention(q, kv[0], kv[1], tables, lens, 0.125, 0, softcap=CAP)
    finally:
        calls = cpu_kernels.record_stop()
    words = torch.tensor(list(calls), dtype=torch.int64).view(-1, cpu_kernels.CALL_WORDS)
    assert words.shape[0] == 1 and cpu_kernels.op_name(int(words[0, 0])) == "decode_attention"
    cap = ops.BY_NAME["decode_attention"].field("softcap").word  # a double's bits, as the scale's
    assert struct.unpack("<d", struct.pack("<q", int(words[0, cap])))[0] == CAP
    first = out.clone()
    out.zero_()
    cpu_kernels.run_calls(words.numpy(), 0)  # as recorded
    assert torch.equal(out, first)


def _prefill(kind, heads, kv_heads, dim, rows, block_size, g):
    blocks = sum(-(-ctx // block_size) for _, ctx in rows) + 3
    order = (torch.randperm(blocks - 1, generator=g) + 1).to(torch.int32)  # scattered, never block 0
    chunks, start, used = [], 0, 0
    for n, ctx in rows:
        width = -(-ctx // block_size)
        chunks.append(PrefillRow(start, start + n, ctx, order[used:used + width]))
        start, used = start + n, used + width
    kv, fp32, scales = _cache(kind, blocks, block_size, kv_heads, dim, g)
    q = (torch.randn(start, heads, dim, generator=g) * 2).bfloat16()
    return q, kv, fp32, scales, chunks


def _reference(q, k_all, v_all, chunks, scale, window, cap, dtype):
    outs = []
    for row in chunks:
        ids = row.block_ids.long()
        k, v = (x[ids].flatten(0, 1)[:row.context_len].to(dtype) for x in (k_all, v_all))
        outs.append(causal_attention(q[row.query_start:row.query_end].to(dtype), k, v, scale, window or None,
                                     cap).float())
    return torch.cat(outs)


# GQA 3, 1 and 4; one-token chunks, chunks after a cached prefix, lengths off the 16-token tiles and
# the 128-key softmax steps; a block size that is not a tile's multiple
@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (8, 2, 64)])
@pytest.mark.parametrize("window", [0, 50])
@pytest.mark.parametrize("block_size", [16, 7])
@pytest.mark.parametrize("amx", [True, False])
def test_prefill_attention_softcap_matches_fp32_reference(kind, heads, kv_heads, dim, window, block_size, amx):
    if amx and not cpu_kernels.amx_available():
        pytest.skip("no AMX here")
    g = torch.Generator().manual_seed(13)
    rows = [(37, 37), (1, 50), (100, 300), (16, 16), (65, 129), (1, 1), (150, 260)]
    q, kv, fp32, scales, chunks = _prefill(kind, heads, kv_heads, dim, rows, block_size, g)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), block_size=block_size, prefill=chunks)
    args = meta.prefill_kernel_args()
    scale = dim**-0.5
    ks = {} if scales is None else {"k_scales": scales[0], "v_scales": scales[1]}
    out = cpu_kernels.prefill_attention(q, kv[0], kv[1], *args, scale, window, amx=amx, softcap=CAP, **ks)
    ref = _reference(q, fp32[0], fp32[1], chunks, scale, window, CAP, torch.float32)
    # torch on the same bf16 inputs (the layer's path without the kernel): products rounded to bf16
    torch_bf16 = _reference(q, fp32[0], fp32[1], chunks, scale, window, CAP, torch.bfloat16)
    err, torch_err = (out.float() - ref).abs(), (torch_bf16 - ref).abs()
    assert err.max().item() <= 1.5 * torch_err.max().item()
    assert err.mean().item() < 1.1 * torch_err.mean().item()
    uncapped = _reference(q, fp32[0], fp32[1], chunks, scale, window, None, torch.float32)
    assert (uncapped - ref).abs().max().item() > 10 * err.max().item()  # the cap shows
    # softcap 0: no cap, exactly the kernel without the argument
    plain = cpu_kernels.prefill_attention(q, kv[0], kv[1], *args, scale, window, amx=amx, **ks)
    assert torch.equal(cpu_kernels.prefill_attention(q, kv[0], kv[1], *args, scale, window, amx=amx, softcap=0.0,
                                                     **ks), plain)
