# cython: language_level=3
"""The BlockAllocator: paged KV blocks with reference counts and one intrusive free list,
all in C arrays, nothing allocated per operation. BlockCache, declared beside it in
block_allocator.pxd, is what it calls on the RadixCache that names its blocks.

The one invariant that ties allocator and cache together
---------------------------------------------------------
A holder (a request, or a caller of RadixCache.lock) that holds a block of the
tree also holds every ancestor block of it (the blocks before it on its root
path). Holders take refs root-first and release tail-first, so an ancestor's
refcount drops to zero no earlier than any descendant's. Released cached blocks
join the free list at the tail, so in the free list every cached block stands
before its ancestors: popping the head evicts a leaf's last block, never a
block that something in the tree still hangs from. Truly free (uncached) blocks
join at the head and are used before any cached block is evicted.

    free list:  sentinel -> [truly free ...] -> [cached, least recently used first ...] -> sentinel

The pool can be resized while serving (EPLB gives the memory of dropped expert
replicas to the KV cache, rtp/engine/expert_balancer.py): the allocator keeps its
arrays for `capacity` blocks but hands out only ids below `num_blocks`, the limit.

    ids:  0 | 1 .. base-1        | base .. num_blocks-1 | num_blocks .. capacity-1
          null  the pool as built   lent by grow()         withheld: never listed, never used

grow() lists withheld blocks; shrink() withholds the top ones again, only when none is
in use (cached-but-unused ones are evicted first, with everything hanging from them).
Lent blocks that come free join the truly free segment at its far end, behind the
pool's own blocks, so while the pool is not full they drain out of use and a later
shrink() finds them free.
"""

from libc.stdint cimport int32_t, uint8_t
from libc.stdlib cimport free

import numpy as np
cimport numpy as cnp

from .common cimport _as_int32_ptr, _int32_array, _zeroed

cnp.import_array()


cdef class BlockCache:
    """The interface only; RadixCache (radix_cache.pyx) implements it."""

    cdef int _evict_block(self, int32_t b) except -1:
        raise NotImplementedError

    cdef int _evict_through(self, int limit) except -2:
        raise NotImplementedError

    cdef bint _is_root_path(self, const int32_t* blocks, int n) noexcept nogil:
        return False


