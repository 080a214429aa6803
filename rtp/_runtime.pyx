# cython: language_level=3
"""rtp's tier-2 runtime: the parts that run every engine step, compiled to C.

Three structures, all state in C arrays, nothing allocated per step:

    BlockAllocator  paged KV blocks with reference counts and one intrusive free list
    RadixCache      block-granular radix tree over token ids (prefix reuse)
    Scheduler       continuous batching under a token budget, writing each step's
                    plan into the numpy buffers of a StepPlan

No torch here: the runtime speaks numpy, so the model runner aliases the plan's
arrays as tensors and the FlexLB master can reuse RadixCache without a model.

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

from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy, memmove, memset

import numpy as np
cimport numpy as cnp

cnp.import_array()

# Finish reasons written into update()'s events (and the Python constants below).
cdef enum:
    _FINISH_NONE = 0
    _FINISH_STOP = 1      # an eos id or one of the request's stop token ids
    _FINISH_LENGTH = 2    # max_tokens or max_model_len reached
    _FINISH_ABORT = 3
    _FINISH_REMOTE = 4    # prefill-only request: decoding continues elsewhere, blocks held

FINISH_NONE = _FINISH_NONE
FINISH_STOP = _FINISH_STOP
FINISH_LENGTH = _FINISH_LENGTH
FINISH_ABORT = _FINISH_ABORT
FINISH_REMOTE = _FINISH_REMOTE
FINISH_REASONS = {_FINISH_NONE: None, _FINISH_STOP: "stop", _FINISH_LENGTH: "length",
                  _FINISH_ABORT: "abort", _FINISH_REMOTE: "remote"}

# Request states.
cdef enum:
    _FREE = 0        # slot unused
    _WAITING = 1     # queued; holds no blocks
    _RUNNING = 2     # admitted; holds blocks for its computed tokens
    _HELD = 3        # prefill-only and done: holds its blocks until release()
    _RESERVED = 4    # decode side: blocks reserved for a prompt whose KV another node computes
    _READY = 5       # decode side: KV arrived, first token given; joins the batch at the next schedule()

STATE_NAMES = {_FREE: "free", _WAITING: "waiting", _RUNNING: "running", _HELD: "held",
               _RESERVED: "reserved", _READY: "ready"}

# Waiting-queue policies.
cdef enum:
    _POLICY_FCFS = 0      # first come, first served
    _POLICY_LPM = 1       # longest cached prefix first, with aging

POLICY_FCFS = _POLICY_FCFS
POLICY_LPM = _POLICY_LPM


cdef inline int _cdiv(int64_t a, int64_t b) noexcept nogil:
    return <int>((a + b - 1) // b)


cdef void* _zeroed(size_t nbytes) noexcept nogil:
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


def _int32_array(object values, str what):
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


# ---------------------------------------------------------------------------------------
# BlockAllocator
# ---------------------------------------------------------------------------------------

cdef class RadixCache


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
    cdef RadixCache cache

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
        lent one at the end of the truly free segment (used last, see the module docstring)."""
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

    cdef void _release_path(self, const int32_t* blocks, int n) noexcept nogil:
        """Drop one ref on each of a holder's blocks, tail first (see module docstring)."""
        cdef int i
        for i in range(n - 1, -1, -1):
            self._decref(blocks[i])

    cdef void _acquire_path(self, const int32_t* blocks, int n) noexcept nogil:
        cdef int i
        for i in range(n):
            self._incref(blocks[i])

    cdef inline int _evictable_in(self, const int32_t* blocks, int n) noexcept nogil:
        """How many of these blocks sit in the free list (acquiring them shrinks it)."""
        cdef int i, k = 0
        for i in range(n):
            k += self.ref[blocks[i]] == 0
        return k

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


# ---------------------------------------------------------------------------------------
# RadixCache
# ---------------------------------------------------------------------------------------

cdef inline uint64_t _mix64(uint64_t x) noexcept nogil:
    # splitmix64 finaliser: a cheap, well-spread 64-bit mix
    x ^= x >> 30
    x *= <uint64_t>0xbf58476d1ce4e5b9
    x ^= x >> 27
    x *= <uint64_t>0x94d049bb133111eb
    x ^= x >> 31
    return x


