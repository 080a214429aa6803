"""rtp's CPU decode kernels against plain PyTorch on the same operands."""

import numpy as np
import pytest
import torch

from rtp.kernels import cpu_kernels, quant
from rtp.kernels.quant import BlockQuantized
from rtp.models.attention import decode_attention

pytestmark = pytest.mark.skipif(not cpu_kernels.tiles_available(), reason="needs a CPU with AVX-512 BF16")


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> BlockQuantized:
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(n, k // 32, generator=g) * 0.02 + 0.001
    if kind == "q4_1":
        qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        return BlockQuantized(kind, qs, d, torch.randn(n, k // 32, generator=g) * 0.05)
    qs = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    return BlockQuantized(kind, qs, d, None)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 70])  # 70: rows past the kernels' stack buffers
@pytest.mark.parametrize("bias", [False, True])
def test_quantized_linear_matches_dequantized_weights(kind, rows, bias):
    n, k = 37, 160  # a partial tile of rows; five blocks per row
    w = random_blocks(kind, n, k)
    b = torch.randn(n) if bias else None
    x = torch.randn(rows, k)
    x_in = x.bfloat16() if kind == "q4_1" else x
    ref = x_in.float() @ w.dequantize().T + (b if bias else 0)
    for out_dtype in (torch.float32, torch.bfloat16):
        out = w.linear(x_in, b, out_dtype)
        assert out.dtype == out_dtype and out.shape == (rows, n)
        tol = 1e-4 * ref.abs().max().item() if out_dtype == torch.float32 else 1e-2 * ref.abs().max().item()
        assert (out.float() - ref).abs().max().item() <= tol
        # rows are independent, bit for bit: each row alone gives its row of the batch (what lets a
        # request's drafted tokens be verified in one step with the numbers of one token a step)
        alone = torch.cat([w.linear(x_in[i:i + 1], b, out_dtype) for i in range(rows)])
        assert torch.equal(out, alone)


needs_amx = pytest.mark.skipif(not cpu_kernels.amx_available(), reason="needs a CPU with AMX-BF16")
# the tile-order kernels: on the AMX unit, and with AVX-512 BF16 (avx_gemm.c, what a CPU without AMX runs)
PATHS = [pytest.param(True, id="amx", marks=needs_amx), pytest.param(False, id="avx512")]


def tiles_linear(x, kind_id, w, b, dtype, amx, glu=False):
    n = w.tiles.shape[0] * 16
    out = torch.empty(x.shape[0], n // 2 if glu else n, dtype=dtype)
    return cpu_kernels.linear_tiles_into(x, kind_id, w.tiles, b, out, glu, amx=amx)


@pytest.mark.parametrize("amx", PATHS)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 15, 17, 64, 65, 100, 256, 300, 529])
def test_tile_linear_equals_the_models_bf16_weights(kind, rows, amx):
    """The tile-order kernels multiply exactly the model's bf16 weights (the dequantized blocks,
    rounded once) with fp32 accumulation: fp32-rounding-level error, any row count."""
    n, k = 48, 192  # three tiles of 16 rows, six blocks per row
    w = random_blocks(kind, n, k).with_tile_layout()
    assert w.tiles is not None and w.tiles.shape == (3, 6, 384 if kind == "q4_1" else 576)
    b = torch.randn(n)
    x = torch.randn(rows, k).bfloat16()
    ref = x.float() @ w.dequantize().bfloat16().float().T + b
    kind_id = 0 if kind == "q4_1" else 1
    out = tiles_linear(x, kind_id, w, b, torch.float32, amx)
    assert out.shape == (rows, n) and (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    assert torch.equal(tiles_linear(x, kind_id, w, b, torch.bfloat16, amx), out.bfloat16())
    if amx == cpu_kernels.amx_available():
        # what the layers call: this CPU's path for every batch, one row included (deterministic, the default)
        assert torch.equal(w.linear(x, b, torch.float32), out)
        with quant.determinism(False):  # --no-deterministic: one row on the one-row kernel, its exact weights
            alone = w.linear(x, b, torch.float32)
            if rows >= quant.TILE_MIN_ROWS:
                assert torch.equal(alone, out)
            else:
                exact = x.float() @ w.dequantize().float().T + b
                assert (alone - exact).abs().max().item() <= 1e-4 * exact.abs().max().item()


@pytest.mark.parametrize("amx", PATHS)
@pytest.mark.parametrize("k", [1024, 1600])
@pytest.mark.parametrize("rows", [17, 300, 529])
def test_tile_linear_over_a_long_k_sums_exactly(k, rows, amx):
    """Past 24 blocks of K (down_proj's 1,536) the AMX GEMM walks K in slices, the partial sums
    parked between them: still the fp32 sum of the model's bf16 weights, with an odd last weight
    tile, uneven slices (50 blocks in four) and row counts off the tiles and chunks; and a row's
    result is the same bits whichever rows come with it."""
    n = 48
    w = random_blocks("q4_1", n, k).with_tile_layout()
    b = torch.randn(n)
    x = torch.randn(rows, k).bfloat16()
    ref = x.float() @ w.dequantize().bfloat16().float().T + b
    out = tiles_linear(x, 0, w, b, torch.float32, amx)
    assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    assert torch.equal(tiles_linear(x[:2], 0, w, b, torch.float32, amx), out[:2])


@pytest.mark.parametrize("amx", PATHS)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [2, 5, 15, 17, 64, 65, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_tile_silu_mul_equals_the_projection_then_the_activation(kind, rows, bias, amx):
    """The fused MLP kernel (gate and up tiles interleaved, silu(gate) * up as the tiles leave
    the accumulators) gives the same bits as the gate_up product in bf16 and then the
    SiLU-and-mul kernel, which is what runs without it."""
    inter, k = 48, 192  # three 16-row tiles per half
    plain = random_blocks(kind, 2 * inter, k).with_tile_layout()
    fused = random_blocks(kind, 2 * inter, k).with_tile_layout(glu=True)
    assert fused.glu and fused.tiles.shape == plain.tiles.shape
    b = torch.randn(2 * inter) if bias else None
    x = torch.randn(rows, k).bfloat16()
    kind_id = 0 if kind == "q4_1" else 1
    want = cpu_kernels.silu_mul(tiles_linear(x, kind_id, plain, b, torch.bfloat16, amx))
    got = tiles_linear(x, kind_id, fused, b, torch.bfloat16, amx, glu=True)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, inter)
    assert torch.equal(got, want)
    ref = x.float() @ fused.dequantize().bfloat16().float().T + (b if bias else 0)
    gate, up = ref.bfloat16().float().chunk(2, dim=-1)
    assert torch.allclose(got.float(), torch.nn.functional.silu(gate) * up, rtol=1e-2, atol=1e-2)
    if amx == cpu_kernels.amx_available():
        assert torch.equal(fused.silu_mul(x, b), got)
    # the interleaved tiles serve only silu_mul: deterministic (the default) every batch, one row included
    assert fused.takes_silu_mul(rows) and not fused.takes(rows)
    assert fused.takes_silu_mul(1) and not fused.takes(1)
    assert plain.takes(rows) and plain.takes(1) and plain.serves_every_batch
    with quant.determinism(False):  # --no-deterministic: from TILE_MIN_ROWS rows on; fewer, the plain blocks
        many = rows >= quant.TILE_MIN_ROWS
        assert fused.takes_silu_mul(rows) == many and fused.takes(rows) != many
        assert fused.takes(1) and not fused.takes_silu_mul(1)


@pytest.mark.parametrize("amx", PATHS)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("x_fp32", [False, True])
def test_tile_linear_gives_a_row_the_same_bits_whatever_the_batch(kind, glu, x_fp32, amx):
    """A row's result is the same bits alone and in any batch, on either path (the root of
    docs/determinism.md). AMX: one row tile (up to 16 rows) runs four weight columns a pass, more rows
    one column a pass over up to four row tiles, past 64 rows the GEMM; without AMX, batches of up to 8
    rows put the weights in the vector lanes and larger ones the rows (avx_gemm.c), up to 32 rows a
    weight tile at a time and past that a dequantized column at a time. Five weight tiles (glu: three
    gate/up pairs), so the four-column passes end on a partial one, and a K that is not a multiple of
    the few-row loop's 4 or 8 blocks at a time."""
    n, k, big = 80 if not glu else 96, 32 * 11, 300
    w = random_blocks(kind, n, k).with_tile_layout(glu=glu and kind == "q4_1")
    kind_id = 0 if kind == "q4_1" else 1
    glu = w.glu
    b = torch.randn(n)
    x = torch.randn(big, k)
    x = x if x_fp32 and not glu else x.bfloat16()
    dtype = torch.bfloat16 if glu else torch.float32
    every = tiles_linear(x, kind_id, w, b, dtype, amx, glu=glu)
    for rows in [1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 21, 32, 33, 64, 65, 100]:
        assert torch.equal(tiles_linear(x[:rows], kind_id, w, b, dtype, amx, glu=glu), every[:rows]), rows
    for lo, hi in [(16, 21), (299, 300), (40, 41), (100, 180)]:
        assert torch.equal(tiles_linear(x[lo:hi], kind_id, w, b, dtype, amx, glu=glu), every[lo:hi]), (lo, hi)


@pytest.mark.parametrize("amx", PATHS)
@pytest.mark.parametrize("rows", [2, 17])
def test_tile_linear_rounds_fp32_rows_like_torch(rows, amx):
    """fp32 rows (the LM head's input) are rounded to bf16 as the kernel reads them: the same
    result as rounding them first."""
    w = random_blocks("q8_0", 48, 128).with_tile_layout()
    x = torch.randn(rows, 128)
    want = tiles_linear(x.bfloat16(), 1, w, None, torch.float32, amx)
    assert torch.equal(tiles_linear(x, 1, w, None, torch.float32, amx), want)
    wide = torch.randn(rows, 160)  # a row stride past K
    assert torch.equal(tiles_linear(wide[:, :128], 1, w, None, torch.float32, amx),
                       tiles_linear(wide[:, :128].bfloat16(), 1, w, None, torch.float32, amx))


def test_tile_linear_reads_a_row_slice_and_compiles():
    w = random_blocks("q4_1", 32, 64).with_tile_layout()
    wide = torch.randn(8, 96).bfloat16()  # rows the tile-order kernels take, with AMX or without
    x = wide[:, :64]  # a row stride wider than K, as a slice of a fused output
    assert torch.equal(w.linear(x, None, torch.float32), w.linear(x.contiguous(), None, torch.float32))

    @torch.compile(fullgraph=True)
    def f(x):
        return torch.relu(w.linear(x, None, torch.float32)) + 1

    assert torch.allclose(f(x), torch.relu(w.linear(x, None, torch.float32)) + 1)


def test_q4_1_nibble_order_is_ggufs(default_gguf):
    """Packed blocks read from the real default model dequantize to what gguf's own
    dequantizer gives, with the q/k rows unpermuted like the fp32 tensors."""
    from rtp.checkpoint.gguf import GGUFCheckpoint

    ckpt = GGUFCheckpoint(default_gguf)
    wanted = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
              "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight"}
    packed = {name: p for name, p in ckpt.quantized() if name in wanted}
    dense = {name: t for name, t in ckpt.tensors() if name in wanted}
    assert set(packed) == wanted
    assert packed["model.embed_tokens.weight"].kind == "q8_0"
    for name in wanted:
        assert torch.equal(packed[name].dequantize(), dense[name]), name


