"""Tier 1: KV blocks in host RAM, a bounded number of rows, the least recently used given up first.

Used from the engine thread only. A row being filled (a disk read) or read (a disk write) is
pinned: it is never handed out again until unpinned, so no thread ever reads a row that is being
rewritten.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class HostTier:
    def __init__(self, capacity_blocks: int, block_bytes: int):
        if capacity_blocks < 1:
            raise ValueError(f"the host KV tier needs room for at least one block of {block_bytes} bytes")
        self.capacity = capacity_blocks
        self.block_bytes = block_bytes
        self.rows = np.empty((capacity_blocks, block_bytes), dtype=np.uint8)  # pages committed as rows are written
        self.index: OrderedDict[bytes, int] = OrderedDict()  # key -> row, least recently used first
        self.key_of: list[bytes | None] = [None] * capacity_blocks
        self.free = list(range(capacity_blocks - 1, -1, -1))
        self.pins = np.zeros(capacity_blocks, dtype=np.int32)
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def get(self, key: bytes) -> int | None:
        """The row holding block `key` (now the most recently used), None when it is not here."""
        row = self.index.get(key)
        if row is not None:
            self.index.move_to_end(key)
        return row

    def discard(self, key: bytes) -> bool:
        """Forget block `key` (its row is free once nothing pins it); False when it is not here."""
        row = self.index.pop(key, None)
        if row is None:
            return False
        self.key_of[row] = None
        if not self.pins[row]:
            self.free.append(row)
        return True

    def take(self) -> int | None:
        """A row to fill, pinned (put() or drop() it): a free one, else the least recently used
        unpinned block's. None when every row is pinned."""
        if self.free:
            row = self.free.pop()
        else:
            for key, row in self.index.items():
                if not self.pins[row]:
                    break
            else:
                return None
            del self.index[key]
            self.key_of[row] = None
            self.evictions += 1
        self.pins[row] += 1
        return row

    def put(self, key: bytes, row: int) -> None:
        """A taken row now holds block `key` (the most recently used); unpinned. When the block is
        here already (two reads of it landed), the old row stays and this one is free again."""
        if key in self.index:
            self.index.move_to_end(key)
        else:
            self.index[key] = row
            self.key_of[row] = key
        self.unpin(row)

    def drop(self, row: int) -> None:
        """A taken row that was not filled after all: free again."""
        self.unpin(row)

    def pin(self, row: int) -> None:
        self.pins[row] += 1

    def unpin(self, row: int) -> None:
        self.pins[row] -= 1
        if self.pins[row] == 0 and self.key_of[row] is None:
            self.free.append(row)

    def check_integrity(self) -> None:
        assert len(self.index) + len(self.free) <= self.capacity
        assert all(self.key_of[row] == key for key, row in self.index.items()), "row map drifted"
        assert not set(self.free) & set(self.index.values()), "a listed row is free"
        assert len(set(self.free)) == len(self.free), "a row is free twice"
        assert all(self.pins[row] == 0 for row in self.free), "a free row is pinned"
