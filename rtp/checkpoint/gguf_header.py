"""A GGUF file's header -- its metadata and its tensor table -- read in one pass over a memory map.

The format (llama.cpp's gguf.md, versions 2 and 3, little-endian):

    magic "GGUF", version u32, tensor count u64, metadata count u64
    metadata   key (string), value type u32, value; an array is element type u32, count u64, elements
    tensors    name (string), dimension count u32, dimensions u64 each (fastest first), type u32,
               offset u64 from the start of the data
    data       at the first multiple of general.alignment (default 32) after the tensor table

where a string is a u64 byte length and UTF-8 bytes.

rtp reads it itself rather than through the gguf package's GGUFReader, which builds a numpy view
for every part of every field: 2.6-3.2 s for the default model's 49,152 tokens and 48,900 merges,
paid by every process that opens the file (`rtp serve`, each worker, each test server). The same
header read with struct here takes about 0.1 s (tests/checkpoint/test_gguf.py compares the two).
gguf's enums still name the tensor types, and its tables give their block sizes.

`GGUFFile` is a file's metadata (a split file's parts found and opened), for any architecture: what
the tokenizer reads. Like the rest of this module it imports no torch, so a process that needs
only a GGUF's tokenizer (`rtp route`) loads none (rtp/checkpoint/gguf.py builds models from it).
"""

from __future__ import annotations

import functools
import mmap
import re
import struct
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_NUMPY = {UINT8: np.uint8, INT8: np.int8, UINT16: np.uint16, INT16: np.int16, UINT32: np.uint32,
          INT32: np.int32, FLOAT32: np.float32, BOOL: np.uint8, UINT64: np.uint64, INT64: np.int64,
          FLOAT64: np.float64}
_STRUCT = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i", FLOAT32: "<f",
           BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}