# (9, 3, 64) and (4, 4, 128) take unrolled copies of the kernel; the others its generic loop
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (8, 1, 32), (14, 2, 96)])
@pytest.mark.parametrize("window", [0, 20, 300])
def test_paged_decode_attention_matches_torch(heads, kv_heads, dim, window):
    g = torch.Generator().manual_seed(1)
    blocks, block_size, batch, width = 80, 16, 8, 40
    kv = torch.randn(2, blocks, block_size, kv_heads, dim, generator=g).bfloat16()
    tables = torch.randint(1, blocks, (batch, width), dtype=torch.int32, generator=g)
    # one key, block edges, softmax spans of 256 keys and their edges; 0: a padding row
    lens = torch.tensor([1, 16, 17, 100, 256, 257, width * block_size, 0], dtype=torch.int32)
    q = torch.randn(batch, heads, dim, generator=g).bfloat16()
    ref = decode_attention(q.float(), kv[0].float(), kv[1].float(), tables, lens, dim**-0.5, window or None)
    out = cpu_kernels.paged_decode_attention(q, kv[0], kv[1], tables, lens, dim**-0.5, window)
    assert out.dtype == torch.bfloat16
    live = lens > 0
    # bf16 output rounding: half an ulp of values below 1 in magnitude
    assert (out.float() - ref)[live].abs().max().item() < 8e-3
    assert torch.all(out[~live] == 0)
    # fewer rows than two per thread: one task per (row, kv head), the same numbers
    for rows in (1, 3):
        part = cpu_kernels.paged_decode_attention(q[-rows:], kv[0], kv[1], tables[-rows:], lens[-rows:],
                                                  dim**-0.5, window)
        assert torch.equal(part, out[-rows:])


