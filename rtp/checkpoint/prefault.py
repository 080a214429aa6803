"""Parameter memory faulted in ahead of the loader's copies, on a thread of its own.

A freshly allocated parameter is not backed by memory yet: the first write to each
4 KiB page traps into the kernel, which zeroes a page for it. On the machine
measured (a 2-core VM) that cost more than the copy itself: about 0.4 s per GB,
against 0.25 s per GB of memcpy. madvise(MADV_POPULATE_WRITE) (Linux 5.14) backs a
whole range in one call, without a trap per page, and leaves its contents alone.
Done on a second thread, in the order the loader fills the parameters, it runs
beside the reads and the copies instead of adding to them; a page the copies
reach first is simply faulted in by them. Where the call is missing or refused
this does nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Self

import torch

from rtp._libc import madvise

_MADV_POPULATE_WRITE = 23
_PAGE = 4096
_STEP = 16 << 20  # per call: the copies are never far behind


_MADVISE = madvise


class Prefault:
    """Context manager: while inside, a thread populates `tensors` (CPU) in the order given."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.ranges = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors
                       if t.device.type == "cpu" and t.numel()]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Self:
        if _MADVISE is not None and self.ranges:
            self._thread = threading.Thread(target=self._run, name="rtp-prefault", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        for address, nbytes in self.ranges:
            start = address // _PAGE * _PAGE  # a page shared with a neighbour is theirs too: harmless
            end = address + nbytes
            for at in range(start, end, _STEP):
                if self._stop.is_set():
                    return
                if _MADVISE(at, min(_STEP, end - at), _MADV_POPULATE_WRITE) != 0:
                    return  # an older kernel (EINVAL) or a mapping it will not populate
