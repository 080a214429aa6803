"""What a checkpoint holds, known before a byte of its weights is read.

A checkpoint is a Hugging Face directory (config.json + *.safetensors, maybe an
index) or a GGUF file. Both are described the same way: a config dict, and one
`TensorRecord` per tensor saying where its bytes lie (a file, [begin, end)), what
they become (name, shape, dtype) and how (`decode`: a reinterpretation for
safetensors, a dequantization for GGUF). Records come in (file, offset) order,
the order `stream_tensors` reads them in (rtp/engine/sequential_reader.py).
`open_checkpoint` reads and validates the headers; nothing else is read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rtp.engine.gguf import GGUFCheckpoint


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


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    config: dict                  # config.json, or the GGUF metadata turned into one
    records: list[TensorRecord]   # (file, offset) order
    gguf: GGUFCheckpoint | None = None  # the parsed GGUF (its metadata is slow to parse: once)


def open_checkpoint(path: Path) -> Checkpoint:
    """A checkpoint directory or GGUF file, its headers read and validated, no weights read."""
    if is_gguf(path):
        from rtp.engine.gguf import GGUFCheckpoint

        gguf = GGUFCheckpoint(path)
        return Checkpoint(path, gguf.config, gguf.records(), gguf)
    from rtp.engine.safetensors_format import directory_records

    config = path / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{path} has no config.json (expected a Hugging Face checkpoint "
                              f"directory or a .gguf file)")
    try:
        with open(config) as f:
            return Checkpoint(path, json.load(f), directory_records(path))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config} is not valid JSON: {e}") from e


def stream_tensors(records: Sequence[TensorRecord], *, chunk_bytes: int | None = None,
                   direct: bool | None = None, device: torch.device | None = None,
                   progress: Callable[[int], None] | None = None) -> Iterator[tuple[TensorRecord, torch.Tensor]]:
    """(record, decoded CPU tensor) for every record, read in file order.

    A tensor may alias a reader buffer: it is valid until the next one is taken, so
    copy out of it. A read that fails raises CheckpointError naming the file and the
    tensor. `device` only pins the buffers and fences their reuse (CUDA); the
    tensors stay on the CPU. Other options: SequentialReader.
    """
    from rtp.engine.sequential_reader import DEFAULT_CHUNK_BYTES, ReadFailed, SequentialReader

    reader = SequentialReader(records, chunk_bytes=chunk_bytes or DEFAULT_CHUNK_BYTES, direct=direct,
                              device=device, progress=progress)
    with reader:
        try:
            for index, raw in reader:
                record = records[index]
                yield record, record.decode(raw)
        except ReadFailed as e:
            record = records[e.index]
            raise CheckpointError(f"{record.path}: cannot read tensor {record.name}: {e}") from e
