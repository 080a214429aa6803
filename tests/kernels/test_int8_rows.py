"""--activation-dtype int8: Q4_1 and Q8_0 linear layers multiply x's rows quantized to int8 per 32 values
(rtp/kernels/csrc/vnni_gemm.c), on a CPU with AVX-512 VNNI and no AMX; int8-prefill: only a step's
prompt rows, its decode rows (the first) staying bf16, in eager calls and in a step graph's replays."""
import pytest
import torch

from rtp.kernels import cpu_kernels, quant
from rtp.kernels.cpu_graph import capture
from rtp.kernels.quant import TILE_KIND, TILE_KIND_INT8_ROWS, BlockQuantized

pytestmark = pytest.mark.skipif(not cpu_kernels.tiles_available() or not cpu_kernels.int8_rows_available(),
                                reason="needs AVX-512 VNNI and no AMX")


def q4_1_blocks(n: int, k: int, seed: int = 0) -> BlockQuantized:
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(n, k // 32, generator=g) * 0.02 + 0.001
    qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    return BlockQuantized("q4_1", qs, d, torch.randn(n, k // 32, generator=g) * 0.05)


def q8_0_blocks(n: int, k: int, seed: int = 0) -> BlockQuantized:
    """Every int8 value, -128 and 127 included (the operand's + 128 must not wrap)."""
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(n, k // 32, generator=g) * 0.002 + 0.0001
    return BlockQuantized("q8_0", torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g), d, None)


BLOCKS = {"q4_1": q4_1_blocks, "q8_0": q8_0_blocks}


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x's rows as the kernel reads them: per block of 32, round(x * 127 / absmax) * absmax / 127 (fp32)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    # torch.full_like(...) / amax, not 127.0 / amax: torch computes the latter as 127 * (1 / amax), rounded twice
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127.0)).reshape(x.shape)


def linear(x, w, b, dtype, glu=False):
    n = w.tiles.shape[0] * 16
    out = torch.empty(x.shape[0], n // 2 if glu else n, dtype=dtype)
    return cpu_kernels.linear_tiles_into(x, TILE_KIND_INT8_ROWS[w.kind], w.tiles, b, out, glu, amx=False)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 64, 100])
