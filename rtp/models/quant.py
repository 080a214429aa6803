"""Block-quantized weights kept in the checkpoint's own format for small-batch decode.

A GGUF checkpoint stores most matrices as Q4_1 or Q8_0 blocks of 32 weights. The
model is built with dequantized weights (exact in fp32, rounded to bf16), which
oneDNN multiplies fast for prefill and large batches. A decode step at a small
batch is instead bound by reading the weights, so the linear layers also keep the
packed blocks (a third to a half of bf16's bytes) and multiply them directly with
rtp's CPU kernels: fewer bytes, and the checkpoint's exact weights.

Packed layout (per matrix of N rows by K columns, K a multiple of 32):
  q4_1: qs uint8 [N, K/2], d fp32 [N, K/32], m fp32 [N, K/32]   (w = d * q + m)
  q8_0: qs int8  [N, K],   d fp32 [N, K/32]                      (w = d * q)
(d and m are the file's fp16 values widened: more bytes, but the kernels are bound by
shuffle work per block, which fp16 scales would add to.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rtp.models import cpu_kernels

BLOCK = 32
_BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}  # GGUF bytes per block of 32 weights


@dataclass
class BlockQuantized:
    kind: str                   # "q4_1" or "q8_0"
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None      # q4_1 only

    @property
    def shape(self) -> tuple[int, int]:
        per_byte = 2 if self.kind == "q4_1" else 1
        return self.qs.shape[0], self.qs.shape[1] * per_byte

    @classmethod
    def from_gguf(cls, kind: str, raw: np.ndarray, rows: int) -> "BlockQuantized":
        """Repack a GGUF tensor's raw blocks (any shape, row-major, `rows` rows)."""
        b = np.asarray(raw, dtype=np.uint8).reshape(rows, -1, _BLOCK_BYTES[kind])
        d = torch.from_numpy(np.ascontiguousarray(b[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float32))
        if kind == "q4_1":
            m = torch.from_numpy(np.ascontiguousarray(b[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32))
            qs = torch.from_numpy(np.ascontiguousarray(b[:, :, 4:]).reshape(rows, -1))
            return cls(kind, qs, d, m)
        qs = torch.from_numpy(np.ascontiguousarray(b[:, :, 2:]).reshape(rows, -1).view(np.int8))
        return cls(kind, qs, d, None)

    def rows(self, index: torch.Tensor | slice) -> "BlockQuantized":
        """A row subset or permutation (rows are independent: blocks never span two)."""
        def pick(t: torch.Tensor) -> torch.Tensor:
            return t[index].contiguous()

        return BlockQuantized(self.kind, pick(self.qs), pick(self.d), None if self.m is None else pick(self.m))

    @staticmethod
    def cat(parts: list["BlockQuantized"]) -> "BlockQuantized | None":
        """Stack parts row-wise (fused qkv / gate_up); None unless all share one kind."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            return None
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])
        return BlockQuantized(parts[0].kind, torch.cat([p.qs for p in parts]),
                              torch.cat([p.d for p in parts]), m)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weights [N, K] (for tests and checks)."""
        n, k = self.shape
        if self.kind == "q4_1":
            q = torch.stack([self.qs & 15, self.qs >> 4], dim=-1)  # byte j: weights j and j + 16
            q = q.view(n, k // BLOCK, BLOCK // 2, 2).transpose(2, 3).reshape(n, k // BLOCK, BLOCK)
            w = q.float() * self.d[..., None] + self.m[..., None]
        else:
            w = self.qs.view(n, k // BLOCK, BLOCK).float() * self.d[..., None]
        return w.reshape(n, k)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        b = None if bias is None else bias.float()
        if self.kind == "q4_1":
            return cpu_kernels.linear_q4_1(x.to(torch.bfloat16), self.qs, self.d, self.m, b, out_dtype)
        return cpu_kernels.linear_q8_0(x.float(), self.qs, self.d, b, out_dtype)
