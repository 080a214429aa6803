"""libc's madvise through ctypes (None off Linux or without libc): huge pages for the KV cache
(rtp/kernels/hugepages.py) and page population while loading (rtp/checkpoint/prefault.py); and
malloc_trim, which gives the heap's free pages back once loading is done (rtp/checkpoint/loader.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def _load_madvise():
    libc = _libc()
    if libc is None:
        return None
    fn = libc.madvise
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return fn


def _load_malloc_trim():
    fn = getattr(_libc(), "malloc_trim", None)  # glibc's; absent from musl
    if fn is not None:
        fn.argtypes = (ctypes.c_size_t,)
    return fn


madvise = _load_madvise()
malloc_trim = _load_malloc_trim()
