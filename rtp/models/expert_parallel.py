"""Expert exchanges: (token, expert) pairs to the slots that compute them, and back.

FusedMoE (rtp/models/moe.py) routes each token to k logical experts and picks, through
EPLB's logical->physical table, one physical slot per pair. An exchange takes it from
there: it moves each pair's token to its slot, has the layer's grouped GEMMs compute
the slots it holds, brings the results back and combines them with the router
weights. Everything between routing and the combined output except the expert math is
the exchange's, so a backend with its own transport (DeepEP's dispatch/combine on
CUDA) plugs in as another ExpertExchange, chosen in `make_exchange`, with no change to
the layer.

  LocalExchange     one rank holds every slot: sort pairs by slot, compute, unsort;
                    no host sync, so a graph can capture it
  AllToAllExchange  expert parallelism over torch.distributed (gloo / NCCL): each rank
                    holds a contiguous range of slots; see its docstring

The expert math is `experts.grouped(x, row_source, group_end)`: rows x[row_source[r]],
consecutive rows per local slot (group g ends at group_end[g]), through w13, SiLU*up,
w2. In layers with replica slots each non-empty group is padded to
`experts.min_group_rows` rows (padding rows recompute some row; never read), which keeps
an expert's output bits independent of how its tokens were split (moe.py).
"""

from __future__ import annotations

import itertools
import time
from typing import Protocol

import torch

from rtp.distributed import all_to_all, ep_all_gather, ep_rank, ep_size


class GroupedExperts(Protocol):
    local_slots: int
    slot_offset: int
    min_group_rows: int

    def grouped(self, x: torch.Tensor, row_source: torch.Tensor, group_end: torch.Tensor) -> torch.Tensor: ...


