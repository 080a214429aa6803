"""EPLB while serving: the engine-side loop around rtp/engine/eplb.py and FusedMoE.place.

The MoE layers count the (token, expert) pairs their routers send to each logical
expert into preallocated counters, inside the forward (graph-safe, no host sync).
This loop reads them only when it needs them:

| when                                  | what                                                  |
|---------------------------------------|-------------------------------------------------------|
| a step that starts a window           | snapshot the counters (a device copy, no host sync)  |
| every `interval` steps                | load = counters now - the window's snapshot (the one |
|                                       | host read); eplb_placement over `ranks`; move weights |
| KV use > `kv_pressure` with replicas  | the same at once, with no replicas                    |
| a plan that would not relieve a layer | that layer keeps its placement (no move)              |

Only rank 0 plans (it alone knows the KV use); it sends the slots to the other ranks
(rtp/engine/tensor_parallel.py) and every rank then calls `apply` at the same point
between two steps, so the weight moves' all-to-alls (expert parallelism) pair up.
The counters count every token on every rank, so rank 0's are the global load.

Memory. Replica slots are preallocated in each layer's stacked weights at load
(`num_redundant_experts` of them, capped so that they take at most `memory_cap` of the
memory free beside the weights). Dropping replicas under KV pressure gives that memory to
the KV cache, on a CPU:

| step (rank 0 decides, every rank does the same)           | where                      |
|-----------------------------------------------------------|----------------------------|
| the plan empties the spare slots (every expert keeps one) | plan(pressured=True)       |
| apply: each emptied slot's whole pages go back to the OS  | FusedMoE.release (madvise) |
| the pool is lent the blocks those bytes pay for           | BlockAllocator.grow        |
| pressure gone, a plan with replicas: the lent blocks come | BlockAllocator.shrink      |
| back first (refused while one holds KV: no replicas yet)  | ExpertBalancer.wait_for_kv |
| their KV pages go back to the OS, then place() refills    | kv_cache.release_blocks    |

The KV cache is allocated at start for the pool's capacity (the budget's blocks plus
`lendable_kv_blocks`), in anonymous memory committed only as blocks are written, so the
blocks it may be lent cost nothing until used; its tensors, like the weights, never move.
Pressure is judged against the pool as built (the one the replicas leave), so a pool grown
into their memory does not call them back at once. The stacks are page-aligned, so a slot
whose bytes are a multiple of the page gives back all of them: for Qwen3-30B-A3B's shape
in bf16, 8 spare slots of 9 MiB per layer release 72 MiB of resident memory in about 1 ms,
and 48 layers lend the pool 2304 blocks of 16 tokens (`python tools/bench_eplb_kv.py`);
the test Mixtral's 2 layers x 4 slots of 84 KiB lend 84 blocks. A slot smaller than a page
lends nothing (logged once). On CUDA there is no madvise: dropped replicas' slots stay
allocated (logged once) and the pool keeps its size, its budget having been taken from
the memory free after the weights, spare slots included. With several ranks rank 0 lends
its own pool what its own slots released; followers mirror its limit (tensor_parallel.py).

Moving weights keeps every tensor's address (place() copies in place), so captured
graphs (CUDA graphs, Inductor without freezing) stay valid across a rebalance.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from rtp.distributed import world_size
from rtp.engine.component import Component
from rtp.engine.eplb import Placement, eplb_placement, imbalance, replica_slots
from rtp.engine.kv_cache import release_blocks

log = logging.getLogger("rtp.eplb")


def logical_ranks(num_experts: int, ep: int, requested: int = 0) -> int:
    """Ranks the planner balances over: the expert-parallel ranks, or in one process
    `requested` logical ranks (0: the largest of 8, 4, 2 that leaves each rank at least two
    experts; replica slots come in multiples of the ranks, so few experts want few ranks)."""
    if ep > 1:
        return ep
    if requested:
        if num_experts % requested:
            raise ValueError(f"eplb_num_ranks {requested} does not split {num_experts} experts")
        return requested
    return next((n for n in (8, 4, 2) if num_experts % n == 0 and num_experts >= 2 * n), 1)


def redundant_slots(num_experts: int, num_ranks: int, *, requested: int | None, share: float,
                    slot_bytes: int, free_bytes: int, memory_cap: float) -> int:
    """Spare slots per MoE layer: `requested` (rounded up to a multiple of the ranks) or
    `share` of the experts, never more than `memory_cap` of `free_bytes` pays for when
    one slot (in every MoE layer) costs `slot_bytes`."""
    capped = replica_slots(num_experts, num_ranks, share=1.0, expert_bytes=slot_bytes, free_bytes=free_bytes,
                           memory_cap=memory_cap)
    if requested is None:
        return min(capped, replica_slots(num_experts, num_ranks, share=share))
    wanted = -(-requested // num_ranks) * num_ranks
    if wanted > capped:
        log.warning("num_redundant_experts %d: %d fit in %.0f %% of %.1f GiB free memory", requested, capped,
                    memory_cap * 100, free_bytes / 2**30)
    return min(wanted, capped)


def lendable_kv_blocks(layers, block_bytes: int) -> int:
    """KV blocks the pool may be lent when every replica is dropped: per MoE layer the bytes
    its emptiest rank could give back (at most `spare` of its slots empty, every expert keeps
    one), over what a block costs. Sizes the KV cache's capacity; 0 off the CPU."""
    total = 0
    for m in layers:
        sizes = sorted((m.releasable(s) for s in range(m.local_slots)), reverse=True)
        total += sum(sizes[: min(m.local_slots, m.num_slots - m.num_experts)])
    return total // block_bytes if block_bytes else 0


