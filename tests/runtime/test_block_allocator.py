import numpy as np
import pytest

from rtp.runtime import BlockAllocator, RadixCache


def test_null_block_is_never_handed_out():
    a = BlockAllocator(5, 16)
    blocks = a.allocate(4)
    assert sorted(blocks.tolist()) == [1, 2, 3, 4]
    assert a.num_free == 0 and not a.can_allocate(1)
    with pytest.raises(MemoryError):
        a.allocate(1)
    a.check_integrity()


def test_allocate_free_refcounts():
    a = BlockAllocator(8, 4)
    blocks = a.allocate(3)
    assert [a.ref_count(int(b)) for b in blocks] == [1, 1, 1]
    a.acquire(blocks)
    assert [a.ref_count(int(b)) for b in blocks] == [2, 2, 2]
    a.free(blocks)
    assert a.num_used == 3 and a.usage == pytest.approx(3 / 7)
    a.free(blocks)
    assert a.num_used == 0 and a.num_free == 7 and a.usage == 0.0
    a.check_integrity()


def test_bad_input_is_refused_and_changes_nothing():
    a = BlockAllocator(8, 4)
    blocks = a.allocate(2)
    with pytest.raises(ValueError):
        a.free([0])  # the null block
    with pytest.raises(ValueError):
        a.free([8])  # out of range
    with pytest.raises(ValueError):
        a.free([5])  # never allocated
    with pytest.raises(ValueError):
        a.acquire([5])  # free, not cached: allocate instead
    with pytest.raises(ValueError):
        a.allocate(-1)
    with pytest.raises(TypeError):
        a.free([1.5])
    with pytest.raises(ValueError):
        BlockAllocator(1, 4)
    with pytest.raises(ValueError):
        BlockAllocator(4, 0)
    assert a.num_used == 2 and [a.ref_count(int(b)) for b in blocks] == [1, 1]
    a.check_integrity()


def test_truly_free_blocks_are_used_before_cached_ones_are_evicted():
    a = BlockAllocator(9, 2)
    cache = RadixCache(a)
    blocks = a.allocate(2)
    cache.insert([1, 2, 3, 4], blocks)
    a.free(blocks)  # now evictable
    assert a.num_evictable == 2 and a.num_truly_free == 6
    got = a.allocate(6)
    assert not set(got.tolist()) & set(blocks.tolist())
    assert a.num_evictions == 0 and cache.num_cached_blocks == 2
    # the next allocation must evict: the path's tail goes first
    (b,) = a.allocate(1)
    assert b == blocks[1] and a.num_evictions == 1
    assert cache.match_prefix([1, 2, 3, 4, 5])[1] == 2
    cache.check_integrity()


def test_cache_hit_unlinks_an_evictable_block():
    a = BlockAllocator(6, 2)
    cache = RadixCache(a)
    blocks = a.allocate(2)
    cache.insert([7, 7, 8, 8], blocks)
    a.free(blocks)
    matched, n = cache.match_prefix([7, 7, 8, 8, 9])
    assert n == 4 and matched.tolist() == blocks.tolist()
    cache.lock(matched)
    assert a.num_evictable == 0 and a.num_protected == 2 and a.num_free == 3
    assert a.allocate(3).size == 3 and not a.can_allocate(1)
    cache.check_integrity()
    cache.unlock(matched)
    assert a.num_evictable == 2
    cache.check_integrity()


def test_many_pairs_keep_integrity():
    rng = np.random.default_rng(0)
    a = BlockAllocator(50, 16)
    held = []
    for _ in range(2000):
        if held and (rng.random() < 0.5 or not a.can_allocate(1)):
            a.free(held.pop(rng.integers(len(held))))
        else:
            held.append(a.allocate(int(rng.integers(1, min(4, a.num_free) + 1))))
    a.check_integrity()
    assert a.num_used == sum(len(h) for h in held)


def test_freeing_a_block_more_times_than_it_is_held_is_refused():
    a = BlockAllocator(8, 4)
    (b,) = a.allocate(1)
    with pytest.raises(ValueError, match="more times"):
        a.free([b, b])
    assert a.ref_count(int(b)) == 1
    a.acquire([b])
    a.free([b, b])
    assert a.ref_count(int(b)) == 0
    a.check_integrity()
