"""libc's madvise through ctypes (None off Linux or without libc): huge pages for the KV cache
(rtp/kernels/hugepages.py) and page population while loading (rtp/checkpoint/prefault.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys


def _load_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return fn


madvise = _load_madvise()