# rows past 512 keys go in parts of 512 keys (tasks of their own), merged after; GQA ratios 3, 1, 4, 7
# and head dims 64, 128, 32, 96
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (8, 2, 32), (14, 2, 96)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (300, 0.0), (700, 0.0), (0, 30.0)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_decode_attention_of_long_rows_matches_torch(heads, kv_heads, dim, window, softcap, block_size):
    g = torch.Generator().manual_seed(3)
    width = 2100 // block_size + 1
    blocks = 4 * width
    kv = torch.randn(2, blocks, block_size, kv_heads, dim, generator=g).bfloat16()
    tables = torch.randint(1, blocks, (7, width), dtype=torch.int32, generator=g)
    # a part's edge, one key past it, two and three parts, a short row beside them, a padding row
    lens = torch.tensor([512, 513, 1024, 1100, 2100, 40, 0], dtype=torch.int32)
    q = torch.randn(7, heads, dim, generator=g).bfloat16()
    scale = dim**-0.5
    ref = decode_attention(q.float(), kv[0].float(), kv[1].float(), tables, lens, scale, window or None,
                           softcap or None)
    out = cpu_kernels.paged_decode_attention(q, kv[0], kv[1], tables, lens, scale, window, softcap)
    live = lens > 0
    assert (out.float() - ref)[live].abs().max().item() < 8e-3
    assert torch.all(out[~live] == 0)
    # a row's output is the same alone as in the batch (a task per part), speculative verification relies on
    # it: alone, a long row takes a task per part where it has a part per thread (on a CPU that streams the
    # tokens), and a task per kv head and part with more threads than parts; two rows together take a task
    # per kv head on such a CPU where both threads would otherwise hold at most two whole-row tasks
    threads = torch.get_num_threads()
    try:
        for n in (threads, 8):
            torch.set_num_threads(n)
            for r in range(7):
                alone = cpu_kernels.paged_decode_attention(q[r:r + 1], kv[0], kv[1], tables[r:r + 1], lens[r:r + 1],
                                                           scale, window, softcap)
                assert torch.equal(alone[0], out[r]), (n, r)
            for r in (0, 2, 4):
                pair = cpu_kernels.paged_decode_attention(q[r:r + 2], kv[0], kv[1], tables[r:r + 2], lens[r:r + 2],
                                                          scale, window, softcap)
                assert torch.equal(pair, out[r:r + 2]), (n, r)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("long_rows", [False, True])  # True: rows in parts
