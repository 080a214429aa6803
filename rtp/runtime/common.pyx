# cython: language_level=3
"""The one shared helper that needs numpy's Python API; the inline ones are in common.pxd."""

from libc.stdint cimport int32_t

import numpy as np
cimport numpy as cnp

cnp.import_array()


cdef object _int32_array(object values, str what):
    """A contiguous int32 view or copy of `values`, refusing values that do not fit."""
    arr = values if isinstance(values, cnp.ndarray) else np.asarray(values)
    if cnp.PyArray_NDIM(<cnp.ndarray>arr) != 1:
        raise ValueError(f"{what} must be one-dimensional, got shape {arr.shape}")
    if _is_contiguous(arr, cnp.NPY_INT32):
        # the common case (callers keep int32 arrays): one vectorised C pass, no numpy reductions
        if _any_negative(<int32_t*>cnp.PyArray_DATA(<cnp.ndarray>arr), cnp.PyArray_SIZE(<cnp.ndarray>arr)):
            raise ValueError(f"{what} must hold values in [0, 2**31), got {arr.min()}")
        return arr
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must hold integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > 2147483647):
        raise ValueError(f"{what} must hold values in [0, 2**31), got [{arr.min()}, {arr.max()}]")
    return np.ascontiguousarray(arr, dtype=np.int32)


cdef bint _any_negative(const int32_t* values, Py_ssize_t n) noexcept nogil:
    cdef int32_t acc = 0
    cdef Py_ssize_t i
    for i in range(n):
        acc |= values[i]  # no early exit, so the compiler vectorises it
    return acc < 0