@dataclass
class Rebalance:
    """Rank 0's decision: new slots [layers, num_slots] and what they were judged on."""

    slots: np.ndarray
    load: np.ndarray    # [layers, experts]: the window's routed pairs it was made from
    before: np.ndarray  # per layer max/min rank load of the current placement, on the window's load
    after: np.ndarray   # the same for the new placement
    reason: str         # "interval" | "kv pressure"


class ExpertBalancer(Component):
    """The EPLB loop over the MoE layers (FusedMoE) of one model; see the module docstring. An engine
    component: it rebalances after a step (channel: the tensor-parallel plan channel, set by the
    builder when ranks follow)."""

    name = "eplb"

    def __init__(self, layers, *, num_ranks: int, window: int, interval: int, kv_pressure: float,
                 kv_block_bytes: int = 0, kv_base: int = 0, kv_capacity: int = 0):
        self.channel = None
        if not layers:
            raise ValueError("EPLB needs a model with MoE layers")
        self.layers = list(layers)
        self.num_experts = self.layers[0].num_experts
        self.num_slots = self.layers[0].num_slots
        if any((m.num_experts, m.num_slots) != (self.num_experts, self.num_slots) for m in self.layers):
            raise ValueError("EPLB needs every MoE layer to have the same experts and slots")
        if self.num_experts % num_ranks or self.num_slots % num_ranks:
            raise ValueError(f"{self.num_experts} experts in {self.num_slots} slots do not split over "
                             f"{num_ranks} ranks")
        self.num_ranks = num_ranks
        self.spare = self.num_slots - self.num_experts
        self.window, self.interval, self.kv_pressure = window, interval, kv_pressure
        # as loaded: expert e in slot e, spare slots empty
        self.current = np.full((len(self.layers), self.num_slots), -1, dtype=np.int64)
        self.current[:, : self.num_experts] = np.arange(self.num_experts)
        self.steps = 0
        self._snapshots = {0: self._counters()}  # step -> counters then (warm-up's steps excluded)
        # Memory given back. A slot is released when a placement empties it (replicas dropped)
        # and stays released while it stays empty; the spare slots as loaded are empty but not
        # released: they are what the replicas were budgeted. slot_bytes: what each gives back
        # (its whole pages; 0 for another rank's slots and off the CPU).
        self.released = np.zeros((len(self.layers), self.num_slots), dtype=bool)
        self.slot_bytes = np.zeros((len(self.layers), self.num_slots), dtype=np.int64)
        for i, m in enumerate(self.layers):
            for k in range(m.local_slots):
                self.slot_bytes[i, m.slot_offset + k] = m.releasable(k)
        # the KV pool's limit as built (what pressure is judged against), its capacity, a block's cost
        self.kv_block_bytes, self.kv_base, self.kv_capacity = kv_block_bytes, kv_base, max(kv_capacity, kv_base)
        self.kv_limit = kv_base
        self.kv_blocks_gained = self.kv_blocks_returned = 0
        self.kv_waits = 0  # plans with replicas put off because lent KV blocks were still in use
        self._said_kept = False
        # what /metrics shows
        self.rebalances = 0
        self.move_seconds = 0.0
        # per layer max/min rank load over the last window: of the placement that served it
        # (what the ranks went through), and of the plan made from it (in-sample, so lower)
        self.ratio = np.full(len(self.layers), np.nan)
        self.planned_ratio = np.full(len(self.layers), np.nan)
        self.history: deque[dict] = deque(maxlen=64)  # rank 0's latest rebalances, as logged
        self._stats: dict | None = None

    def _counters(self) -> torch.Tensor:
        return torch.stack([m.expert_load for m in self.layers])

    # -- the engine's hooks: after a step (rank 0), on a rebalance rank 0 sent (the others) ---------

    def after_step(self, step) -> None:
        core = step.core
        self.between_steps(core.scheduler.allocator, core.runner.kv_tensors, self.channel)

    def between_steps(self, allocator, kv_caches, channel=None) -> None:
        """Rank 0, after each step: a due plan, made here and applied on every rank before the
        next step (channel: the tensor-parallel plan channel, or None alone).

        The KV pool is resized around the move: lent blocks go back (shrink) before replicas
        take their memory again, and are lent (grow) only after the replicas have left it. A plan
        whose shrink is refused (lent blocks still hold KV) is not applied. Pressure is judged
        against the pool as built, the one the replicas leave: a pool grown into their memory
        would otherwise look relieved and call them back at once."""
        decision = self.count_step(allocator.num_used / max(1, allocator.base - 1))
        if decision is None:
            return
        old, limit = allocator.num_blocks, self.kv_limit_after(decision.slots)
        if limit < old and not allocator.shrink(limit):
            self.wait_for_kv(decision, old - limit)
            return
        if channel is not None:
            channel.send_rebalance(decision.slots, limit)
        self._move(decision.slots, old, limit, allocator, kv_caches, decision)

    def follow(self, slots: np.ndarray, limit: int, allocator, kv_caches) -> None:
        """A follower rank: rank 0's rebalance, with the KV limit rank 0 moves to (this rank's
        allocator holds no blocks, so it mirrors the limit without refusal)."""
        old = allocator.num_blocks
        if limit < old:
            allocator.shrink(limit)
        self._move(slots, old, limit, allocator, kv_caches)

    def _move(self, slots: np.ndarray, old: int, limit: int, allocator, kv_caches, decision=None) -> None:
        if limit < old:  # blocks handed back: their KV pages go before the replicas' come
            release_blocks(kv_caches, limit, old)
        self.apply(slots, decision, kv_limit=limit)
        if limit > old:
            allocator.grow(limit)

    def replicas(self) -> np.ndarray:
        """[layers]: slots holding a second (or later) copy of an expert."""
        return (self.current >= 0).sum(axis=1) - self.num_experts

    # -- rank 0 ------------------------------------------------------------------------------

    def count_step(self, kv_usage: float) -> Rebalance | None:
        """Count a step that ran; a new placement when one is due (None otherwise)."""
        self.steps += 1
        s = self.steps
        pressured = kv_usage > self.kv_pressure
        if (s + self.window) % self.interval == 0:  # the window of the plan at step s + window starts here
            self._snapshots[s] = self._counters()
        if s % self.interval == 0:
            return self.plan(pressured)
        if pressured and self.replicas().any():  # replicas go first, without waiting for the interval
            return self.plan(True)
        return None

    def window_load(self) -> np.ndarray:
        """[layers, experts] int64: pairs routed to each expert since the window's snapshot (the
        latest at or before `window` steps ago, else the oldest); the one host read of the loop."""
        start = self.steps - self.window
        older = [k for k in self._snapshots if k <= start]
        key = max(older) if older else min(self._snapshots)
        for k in [k for k in self._snapshots if k < key]:  # later plans start later still
            del self._snapshots[k]
        return (self._counters() - self._snapshots[key]).cpu().numpy()

    def plan(self, pressured: bool) -> Rebalance | None:
        load = self.window_load()
        if not pressured and not load.any():
            return None  # nothing routed in the window: nothing to balance by
        extra = 0 if pressured else self.spare
        placement = _padded(eplb_placement(load, self.num_ranks, extra), self.num_slots // self.num_ranks)
        placement = Placement(np.stack([_closest(new, old) for new, old in
                                        zip(placement.slots, self._as_placement(self.current).slots)]))
        current = self._as_placement(self.current).rank_loads(load)
        planned = placement.rank_loads(load)
        slots = placement.slots.reshape(len(self.layers), self.num_slots)
        # the packing is greedy, not optimal: a layer whose straggler the plan would not relieve
        # keeps its placement (and its weights stay put), unless it holds replicas under pressure
        keep = current.max(axis=1) <= planned.max(axis=1)
        if pressured:
            keep &= self.replicas() == 0
        slots[keep] = self.current[keep]
        planned[keep] = current[keep]
        before, after = imbalance(current), imbalance(planned)
        self.ratio, self.planned_ratio = before, after
        self._stats = None
        if np.array_equal(slots, self.current):
            return None
        return Rebalance(slots, load, before, after, "kv pressure" if pressured else "interval")

    def _as_placement(self, slots: np.ndarray) -> Placement:
        return Placement(slots.reshape(len(self.layers), self.num_ranks, -1))

    def released_after(self, slots: np.ndarray) -> np.ndarray:
        """[layers, slots] bool: the slots released once `slots` is applied (emptied now, or
        released before and still empty)."""
        return (slots < 0) & (self.released | (self.current >= 0))

    def kv_limit_after(self, slots: np.ndarray) -> int:
        """The KV pool's limit once `slots` is applied: the limit as built plus the blocks the
        released slots' bytes pay for, within the capacity."""
        if not self.kv_block_bytes:
            return self.kv_limit
        lent = int(self.slot_bytes[self.released_after(slots)].sum()) // self.kv_block_bytes
        return min(self.kv_capacity, self.kv_base + lent)

    def wait_for_kv(self, decision: Rebalance, blocks: int) -> None:
        """A plan with replicas that needs `blocks` lent KV blocks back, some still in use: the
        placement in use stays (replica-free) and the next interval's plan tries again."""
        self.kv_waits += 1
        self.planned_ratio = self.ratio.copy()  # nothing applied: the plan in use is the current one
        self._stats = None
        log.info("EPLB at step %d: replicas wait, the KV pool must hand back %d lent blocks first and some "
                 "still hold KV", self.steps, blocks)

    # -- every rank --------------------------------------------------------------------------

    @torch.no_grad()
    def apply(self, slots: np.ndarray, decision: Rebalance | None = None, kv_limit: int | None = None) -> None:
        """Move every layer whose slots changed (between steps; every rank, the same slots), then
        give the released slots' pages back. kv_limit: the KV pool's limit once this is applied
        (kv_limit_after), which the caller shrinks the pool to before and grows it to after."""
        start = time.perf_counter()
        moved = [i for i in range(len(self.layers)) if not np.array_equal(slots[i], self.current[i])]
        # slots whose weights are rewritten (place() leaves the others, and emptied ones, alone)
        rewritten = int(((slots != self.current) & (slots >= 0)).sum())
        released = self.released_after(slots)
        newly = released & ~self.released
        for i in moved:
            self.layers[i].place(slots[i].tolist())
            self.current[i] = slots[i]
        self.released = released
        # every released slot, again: with expert parallelism place() rewrites a layer's whole
        # stack, zeros included, committing their pages anew (a page not present costs nothing)
        for i, k in zip(*np.nonzero(released)):
            m = self.layers[i]
            if m.slot_offset <= k < m.slot_offset + m.local_slots:
                m.release(int(k) - m.slot_offset)
        if newly.any() and not self.slot_bytes[newly].any() and not self._said_kept:
            self._said_kept = True
            log.info("EPLB: the dropped replicas' memory stays allocated (%s), the KV cache keeps its size",
                     "no whole page in a slot" if self.layers[0].w13.device.type == "cpu" else
                     f"no madvise on {self.layers[0].w13.device.type}")
        kv = 0
        if kv_limit is not None:
            kv, self.kv_limit = kv_limit - self.kv_limit, kv_limit
            self.kv_blocks_gained += max(kv, 0)
            self.kv_blocks_returned += max(-kv, 0)
        device = self.layers[0].w13.device
        if device.type == "cuda":  # the copies are asynchronous: time them whole
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        self.rebalances += 1
        self.move_seconds += seconds
        self._stats = None
        if decision is not None:
            self.history.append({"step": self.steps, "reason": decision.reason, "layers_moved": len(moved),
                                 "slots_rewritten": rewritten,
                                 "before_max": float(decision.before.max()), "after_max": float(decision.after.max()),
                                 "before_mean": float(decision.before.mean()),
                                 "after_mean": float(decision.after.mean()),
                                 "replicas": int(self.replicas().max()), "kv_blocks": kv,
                                 "kv_limit": self.kv_limit, "ms": seconds * 1e3})
            log.info("EPLB rebalance %d at step %d (%s): %d/%d layers moved (%d slots rewritten), max/min "
                     "rank load %s -> %s (worst layer), %s -> %s (mean), replicas %d per layer, KV blocks %+d "
                     "(%d lent), %.1f ms",
                     self.rebalances, self.steps, decision.reason, len(moved), len(self.layers), rewritten,
                     _ratio(decision.before.max()), _ratio(decision.after.max()),
                     _ratio(decision.before.mean()), _ratio(decision.after.mean()),
                     int(self.replicas().max()), kv, self.kv_limit - self.kv_base, seconds * 1e3)

    def stats(self) -> dict:
        """For /metrics: rebuilt only when a plan changed something (the engine asks every step)."""
        if self._stats is None:
            self._stats = self._snapshot_stats()
        return self._stats

    def _snapshot_stats(self) -> dict:
        finite = self.ratio[np.isfinite(self.ratio)]
        return {
            "ranks": self.num_ranks,
            "rank_load_ratio": self.ratio.tolist(),
            "rank_load_ratio_max": float(self.ratio.max()),
            "rank_load_ratio_mean": float(finite.mean()) if finite.size else float("nan"),
            "planned_rank_load_ratio": self.planned_ratio.tolist(),
            "replicas": self.replicas().tolist(),
            "spare_slots": self.spare,
            "rebalances": self.rebalances,
            "move_seconds": self.move_seconds,
            "released_slots": self.released.sum(axis=1).tolist(),
            "kv_blocks_lent": self.kv_limit - self.kv_base,
            "kv_blocks_gained": self.kv_blocks_gained,
            "kv_blocks_returned": self.kv_blocks_returned,
            "kv_waits": self.kv_waits,
        }


def _closest(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """The same per-rank sets of experts as `new` [ranks, per_rank], relabelled to move the fewest
    weights from `old`: ranks are interchangeable (a new rank takes the old rank it shares most
    experts with, greedily) and so are a rank's slots (an expert it already holds stays put)."""
    ranks = len(new)
    overlap = np.array([[len(_common(n, o)) for o in old] for n in new])
    order = np.argsort(-overlap, axis=None, kind="stable")
    to_old, taken = {}, set()
    for flat in order:
        n, o = divmod(int(flat), ranks)
        if n not in to_old and o not in taken:
            to_old[n] = o
            taken.add(o)
    out = np.full_like(old, -1)
    for n, o in to_old.items():
        pending = list(new[n][new[n] >= 0])
        free = []
        for k, expert in enumerate(old[o]):
            if expert >= 0 and expert in pending:
                out[o, k] = expert
                pending.remove(expert)
            else:
                free.append(k)
        for k, expert in zip(free, pending):
            out[o, k] = expert
    return out


def _common(a: np.ndarray, b: np.ndarray) -> list[int]:
    rest = list(b[b >= 0])
    out = []
    for x in a[a >= 0]:
        if x in rest:
            rest.remove(x)
            out.append(int(x))
    return out


def _padded(placement: Placement, per_rank: int) -> Placement:
    """A placement with fewer slots per rank (replicas dropped) widened with empty slots."""
    layers, ranks, used = placement.slots.shape
    out = np.full((layers, ranks, per_rank), -1, dtype=np.int64)
    out[:, :, :used] = placement.slots
    return Placement(out)


def _ratio(x: float) -> str:
    return "inf" if not np.isfinite(x) else f"{x:.3f}"


def free_memory(device: torch.device) -> int:
    """Bytes free on the device now (on a CPU: the host's MemAvailable)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def spare_slots_for(eplb, model_config, checkpoint_bytes: int, dtype: torch.dtype,
                    device: torch.device, ep: int) -> tuple[int, int]:
    """(planner ranks, spare slots per MoE layer) for an engine about to load `model_config`
    (eplb: its EPLBConfig).

    The cap is taken against the memory free beside the weights: free memory now, less the
    checkpoint's bytes (this rank's share of them with expert parallelism on CUDA, where
    each rank has its own device and holds 1/ep of the replicas)."""
    mc = model_config
    ranks = logical_ranks(mc.num_experts, ep, eplb.num_ranks)
    moe_layers = sum(mc.is_moe_layer(i) for i in range(mc.num_hidden_layers))
    slot_bytes = 3 * mc.hidden_size * mc.moe_intermediate_size * dtype.itemsize * moe_layers
    per_device = ep if device.type == "cuda" else 1
    free = max(0, free_memory(device) - checkpoint_bytes // per_device) * per_device
    spare = redundant_slots(mc.num_experts, ranks, requested=eplb.num_redundant_experts,
                            share=eplb.replica_share, slot_bytes=slot_bytes, free_bytes=free,
                            memory_cap=eplb.memory_cap)
    log.info("EPLB: %d spare expert slots per MoE layer (%d layers, %.1f MiB in all) over %d ranks",
             spare, moe_layers, spare * slot_bytes / 2**20, ranks)
    return ranks, spare


def eplb_slots(eplb, parallel, path, model_config, dtype: torch.dtype, device: torch.device, compiled: bool
               ) -> tuple[int, int]:
    """(planner ranks, spare expert slots per layer) for --enable-eplb; (0, 0) for a dense model.
    Every rank agrees on the spare slots (each measured its own free memory)."""
    if compiled and os.environ.get("RTP_FREEZE") == "1":  # frozen weights would not see the moves
        raise ValueError("--enable-eplb moves expert weights in place: not with RTP_FREEZE=1 graphs")
    if not model_config.num_experts:
        log.warning("--enable-eplb: %s has no experts; EPLB stays off", model_config.architecture)
        return 0, 0
    files = [path] if path.is_file() else list(path.glob("*.safetensors")) + list(path.glob("*.bin"))
    ranks, spare = spare_slots_for(eplb, model_config, sum(f.stat().st_size for f in files), dtype, device,
                                   parallel.expert_parallel_size)
    if world_size() > 1:
        agreed = torch.tensor([spare])
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
        spare = int(agreed)
    return ranks, spare