def test_decode_attention_of_a_peaked_softmax_is_right_and_not_slow(long_rows):
    """Queries 100x larger make most probabilities underflow toward denormals; with denormals live every
    vector operation on one took a microcode assist (6.5x slower). The kernels flush them, and give the
    caller's thread its float mode back: a denormal product still comes out non-zero after them."""
    import time

    g = torch.Generator().manual_seed(4)
    ctx, rows, block_size = (600 if long_rows else 256), 16, 16
    width = ctx // block_size + 1
    kv = torch.randn(2, rows * width + 1, block_size, 3, 64, generator=g).bfloat16()
    kv[1] *= 0.1
    tables = (torch.arange(rows * width, dtype=torch.int32) + 1).view(rows, width)
    lens = torch.full((rows,), ctx, dtype=torch.int32)
    q = torch.randn(rows, 9, 64, generator=g)
    peaked = (q * 100).bfloat16()
    ref = decode_attention(peaked.float(), kv[0].float(), kv[1].float(), tables, lens, 0.125, None)
    out = cpu_kernels.paged_decode_attention(peaked, kv[0], kv[1], tables, lens, 0.125, 0)
    assert (out.float() - ref).abs().max().item() < 8e-3
    assert (torch.tensor([1e-30]) * torch.tensor([1e-10])).item() != 0.0  # the float mode is back

    def best(x, n=7):
        cpu_kernels.paged_decode_attention(x, kv[0], kv[1], tables, lens, 0.125, 0)
        times = []
        for _ in range(n):
            t = time.perf_counter()
            cpu_kernels.paged_decode_attention(x, kv[0], kv[1], tables, lens, 0.125, 0)
            times.append(time.perf_counter() - t)
        return min(times)

    assert best(peaked) < 3 * best(q.bfloat16())


