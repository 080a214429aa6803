"""CPU tensors in anonymous memory: committed page by page as they are written, backed by
transparent huge pages (2 MiB) where the kernel offers them, and able to give whole pages
back to the operating system.

Lazy: `zeros` maps anonymous memory (mmap) instead of allocating and zero-filling it.
The kernel hands out zeroed pages on first touch, so a page never written costs no RAM.
The KV cache relies on this: it is sized for every block the pool may ever grow into
(rtp/engine/kv_cache.py) while only the blocks in use are backed.

Huge: decode reads the KV cache in 6 KB runs (a block of 16 tokens) scattered over
hundreds of megabytes: with 4 KiB pages nearly every run is a TLB miss. Where THP is in
"madvise" mode (the common default), memory is only backed by huge pages when asked with
madvise(MADV_HUGEPAGE) before it is first touched. Asking took the decode attention of a
30-layer, 64-row step from 46 to 41 ms here.

Release: `release` drops the whole pages inside a tensor's bytes (MADV_DONTNEED): their
memory goes back to the OS at once and they read back as zeros, committed again when next
written. EPLB gives dropped expert replicas' slots back this way (rtp/engine/expert_balancer.py).

Off Linux, without libc, or with THP off, nothing is advised and nothing is released
(`release` returns 0): the tensors are then ordinary memory.
"""

from __future__ import annotations

import mmap

import torch

from rtp._libc import madvise

_HUGE = 2 << 20
PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14


def _madvise():
    """libc's madvise, unless transparent huge pages are off on this system."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return None
    except OSError:
        return None
    return madvise


_MADVISE = _madvise()


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for s in shape:
        numel *= s
    return numel * torch.empty((), dtype=dtype).element_size()


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose whole 2 MiB pages are asked to be huge."""
    nbytes = _nbytes(shape, dtype)
    if _MADVISE is None or nbytes < 2 * _HUGE:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + _HUGE, dtype=torch.uint8)  # room to start on a 2 MiB boundary
    offset = -raw.data_ptr() % _HUGE
    _MADVISE(raw.data_ptr() + offset, nbytes // _HUGE * _HUGE, _MADV_HUGEPAGE)  # advice: failure is harmless
    return raw[offset: offset + nbytes].view(dtype).view(shape)


def copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t in memory from empty(): for data read whole every step."""
    return empty(tuple(t.shape), t.dtype).copy_(t)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor from anonymous memory: page-aligned (2 MiB-aligned when large),
    nothing committed until written, whole 2 MiB pages asked to be huge."""
    nbytes = _nbytes(shape, dtype)
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    large = nbytes >= 2 * _HUGE
    # the tensor holds a reference to the mapping, which is unmapped when the last view goes
    # private: a shared anonymous mapping is shmem, which MADV_DONTNEED would not free
    buf = mmap.mmap(-1, nbytes + (_HUGE if large else 0), flags=mmap.MAP_PRIVATE)
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    offset = -raw.data_ptr() % _HUGE if large else 0
    if large and _MADVISE is not None:
        _MADVISE(raw.data_ptr() + offset, nbytes // _HUGE * _HUGE, _MADV_HUGEPAGE)
    return raw[offset: offset + nbytes].view(dtype).view(shape)


def whole_pages(address: int, nbytes: int) -> tuple[int, int]:
    """(start, length) of the whole pages inside [address, address + nbytes); length may be 0."""
    start = -(-address // PAGE) * PAGE
    end = (address + nbytes) // PAGE * PAGE
    return start, max(0, end - start)


def releasable(t: torch.Tensor) -> int:
    """Bytes `release(t)` would give back: the whole pages inside a contiguous CPU tensor's
    bytes (0 on other devices or where madvise is missing)."""
    if madvise is None or t.device.type != "cpu" or not t.is_contiguous():
        return 0
    return whole_pages(t.data_ptr(), t.numel() * t.element_size())[1]


def release(t: torch.Tensor) -> int:
    """Give the whole pages inside a contiguous CPU tensor's bytes back to the OS; they read
    back as zeros. Returns the bytes released (0 where this cannot be done)."""
    nbytes = releasable(t)
    if nbytes == 0:
        return 0
    start, _ = whole_pages(t.data_ptr(), t.numel() * t.element_size())
    if madvise(start, nbytes, _MADV_DONTNEED) != 0:
        return 0
    return nbytes
