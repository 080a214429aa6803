"""The avx2 path's linears (rtp/kernels/csrc/avx2/linear.c), run on any CPU with rtp's kernels (a higher path
selects them through cpu_kernels.on_isa): every weight kind against x @ dequantize(W).T, and a row's bits
the same whatever the batch, its place in it and the thread count (the determinism the engine promises)."""

from __future__ import annotations

import pytest
import torch

from rtp.kernels import cpu_kernels
from rtp.kernels.quant import BlockQuantized

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs rtp's CPU kernels (AVX2 or more)")


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> BlockQuantized:
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(n, k // (16 if kind == "q8_16" else 32), generator=g) * 0.02 + 0.001
    m = torch.randn(n, k // 32, generator=g) * 0.05
    if kind == "q4_1":
        return BlockQuantized(kind, torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g), d, m)
    if kind == "bf16":
        return BlockQuantized.from_dense(torch.randn(n, k, generator=g).bfloat16())
    low, high = {"q8_0": (-128, 128), "q8_1": (0, 32), "q8_16": (-32, 32)}[kind]
    qs = torch.randint(low, high, (n, k), dtype=torch.int8, generator=g)
    return BlockQuantized(kind, qs, d, m if kind == "q8_1" else None)


def int_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as linear_int8.c takes it: each 32 values scaled by 16256 / their largest magnitude, rounded to
    nearest even (15 bits), and scaled back (fp32)."""
    v = x.float().view(x.shape[0], -1, 32)
    top = v.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, torch.tensor(16256.0) / top, torch.tensor(0.0))
    return (torch.round(v * inv) * (top / 16256.0)).view_as(x.float())


def run(w: BlockQuantized, x: torch.Tensor, bias, out_dtype) -> torch.Tensor:
    with cpu_kernels.on_isa("avx2"):
        return w.linear(x, bias, out_dtype)


KINDS = ["q4_1", "q8_0", "q8_1", "q8_16", "bf16"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 70, 131])  # 70, 131: past a chunk of 64 rows
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_avx2_linear_matches_dequantized_weights(kind, rows, x_dtype):
    n, k = 37, 160  # partial tiles of weight rows; five blocks a row
    w = random_blocks(kind, n, k, seed=rows)
    b = torch.randn(n)
    x = torch.randn(rows, k).to(x_dtype)
    # dense bf16 weights multiply x rounded to bf16; the block kinds x's 15-bit blocks (Q4_1 takes x in bf16)
    xr = x.bfloat16().float() if kind in ("bf16", "q4_1") else x.float()
    ref = (xr.double() if kind == "bf16" else int_blocks(xr).double()) @ w.dequantize().double().T + b.double()
    for out_dtype in (torch.float32, torch.bfloat16):
        out = run(w, x, b, out_dtype)
        assert out.dtype == out_dtype and out.shape == (rows, n)
        scale = ref.abs().max().item()
        tol = 1e-5 * scale if out_dtype == torch.float32 else 2.0**-8 * scale
        assert (out.float() - ref).abs().max().item() <= tol


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "bf16"])
def test_avx2_linear_gives_a_row_the_same_bits_whatever_the_batch(kind):
    n, k = 45, 256
    w = random_blocks(kind, n, k)
    x = torch.randn(300, k).bfloat16()
    batch = run(w, x, None, torch.float32)
    for size in (1, 2, 3, 4, 7, 64, 65, 299):
        for start in {0, 1, 300 - size}:
            assert torch.equal(run(w, x[start:start + size], None, torch.float32), batch[start:start + size])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = run(w, x, None, torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, batch)


def test_avx2_linear_reads_a_strided_row_slice():
    w = random_blocks("q4_1", 32, 96)
    wide = torch.randn(5, 160).bfloat16()
    x = wide[:, 32:128]  # rows strided past the width
    assert torch.equal(run(w, x, None, torch.float32), run(w, x.contiguous(), None, torch.float32))


def test_avx2_linear_keeps_its_speed_on_rows_of_tiny_values():
    """A block of x whose values all lie below 2e-34 has a denormal scale: with denormals not flushed, every
    vector operation on it took a microcode assist (a 1024 x 2816 Q4_1 product: 3.4 ms against 69 us). The
    kernel flushes them (FTZ and DAZ, in each thread), so such rows cost what others do; their products are 0."""
    import time

    w = random_blocks("q4_1", 1024, 2816)
    normal = torch.randn(1, 2816).bfloat16()
    tiny = (torch.randn(1, 2816) * 1e-36).bfloat16()

    def best(x):
        run(w, x, None, torch.float32)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            run(w, x, None, torch.float32)
            times.append(time.perf_counter() - start)
        return min(times)

    assert best(tiny) < 5 * best(normal)
    assert run(w, tiny, None, torch.float32).abs().max().item() < 1e-30
