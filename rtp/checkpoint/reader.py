"""Byte spans of files, read front to back at the drive's sequential speed.

The caller lists spans (a file, [begin, end)) in (file, offset) order, one per
tensor. A dedicated reader thread turns them into large sequential reads and
fills two aligned buffers in turn, while the consumer takes tensors out of the
other one:

    reader thread   fill A | fill B | fill A | ...      (waits for a buffer to come back)
    consumer               | use A  | use B  | ...      (gives A back when done with it)

`plan_reads` groups consecutive spans of a file into reads of at most
`chunk_bytes`; a span longer than that is cut into chunk-sized pieces, which the
consumer assembles into one tensor of the span's size. Reads start and end on
`ALIGN` boundaries so that they can go through O_DIRECT (no page-cache copy, no
page-cache pollution); the few bytes the rounding adds are read twice.

O_DIRECT is used unless the file already looks cached (a page-cache hit is memory
speed, a direct read is disk speed) or the filesystem refuses it (EINVAL, e.g.
tmpfs): then reads are buffered, with POSIX_FADV_SEQUENTIAL. On CUDA the
buffers are pinned and a buffer is refilled only after the copies enqueued from
it have run (a CUDA event recorded when the consumer gives it back).
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Self

import torch

from rtp.checkpoint.records import CheckpointError, TensorRecord

log = logging.getLogger("rtp.reader")

ALIGN = 4096  # O_DIRECT wants offsets, lengths and buffer addresses aligned to the logical block size
DEFAULT_CHUNK_BYTES = 32 << 20
_CACHE_PROBES = 4


class ReadFailed(OSError):
    """A read of the file holding span `index` failed (the cause is chained)."""

    def __init__(self, index: int, cause: OSError):
        super().__init__(str(cause))
        self.index = index


class Span(Protocol):
    path: Path
    begin: int
    end: int


@dataclass(frozen=True, slots=True)
class Read:
    """One read: file bytes [offset, offset + length), ALIGN-rounded, covering `pieces`:
    (span index, lo, hi) file ranges, each a whole span or one piece of a long one."""

    path: Path
    offset: int
    length: int
    pieces: tuple[tuple[int, int, int], ...]

    @property
    def data_bytes(self) -> int:
        """Bytes of the file this read is for (from the first piece to the last, unrounded)."""
        return self.pieces[-1][2] - self.pieces[0][1]


def _down(n: int) -> int:
    return n // ALIGN * ALIGN


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _read(path: Path, pieces: list[tuple[int, int, int]]) -> Read:
    offset = _down(pieces[0][1])
    return Read(path, offset, _up(pieces[-1][2]) - offset, tuple(pieces))


def plan_reads(spans: Sequence[Span], chunk_bytes: int) -> list[Read]:
    """Sequential reads covering `spans` (in (file, offset) order, not overlapping)."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    reads: list[Read] = []
    i = 0
    while i < len(spans):
        s = spans[i]
        if s.end - s.begin > chunk_bytes:
            reads += [_read(s.path, [(i, lo, min(lo + chunk_bytes, s.end))])
                      for lo in range(s.begin, s.end, chunk_bytes)]
            i += 1
            continue
        group = [(i, s.begin, s.end)]
        i += 1
        while i < len(spans) and spans[i].path == s.path and spans[i].end - s.begin <= chunk_bytes:
            group.append((i, spans[i].begin, spans[i].end))
            i += 1
        reads.append(_read(s.path, group))
    return reads


@dataclass(eq=False)
class _Buffer:
    data: torch.Tensor  # uint8, ALIGN-aligned
    view: memoryview = field(init=False)
    fence: object = None  # a CUDA event: the copies out of this buffer that must finish before a refill

    def __post_init__(self):
        self.view = memoryview(self.data.numpy())


def _aligned_buffer(nbytes: int, pinned: bool) -> _Buffer:
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pinned)
    start = -raw.data_ptr() % ALIGN
    return _Buffer(raw[start: start + nbytes])


def _pages_cached(fd: int, begin: int, end: int) -> bool:
    """Whether a few pages spread over [begin, end) are in the page cache: reads that must not wait."""
    nowait = getattr(os, "RWF_NOWAIT", None)
    if nowait is None or end <= begin:
        return False
    probe = bytearray(1)
    for k in range(_CACHE_PROBES):
        offset = begin + (end - 1 - begin) * k // (_CACHE_PROBES - 1)
        try:
            if os.preadv(fd, [probe], offset, nowait) != 1:
                return False
        except OSError:  # EAGAIN: not cached; EOPNOTSUPP and the like: cannot tell
            return False
    return True


