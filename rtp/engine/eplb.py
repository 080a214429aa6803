"""EPLB: the placement of experts (and their replicas) on ranks.

With expert parallelism the rank that holds a hot expert is every MoE layer's
straggler: the layer waits for its slowest rank. EPLB, as DeepSeek and RTP-LLM run
it, answers with two moves computed from the measured load of each logical expert:

  replicate  the hottest experts get extra copies in spare physical slots, and the
             dispatch deals an expert's tokens evenly across its copies
             (rtp/models/moe.py: logical_to_physical, replica_count);
  place      copies go to ranks so that the most loaded rank carries as little as
             possible (greedy balanced packing, heaviest first, each rank holding the
             same number of slots).

`naive_placement` (contiguous blocks of E / N experts) and `static_placement`
(load-aware packing, no replicas) are the baselines the benchmark compares with.
Everything here is numpy over [layers, experts] loads: no torch, no model. The loads
come from the MoE layers' counters over a window of steps (ExpertBalancer.window_load,
rtp/engine/expert_balancer.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Placement:
    """Which logical expert each physical slot of each rank holds, per layer: slots [layers,
    ranks, slots_per_rank] (-1: empty)."""

    slots: np.ndarray

    @property
    def num_ranks(self) -> int:
        return self.slots.shape[1]

    def replica_count(self, num_experts: int) -> np.ndarray:
        """[layers, experts]: copies of each expert."""
        layers = self.slots.shape[0]
        count = np.zeros((layers, num_experts), dtype=np.int64)
        for layer in range(layers):
            held = self.slots[layer].reshape(-1)
            np.add.at(count[layer], held[held >= 0], 1)
        return count

    def logical_to_physical(self, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
        """The dispatch tables of rtp/models/moe.py: [layers, experts, max_replicas] global slot
        ids (slot = rank * slots_per_rank + index; -1 past replica_count) and replica_count."""
        count = self.replica_count(num_experts)
        table = np.full((*count.shape, max(1, int(count.max()))), -1, dtype=np.int64)
        filled = np.zeros_like(count)
        for layer in range(self.slots.shape[0]):
            for slot, expert in enumerate(self.slots[layer].reshape(-1)):
                if expert >= 0:
                    table[layer, expert, filled[layer, expert]] = slot
                    filled[layer, expert] += 1
        return table, count

    def rank_loads(self, load: np.ndarray) -> np.ndarray:
        """[layers, ranks]: tokens each rank computes when every expert's load splits evenly
        across its copies."""
        count = self.replica_count(load.shape[1])
        per_copy = np.where(count > 0, load / np.maximum(count, 1), 0.0)
        out = np.zeros(self.slots.shape[:2])
        for layer in range(self.slots.shape[0]):
            held = self.slots[layer]
            out[layer] = np.where(held >= 0, per_copy[layer][np.maximum(held, 0)], 0.0).sum(axis=1)
        return out


def imbalance(rank_loads: np.ndarray) -> np.ndarray:
    """Per layer: the most loaded rank's tokens over the least loaded rank's (inf if one is idle)."""
    low = rank_loads.min(axis=1)
    with np.errstate(divide="ignore"):
        return np.where(low > 0, rank_loads.max(axis=1) / np.where(low > 0, low, 1), np.inf)


def naive_placement(num_layers: int, num_experts: int, num_ranks: int) -> Placement:
    """Contiguous blocks: rank r holds experts [r E/N, (r + 1) E/N)."""
    _check_split(num_experts, num_ranks)
    per = num_experts // num_ranks
    slots = np.arange(num_experts).reshape(num_ranks, per)
    return Placement(np.broadcast_to(slots, (num_layers, num_ranks, per)).copy())


def static_placement(load: np.ndarray, num_ranks: int) -> Placement:
    """Load-aware placement without replicas: E / N experts per rank, packed heaviest first."""
    num_experts = load.shape[1]
    _check_split(num_experts, num_ranks)
    counts = np.ones_like(load, dtype=np.int64)
    return Placement(np.stack([_pack(load[layer], counts[layer], num_ranks, num_experts // num_ranks)
                               for layer in range(load.shape[0])]))


def replica_slots(num_experts: int, num_ranks: int, *, share: float = 0.05, expert_bytes: int = 0,
                  free_bytes: int | None = None, memory_cap: float = 0.15, kv_usage: float = 0.0,
                  kv_pressure: float = 0.85) -> int:
    """Extra slots for replicas: `share` of the experts, rounded up to a multiple of the ranks
    (every rank holds as many slots), fewer where the replicas' bytes would pass `memory_cap`
    of the free device memory, none once the KV cache is over `kv_pressure` full (replicas
    are dropped first, to give memory back to the cache)."""
    if kv_usage > kv_pressure:
        return 0
    extra = -(-int(np.ceil(num_experts * share)) // num_ranks) * num_ranks
    if free_bytes is not None and expert_bytes > 0:
        affordable = int(memory_cap * free_bytes // expert_bytes)
        extra = min(extra, affordable // num_ranks * num_ranks)
    return extra


def eplb_placement(load: np.ndarray, num_ranks: int, extra_slots: int) -> Placement:
    """Replicas, then placement. `extra_slots` (a multiple of num_ranks) go one at a time to
    the expert whose copies carry the most tokens each; then every copy is packed onto the
    ranks heaviest first, (E + extra) / N slots per rank, never two copies of an expert on
    one rank while another rank could take it."""
    num_layers, num_experts = load.shape
    _check_split(num_experts + extra_slots, num_ranks)
    if extra_slots % num_ranks:
        raise ValueError(f"{extra_slots} replica slots do not split over {num_ranks} ranks")
    per_rank = (num_experts + extra_slots) // num_ranks
    layers = []
    for layer in range(num_layers):
        counts = np.ones(num_experts, dtype=np.int64)
        for _ in range(extra_slots):
            hottest = int(np.argmax(load[layer] / counts))
            counts[hottest] += 1
        layers.append(_pack(load[layer], counts, num_ranks, per_rank))
    return Placement(np.stack(layers))


def _pack(load: np.ndarray, counts: np.ndarray, num_ranks: int, per_rank: int) -> np.ndarray:
    """Copies of each expert (counts[e] of them, each carrying load[e] / counts[e]) onto ranks of
    per_rank slots: heaviest copy first, to the least loaded rank with a free slot (preferring
    ranks without a copy of that expert). Returns slots [ranks, per_rank]."""
    copies = [(load[e] / counts[e], e) for e in range(len(load)) for _ in range(counts[e])]
    copies.sort(key=lambda c: (-c[0], c[1]))
    slots = np.full((num_ranks, per_rank), -1, dtype=np.int64)
    used = np.zeros(num_ranks, dtype=np.int64)
    carried = np.zeros(num_ranks)
    for tokens, expert in copies:
        free = used < per_rank
        fresh = free & ~(slots == expert).any(axis=1)
        candidates = np.flatnonzero(fresh if fresh.any() else free)
        rank = candidates[np.argmin(carried[candidates])]
        slots[rank, used[rank]] = expert
        used[rank] += 1
        carried[rank] += tokens
    return slots


def _check_split(slots: int, num_ranks: int) -> None:
    if num_ranks < 1 or slots % num_ranks:
        raise ValueError(f"{slots} expert slots do not split evenly over {num_ranks} ranks")
