"""A resizable block pool: BlockAllocator.grow / shrink under a capacity, with and without
a RadixCache, and a Scheduler on top (the random interleavings that resize mid-run are in
test_runtime_properties.py)."""

import numpy as np
import pytest
from runtime_sim import ToyRunner, make_scheduler, oracle, run_to_completion

from rtp.runtime import BlockAllocator, RadixCache


def test_blocks_above_the_limit_are_never_handed_out():
    a = BlockAllocator(5, 4, capacity=9)
    assert (a.num_blocks, a.capacity, a.base) == (5, 9, 5)
    assert sorted(a.allocate(4).tolist()) == [1, 2, 3, 4]
    assert a.num_free == 0 and not a.can_allocate(1)
    with pytest.raises(MemoryError):
        a.allocate(1)
    with pytest.raises(ValueError):
        a.free([6])  # a withheld id is no block of the pool
    a.check_integrity()


def test_counts_and_usage_follow_the_limit():
    a = BlockAllocator(5, 4, capacity=9)
    own = a.allocate(2)
    assert a.num_used == 2 and a.num_free == 2 and a.usage == pytest.approx(2 / 4)
    a.grow(9)
    assert a.num_blocks == 9 and a.num_free == 6 and a.usage == pytest.approx(2 / 8)
    assert a.shrink(5)
    assert a.num_blocks == 5 and a.num_free == 2 and a.usage == pytest.approx(2 / 4)
    a.free(own)
    a.check_integrity()


def test_lent_blocks_are_used_after_the_pools_own():
    a = BlockAllocator(5, 4, capacity=9)
    a.grow(9)
    first, second = a.allocate(4), a.allocate(4)
    assert sorted(first.tolist()) == [1, 2, 3, 4] and second.tolist() == [5, 6, 7, 8]
    a.free(second)
    a.free(first)  # freed last, so at the head either way: the pool's own come first regardless
    assert sorted(a.allocate(4).tolist()) == [1, 2, 3, 4]
    a.check_integrity()


def test_shrink_is_refused_while_a_block_above_the_new_limit_is_used():
    a = BlockAllocator(5, 4, capacity=9)
    a.grow(9)
    a.allocate(4)
    lent = a.allocate(2)  # 5, 6
    assert lent.tolist() == [5, 6]
    before = (a.num_blocks, a.num_free, a.num_used)
    assert not a.can_shrink(5) and not a.shrink(5)
    assert (a.num_blocks, a.num_free, a.num_used) == before  # refused: nothing changed
    assert a.shrink(7)  # 7 and 8 are free: those can go back
    assert a.num_blocks == 7 and a.num_free == 0
    a.free([6])
    assert not a.shrink(5)  # 5 still used
    assert a.shrink(6)
    a.free([5])
    assert a.shrink(5) and a.num_free == 0 and a.num_used == 4
    a.check_integrity()


def test_resize_refuses_limits_out_of_range():
    a = BlockAllocator(5, 4, capacity=9)
    with pytest.raises(ValueError):
        a.grow(10)  # past the capacity
    with pytest.raises(ValueError):
        a.grow(4)  # below the limit: that is shrink()
    with pytest.raises(ValueError):
        a.shrink(6)  # above the limit
    with pytest.raises(ValueError):
        a.shrink(1)  # the null block and one usable block always stay
    with pytest.raises(ValueError):
        BlockAllocator(5, 4, capacity=4)
    assert BlockAllocator(5, 4).capacity == 5
    a.grow(9)
    assert a.shrink(2) and a.num_free == 1
    a.grow(9)  # back above the limit as built: every block is free again
    assert a.num_free == 8
    a.check_integrity()


def _path(a, cache, tokens, blocks):
    blocks = np.asarray(blocks, dtype=np.int32)
    cache.insert(tokens, blocks)
    a.free(blocks)


