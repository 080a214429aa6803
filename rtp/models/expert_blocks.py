"""A MoE layer's routed experts served from a GGUF's quant blocks, never a dense copy.

A quantized MoE GGUF holds most of its bytes in experts (Qwen3-30B-A3B in Q4_K_M: 17 GB, of
which the experts' bf16 copy alone would be 57 GB): FusedMoE's stacked dense w13 / w2 cannot
hold them on a CPU host. ExpertBlocks keeps each expert as the file's blocks (rtp/kernels/quant.py:
BlockQuantized, the layouts the dense layers' GGUF blocks take), per local slot a [gate | up]
block matrix laid out for the fused SiLU-and-mul and a down block matrix, and computes
FusedMoE.grouped's rows group by group through the block kernels. Where the CPU has the tile
kernels (AVX-512 BF16, AMX) an expert holds its tiles alone (BlockQuantized.keep_only_tiles: 0.75
bytes a Q4_K weight, where blocks, super-blocks and tiles together were 2.1), which take every
batch; on the avx2 path, its blocks.

The groups are walked on the host (their ends read once a layer), so a layer served this way
runs eagerly, as MoE layers on a CPU do today; EPLB's placements move slot references
(replicas share one expert's blocks). What it does not do yet: route and dispatch in one C
kernel, and replay the step from a CPU graph (issue "The models people run on CPUs now").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rtp.kernels.quant import BlockQuantized


class ExpertBlocks:
    """w13[slot]: [gate | up] blocks [2 * width, hidden]; w2[slot]: down blocks [hidden, width];
    None for a slot no expert is placed in."""

    def __init__(self, w13: list[BlockQuantized | None], w2: list[BlockQuantized | None]):
        self.w13 = w13
        self.w2 = w2

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
            # tiles alone where the CPU takes them (they serve every batch; nothing else reads an expert),
            # the blocks on the avx2 path
            fused = fused.with_tile_layout(glu=True).keep_only_tiles().on_huge_pages()
            d = d.with_tile_layout().keep_only_tiles().on_huge_pages()
            if not (fused.runs_here and d.runs_here and fused.serves_every_batch and d.serves_every_batch):
                return None
            w13.append(fused)
            w2.append(d)
        pad = num_slots - len(w13)
        return cls(w13 + [None] * pad, w2 + [None] * pad)

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

    def place(self, source: torch.Tensor, used: torch.Tensor) -> None:
        """Slot i takes the expert now in slot source[i] (where used[i]; else it empties): references
        moved, all read before any is written."""
        w13 = [self.w13[s] if u else None for s, u in zip(source.tolist(), used.tolist())]
        w2 = [self.w2[s] if u else None for s, u in zip(source.tolist(), used.tolist())]
        self.w13, self.w2 = w13, w2