def test_paged_decode_attention_reads_a_table_view():
    """The runner passes a column slice of a wider table (row stride > width)."""
    g = torch.Generator().manual_seed(2)
    kv = torch.randn(2, 20, 16, 2, 64, generator=g).bfloat16()
    wide = torch.randint(1, 20, (3, 10), dtype=torch.int32, generator=g)
    lens = torch.tensor([40, 48, 5], dtype=torch.int32)
    q = torch.randn(3, 4, 64, generator=g).bfloat16()
    a = cpu_kernels.paged_decode_attention(q, kv[0], kv[1], wide[:, :3], lens, 0.125, 0)
    b = cpu_kernels.paged_decode_attention(q, kv[0], kv[1], wide[:, :3].contiguous(), lens, 0.125, 0)
    assert torch.equal(a, b)


def test_quantized_linear_compiles():
    w = random_blocks("q4_1", 64, 96)
    x = torch.randn(2, 96).bfloat16()

    @torch.compile(fullgraph=True)
    def f(x):
        return torch.relu(w.linear(x, None, torch.float32)) + 1

    assert torch.allclose(f(x), torch.relu(w.linear(x, None, torch.float32)) + 1)


def test_from_gguf_layout():
    """One Q4_1 block built by hand: d, m as fp16, byte j = weight j (low) | weight j + 16 (high)."""
    q = np.arange(32) % 16
    raw = np.zeros(20, dtype=np.uint8)
    raw[0:2] = np.frombuffer(np.float16(0.5).tobytes(), dtype=np.uint8)
    raw[2:4] = np.frombuffer(np.float16(-1.0).tobytes(), dtype=np.uint8)
    raw[4:] = (q[:16] | (q[16:] << 4)).astype(np.uint8)
    w = BlockQuantized.from_gguf("q4_1", raw, rows=1)
    assert torch.equal(w.dequantize()[0], torch.tensor(q * 0.5 - 1.0, dtype=torch.float32))


@pytest.mark.parametrize("delta_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_add_rms_norm_matches_torch(delta_dtype, out_dtype, weight_dtype, tokens):
    from rtp.models.layers import RMSNorm

    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = (torch.randn(96, generator=g) + 1).to(weight_dtype)
    residual = torch.randn(tokens, 96, generator=g) * 4
    delta = None if delta_dtype is None else torch.randn(tokens, 96, generator=g).to(delta_dtype)
    want_res = residual + (0 if delta is None else delta.float())
    want = norm(want_res).to(out_dtype)
    got_res, got = norm.add_norm(residual.clone(), delta, out_dtype)
    assert torch.equal(got_res, want_res)
    assert got.dtype == out_dtype
    if out_dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # an ulp of fp32 difference may round to the neighbouring bf16 value
        assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 128)])
