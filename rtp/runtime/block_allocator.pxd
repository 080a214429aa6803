# cython: language_level=3
"""The BlockAllocator's C surface, for the radix cache and the scheduler to cimport.

The list primitives and refcount steps are inline here, so the cache and the scheduler
call them directly, as code of their own module; the larger methods go through the
class's vtable, as any cdef method does."""

from libc.stdint cimport int32_t, int64_t, uint8_t


cdef class BlockCache:
    """What the allocator asks of the cache that names its blocks (RadixCache derives from
    it): the allocator cannot cimport the cache, which cimports the allocator."""

    cdef int _evict_block(self, int32_t b) except -1
    cdef int _evict_through(self, int limit) except -2
    cdef bint _is_root_path(self, const int32_t* blocks, int n) noexcept nogil


cdef class BlockAllocator:
    cdef readonly int num_blocks  # the limit: ids [0, num_blocks) make up the pool now
    cdef readonly int capacity    # the arrays' size: grow() goes up to it
    cdef readonly int base        # the limit as built: ids at or above it are lent by grow()
    cdef readonly int block_size
    cdef int32_t* ref
    cdef int32_t* prev
    cdef int32_t* next
    cdef uint8_t* in_list
    cdef uint8_t* cached          # the block's tokens live in the attached RadixCache
    cdef int32_t* scratch         # per-block counts for validating a Python call, kept zero
    cdef int32_t sentinel         # index capacity: head is next[sentinel], tail prev[sentinel]
    cdef int32_t first_cached     # first cached block in the list, or sentinel
    cdef int n_list               # blocks in the list (free + evictable)
    cdef int n_cached_in_list     # evictable blocks
    cdef int n_cached             # blocks held by the cache, used or not
    cdef int n_cached_used        # cached blocks with refcount > 0 ("protected")
    cdef readonly int64_t num_evictions
    cdef BlockCache cache         # the RadixCache on this allocator, or None

    # -- list primitives ------------------------------------------------------------------

    cdef inline void _link_after(self, int32_t at, int32_t b) noexcept nogil:
        cdef int32_t nx = self.next[at]
        self.prev[b] = at
        self.next[b] = nx
        self.prev[nx] = b
        self.next[at] = b
        self.in_list[b] = 1
        self.n_list += 1

    cdef inline void _push_head(self, int32_t b) noexcept nogil:
        self._link_after(self.sentinel, b)

    cdef inline void _push_free(self, int32_t b) noexcept nogil:
        """A block that just became truly free: the pool's own at the head (used next), a
        lent one at the end of the truly free segment (used last, see block_allocator.pyx)."""
        if b < self.base:
            self._link_after(self.sentinel, b)
        else:
            self._link_after(self.prev[self.first_cached], b)

    cdef inline void _push_tail(self, int32_t b) noexcept nogil:
        self._link_after(self.prev[self.sentinel], b)
        self.n_cached_in_list += 1
        if self.first_cached == self.sentinel:
            self.first_cached = b

    cdef inline void _unlink(self, int32_t b) noexcept nogil:
        if b == self.first_cached:
            self.first_cached = self.next[b]  # the list is [free..., cached...]: next is cached or the end
        if self.cached[b]:
            self.n_cached_in_list -= 1
        self.next[self.prev[b]] = self.next[b]
        self.prev[self.next[b]] = self.prev[b]
        self.in_list[b] = 0
        self.n_list -= 1

    # -- hot-path operations (C callers) -------------------------------------------------

    cdef int _alloc(self, int n, int32_t* out) except -1

    cdef inline void _incref(self, int32_t b) noexcept nogil:
        if self.ref[b] == 0:
            self._unlink(b)  # a cache hit takes the block back out of the list in O(1)
            if self.cached[b]:
                self.n_cached_used += 1
        self.ref[b] += 1

    cdef inline void _decref(self, int32_t b) noexcept nogil:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if self.cached[b]:
                self.n_cached_used -= 1
                self._push_tail(b)
            else:
                self._push_free(b)

    cdef void _release_path(self, const int32_t* blocks, int n) noexcept nogil
    cdef void _acquire_path(self, const int32_t* blocks, int n) noexcept nogil

    cdef inline int _evictable_in(self, const int32_t* blocks, int n) noexcept nogil:
        """How many of these blocks sit in the free list (acquiring them shrinks it)."""
        cdef int i, k = 0
        for i in range(n):
            k += self.ref[blocks[i]] == 0
        return k
