import numpy as np
import pytest

from rtp.runtime import BlockAllocator, RadixCache

BS = 4


def fresh(num_blocks=64):
    a = BlockAllocator(num_blocks, BS)
    return a, RadixCache(a)


def put(cache, tokens):
    """Insert tokens' full blocks as a request would, then release them."""
    blocks = cache.allocator.allocate(len(tokens) // BS)
    blocks, shared = cache.insert(tokens, blocks)
    cache.allocator.free(blocks)
    cache.check_integrity()
    return blocks, shared


def test_match_is_capped_below_the_last_token_and_block_aligned():
    a, cache = fresh()
    toks = list(range(100, 112))  # 3 full blocks
    blocks, _ = put(cache, toks)
    # the whole prompt is cached, but one token must be left to compute
    got, n = cache.match_prefix(toks)
    assert n == 8 and got.tolist() == blocks[:2].tolist()
    got, n = cache.match_prefix(toks + [1])
    assert n == 12
    got, n = cache.match_prefix(toks, leave_last=False)
    assert n == 12
    got, n = cache.match_prefix(toks[:7])
    assert n == 4  # rounded down to a block boundary
    assert cache.match_prefix([])[1] == 0
    assert cache.match_prefix([100])[1] == 0


def test_split_keeps_counters_exact():
    a, cache = fresh()
    base = list(range(1, 17))  # 4 blocks in one node
    b1, _ = put(cache, base)
    assert cache.num_nodes == 2
    other = base[:8] + [99] * 8  # diverges after 2 blocks: split the node
    matched, n = cache.match_prefix(other)
    assert n == 8
    cache.lock(matched)
    b2 = a.allocate(2)
    blocks, shared = cache.insert(other, np.concatenate([matched, b2]))
    assert shared == 2 and cache.num_nodes == 4 and cache.num_splits == 1
    assert cache.num_cached_blocks == 6
    assert cache.num_protected_blocks == 4 and cache.num_evictable_blocks == 2
    cache.check_integrity()
    cache.unlock(blocks)
    assert cache.num_protected_blocks == 0 and cache.num_evictable_blocks == 6
    cache.check_integrity()
    # both branches are still found
    assert cache.match_prefix(base, leave_last=False)[0].tolist() == b1.tolist()
    assert cache.match_prefix(other, leave_last=False)[0].tolist() == blocks.tolist()


def test_insert_swaps_a_duplicate_for_the_cached_block():
    a, cache = fresh()
    toks = list(range(50, 62))
    first, _ = put(cache, toks)
    mine = a.allocate(3)  # computed the same tokens again, into other blocks
    free_before = a.num_truly_free
    swapped, shared = cache.insert(toks, mine)
    assert shared == 3
    assert swapped.tolist() == first.tolist() and mine.tolist() == first.tolist()  # in place
    assert a.num_truly_free == free_before + 3  # the duplicates went back
    assert a.num_protected == 3
    cache.check_integrity()
    a.free(swapped)
    cache.check_integrity()


def test_tokens_are_compared_not_just_hashed():
    """Two different blocks under the same parent, however their hashes fall, never match
    each other: the lookup confirms every candidate with memcmp."""
    a, cache = fresh(num_blocks=512)
    rng = np.random.default_rng(7)
    seqs = [rng.integers(0, 3, size=BS * 3).tolist() for _ in range(60)]  # tiny alphabet: many near-equal keys
    for s in seqs:
        put(cache, s)
    for s in seqs:
        got, n = cache.match_prefix(s, leave_last=False)
        assert n == len(s)
        for i, b in enumerate(got):
            # the block found for each position must hold exactly those tokens
            again, m = cache.match_prefix(s[: (i + 1) * BS], leave_last=False)
            assert again[-1] == b and m == (i + 1) * BS
    unseen = [5] * (BS * 2)
    assert cache.match_prefix(unseen, leave_last=False)[1] == 0


def test_hash_collisions_are_resolved_by_comparing_tokens():
    """Force every node into one hash bucket chain by filling a tiny table: a cache with
    more entries than buckets must still answer exactly."""
    a, cache = fresh(num_blocks=8)  # 16 buckets, and keys collide on the low bits often
    put(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    put(cache, [1, 2, 3, 4, 9, 9, 9, 9])
    put(cache, [2, 2, 3, 4])
    assert cache.match_prefix([1, 2, 3, 4, 9, 9, 9, 9], leave_last=False)[1] == 8
    assert cache.match_prefix([1, 2, 3, 4, 9, 9, 9, 8], leave_last=False)[1] == 4
    assert cache.match_prefix([2, 2, 3, 5], leave_last=False)[1] == 0


def test_lru_eviction_takes_unlocked_leaves_first():
    a, cache = fresh(num_blocks=9)  # 8 usable
    old, _ = put(cache, [1] * 8)
    new, _ = put(cache, [2] * 8)
    locked, n = cache.match_prefix([1] * 9)
    cache.lock(locked)
    cache.check_integrity()
    assert cache.evict(3) == 2  # only the unlocked branch can go, tail first
    assert cache.match_prefix([2] * 9)[1] == 0
    assert cache.match_prefix([1] * 9)[1] == 8
    cache.unlock(locked)
    assert cache.evict(100) == 2
    assert cache.num_cached_blocks == 0 and cache.num_nodes == 1
    assert a.num_truly_free == 8
    cache.check_integrity()


def test_eviction_order_follows_recency():
    a, cache = fresh(num_blocks=7)  # 6 usable
    put(cache, [1] * 8)
    put(cache, [2] * 8)
    put(cache, [3] * 8)
    # touch [1]: it becomes the most recently used
    hit, _ = cache.match_prefix([1] * 9)
    cache.lock(hit)
    cache.unlock(hit)
    a.allocate(2)  # evicts the least recently used: [2]
    assert cache.match_prefix([2] * 9)[1] == 0
    assert cache.match_prefix([1] * 9)[1] == 8 and cache.match_prefix([3] * 9)[1] == 8
    cache.check_integrity()


def test_partial_eviction_truncates_a_node_from_its_tail():
    a, cache = fresh(num_blocks=5)  # 4 usable
    put(cache, list(range(16)))  # one node of 4 blocks
    a.allocate(1)
    assert cache.num_cached_blocks == 3
    assert cache.match_prefix(list(range(16)), leave_last=False)[1] == 12
    cache.check_integrity()


def test_standalone_record_mirrors_a_bounded_cache():
    a, cache = fresh(num_blocks=9)  # the master's view of a worker with 8 blocks
    assert cache.record(list(range(16))) == 0
    assert cache.record(list(range(16)) + [99] * 4) == 16
    assert cache.num_cached_blocks == 5
    assert cache.record([7] * 40) == 0  # bigger than the cache: keeps what fits, evicting
    assert cache.num_cached_blocks == 8
    assert a.num_used == 0  # nothing is held in standalone use
    cache.check_integrity()
    assert cache.match_prefix(list(range(16)), leave_last=False)[1] == 0


def test_insert_refuses_bad_blocks():
    a, cache = fresh()
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], [5])  # block 5 is not allocated
    blocks, _ = put(cache, [1, 2, 3, 4])
    mine = a.allocate(1)
    # a block cached under other tokens cannot be inserted elsewhere
    held, _ = cache.match_prefix([1, 2, 3, 4, 0])
    cache.lock(held)
    with pytest.raises(ValueError):
        cache.insert([9, 9, 9, 9], held)
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4, 5, 6, 7, 8], mine)  # too few blocks
    with pytest.raises(ValueError):
        cache.match_prefix([[1, 2]])
    with pytest.raises(ValueError):
        cache.match_prefix([-1, 2, 3])
    cache.check_integrity()