def test_rope_and_store_matches_torch(heads, kv_heads, dim):
    """The fused kernel (rotate q, k; write k, v at their slots) equals rotary + index_copy."""
    from rtp.models.attention import AttentionMetadata, PagedAttention, forward_context
    from rtp.models.rotary import get_rope

    g = torch.Generator().manual_seed(4)
    tokens, blocks, block_size = 5, 8, 4
    rope = get_rope(dim, None, 256, 10000.0, None)
    attn = PagedAttention(heads, kv_heads, dim, dim**-0.5)
    attn.kv_cache = torch.zeros(2, blocks, block_size, kv_heads, dim, dtype=torch.bfloat16)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).bfloat16()
    positions = torch.tensor([0, 7, 100, 255, 31], dtype=torch.int32)
    slots = torch.tensor([4, 9, 31, 5, 12], dtype=torch.int64)
    assert attn.can_rope_and_store(qkv, positions, rope)
    with forward_context(AttentionMetadata(slot_mapping=slots, block_size=block_size)):
        q = attn.rope_and_store(qkv, positions, rope)
    q_ref, k_ref, v_ref = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q_ref, k_ref = rope(positions, q_ref.view(tokens, heads, dim), k_ref.view(tokens, kv_heads, dim))
    assert torch.equal(q, q_ref)
    flat = attn.kv_cache.view(2, -1, kv_heads, dim)
    assert torch.equal(flat[0, slots], k_ref)
    assert torch.equal(flat[1, slots], v_ref.view(tokens, kv_heads, dim))
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert torch.all(flat[:, untouched] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embed_rows_equals_embedding_in_fp32(dtype):
    from rtp.models.layers import VocabParallelEmbedding

    emb = VocabParallelEmbedding(50, 96)
    emb.weight.data = torch.randn(50, 96).to(dtype)
    ids = torch.tensor([3, 0, 49, 3, 17], dtype=torch.int32)
    out = cpu_kernels.embed_rows(ids, emb.weight)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.nn.functional.embedding(ids, emb.weight).float())
    assert torch.equal(emb.embed_fp32(ids), out)


@pytest.mark.parametrize("gate_dtype", [torch.bfloat16, torch.float32])
def test_add_sigmoid_gated_matches_fp32_torch(gate_dtype):
    """A shared expert's gated output onto the routed sum: out += sigmoid(gate) * y in fp32, within an
    fp32 rounding of torch's (the sigmoid's exp is libm's); a gate row strided, extreme gates finite."""
    g = torch.Generator().manual_seed(6)
    out = torch.randn(7, 96, generator=g)
    gate = (torch.randn(7, 3, generator=g) * 8).to(gate_dtype)[:, 1:2]  # one value a row, row stride 3
    gate[0, 0], gate[1, 0] = -200.0, 200.0
    y = torch.randn(7, 96, generator=g).bfloat16()
    want = out + torch.sigmoid(gate.float()) * y.float()
    got = cpu_kernels.add_sigmoid_gated(out.clone(), gate, y)
    assert torch.all(torch.isfinite(got))
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 5, 20])
def test_silu_mul_matches_fp32_torch(tokens):
    """silu(gate) * up in fp32, rounded once to bf16: within half a bf16 ulp (plus the exp
    approximation's last fp32 bits) of torch's fp32 result; extreme gates stay finite."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(tokens, 2 * 64, generator=g) * 4).bfloat16()
    x[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0]).bfloat16()
    out = cpu_kernels.silu_mul(x)
    gate, up = x.float().chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, 64)
    assert torch.all(torch.isfinite(out.float()))
    assert torch.all((out.float() - want).abs() <= want.abs() * 2**-8 + 1e-30)


def _prefill_batch(heads, kv_heads, dim, rows, block_size, seed=0):
    """Random bf16 q and a paged cache holding each row's whole context (its chunk's K/V included,
    as after rope_and_store); rows: (query tokens, context length). Returns q, kv and the rows as
    PrefillRows (token after token, from token 0)."""
    from rtp.models.attention import PrefillRow

    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-ctx // block_size) for _, ctx in rows) + 3
    kv = (torch.randn(2, blocks, block_size, kv_heads, dim, generator=g) * 2).bfloat16()
    order = (torch.randperm(blocks - 1, generator=g) + 1).to(torch.int32)  # scattered, never block 0
    q = (torch.randn(sum(n for n, _ in rows), heads, dim, generator=g) * 2).bfloat16()
    chunks, start, used = [], 0, 0
    for n, ctx in rows:
        width = -(-ctx // block_size)
        chunks.append(PrefillRow(start, start + n, ctx, order[used:used + width]))
        start, used = start + n, used + width
    return q, kv, chunks


def _kernel_args(chunks, block_size, num_decode=0):
    """The plan arrays rtp's prefill kernel reads, as AttentionMetadata builds them from rows."""
    from rtp.models.attention import AttentionMetadata

    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), block_size=block_size,
                             num_decode=num_decode, prefill=chunks)
    return meta.prefill_kernel_args()