def test_shrink_evicts_cached_blocks_above_the_limit_and_what_hangs_from_them():
    """Block 6 (lent) is cached mid-path: it goes, with block 2 after it; block 1 before it and
    the other path (3, 4) stay cached and still match."""
    a = BlockAllocator(5, 2, capacity=9)
    cache = RadixCache(a)
    a.grow(9)
    assert a.allocate(8).tolist() == list(range(1, 9))
    a.free([5, 7, 8])
    path_a, path_b = [1, 2, 3, 4, 5, 6], [9, 9, 8, 8]
    _path(a, cache, path_a, [1, 6, 2])
    _path(a, cache, path_b, [3, 4])
    cache.check_integrity()
    assert a.num_cached == 5
    evictions = a.num_evictions
    assert a.shrink(5)
    assert a.num_blocks == 5 and a.num_cached == 3 and a.num_evictions == evictions + 2
    cache.check_integrity()
    assert cache.match_prefix(path_a, leave_last=False)[0].tolist() == [1]
    assert cache.match_prefix(path_b, leave_last=False)[0].tolist() == [3, 4]
    # what is left: 2 truly free, then 1, 3, 4 evicted as needed, never an id of 5 or more
    got = a.allocate(4)
    assert sorted(got.tolist()) == [1, 2, 3, 4] and a.num_cached == 0
    cache.check_integrity()


def test_shrink_is_refused_while_a_cached_block_above_the_limit_is_locked():
    a = BlockAllocator(5, 2, capacity=9)
    cache = RadixCache(a)
    a.grow(9)
    a.allocate(5)  # 1..5, so the path below takes 6 and 7
    path = a.allocate(2)
    assert path.tolist() == [6, 7]
    _path(a, cache, [1, 2, 3, 4], path)
    matched, _ = cache.match_prefix([1, 2, 3, 4, 5])
    cache.lock(matched)
    assert not a.shrink(6)
    assert a.num_cached == 2 and a.num_blocks == 9
    cache.check_integrity()
    cache.unlock(matched)
    assert a.shrink(6) and a.num_cached == 0
    cache.check_integrity()


def test_a_standalone_cache_records_within_the_limit():
    """The FlexLB master's view of a worker (RadixCache.record over an allocator of its own)."""
    a = BlockAllocator(5, 2, capacity=17)
    cache = RadixCache(a)
    for start in range(0, 40, 4):
        cache.record(list(range(start, start + 8)))
        assert a.num_cached <= 4
    a.grow(17)
    for start in range(0, 40, 4):
        cache.record(list(range(100 + start, 100 + start + 8)))
    assert a.num_cached == 16
    cache.check_integrity()
    assert a.shrink(5)
    assert a.num_cached <= 4
    cache.check_integrity()


def test_scheduler_runs_within_the_limit_and_after_a_grow():
    """Admission, allocation and the stats the server reports all use the limit; block tables
    never name a withheld block; outputs match the oracle through a grow and a shrink."""
    vocab, eos = 40, 0
    s = make_scheduler(num_blocks=9, block_size=4, capacity=33, max_num_seqs=4, max_num_batched_tokens=16,
                       max_model_len=32, eos_token_ids=[eos], vocab_size=vocab)
    a = s.allocator
    assert s.stats()["num_blocks"] == 8
    r = ToyRunner(s, vocab)
    rng = np.random.default_rng(0)
    prompts = {rid: rng.integers(1, vocab, int(rng.integers(4, 20))).tolist() for rid in range(24)}
    outs = {}
    seen = set()

    def run(rids):
        for rid in rids:
            s.add_request(rid, prompts[rid], max_tokens=12)
        while s.has_unfinished:
            for q, tok, _ in r.step():
                outs.setdefault(q, []).append(tok)
            seen.update(s.plan.block_tables.flatten().tolist())
            assert s.stats()["used_blocks"] <= a.num_blocks - 1
            s.check_integrity()

    run(range(8))
    assert max(seen) < 9 and s.num_preemptions > 0  # 8 blocks for 4 rows: tight
    a.grow(33)
    stats = s.stats()
    assert stats["num_blocks"] == 32 and stats["kv_cache_usage"] == 0.0
    run(range(8, 16))
    assert max(seen) >= 9  # the lent blocks were used
    assert a.shrink(9)
    seen.clear()
    run(range(16, 24))
    assert max(seen) < 9
    for rid, prompt in prompts.items():
        assert outs[rid] == oracle(prompt, min(12, 32 - len(prompt)), vocab, {eos})
    assert run_to_completion(r) == {} and a.num_used == 0
