"""Mixture of experts: the router, and the experts stored stacked and computed grouped.

A sparse block is `gate` (a linear: hidden -> one logit per expert), `TopKRouter`
(logits -> each token's top-k experts and their fp32 weights) and `FusedMoE` (the
experts). The experts of a layer live in physical *slots* of two stacked weights,
w13 [num_slots, 2 * inter, hidden] (gate rows, then up rows) and w2 [num_slots,
hidden, inter]. One forward, for T tokens and N = T * top_k (token, expert) pairs:

| step      | what                                                                      |
|-----------|---------------------------------------------------------------------------|
| count     | pairs per logical expert (also added to `expert_load`, EPLB's statistics) |
| sort      | pairs ordered by logical expert (stable); a pair's rank within its expert |
| place     | replica = rank % replica_count[e], slot = logical_to_physical[e, replica]:|
|           | an expert's tokens dealt round-robin across its replicas                  |
| exchange  | the layer's ExpertExchange (rtp/models/expert_parallel.py) from here:    |
|           | with one rank (LocalExchange) the slot groups are laid out contiguous, in |
|           | slot order, a pair's row = its group's start + its rank within its slot;  |
|           | in layers with spare slots each non-empty group is padded to              |
|           | REPRODUCIBLE_GROUP_ROWS rows; with expert parallelism pairs travel to the |
|           | rank holding their slot and back (all_to_all_single, micro-chunked)       |
| compute   | one grouped GEMM over w13, SiLU * up, one grouped GEMM over w2            |
| combine   | out[t] = sum over k (in k order) of weight[t, k] * y[row(t, k)], in fp32  |

With one rank nothing on this path syncs with the host or loops in Python where
`torch._grouped_mm` takes the dtype, so it can be captured in a graph (the
expert-parallel exchange reads its counts on the host: it runs eagerly).

Nothing on this path syncs with the host or loops in Python where `torch._grouped_mm`
takes the dtype, so it can be captured in a graph.

EPLB plugs in through three buffers, written in place (the planner: rtp/engine/eplb.py; the
loop that reads the counters and calls `place` between steps: rtp/engine/expert_balancer.py):
`logical_to_physical` [E, max_replicas] and `replica_count` [E] say which slots hold
each logical expert (the first replica_count[e] entries of row e; loading puts
expert e in slot e, the identity), and `expert_load` [E] int64 accumulates the pairs
routed to each logical expert while `count_load` is set.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from rtp.config import ModelConfig
from rtp.distributed import all_to_all, ep_rank, ep_size
from rtp.kernels import hugepages
from rtp.models.expert_blocks import ExpertBlocks
from rtp.models.expert_parallel import make_exchange
from rtp.models.layers import ReplicatedLinear, SiluAndMul, _copy_checked

# A row of an fp32 GEMM with at least this many rows gets the same bits whatever the row
# count and the row's place (MKL takes other kernels, with another summation order, for
# fewer rows: tests/models/test_moe.py). Layers with replica slots pad each expert group to it,
# so splitting an expert's tokens across replicas leaves the output bit-for-bit unchanged.
REPRODUCIBLE_GROUP_ROWS = 16

_EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")


class ExpertShard(NamedTuple):
    """Which part of which logical expert a checkpoint tensor fills."""

    expert: int
    part: str  # gate | up | down

    def __str__(self) -> str:
        return f"{self.expert}.{self.part}"


def expert_target(name: str, parts: dict[str, str]) -> tuple[str, ExpertShard] | None:
    """(stacked parameter name, shard) for a per-expert checkpoint tensor, e.g. with
    parts {"w1": "gate", "w3": "up", "w2": "down"} (Mixtral):
    "...experts.5.w3.weight" -> ("...experts.w13", ExpertShard(5, "up")); None for other names."""
    match = _EXPERT_TENSOR.search(name)
    if match is None or match[2] not in parts:
        return None
    part = parts[match[2]]
    return f"{name[:match.start()]}.experts.{'w2' if part == 'down' else 'w13'}", ExpertShard(int(match[1]), part)


class TopKRouter(nn.Module):
    """Router logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64).

    Softmax over all experts, then the top k, renormalised to sum to 1 if asked
    (Mixtral always; Qwen MoE when norm_topk_prob). DeepSeek-V3 differs in `scores`
    (sigmoid, plus a correction bias used for choosing only) and in `select` (top
    experts within the best groups, scaled by a routed scaling factor)."""

    # scores are a softmax and select the plain top k: what a MoE layer served by the one-call kernel
    # (ExpertBlocks.routed, csrc/moe.c) routes with itself; a router that differs says False
    softmax_top_k = True

    def __init__(self, top_k: int, renormalize: bool):
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.float(), dim=-1)

    def select(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = torch.topk(scores, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.select(self.scores(logits))


def _grouped_mm_takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    # 16-byte aligned rows; CUDA's kernels (and the fake-tensor rule torch.compile traces
    # with) take bf16 only, the CPU kernel fp32 too
    aligned = all(n * x.element_size() % 16 == 0 for n in (w.shape[1], w.shape[2]))
    if x.device.type == "cpu":
        return aligned and x.dtype in (torch.float32, torch.bfloat16)
    return aligned and x.dtype == torch.bfloat16


def grouped_mm(x: torch.Tensor, w: torch.Tensor, group_end: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ w[g]^T for each group g of consecutive rows [group_end[g-1], group_end[g])
    -> [rows, out]; rows past the last group are left undefined.

    `torch._grouped_mm` where it takes the dtype: on this CPU a FusedMoE forward with it was
    as fast as with one torch.mm per group at 1 token and 7-14 % faster beyond (bf16, 32
    experts, hidden 1024, inter 512, top-4, one thread, best of 3: 1.45 vs 1.43 ms at 1
    token, 6.2 vs 7.2 ms at 4, 15.2 vs 16.5 ms at 16, 19.4 vs 20.7 ms at 128), and it needs
    no host sync, so it can be captured. Elsewhere one torch.mm per group."""
    if _grouped_mm_takes(x, w):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=group_end.to(torch.int32))
    return grouped_mm_per_group(x, w, group_end)