def _causal_reference(q, kv, chunks, block_size, scale, window, dtype):
    from rtp.models.attention import causal_attention

    outs = []
    for row in chunks:
        ids = row.block_ids.long()
        k, v = (kv[i][ids].flatten(0, 1)[:row.context_len].to(dtype) for i in (0, 1))
        outs.append(causal_attention(q[row.query_start:row.query_end].to(dtype), k, v, scale, window or None).float())
    return torch.cat(outs)


# GQA ratios 3, 1, 4 and 4 at head_dim 128, head_dims 96 and 256 (the AVX-512 score loop has a copy per
# head_dim); one-token chunks, chunks after a cached prefix, lengths
# off the 16-token tiles, the 32-token tasks and the 256-key softmax steps (three of them in the last
# row); a block size that is not a tile's multiple
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (8, 2, 64), (12, 3, 128), (6, 2, 96),
                                                (4, 2, 256)])
@pytest.mark.parametrize("window", [0, 50])
@pytest.mark.parametrize("block_size", [16, 7])
@pytest.mark.parametrize("amx", [True, False])
def test_prefill_attention_matches_fp32_reference(heads, kv_heads, dim, window, block_size, amx):
    if amx and not cpu_kernels.amx_available():
        pytest.skip("no AMX here")
    rows = [(37, 37), (1, 50), (100, 300), (16, 16), (65, 129), (1, 1), (150, 400), (40, 600)]
    q, kv, chunks = _prefill_batch(heads, kv_heads, dim, rows, block_size)
    scale = dim**-0.5
    out = cpu_kernels.prefill_attention(q, kv[0], kv[1], *_kernel_args(chunks, block_size), scale, window, amx=amx)
    ref = _causal_reference(q, kv, chunks, block_size, scale, window, torch.float32)
    sdpa = _causal_reference(q, kv, chunks, block_size, scale, window, torch.bfloat16)
    err, sdpa_err = (out.float() - ref).abs(), (sdpa - ref).abs()
    # bf16 inputs, P rounded to bf16 and a bf16 output, as torch's SDPA on the same inputs: as
    # close to fp32 as it is (the largest errors are the output's rounding of values near 4, the
    # same in both; a running max left stale by a few units doubled the mean error)
    assert err.max().item() <= 1.5 * sdpa_err.max().item()
    assert err.mean().item() < 1.1 * sdpa_err.mean().item()


def test_prefill_attention_in_the_layer_matches_sdpa(monkeypatch):
    """PagedAttention over a step of two decode rows and two prefill chunks (one after a cached
    prefix): the kernel path gives what the SDPA path gives, within bf16 rounding."""
    from rtp.models.attention import AttentionMetadata, PagedAttention, PrefillRow, forward_context

    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    g = torch.Generator().manual_seed(6)
    attn = PagedAttention(heads, kv_heads, dim, dim**-0.5)
    attn.kv_cache = torch.randn(2, 40, block_size, kv_heads, dim, generator=g).bfloat16()
    tables = torch.arange(1, 37, dtype=torch.int32).view(4, 9)
    lens = [70, 33, 40, 130]  # decode rows: one token each; prefill: 40 fresh, 60 after 70 cached
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), block_size=block_size, num_decode=2,
                             decode_block_tables=tables[:2], decode_seq_lens=torch.tensor(lens[:2], dtype=torch.int32),
                             prefill=[PrefillRow(2, 42, 40, tables[2, :3]), PrefillRow(42, 102, 130, tables[3])])
    q = torch.randn(102, heads, dim, generator=g).bfloat16()
    with forward_context(meta):
        assert cpu_kernels.prefill_attention_supported(q, attn.kv_cache[0])
        fused = attn(q, None, None)
        monkeypatch.setattr(cpu_kernels, "_PREFILL", False)
        meta._prefill_args = None
        sdpa = attn(q, None, None)
    assert fused.shape == sdpa.shape == (102, heads * dim)
    assert torch.equal(fused[:2], sdpa[:2])  # the decode rows: the same kernel
    assert (fused.float() - sdpa.float()).abs().max().item() < 2e-2  # a bf16 ulp of values below 4


