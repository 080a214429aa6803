"""KVTiers: the engine component that keeps prefixes past the KV pool, in host RAM and on disk.

    admit(request)        note its prompt, to be looked up before the next schedule
    before_schedule       land finished disk reads (host rows registered; the request's blocks into
                          the pool; the request queued again); look the new prompts up: past the
                          pool's match, the run of blocks the host tier holds, then the disk tier;
                          load them if that measures cheaper than recomputing them, else recompute
    after_emit            note each request's generated tokens; those that finished
    after_step            copy the finished requests' cached blocks into the host tier (and queue
                          their disk writes); measure what a prompt token costs to compute
    finished(rid)         forget it (a read in flight lands in the host tier all the same)

Loading is always host -> pool: a disk hit is first read into host rows on the reader thread while
the request waits out of the queue (Scheduler.defer), and is placed the same way once read. Placing
holds the pool's matched blocks, allocates the rest, copies the rows in and inserts the whole path
into the radix tree, then lets go: the blocks are the tree's most recently used, which the
scheduler matches as for any prefix hit when it admits the request first in line. Nothing is held
across steps, so a request aborted or preempted at any point leaves nothing behind. Other
components learn that these blocks' KV came from outside the model (`reserved`: a draft model
marks its own KV there stale).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from rtp.engine.component import Component
from rtp.engine.kv_tiers.blocks import BlockCopier, extend_chain, fingerprint
from rtp.engine.kv_tiers.disk import DiskTier
from rtp.engine.kv_tiers.host import HostTier

log = logging.getLogger("rtp.kv_tiers")

_GIB = 1 << 30
_STAGING_GIB = 0.25  # the host rows a disk tier reads through when no host tier is asked for


class Costs:
    """What loading and recomputing measure here, as moving averages: seconds per byte from each tier
    (a disk load also pays the host copy), seconds per prompt token computed. The priors only
    decide until the first measurements: a host copy at 4 GB/s, a disk at 1 GB/s, 10,000 prompt
    tokens a second (more than a CPU prefills: recompute is not underrated)."""

    def __init__(self):
        self.per_byte = {"host": 1 / 4e9, "disk": 1 / 1e9}
        self.per_token = 1e-4
        self.samples = {"host": 0, "disk": 0, "recompute": 0}

    def _mix(self, old: float, new: float, what: str) -> float:
        self.samples[what] += 1
        return new if self.samples[what] == 1 else 0.7 * old + 0.3 * new

    def loaded(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes >= 1 << 20:  # smaller copies measure the call, not the bandwidth
            self.per_byte[tier] = self._mix(self.per_byte[tier], seconds / nbytes, tier)

    def computed(self, tokens: int, seconds: float) -> None:
        self.per_token = self._mix(self.per_token, seconds / tokens, "recompute")

    def load(self, host_bytes: int, disk_bytes: int) -> float:
        return (host_bytes + disk_bytes) * self.per_byte["host"] + disk_bytes * self.per_byte["disk"]

    def recompute(self, tokens: int) -> float:
        return tokens * self.per_token


@dataclass
class _Read:
    """Disk blocks on their way into host rows for a deferred request."""

    rid: int
    prompt: np.ndarray
    keys: list[bytes]                  # the prompt's chain (the blocks read are keys[start:start + len(rows)])
    start: int
    rows: list[int]
    future: Future
    gone: bool = False                 # the request finished meanwhile: land the rows, place nothing
    started: float = field(default_factory=time.monotonic)


class KVTiers(Component):
    name = "kv_tiers"

    def __init__(self, *, scheduler, cache, tensors, block_size: int, seed: bytes, host: HostTier,
                 disk: DiskTier | None):
        self.scheduler, self.cache, self.allocator = scheduler, cache, cache.allocator
        self.block_size, self.seed, self.host, self.disk = block_size, seed, host, disk
        self.copier = BlockCopier(tensors)
        if self.copier.block_bytes != host.block_bytes:
            raise ValueError("the host tier's rows are not the size of a KV block")
        self.costs = Costs()
        self.core = None
        self._reader = ThreadPoolExecutor(1, "rtp-kv-read") if disk is not None else None
        self._writer = ThreadPoolExecutor(1, "rtp-kv-write") if disk is not None else None
        self._new: dict[int, np.ndarray] = {}         # rid -> prompt, not looked up yet
        self._prompts: dict[int, np.ndarray] = {}     # rid -> prompt, while it runs
        self._keys: dict[int, list[bytes]] = {}       # rid -> its chain so far
        self._generated: dict[int, list[int]] = {}    # rid -> tokens sampled so far
        self._ended: list[int] = []                   # rids that finished this step
        self._reads: dict[int, _Read] = {}            # deferred requests' disk reads
        self._orphans: list[_Read] = []               # reads of requests gone meanwhile
        self._writes: deque[tuple[Future, int]] = deque()  # disk writes in flight, their pinned rows
        self.decisions: deque[dict] = deque(maxlen=1024)   # the latest look-ups' choices, for logs and tools
        self.counts = {"lookups": 0, "pool_tokens": 0, "host_tokens": 0, "disk_tokens": 0, "missed_tokens": 0,
                       "decided_load": 0, "decided_recompute": 0, "placed_blocks": 0, "place_failed": 0,
                       "host_bytes_loaded": 0, "host_seconds": 0.0, "disk_bytes_read": 0, "disk_seconds": 0.0,
                       "host_blocks_stored": 0, "disk_writes_queued": 0}

    # -- hooks ------------------------------------------------------------------------------------

    def admit(self, request) -> None:
        prompt = np.asarray(request.prompt_ids, dtype=np.int32)
        for rid in request.rids:
            self._new[rid] = prompt
            self._prompts[rid] = prompt
            self._generated[rid] = []

    def before_schedule(self, core) -> None:
        self.core = core
        self._unpin_written()
        if self._reads or self._orphans:
            s = self.scheduler
            idle = s.num_running == 0 and s.num_waiting == 0 and s.num_ready == 0
            self._land(wait=idle and not self._new)
        if self._new:
            new, self._new = self._new, {}
            for rid, prompt in new.items():
                if self.scheduler.has_request(rid) and self.scheduler.request_state(rid)["state"] == "waiting":
                    self._look_up(rid, prompt)

    def after_emit(self, step) -> None:
        s, n = self.scheduler, step.events
        if not n:
            return
        generated = self._generated
        for rid, token, finish in zip(s.event_req_ids[:n].tolist(), s.event_tokens[:n].tolist(),
                                      s.event_finish[:n].tolist()):
            tokens = generated.get(rid)
            if tokens is not None:
                tokens.append(token)
                if finish:
                    self._ended.append(rid)

    def after_step(self, step) -> None:
        plan = step.plan
        prompt_tokens = plan.num_tokens - plan.num_decode_rows
        if prompt_tokens >= 4 * self.block_size and prompt_tokens >= 0.75 * plan.num_tokens:
            self.costs.computed(plan.num_tokens, step.seconds)
        if self._ended:
            ended, self._ended = self._ended, []
            for rid in ended:
                self._save(rid)
                self._drop(rid)

    def finished(self, rid: int) -> None:
        self._new.pop(rid, None)
        read = self._reads.pop(rid, None)
        if read is not None:
            read.gone = True
            self._orphans.append(read)
        if rid not in self._ended:
            self._drop(rid)

    def _drop(self, rid: int) -> None:
        self._prompts.pop(rid, None)
        self._keys.pop(rid, None)
        self._generated.pop(rid, None)

    # -- look-up and loading ----------------------------------------------------------------------

    def _chain(self, rid: int, tokens: np.ndarray, nblocks: int) -> list[bytes]:
        keys = self._keys.setdefault(rid, [])
        return extend_chain(keys, tokens, nblocks, self.block_size, self.seed)

    def _look_up(self, rid: int, prompt: np.ndarray) -> None:
        bs = self.block_size
        n = (len(prompt) - 1) // bs  # at least the last token is computed (its logits)
        if n == 0:
            return
        matched, _ = self.cache.match_prefix(prompt, count=False)
        m = len(matched)
        self.counts["lookups"] += 1
        self.counts["pool_tokens"] += m * bs
        if m >= n:
            return
        keys = self._chain(rid, prompt, n)
        j = m
        while j < n and keys[j] in self.host:
            j += 1
        host_blocks, d = j - m, j
        if self.disk is not None:
            while d < n and self.disk.contains(keys[d]):
                d += 1
        disk_blocks = d - j
        self.counts["missed_tokens"] += (n - d) * bs
        if not host_blocks + disk_blocks:
            return
        bb = self.host.block_bytes
        load_s = self.costs.load(host_blocks * bb, disk_blocks * bb)
        recompute_s = self.costs.recompute((host_blocks + disk_blocks) * bs)
        skipped = 0
        if disk_blocks and host_blocks and load_s > recompute_s:  # the disk is the slow part: the host's alone
            skipped, disk_blocks = disk_blocks, 0
            load_s = self.costs.load(host_blocks * bb, 0)
            recompute_s = self.costs.recompute(host_blocks * bs)
        load = load_s <= recompute_s
        self.counts["decided_load" if load else "decided_recompute"] += 1
        decision = {"rid": rid, "pool_tokens": m * bs, "host_tokens": host_blocks * bs,
                    "disk_tokens": disk_blocks * bs, "disk_tokens_not_read": skipped * bs, "load_seconds": load_s,
                    "recompute_seconds": recompute_s, "load": load}
        self.decisions.append(decision)
        log.debug("KV tiers: %s", decision)
        if not load:
            return
        if host_blocks:
            self.counts["host_tokens"] += host_blocks * bs
        if not disk_blocks:
            self._place(rid, prompt, keys[:n])
            return
        rows = []
        while len(rows) < disk_blocks and (row := self.host.take()) is not None:
            rows.append(row)
        if not rows:
            self._place(rid, prompt, keys[:n])
            return
        start = m + host_blocks
        self.scheduler.defer(rid)
        tokens = [prompt[(start + i) * bs:(start + i + 1) * bs] for i in range(len(rows))]
        future = self._reader.submit(self._read, keys[start:start + len(rows)], tokens, rows)
        self._reads[rid] = _Read(rid, prompt, keys[:n], start, rows, future)

    def _read(self, keys: list[bytes], tokens: list[np.ndarray], rows: list[int]) -> tuple[int, float]:
        """Reader thread: blocks into their rows, in order, up to the first that fails."""
        started, done = time.monotonic(), 0
        try:
            for key, toks, row in zip(keys, tokens, rows):
                if not self.disk.read(key, toks, self.host.rows[row]):
                    break
                done += 1
        except Exception:
            log.exception("KV disk tier: a read failed")
        return done, time.monotonic() - started

    def _land(self, wait: bool) -> None:
        """Disk reads that are done: their rows into the host tier, their requests' blocks into the
        pool, the requests queued again. With `wait` (nothing else could run) the oldest is waited for."""
        for read in list(self._orphans):
            if read.future.done():
                self._orphans.remove(read)
                self._rows_in(read)
        for rid, read in list(self._reads.items()):
            if not read.future.done() and not wait:
                continue
            wait = False
            del self._reads[rid]
            self._rows_in(read)
            self._place(rid, read.prompt, read.keys)
            self.scheduler.undefer(rid)

    def _rows_in(self, read: _Read) -> None:
        done, seconds = read.future.result()
        for i, row in enumerate(read.rows):
            if i < done:
                self.host.put(read.keys[read.start + i], row)
            else:
                self.host.drop(row)
        nbytes = done * self.host.block_bytes
        self.counts["disk_bytes_read"] += nbytes
        self.counts["disk_seconds"] += seconds
        if not read.gone:
            self.counts["disk_tokens"] += done * self.block_size
        self.costs.loaded("disk", nbytes, seconds)

    def _place(self, rid: int, prompt: np.ndarray, keys: list[bytes]) -> int:
        """The host tier's run of blocks past the pool's match, into pool blocks and the radix tree
        (nothing held afterwards). Returns the blocks placed."""
        matched, _ = self.cache.match_prefix(prompt, count=False)
        m, rows = len(matched), []
        for key in keys[len(matched):]:
            row = self.host.get(key)
            if row is None:
                break
            rows.append(row)
        if not rows:
            return 0
        started = time.monotonic()
        alloc = self.allocator
        alloc.acquire(matched)
        try:
            blocks = alloc.allocate(len(rows))
        except MemoryError:
            alloc.free(matched)
            self.counts["place_failed"] += 1
            return 0
        path = np.concatenate([matched, blocks]).astype(np.int32)
        try:
            self.copier.to_pool(self.host.rows, np.asarray(rows), blocks)
            self.cache.insert(prompt[:len(path) * self.block_size], path)
        finally:
            alloc.free(path)
        seconds = time.monotonic() - started
        nbytes = len(rows) * self.host.block_bytes
        self.costs.loaded("host", nbytes, seconds)
        self.counts["placed_blocks"] += len(rows)
        self.counts["host_bytes_loaded"] += nbytes
        self.counts["host_seconds"] += seconds
        request = self.core.requests.of(rid) if self.core is not None else None
        for c in (self.core.components if self.core is not None else ()):
            if c is not self:
                c.reserved(request, blocks)  # their KV came from outside the model
        return len(rows)

    # -- saving -----------------------------------------------------------------------------------

    def _save(self, rid: int) -> None:
        """A finished request's cached blocks (prompt and generated tokens) into the host tier, the
        new ones on to the disk tier."""
        prompt = self._prompts.get(rid)
        if prompt is None:
            return
        generated = self._generated.get(rid) or []
        tokens = np.concatenate([prompt, np.asarray(generated, dtype=np.int32)]) if generated else prompt
        blocks, _ = self.cache.match_prefix(tokens, leave_last=False, count=False)
        if not len(blocks):
            return
        keys = self._chain(rid, tokens, len(blocks))
        new_blocks, rows, new_keys = [], [], []
        for i, key in enumerate(keys):
            if self.host.get(key) is not None:
                continue
            row = self.host.take()
            if row is None:
                break
            new_blocks.append(blocks[i])
            rows.append(row)
            new_keys.append((i, key))
        if not rows:
            return
        self.copier.to_host(np.asarray(new_blocks, dtype=np.int32), self.host.rows, np.asarray(rows))
        bs = self.block_size
        for (i, key), row in zip(new_keys, rows):
            self.host.put(key, row)
            if self.disk is not None and self.disk.writable and not self.disk.known(key):
                self.host.pin(row)  # until written: the writer reads the row
                future = self._writer.submit(self.disk.write, key, tokens[i * bs:(i + 1) * bs], self.host.rows[row])
                self._writes.append((future, row))
                self.counts["disk_writes_queued"] += 1
        self.counts["host_blocks_stored"] += len(rows)

    def _unpin_written(self) -> None:
        while self._writes and self._writes[0][0].done():
            future, row = self._writes.popleft()
            self.host.unpin(row)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued disk write is done (tools, tests, shutdown)."""
        for future, _ in list(self._writes):
            future.result(timeout)
        self._unpin_written()

    def close(self) -> None:
        for pool in (self._reader, self._writer):
            if pool is not None:
                pool.shutdown(wait=True)

    def check_integrity(self) -> None:
        self.host.check_integrity()

    def stats(self) -> dict:
        out = dict(self.counts)
        out["host"] = {"blocks": len(self.host), "capacity_blocks": self.host.capacity,
                       "bytes": len(self.host) * self.host.block_bytes, "evictions": self.host.evictions}
        if self.disk is not None:
            out["disk"] = self.disk.stats()
        out["seconds_per_token_recompute"] = self.costs.per_token
        out["seconds_per_byte"] = dict(self.costs.per_byte)
        return out