cdef class BlockAllocator:
    """Fixed-size KV blocks with reference counts, handed out in O(1).

    Block 0 is the null block: never handed out, it is what padded rows of a step
    plan point at. Blocks 1..num_blocks-1 are usable. A block is in exactly one of:
    used (refcount > 0), truly free, or evictable (refcount 0 but its tokens still
    cached in the RadixCache). Free and evictable blocks share one doubly linked
    list kept in C arrays (see the module docstring for its order).

    num_blocks is the limit, what every count and usage figure is relative to;
    `capacity` (default num_blocks) is what grow() may raise it to.
    """

    def __cinit__(self, int num_blocks, int block_size, int capacity=0):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if capacity == 0:
            capacity = num_blocks
        if capacity < num_blocks:
            raise ValueError(f"capacity {capacity} is below num_blocks {num_blocks}")
        self.num_blocks = num_blocks
        self.capacity = capacity
        self.base = num_blocks
        self.block_size = block_size
        self.ref = <int32_t*>_zeroed(<size_t>(capacity) * sizeof(int32_t))
        self.prev = <int32_t*>_zeroed((<size_t>capacity + 1) * sizeof(int32_t))
        self.next = <int32_t*>_zeroed((<size_t>capacity + 1) * sizeof(int32_t))
        self.in_list = <uint8_t*>_zeroed(<size_t>(capacity) * sizeof(uint8_t))
        self.cached = <uint8_t*>_zeroed(<size_t>(capacity) * sizeof(uint8_t))
        self.scratch = <int32_t*>_zeroed(<size_t>(capacity) * sizeof(int32_t))
        if not (self.ref and self.prev and self.next and self.in_list and self.cached and self.scratch):
            raise MemoryError()
        self.sentinel = capacity
        self.prev[self.sentinel] = self.sentinel
        self.next[self.sentinel] = self.sentinel
        self.first_cached = self.sentinel
        self.ref[0] = 1  # the null block is permanently "used" and never listed
        cdef int b
        for b in range(num_blocks - 1, 0, -1):
            self._push_head(b)  # so block 1 is handed out first

    def __dealloc__(self):
        free(self.ref); free(self.prev); free(self.next); free(self.in_list); free(self.cached)
        free(self.scratch)

    # -- hot-path operations (C callers) -------------------------------------------------

    cdef int _alloc(self, int n, int32_t* out) except -1:
        """Pop n blocks off the head (evicting cached ones) with refcount 1 into out."""
        cdef int i
        cdef int32_t b
        if n > self.n_list:
            raise MemoryError(f"cannot allocate {n} blocks: {self.n_list} free or evictable")
        for i in range(n):
            b = self.next[self.sentinel]
            self._unlink(b)
            if self.cached[b]:
                self.cache._evict_block(b)
                self.num_evictions += 1
            self.ref[b] = 1
            out[i] = b
        return 0

    cdef void _release_path(self, const int32_t* blocks, int n) noexcept nogil:
        """Drop one ref on each of a holder's blocks, tail first (see module docstring)."""
        cdef int i
        for i in range(n - 1, -1, -1):
            self._decref(blocks[i])

    cdef void _acquire_path(self, const int32_t* blocks, int n) noexcept nogil:
        cdef int i
        for i in range(n):
            self._incref(blocks[i])

    # -- Python surface ------------------------------------------------------------------

    @property
    def num_free(self):
        """Blocks that allocate() can hand out now: truly free plus evictable."""
        return self.n_list

    @property
    def num_truly_free(self):
        return self.n_list - self.n_cached_in_list

    @property
    def num_evictable(self):
        """Cached blocks that nothing holds (evicted least recently used first)."""
        return self.n_cached_in_list

    @property
    def num_cached(self):
        """Blocks whose tokens the RadixCache holds, used or evictable."""
        return self.n_cached

    @property
    def num_protected(self):
        """Cached blocks that some holder uses (cannot be evicted)."""
        return self.n_cached_used

    @property
    def num_used(self):
        """Usable blocks with refcount > 0 (block 0 excluded)."""
        return self.num_blocks - 1 - self.n_list

    @property
    def usage(self):
        """Fraction of usable blocks in use, 0..1 (evictable cached blocks count as free)."""
        return <double>self.num_used / (self.num_blocks - 1)

    def can_allocate(self, int n):
        return 0 <= n <= self.n_list

    def allocate(self, int n):
        """n blocks with refcount 1, as an int32 array. Raises MemoryError if fewer remain."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        out = np.empty(n, dtype=np.int32)
        if n:
            self._alloc(n, _as_int32_ptr(out))
        return out

    def acquire(self, blocks):
        """Take one more ref on each block, in order (a holder's root path, root first)."""
        arr = self._checked(blocks, allow_free=True)
        if arr.size:
            self._acquire_path(_as_int32_ptr(arr), arr.size)

    def free(self, blocks):
        """Drop one ref on each block, last block first, so a path's tail is evicted first."""
        arr = self._checked(blocks, allow_free=False)
        if arr.size:
            self._release_path(_as_int32_ptr(arr), arr.size)

    def ref_count(self, int block):
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} out of range [0, {self.num_blocks})")
        return self.ref[block]

    def evict(self, int n):
        """Evict up to n evictable cached blocks now (least recently used first); returns how many."""
        cdef int done = 0
        cdef int32_t b
        while done < n and self.first_cached != self.sentinel:
            b = self.first_cached
            self._unlink(b)
            self.cache._evict_block(b)
            self.num_evictions += 1
            self._push_free(b)
            done += 1
        return done

    def grow(self, int new_limit):
        """Raise the limit to new_limit (at most capacity): the withheld blocks below it
        become free. Lent blocks are listed lowest first, behind every free block of the
        pool as built."""
        if not self.num_blocks <= new_limit <= self.capacity:
            raise ValueError(f"grow to {new_limit}: the limit is {self.num_blocks}, the capacity {self.capacity}")
        cdef int32_t b
        for b in range(new_limit - 1, self.num_blocks - 1, -1):
            if b < self.base:  # back below the limit as built (after a deeper shrink): the head
                self._link_after(self.sentinel, b)
        for b in range(max(self.num_blocks, self.base), new_limit):
            self._link_after(self.prev[self.first_cached], b)
        self.num_blocks = new_limit

    def can_shrink(self, int new_limit):
        """Whether shrink(new_limit) would succeed now: no block at or above it is in use."""
        if not 2 <= new_limit <= self.num_blocks:
            raise ValueError(f"shrink to {new_limit}: the limit is {self.num_blocks} (at least 2 stay)")
        cdef int32_t b
        for b in range(new_limit, self.num_blocks):
            if self.ref[b] > 0:
                return False
        return True

    def shrink(self, int new_limit):
        """Lower the limit to new_limit, withholding the blocks at or above it; only when none
        of them is in use, else nothing changes and this returns False. Cached ones (unused)
        are evicted first, together with every cached block whose root path runs through them
        (nothing can use those either: a holder holds its whole path)."""
        if not self.can_shrink(new_limit):
            return False
        cdef int32_t b
        if self.cache is not None and self.n_cached:
            if self.cache._evict_through(new_limit) < 0:
                return False
        for b in range(new_limit, self.num_blocks):
            self._unlink(b)
        self.num_blocks = new_limit
        return True

    def _checked(self, blocks, bint allow_free):
        """Validate block ids from Python before anything changes."""
        arr = _int32_array(blocks, "blocks")
        cdef int32_t* view = _as_int32_ptr(arr) if arr.size else NULL
        cdef Py_ssize_t i, n = arr.size
        cdef int32_t b
        cdef bint any_cached = False
        for i in range(n):
            b = view[i]
            if b <= 0 or b >= self.num_blocks:
                raise ValueError(f"block {b} is not a usable block id (1..{self.num_blocks - 1})")
            if not allow_free and self.ref[b] <= 0:
                raise ValueError(f"block {b} is not allocated")
            if allow_free and self.ref[b] == 0 and not self.cached[b]:
                raise ValueError(f"block {b} is free: allocate it instead of acquiring it")
            any_cached |= self.cached[b]
        if not allow_free and n > 1:
            # a block listed more often than it is held would go negative
            b = -1
            for i in range(n):
                self.scratch[view[i]] += 1
                if self.scratch[view[i]] > self.ref[view[i]] and b < 0:
                    b = view[i]
            for i in range(n):
                self.scratch[view[i]] = 0
            if b >= 0:
                raise ValueError(f"block {b} freed more times than it is held")
        if allow_free and any_cached and not self.cache._is_root_path(view, n):
            # holding a cached block without its ancestors would let them be evicted from under it
            raise ValueError("cached blocks must be acquired as a path from the root of the cache")
        return arr

    def check_integrity(self):
        """Assert every invariant of the allocator; O(num_blocks)."""
        cdef int32_t b = self.next[self.sentinel], p = self.sentinel
        cdef int count = 0, cached_seen = 0, used = 0, cached_used = 0, cached_total = 0
        cdef bint in_cached_segment = False
        seen_first_cached = self.sentinel
        while b != self.sentinel:
            assert 0 < b < self.num_blocks, f"list holds invalid block {b}"
            assert self.prev[b] == p, f"broken back link at block {b}"
            assert self.in_list[b], f"block {b} in list but not flagged"
            assert self.ref[b] == 0, f"listed block {b} has refcount {self.ref[b]}"
            if self.cached[b]:
                if not in_cached_segment:
                    seen_first_cached = b
                in_cached_segment = True
                cached_seen += 1
            else:
                assert not in_cached_segment, f"free block {b} after a cached block in the list"
            count += 1
            assert count <= self.num_blocks, "cycle in free list"
            p = b
            b = self.next[b]
        assert self.prev[self.sentinel] == p, "broken tail link"
        assert count == self.n_list, f"list length {count} != counter {self.n_list}"
        assert cached_seen == self.n_cached_in_list, "evictable counter drifted"
        assert seen_first_cached == self.first_cached, "first_cached pointer drifted"
        assert self.ref[0] == 1 and not self.in_list[0] and not self.cached[0], "null block touched"
        assert 2 <= self.num_blocks <= self.capacity, "limit outside [2, capacity]"
        for b in range(self.num_blocks, self.capacity):
            assert self.ref[b] == 0 and not self.in_list[b] and not self.cached[b], \
                f"withheld block {b} (limit {self.num_blocks}) is in use, listed or cached"
        for b in range(1, self.num_blocks):
            assert self.ref[b] >= 0, f"negative refcount on block {b}"
            assert (self.ref[b] == 0) == bool(self.in_list[b]), f"block {b}: refcount vs list"
            used += self.ref[b] > 0
            cached_total += self.cached[b]
            cached_used += self.cached[b] and self.ref[b] > 0
        assert used + count == self.num_blocks - 1, "used + free + evictable != total"
        assert cached_total == self.n_cached, "cached counter drifted"
        assert cached_used == self.n_cached_used, "protected counter drifted"
        if self.cache is None:
            assert cached_total == 0