def float32_value(v: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips: 1e-05, not 9.9999997e-06."""
    return float(str(np.float32(v)))


@dataclass
class GGUFTensor:
    """One entry of the tensor table; `data` is its bytes in the file's map (no copy)."""

    name: str
    tensor_type: Any            # gguf.GGMLQuantizationType
    shape: np.ndarray           # uint64 dimensions, fastest first (GGUF order)
    n_elements: int
    n_bytes: int
    data_offset: int            # from the start of the file
    _map: Any = field(repr=False, default=None)

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes: typed (dimensions slowest first) for F32, F16, F64 and the integer types,
        else raw uint8 blocks. Raises ValueError past the end of the file."""
        from gguf import GGMLQuantizationType as Q

        typed = {Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64, Q.I8: np.int8, Q.I16: np.int16,
                 Q.I32: np.int32, Q.I64: np.int64}.get(self.tensor_type)
        if typed is None:
            return np.frombuffer(self._map, np.uint8, self.n_bytes, self.data_offset)
        dims = tuple(int(d) for d in reversed(self.shape.tolist()))
        return np.frombuffer(self._map, typed, self.n_elements, self.data_offset).reshape(dims)


class GGUFHeader:
    """fields: every metadata key -> its value (str, int, float, bool, or a list of them; a nested
    array None); tensors: the tensor table in file order of entries. Raises ValueError or
    struct.error on a file that is not a well-formed GGUF (the caller names the file)."""

    def __init__(self, path: str | Path):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._size = len(self._map)
        self._at = 0
        if self._read(4) != MAGIC:
            raise ValueError("GGUF magic invalid")
        version = self._unpack("<I")
        if version & 0xFFFF == 0 and version:
            raise ValueError("a big-endian GGUF file: rtp reads little-endian ones")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version}: rtp reads versions {', '.join(map(str, VERSIONS))}")
        tensor_count, kv_count = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        entries = [self._tensor_entry() for _ in range(tensor_count)]
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r}: not a power of two")
        start = -(-self._at // alignment) * alignment
        self.tensors: list[GGUFTensor] = []
        names: set[str] = set()
        for name, dims, qtype, offset in entries:
            if name in names:
                raise ValueError(f"tensor {name} appears twice")
            names.add(name)
            self.tensors.append(self._tensor(name, dims, qtype, start + offset))

    def _tensor(self, name: str, dims: np.ndarray, qtype: int, offset: int) -> GGUFTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        tensor_type = GGMLQuantizationType(qtype)  # ValueError for a type gguf does not know
        block, type_size = GGML_QUANT_SIZES[tensor_type]
        n = int(np.prod(dims.astype(object))) if len(dims) else 1  # object: no uint64 overflow
        return GGUFTensor(name, tensor_type, dims, n, n * type_size // block, offset, self._map)

    # -- reading ---------------------------------------------------------------------------------

    def _read(self, n: int) -> bytes:
        end = self._at + n
        if n < 0 or end > self._size:
            raise ValueError(f"the header runs past the end of the file ({self._size} bytes) at byte {self._at}")
        out = self._map[self._at:end]
        self._at = end
        return out

    def _unpack(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._map, self._at)
        self._at += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        return self._read(self._unpack("<Q")).decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype == STRING:
            return self._string()
        if vtype == ARRAY:
            return self._array()
        if vtype not in _STRUCT:
            raise ValueError(f"metadata value type {vtype} is not a GGUF type")
        value = self._unpack(_STRUCT[vtype])
        return float32_value(value) if vtype == FLOAT32 else value

    def _array(self) -> list | None:
        etype, count = self._unpack("<I"), self._unpack("<Q")
        if etype == STRING:
            if count > (self._size - self._at) // 8:  # every string takes its 8-byte length at least
                raise ValueError(f"an array of {count} strings does not fit in the file")
            return [self._string() for _ in range(count)]
        if etype == ARRAY:  # nested arrays: no key rtp reads has them; step over them
            for _ in range(count):
                self._array()
            return None
        if etype not in _NUMPY:
            raise ValueError(f"metadata array element type {etype} is not a GGUF type")
        dtype = np.dtype(_NUMPY[etype]).newbyteorder("<")
        values = np.frombuffer(self._read(count * dtype.itemsize), dtype)
        if etype == FLOAT32:
            return [float32_value(v) for v in values]
        if etype == BOOL:
            return [bool(v) for v in values]
        return values.tolist()

    def _tensor_entry(self) -> tuple[str, np.ndarray, int, int]:
        name = self._string()
        n_dims = self._unpack("<I")
        dims = np.frombuffer(self._read(8 * n_dims), np.dtype("<u8")).copy()
        return name, dims, self._unpack("<I"), self._unpack("<Q")


class GGUFError(ValueError):
    """A file that is not a readable GGUF checkpoint of a supported model."""


@functools.lru_cache(maxsize=8)
def _read(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    """The header of one file version (size and mtime in the key): a start opens the file twice (the
    loader, then the tokenizer), and the last files read (a split GGUF's parts) stay memory-mapped."""
    return GGUFHeader(path)


_SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$")


def _open(path: Path):
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (starts with {magic!r}, not {MAGIC!r})")
    stat = path.stat()
    try:
        return _read(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    except Exception as e:  # the header's reading raises ValueError/struct.error/KeyError on damage
        raise GGUFError(f"{path}: cannot parse GGUF: {e}") from e


class GGUFFile:
    """A GGUF file's metadata, for any architecture (the tokenizer only needs this)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        if not self.path.is_file():
            raise GGUFError(f"{self.path} is not a file (expected a .gguf checkpoint)")
        self.header = _open(self.path)
        # a split GGUF (llama.cpp's gguf-split: NAME-00001-of-0000N.gguf): the metadata is the first
        # part's, the tensors are spread over all N, each part a file of its own
        self.parts: list[tuple[Path, GGUFHeader]] = [(self.path, self.header)]
        count = int(self.get("split.count", 1) or 1)
        if count > 1:
            split = _SPLIT_NAME.match(self.path.name)
            if split is None or int(split["part"]) != 1:
                raise GGUFError(f"{self.path} is part of a split GGUF of {count} files: load its first part "
                                "(NAME-00001-of-0000N.gguf)")
            for k in range(2, count + 1):
                part = self.path.with_name(f"{split['stem']}-{k:05d}-of-{split['count']}.gguf")
                if not part.is_file():
                    raise GGUFError(f"{self.path}: part {k} of {count} of this split GGUF is missing ({part})")
                self.parts.append((part, _open(part)))

    def all_tensors(self) -> list[tuple[Path, GGUFTensor]]:
        """(file, tensor) of every tensor, part by part, each part's in data-offset order."""
        return [(path, t) for path, header in self.parts for t in sorted(header.tensors, key=lambda t: t.data_offset)]

    def get(self, key: str, default: Any = None) -> Any:
        """One metadata value by its GGUF key (e.g. 'llama.block_count')."""
        return self.header.fields.get(key, default)

    def keys(self) -> list[str]:
        return list(self.header.fields)

    @cached_property
    def architecture(self) -> str:
        arch = self.get("general.architecture")
        if arch is None:
            raise GGUFError(f"{self.path} has no general.architecture in its metadata")
        return arch

    @property
    def chat_template(self) -> str | None:
        return self.get("tokenizer.chat_template")

    @cached_property
    def tokenizer_metadata(self) -> dict[str, Any]:
        """The `tokenizer.ggml.*` fields, without the prefix (tokens, merges, token_type, pre, ...),
        plus `chat_template`. Ids absent from the file are absent here."""
        prefix = "tokenizer.ggml."
        meta = {k[len(prefix):]: v for k, v in self.header.fields.items() if k.startswith(prefix)}
        meta["chat_template"] = self.chat_template
        return meta
