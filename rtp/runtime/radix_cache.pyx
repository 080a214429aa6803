# cython: language_level=3
"""The RadixCache: a block-granular radix tree over token ids whose values are the
BlockAllocator's block ids, all in C arrays. The invariant it keeps with the allocator
(a holder holds its whole root path; evictable blocks are listed leaves first) is told
in block_allocator.pyx."""

from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.stdlib cimport free
from libc.string cimport memcmp, memcpy, memset

import numpy as np
cimport numpy as cnp

from .block_allocator cimport BlockAllocator, BlockCache
from .common cimport _as_int32_ptr, _int32_array, _zeroed

cnp.import_array()


cdef inline uint64_t _mix64(uint64_t x) noexcept nogil:
    # splitmix64 finaliser: a cheap, well-spread 64-bit mix
    x ^= x >> 30
    x *= <uint64_t>0xbf58476d1ce4e5b9
    x ^= x >> 27
    x *= <uint64_t>0x94d049bb133111eb
    x ^= x >> 31
    return x


cdef class RadixCache(BlockCache):
    """Block-granular radix tree over token ids, whose values are KV block ids.

    Each node holds a chain of one or more full blocks (block_size tokens each);
    a child is found from its parent and its first block's tokens through a hash
    table, and every candidate is confirmed by comparing the tokens (memcmp) — a
    hash alone is never trusted. Splitting a node happens only at block
    boundaries. Eviction is driven by the allocator: when it hands out an
    evictable block, the tree gives up that block (always the last block of a
    leaf, by the invariant in block_allocator.pyx).

    Used two ways: by the Scheduler over real KV blocks, and standalone (with an
    allocator of its own, no KV at all) as the FlexLB master's approximate view of
    a worker's cache, through record() and match_prefix().
    """

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

    # -- Python surface ------------------------------------------------------------------

    def match_prefix(self, tokens, bint leave_last=True, bint count=True):
        """Longest cached prefix of tokens, as (block ids, number of tokens matched).

        With leave_last (the default, for a request about to be computed) the match
        stops before the last token, rounded down to a block boundary, so at least
        one token is left to compute and produce logits. Does not take refs: call
        lock(blocks) to keep the matched blocks from eviction. `count=False`: a look
        that is not a request's query (a cache tier copying blocks out), kept out of
        the hit-rate counters.
        """
        arr = _int32_array(tokens, "tokens")
        cdef int n = arr.size
        out = np.empty(self._match_cap(n, leave_last), dtype=np.int32)
        cdef int m = 0
        if out.size:
            m = self._match(_as_int32_ptr(arr), out.size, _as_int32_ptr(out))
        if count:
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


