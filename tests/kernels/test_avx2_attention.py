"""The avx2 path's paged attention kernels (rtp/kernels/csrc/avx2/decode_attention.c, prefill_attention.c)
against an fp32 reference of the same cache, and their determinism: a query's bits depend on nothing but its
own q, position and keys (not the batch, its order, the thread count, or how its prompt was chunked), and
decode and prefill give a query at the same position the same bits."""

import pytest
import torch

from rtp.kernels import cpu_kernels
from rtp.models.attention import causal_attention, decode_attention, dequantize_kv, quantize_kv

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs rtp's CPU kernels (AVX2 or better)")

CAP = 2.0  # scores here spread over about +-8: a cap of 2 reshapes every softmax


def _cache(kind, blocks, block_size, kv_heads, dim, g):
    """A random cache [2, blocks, block_size, Hkv, D] (bf16, or int8 with its scales [2, blocks, block_size,
    Hkv]), the fp32 K/V it stands for, and the scales (None for bf16)."""
    x = torch.randn(2, blocks, block_size, kv_heads, dim, generator=g) * 2
    if kind == "bf16":
        kv = x.bfloat16()
        return kv, kv.float(), None
    x *= torch.rand(2, blocks, block_size, kv_heads, 1, generator=g) * 1.5 + 0.03  # scales over two decades
    kv, scales = quantize_kv(x)
    return kv, dequantize_kv(kv, scales, torch.float32), scales


def _assert_close_to_fp32(out, ref):
    """fp32 math inside, one bf16 rounding of the output: within a bf16 ulp of each value (2^-8 relative),
    plus a hair for the fp32 sums."""
    assert out.dtype == torch.bfloat16
    err = (out.float() - ref).abs()
    assert torch.all(err <= ref.abs() * 2**-8 + 1e-4 * ref.abs().max()), err.max().item()


def _decode(q, kv, scales, tables, lens, scale, window, softcap):
    with cpu_kernels.on_isa("avx2"):
        if scales is None:
            return cpu_kernels.paged_decode_attention(q, kv[0], kv[1], tables, lens, scale, window, softcap)
        return cpu_kernels.paged_decode_attention_int8(q, kv[0], kv[1], scales[0], scales[1], tables, lens, scale,
                                                       window, softcap)


def _plan(rows, width):
    """The plan arrays the prefill kernel reads for rows (query_start, tokens, context length, block ids)."""
    qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
    lens = torch.zeros(len(rows), dtype=torch.int32)
    tables = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, (start, n, ctx, ids) in enumerate(rows):
        qsl[i], qsl[i + 1] = start, start + n
        lens[i] = ctx
        tables[i, :ids.shape[0]] = ids
    return qsl, lens, tables


def _prefill(q, kv, scales, rows, width, scale, window, softcap, out=None):
    qsl, lens, tables = _plan(rows, width)
    ks = {} if scales is None else {"k_scales": scales[0], "v_scales": scales[1]}
    with cpu_kernels.on_isa("avx2"):
        return cpu_kernels.prefill_attention(q, kv[0], kv[1], qsl, lens, tables, 0, len(rows), scale, window, out=out,
                                             softcap=softcap, **ks)


def test_the_avx2_path_runs_both_attention_ops():
    assert cpu_kernels.has_op("decode_attention") and cpu_kernels.has_op("prefill_attention")
    with cpu_kernels.on_isa("avx2") as path:
        assert path == "avx2"


