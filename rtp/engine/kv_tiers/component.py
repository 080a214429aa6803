"""KVTiers: the engine component that keeps prefixes past the KV pool, in host RAM and on disk.

    admit(request)        note its prompt
    before_schedule       land finished disk reads (host rows registered; the request's blocks into
                          the pool; the request queued again); look up the requests the scheduler
                          admits next (new, or back in the queue after a preemption), and again
                          whenever the pool lost what it held for one: past the pool's match, the
                          run of blocks the host tier holds, then the disk tier; load them if that
                          measures cheaper than recomputing them, else recompute
    after_emit            note each request's generated tokens; whose prompt is done, which finished
    after_step            copy those requests' cached blocks into the host tier (and queue their disk
                          writes); measure what a prompt token costs to compute
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

import itertools
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from rtp.engine.component import Component
from rtp.engine.kv_tiers.blocks import BlockCopier, extend_chain, fingerprint
from rtp.engine.kv_tiers.costs import Costs
from rtp.engine.kv_tiers.disk import DiskTier
from rtp.engine.kv_tiers.host import HostTier

log = logging.getLogger("rtp.kv_tiers")

_GIB = 1 << 30
_STAGING_GIB = 0.25  # at least, the host rows a disk tier reads through when no host tier is asked for
_READERS = 2  # reader threads: a run of blocks is read by all of them at once
_NEXT = 4  # how far into the waiting queue requests are looked up (those the scheduler admits soon)


def _lowest_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except OSError:
        pass


class _Parts:
    """A run of blocks read by every reader thread at once, each a contiguous share (reading and
    checking a block's CRC is CPU work: one thread read 0.95-1.05 GB/s from a 2.2 GB/s drive).
    done() when every share is; result(): how many blocks from the first were read whole, and the
    seconds from the first share's start to the last one's end."""

    def __init__(self, pool: ThreadPoolExecutor, k: int, read, keys: list, tokens: list, rows: list):
        n = len(keys)
        cuts = [n * i // k for i in range(k + 1)]
        self.futures = [pool.submit(read, keys[a:b], tokens[a:b], rows[a:b])
                        for a, b in zip(cuts, cuts[1:]) if b > a]

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def result(self) -> tuple[int, float]:
        parts = [f.result() for f in self.futures]
        ok = [flag for flags, _, _ in parts for flag in flags]
        done = ok.index(False) if False in ok else len(ok)
        return done, max(end for _, _, end in parts) - min(start for _, start, _ in parts)


@dataclass
class _Read:
    """Disk blocks on their way into host rows for a deferred request."""

    rid: int
    prompt: np.ndarray                 # the request's tokens
    keys: list[bytes]                  # their chain (the blocks read are keys[start:start + len(rows)])
    start: int
    rows: list[int]
    future: _Parts
    decision: dict                     # the look-up's record: what loading took is added when it lands
    gone: bool = False                 # the request finished meanwhile: land the rows, place nothing
    started: float = field(default_factory=time.monotonic)


class KVTiers(Component):
    name = "kv_tiers"

    def __init__(self, *, scheduler, cache, copier: BlockCopier, block_size: int, seed: bytes, host: HostTier,
                 disk: DiskTier | None):
        self.scheduler, self.cache, self.allocator = scheduler, cache, cache.allocator
        self.block_size, self.seed, self.host, self.disk = block_size, seed, host, disk
        self.copier = copier
        if copier.block_bytes != host.block_bytes:
            raise ValueError("the host tier's rows are not the size of a KV block")
        self.costs = Costs()
        self.core = None
        self._reader = ThreadPoolExecutor(_READERS, "rtp-kv-read") if disk is not None else None
        # writes are background work: at the lowest CPU priority, they take no time the engine's threads want
        self._writer = ThreadPoolExecutor(1, "rtp-kv-write", initializer=_lowest_priority) if disk is not None else None
        self._prompts: dict[int, np.ndarray] = {}     # rid -> prompt, while it runs
        self._keys: dict[int, list[bytes]] = {}       # rid -> its chain so far
        self._generated: dict[int, list[int]] = {}    # rid -> tokens sampled so far
        self._ended: list[int] = []                   # rids that finished this step
        self._prompted: list[int] = []                # rids whose first token came this step
        self._seen: dict[int, int] = {}               # rid -> the pool's blocks for it after its last look-up
        self._counted: set[int] = set()               # rids looked up once (their hits and misses counted)
        self._claimed = 0
        self._held: list[np.ndarray] = []             # matched paths held while the scheduler plans
        self._prefilling: set[int] = set()            # rids admitted or queued that still compute tokens
        self._awaiting: dict[int, tuple] = {}         # deferred until the pool has room, in arrival order:
        #                                               (tokens, the host rows its disk read filled or None)
        self._order: dict[int, int] = {}              # rid -> arrival number
        self._arrivals = itertools.count()
        self._reads: dict[int, _Read] = {}            # deferred requests' disk reads
        self._orphans: list[_Read] = []               # reads of requests gone meanwhile
        self._writes: deque[tuple[Future, int]] = deque()  # disk writes in flight, their pinned rows
        self.decisions: deque[dict] = deque(maxlen=1024)   # the latest look-ups' choices, for logs and tools
        self.counts = {"lookups": 0, "pool_tokens": 0, "host_tokens": 0, "disk_tokens": 0, "missed_tokens": 0,
                       "decided_load": 0, "decided_recompute": 0, "placed_blocks": 0, "place_failed": 0,
                       "host_bytes_loaded": 0, "host_seconds": 0.0, "disk_bytes_read": 0, "disk_seconds": 0.0,
                       "host_blocks_stored": 0, "disk_writes_queued": 0, "reloads": 0, "extended_tokens": 0,
                       "waited_for_room": 0}

    # -- hooks ------------------------------------------------------------------------------------

    def admit(self, request) -> None:
        prompt = np.asarray(request.prompt_ids, dtype=np.int32)
        for rid in request.rids:
            self._prompts[rid] = prompt
            self._generated[rid] = []
            self._prefilling.add(rid)
            self._order[rid] = next(self._arrivals)

    def before_schedule(self, core) -> None:
        self.core = core
        self._unpin_written()
        s = self.scheduler
        if self._reads or self._orphans:
            self._land(wait=s.num_running == 0 and s.num_waiting == 0 and s.num_ready == 0)
        self._claimed = 0  # blocks this step's placements (and their first chunks) count on
        for rid, (tokens, rows) in list(self._awaiting.items()):  # first come, first served
            if not self._room_for(tokens):
                break
            del self._awaiting[rid]
            s.undefer(rid)
            if rows is not None:  # its disk blocks are in host rows now: the load it was deferred for, placed
                self._place(rid, tokens, self._chain(rid, tokens, (len(tokens) - 1) // self.block_size))
                self._unpin(rows)
            else:
                self._look_up(rid, tokens)
            self._hold(tokens)
        if self._awaiting:
            # while the oldest waits for room, requests that came after it wait too, or they would take
            # the room it waits for, one after another (requests preempted meanwhile are older: they run)
            first = self._order[next(iter(self._awaiting))]
            for rid in s.waiting_request_ids():
                if self._order.get(rid, -1) > first:
                    s.defer(rid)
                    self._await(rid, self._tokens(rid), None)
        if self._prefilling:
            self._extend_running()
        if not s.num_waiting:
            return
        # the requests the scheduler admits next (new ones, and preempted ones back in the queue), each
        # once more whenever the pool has lost some of what it matched for them the last time (an
        # earlier look found the pool holding a prefix that it evicted before the request's turn)
        for i, rid in enumerate(s.waiting_request_ids()[:_NEXT]):
            if rid not in self._prompts:
                continue
            tokens = self._tokens(rid)
            self._prefilling.add(rid)  # new, or preempted: what it computes next may be in a tier
            if self._look_up(rid, tokens) or i == 0:
                # the allocations of this schedule for the running requests must not evict what it
                # matches before it is admitted: held until the scheduler has planned
                self._hold(tokens)

    def _extend_running(self) -> None:
        """Running requests still computing their tokens (admitted when the pool had no room to load
        their prefix, or past what was loaded) take their next blocks from the host tier as the pool
        makes room: Scheduler.extend, then the rows copied in."""
        s, bs = self.scheduler, self.block_size
        for rid in s.running_request_ids():
            if rid not in self._prefilling:
                continue
            state = s.request_state(rid)
            c, tokens = state["num_computed_tokens"], state["token_ids"]
            n = (len(tokens) - 1) // bs
            j = c // bs
            if j >= n:
                continue
            keys = self._chain(rid, tokens, n)
            rows = []
            room = self.allocator.num_free - s.num_running - self._claimed + -(-c // bs) - j
            while j + len(rows) < n and len(rows) < room and (row := self.host.get(keys[j + len(rows)])) is not None:
                rows.append(row)
            k = j + len(rows)
            if k * bs <= c:
                continue
            load_s = self.costs.load(len(rows) * self.host.block_bytes, 0)
            recompute_s = self.costs.recompute(k * bs - c)
            if load_s > recompute_s:
                continue
            started = time.monotonic()
            blocks = s.extend(rid, k)
            self.copier.to_pool(self.host.rows, np.asarray(rows), blocks)
            self._claimed += len(rows)
            seconds = self._copied_in(rid, blocks, len(rows), started)
            self.counts["extended_tokens"] += k * bs - c
            self.counts["host_tokens"] += k * bs - c
            self.decisions.append({"rid": rid, "running": True, "pool_tokens": c, "host_tokens": k * bs - c,
                                   "disk_tokens": 0, "load_seconds": load_s, "recompute_seconds": recompute_s,
                                   "load": True, "loaded_tokens": k * bs - c, "loaded_seconds": seconds})

    def _copied_in(self, rid: int, blocks: np.ndarray, num_rows: int, started: float) -> float:
        """Host rows were copied into a request's pool blocks since `started`: the host tier's measured
        cost and counters, and the other components told that these blocks' KV came from outside the
        model (a draft model marks its own KV there stale). Returns the seconds it took."""
        seconds = time.monotonic() - started
        nbytes = num_rows * self.host.block_bytes
        self.costs.loaded("host", nbytes, seconds)
        self.counts["host_bytes_loaded"] += nbytes
        self.counts["host_seconds"] += seconds
        if self.core is not None:
            request = self.core.requests.of(rid)
            for c in self.core.components:
                if c is not self:
                    c.reserved(request, blocks)
        return seconds

    def after_schedule(self, core) -> None:
        while self._held:
            self.allocator.free(self._held.pop())

    def _hold(self, tokens: np.ndarray) -> None:
        matched, _ = self.cache.match_prefix(tokens, count=False)
        if len(matched):
            self.allocator.acquire(matched)
            self._held.append(matched)

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
                self._prefilling.discard(rid)  # its tokens are computed: it samples
                if finish:
                    self._ended.append(rid)
                elif len(tokens) == 1:
                    self._prompted.append(rid)  # its prompt is computed and in the radix tree

    def after_step(self, step) -> None:
        plan = step.plan
        prompt_tokens = plan.num_tokens - plan.num_decode_rows
        if prompt_tokens >= 4 * self.block_size and prompt_tokens >= 0.75 * plan.num_tokens:
            self.costs.computed(plan.num_tokens, step.seconds)
        if self._prompted:
            prompted, self._prompted = self._prompted, []
            for rid in prompted:
                self._save(rid)
        if self._ended:
            ended, self._ended = self._ended, []
            for rid in ended:
                self._save(rid)
                self._drop(rid)

    def finished(self, rid: int) -> None:
        waiting = self._awaiting.pop(rid, None)
        if waiting is not None and waiting[1]:
            self._unpin(waiting[1])
        read = self._reads.pop(rid, None)
        if read is not None:
            read.gone = True
            self._orphans.append(read)
        if rid not in self._ended:
            self._drop(rid)

    def _drop(self, rid: int) -> None:
        self._seen.pop(rid, None)
        self._order.pop(rid, None)
        self._prefilling.discard(rid)
        self._counted.discard(rid)
        self._prompts.pop(rid, None)
        self._keys.pop(rid, None)
        self._generated.pop(rid, None)

    # -- look-up and loading ----------------------------------------------------------------------

    def _chain(self, rid: int, tokens: np.ndarray, nblocks: int) -> list[bytes]:
        keys = self._keys.setdefault(rid, [])
        return extend_chain(keys, tokens, nblocks, self.block_size, self.seed)

    def _look_up(self, rid: int, tokens: np.ndarray) -> bool:
        """The blocks of a waiting request's tokens past the pool's match: loaded from the tiers where
        that measures cheaper than computing them. Nothing when the pool still holds all it held for
        the request at its last look-up. True when blocks were placed in the pool for it now."""
        bs = self.block_size
        n = (len(tokens) - 1) // bs  # at least the last token is computed (its logits)
        if n == 0:
            return False
        matched, _ = self.cache.match_prefix(tokens, count=False)
        m = len(matched)
        seen = self._seen.get(rid)
        if seen is not None and m >= seen:
            return False
        again = rid in self._counted
        if not again:
            self._counted.add(rid)
            self.counts["lookups"] += 1
            self.counts["pool_tokens"] += m * bs
        if m >= n:
            self._seen[rid] = m
            return False
        keys = self._chain(rid, tokens, n)
        if again and keys[m] not in self.host and (self.disk is None or not self.disk.contains(keys[m])):
            self._seen[rid] = m
            return False
        j = m
        while j < n and keys[j] in self.host:
            j += 1
        host_blocks, d = j - m, j
        if self.disk is not None:
            while d < n and self.disk.contains(keys[d]):
                d += 1
        disk_blocks = d - j
        if not again:
            self.counts["missed_tokens"] += (n - d) * bs
        if not host_blocks + disk_blocks:
            self._seen[rid] = m
            return False
        if not self._fits(len(tokens), m, host_blocks + disk_blocks):
            # no room for the hit now: the request waits out of the queue until there is (admitted now it
            # would compute what the tier holds a chunk at a time, preempting others as it grows)
            self.scheduler.defer(rid)
            self._await(rid, tokens, None)
            self.counts["waited_for_room"] += 1
            return False
        self._seen[rid] = m
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
            return False
        if host_blocks:
            self.counts["host_tokens"] += host_blocks * bs
        if again:
            self.counts["reloads"] += 1
        rows = []
        while len(rows) < disk_blocks and (row := self.host.take()) is not None:
            rows.append(row)
        if not rows:
            started = time.monotonic()
            decision["loaded_tokens"] = self._place(rid, tokens, keys[:n]) * bs
            decision["loaded_seconds"] = time.monotonic() - started
            return decision["loaded_tokens"] > 0
        start = m + host_blocks
        self.scheduler.defer(rid)
        own = [tokens[(start + i) * bs:(start + i + 1) * bs] for i in range(len(rows))]
        future = _Parts(self._reader, _READERS, self._read, keys[start:start + len(rows)], own, rows)
        self._reads[rid] = _Read(rid, tokens, keys[:n], start, rows, future, decision)
        return False  # deferred: placed when its blocks are read

    def _await(self, rid: int, tokens: np.ndarray, rows: list[int] | None) -> None:
        """A deferred request waits for room in the pool, in arrival order; `rows`: the host rows its
        disk read filled, pinned until placed (else the host tier's saves meanwhile could evict them)."""
        self._seen.pop(rid, None)
        self._awaiting[rid] = (tokens, rows)
        if len(self._awaiting) > 1 and self._order[rid] < self._order[next(reversed(self._awaiting))]:
            self._awaiting = dict(sorted(self._awaiting.items(), key=lambda item: self._order[item[0]]))

    def _tokens(self, rid: int) -> np.ndarray:
        prompt, generated = self._prompts[rid], self._generated[rid]
        return np.concatenate([prompt, np.asarray(generated, dtype=np.int32)]) if generated else prompt

    def _room_for(self, tokens: np.ndarray) -> bool:
        """Whether a request waiting for room can have its hit placed now (without claiming it)."""
        n = (len(tokens) - 1) // self.block_size
        matched, _ = self.cache.match_prefix(tokens, count=False)
        claimed = self._claimed
        fits = n <= len(matched) or self._fits(len(tokens), len(matched), n - len(matched))
        self._claimed = claimed
        return fits or (self.scheduler.num_running == 0 and not self._held)

    def _fits(self, num_tokens: int, matched: int, blocks: int) -> bool:
        """Whether the pool can take a request's `blocks` loaded blocks now beside its matched ones, the
        first chunk after them and a block for each running request (else the scheduler would not admit
        it now and the blocks would be evicted before it is); if so, they are claimed for this step."""
        s, bs = self.scheduler, self.block_size
        if s.num_running >= s.max_num_seqs:
            return False
        room = self.allocator.num_free - self._claimed - s.num_running - matched
        chunk = min(s.max_num_batched_tokens, max(1, num_tokens - (matched + blocks) * bs))
        need = blocks + -(-chunk // bs)
        if need > room:
            return False
        self._claimed += matched + need  # the next request's placement must not evict these
        return True

    def _read(self, keys: list[bytes], tokens: list[np.ndarray], rows: list[int]) -> tuple[list[bool], float, float]:
        """A reader thread: its share of a run of blocks into their rows; which were read whole."""
        started, ok = time.monotonic(), []
        try:
            self.disk.prefetch(keys)
            for key, toks, row in zip(keys, tokens, rows):
                ok.append(self.disk.read(key, toks, self.host.rows[row]))
                if not ok[-1]:
                    break
        except Exception:
            log.exception("KV disk tier: a read failed")
        return ok + [False] * (len(keys) - len(ok)), started, time.monotonic()

    def _land(self, wait: bool) -> None:
        """Disk reads that are done: their rows into the host tier, their requests on to wait for room
        in the pool (placed, and queued again, by before_schedule). With `wait` (nothing else could
        run) the oldest is waited for."""
        for read in list(self._orphans):
            if read.future.done():
                self._orphans.remove(read)
                self._rows_in(read)
        for rid, read in list(self._reads.items()):
            if not read.future.done() and not wait:
                continue
            wait = False
            del self._reads[rid]
            done = self._rows_in(read)
            # from the look-up to the blocks in host rows: the read, and the wait for the step in flight
            read.decision["loaded_seconds"] = time.monotonic() - read.started
            read.decision["loaded_tokens"] = done * self.block_size
            # placed (and queued again) as the requests waiting for room are, when the pool has it
            rows = [self.host.index[k] for k in read.keys[read.start:read.start + done] if k in self.host.index]
            for row in rows:
                self.host.pin(row)
            self._await(rid, read.prompt, rows)

    def _unpin(self, rows: list[int]) -> None:
        for row in rows:
            self.host.unpin(row)

    def _rows_in(self, read: _Read) -> int:
        """A finished read's rows registered in the host tier (those it did not fill freed); how many it filled."""
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
        return done

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
        self._seen[rid] = len(path)
        self._copied_in(rid, blocks, len(rows), started)
        self.counts["placed_blocks"] += len(rows)
        return len(rows)

    # -- saving -----------------------------------------------------------------------------------

    def _save(self, rid: int) -> None:
        """A finished request's cached blocks (prompt and generated tokens) into the host tier, the
        new ones on to the disk tier."""
        if rid not in self._prompts:
            return
        tokens = self._tokens(rid)
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
        """Wait until every queued disk write is done (tools, tests; at exit the interpreter waits for them)."""
        for future, _ in list(self._writes):
            future.result(timeout)
        self._unpin_written()

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
        token_bytes = self.host.block_bytes / self.block_size
        out["route"] = {"host_blocks": self.host.capacity, "host_saving": self.costs.saving("host", token_bytes),
                        "disk_id": "", "disk_blocks": 0, "disk_saving": 0.0}
        if self.disk is not None:
            out["route"].update(disk_id=self.disk.id, disk_blocks=self.disk.budget // self.disk.file_bytes,
                                disk_saving=self.costs.saving("disk", token_bytes))
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
    # without a host tier of its own, the disk tier reads through host rows enough for 4 whole contexts
    staging = max(int(_STAGING_GIB * _GIB) // copier.block_bytes, 4 * -(-scheduler.max_model_len // bs))
    rows = int(host_gb * _GIB) // copier.block_bytes if host_gb else staging
    host = HostTier(rows, copier.block_bytes)
    disk = None
    if disk_dir:
        disk = DiskTier(disk_dir, seed, int(cache_config.kv_disk_cache_gb * _GIB), copier.block_bytes, bs)
    log.info("KV cache tiers: host %d blocks (%.2f GiB)%s", rows, rows * copier.block_bytes / _GIB,
             f", disk {disk.dir} ({cache_config.kv_disk_cache_gb:g} GiB, {len(disk.index)} blocks found)" if disk else "")
    return KVTiers(scheduler=scheduler, cache=cache, copier=copier, block_size=bs, seed=seed, host=host, disk=disk)
