"""Type stub for rtp.runtime.block_allocator (see block_allocator.pyx)."""

from typing import Iterable

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int32]
Tokens = Iterable[int] | npt.NDArray[np.integer]


class BlockCache:
    """What the allocator calls on the cache that names its blocks (C methods only);
    RadixCache implements it."""


class BlockAllocator:
    """Paged KV blocks with refcounts; block 0 is the reserved null block."""
    num_blocks: int     # the limit: ids below it make up the pool now
    capacity: int       # what grow() may raise the limit to
    base: int           # the limit as built
    block_size: int
    num_evictions: int
    def __init__(self, num_blocks: int, block_size: int, capacity: int = 0) -> None: ...
    @property
    def num_free(self) -> int: ...          # truly free + evictable
    @property
    def num_truly_free(self) -> int: ...
    @property
    def num_evictable(self) -> int: ...
    @property
    def num_cached(self) -> int: ...
    @property
    def num_protected(self) -> int: ...
    @property
    def num_used(self) -> int: ...
    @property
    def usage(self) -> float: ...
    def can_allocate(self, n: int) -> bool: ...
    def allocate(self, n: int) -> IntArray: ...      # MemoryError when fewer than n remain
    def acquire(self, blocks: Tokens) -> None: ...   # +1 ref each, root first
    def free(self, blocks: Tokens) -> None: ...      # -1 ref each, last block first
    def ref_count(self, block: int) -> int: ...
    def evict(self, n: int) -> int: ...
    def grow(self, new_limit: int) -> None: ...
    def can_shrink(self, new_limit: int) -> bool: ...
    def shrink(self, new_limit: int) -> bool: ...   # False (nothing changed) if a block >= new_limit is in use
    def check_integrity(self) -> None: ...