@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 49152])
def test_argmax_rows_is_numpys(n):
    """Greedy sampling's argmax: NumPy's answer on random rows, ties (the first wins, across
    lanes and across vectors), -inf rows, NaN (the first NaN wins) and a row stride past N."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(70, n + 3, generator=g)[:, :n]
    x[1] = 0.0                                      # all tied: index 0
    x[2, n // 2] = x[2, n - 1] = 100.0              # tied maxima: the first
    x[3] = float("-inf")
    x[4, n // 3] = float("nan")
    x[5, -1] = float("nan")
    x[5, 0] = float("inf")
    x[6] = torch.randint(0, 3, (n,), generator=g).float()  # many ties
    got = cpu_kernels.argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, torch.from_numpy(x.numpy().argmax(axis=-1)))
    with pytest.raises(ValueError, match="fp32"):
        cpu_kernels.argmax_rows(x.bfloat16())


def test_compiled_kernels_keep_their_prefetches():
    """GCC 12 once deleted every _mm_prefetch of the streaming kernels (a loop doing only
    __builtin_prefetch is dead code to it), which halved the one-row step's speed unnoticed:
    the binary must hold prefetch instructions in each kernel that streams weights or K/V."""
    import re
    import shutil
    import subprocess

    from rtp.kernels import _cpu_kernels

    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("needs objdump (binutils)")
    listing = subprocess.run([objdump, "-d", "--no-show-raw-insn", _cpu_kernels.__file__], capture_output=True,
                             text=True, check=True).stdout
    counts: dict[str, int] = {}
    function = ""
    for line in listing.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.+)>:$", line)
        if head:
            function = head.group(1)
        elif "prefetcht" in line:
            counts[function] = counts.get(function, 0) + 1
    # each kernel with the functions its loops may live in (tile_pass: the AMX linear's, unless inlined)
    for kernel in (("rtp_linear_q4_1",), ("rtp_linear_q8",), ("rtp_paged_decode_attention_bf16",),
                   ("tile_pass", "rtp_linear_amx")):
        found = sum(n for name, n in counts.items() if name.startswith(kernel))
        assert found > 0, f"{kernel[0]}: no prefetch instruction in {_cpu_kernels.__file__}"


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 17, 64, 65, 300])
@pytest.mark.parametrize("x_fp32", [False, True])
def test_dense_bf16_layers_take_rtps_kernels(rows, x_fp32):
    """A bf16 checkpoint's layer (BlockQuantized.from_dense): the one-row kernel over the weight as it
    lies and AMX over a tile-order copy both multiply exactly its bf16 weights, fp32 sums; rows are
    independent bit for bit on each path; x fp32 (the LM head's input) is rounded to bf16 as read."""
    n, k = 48, 160
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g)
    x = torch.randn(rows, k + 32, generator=g)[:, :k]  # a row stride past K
    x = x if x_fp32 else x.bfloat16()
    ref = x.bfloat16().float() @ weight.float().T + bias
    plain = BlockQuantized.from_dense(weight)
    assert plain.qs.data_ptr() == weight.data_ptr() and plain.takes(1)
    for w in (plain, BlockQuantized.from_dense(weight).with_tile_layout()):
        out = w.linear(x, bias, torch.float32)
        assert out.shape == (rows, n) and (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
        if w.tiles is None or rows == 1:
            alone = torch.cat([w.linear(x[i:i + 1], bias, torch.float32) for i in range(rows)])
            assert torch.equal(out, alone)
        assert torch.equal(w.linear(x, bias, torch.bfloat16), out.bfloat16())