def grouped_mm_per_group(x: torch.Tensor, w: torch.Tensor, group_end: torch.Tensor) -> torch.Tensor:
    """grouped_mm as one torch.mm per non-empty group (reads the group ends on the host)."""
    out = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for group, end in enumerate(group_end.tolist()):
        if end > start:
            torch.mm(x[start:end], w[group].t(), out=out[start:end])
        start = end
    return out


class FusedMoE(nn.Module):
    """The routed experts of one layer, stacked into slots (see the module docstring).

    Tensor parallelism does not split the experts: every rank holds all the slots and
    computes the whole (replicated) output. Expert parallelism splits the slots: with N
    ranks, rank r holds global slots [r * S/N, (r + 1) * S/N) (`local_slots` of them from
    `slot_offset`), and `exchange` (rtp/models/expert_parallel.py) sends each pair to the
    rank holding the slot it was dealt. The EPLB tables stay global and the same on every
    rank."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, num_slots: int | None = None):
        super().__init__()
        num_slots = num_experts if num_slots is None else num_slots
        if num_slots < num_experts:
            raise ValueError(f"{num_slots} slots cannot hold {num_experts} experts")
        if num_slots % ep_size():
            raise ValueError(f"{num_slots} expert slots do not split over {ep_size()} expert-parallel ranks")
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.local_slots = num_slots // ep_size()
        self.slot_offset = ep_rank() * self.local_slots
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(_stacked(self.local_slots, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(_stacked(self.local_slots, hidden_size, intermediate_size))
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader
        self.act = SiluAndMul()
        self.min_group_rows = REPRODUCIBLE_GROUP_ROWS if num_slots > num_experts else 1
        # -1: no slot; only the first replica_count[e] entries of a row are read
        logical_to_physical = torch.full((num_experts, num_slots - num_experts + 1), -1, dtype=torch.int64)
        logical_to_physical[:, 0] = torch.arange(num_experts)
        self.register_buffer("logical_to_physical", logical_to_physical, persistent=False)
        self.register_buffer("replica_count", torch.ones(num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.count_load = True
        self.exchange = make_exchange()
        # a quantized GGUF's experts as its blocks (rtp/models/expert_blocks.py; set by the loader,
        # which then drops w13 and w2 to the meta device): grouped() computes from these instead
        self.blocks: ExpertBlocks | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: ExpertShard) -> None:
        """Copy one expert's gate, up or down projection into its home slot (slot = expert id),
        where this rank holds that slot (every expert part reaches every rank)."""
        if not isinstance(shard, ExpertShard) or not 0 <= shard.expert < self.num_experts:
            raise ValueError(f"expert part {shard!r} does not fit {self.num_experts} experts")
        inter = self.intermediate_size
        rows = {"gate": slice(0, inter), "up": slice(inter, None)}.get(shard.part, slice(None))
        slot = shard.expert - self.slot_offset
        if not 0 <= slot < self.local_slots:  # another rank's expert: its shape checked, its data not kept
            if param.data[0, rows].shape != loaded.shape:
                raise ValueError(f"expert {shard}: checkpoint shape {tuple(loaded.shape)} does not fit "
                                 f"{tuple(param.data[0, rows].shape)}")
            return
        dst = param.data[slot, rows]
        _copy_checked(dst, loaded, f"expert {shard}")

    def expected_shards(self) -> dict[str, list[ExpertShard]]:
        """Parameter name -> the checkpoint parts that must fill it."""
        experts = range(self.num_experts)
        return {"w13": [ExpertShard(e, p) for e in experts for p in ("gate", "up")],
                "w2": [ExpertShard(e, "down") for e in experts]}

    @torch.no_grad()
    def place(self, slots: Sequence[int]) -> None:
        """Move to a new placement (rtp/engine/eplb.py): slots[i] is the logical expert global
        physical slot i holds (-1: empty). Every expert keeps at least one slot; each slot's
        weights come from the expert's first current slot, sent over one all-to-all per
        weight where that slot is on another expert-parallel rank (every rank calls this with
        the same slots). Between steps only: a step in flight would read half-moved weights."""
        target = torch.as_tensor(list(slots), dtype=torch.int64)
        if target.shape != (self.num_slots,) or target.max() >= self.num_experts or target.min() < -1:
            raise ValueError(f"a placement of {self.num_experts} experts names each of {self.num_slots} "
                             f"slots once, got {list(slots)}")
        count = torch.bincount(target[target >= 0], minlength=self.num_experts)
        if (count == 0).any():
            raise ValueError(f"a placement must keep every expert, missing {(count == 0).nonzero().flatten().tolist()}")
        if count.max() > self.logical_to_physical.shape[1]:
            raise ValueError(f"at most {self.logical_to_physical.shape[1]} copies of an expert fit")
        # where each new slot's weights are now (an empty slot keeps slot 0's, never read)
        table_now = self.logical_to_physical.cpu()
        source = table_now[target.clamp_min(0), 0]
        if self.local_slots < self.num_slots:
            self._move_across_ranks(source, target >= 0)
        elif self.blocks is not None:  # one rank: references move
            self.blocks.place(source, target >= 0)
        else:  # one rank holds every slot
            # only slots that change expert are written (an emptied slot keeps its stale weights,
            # never read): rows gathered before any is overwritten, so sources may be moving too
            held = torch.full((self.num_slots,), -1, dtype=torch.int64)
            for expert, copies in enumerate(self.replica_count.cpu().tolist()):
                held[table_now[expert, :copies]] = expert
            moving = ((target >= 0) & (target != held)).nonzero().flatten()
            if len(moving):
                for param in (self.w13, self.w2):
                    rows = param.data.index_select(0, source[moving].to(param.device))
                    param.data.index_copy_(0, moving.to(param.device), rows)
        # built on the host, copied once: per-element writes into a device tensor would each launch
        table = torch.full(self.logical_to_physical.shape, -1, dtype=torch.int64)
        filled = torch.zeros(self.num_experts, dtype=torch.int64)
        for slot, expert in enumerate(target.tolist()):
            if expert >= 0:
                table[expert, filled[expert]] = slot
                filled[expert] += 1
        self.logical_to_physical.copy_(table)  # in place: graphs captured over these tables stay valid
        self.replica_count.copy_(count)

    def releasable(self, slot: int) -> int:
        """Bytes release(slot) gives back: the whole pages of this rank's slot `slot` (a local
        index) in w13 and w2; 0 off the CPU or without madvise, or for experts served from their
        blocks (a replica shares its expert's)."""
        if self.blocks is not None:
            return 0
        return hugepages.releasable(self.w13.data[slot]) + hugepages.releasable(self.w2.data[slot])

    @torch.no_grad()
    def release(self, slot: int) -> int:
        """Give an empty slot's whole pages (local index) back to the OS; it reads as zeros until
        place() writes an expert into it again. Returns the bytes released."""
        if self.blocks is not None:
            return 0
        return hugepages.release(self.w13.data[slot]) + hugepages.release(self.w2.data[slot])

    def _move_across_ranks(self, source: torch.Tensor, used: torch.Tensor) -> None:
        """Slot i's weights from global slot source[i]: local copies, the rest over all_to_all.
        Rows travel in increasing destination-slot order, which both ends derive alike."""
        outgoing, incoming, local = self._cross_rank_plan(source, used)
        if self.blocks is not None:  # each slot's records, sent as they are (ExpertBlocks.move)
            self.blocks.move(outgoing, incoming, local, self.slot_offset)
            return
        for param in (self.w13, self.w2):
            w = param.data
            sent = w.index_select(0, torch.tensor(list(itertools.chain(*outgoing)), dtype=torch.int64, device=w.device))
            received = w.new_empty(sum(map(len, incoming)), *w.shape[1:])
            all_to_all(received, sent, [len(i) for i in incoming], [len(o) for o in outgoing])
            new = w.clone()
            for dest, src in local:
                new[dest] = w[src]
            arrived = list(itertools.chain(*incoming))
            if arrived:
                new.index_copy_(0, torch.tensor(arrived, device=w.device) - self.slot_offset, received)
            w.copy_(new)

    def _cross_rank_plan(self, source: torch.Tensor, used: torch.Tensor
                         ) -> tuple[list[list[int]], list[list[int]], list[tuple[int, int]]]:
        """What a placement moves, on this rank: for each rank, the local slots whose expert this rank sends it
        (in its destination slots' order); for each rank, the global slots here that rank's experts arrive in;
        and the (destination, source) local slots whose expert is already here."""
        ranks, local, me = ep_size(), self.local_slots, ep_rank()
        owner = source // local
        outgoing = [[int(source[d]) - self.slot_offset for d in range(r * local, (r + 1) * local)
                     if used[d] and owner[d] == me] if r != me else [] for r in range(ranks)]
        incoming = [[d for d in range(me * local, (me + 1) * local) if used[d] and owner[d] == r] if r != me else []
                    for r in range(ranks)]
        here = [(d - self.slot_offset, int(source[d]) - self.slot_offset)
                for d in range(me * local, (me + 1) * local) if used[d] and owner[d] == me]
        return outgoing, incoming, here

    def grouped(self, x: torch.Tensor, row_source: torch.Tensor, group_end: torch.Tensor) -> torch.Tensor:
        """The expert math of an exchange: row r is this rank's slot g's expert applied to
        x[row_source[r]], for the rows of group g (ending at group_end[g])."""
        if self.blocks is not None:
            return self.blocks.grouped(x, row_source, group_end, self.act)
        h = grouped_mm(x.index_select(0, row_source), self.w13, group_end)
        return grouped_mm(self.act(h), self.w2, group_end)

    def routed(self, x: torch.Tensor, logits: torch.Tensor, router: TopKRouter) -> torch.Tensor:
        """x [T, hidden] through the experts `router` picks from its logits [T, E] -> [T, hidden] fp32: one
        kernel call where the experts are GGUF blocks the MoE op serves and the router is its softmax top-k
        (ExpertBlocks.routed; then a CPU graph can replay the layer), else router, then forward."""
        if (self.blocks is not None and self.blocks.one_call and router.softmax_top_k
                and self.local_slots == self.num_slots
                and x.dtype == torch.bfloat16 and logits.dtype in (torch.bfloat16, torch.float32)):
            return self.blocks.routed(x, logits, router.top_k, router.renormalize, self.logical_to_physical,
                                      self.replica_count, self.expert_load if self.count_load else None)
        return self(x, *router(logits))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden]; topk_weights [T, k] fp32; topk_ids [T, k] logical expert ids -> [T, hidden] fp32."""
        tokens, k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        per_expert = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        per_expert.index_add_(0, flat, torch.ones_like(flat))
        if self.count_load:  # over all T tokens, which every rank routes alike: the global load
            self.expert_load.add_(per_expert)
        # each expert's pairs dealt round-robin over its replicas, in pair order
        order = flat.argsort(stable=True)
        expert = flat.index_select(0, order)
        rank = torch.arange(tokens * k, device=x.device) - (per_expert.cumsum(0) - per_expert).index_select(0, expert)
        slot = self.logical_to_physical[expert, rank % self.replica_count.index_select(0, expert)]
        slots = torch.empty_like(slot).index_copy_(0, order, slot).view(tokens, k)
        return self.exchange(self, x, slots, topk_weights)


def _stacked(*shape: int) -> torch.Tensor:
    """A stacked expert weight, uninitialised on the current default device and dtype. On a
    CPU it is page-aligned anonymous memory (rtp/kernels/hugepages.py), so that a slot EPLB empties
    gives back all of its pages when a slot's bytes are a multiple of the page (e.g.
    Qwen3-30B-A3B in bf16: 6 MiB of w13 and 3 MiB of w2 per slot), not all but the edges."""
    probe = torch.empty(0)
    if probe.device.type == "cpu":
        return hugepages.zeros(shape, probe.dtype)
    return torch.empty(shape)


class SparseMoeBlock(nn.Module):
    """gate -> router -> routed experts: the feed-forward block of a sparse layer."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False)
        self.router = TopKRouter(config.num_experts_per_tok, config.norm_topk_prob)
        self.experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                num_slots=config.num_experts + config.num_redundant_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden] fp32."""
        return self.experts.routed(x, self.gate(x), self.router)
