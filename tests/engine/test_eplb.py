"""EPLB statistics and placement (rtp/engine/eplb.py) on synthetic loads."""

import numpy as np
import pytest

from rtp.engine.eplb import (
    eplb_placement,
    imbalance,
    naive_placement,
    replica_slots,
    static_placement,
)


def zipf_load(layers: int, experts: int, tokens: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, experts + 1) ** 0.6
    out = np.stack([rng.multinomial(tokens, rng.permutation(p / p.sum())) for _ in range(layers)])
    return out.astype(np.int64)


def test_naive_and_static_hold_every_expert_once():
    load = zipf_load(3, 16, 10_000)
    for placement in (naive_placement(3, 16, 4), static_placement(load, 4)):
        assert placement.slots.shape == (3, 4, 4)
        assert (placement.replica_count(16) == 1).all()
    assert (naive_placement(1, 16, 4).slots[0, 1] == [4, 5, 6, 7]).all()


def test_eplb_replicates_the_hottest_and_balances():
    load = zipf_load(4, 64, 200_000)
    extra = replica_slots(64, 8, share=0.1)
    assert extra == 8  # 6.4 rounded up to one per rank
    eplb = eplb_placement(load, 8, extra)
    count = eplb.replica_count(64)
    assert (count >= 1).all() and (count.sum(axis=1) == 64 + extra).all()
    for layer in range(4):  # the copies went to the experts with the most tokens
        assert load[layer][count[layer] > 1].min() >= np.median(load[layer])
        for rank in eplb.slots[layer]:  # no expert twice on one rank
            assert len(set(rank.tolist())) == len(rank)
    naive = imbalance(naive_placement(4, 64, 8).rank_loads(load))
    static = imbalance(static_placement(load, 8).rank_loads(load))
    balanced = imbalance(eplb.rank_loads(load))
    assert (balanced <= static + 1e-9).all() and (static <= naive + 1e-9).all()
    assert balanced.max() < 1.1
    # every token is computed by some rank, exactly once
    assert np.allclose(eplb.rank_loads(load).sum(axis=1), load.sum(axis=1))


def test_dispatch_tables_match_the_slots():
    load = zipf_load(2, 16, 50_000)
    placement = eplb_placement(load, 4, 4)
    table, count = placement.logical_to_physical(16)
    flat = placement.slots.reshape(2, -1)
    for layer in range(2):
        for expert in range(16):
            held = table[layer, expert, : count[layer, expert]]
            assert (flat[layer][held] == expert).all()
            assert (table[layer, expert, count[layer, expert]:] == -1).all()


def test_replica_budget_caps_memory_and_yields_to_the_kv_cache():
    assert replica_slots(256, 16) == 16  # 5 %: 12.8 -> 16, one per rank
    assert replica_slots(256, 16, share=0.2, expert_bytes=10, free_bytes=1000) == 0  # 15 % of 1000 B: 15 slots
    assert replica_slots(256, 16, share=0.2, expert_bytes=1, free_bytes=400) == 48  # 64 wanted, 60 fit
    assert replica_slots(256, 16, kv_usage=0.9) == 0


def test_uneven_splits_are_refused():
    with pytest.raises(ValueError, match="do not split"):
        naive_placement(1, 10, 4)
    with pytest.raises(ValueError, match="do not split"):
        eplb_placement(np.ones((1, 16), dtype=np.int64), 4, 3)