def test_cache_needs_a_fresh_allocator():
    a = BlockAllocator(8, 4)
    RadixCache(a)
    with pytest.raises(ValueError):
        RadixCache(a)
    b = BlockAllocator(8, 4)
    b.allocate(1)
    with pytest.raises(ValueError):
        RadixCache(b)


def test_stats_count_tokens():
    a, cache = fresh()
    put(cache, list(range(8)))
    cache.reset_stats()
    cache.match_prefix(list(range(8)) + [1])
    cache.match_prefix([5] * 8)
    assert cache.num_queries == 2 and cache.query_tokens == 17 and cache.hit_tokens == 8


def test_lock_refuses_a_path_that_does_not_start_at_the_root():
    a, cache = fresh(num_blocks=9)
    cache.record(list(range(1, 9)))  # two blocks, evictable
    blocks, _ = cache.match_prefix(list(range(1, 9)), leave_last=False)
    for bad in (blocks[1:], blocks[::-1]):
        with pytest.raises(ValueError, match="path from the root"):
            cache.lock(bad)
    with pytest.raises(ValueError, match="path from the root"):
        a.acquire(blocks[1:])
    cache.check_integrity()
    a.allocate(8)  # evicts both, tail first, without tripping over a held descendant
    cache.check_integrity()


def test_a_growing_sequence_extends_its_leaf_instead_of_adding_nodes():
    a, cache = fresh(num_blocks=64)
    toks = list(range(1, 41))
    held = a.allocate(10)
    for n in range(1, 11):  # insert after every new block, as a long generation would
        cache.insert(toks[: 4 * n], held[:n])
    assert cache.num_nodes == 2 and cache.num_cached_blocks == 10
    cache.check_integrity()
    a.free(held)
    cache.check_integrity()
