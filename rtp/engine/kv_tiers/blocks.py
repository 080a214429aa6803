"""What names a KV block across processes, and block copies between the pool and host memory.

A block's key is a hash chain: key(i) = H(key(i - 1) + the token ids of block i), key(-1) the
model's fingerprint. So a key stands for every token before the block's end, in this model, with
this KV layout: equal keys mean equal KV, in any process that computes KV the same way. The
fingerprint covers what decides the bits: the checkpoint (its files' names, sizes and first and
last bytes), the model's config, the dtype, the KV cache's dtype and shape, the block size and the
kernels' ISA path (docs/determinism.md: KV is bit-identical on one ISA path).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch

from rtp.engine.kv_transfer import raw_view

KEY_BYTES = 16
_SAMPLE = 1 << 16  # bytes read from each end of each checkpoint file


def fingerprint(model_path: str | os.PathLike, *parts) -> bytes:
    """The seed of every key: the checkpoint's identity and whatever else decides the KV's bits."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    path = Path(model_path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        if f.suffix not in (".gguf", ".safetensors", ".bin", ".json", ".pt"):
            continue
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(_SAMPLE))
            if size > 2 * _SAMPLE:
                fh.seek(size - _SAMPLE)
                h.update(fh.read(_SAMPLE))
    for part in parts:
        h.update(repr(part).encode())
    return h.digest()


def extend_chain(keys: list[bytes], tokens: np.ndarray, nblocks: int, block_size: int, seed: bytes) -> list[bytes]:
    """Extend `keys` (the keys of tokens' first len(keys) blocks) to the first nblocks blocks."""
    prev = keys[-1] if keys else seed
    for i in range(len(keys), nblocks):
        prev = hashlib.blake2b(prev + tokens[i * block_size:(i + 1) * block_size].tobytes(),
                               digest_size=KEY_BYTES).digest()
        keys.append(prev)
    return keys


class BlockCopier:
    """Blocks of the KV pool to rows of a host array and back.

    The pool is a list of tensors indexed by block id on dim 1 ([lead, blocks, block_size, ...]:
    each layer's K and V, and an int8 cache's scales). A host row holds one block of every tensor,
    one after the other: `block_bytes` bytes, the unit the host and disk tiers store. Copies go
    through numpy (no OpenMP region opened on the thread that calls)."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.parts: list[tuple[np.ndarray, int, int, int]] = []  # (pool bytes [lead, blocks, chunk], offset, lead, chunk)
        offset = 0
        for t in tensors:
            if t.device.type != "cpu":
                raise ValueError("the KV cache tiers copy blocks of a CPU KV cache")
            u = raw_view(t).view(np.uint8).reshape(t.shape[0], t.shape[1], -1)
            self.parts.append((u, offset, t.shape[0], u.shape[2]))
            offset += t.shape[0] * u.shape[2]
        self.block_bytes = offset

    def _row_views(self, rows: np.ndarray):
        for u, offset, lead, chunk in self.parts:
            view = rows[:, offset:offset + lead * chunk].reshape(rows.shape[0], lead, chunk)
            assert np.may_share_memory(view, rows), "a host view must not be a copy"
            yield u, view

    # One slice copy per block and tensor: measured 1.6x faster than one gather per tensor (numpy's
    # fancy indexing copies through a temporary), 7.3 against 4.3 GB/s for 93 SmolLM2 blocks.
    def to_host(self, blocks: np.ndarray, rows: np.ndarray, slots: np.ndarray) -> None:
        """rows[slots[i]] = pool block blocks[i], for every i."""
        pairs = list(zip(np.asarray(slots).tolist(), np.asarray(blocks).tolist()))
        for u, view in self._row_views(rows):
            for slot, block in pairs:
                view[slot] = u[:, block]

    def to_pool(self, rows: np.ndarray, slots: np.ndarray, blocks: np.ndarray) -> None:
        """Pool block blocks[i] = rows[slots[i]], for every i."""
        pairs = list(zip(np.asarray(slots).tolist(), np.asarray(blocks).tolist()))
        for u, view in self._row_views(rows):
            for slot, block in pairs:
                u[:, block] = view[slot]