class ExpertExchange(Protocol):
    def __call__(self, experts: GroupedExperts, x: torch.Tensor, slots: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (the same on every rank); slots [T, k] global physical slot of each pair;
        weights [T, k] fp32 -> [T, hidden] fp32, sum over k (in k order) of weight * expert(x)."""
        ...


def _weighted_sum(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    # a fixed summation order over k, whichever slots (and ranks) served the pairs
    return (y.view(*weights.shape, -1).float() * weights.unsqueeze(-1)).sum(dim=1)


def _padded(counts: torch.Tensor, min_rows: int) -> torch.Tensor:
    return torch.where(counts > 0, counts.clamp_min(min_rows), counts) if min_rows > 1 else counts


class LocalExchange:
    """Every slot on this rank: one grouped compute over all pairs, no communication."""

    def __call__(self, experts: GroupedExperts, x: torch.Tensor, slots: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        tokens, k = slots.shape
        pairs = tokens * k
        flat = slots.reshape(-1)
        order = flat.argsort(stable=True)  # stable: a group's rows stay in pair order
        slot = flat.index_select(0, order)
        per_slot = torch.zeros(experts.local_slots, dtype=torch.int64, device=x.device)
        per_slot.index_add_(0, flat, torch.ones_like(flat))
        rank = torch.arange(pairs, device=x.device) - (per_slot.cumsum(0) - per_slot).index_select(0, slot)
        per_group = _padded(per_slot, experts.min_group_rows)
        # a bound on the padded rows known without reading per_slot: no host sync
        num_rows = pairs + (experts.min_group_rows - 1) * min(experts.local_slots, pairs)
        group_end = per_group.cumsum(0)
        row = (group_end - per_group).index_select(0, slot) + rank
        # padding rows compute token 0 again; their results are never read
        row_source = torch.zeros(num_rows, dtype=torch.int64, device=x.device).index_copy_(0, row, order // k)
        y = experts.grouped(x, row_source, group_end)
        row_of_pair = torch.empty_like(row).index_copy_(0, order, row)
        return _weighted_sum(y.index_select(0, row_of_pair), weights)


class AllToAllExchange:
    """Expert parallelism with torch.distributed.all_to_all_single, in overlapped micro-chunks.

    Every rank holds the same T tokens (attention ran replicated or tensor-parallel) and
    slots [rank * S/N, (rank + 1) * S/N). Rank r takes tokens [r * ceil(T/N), ...) of them:

    | step     | what                                                                     |
    |----------|--------------------------------------------------------------------------|
    | chunk    | its pairs split into micro-chunks (`split`, below)                       |
    | counts   | one all-to-all of pair counts per (chunk, destination slot): the only    |
    |          | host sync, it sizes every later exchange                                 |
    | dispatch | per chunk, its pairs sorted by global slot (so by destination rank and   |
    |          | local slot): token rows out, pair rows in, all_to_all_single             |
    | compute  | received rows laid out slot-major (from the counts alone), grouped GEMMs |
    | combine  | result rows back over the reverse all_to_all_single, into pair order     |
    | reduce   | weighted sum over k (in k order, fp32) once every chunk is back          |
    | gather   | the ranks' token slices all-gathered: every rank has the layer's output  |

    With `overlap`, chunk m+1's dispatch and chunk m-1's combine run (async_op: gloo's
    worker threads on the CPU, NCCL's stream on CUDA) while chunk m's GEMMs compute.
    `split` says what a chunk is:

      "experts"  the pairs bound for local slots [m * L/M, (m + 1) * L/M) of each rank:
                 every expert's weights are read once per layer, as without chunks, and
                 its rows stay one group (the output is bit for bit the unchunked one)
      "tokens"   the pairs of tokens [m * T_r/M, (m + 1) * T_r/M), DeepEP's micro-batches:
                 each chunk reads every hot expert's weights again, which costs more than
                 the overlap saves where expert GEMMs are bound by weight bandwidth (a CPU
                 at these token counts: tools/bench_parallel.py)

    The chunk count is the same on every rank (a function of T), as the collectives must
    be. Without overlap each exchange is waited on at once. `stall_s` accumulates the
    seconds this rank spent waiting on the exchange (counts, waits, gather) while `timing`
    is set.
    """

    def __init__(self, chunks: int = 2, min_chunk_tokens: int = 16, overlap: bool = True, split: str = "experts"):
        if split not in ("experts", "tokens"):
            raise ValueError(f"split is experts or tokens, not {split!r}")
        self.chunks = chunks
        self.min_chunk_tokens = min_chunk_tokens
        self.overlap = overlap
        self.split = split
        self.timing = False
        self.stall_s = 0.0

    def num_chunks(self, tokens: int) -> int:
        """Micro-chunks for a layer of `tokens` tokens: 1 unless each rank's share keeps at
        least min_chunk_tokens per chunk (below that the per-exchange overhead outweighs the
        overlap)."""
        if not self.overlap:
            return 1
        return max(1, min(self.chunks, tokens // (ep_size() * self.min_chunk_tokens)))

    def __call__(self, experts: GroupedExperts, x: torch.Tensor, slots: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        per_rank = -(-tokens // ep_size())
        lo = min(tokens, ep_rank() * per_rank)
        hi = min(tokens, lo + per_rank)
        chunks = min(self.num_chunks(tokens), experts.local_slots)
        y = self._exchange(experts, x[lo:hi], slots[lo:hi], chunks)
        out = torch.zeros(per_rank, x.shape[1], dtype=torch.float32, device=x.device)
        if hi > lo:
            out[:hi - lo] = _weighted_sum(y, weights[lo:hi])
        start = time.perf_counter()
        gathered = ep_all_gather(out)[:tokens]
        self._stalled(start)
        return gathered

    def _stalled(self, start: float) -> None:
        if self.timing:
            self.stall_s += time.perf_counter() - start

    def _wait(self, work) -> None:
        if work is not None:
            start = time.perf_counter()
            work.wait()
            self._stalled(start)

    def _exchange(self, experts: GroupedExperts, x: torch.Tensor, slots: torch.Tensor, chunks: int) -> torch.Tensor:
        """This rank's pairs through the experts of every rank -> [pairs, hidden], pair order."""
        ranks, local = ep_size(), experts.local_slots
        tokens, k = slots.shape
        flat = slots.reshape(-1)
        if self.split == "experts":
            chunk = (flat % local) * chunks // local
        else:
            chunk = torch.arange(tokens, device=x.device).repeat_interleave(k) * chunks // max(tokens, 1)
        key = chunk * (ranks * local) + flat
        order = key.argsort(stable=True)  # chunk-major, then by global slot: by rank, then local slot
        counts = torch.bincount(key, minlength=chunks * ranks * local).view(chunks, ranks, local)
        send_counts = counts.transpose(0, 1).contiguous()  # [ranks, chunks, local]: what goes where
        recv_counts = torch.empty_like(send_counts)
        start = time.perf_counter()
        all_to_all(recv_counts, send_counts)
        self._stalled(start)
        send_splits = send_counts.sum(dim=2).t().tolist()  # [chunk][rank]
        recv_splits = recv_counts.sum(dim=2).t().tolist()
        # slot-major rows each chunk's grouped GEMMs run, padding included
        grouped_rows = _padded(recv_counts.sum(dim=0), experts.min_group_rows).sum(dim=1).tolist()
        recv_counts = recv_counts.to(x.device)
        bounds = [0, *itertools.accumulate(sum(split) for split in send_splits)]
        y = x.new_empty(tokens * k, x.shape[1])
        sync = not self.overlap

        def dispatch(c: int):
            pairs = order[bounds[c]:bounds[c + 1]]
            received = x.new_empty(sum(recv_splits[c]), x.shape[1])
            work = all_to_all(received, x.index_select(0, pairs // k), recv_splits[c], send_splits[c],
                              async_op=True)
            if sync:
                self._wait(work)
            return received, None if sync else work

        def combine(c: int, received: torch.Tensor):
            back = self._compute(experts, received, recv_counts[:, c], grouped_rows[c])
            returned = x.new_empty(bounds[c + 1] - bounds[c], x.shape[1])
            work = all_to_all(returned, back, send_splits[c], recv_splits[c], async_op=True)
            if sync:
                self._wait(work)
            return returned, None if sync else work

        def land(c: int, returned: torch.Tensor, work) -> None:
            self._wait(work)
            y.index_copy_(0, order[bounds[c]:bounds[c + 1]], returned)

        dispatched = [dispatch(0)]
        returning = []
        for c in range(chunks):
            if c + 1 < chunks:
                dispatched.append(dispatch(c + 1))  # in flight while chunk c computes
            received, work = dispatched[c]
            self._wait(work)
            returning.append(combine(c, received))
            if c > 0:  # chunk c-1's results came back while chunk c computed
                land(c - 1, *returning[c - 1])
        land(chunks - 1, *returning[-1])
        return y

    @staticmethod
    def _compute(experts: GroupedExperts, received: torch.Tensor, counts: torch.Tensor,
                 grouped_rows: int) -> torch.Tensor:
        """Rows received in (source rank, local slot) order, counts [ranks, local] -> their
        results, same order. The grouped GEMMs want them slot-major, padded per group."""
        rows = received.shape[0]
        if rows == 0:
            return received
        device = received.device
        per_group = _padded(counts.sum(dim=0), experts.min_group_rows)
        group_end = per_group.cumsum(0)
        flat = counts.reshape(-1)
        recv_start = flat.cumsum(0) - flat  # each (source, slot) block's first received row
        # its first row in the slot-major layout: the group's start plus earlier sources' rows
        dest_start = (group_end - per_group).unsqueeze(0) + counts.cumsum(dim=0) - counts
        shift = torch.repeat_interleave(dest_start.reshape(-1) - recv_start, flat, output_size=rows)
        dest = torch.arange(rows, device=device) + shift
        # padding rows recompute received row 0; their results are never read
        row_source = torch.zeros(grouped_rows, dtype=torch.int64, device=device)
        row_source.index_copy_(0, dest, torch.arange(rows, device=device))
        return experts.grouped(received, row_source, group_end).index_select(0, dest)


def make_exchange() -> ExpertExchange:
    """The exchange for this process's expert-parallel group. (Where DeepEP's buffers are
    available on CUDA, its dispatch/combine would be returned here behind the same call.)"""
    return AllToAllExchange() if ep_size() > 1 else LocalExchange()
