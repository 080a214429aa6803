"""A multi-tier KV cache: prefixes that outlive the KV pool (a host RAM tier) and the process (a disk tier).

The radix tree (rtp/runtime/radix_cache.pyx) caches prefixes in the KV pool, tier 0, and gives
its least recent blocks up when the pool needs them. With tiers on, every block a request leaves
in the tree is also copied, when the request ends, into the host tier (tier 1, host.py) and from
there, off the engine thread, into the disk tier (tier 2, disk.py). A block is named by a hash
chain over the token ids up to its end, seeded with a fingerprint of the model and its KV layout
(blocks.py), so a block means the same thing in every process of the same model: the disk tier
survives restarts and can be shared by several nodes through one directory.

When a request arrives, its prompt's blocks past the pool's match are looked up tier by tier;
if loading them measures cheaper than recomputing those tokens (component.py: both measured
online), the host tier's blocks are copied into pool blocks and inserted into the radix tree
before the scheduler admits the request, so its prefill continues from the end of the hit; disk
blocks are read into the host tier first, on a reader thread, while the request waits out of
the queue (Scheduler.defer) and the other requests keep stepping.

    blocks.py      the fingerprint, the hash chain, block copies between the pool and host memory
    host.py        tier 1: a bounded RAM store of blocks, least recently used evicted
    disk.py        tier 2: one checksummed file per block, content-addressed, atomic writes
    costs.py       what a load from each tier and a recomputed token measure here
    component.py   the engine component: look-ups, cost decisions, loads, saves, counters
"""

from rtp.engine.kv_tiers.component import KVTiers, build_kv_tiers

__all__ = ["KVTiers", "build_kv_tiers"]