@pytest.mark.parametrize("x_fp32", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_rows_are_the_rows_quantized_times_the_blocks(kind, rows, x_fp32, bias):
    """The product is exact but for fp32 sums: the quantized rows times the dequantized weights."""
    n, k = 48, 32 * 7
    w = BLOCKS[kind](n, k).with_tile_layout()
    b = torch.randn(n) if bias else None
    x = torch.randn(rows, k) * torch.linspace(0.1, 4.0, k)  # blocks of different scales
    x = x if x_fp32 else x.bfloat16()
    want = int8_rows(x).double() @ w.dequantize().double().T + (b.double() if bias else 0)
    got = linear(x, w, b, torch.float32)
    assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    # and near the bf16 product: int8 rows lose at most half a step of 1/127 of each block's largest value
    exact = x.double() @ w.dequantize().double().T + (b.double() if bias else 0)
    assert (got.double() - exact).abs().max().item() <= 2e-2 * exact.abs().max().item()


@pytest.mark.parametrize("kind, glu", [("q4_1", False), ("q4_1", True), ("q8_0", False)])
def test_int8_rows_give_a_row_the_same_bits_whatever_the_batch(kind, glu):
    """Each row is quantized on its own and summed in one order: a row alone, in a decode step of a few
    and in a prompt chunk gets one answer (what speculative verification relies on)."""
    w = BLOCKS[kind](64, 32 * 11).with_tile_layout(glu=glu)
    x = torch.randn(64, 32 * 11).bfloat16()
    dtype = torch.bfloat16 if glu else torch.float32
    every = linear(x, w, None, dtype, glu=glu)
    for rows in (1, 2, 3, 5, 8, 9, 21):
        assert torch.equal(linear(x[:rows], w, None, dtype, glu=glu), every[:rows]), (glu, rows)
    assert torch.equal(linear(x[16:21], w, None, dtype, glu=glu), every[16:21])


def test_int8_rows_mlp_is_silu_gate_times_up():
    """The gate and up tiles of an MLP (glu) take the same int8 rows; silu(gate) * up as the bf16 kernels
    round it."""
    i, k = 64, 32 * 6
    gate, up = q4_1_blocks(i, k, seed=1), q4_1_blocks(i, k, seed=2)
    both = BlockQuantized("q4_1", torch.cat([gate.qs, up.qs]), torch.cat([gate.d, up.d]), torch.cat([gate.m, up.m]))
    w = both.with_tile_layout(glu=True)
    x = torch.randn(20, k).bfloat16()
    xq = int8_rows(x).double()
    g = (xq @ gate.dequantize().double().T).bfloat16().double()
    u = (xq @ up.dequantize().double().T).bfloat16().double()
    want = torch.nn.functional.silu(g) * u
    got = linear(x, w, None, torch.bfloat16, glu=True).double()
    assert (got - want).abs().max().item() <= 2e-2 * want.abs().max().item()


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_zero_rows_give_the_bias(kind):
    """A block of zeros has no scale (absmax 0): it adds nothing, no NaN."""
    w = BLOCKS[kind](32, 64).with_tile_layout()
    b = torch.randn(32)
    got = linear(torch.zeros(3, 64).bfloat16(), w, b, torch.float32)
    assert torch.equal(got, b.expand(3, 32))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_the_blocks_tile_kind_follows_the_flag(kind):
    w = BLOCKS[kind](32, 64).with_tile_layout()
    x = torch.randn(4, 64).bfloat16()
    bf16 = w.linear(x, None, torch.float32)
    w.int8_rows = "all"
    assert w.tile_kind == TILE_KIND_INT8_ROWS[kind]
    assert torch.equal(w.linear(x, None, torch.float32), linear(x, w, None, torch.float32))
    assert not torch.equal(w.linear(x, None, torch.float32), bf16)


def tiles(x, w, kind, dtype, glu=False, bf16_rows=0):
    n = w.tiles.shape[0] * 16
    out = torch.empty(x.shape[0], n // 2 if glu else n, dtype=dtype)
    return cpu_kernels.linear_tiles_into(x, kind, w.tiles, None, out, glu, amx=False, bf16_rows=bf16_rows)


@pytest.mark.parametrize("kind, glu", [("q4_1", False), ("q4_1", True), ("q8_0", False)])
@pytest.mark.parametrize("rows", [2, 9, 40])
def test_the_first_bf16_rows_of_a_call_are_multiplied_in_bf16(kind, glu, rows):
    """One call: rows before bf16_rows in bf16, the rest as int8 rows, each with the bits it gets in a
    call of its own kind (rows are independent in both kernels), wherever the split falls."""
    w = BLOCKS[kind](64, 32 * 11).with_tile_layout(glu=glu)
    x = torch.randn(rows, 32 * 11).bfloat16()
    dtype = torch.bfloat16 if glu else torch.float32
    bf16 = tiles(x, w, TILE_KIND[kind], dtype, glu)
    int8 = tiles(x, w, TILE_KIND_INT8_ROWS[kind], dtype, glu)
    assert not torch.equal(bf16, int8)
    for p in sorted({0, 1, rows // 2, rows - 1, rows, rows + 5}):
        got = tiles(x, w, TILE_KIND_INT8_ROWS[kind], dtype, glu, bf16_rows=p)
        assert torch.equal(got[:p], bf16[:p]) and torch.equal(got[p:], int8[p:]), p


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_int8_prefill_layers_take_int8_for_the_prompt_rows_only(kind):
    """BlockQuantized.int8_rows "prefill": the rows quant.decode_rows names (a step's first) stay bf16; a
    batch of decode rows only is the plain bf16 call; a prompt chunk alone is all int8."""
    w = BLOCKS[kind](32, 64).with_tile_layout()
    x = torch.randn(6, 64).bfloat16()
    bf16 = w.linear(x, None, torch.float32)
    w.int8_rows = "all"
    int8 = w.linear(x, None, torch.float32)
    w.int8_rows = "prefill"
    with quant.decode_rows(2):
        got = w.linear(x, None, torch.float32)
    assert torch.equal(got[:2], bf16[:2]) and torch.equal(got[2:], int8[2:])
    with quant.decode_rows(6):
        assert torch.equal(w.linear(x, None, torch.float32), bf16)
    assert torch.equal(w.linear(x, None, torch.float32), int8)


def test_a_step_graph_keeps_each_steps_decode_rows_bf16():
    """A step graph captured with one decode row replays steps of any split: the replay puts the step's
    decode rows in every int8-prefill call (kernel_calls.c), as an eager call over that step would."""
    w = BLOCKS["q4_1"](64, 32 * 6).with_tile_layout(glu=True)
    x = torch.randn(24, 32 * 6).bfloat16()
    w.int8_rows = "prefill"
    with quant.decode_rows(1):
        graph = capture(lambda: w.silu_mul(x, None), 24, samples=lambda hidden: hidden)
    bf16 = tiles(x, w, TILE_KIND["q4_1"], torch.bfloat16, glu=True)
    int8 = tiles(x, w, TILE_KIND_INT8_ROWS["q4_1"], torch.bfloat16, glu=True)
    for tokens, decode in [(24, 1), (24, 0), (24, 7), (10, 3), (5, 5)]:
        got = graph.replay_step(tokens, tokens, decode, tokens - decode)
        assert torch.equal(got[:decode], bf16[:decode]), (tokens, decode)
        assert torch.equal(got[decode:tokens], int8[decode:tokens]), (tokens, decode)
