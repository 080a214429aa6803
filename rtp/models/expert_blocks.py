"""A MoE layer's routed experts served from a GGUF's quant blocks, never a dense copy.

A quantized MoE GGUF holds most of its bytes in experts (Qwen3-30B-A3B in Q4_K_M: 17 GB, of
which the experts' bf16 copy alone would be 57 GB): FusedMoE's stacked dense w13 / w2 cannot
hold them on a CPU host. ExpertBlocks keeps each expert as the file's blocks (rtp/kernels/quant.py:
BlockQuantized, the layouts the dense layers' GGUF blocks take), per local slot a [gate | up]
block matrix laid out for the fused SiLU-and-mul and a down block matrix, and computes
FusedMoE.grouped's rows group by group through the block kernels. An expert holds the one layout
the dense layers take every batch in (0.75 bytes a Q4_K weight, where blocks, super-blocks and a
layout together were 2.1): tiles alone (BlockQuantized.keep_only_tiles) where the CPU has the tile
kernels (AVX-512 BF16, AMX), lane order on the avx512 path (AVX-512 VNNI without BF16), the blocks on
the avx2 path. (Lane order on AMX too, where an expert's product at one row is the lane kernel's
strength, measured 12 % faster at one stream but 34 %, 60 % and 66 % slower at 16 and 64 streams and
on prompts on a Qwen3-30B-A3B-shaped file: docs/benchmarks.md, MoE.)

Where the kernels have the one-call MoE op (rtp/kernels/csrc/moe.c), `routed` runs
the whole layer -- softmax top-k routing, EPLB's replica dealing, each slot's two products, the
weighted combine -- in one kernel call over two tables of the slots' record addresses, so a MoE step
is kernel calls only and replays from a CPU graph like a dense one (its work follows the step's
routing, read at replay). `grouped` is FusedMoE's generic path from the blocks (a router the op does
not know, expert parallelism): its groups are walked on the host, eagerly. EPLB's placements move
slot references (replicas share one expert's blocks) and rewrite the address tables in place, so
captured graphs see the new placement. With expert parallelism each rank holds its own slots' experts,
and a placement sends an expert's records tensor to the rank whose slot takes it (`move`, over the
all-to-all the dense slots use).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

import torch

from rtp.kernels import cpu_kernels, hugepages
from rtp.kernels.quant import TILE_KIND, BlockQuantized


class ExpertBlocks:
    """w13[slot]: [gate | up] blocks [2 * width, hidden]; w2[slot]: down blocks [hidden, width];
    None for a slot no expert is placed in."""

    def __init__(self, w13: list[BlockQuantized | None], w2: list[BlockQuantized | None]):
        self.w13 = w13
        self.w2 = w2
        placed = [(a, b) for a, b in zip(w13, w2) if a is not None]
        # what an expert that arrives from another rank is made from (move): its layout, kind and shape
        self.templates = placed[0] if placed else (None, None)
        # the op multiplies every slot alike: records of one order, and of one kind each for [gate | up] and down
        # (glu tiles; an int8-prefill split of decode and prompt rows stays on the generic path)
        self.lanes = bool(placed) and all(a.lanes is not None and b.lanes is not None for a, b in placed)
        tiles = all(a.tiles is not None and a.glu and b.tiles is not None and "prefill" not in (a.int8_rows, b.int8_rows)
                    for a, b in placed)
        kinds = {(TILE_KIND[a.kind], TILE_KIND[b.kind]) if self.lanes else (a.tile_kind, b.tile_kind) for a, b in placed}
        self.one_call = cpu_kernels.has_op("moe_experts") and len(kinds) == 1 and (self.lanes or tiles)
        self.kinds = next(iter(kinds)) if len(kinds) == 1 else None
        self.inter = placed[0][1].shape[1] if placed else 0
        # each slot's records by address (0: empty), what the one-call op reads; rewritten in place
        self.w13_records = torch.zeros(len(w13), dtype=torch.int64)
        self.w2_records = torch.zeros(len(w2), dtype=torch.int64)
        self._write_records()

    def _write_records(self) -> None:
        for table, blocks in ((self.w13_records, self.w13), (self.w2_records, self.w2)):
            records = [None if b is None else _records(b) for b in blocks]
            table.copy_(torch.tensor([0 if r is None else r.data_ptr() for r in records], dtype=torch.int64))

    @classmethod
    def build(cls, gate: Sequence[BlockQuantized], up: Sequence[BlockQuantized], down: Sequence[BlockQuantized],
              num_slots: int) -> ExpertBlocks | None:
        """Expert e's blocks in slot e (the identity placement), the slots past the experts empty; None
        where some expert's blocks cannot serve every batch here (no layout holds its gate and up
        together, or its kernels do not run on this CPU): the layer then keeps dense experts."""
        w13, w2 = [], []
        for g, u, d in zip(gate, up, down):
            fused = BlockQuantized.cat([g, u])
            if fused is None:
                return None
            # one layout alone (the module docstring): nothing but the expert's own products reads them
            fused = fused.with_tile_layout(glu=True).keep_only_tiles().on_huge_pages()
            d = d.with_tile_layout().keep_only_tiles().on_huge_pages()
            if not (fused.runs_here and d.runs_here and fused.serves_every_batch and d.serves_every_batch):
                return None
            w13.append(fused)
            w2.append(d)
        pad = num_slots - len(w13)
        return cls(w13 + [None] * pad, w2 + [None] * pad)

    def routed(self, x: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool,
               expert_slots: torch.Tensor, replica_count: torch.Tensor,
               expert_load: torch.Tensor | None) -> torch.Tensor:
        """The layer's routed experts for x bf16 [T, hidden] from the router's logits, in one kernel call
        (one_call must hold): softmax top-k, EPLB's tables as FusedMoE keeps them -> fp32 [T, hidden]."""
        return cpu_kernels.moe_experts(x, logits, top_k, renormalize, expert_slots, replica_count, expert_load,
                                       self.w13_records, self.w2_records, *self.kinds, self.inter, self.lanes)

    def grouped(self, x: torch.Tensor, row_source: torch.Tensor, group_end: torch.Tensor,
                act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """FusedMoE.grouped from the blocks: row r is slot g's expert applied to x[row_source[r]], for
        the rows of group g (ending at group_end[g]); rows past the last group are left undefined."""
        out = x.new_empty(row_source.shape[0], x.shape[1])
        start = 0
        for slot, end in enumerate(group_end.tolist()):
            if end > start:
                rows = x.index_select(0, row_source[start:end])
                w13 = self.w13[slot]
                if w13.takes_silu_mul(end - start):
                    h = w13.silu_mul(rows, None)
                else:
                    h = act(w13.linear(rows, None, x.dtype))
                self.w2[slot].linear_into(h, None, out[start:end])
            start = end
        return out

    @property
    def movable(self) -> bool:
        """Whether every placed expert is one records tensor (its tiles or lane order alone), which `move`
        sends to another rank as it is."""
        return all(b is None or b.only_tiles is not None for b in self.w13 + self.w2)

    def move(self, outgoing: list[list[int]], incoming: list[list[int]], local: list[tuple[int, int]],
             slot_offset: int) -> None:
        """Expert parallelism's placement change (FusedMoE._cross_rank_plan): outgoing[r] are the local slots
        whose records go to rank r, incoming[r] the global slots here that rank r's records arrive in, local
        the (destination, source) local slots whose expert is already here; every other slot empties. Every
        rank calls this with the same placement."""
        from rtp.distributed import all_to_all

        layouts = []
        for part, template in zip((self.w13, self.w2), self.templates):
            records = [_records(part[s]) for s in itertools.chain(*outgoing)]
            shape = _records(template).shape
            sent = torch.stack(records) if records else torch.empty(0, *shape, dtype=torch.uint8)
            received = torch.empty(sum(map(len, incoming)), *shape, dtype=torch.uint8)
            all_to_all(received, sent, [len(i) for i in incoming], [len(o) for o in outgoing])
            new: list[BlockQuantized | None] = [None] * len(part)
            for dest, src in local:
                new[dest] = part[src]
            field = "lanes" if template.lanes is not None else "tiles"
            for k, d in enumerate(itertools.chain(*incoming)):
                # on huge pages, as the loader put every expert's records (BlockQuantized.tile_layout)
                new[d - slot_offset] = dataclasses.replace(template, **{field: hugepages.copy(received[k])})
            layouts.append(new)
        self.w13, self.w2 = layouts
        self._write_records()

    def place(self, source: torch.Tensor, used: torch.Tensor) -> None:
        """Slot i takes the expert now in slot source[i] (where used[i]; else it empties): references
        moved, all read before any is written."""
        w13 = [self.w13[s] if u else None for s, u in zip(source.tolist(), used.tolist())]
        w2 = [self.w2[s] if u else None for s, u in zip(source.tolist(), used.tolist())]
        self.w13, self.w2 = w13, w2
        self._write_records()


def _records(blocks: BlockQuantized) -> torch.Tensor:
    """The records tensor the kernels read for an expert: its lane order, else its tiles (None on the avx2 path)."""
    return blocks.lanes if blocks.lanes is not None else blocks.tiles
