"""The avx512 path's linears (rtp/kernels/csrc/avx512/linear_lanes.c: weights in lane order, x's rows as 15-bit
integer blocks, AVX-512 VNNI), run on any CPU with AVX-512 VNNI (a higher path selects them through
cpu_kernels.on_isa): every block kind against x's integer blocks @ dequantize(W).T, and a row's bits the same
whatever the batch, its place in it and the thread count (the determinism the engine promises)."""

from __future__ import annotations

import pytest
import torch
from test_avx2_linear import int_blocks, random_blocks

from rtp.kernels import cpu_kernels
from rtp.kernels.quant import TILE_KIND

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available() or "avx512" not in cpu_kernels.paths_here() or not cpu_kernels._k.vnni_supported(),
    reason="needs a CPU with AVX-512 VNNI")

KINDS = ["q4_1", "q8_0", "q8_1", "q8_16"]


def run(w, lanes, x, bias, out_dtype) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.shape[0], dtype=out_dtype)
    with cpu_kernels.on_isa("avx512"):
        return cpu_kernels.linear_lanes_into(x, TILE_KIND[w.kind], lanes, bias, out)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 70, 131])  # 70, 131: past a chunk of 64 rows
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_lane_linear_matches_dequantized_weights(kind, rows, x_dtype):
    n, k = 48, 160  # three record columns; five blocks a row
    w = random_blocks(kind, n, k, seed=rows)
    lanes = w.lane_layout()
    b = torch.randn(n)
    x = torch.randn(rows, k).to(x_dtype)
    xr = x.bfloat16().float() if kind == "q4_1" else x.float()  # Q4_1's entry point takes x in bf16
    if kind == "q4_1":
        x = x.bfloat16()
    ref = int_blocks(xr).double() @ w.dequantize().double().T + b.double()
    for out_dtype in (torch.float32, torch.bfloat16):
        out = run(w, lanes, x, b, out_dtype)
        scale = ref.abs().max().item()
        tol = 1e-5 * scale if out_dtype == torch.float32 else 2.0**-8 * scale
        assert (out.float() - ref).abs().max().item() <= tol, kind
    # bf16 outputs are the fp32 ones rounded once
    assert torch.equal(run(w, lanes, x, b, torch.bfloat16), run(w, lanes, x, b, torch.float32).bfloat16())


@pytest.mark.parametrize("kind", KINDS)
def test_lane_linear_gives_a_row_the_same_bits_whatever_the_batch(kind):
    n, k = 64, 256
    w = random_blocks(kind, n, k)
    lanes = w.lane_layout()
    x = torch.randn(300, k).bfloat16()
    batch = run(w, lanes, x, None, torch.float32)
    for size in (1, 2, 3, 4, 5, 7, 64, 65, 299):
        for start in {0, 1, 300 - size}:
            assert torch.equal(run(w, lanes, x[start:start + size], None, torch.float32), batch[start:start + size])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = run(w, lanes, x, None, torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, batch)