class _File:
    """An open file read in one mode: "direct" (O_DIRECT) or "buffered"."""

    def __init__(self, path: Path, direct: bool | None, begin: int, end: int):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        self.mode = "buffered"
        if direct is None:
            direct = not _pages_cached(self.fd, begin, end)
        if direct and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                log.debug("%s: O_DIRECT refused, reading through the page cache", path)
            else:
                os.close(self.fd)
                self.fd, self.mode = fd, "direct"
        if self.mode == "buffered":
            self._advise_sequential()

    def _advise_sequential(self) -> None:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def fall_back_to_buffered(self) -> None:
        log.debug("%s: O_DIRECT read refused, reading through the page cache", self.path)
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_RDONLY)
        self.mode = "buffered"
        self._advise_sequential()

    def fill(self, buf: _Buffer, read: Read) -> None:
        """Read `read` into `buf`; at least up to the end of its last piece, or OSError."""
        need = read.pieces[-1][2] - read.offset
        got = 0
        while got < need:
            try:
                n = os.preadv(self.fd, [buf.view[got: read.length]], read.offset + got)
            except OSError as e:
                if e.errno != errno.EINVAL or self.mode != "direct":
                    raise
                self.fall_back_to_buffered()
                continue
            if n == 0:
                raise OSError(errno.EIO, f"{self.path} ends at byte {read.offset + got}, but its data "
                                         f"reaches byte {read.offset + need} (truncated while reading?)")
            got += n

    def close(self) -> None:
        os.close(self.fd)


class SequentialReader:
    """Iterate (span index, raw bytes) in span order; use it as a context manager.

    Each raw tensor is uint8 on the CPU, a view into a reader buffer (or, for a span
    longer than a chunk, into the staging buffer it was assembled in), valid until the
    next item is taken: copy out of it, do not keep it. `device` = a CUDA device pins the buffers and
    fences their reuse on that device's current stream.
    """

    def __init__(self, spans: Sequence[Span], *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 direct: bool | None = None, device: torch.device | None = None,
                 progress: Callable[[int], None] | None = None):
        self.spans = spans
        self.chunk_bytes = chunk_bytes
        self.reads = plan_reads(spans, chunk_bytes)
        self.direct = direct
        self.cuda = device is not None and device.type == "cuda"
        self.device = device
        self.progress = progress
        self.modes: dict[Path, str] = {}  # how each file was read ("direct" or "buffered")
        self._free: queue.Queue = queue.Queue()
        self._filled: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the reader thread (it finishes the read in flight) and close its file."""
        self._stop.set()
        self._free.put(None)
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        file: _File | None = None
        try:
            for read in self.reads:
                buf = self._free.get()
                if buf is None or self._stop.is_set():
                    return
                if buf.fence is not None:
                    buf.fence.synchronize()
                    buf.fence = None
                if file is None or file.path != read.path:
                    if file is not None:
                        file.close()
                        file = None
                    last = next(r for r in reversed(self.reads) if r.path == read.path)
                    file = _File(read.path, self.direct, read.offset, last.pieces[-1][2])
                file.fill(buf, read)
                self.modes[read.path] = file.mode
                self._filled.put(buf)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            self._filled.put(e)
        finally:
            if file is not None:
                file.close()

    def _start(self) -> None:
        capacity = max((r.length for r in self.reads), default=0)
        for _ in range(2 if len(self.reads) > 1 else 1):
            self._free.put(_aligned_buffer(capacity, self.cuda))
        self._thread = threading.Thread(target=self._run, name="rtp-reader", daemon=True)
        self._thread.start()

    def _give_back(self, buf: _Buffer) -> None:
        if self.cuda:
            buf.fence = torch.cuda.Event()
            buf.fence.record(torch.cuda.current_stream(self.device))
        self._free.put(buf)

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        if self._thread is not None:
            raise RuntimeError("a SequentialReader is iterated once")
        self._start()
        # spans longer than a chunk are assembled here: one allocation, its pages faulted in once
        long_spans = [s.end - s.begin for s in self.spans if s.end - s.begin > self.chunk_bytes]
        staging = torch.empty(max(long_spans, default=0), dtype=torch.uint8)
        staged = staging[:0]
        try:
            for read in self.reads:
                item = self._filled.get()
                if isinstance(item, OSError):
                    raise ReadFailed(read.pieces[0][0], item) from item
                if isinstance(item, BaseException):
                    raise item
                if self.progress is not None:
                    self.progress(read.data_bytes)
                for index, lo, hi in read.pieces:
                    span = self.spans[index]
                    piece = item.data[lo - read.offset: hi - read.offset]
                    if lo == span.begin and hi == span.end:
                        yield index, piece
                        continue
                    if lo == span.begin:
                        staged = staging[: span.end - span.begin]
                    staged[lo - span.begin: hi - span.begin].copy_(piece)
                    if hi == span.end:
                        yield index, staged
                self._give_back(item)
        finally:
            self.close()


def stream_tensors(records: Sequence[TensorRecord], *, chunk_bytes: int | None = None,
                   direct: bool | None = None, device: torch.device | None = None,
                   progress: Callable[[int], None] | None = None) -> Iterator[tuple[TensorRecord, torch.Tensor]]:
    """(record, decoded CPU tensor) for every record, read in file order.

    A tensor may alias a reader buffer: it is valid until the next one is taken, so
    copy out of it. A read that fails raises CheckpointError naming the file and the
    tensor. `device` only pins the buffers and fences their reuse (CUDA); the
    tensors stay on the CPU. Other options: SequentialReader.
    """
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
