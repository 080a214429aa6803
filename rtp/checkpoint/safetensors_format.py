"""The safetensors format, read and written by rtp itself.

    [u64 little-endian N][N bytes of JSON header][data]
    header: {"<name>": {"dtype": "BF16", "shape": [4096, 4096], "data_offsets": [begin, end]},
             ..., "__metadata__": {"format": "pt"}}

Offsets are relative to the first data byte. rtp reads the header itself (the
reader then streams the data in file order) and trusts nothing in it: the
length must fit the file, the JSON must parse, every dtype must be known, every
tensor's bytes must match its shape and lie inside the file, and no two tensors
may overlap. A directory's shards are the ones its model.safetensors.index.json
names (or every *.safetensors when there is none), and the index must agree with
the shards' headers. Any failure is a CheckpointError naming the file and tensor.

`SafetensorsWriter` writes a file in a given tensor order, each tensor as it
arrives (the header is computed up front from shapes and dtypes).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import torch

from rtp.checkpoint.records import CheckpointError, TensorRecord

INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _reinterpret(raw: torch.Tensor, *, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The file's bytes as a tensor, without a copy where they are aligned for the dtype."""
    if raw.storage_offset() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype).view(shape)


def _entry(path: Path, name: str, value, data_start: int, file_size: int) -> TensorRecord:
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: tensor {name}: {why}")

    if not isinstance(value, dict):
        raise bad(f"header entry is {type(value).__name__}, not an object")
    dtype = DTYPES.get(value.get("dtype"))
    if dtype is None:
        raise bad(f"unknown dtype {value.get('dtype')!r} (known: {', '.join(DTYPES)})")
    shape, offsets = value.get("shape"), value.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"shape {shape!r} is not a list of sizes")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise bad(f"data_offsets {offsets!r} are not [begin, end] with 0 <= begin <= end")
    begin, end = data_start + offsets[0], data_start + offsets[1]
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise bad(f"{value['dtype']} {shape} needs {expected} bytes, its data_offsets span {end - begin}")
    if end > file_size:
        raise bad(f"data [{begin}, {end}) overruns the file ({file_size} bytes): truncated or corrupt")
    return TensorRecord(name, path, begin, end, tuple(shape), dtype,
                        functools.partial(_reinterpret, dtype=dtype, shape=tuple(shape)))


def read_header(path: Path) -> list[TensorRecord]:
    """The tensors of one safetensors file, validated, in offset order."""
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: {file_size} bytes, too short for a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES or 8 + length > file_size:
            raise CheckpointError(f"{path}: header length {length} does not fit the file ({file_size} bytes): "
                                  f"truncated, or not a safetensors file")
        text = f.read(length)
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is a JSON {type(header).__name__}, not an object")
    data_start = 8 + length
    records = sorted((_entry(path, name, value, data_start, file_size)
                      for name, value in header.items() if name != "__metadata__"),
                     key=lambda r: (r.begin, r.end))
    for prev, cur in itertools.pairwise(records):
        if cur.begin < prev.end:
            raise CheckpointError(f"{path}: tensors {prev.name} and {cur.name} overlap "
                                  f"([{prev.begin}, {prev.end}) and [{cur.begin}, {cur.end}))")
    return records


def shard_files(directory: Path) -> tuple[list[Path], dict[str, str]]:
    """The shards to read (index order, else name order) and the index's tensor -> file map."""
    index = directory / INDEX_FILE
    if not index.is_file():
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{directory} has no *.safetensors files")
        return files, {}
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not an object of file names")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a readable index ({type(e).__name__}: {e})") from e
    files = [directory / name for name in sorted(set(weight_map.values()))]
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{index} places tensors in {file.name}, which is missing")
    return files, weight_map


def directory_records(directory: Path) -> list[TensorRecord]:
    """Every tensor of a checkpoint directory's shards, validated, in (file, offset) order."""
    files, weight_map = shard_files(directory)
    records: list[TensorRecord] = []
    where: dict[str, Path] = {}
    for file in files:
        for record in read_header(file):
            if record.name in where:
                raise CheckpointError(f"{file}: tensor {record.name} is also in {where[record.name]}")
            where[record.name] = file
            records.append(record)
    for name, file_name in weight_map.items():
        if where.get(name, Path()).name != file_name:
            raise CheckpointError(f"{directory / file_name}: lacks tensor {name}, which {INDEX_FILE} "
                                  f"places there")
    return records


def write_index(directory: Path, placement: dict[str, str], total_bytes: int) -> None:
    index = {"metadata": {"total_size": total_bytes}, "weight_map": placement}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


class SafetensorsWriter:
    """Writes one safetensors file: its header at once, then each tensor as it arrives.

    `layout` is (name, shape, dtype) in file order. `write` takes tensors in any order,
    each into its own place; `close` syncs the file to disk.
    """

    def __init__(self, path: Path, layout: Sequence[tuple[str, tuple[int, ...], torch.dtype]]):
        self.path = path
        header: dict = {"__metadata__": {"format": "pt"}}
        self.slots: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, shape, dtype in layout:
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self.slots[name] = (offset, size)
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.data_start = 8 + len(text)
        self.nbytes = self.data_start + offset
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self.fd, self.nbytes)
        self._pwrite(struct.pack("<Q", len(text)) + text, 0)

    def _pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = os.pwrite(self.fd, view, offset)
            view, offset = view[n:], offset + n

    def write(self, name: str, tensor: torch.Tensor) -> None:
        offset, size = self.slots[name]
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        if data.numel() != size:
            raise ValueError(f"{self.path}: {name} has {data.numel()} bytes, its slot {size}")
        self._pwrite(data.numpy(), self.data_start + offset)

    def close(self, sync: bool = True) -> None:
        try:
            if sync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