def build_kv_tiers(cache_config, *, model_path, model_config, runner, scheduler, cache, dtype, kv_dtype,
                   isa: str | None) -> KVTiers | None:
    """The component for --kv-host-cache-gb / --kv-disk-cache, or None when both are off."""
    host_gb, disk_dir = cache_config.kv_host_cache_gb, cache_config.kv_disk_cache
    if not host_gb and not disk_dir:
        return None
    if cache is None:
        raise ValueError("the KV cache tiers (--kv-host-cache-gb, --kv-disk-cache) extend the prefix cache: "
                         "not with --no-enable-prefix-caching")
    tensors = runner.kv_tensors
    copier = BlockCopier(tensors)
    bs = scheduler.block_size
    layout = [(str(t.dtype), tuple(t.shape[:1]) + tuple(t.shape[2:])) for t in tensors]
    seed = fingerprint(model_path, repr(model_config),
                       str(dtype), str(kv_dtype), layout, bs, isa)
    rows = int((host_gb or _STAGING_GIB) * _GIB) // copier.block_bytes
    host = HostTier(rows, copier.block_bytes)
    disk = None
    if disk_dir:
        disk = DiskTier(disk_dir, seed, int(cache_config.kv_disk_cache_gb * _GIB), copier.block_bytes, bs)
    log.info("KV cache tiers: host %d blocks (%.2f GiB)%s", rows, rows * copier.block_bytes / _GIB,
             f", disk {disk.dir} ({cache_config.kv_disk_cache_gb:g} GiB, {len(disk.index)} blocks found)" if disk else "")
    return KVTiers(scheduler=scheduler, cache=cache, tensors=tensors, block_size=bs, seed=seed, host=host, disk=disk)
