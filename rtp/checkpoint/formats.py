"""The checkpoint formats rtp opens: a Hugging Face directory or a GGUF file.

A checkpoint is a Hugging Face directory (config.json + *.safetensors, maybe an
index) or a GGUF file. Both are described the same way (rtp/checkpoint/records.py):
a config dict, and one `TensorRecord` per tensor, in (file, offset) order, the
order `stream_tensors` reads them in (rtp/checkpoint/reader.py). `open_checkpoint`
reads and validates the headers; nothing else is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rtp.checkpoint.multimodal import text_config, text_records, wrapper_of
from rtp.checkpoint.records import CheckpointError, TensorRecord, is_gguf

if TYPE_CHECKING:
    from rtp.checkpoint.gguf import GGUFCheckpoint


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    config: dict                  # config.json, or the GGUF metadata turned into one
    records: list[TensorRecord]   # (file, offset) order
    gguf: GGUFCheckpoint | None = None  # the parsed GGUF (its metadata is slow to parse: once)


def open_checkpoint(path: Path) -> Checkpoint:
    """A checkpoint directory or GGUF file, its headers read and validated, no weights read."""
    if is_gguf(path):
        from rtp.checkpoint.gguf import GGUFCheckpoint

        gguf = GGUFCheckpoint(path)
        return Checkpoint(path, gguf.config, gguf.records(), gguf)
    from rtp.checkpoint.safetensors_format import directory_records

    config = path / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{path} has no config.json (expected a Hugging Face checkpoint "
                              f"directory or a .gguf file)")
    try:
        with open(config) as f:
            hf = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config} is not valid JSON: {e}") from e
    records = directory_records(path)
    wrapper = wrapper_of(hf)
    if wrapper is not None:  # a multimodal checkpoint: its language model (rtp/checkpoint/multimodal.py)
        records = text_records(records, wrapper)
        has_head = any(r.name == "lm_head.weight" for r in records)
        return Checkpoint(path, text_config(hf, wrapper, has_head=has_head), records)
    return Checkpoint(path, hf, records)
