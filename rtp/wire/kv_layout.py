"""KVLayout: what a node's KV cache looks like on the wire, block size aside.

A prefill node hands KV only to a decode node of the same layout: the reserve RPC carries the
prefill node's, the decode node compares it with its own (`mismatch`), and each KV frame's size
is checked against it (`token_bytes`). A layer's KV travels token-major, [lead, num_tokens,
*trail] in the cache's dtype (rtp/engine/kv_transfer.py), so nodes of different block sizes
exchange it without either knowing the other's.

This is the wire's own struct, not the engine's: the engine describes its cache in its own
terms (rtp/engine/kv_transfer.py KVLayout, which must not import this package: imports run
from the server down to the engine, never up), and the server builds this one from it
(rtp/server/pd/node.py `wire_layout`). Two structs and one conversion keep the RPC's format a
decision of the RPC's (versioned with RPC_VERSION): a change of how the engine lays out its
cache cannot change what goes over the wire without an edit here.
"""

from __future__ import annotations

import math

import msgspec

# bytes per value of each dtype a cache may hold, by the name the wire gives it (torch's own name
# without "torch."); an unknown name is refused where a layout arrives, not guessed
ITEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


class KVLayout(msgspec.Struct, frozen=True):
    """A node's KV cache: its dtype, and per layer [lead, *trail] (the cache's shape without the
    blocks and the block size: lead 2 for K and V, 1 for MLA's latent; trail the per-token heads
    and dims)."""

    dtype: str
    layers: list[list[int]]

    def token_bytes(self, layer: int) -> int:
        """Bytes one token of this layer takes on the wire."""
        return math.prod(self.layers[layer]) * ITEM_BYTES[self.dtype]

    def mismatch(self, other: KVLayout) -> str | None:
        """Why KV in layout `other` cannot go into this one (None: it can)."""
        if other.dtype not in ITEM_BYTES:
            return f"KV dtype {other.dtype!r} is not one rtp transfers ({', '.join(ITEM_BYTES)})"
        if other.dtype != self.dtype:
            return f"KV dtype {other.dtype} cannot go into a {self.dtype} cache (start both nodes with the same --dtype)"
        if other.layers != self.layers:
            return (f"KV of {len(other.layers)} layers shaped {other.layers[:1]} cannot go into a cache of "
                    f"{len(self.layers)} layers shaped {self.layers[:1]} (not the same model)")
        return None