# GQA ratios 3, 1, 4 and 2; head dims 64, 128, 32 and 256
@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (16, 4, 32), (4, 2, 256)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (20, 0.0), (300, 0.0), (0, CAP), (20, CAP)])
def test_decode_attention_matches_fp32_reference(kind, heads, kv_heads, dim, window, softcap):
    g = torch.Generator().manual_seed(1)
    blocks, block_size, batch, width = 80, 16, 8, 40
    kv, fp32, scales = _cache(kind, blocks, block_size, kv_heads, dim, g)
    tables = torch.randint(1, blocks, (batch, width), dtype=torch.int32, generator=g)
    # one key, block edges, the 32-key steps' edges, many blocks; 0: a padding row
    lens = torch.tensor([1, 16, 33, 100, 256, 257, width * block_size, 0], dtype=torch.int32)
    q = (torch.randn(batch, heads, dim, generator=g) * 2).bfloat16()
    scale = dim**-0.5
    ref = decode_attention(q.float(), fp32[0], fp32[1], tables, lens, scale, window or None, softcap or None)
    out = _decode(q, kv, scales, tables, lens, scale, window, softcap)
    live = lens > 0
    _assert_close_to_fp32(out[live], ref[live])
    assert torch.all(out[~live] == 0)
    if softcap:
        uncapped = decode_attention(q.float(), fp32[0], fp32[1], tables, lens, scale, window or None)
        assert (uncapped - ref)[live].abs().max().item() > 0.1  # the cap shows


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_decode_rows_are_the_same_bits_alone_in_any_batch_and_on_any_thread_count(kind):
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, blocks, block_size, width = 9, 3, 64, 60, 16, 30
    kv, _, scales = _cache(kind, blocks, block_size, kv_heads, dim, g)
    tables = torch.randint(1, blocks, (6, width), dtype=torch.int32, generator=g)
    lens = torch.tensor([1, 31, 32, 33, 200, 480], dtype=torch.int32)
    q = (torch.randn(6, heads, dim, generator=g) * 2).bfloat16()
    scale = dim**-0.5
    out = _decode(q, kv, scales, tables, lens, scale, 50, CAP)
    for r in range(6):
        alone = _decode(q[r:r + 1], kv, scales, tables[r:r + 1], lens[r:r + 1], scale, 50, CAP)
        assert torch.equal(alone[0], out[r]), r
    order = torch.tensor([5, 2, 0, 4, 1, 3])
    assert torch.equal(_decode(q[order], kv, scales, tables[order], lens[order], scale, 50, CAP), out[order])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.equal(_decode(q, kv, scales, tables, lens, scale, 50, CAP), out), n
    finally:
        torch.set_num_threads(threads)


