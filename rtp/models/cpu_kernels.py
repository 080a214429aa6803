"""Torch-facing wrappers of rtp's CPU decode kernels (rtp/csrc/cpu_kernels.c).

Each kernel is a torch custom op, so a `torch.compile`d decode graph calls it
as one opaque node, and eager code calls the same function. The wrappers check
dtypes and contiguity; the C side trusts them. `available()` is False off
x86, on CPUs without AVX-512 BF16, or with RTP_CPU_KERNELS=0 (to measure the
plain PyTorch path), and then nothing here is called.
"""

from __future__ import annotations

import os

import torch

# Up to this many rows a block-quantized linear streams its packed weights through the
# kernel; above it oneDNN's bf16 GEMM (AMX where present) on the dequantized copy wins.
QUANT_MAX_ROWS = 8


def _probe() -> bool:
    if os.environ.get("RTP_CPU_KERNELS", "1") == "0":
        return False
    try:
        from rtp import _cpu_kernels
    except ImportError:
        return False
    return _cpu_kernels.supported()


# Decided once at import: a constant is what torch.compile can trace through.
_AVAILABLE = _probe()


def available() -> bool:
    return _AVAILABLE


def _k():
    from rtp import _cpu_kernels

    return _cpu_kernels


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


@torch.library.custom_op("rtp::linear_q4_1", mutates_args=())
def linear_q4_1(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] bf16 @ Q4_1 weight [N, K].T (+ bias fp32) -> [M, N] in out_dtype."""
    x = x.contiguous()
    rows, k = x.shape
    n = qs.shape[0]
    out = torch.empty(rows, n, dtype=out_dtype)
    xsum = torch.empty(rows, k // 32, dtype=torch.float32)
    _k().linear_q4_1(x.data_ptr(), k, qs.data_ptr(), d.data_ptr(), m.data_ptr(), _ptr(bias),
                     xsum.data_ptr(), out.data_ptr(), n, out_dtype == torch.bfloat16, rows, n, k)
    return out


@linear_q4_1.register_fake
def _(x, qs, d, m, bias, out_dtype):
    return x.new_empty(x.shape[0], qs.shape[0], dtype=out_dtype)


@torch.library.custom_op("rtp::linear_q8_0", mutates_args=())
def linear_q8_0(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] fp32 @ Q8_0 weight [N, K].T (+ bias fp32) -> [M, N] in out_dtype."""
    x = x.contiguous()
    rows, k = x.shape
    n = qs.shape[0]
    out = torch.empty(rows, n, dtype=out_dtype)
    _k().linear_q8_0(x.data_ptr(), k, qs.data_ptr(), d.data_ptr(), _ptr(bias), out.data_ptr(), n,
                     out_dtype == torch.bfloat16, rows, n, k)
    return out


@linear_q8_0.register_fake
def _(x, qs, d, bias, out_dtype):
    return x.new_empty(x.shape[0], qs.shape[0], dtype=out_dtype)


@torch.library.custom_op("rtp::paged_decode_attention", mutates_args=())
def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           window: int) -> torch.Tensor:
    """q [B, H, D] bf16 over k/v_cache [blocks, block_size, Hkv, D] bf16 -> [B, H, D] bf16.
    window 0: no sliding window."""
    q = q.contiguous()
    b, h, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    lens = seq_lens.contiguous()
    out = torch.empty_like(q)
    _k().paged_decode_attention_bf16(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                     k_cache.stride(1), tables.data_ptr(), tables.stride(0),
                                     lens.data_ptr(), out.data_ptr(), b, h, hkv, d, block_size,
                                     scale, window)
    return out


@paged_decode_attention.register_fake
def _(q, k_cache, v_cache, block_tables, seq_lens, scale, window):
    return torch.empty_like(q)


def attention_supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether paged_decode_attention takes these operands."""
    d = q.shape[-1]
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    return (available() and q.device.type == "cpu" and k_cache.dtype == torch.bfloat16
            and d % 16 == 0 and d <= 256 and heads % kv_heads == 0 and heads // kv_heads <= 16
            and k_cache.stride(-1) == 1 and k_cache.stride(-2) == d)
