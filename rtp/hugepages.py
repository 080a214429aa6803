"""CPU tensors backed by transparent huge pages (2 MiB) where the kernel offers them.

Decode reads the KV cache in 6 KB runs (a block of 16 tokens) scattered over
hundreds of megabytes: with 4 KiB pages nearly every run is a TLB miss. Where
THP is in "madvise" mode (the common default), memory is only backed by huge
pages when asked with madvise(MADV_HUGEPAGE) before it is first touched. Asking
took the decode attention of a 30-layer, 64-row step from 46 to 41 ms here.

Elsewhere (no Linux, THP off, madvise refused) `empty` is plain `torch.empty`.
"""

from __future__ import annotations

import torch

from rtp._libc import madvise

_HUGE = 2 << 20
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


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose whole 2 MiB pages are asked to be huge."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if _MADVISE is None or nbytes < 2 * _HUGE:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + _HUGE, dtype=torch.uint8)  # room to start on a 2 MiB boundary
    offset = -raw.data_ptr() % _HUGE
    _MADVISE(raw.data_ptr() + offset, nbytes // _HUGE * _HUGE, _MADV_HUGEPAGE)  # advice: failure is harmless
    return raw[offset: offset + nbytes].view(dtype).view(shape)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return empty(shape, dtype).zero_()