def _prefill_case(kind, heads, kv_heads, dim, block_size, contexts, g):
    """A cache holding each sequence's whole context and q for every position of it: returns q [sum ctx, H, D],
    the cache, its fp32 K/V, scales, each sequence's block ids and first token in q, and the table width."""
    width = max(-(-ctx // block_size) for ctx in contexts)
    blocks = sum(-(-ctx // block_size) for ctx in contexts) + 3
    kv, fp32, scales = _cache(kind, blocks, block_size, kv_heads, dim, g)
    order = (torch.randperm(blocks - 1, generator=g) + 1).to(torch.int32)  # scattered, never block 0
    ids, starts, used, start = [], [], 0, 0
    for ctx in contexts:
        n = -(-ctx // block_size)
        ids.append(order[used:used + n])
        starts.append(start)
        used, start = used + n, start + ctx
    q = (torch.randn(start, heads, dim, generator=g) * 2).bfloat16()
    return q, kv, fp32, scales, ids, starts, width


# GQA ratios 3, 1, 4 and 16 (the most a kv head takes: one token a tile); head dims 64 and 128; a block size
# off the 32-key steps
@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [(9, 3, 64, 16), (4, 4, 128, 7), (8, 2, 64, 7),
                                                           (16, 1, 128, 16)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (50, 0.0), (0, CAP), (50, CAP)])
def test_prefill_attention_matches_fp32_reference(kind, heads, kv_heads, dim, window, softcap, block_size):
    g = torch.Generator().manual_seed(3)
    contexts = [37, 50, 300, 1, 129, 200]
    q, kv, fp32, scales, ids, starts, width = _prefill_case(kind, heads, kv_heads, dim, block_size, contexts, g)
    # whole prompts, one-token chunks, and chunks after a cached prefix (the rest of q stays out of the call)
    chunks = [(0, 37), (49, 1), (100, 200), (0, 1), (64, 65), (150, 50)]  # (cached tokens, chunk tokens)
    rows, start = [], 0
    for (cached, n), ctx, blk in zip(chunks, contexts, ids):
        assert cached + n == ctx
        rows.append((start, n, ctx, blk))
        start += n
    qs = torch.cat([q[s + cached:s + ctx] for s, (cached, _), ctx in zip(starts, chunks, contexts)])
    scale = dim**-0.5
    out = _prefill(qs, kv, scales, rows, width, scale, window, softcap)
    ref = []
    for (s, n, ctx, blk) in rows:
        k, v = (x[blk.long()].flatten(0, 1)[:ctx] for x in (fp32[0], fp32[1]))
        ref.append(causal_attention(qs[s:s + n].float(), k, v, scale, window or None, softcap or None))
    _assert_close_to_fp32(out, torch.cat(ref))


@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("heads,kv_heads,dim,window", [(9, 3, 64, 0), (4, 4, 128, 45), (8, 2, 64, 0)])
def test_a_query_is_the_same_bits_however_its_prompt_is_chunked_batched_or_decoded(kind, heads, kv_heads, dim,
                                                                                    window):
    """Prefill of a whole prompt, of the same prompt in chunks that start off the 32-key steps and off the
    kernel's tiles (in one call, and call by call), of one sequence alone or beside others, on 1-3 threads,
    and decode of each position: every query gets the same bits."""
    g = torch.Generator().manual_seed(4)
    contexts = [203, 90, 1]
    q, kv, _, scales, ids, starts, width = _prefill_case(kind, heads, kv_heads, dim, 16, contexts, g)
    scale = dim**-0.5

    def whole(order):
        rows, start = [], 0
        for i in order:
            rows.append((start, contexts[i], contexts[i], ids[i]))
            start += contexts[i]
        qs = torch.cat([q[starts[i]:starts[i] + contexts[i]] for i in order])
        out = _prefill(qs, kv, scales, rows, width, scale, window, CAP)
        return {i: out[r[0]:r[0] + r[1]] for i, r in zip(order, rows)}

    want = whole([0, 1, 2])
    assert all(torch.equal(want[i], got) for i, got in whole([2, 0, 1]).items())
    assert torch.equal(whole([0])[0], want[0])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert all(torch.equal(want[i], got) for i, got in whole([0, 1, 2]).items()), n
    finally:
        torch.set_num_threads(threads)
    # sequence 0 in chunks: all of them rows of one call, then each chunk in a call of its own (out keeps
    # the tokens a call leaves alone)
    cuts = [0, 5, 37, 38, 64, 100, 161, 203]
    rows = [(a, b - a, b, ids[0]) for a, b in zip(cuts, cuts[1:])]
    q0 = q[starts[0]:starts[0] + contexts[0]]
    assert torch.equal(_prefill(q0, kv, scales, rows, width, scale, window, CAP), want[0])
    out = torch.full_like(q0, float("nan"))
    for row in rows:
        _prefill(q0, kv, scales, [row], width, scale, window, CAP, out=out)
    assert torch.equal(out, want[0])
    # decode of position p over its p + 1 keys: the prefill's query at p
    lens = torch.arange(1, contexts[0] + 1, dtype=torch.int32)
    tables = ids[0].expand(contexts[0], -1).contiguous()
    assert torch.equal(_decode(q0, kv, scales, tables, lens, scale, window, CAP), want[0])


def test_prefill_leaves_tokens_outside_its_rows_alone():
    g = torch.Generator().manual_seed(5)
    _, kv, _, _, ids, _, width = _prefill_case("bf16", 9, 3, 64, 16, [40, 20], g)
    q = torch.randn(64, 9, 64, generator=g).bfloat16()
    # plan rows 0-1: the step's decode rows (tokens 0-1); the call runs row 2 alone (tokens 2-41), not row 3
    qsl = torch.tensor([0, 1, 2, 42, 62], dtype=torch.int32)
    lens = torch.tensor([5, 5, 40, 20], dtype=torch.int32)
    tables = torch.zeros(4, width, dtype=torch.int32)
    tables[2, :ids[0].shape[0]], tables[3, :ids[1].shape[0]] = ids[0], ids[1]
    out = torch.full((64, 9, 64), 7.0, dtype=torch.bfloat16)
    with cpu_kernels.on_isa("avx2"):
        cpu_kernels.prefill_attention(q, kv[0], kv[1], qsl, lens, tables, 2, 1, 0.125, 0, out=out)
    assert torch.all(out[:2] == 7) and torch.all(out[42:] == 7)
    assert not torch.any(out[2:42] == 7)