cdef class RadixCache:
    """Block-granular radix tree over token ids, whose values are KV block ids.

    Each node holds a chain of one or more full blocks (block_size tokens each);
    a child is found from its parent and its first block's tokens through a hash
    table, and every candidate is confirmed by comparing the tokens (memcmp) — a
    hash alone is never trusted. Splitting a node happens only at block
    boundaries. Eviction is driven by the allocator: when it hands out an
    evictable block, the tree gives up that block (always the last block of a
    leaf, by the invariant in the module docstring).

    Used two ways: by the Scheduler over real KV blocks, and standalone (with an
    allocator of its own, no KV at all) as the FlexLB master's approximate view of
    a worker's cache, through record() and match_prefix().
    """

    cdef readonly BlockAllocator allocator
    cdef readonly int block_size
    cdef int capacity                # node slots: one per block the allocator may ever list, plus the root
    cdef int32_t* block_tokens       # [capacity * block_size] tokens of each cached block
    cdef int32_t* block_node         # node owning the block, -1 when uncached
    cdef int32_t* block_next         # chain of blocks inside a node
    cdef int32_t* block_prev
    cdef int32_t* n_parent
    cdef int32_t* n_first
    cdef int32_t* n_last
    cdef int32_t* n_nblocks
    cdef int32_t* n_nchildren
    cdef int32_t* n_hnext            # next node in the same hash bucket
    cdef uint64_t* n_key             # hash of (parent, first block tokens)
    cdef int32_t* free_nodes
    cdef int n_free_nodes
    cdef int32_t* path_scratch       # block ids of one path, for record()
    cdef int32_t* buckets
    cdef uint64_t bucket_mask
    cdef readonly int num_nodes      # including the root
    cdef readonly int64_t num_queries
    cdef readonly int64_t query_tokens
    cdef readonly int64_t hit_tokens
    cdef readonly int64_t num_splits

    def __cinit__(self, BlockAllocator allocator not None):
        if allocator.cache is not None:
            raise ValueError("this allocator already backs a RadixCache")
        if allocator.n_list != allocator.num_blocks - 1:
            raise ValueError("attach the RadixCache before allocating any block")
        cdef int nb = allocator.capacity, bs = allocator.block_size, i
        self.allocator = allocator
        self.block_size = bs
        self.capacity = nb
        self.block_tokens = <int32_t*>_zeroed(<size_t>nb * bs * sizeof(int32_t))
        self.block_node = <int32_t*>_zeroed(nb * sizeof(int32_t))
        self.block_next = <int32_t*>_zeroed(nb * sizeof(int32_t))
        self.block_prev = <int32_t*>_zeroed(nb * sizeof(int32_t))
        self.n_parent = <int32_t*>_zeroed(nb * sizeof(int32_t))
        self.n_first = <int32_t*>_zeroed(nb * sizeof(int32_t))
        self.n_last = <int32_t*>_zeroed(nb * sizeof(int32_t))
        self.n_nblocks = <int32_t*>_zeroed(<size_t>(nb) * sizeof(int32_t))
        self.n_nchildren = <int32_t*>_zeroed(<size_t>(nb) * sizeof(int32_t))
        self.n_hnext = <int32_t*>_zeroed(nb * sizeof(int32_t))
        self.n_key = <uint64_t*>_zeroed(<size_t>(nb) * sizeof(uint64_t))
        self.free_nodes = <int32_t*>_zeroed(nb * sizeof(int32_t))
        self.path_scratch = <int32_t*>_zeroed(nb * sizeof(int32_t))
        cdef uint64_t nbuckets = 16
        while nbuckets < <uint64_t>(2 * nb):
            nbuckets <<= 1
        self.buckets = <int32_t*>_zeroed(nbuckets * sizeof(int32_t))
        if not (self.block_tokens and self.block_node and self.block_next and self.block_prev
                and self.n_parent and self.n_first and self.n_last and self.n_nblocks
                and self.n_nchildren and self.n_hnext and self.n_key and self.free_nodes
                and self.path_scratch and self.buckets):
            raise MemoryError()
        self.bucket_mask = nbuckets - 1
        for i in range(<int>nbuckets):
            self.buckets[i] = -1
        for i in range(nb):
            self.block_node[i] = -1
            self.block_next[i] = -1
            self.block_prev[i] = -1
        # node 0 is the root; free node ids are handed out lowest first
        self.n_parent[0] = -1
        self.n_first[0] = -1
        self.n_last[0] = -1
        self.n_free_nodes = 0
        for i in range(nb - 1, 0, -1):
            self.free_nodes[self.n_free_nodes] = i
            self.n_free_nodes += 1
        self.num_nodes = 1
        allocator.cache = self

    def __dealloc__(self):
        free(self.block_tokens); free(self.block_node); free(self.block_next); free(self.block_prev)
        free(self.n_parent); free(self.n_first); free(self.n_last); free(self.n_nblocks)
        free(self.n_nchildren); free(self.n_hnext); free(self.n_key); free(self.free_nodes)
        free(self.path_scratch); free(self.buckets)

    # -- hashing --------------------------------------------------------------------------

    cdef inline uint64_t _key(self, int32_t parent, const int32_t* toks) noexcept nogil:
        cdef uint64_t h = _mix64(<uint64_t>(parent + 1) * <uint64_t>0x9e3779b97f4a7c15)
        cdef int i
        for i in range(self.block_size):
            h = (h ^ <uint64_t><uint32_t>toks[i]) * <uint64_t>0x100000001b3
        return _mix64(h)

    cdef inline void _hash_add(self, int32_t node) noexcept nogil:
        cdef uint64_t slot = self.n_key[node] & self.bucket_mask
        self.n_hnext[node] = self.buckets[slot]
        self.buckets[slot] = node

    cdef inline void _hash_remove(self, int32_t node) noexcept nogil:
        cdef uint64_t slot = self.n_key[node] & self.bucket_mask
        cdef int32_t c = self.buckets[slot]
        if c == node:
            self.buckets[slot] = self.n_hnext[node]
            return
        while self.n_hnext[c] != node:
            c = self.n_hnext[c]
        self.n_hnext[c] = self.n_hnext[node]

    cdef inline int32_t _find_child(self, int32_t parent, const int32_t* toks) noexcept nogil:
        cdef uint64_t key = self._key(parent, toks)
        cdef int32_t c = self.buckets[key & self.bucket_mask]
        cdef size_t nbytes = self.block_size * sizeof(int32_t)
        while c >= 0:
            if (self.n_key[c] == key and self.n_parent[c] == parent and
                    memcmp(self.block_tokens + <int64_t>self.n_first[c] * self.block_size, toks, nbytes) == 0):
                return c
            c = self.n_hnext[c]
        return -1

    cdef inline bint _block_equals(self, int32_t b, const int32_t* toks) noexcept nogil:
        return memcmp(self.block_tokens + <int64_t>b * self.block_size, toks,
                      self.block_size * sizeof(int32_t)) == 0

    # -- core operations (C callers) ------------------------------------------------------

    cdef int _match(self, const int32_t* toks, int max_blocks, int32_t* out) noexcept nogil:
        """Write the cached block ids of the longest cached prefix (at most max_blocks
        blocks) into out (may be NULL to only count); return how many."""
        cdef int32_t node = 0, child, b
        cdef int n = 0, bs = self.block_size
        while n < max_blocks:
            child = self._find_child(node, toks + <int64_t>n * bs)
            if child < 0:
                break
            b = self.n_first[child]
            if out != NULL:
                out[n] = b
            n += 1
            b = self.block_next[b]
            while b >= 0 and n < max_blocks and self._block_equals(b, toks + <int64_t>n * bs):
                if out != NULL:
                    out[n] = b
                n += 1
                b = self.block_next[b]
            if b >= 0:
                break  # stopped inside this node
            node = child
        return n

    cdef int32_t _new_node(self, int32_t parent, const int32_t* blocks, int nblocks,
                           const int32_t* toks) noexcept nogil:
        cdef int32_t node = self.free_nodes[self.n_free_nodes - 1]
        cdef int i, bs = self.block_size
        cdef int32_t b, prev = -1
        self.n_free_nodes -= 1
        self.num_nodes += 1
        self.n_parent[node] = parent
        self.n_nblocks[node] = nblocks
        self.n_nchildren[node] = 0
        self.n_nchildren[parent] += 1
        for i in range(nblocks):
            b = blocks[i]
            self._adopt(b, node, prev, toks + <int64_t>i * bs)
            prev = b
        self.allocator.n_cached += nblocks
        self.n_first[node] = blocks[0]
        self.n_last[node] = prev
        self.n_key[node] = self._key(parent, toks)
        self._hash_add(node)
        return node

    cdef int32_t _split(self, int32_t node, int k) noexcept nogil:
        """Split node after its first k blocks; returns the new upper node."""
        cdef int32_t top = self.free_nodes[self.n_free_nodes - 1]
        cdef int32_t b = self.n_first[node]
        cdef int i
        self.n_free_nodes -= 1
        self.num_nodes += 1
        self.num_splits += 1
        # the upper part takes the node's place under its parent (same key)
        self._hash_remove(node)
        self.n_parent[top] = self.n_parent[node]
        self.n_key[top] = self.n_key[node]
        self.n_first[top] = b
        for i in range(k):
            self.block_node[b] = top
            if i == k - 1:
                break
            b = self.block_next[b]
        self.n_last[top] = b
        self.n_nblocks[top] = k
        self.n_nchildren[top] = 1
        self._hash_add(top)
        # the lower part keeps its id (its children stay keyed by it) and hangs under top
        cdef int32_t rest = self.block_next[b]
        self.block_next[b] = -1
        self.block_prev[rest] = -1
        self.n_first[node] = rest
        self.n_nblocks[node] -= k
        self.n_parent[node] = top
        self.n_key[node] = self._key(top, self.block_tokens + <int64_t>rest * self.block_size)
        self._hash_add(node)
        return top

    cdef inline int _swap_in(self, int32_t* blocks, int i, int32_t b) except -1:
        """The holder computed tokens the tree already caches in block b: hold b instead."""
        cdef BlockAllocator alloc = self.allocator
        if blocks[i] != b:
            if alloc.cached[blocks[i]]:
                raise AssertionError(f"block {blocks[i]} is cached under other tokens")
            alloc._incref(b)
            alloc._decref(blocks[i])
            blocks[i] = b
        return 0

    cdef int _insert(self, const int32_t* toks, int nblocks, int32_t* blocks, int start) except -1:
        """Insert a holder's path of nblocks full blocks, of which the first `start` are
        known to be the tree's own (held, so still there): the walk resumes after them.

        Where the tree already caches a block for the same tokens, the holder's duplicate
        is swapped for the tree's (ref taken on the tree block, the duplicate released), so
        the holder keeps holding its whole root path. New blocks extend a leaf the path
        ends at, or hang under the node where the path leaves the tree (splitting it at a
        block boundary). Returns the number of blocks that were already cached."""
        cdef int32_t node = 0, child = -1, b = -1, c
        cdef int i = start, bs = self.block_size, shared = start, k
        if start > 0:
            child = self.block_node[blocks[start - 1]]
            b = self.block_next[blocks[start - 1]]
        while True:
            if child >= 0:
                # inside child: everything before block b matched
                while b >= 0 and i < nblocks and self._block_equals(b, toks + <int64_t>i * bs):
                    self._swap_in(blocks, i, b)
                    shared += 1
                    i += 1
                    b = self.block_next[b]
                if i == nblocks:
                    return shared
                if b >= 0:
                    k = 0
                    c = self.n_first[child]
                    while c != b:
                        c = self.block_next[c]
                        k += 1
                    node = self._split(child, k)  # the path leaves the tree inside child
                elif self.n_nchildren[child] == 0:
                    self._extend(child, blocks + i, nblocks - i, toks + <int64_t>i * bs)
                    return shared
                else:
                    node = child
            child = self._find_child(node, toks + <int64_t>i * bs)
            if child < 0:
                self._new_node(node, blocks + i, nblocks - i, toks + <int64_t>i * bs)
                return shared
            b = self.n_first[child]
            self._swap_in(blocks, i, b)
            shared += 1
            i += 1
            b = self.block_next[b]

    cdef void _extend(self, int32_t node, const int32_t* blocks, int nblocks, const int32_t* toks) noexcept nogil:
        """Append blocks to a leaf (its key, the first block, is unchanged)."""
        cdef int i, bs = self.block_size
        cdef int32_t b, prev = self.n_last[node]
        for i in range(nblocks):
            b = blocks[i]
            self._adopt(b, node, prev, toks + <int64_t>i * bs)
            prev = b
        self.n_last[node] = prev
        self.n_nblocks[node] += nblocks
        self.allocator.n_cached += nblocks

    cdef inline void _adopt(self, int32_t b, int32_t node, int32_t prev, const int32_t* toks) noexcept nogil:
        """Make block b, holding toks, the next block of node's chain after prev."""
        memcpy(self.block_tokens + <int64_t>b * self.block_size, toks, self.block_size * sizeof(int32_t))
        self.block_node[b] = node
        self.block_prev[b] = prev
        self.block_next[b] = -1
        if prev >= 0:
            self.block_next[prev] = b
        self.allocator.cached[b] = 1
        # the inserting holder has a ref, so the block is protected
        self.allocator.n_cached_used += self.allocator.ref[b] > 0

    cdef bint _is_root_path(self, const int32_t* blocks, int n) noexcept nogil:
        """Whether blocks[0..n) are cached blocks forming a path from the root."""
        cdef int i
        cdef int32_t b, node, expected_prev
        for i in range(n):
            b = blocks[i]
            node = self.block_node[b]
            if node < 0:
                return False
            expected_prev = self.block_prev[b]
            if expected_prev < 0 and self.n_parent[node] != 0:
                expected_prev = self.n_last[self.n_parent[node]]
            if expected_prev != (blocks[i - 1] if i > 0 else -1):
                return False
        return True

    cdef int _evict_block(self, int32_t b) except -1:
        """Called by the allocator when it hands out cached block b."""
        cdef int32_t node = self.block_node[b], parent, p
        if node < 0 or self.n_last[node] != b or self.n_nchildren[node] != 0:
            raise AssertionError(f"evicting block {b} that is not the last block of a leaf")
        if self.n_nblocks[node] == 1:
            parent = self.n_parent[node]
            self._hash_remove(node)
            self.n_nchildren[parent] -= 1
            self.n_nblocks[node] = 0
            self.free_nodes[self.n_free_nodes] = node
            self.n_free_nodes += 1
            self.num_nodes -= 1
        else:
            p = self.block_prev[b]
            self.block_next[p] = -1
            self.n_last[node] = p
            self.n_nblocks[node] -= 1
        self.block_node[b] = -1
        self.block_prev[b] = -1
        self.block_next[b] = -1
        self.allocator.cached[b] = 0
        self.allocator.n_cached -= 1
        return 0

    cdef inline int32_t _parent_block(self, int32_t b) noexcept nogil:
        """The block before cached block b on its root path, -1 for a block hanging from the root."""
        cdef int32_t node
        if self.block_prev[b] >= 0:
            return self.block_prev[b]
        node = self.block_node[b]
        return self.n_last[self.n_parent[node]] if self.n_parent[node] != 0 else -1

    cdef int _evict_through(self, int limit) except -2:
        """For BlockAllocator.shrink: evict every cached block whose root path holds a block
        id >= limit. Returns how many, or -1 (nothing changed) if one of them is in use.

        The allocator's scratch marks each block once (1: its path crosses the limit, 2: it
        does not), so resolving all of them walks each path once. Then the evictable list is
        walked in order: it holds every marked block (unused, so is all that hangs from it)
        and puts a block before its ancestors, so each marked block is a leaf's last block
        by the time it is reached."""
        cdef BlockAllocator alloc = self.allocator
        cdef int32_t* mark = alloc.scratch
        cdef int32_t* path = self.path_scratch
        cdef int32_t b, x, nx, state
        cdef int n, i, done = 0, busy = 0
        for b in range(1, alloc.num_blocks):
            if not alloc.cached[b] or mark[b]:
                continue
            n = 0
            x = b
            while x >= 0 and mark[x] == 0 and x < limit:
                path[n] = x
                n += 1
                x = self._parent_block(x)
            state = 1 if x >= limit or (x >= 0 and mark[x] == 1) else 2
            for i in range(n):
                mark[path[i]] = state
            if x >= limit:
                mark[x] = 1
        for b in range(1, alloc.num_blocks):
            busy += mark[b] == 1 and alloc.ref[b] > 0
        if busy == 0:
            b = alloc.first_cached
            while b != alloc.sentinel:
                nx = alloc.next[b]
                if mark[b] == 1:
                    alloc._unlink(b)
                    self._evict_block(b)
                    alloc.num_evictions += 1
                    alloc._push_free(b)
                    done += 1
                b = nx
        memset(mark, 0, alloc.capacity * sizeof(int32_t))
        return -1 if busy else done

    cdef inline int _match_cap(self, int ntoks, bint leave_last) noexcept nogil:
        if leave_last:
            return (ntoks - 1) // self.block_size if ntoks > 0 else 0
        return ntoks // self.block_size

    cdef inline void _count_query(self, int ntoks, int nblocks) noexcept nogil:
        self.num_queries += 1
        self.query_tokens += ntoks
        self.hit_tokens += <int64_t>nblocks * self.block_size

    # -- Python surface ------------------------------------------------------------------

    def match_prefix(self, tokens, bint leave_last=True):
        """Longest cached prefix of tokens, as (block ids, number of tokens matched).

        With leave_last (the default, for a request about to be computed) the match
        stops before the last token, rounded down to a block boundary, so at least
        one token is left to compute and produce logits. Does not take refs: call
        lock(blocks) to keep the matched blocks from eviction.
        """
        arr = _int32_array(tokens, "tokens")
        cdef int n = arr.size
        out = np.empty(self._match_cap(n, leave_last), dtype=np.int32)
        cdef int m = 0
        if out.size:
            m = self._match(_as_int32_ptr(arr), out.size, _as_int32_ptr(out))
        self._count_query(n, m)
        return out[:m].copy(), m * self.block_size

    def insert(self, tokens, blocks):
        """Insert the full blocks of tokens whose KV lies in blocks (which the caller holds).

        Where the tree already caches some of these tokens under other blocks, the
        caller's duplicates are released and swapped, in place in `blocks` when it is
        a contiguous int32 array, for the tree's blocks (now held by the caller).
        Returns (the blocks the caller now holds, number of blocks already cached).
        """
        tok = _int32_array(tokens, "tokens")
        if isinstance(blocks, np.ndarray) and blocks.dtype == np.int32 and blocks.flags.c_contiguous:
            blk = blocks
        else:
            blk = _int32_array(blocks, "blocks")
        cdef int nfull = tok.size // self.block_size
        if blk.size < nfull:
            raise ValueError(f"{tok.size} tokens need {nfull} full blocks, got {blk.size}")
        self.allocator._checked(blk[:nfull], False)
        if nfull == 0:
            return blk, 0
        # a block already cached must sit where the tree has it: refuse before changing anything
        tree = np.empty(nfull, dtype=np.int32)
        cdef int m = self._match(_as_int32_ptr(tok), nfull, _as_int32_ptr(tree))
        cdef int i
        for i in range(nfull):
            if self.allocator.cached[blk[i]] and (i >= m or tree[i] != blk[i]):
                raise ValueError(f"block {blk[i]} is cached under other tokens")
        shared = self._insert(_as_int32_ptr(tok), nfull, _as_int32_ptr(blk), 0)
        return blk, shared

    def lock(self, blocks):
        """Protect a matched path (root first, as match_prefix returns it) from eviction
        while something uses it: one ref on each block."""
        self.allocator.acquire(blocks)

    def unlock(self, blocks):
        """Undo lock(); the path becomes evictable once nothing else holds it."""
        self.allocator.free(blocks)

    def evict(self, int num_blocks):
        """Evict up to num_blocks least recently used unlocked blocks; returns how many."""
        return self.allocator.evict(num_blocks)

    def record(self, tokens):
        """Standalone use (no KV): note that a worker has now cached tokens' full blocks.

        Matches, allocates blocks for the rest from this cache's own allocator
        (evicting least recently used entries when it is full, as the worker would),
        inserts, and leaves the whole path evictable, most recently used. Returns the
        number of tokens that were already cached.
        """
        tok = _int32_array(tokens, "tokens")
        # a path never holds more blocks than the cache has: the scratch path fits
        cdef int nfull = min(tok.size // self.block_size, self.capacity - 1)
        if nfull == 0:
            return 0
        cdef int32_t* t = _as_int32_ptr(tok)
        cdef int32_t* p = self.path_scratch
        cdef BlockAllocator alloc = self.allocator
        cdef int m = self._match(t, nfull, p)
        self._count_query(tok.size, m)
        alloc._acquire_path(p, m)
        cdef int n = nfull
        if n - m > alloc.n_list:
            n = m + alloc.n_list  # bigger than the whole cache: keep what fits
        if n > m:
            alloc._alloc(n - m, p + m)
            self._insert(t, n, p, m)
        alloc._release_path(p, n)
        return m * self.block_size

    @property
    def num_cached_blocks(self):
        return self.allocator.n_cached

    @property
    def num_evictable_blocks(self):
        return self.allocator.n_cached_in_list

    @property
    def num_protected_blocks(self):
        return self.allocator.n_cached_used

    @property
    def num_cached_tokens(self):
        return self.allocator.n_cached * self.block_size

    def reset_stats(self):
        self.num_queries = self.query_tokens = self.hit_tokens = 0

    def check_integrity(self):
        """Assert the tree's invariants and its agreement with the allocator; O(blocks)."""
        cdef BlockAllocator alloc = self.allocator
        cdef int nb = alloc.capacity, bs = self.block_size
        cdef int node, b, count, parent, total_blocks = 0, nodes = 1, p, listed, last
        alloc.check_integrity()
        children = [0] * nb
        is_free = [False] * nb
        for p in range(self.n_free_nodes):
            is_free[self.free_nodes[p]] = True
        assert not is_free[0], "root on the free node list"
        # position of each listed block, for the eviction-order invariant
        position = {}
        b = alloc.next[alloc.sentinel]
        listed = 0
        while b != alloc.sentinel:
            position[b] = listed
            listed += 1
            b = alloc.next[b]
        for node in range(1, nb):
            if is_free[node]:
                continue
            nodes += 1
            parent = self.n_parent[node]
            assert 0 <= parent < nb and not is_free[parent], f"node {node} has bad parent {parent}"
            children[parent] += 1
            assert self.n_nblocks[node] >= 1, f"node {node} is empty"
            assert self._find_child(parent, self.block_tokens + <int64_t>self.n_first[node] * bs) == node, \
                f"node {node} not found from its parent by its first block"
            count = 0
            b = self.n_first[node]
            p = -1
            while b >= 0:
                assert self.block_node[b] == node, f"block {b} claims node {self.block_node[b]}, not {node}"
                assert self.block_prev[b] == p, f"broken chain at block {b}"
                assert alloc.cached[b], f"tree block {b} not flagged cached"
                # the block before b on its root path
                if p >= 0:
                    last = p
                elif parent != 0:
                    last = self.n_last[parent]
                else:
                    last = -1
                if last >= 0:
                    if alloc.ref[b] > 0:
                        assert alloc.ref[last] > 0, f"block {b} held but its ancestor {last} is not"
                    elif alloc.ref[last] == 0:
                        assert position[b] < position[last], \
                            f"ancestor {last} would be evicted before its descendant {b}"
                count += 1
                p = b
                b = self.block_next[b]
            assert p == self.n_last[node], f"node {node} last block mismatch"
            assert count == self.n_nblocks[node], f"node {node} block count mismatch"
            total_blocks += count
        for node in range(nb):
            if not is_free[node]:
                assert children[node] == self.n_nchildren[node], f"node {node} child count drifted"
        assert nodes == self.num_nodes, "node count drifted"
        assert nodes + self.n_free_nodes == nb, "node slots leaked"
        assert total_blocks == alloc.n_cached, "cached block counter drifted"
        for b in range(nb):
            assert (self.block_node[b] >= 0) == bool(alloc.cached[b]), f"block {b} cached flag mismatch"


# ---------------------------------------------------------------------------------------
# StepPlan and Scheduler
# ---------------------------------------------------------------------------------------

cdef class StepPlan:
    """The numpy buffers one engine step is described by, allocated once.

    The scheduler writes into them in place; the model runner aliases them as
    tensors (torch.from_numpy on CPU, pinned staging on CUDA). Tokens are packed
    row after row; rows with one query token (decodes, and a prompt's last single
    token) come first: rows [0, num_decode_rows) each compute exactly one token.

    | array            | shape                          | holds                                        |
    |------------------|--------------------------------|----------------------------------------------|
    | input_ids        | [max_num_tokens] int32         | token ids to compute                         |
    | positions        | [max_num_tokens] int32         | their positions in their sequences           |
    | slot_mapping     | [max_num_tokens] int64         | KV slot = block * block_size + offset        |
    | block_tables     | [max_num_seqs, width] int32    | each row's block ids, zero past its length   |
    | seq_lens         | [max_num_seqs] int32           | context length after this step              |
    | query_start_loc  | [max_num_seqs + 1] int32       | row r's tokens: [qsl[r], qsl[r+1])           |
    | logits_indices   | [max_num_seqs] int32           | token index of each row that samples         |
    | sample_slots     | [max_num_seqs] int32           | scheduler slot of each sampling row          |
    | sample_req_ids   | [max_num_seqs] int64           | request id of each sampling row              |

    Everything past num_tokens / num_rows / num_samples is zero (slot 0 is the null
    block), so a captured graph padded to a bucket reads harmless values.
    """

    cdef readonly object input_ids, positions, slot_mapping, block_tables, seq_lens
    cdef readonly object query_start_loc, logits_indices, sample_slots, sample_req_ids
    cdef readonly int max_num_tokens, max_num_seqs, width
    cdef readonly int num_tokens, num_rows, num_decode_rows, num_samples
    cdef int32_t* p_input_ids
    cdef int32_t* p_positions
    cdef int64_t* p_slot_mapping
    cdef int32_t* p_block_tables
    cdef int32_t* p_seq_lens
    cdef int32_t* p_qsl
    cdef int32_t* p_logits_indices
    cdef int32_t* p_sample_slots
    cdef int64_t* p_sample_req_ids
    cdef int32_t* row_width          # columns written in each row last time (to clear stale ones)

    def __cinit__(self, int max_num_tokens, int max_num_seqs, int width, **arrays):
        if max_num_tokens < 1 or max_num_seqs < 1 or width < 1:
            raise ValueError("StepPlan sizes must be positive")
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.width = width
        shapes = {
            "input_ids": ((max_num_tokens,), np.int32),
            "positions": ((max_num_tokens,), np.int32),
            "slot_mapping": ((max_num_tokens,), np.int64),
            "block_tables": ((max_num_seqs, width), np.int32),
            "seq_lens": ((max_num_seqs,), np.int32),
            "query_start_loc": ((max_num_seqs + 1,), np.int32),
            "logits_indices": ((max_num_seqs,), np.int32),
            "sample_slots": ((max_num_seqs,), np.int32),
            "sample_req_ids": ((max_num_seqs,), np.int64),
        }
        unknown = set(arrays) - set(shapes)
        if unknown:
            raise TypeError(f"unknown StepPlan arrays: {sorted(unknown)}")
        made = {}
        for name, (shape, dtype) in shapes.items():
            arr = arrays.get(name)
            if arr is None:
                arr = np.zeros(shape, dtype=dtype)
            elif (not isinstance(arr, np.ndarray) or arr.shape != shape or arr.dtype != dtype
                  or not arr.flags.c_contiguous or not arr.flags.writeable):
                raise ValueError(f"StepPlan.{name} must be a writable contiguous {np.dtype(dtype)} "
                                 f"array of shape {shape}")
            else:
                arr[...] = 0
            made[name] = arr
        self.input_ids = made["input_ids"]
        self.positions = made["positions"]
        self.slot_mapping = made["slot_mapping"]
        self.block_tables = made["block_tables"]
        self.seq_lens = made["seq_lens"]
        self.query_start_loc = made["query_start_loc"]
        self.logits_indices = made["logits_indices"]
        self.sample_slots = made["sample_slots"]
        self.sample_req_ids = made["sample_req_ids"]
        self.p_input_ids = _as_int32_ptr(self.input_ids)
        self.p_positions = _as_int32_ptr(self.positions)
        self.p_slot_mapping = _as_int64_ptr(self.slot_mapping)
        self.p_block_tables = _as_int32_ptr(self.block_tables.reshape(-1))
        self.p_seq_lens = _as_int32_ptr(self.seq_lens)
        self.p_qsl = _as_int32_ptr(self.query_start_loc)
        self.p_logits_indices = _as_int32_ptr(self.logits_indices)
        self.p_sample_slots = _as_int32_ptr(self.sample_slots)
        self.p_sample_req_ids = _as_int64_ptr(self.sample_req_ids)
        self.row_width = <int32_t*>_zeroed(<size_t>(max_num_seqs) * sizeof(int32_t))
        if not self.row_width:
            raise MemoryError()

    def __dealloc__(self):
        free(self.row_width)

    def follow(self, int num_tokens, int num_rows, int num_decode_rows, int num_samples):
        """Take the extent of a plan another process wrote into these arrays (a tensor-parallel
        rank receiving rank 0's step): the arrays already hold it, the counts come here."""
        if not (0 <= num_decode_rows <= num_rows <= self.max_num_seqs and 0 <= num_samples <= num_rows
                and num_rows <= num_tokens <= self.max_num_tokens):
            raise ValueError(f"a plan of {num_tokens} tokens, {num_rows} rows ({num_decode_rows} decode), "
                             f"{num_samples} samples does not fit this StepPlan")
        self.num_tokens = num_tokens
        self.num_rows = num_rows
        self.num_decode_rows = num_decode_rows
        self.num_samples = num_samples

    cdef void _clear_tail(self, int num_tokens, int num_rows, int num_samples) noexcept nogil:
        """Zero what the previous step wrote past this step's extent."""
        cdef int r
        if self.num_tokens > num_tokens:
            memset(self.p_input_ids + num_tokens, 0, (self.num_tokens - num_tokens) * sizeof(int32_t))
            memset(self.p_positions + num_tokens, 0, (self.num_tokens - num_tokens) * sizeof(int32_t))
            memset(self.p_slot_mapping + num_tokens, 0, (self.num_tokens - num_tokens) * sizeof(int64_t))
        for r in range(num_rows, self.num_rows):
            if self.row_width[r]:
                memset(self.p_block_tables + <int64_t>r * self.width, 0, self.row_width[r] * sizeof(int32_t))
                self.row_width[r] = 0
            self.p_seq_lens[r] = 0
            self.p_qsl[r + 1] = 0
        if self.num_samples > num_samples:
            r = self.num_samples - num_samples
            memset(self.p_logits_indices + num_samples, 0, r * sizeof(int32_t))
            memset(self.p_sample_slots + num_samples, 0, r * sizeof(int32_t))
            memset(self.p_sample_req_ids + num_samples, 0, r * sizeof(int64_t))
        self.num_tokens = num_tokens
        self.num_rows = num_rows
        self.num_samples = num_samples

    @property
    def query_lens(self):
        qsl = self.query_start_loc
        return np.diff(qsl[: self.num_rows + 1])


cdef class Scheduler:
    """Continuous batching with one token budget per step (no prefill/decode phases).

    Every request has num_tokens (prompt + generated) and num_computed_tokens (whose
    KV is in the cache). A step gives each running request the tokens it still
    needs — one for a decode, a chunk for a prompt — running requests first, in
    admission order, so decodes are never starved by a long prompt; what budget
    remains admits waiting requests (radix match first, blocks only for the rest).
    When blocks run out, the newest running request is preempted by recompute.

    Usage, once per step:  plan_rows = schedule(); ...forward, sample...; update(tokens)
    """

    cdef readonly BlockAllocator allocator
    cdef readonly RadixCache cache         # None: prefix caching off
    cdef readonly StepPlan plan
    cdef readonly int block_size, max_num_seqs, max_num_batched_tokens, max_model_len
    cdef readonly int max_prefill_tokens_with_decodes
    cdef readonly int max_requests, vocab_size, policy, lpm_window
    cdef readonly double lpm_aging
    cdef readonly bint chunked_prefill
    cdef int32_t* eos_ids
    cdef int n_eos
    # per-request state, indexed by slot
    cdef int64_t* r_id
    cdef uint8_t* r_state
    cdef uint8_t* r_aborted          # aborted while in flight: freed at update()
    cdef uint8_t* r_ignore_eos
    cdef uint8_t* r_prefill_only
    cdef int32_t** r_tokens
    cdef int32_t** r_blocks
    cdef int32_t** r_stop_ids
    cdef int32_t* r_nstop
    cdef int32_t* r_capacity         # most tokens the request can ever hold
    cdef int32_t* r_num_tokens
    cdef int32_t* r_prompt_len
    cdef int32_t* r_num_computed
    cdef int32_t* r_nblocks
    cdef int32_t* r_max_tokens
    cdef int32_t* r_min_tokens
    cdef int32_t* r_cached_tokens    # prompt tokens found in the cache at first admission
    cdef int32_t* r_inserted         # full blocks already inserted into the cache
    cdef int32_t* r_preemptions
    cdef int64_t* r_arrival_step
    cdef int32_t* free_slots
    cdef int n_free_slots
    # queues
    cdef int32_t* running            # admission order; the last one is preempted first
    cdef readonly int num_running
    cdef int32_t* waiting            # front first
    cdef readonly int num_waiting
    cdef readonly int num_held
    cdef int32_t* ready              # _READY slots, oldest first
    cdef readonly int num_ready
    cdef readonly int num_reserved
    cdef dict slot_of
    # this step
    cdef int32_t* sched_slot
    cdef int32_t* sched_n
    cdef int n_sched
    cdef readonly bint in_flight
    # events from update()
    cdef readonly object event_req_ids, event_tokens, event_finish
    cdef int64_t* e_req_ids
    cdef int32_t* e_tokens
    cdef int8_t* e_finish
    # stats
    cdef readonly int64_t step_count
    cdef readonly int64_t num_preemptions
    cdef readonly int64_t queued_prompt_tokens

    def __cinit__(self, BlockAllocator allocator not None, StepPlan plan not None, *,
                  RadixCache cache=None, int max_num_seqs=64, int max_num_batched_tokens=2048,
                  int max_model_len=4096, eos_token_ids=(), int max_requests=16384,
                  int vocab_size=0, str policy="fcfs", bint chunked_prefill=True,
                  double lpm_aging=8.0, int lpm_window=64, int max_prefill_tokens_with_decodes=0):
        if cache is not None and cache.allocator is not allocator:
            raise ValueError("the RadixCache must be built on the same allocator")
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or max_model_len < 1 or max_requests < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens, max_model_len and max_requests must be positive")
        if max_prefill_tokens_with_decodes < 0:
            raise ValueError(f"max_prefill_tokens_with_decodes must be 0 (no limit) or positive, "
                             f"got {max_prefill_tokens_with_decodes}")
        if plan.max_num_seqs < max_num_seqs:
            raise ValueError(f"plan has {plan.max_num_seqs} rows, scheduler needs {max_num_seqs}")
        if plan.max_num_tokens < max_num_batched_tokens:
            raise ValueError(f"plan has {plan.max_num_tokens} token slots, scheduler needs {max_num_batched_tokens}")
        cdef int width = _cdiv(max_model_len, allocator.block_size)
        if plan.width < width:
            raise ValueError(f"plan block tables are {plan.width} wide; max_model_len {max_model_len} "
                             f"with block_size {allocator.block_size} needs {width}")
        if policy not in ("fcfs", "lpm"):
            raise ValueError(f"policy must be 'fcfs' or 'lpm', got {policy!r}")
        if policy == "lpm" and cache is None:
            raise ValueError("policy 'lpm' needs a RadixCache")
        self.allocator = allocator
        self.cache = cache
        self.plan = plan
        self.block_size = allocator.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes
        self.max_model_len = max_model_len
        self.max_requests = max_requests
        self.vocab_size = vocab_size
        self.policy = _POLICY_LPM if policy == "lpm" else _POLICY_FCFS
        self.chunked_prefill = chunked_prefill
        self.lpm_aging = lpm_aging
        self.lpm_window = max(1, lpm_window)
        eos = _int32_array(list(eos_token_ids), "eos_token_ids")
        self.n_eos = eos.size
        self.eos_ids = <int32_t*>_zeroed(max(1, eos.size) * sizeof(int32_t))
        cdef int i
        for i in range(eos.size):
            self.eos_ids[i] = eos[i]
        cdef int n = max_requests
        self.r_id = <int64_t*>_zeroed(<size_t>(n) * sizeof(int64_t))
        self.r_state = <uint8_t*>_zeroed(<size_t>(n) * sizeof(uint8_t))
        self.r_aborted = <uint8_t*>_zeroed(<size_t>(n) * sizeof(uint8_t))
        self.r_ignore_eos = <uint8_t*>_zeroed(<size_t>(n) * sizeof(uint8_t))
        self.r_prefill_only = <uint8_t*>_zeroed(<size_t>(n) * sizeof(uint8_t))
        self.r_tokens = <int32_t**>_zeroed(<size_t>(n) * sizeof(int32_t*))
        self.r_blocks = <int32_t**>_zeroed(<size_t>(n) * sizeof(int32_t*))
        self.r_stop_ids = <int32_t**>_zeroed(<size_t>(n) * sizeof(int32_t*))
        self.r_nstop = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_capacity = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_num_tokens = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_prompt_len = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_num_computed = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_nblocks = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_max_tokens = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_min_tokens = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_cached_tokens = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_inserted = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_preemptions = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_arrival_step = <int64_t*>_zeroed(<size_t>(n) * sizeof(int64_t))
        self.free_slots = <int32_t*>_zeroed(n * sizeof(int32_t))
        self.running = <int32_t*>_zeroed(max_num_seqs * sizeof(int32_t))
        self.waiting = <int32_t*>_zeroed(n * sizeof(int32_t))
        self.ready = <int32_t*>_zeroed(n * sizeof(int32_t))
        self.sched_slot = <int32_t*>_zeroed(max_num_seqs * sizeof(int32_t))
        self.sched_n = <int32_t*>_zeroed(max_num_seqs * sizeof(int32_t))
        if not (self.eos_ids and self.r_id and self.r_state and self.r_aborted and self.r_ignore_eos
                and self.r_prefill_only and self.r_tokens and self.r_blocks and self.r_stop_ids
                and self.r_nstop and self.r_capacity and self.r_num_tokens and self.r_prompt_len
                and self.r_num_computed and self.r_nblocks and self.r_max_tokens and self.r_min_tokens
                and self.r_cached_tokens and self.r_inserted and self.r_preemptions
                and self.r_arrival_step and self.free_slots and self.running and self.waiting and self.ready
                and self.sched_slot and self.sched_n):
            raise MemoryError()
        for i in range(n):
            self.free_slots[i] = n - 1 - i  # slot 0 handed out first
        self.n_free_slots = n
        self.slot_of = {}
        self.event_req_ids = np.zeros(max_num_seqs, dtype=np.int64)
        self.event_tokens = np.zeros(max_num_seqs, dtype=np.int32)
        self.event_finish = np.zeros(max_num_seqs, dtype=np.int8)
        self.e_req_ids = _as_int64_ptr(self.event_req_ids)
        self.e_tokens = _as_int32_ptr(self.event_tokens)
        cdef int8_t[::1] fin = self.event_finish
        self.e_finish = &fin[0]

    def __dealloc__(self):
        cdef int i
        if self.r_tokens != NULL:
            for i in range(self.max_requests):
                free(self.r_tokens[i]); free(self.r_blocks[i]); free(self.r_stop_ids[i])
        free(self.eos_ids); free(self.r_id); free(self.r_state); free(self.r_aborted)
        free(self.r_ignore_eos); free(self.r_prefill_only); free(self.r_tokens); free(self.r_blocks)
        free(self.r_stop_ids); free(self.r_nstop); free(self.r_capacity); free(self.r_num_tokens)
        free(self.r_prompt_len); free(self.r_num_computed); free(self.r_nblocks); free(self.r_max_tokens)
        free(self.r_min_tokens); free(self.r_cached_tokens); free(self.r_inserted)
        free(self.r_preemptions); free(self.r_arrival_step); free(self.free_slots); free(self.running)
        free(self.waiting); free(self.ready); free(self.sched_slot); free(self.sched_n)

    # -- requests in and out (Python callers, once per request) ---------------------------

    def add_request(self, int64_t req_id, prompt_token_ids, *, int max_tokens=16, int min_tokens=0,
                    stop_token_ids=(), bint ignore_eos=False, bint prefill_only=False):
        """Queue a request (at the back). max_tokens counts generated tokens."""
        if req_id in self.slot_of:
            raise ValueError(f"request {req_id} already exists")
        prompt = _int32_array(prompt_token_ids, "prompt_token_ids")
        stops = _int32_array(list(stop_token_ids), "stop_token_ids")
        cdef int plen = prompt.size
        if plen == 0:
            raise ValueError("the prompt is empty")
        if plen > self.max_model_len:
            raise ValueError(f"the prompt has {plen} tokens, more than max_model_len {self.max_model_len}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if min_tokens < 0 or min_tokens > max_tokens:
            raise ValueError(f"min_tokens must lie in [0, max_tokens], got {min_tokens}")
        if self.vocab_size > 0:
            bad = prompt[prompt >= self.vocab_size]
            if bad.size:
                raise ValueError(f"token id {int(bad[0])} is outside the vocabulary (size {self.vocab_size})")
        # the request never holds more than max_model_len tokens of KV; one sampled past
        # a prompt of exactly max_model_len tokens is the only exception
        cdef int64_t capacity = min(<int64_t>plen + max_tokens, max(self.max_model_len, plen + 1))
        cdef int max_blocks = _cdiv(capacity - 1, self.block_size)
        if max_blocks > self.allocator.num_blocks - 1:
            raise ValueError(f"the request may need {max_blocks} KV blocks, the cache has only "
                             f"{self.allocator.num_blocks - 1}")
        if self.n_free_slots == 0:
            raise OverflowError(f"the scheduler already holds {self.max_requests} requests")
        cdef int s = self.free_slots[self.n_free_slots - 1]
        cdef int32_t* toks = <int32_t*>malloc(capacity * sizeof(int32_t))
        cdef int32_t* blks = <int32_t*>malloc(max(1, max_blocks) * sizeof(int32_t))
        cdef int32_t* stop_buf = <int32_t*>malloc(max(1, stops.size) * sizeof(int32_t))
        if not (toks and blks and stop_buf):
            free(toks); free(blks); free(stop_buf)
            raise MemoryError()
        self.n_free_slots -= 1
        memcpy(toks, _as_int32_ptr(prompt), plen * sizeof(int32_t))
        cdef int i
        for i in range(stops.size):
            stop_buf[i] = stops[i]
        self.r_id[s] = req_id
        self.r_tokens[s] = toks
        self.r_blocks[s] = blks
        self.r_stop_ids[s] = stop_buf
        self.r_nstop[s] = stops.size
        self.r_capacity[s] = <int32_t>capacity
        self.r_num_tokens[s] = plen
        self.r_prompt_len[s] = plen
        self.r_num_computed[s] = 0
        self.r_nblocks[s] = 0
        self.r_max_tokens[s] = max_tokens
        self.r_min_tokens[s] = min_tokens
        self.r_ignore_eos[s] = ignore_eos
        self.r_prefill_only[s] = prefill_only
        self.r_aborted[s] = 0
        self.r_cached_tokens[s] = 0
        self.r_inserted[s] = 0
        self.r_preemptions[s] = 0
        self.r_arrival_step[s] = self.step_count
        self.slot_of[req_id] = s
        self._enqueue(s, False)
        return s

    def abort(self, int64_t req_id):
        """Drop a request wherever it is; its blocks are freed now, or at update() when the
        step in flight still reads them. Returns False for an unknown or finished id."""
        slot = self.slot_of.get(req_id)
        if slot is None:
            return False
        cdef int s = slot
        if self.r_aborted[s]:
            return False
        if self.in_flight and self._in_step(s):
            self.r_aborted[s] = 1
            return True
        self._drop(s)
        return True

    def reserve(self, int64_t req_id, prompt_token_ids, *, int max_tokens=16, int min_tokens=0,
                stop_token_ids=(), bint ignore_eos=False):
        """Decode side of a disaggregated request: hold blocks for a prompt whose KV another node
        computes, outside the queues, until resume() (or abort()).

        Returns the block ids, in token order, the prompt's KV must be written into. MemoryError
        when the pool cannot hold them now; nothing changes then (query before commit). The
        blocks are never inserted into the prefix cache before resume(): until then their
        contents are whatever the transfer has written so far."""
        prompt = _int32_array(prompt_token_ids, "prompt_token_ids")
        cdef int need = _cdiv(prompt.size, self.block_size)
        if need > self.allocator.n_list:
            raise MemoryError(f"cannot reserve {need} blocks: {self.allocator.n_list} free or evictable")
        cdef int s = self.add_request(req_id, prompt, max_tokens=max_tokens, min_tokens=min_tokens,
                                      stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
        self._remove_waiting(self.num_waiting - 1)  # add_request queued it last
        self.allocator._alloc(need, self.r_blocks[s])
        self.r_nblocks[s] = need
        self.r_num_computed[s] = self.r_prompt_len[s]  # computed elsewhere
        self.r_state[s] = _RESERVED
        self.num_reserved += 1
        blocks = np.empty(need, dtype=np.int32)
        memcpy(_as_int32_ptr(blocks), self.r_blocks[s], need * sizeof(int32_t))
        return blocks

    def resume(self, int64_t req_id, int first_token):
        """The reserved request's KV has arrived: append the first token (sampled where the prompt
        ran) and let it join the running batch at the next schedule(), as a decode of that token.
        It then counts that token as generated for max_tokens and min_tokens, exactly as a local
        request would. ValueError, changing nothing, when the token would already finish it (the
        prefill node finishes such requests itself) or lies outside the vocabulary."""
        slot = self.slot_of.get(req_id)
        if slot is None or self.r_state[<int>slot] != _RESERVED:
            raise KeyError(f"request {req_id} is not reserved")
        cdef int s = slot
        if first_token < 0 or (self.vocab_size > 0 and first_token >= self.vocab_size):
            raise ValueError(f"token id {first_token} is outside the vocabulary (size {self.vocab_size})")
        self.r_tokens[s][self.r_num_tokens[s]] = first_token
        self.r_num_tokens[s] += 1
        if self._stop_reason(s, first_token) != _FINISH_NONE:
            self.r_num_tokens[s] -= 1
            raise ValueError(f"the first token {first_token} already finishes request {req_id}")
        self.num_reserved -= 1
        self.r_state[s] = _READY
        self.ready[self.num_ready] = s
        self.num_ready += 1

    def release(self, int64_t req_id):
        """Free the blocks of a prefill-only request once its KV has been sent elsewhere."""
        slot = self.slot_of.get(req_id)
        if slot is None or self.r_state[<int>slot] != _HELD:
            raise KeyError(f"request {req_id} is not held")
        self._drop(<int>slot)

    # -- the step (hot path) ---------------------------------------------------------------

    def schedule(self):
        """Fill the plan for one step and return the number of rows scheduled."""
        if self.in_flight:
            raise RuntimeError("schedule() called again before update() for the step in flight")
        self._schedule()
        return self.plan.num_rows

    def update(self, sampled_token_ids):
        """Append one sampled token per sampling row (in plan.logits_indices order), apply
        stop conditions, free finished requests and cache their prefixes. Returns the
        number of events written to event_req_ids / event_tokens / event_finish."""
        if not self.in_flight:
            raise RuntimeError("update() without a step in flight")
        arr = sampled_token_ids
        if not _is_contiguous(arr, cnp.NPY_INT64):  # the sampler's own output needs no copy
            arr = np.asarray(arr)
            if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
                raise TypeError(f"sampled_token_ids must be a 1-D integer array, got {arr.dtype} {arr.shape}")
            arr = np.ascontiguousarray(arr, dtype=np.int64)
        if cnp.PyArray_NDIM(<cnp.ndarray>arr) != 1 or cnp.PyArray_SIZE(<cnp.ndarray>arr) < self.plan.num_samples:
            raise ValueError(f"{self.plan.num_samples} rows sample, got {arr.shape} tokens")
        return self._update(<int64_t*>cnp.PyArray_DATA(<cnp.ndarray>arr))

    cdef bint _in_step(self, int s) noexcept nogil:
        cdef int k
        for k in range(self.n_sched):
            if self.sched_slot[k] == s:
                return True
        return False

    cdef void _enqueue(self, int s, bint front) noexcept nogil:
        if front:
            memmove(self.waiting + 1, self.waiting, self.num_waiting * sizeof(int32_t))
            self.waiting[0] = s
        else:
            self.waiting[self.num_waiting] = s
        self.num_waiting += 1
        self.r_state[s] = _WAITING
        self.queued_prompt_tokens += self.r_num_tokens[s]

    cdef void _remove_waiting(self, int idx) noexcept nogil:
        cdef int s = self.waiting[idx]
        memmove(self.waiting + idx, self.waiting + idx + 1, (self.num_waiting - idx - 1) * sizeof(int32_t))
        self.num_waiting -= 1
        self.queued_prompt_tokens -= self.r_num_tokens[s]

    cdef void _remove_running(self, int s) noexcept nogil:
        cdef int i = self.num_running - 1
        while self.running[i] != s:
            i -= 1
        memmove(self.running + i, self.running + i + 1, (self.num_running - i - 1) * sizeof(int32_t))
        self.num_running -= 1

    cdef int _cache_blocks(self, int s) except -1:
        """Insert s's fully computed blocks into the cache (swapping duplicates)."""
        cdef int nfull = self.r_num_computed[s] // self.block_size
        if self.cache is not None and nfull > self.r_inserted[s]:
            self.cache._insert(self.r_tokens[s], nfull, self.r_blocks[s], self.r_inserted[s])
            self.r_inserted[s] = nfull
        return 0

    cdef int _free_blocks(self, int s) except -1:
        self._cache_blocks(s)
        self.allocator._release_path(self.r_blocks[s], self.r_nblocks[s])
        self.r_nblocks[s] = 0
        self.r_inserted[s] = 0
        return 0

    cdef int _drop(self, int s) except -1:
        """Remove a request entirely (finished, aborted or released): blocks, slot, id."""
        cdef uint8_t state = self.r_state[s]
        cdef int i
        if state == _WAITING:
            for i in range(self.num_waiting):
                if self.waiting[i] == s:
                    self._remove_waiting(i)
                    break
        elif state == _RUNNING:
            self._remove_running(s)
        elif state == _HELD:
            self.num_held -= 1
        elif state == _READY:
            for i in range(self.num_ready):
                if self.ready[i] == s:
                    memmove(self.ready + i, self.ready + i + 1, (self.num_ready - i - 1) * sizeof(int32_t))
                    self.num_ready -= 1
                    break
        if state == _RESERVED:
            # a transfer that never completed: the blocks hold partial KV, so they must not reach the cache
            self.num_reserved -= 1
            self.allocator._release_path(self.r_blocks[s], self.r_nblocks[s])
            self.r_nblocks[s] = 0
        elif state != _WAITING:
            self._free_blocks(s)
        free(self.r_tokens[s]); free(self.r_blocks[s]); free(self.r_stop_ids[s])
        self.r_tokens[s] = NULL
        self.r_blocks[s] = NULL
        self.r_stop_ids[s] = NULL
        self.r_state[s] = _FREE
        self.r_aborted[s] = 0
        del self.slot_of[self.r_id[s]]
        self.free_slots[self.n_free_slots] = s
        self.n_free_slots += 1
        return 0

    cdef int _preempt(self, int s) except -1:
        """Recompute-style preemption: cache what was computed, free it all, requeue first."""
        self._remove_running(s)
        self._free_blocks(s)
        self.r_num_computed[s] = 0
        self.r_preemptions[s] += 1
        self.num_preemptions += 1
        self._enqueue(s, True)
        return 0

    cdef int _pick_waiting(self) except -1:
        """Index in the waiting queue of the request to admit next."""
        if self.policy == _POLICY_FCFS or self.num_waiting == 1:
            return 0
        cdef int i, s, best = 0, m, n = min(self.num_waiting, self.lpm_window)
        cdef double score, best_score = -1.0
        for i in range(n):
            s = self.waiting[i]
            m = self.cache._match(self.r_tokens[s], self.cache._match_cap(self.r_num_tokens[s], True), NULL)
            # aging: every step waited counts as lpm_aging matched tokens, so a cold
            # request overtakes hot ones after a bounded wait
            score = <double>m * self.block_size + self.lpm_aging * <double>(self.step_count - self.r_arrival_step[s])
            if score > best_score:
                best_score = score
                best = i
        return best

    cdef int _schedule(self) except -1:
        cdef int budget = self.max_num_batched_tokens
        cdef int prefill_budget = budget  # tokens of prompt chunks this step
        cdef int i = 0, s, n, need, bs = self.block_size, m, idx
        cdef bint preempted = False
        cdef BlockAllocator alloc = self.allocator
        self.n_sched = 0
        # requests prefilled elsewhere join the batch first: their next token is one decode
        while self.num_ready > 0 and self.num_running < self.max_num_seqs:
            s = self.ready[0]
            self.num_ready -= 1
            memmove(self.ready, self.ready + 1, self.num_ready * sizeof(int32_t))
            self.running[self.num_running] = s
            self.num_running += 1
            self.r_state[s] = _RUNNING
        # A step that carries decodes stalls every one of them for as long as its prompt chunks
        # take: with decodes running, prompts get at most max_prefill_tokens_with_decodes.
        if self.max_prefill_tokens_with_decodes:
            for i in range(self.num_running):
                s = self.running[i]
                if self.r_num_tokens[s] - self.r_num_computed[s] == 1:
                    prefill_budget = min(budget, self.max_prefill_tokens_with_decodes)
                    break
            i = 0
        # 1. running requests, oldest first: a decode needs 1 token, a prompt its next chunk
        while i < self.num_running and budget > 0:
            s = self.running[i]
            n = min(self.r_num_tokens[s] - self.r_num_computed[s], budget)
            if n > 1:
                n = min(n, prefill_budget)
                if n == 0:
                    i += 1
                    continue  # its next chunk waits for a step with room
            need = _cdiv(self.r_num_computed[s] + n, bs) - self.r_nblocks[s]
            while need > alloc.n_list:
                preempted = True
                self._preempt(self.running[self.num_running - 1])
                if self.r_state[s] != _RUNNING:
                    break
            if self.r_state[s] != _RUNNING:
                break  # s itself was the newest: it waits for blocks
            if need > 0:
                alloc._alloc(need, self.r_blocks[s] + self.r_nblocks[s])
                self.r_nblocks[s] += need
            self.sched_slot[self.n_sched] = s
            self.sched_n[self.n_sched] = n
            self.n_sched += 1
            budget -= n
            if n > 1:
                prefill_budget -= n
            i += 1
        # 2. admit waiting requests while budget, rows and blocks allow (not after a preemption)
        budget = min(budget, prefill_budget)
        while (not preempted and budget > 0 and self.num_waiting > 0
               and self.num_running < self.max_num_seqs):
            idx = self._pick_waiting()
            s = self.waiting[idx]
            m = 0
            if self.cache is not None:
                m = self.cache._match(self.r_tokens[s], self.cache._match_cap(self.r_num_tokens[s], True),
                                      self.r_blocks[s])
            n = self.r_num_tokens[s] - m * bs
            if n > budget:
                if not self.chunked_prefill:
                    break
                n = budget
            need = _cdiv(m * bs + n, bs) - m
            if need + alloc._evictable_in(self.r_blocks[s], m) > alloc.n_list:
                break  # not enough blocks: keep the queue order, try next step
            # commit: hold the matched path, then allocate the rest
            alloc._acquire_path(self.r_blocks[s], m)
            alloc._alloc(need, self.r_blocks[s] + m)
            self.r_nblocks[s] = m + need
            self.r_num_computed[s] = m * bs  # recomputed on every admission (preempted requests too)
            self.r_inserted[s] = m
            if self.r_preemptions[s] == 0:
                self.r_cached_tokens[s] = m * bs
            if self.cache is not None:
                self.cache._count_query(self.r_num_tokens[s], m)
            self._remove_waiting(idx)
            self.running[self.num_running] = s
            self.num_running += 1
            self.r_state[s] = _RUNNING
            self.sched_slot[self.n_sched] = s
            self.sched_n[self.n_sched] = n
            self.n_sched += 1
            budget -= n
        self._write_plan()
        self.in_flight = True
        self.step_count += 1
        return 0

    cdef void _write_plan(self) noexcept:
        cdef StepPlan plan = self.plan
        cdef int k, s, n, j, pos, c, nb, row = 0, t = 0, samples = 0, pass_
        cdef int bs = self.block_size, width = plan.width
        cdef int32_t* toks
        cdef int32_t* blocks
        cdef int32_t* bt_row
        plan.p_qsl[0] = 0
        for pass_ in range(2):  # decode rows (one token) first, then prompt chunks
            for k in range(self.n_sched):
                n = self.sched_n[k]
                if (n == 1) != (pass_ == 0):
                    continue
                s = self.sched_slot[k]
                c = self.r_num_computed[s]
                toks = self.r_tokens[s]
                blocks = self.r_blocks[s]
                for j in range(n):
                    pos = c + j
                    plan.p_input_ids[t] = toks[pos]
                    plan.p_positions[t] = pos
                    plan.p_slot_mapping[t] = <int64_t>blocks[pos // bs] * bs + pos % bs
                    t += 1
                nb = self.r_nblocks[s]
                bt_row = plan.p_block_tables + <int64_t>row * width
                memcpy(bt_row, blocks, nb * sizeof(int32_t))
                if plan.row_width[row] > nb:  # stale columns from a longer request
                    memset(bt_row + nb, 0, (plan.row_width[row] - nb) * sizeof(int32_t))
                plan.row_width[row] = nb
                plan.p_seq_lens[row] = c + n
                plan.p_qsl[row + 1] = t
                if c + n == self.r_num_tokens[s]:
                    plan.p_logits_indices[samples] = t - 1
                    plan.p_sample_slots[samples] = s
                    plan.p_sample_req_ids[samples] = self.r_id[s]
                    samples += 1
                self.r_num_computed[s] = c + n
                row += 1
            if pass_ == 0:
                plan.num_decode_rows = row
        plan._clear_tail(t, row, samples)

    cdef int _stop_reason(self, int s, int32_t tok) noexcept nogil:
        cdef int i, out = self.r_num_tokens[s] - self.r_prompt_len[s]
        if out >= self.r_min_tokens[s]:
            if not self.r_ignore_eos[s]:
                for i in range(self.n_eos):
                    if tok == self.eos_ids[i]:
                        return _FINISH_STOP
            for i in range(self.r_nstop[s]):
                if tok == self.r_stop_ids[s][i]:
                    return _FINISH_STOP
        if out >= self.r_max_tokens[s] or self.r_num_tokens[s] >= self.max_model_len:
            return _FINISH_LENGTH
        return _FINISH_NONE

    cdef int _update(self, const int64_t* sampled) except -1:
        cdef StepPlan plan = self.plan
        cdef int k, s, reason, events = 0
        cdef int64_t tok, limit = self.vocab_size if self.vocab_size > 0 else 2147483648
        for k in range(plan.num_samples):
            tok = sampled[k]
            if tok < 0 or tok >= limit:
                # checked before anything changes, so the step can be retried with good tokens
                raise ValueError(f"sampled token id {tok} (row {k}) is outside [0, {limit})")
        for k in range(plan.num_samples):
            s = plan.p_sample_slots[k]
            if self.r_aborted[s]:
                continue
            tok = sampled[k]
            self.r_tokens[s][self.r_num_tokens[s]] = <int32_t>tok
            self.r_num_tokens[s] += 1
            reason = self._stop_reason(s, <int32_t>tok)
            if reason == _FINISH_NONE and self.r_prefill_only[s]:
                reason = _FINISH_REMOTE
            self.e_req_ids[events] = self.r_id[s]
            self.e_tokens[events] = <int32_t>tok
            self.e_finish[events] = reason
            events += 1
            if reason == _FINISH_REMOTE:
                # keep the blocks for the KV transfer; what was computed is cached now
                self._cache_blocks(s)
                self._remove_running(s)
                self.r_state[s] = _HELD
                self.num_held += 1
            elif reason != _FINISH_NONE:
                self._drop(s)
        for k in range(self.n_sched):
            s = self.sched_slot[k]
            if self.r_aborted[s]:
                self._drop(s)
            elif (self.r_state[s] == _RUNNING and self.r_num_computed[s] >= self.r_prompt_len[s]
                  and self.r_inserted[s] < self.r_prompt_len[s] // self.block_size):
                # prompt done: cache it now so concurrent requests with the same prefix share
                # it (generated blocks are cached when the request finishes or is preempted)
                self._cache_blocks(s)
        self.in_flight = False
        return events

    # -- inspection --------------------------------------------------------------------------

    cdef int _slot(self, int64_t req_id) except -1:
        slot = self.slot_of.get(req_id)
        if slot is None:
            raise KeyError(f"unknown request {req_id}")
        return slot

    def slot_of_request(self, int64_t req_id):
        return self._slot(req_id)

    def has_request(self, int64_t req_id):
        return req_id in self.slot_of

    def request_state(self, int64_t req_id):
        """A dict describing one live request (for tests, debugging and the RPC layer)."""
        cdef int s = self._slot(req_id)
        cdef int n = self.r_num_tokens[s]
        tokens = np.empty(n, dtype=np.int32)
        memcpy(_as_int32_ptr(tokens), self.r_tokens[s], n * sizeof(int32_t))
        blocks = np.empty(self.r_nblocks[s], dtype=np.int32)
        if blocks.size:
            memcpy(_as_int32_ptr(blocks), self.r_blocks[s], blocks.size * sizeof(int32_t))
        return {
            "state": STATE_NAMES[self.r_state[s]],
            "slot": s,
            "token_ids": tokens,
            "prompt_len": self.r_prompt_len[s],
            "num_tokens": n,
            "num_computed_tokens": self.r_num_computed[s],
            "block_ids": blocks,
            "cached_prompt_tokens": self.r_cached_tokens[s],
            "num_preemptions": self.r_preemptions[s],
            "aborted": bool(self.r_aborted[s]),
        }

    def cached_prompt_tokens(self, int64_t req_id):
        """Prompt tokens the prefix cache supplied when the request was first admitted."""
        return self.r_cached_tokens[self._slot(req_id)]

    def waiting_request_ids(self):
        return [self.r_id[self.waiting[i]] for i in range(self.num_waiting)]

    def running_request_ids(self):
        return [self.r_id[self.running[i]] for i in range(self.num_running)]

    def stats(self):
        """Counters for the server's metrics and the master's routing; O(1)."""
        cdef BlockAllocator a = self.allocator
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_held": self.num_held,
            "num_reserved": self.num_reserved,
            "num_ready": self.num_ready,
            "queued_prompt_tokens": self.queued_prompt_tokens,
            "num_blocks": a.num_blocks - 1,
            "free_blocks": a.n_list - a.n_cached_in_list,
            "evictable_blocks": a.n_cached_in_list,
            "used_blocks": a.num_blocks - 1 - a.n_list,
            "cached_blocks": a.n_cached,
            "kv_cache_usage": <double>(a.num_blocks - 1 - a.n_list) / (a.num_blocks - 1),
            "num_preemptions": self.num_preemptions,
            "prefix_cache_queries": self.cache.num_queries if self.cache is not None else 0,
            "prefix_cache_query_tokens": self.cache.query_tokens if self.cache is not None else 0,
            "prefix_cache_hit_tokens": self.cache.hit_tokens if self.cache is not None else 0,
            "num_steps": self.step_count,
        }

    @property
    def has_unfinished(self):
        return self.num_running > 0 or self.num_waiting > 0 or self.num_ready > 0

    def check_integrity(self):
        """Assert the scheduler's invariants and those of the allocator and cache below it."""
        cdef int s, i, b, n_live = 0
        cdef BlockAllocator alloc = self.allocator
        if self.cache is not None:
            self.cache.check_integrity()
        else:
            alloc.check_integrity()
        holders = np.zeros(alloc.num_blocks, dtype=np.int64)
        counted = {"running": 0, "waiting": 0, "held": 0, "reserved": 0, "ready": 0}
        queued = 0
        for s in range(self.max_requests):
            if self.r_state[s] == _FREE:
                continue
            n_live += 1
            assert self.slot_of.get(self.r_id[s]) == s, f"slot {s} not in the id map"
            assert 0 < self.r_prompt_len[s] <= self.r_num_tokens[s] <= self.r_capacity[s]
            assert 0 <= self.r_num_computed[s] <= self.r_num_tokens[s]
            if self.r_state[s] == _WAITING:
                counted["waiting"] += 1
                queued += self.r_num_tokens[s]
                assert self.r_nblocks[s] == 0, f"waiting slot {s} holds blocks"
                assert self.r_num_computed[s] == 0, f"waiting slot {s} keeps a stale computed count"
            else:
                counted[STATE_NAMES[self.r_state[s]]] += 1
                assert self.r_nblocks[s] == _cdiv(self.r_num_computed[s], self.block_size), \
                    f"slot {s}: {self.r_nblocks[s]} blocks for {self.r_num_computed[s]} computed tokens"
                for i in range(self.r_nblocks[s]):
                    b = self.r_blocks[s][i]
                    assert 0 < b < alloc.num_blocks, f"slot {s} holds invalid block {b}"
                    holders[b] += 1
        assert counted["running"] == self.num_running, "running count drifted"
        assert counted["waiting"] == self.num_waiting, "waiting count drifted"
        assert counted["held"] == self.num_held, "held count drifted"
        assert counted["reserved"] == self.num_reserved, "reserved count drifted"
        assert counted["ready"] == self.num_ready, "ready count drifted"
        assert len({self.ready[i] for i in range(self.num_ready)}) == self.num_ready, "request twice in ready"
        assert queued == self.queued_prompt_tokens, "queued prompt tokens drifted"
        assert n_live == len(self.slot_of) == self.max_requests - self.n_free_slots, "slots leaked"
        assert self.num_running <= self.max_num_seqs
        assert len(set(self.running_request_ids())) == self.num_running, "request twice in running"
        assert len(set(self.waiting_request_ids())) == self.num_waiting, "request twice in waiting"
        for b in range(1, alloc.num_blocks):
            assert alloc.ref[b] == holders[b], f"block {b}: refcount {alloc.ref[b]} but {holders[b]} holders"
