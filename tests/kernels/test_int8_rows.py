"""--activation-dtype int8: Q4_1 and Q8_0 linear layers multiply x's rows quantized to int8 per 32 values
(rtp/kernels/csrc/vnni_gemm.c), on a CPU with AVX-512 VNNI and no AMX."""
import pytest
import torch

from rtp.kernels import cpu_kernels
from rtp.kernels.quant import TILE_KIND_INT8_ROWS, BlockQuantized

pytestmark = pytest.mark.skipif(not cpu_kernels.available() or not cpu_kernels.int8_rows_available(),
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
    w.int8_rows = True
    assert w.tile_kind == TILE_KIND_INT8_ROWS[kind]
    assert torch.equal(w.linear(x, None, torch.float32), linear(x, w, None, torch.float32))
    assert not torch.equal(w.linear(x, None, torch.float32), bf16)
