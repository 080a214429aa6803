"""What a checkpoint holds, known before a byte of its weights is read: one record per tensor.

A `TensorRecord` says where a tensor's bytes lie (a file, [begin, end)), what they
become (name, shape, dtype) and how (`decode`: a reinterpretation for safetensors,
a dequantization for GGUF). Every format module describes its files in these, and
everything that reads them (reader, loader, convert) takes them; so this module
imports nothing of rtp.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint that cannot be served: missing, malformed, or not matching its config."""


@dataclass(frozen=True, slots=True)
class TensorRecord:
    name: str                # Hugging Face name
    path: Path               # the file holding its bytes
    begin: int               # absolute file offsets of its bytes
    end: int
    shape: tuple[int, ...]   # after decode
    dtype: torch.dtype       # after decode
    decode: Callable[[torch.Tensor], torch.Tensor]  # raw uint8 CPU bytes -> tensor (may alias them)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf"
