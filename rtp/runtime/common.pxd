# cython: language_level=3
"""Helpers every runtime module shares. The small ones are inline here, so each module
compiles its own copy and no call crosses a module boundary; _int32_array lives in
common.pyx (it needs numpy's Python API) and is reached through Cython's C-API table."""

from libc.stdint cimport int32_t, int64_t
from libc.stdlib cimport malloc
from libc.string cimport memset

cimport numpy as cnp


cdef inline int _cdiv(int64_t a, int64_t b) noexcept nogil:
    return <int>((a + b - 1) // b)


cdef inline void* _zeroed(size_t nbytes) noexcept nogil:
    """malloc + memset: every page is touched now, at construction, so the first steps
    that reach a fresh part of a large table don't pay its page faults."""
    cdef void* p = malloc(nbytes if nbytes else 1)
    if p != NULL:
        memset(p, 0, nbytes)
    return p


cdef inline bint _is_contiguous(object array, int typenum) noexcept:
    return (isinstance(array, cnp.ndarray) and cnp.PyArray_TYPE(<cnp.ndarray>array) == typenum
            and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>array))


cdef inline int32_t* _as_int32_ptr(object array) except NULL:
    """The data of a contiguous int32 array (checked: a cheap C-API test, no memoryview)."""
    if not _is_contiguous(array, cnp.NPY_INT32):
        raise TypeError("expected a contiguous int32 array")
    return <int32_t*>cnp.PyArray_DATA(<cnp.ndarray>array)


cdef inline int64_t* _as_int64_ptr(object array) except NULL:
    if not _is_contiguous(array, cnp.NPY_INT64):
        raise TypeError("expected a contiguous int64 array")
    return <int64_t*>cnp.PyArray_DATA(<cnp.ndarray>array)


cdef object _int32_array(object values, str what)
