# cython: language_level=3
"""The RadixCache's C surface, for the scheduler to cimport: the tree's arrays, _match
and _insert through the vtable, the two small counters inline."""

from libc.stdint cimport int32_t, int64_t, uint64_t

from .block_allocator cimport BlockAllocator, BlockCache


cdef class RadixCache(BlockCache):
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

    # hashing (radix_cache.pyx)
    cdef inline uint64_t _key(self, int32_t parent, const int32_t* toks) noexcept nogil
    cdef inline void _hash_add(self, int32_t node) noexcept nogil
    cdef inline void _hash_remove(self, int32_t node) noexcept nogil
    cdef inline int32_t _find_child(self, int32_t parent, const int32_t* toks) noexcept nogil
    cdef inline bint _block_equals(self, int32_t b, const int32_t* toks) noexcept nogil

    # the tree (radix_cache.pyx)
    cdef int _match(self, const int32_t* toks, int max_blocks, int32_t* out) noexcept nogil
    cdef int32_t _new_node(self, int32_t parent, const int32_t* blocks, int nblocks,
                           const int32_t* toks) noexcept nogil
    cdef int32_t _split(self, int32_t node, int k) noexcept nogil
    cdef inline int _swap_in(self, int32_t* blocks, int i, int32_t b) except -1
    cdef int _insert(self, const int32_t* toks, int nblocks, int32_t* blocks, int start) except -1
    cdef void _extend(self, int32_t node, const int32_t* blocks, int nblocks, const int32_t* toks) noexcept nogil
    cdef inline void _adopt(self, int32_t b, int32_t node, int32_t prev, const int32_t* toks) noexcept nogil
    cdef inline int32_t _parent_block(self, int32_t b) noexcept nogil

    # BlockCache, for the allocator
    cdef bint _is_root_path(self, const int32_t* blocks, int n) noexcept nogil
    cdef int _evict_block(self, int32_t b) except -1
    cdef int _evict_through(self, int limit) except -2

    # for the scheduler's admission loop
    cdef inline int _match_cap(self, int ntoks, bint leave_last) noexcept nogil:
        if leave_last:
            return (ntoks - 1) // self.block_size if ntoks > 0 else 0
        return ntoks // self.block_size

    cdef inline void _count_query(self, int ntoks, int nblocks) noexcept nogil:
        self.num_queries += 1
        self.query_tokens += ntoks
        self.hit_tokens += <int64_t>nblocks * self.block_size
