"""Routing policies of the FlexLB master: which prefill worker and which decode worker a request goes to.

Pure decision logic over the master's view of its workers -- no HTTP, no clock,
no threads -- so `rtp route` (rtp/router/flexlb.py) and the cluster simulator
(rtp/sim/) drive the very same code.

The view of one worker (`WorkerView`):
- an approximate radix tree of the prompts the master sent it: the runtime's
  RadixCache on a private BlockAllocator as large as the worker's KV cache, so
  it evicts least recently used prefixes when the worker would;
- queued prompt tokens Q: the master's own in-flight accounting (tokens routed
  whose prefill has not finished) or the worker's report, whichever is larger;
- mu: measured prefill tokens per ms (a moving average);
- free KV tokens and the expected KV growth of the requests decoding there;
- the KV tiers under its pool, when it has them (--kv-host-cache-gb, --kv-disk-cache): its host
  tier, and the disk directory it shares with the workers that report the same one (`TierView`).

A prefix a worker holds only in a tier below its pool counts for less than one in the pool: each
such token counts the share of its prefill time a load saves there, as the worker measures it.

FlexLB's prefill choice maximises

    beta * H(R, w) / |R|  -  (1 - beta) * (Q_w / mu_w) / (|R| / mu)

H is R's prefix match against w's tree. The queue time Q_w / mu_w is measured
in units of R's own uncached prefill time (|R| / mu, mu the cluster mean) while
queues are shorter than that, so both terms are dimensionless and at beta = 0.5
the score is the negative of R's estimated time to first token. Once the mean
queue is longer than that, it becomes the unit: the term is then relative load,
and a full prefix hit keeps R on a worker up to about beta / (1 - beta) times
the mean queue -- affinity is not thrown away under load, which would spread
every prefix over every worker and make the overload worse. beta > 0.5 leans
toward cache affinity, beta < 0.5 toward short queues.

Decode choice maximises K_free(d) - gamma * E[S_gen](d): free KV tokens minus
the tokens the requests already decoding there are still expected to generate
(from max_tokens, capped by the running average of actual output lengths).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rtp.runtime import BlockAllocator, RadixCache

POLICIES = ("flexlb", "round-robin", "least-loaded", "cache-aware")


@dataclass
class WorkerReport:
    """What a worker says about itself (the stats RPC), in the fields routing needs."""
    total_blocks: int
    free_blocks: int
    block_size: int
    queued_prompt_tokens: int = 0
    running: int = 0
    waiting: int = 0
    prefill_tokens_per_ms: float = 0.0   # 0: not measured yet
    cached_blocks: int | None = None     # blocks in its prefix cache, when reported
    host_blocks: int = 0                 # its host KV tier's size (0: none)
    host_saving: float = 0.0             # share of a prompt token's compute time a host-tier load saves
    disk_id: str = ""                    # its disk KV tier: the directory's identity and the model's ("" none)
    disk_blocks: int = 0
    disk_saving: float = 0.0


class Pool:
    """The workers of one role. Their numbers live in arrays, one slot per worker, so a
    choice over hundreds of workers is a few vector operations, not a Python loop."""

    FIELDS = ("inflight_queue", "reported_queue", "mu", "free_tokens", "reserved_tokens",
              "expected_remaining", "running", "healthy")

    def __init__(self, role: str):
        self.role = role
        self.views: list[WorkerView] = []
        for f in self.FIELDS:
            setattr(self, f, np.zeros(0, dtype=bool if f == "healthy" else np.float64))
        # first block of a prompt -> workers sent a prompt starting with it: the only ones
        # that can hold any prefix of a new prompt (stale entries just match nothing)
        self.first_block: dict[bytes, set[int]] = {}
        self.rr = 0

    def add(self, view: WorkerView) -> int:
        self.views.append(view)
        for f in self.FIELDS:
            setattr(self, f, np.append(getattr(self, f), False if f == "healthy" else 0.0))
        return len(self.views) - 1

    def queue_ms(self) -> np.ndarray:
        return np.maximum(self.inflight_queue, self.reported_queue) / self.speed()

    def speed(self) -> np.ndarray:
        """Prefill tokens per ms; a worker that has not measured itself yet counts as the
        mean of those that have (as fast as its peers, until it says otherwise)."""
        known = self.mu > 0
        if known.all():
            return self.mu
        return np.where(known, self.mu, self.mu[known].mean() if known.any() else 1.0)

    def usable(self, exclude=()) -> np.ndarray:
        ok = self.healthy.copy()
        for name in exclude:
            for i, v in enumerate(self.views):
                if v.name == name:
                    ok[i] = False
        return ok


class TierView:
    """The master's picture of a KV tier below the pool: one worker's host tier, or a disk directory
    shared by every worker that reports its id. Like a worker's tree, a mirror of the prompts routed
    to it, least recently used evicted at its size."""

    def __init__(self, blocks: int, block_size: int):
        self.blocks, self.block_size = blocks, block_size
        self.tree = RadixCache(BlockAllocator(max(blocks, 2), block_size))
        self.members: set[WorkerView] = set()   # the workers reading it

    def fits(self, blocks: int, block_size: int) -> bool:
        return blocks <= self.blocks and block_size == self.block_size

    def match(self, tokens) -> int:
        return _matched(self.tree, tokens)


def _matched(tree: RadixCache, tokens) -> int:
    """Tokens of `tokens` a mirror holds (whole blocks, the last token included)."""
    _blocks, n = tree.match_prefix(tokens, leave_last=False)
    return int(n)


class _PoolField:
    """A WorkerView attribute stored in its pool's array."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, view, owner=None):
        if view is None:
            return self
        return getattr(view.pool, self.name)[view.index].item()

    def __set__(self, view, value):
        getattr(view.pool, self.name)[view.index] = value


class WorkerView:
    """The master's picture of one worker."""

    inflight_queue = _PoolField()       # prompt tokens routed here whose prefill has not finished
    reported_queue = _PoolField()       # queued prompt tokens, as the worker last said
    mu = _PoolField()                   # prefill tokens per ms, moving average
    free_tokens = _PoolField()          # free KV tokens, as the worker last said
    reserved_tokens = _PoolField()      # KV of requests routed here the worker has not reported yet
    expected_remaining = _PoolField()   # decode tokens still expected from requests running here
    running = _PoolField()
    healthy = _PoolField()

    def __init__(self, name: str, role: str, *, total_blocks: int, block_size: int,
                 prefill_tokens_per_ms: float = 0.0):
        if role not in ("prefill", "decode", "collocated"):
            raise ValueError(f"role must be prefill, decode or collocated, got {role!r}")
        self.name = name
        self.role = role
        self.block_size = block_size
        self.total_blocks = total_blocks
        self.tree = RadixCache(BlockAllocator(max(total_blocks, 2), block_size))
        # its KV tiers, once it reports them; a token found only there counts the share of its prefill
        # time that loading it instead saves, as the worker measures it
        self.host: TierView | None = None
        self.disk: TierView | None = None
        self.saving = {"host": 0.0, "disk": 0.0}
        self.pool = Pool(role)           # replaced when a Router adopts the view
        self.index = self.pool.add(self)
        self.healthy = True
        self.mu = prefill_tokens_per_ms
        self.free_tokens = total_blocks * block_size

    def _join(self, pool: Pool) -> None:
        values = {f: getattr(self, f) for f in Pool.FIELDS}
        self.pool, self.index = pool, pool.add(self)
        for f, v in values.items():
            setattr(self, f, v)

    @property
    def queued_tokens(self) -> float:
        return max(self.inflight_queue, self.reported_queue)

    @property
    def queue_ms(self) -> float:
        return float(self.pool.queue_ms()[self.index])

    def match(self, tokens) -> float:
        """Tokens of `tokens` this worker is believed to have cached: those in its pool, plus those only
        its KV tiers hold, each counted at the share of its prefill time a load from there saves."""
        hit = covered = _matched(self.tree, tokens)
        for name, tier in (("host", self.host), ("disk", self.disk)):
            if tier is not None:
                more = tier.match(tokens) - covered
                if more > 0:
                    hit += self.saving[name] * more
                    covered += more
        return hit

    def record(self, tokens) -> None:
        """A prompt sent here: its prefix is in the pool, and on its way into the tiers below."""
        for tree in (self.tree, self.host and self.host.tree, self.disk and self.disk.tree):
            if tree is not None:
                tree.record(tokens)

    def apply_report(self, report: WorkerReport) -> None:
        """Refresh the view from the worker's own stats."""
        if report.block_size != self.block_size or report.total_blocks != self.total_blocks:
            # the worker restarted with another cache: what we believed it holds is void
            self.block_size, self.total_blocks = report.block_size, report.total_blocks
            self.tree = RadixCache(BlockAllocator(max(report.total_blocks, 2), report.block_size))
        self.reported_queue = report.queued_prompt_tokens
        self.free_tokens = report.free_blocks * report.block_size
        self.running = report.running
        if report.prefill_tokens_per_ms > 0:
            self.mu = report.prefill_tokens_per_ms
        if report.cached_blocks is not None and self.tree.num_cached_blocks > report.cached_blocks:
            # the worker evicted more than our mirror did (other traffic, a restart): follow it
            self.tree.evict(self.tree.num_cached_blocks - report.cached_blocks)
        if not report.host_blocks:
            self.host = None
        elif self.host is None or (self.host.blocks, self.host.block_size) != (report.host_blocks, report.block_size):
            self.host = TierView(report.host_blocks, report.block_size)
        self.saving = {"host": _share(report.host_saving), "disk": _share(report.disk_saving)}


@dataclass
class RouterStats:
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: float = 0                # prefix tokens the chosen prefill worker was believed to hold (tier hits weighted)
    beta_trace: list = field(default_factory=list)

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _share(x: float) -> float:
    return min(1.0, max(0.0, float(x)))


def _first_block(tokens, block_size: int) -> bytes | None:
    if len(tokens) < block_size:
        return None
    return np.asarray(tokens[:block_size], dtype=np.int32).tobytes()


class AutoBeta:
    """Online beta: lean on cache affinity as much as the traffic's prefix sharing pays for,
    and back off when that piles the queue onto few workers.

    The seed's rule of thumb -- about 0.65 for heavily shared system prompts, 0.30 for
    little commonality -- becomes a line over the observed sharing ratio s (the share of
    each prompt the best-placed worker already holds, a moving average). In this
    router's units (the queue term measured against R's own prefill time, or the mean
    queue) the line runs from 0.5 at s = 0, where the score is plain estimated time to
    first token, to 0.8 at s >= 0.6, where a full hit keeps R on a worker with up to
    four times the mean queue (beta / (1 - beta)). `rtp simulate --seeds 6` puts the best
    fixed beta at 0.65-0.8 on shared system prompts, 0.8 on the same traffic in bursts,
    and finds the code trace flat in beta; 0.9 (nine mean queues) is already too sticky
    on both shared traces. A queue imbalance (coefficient of variation of queue time
    across workers) past 1.5 -- most of the queue on a few workers, the way affinity
    fails -- pulls beta down.
    """

    def __init__(self, low: float = 0.5, high: float = 0.8, full_sharing: float = 0.6,
                 halflife: int = 200):
        self.low, self.high, self.full_sharing = low, high, full_sharing
        self.alpha = 1 - 0.5 ** (1 / halflife)
        self.sharing = 0.0
        self.imbalance = 0.0
        self.beta = low

    def observe(self, best_hit_ratio: float, queue_cv: float) -> float:
        a = self.alpha
        self.sharing += a * (best_hit_ratio - self.sharing)
        self.imbalance += a * (queue_cv - self.imbalance)
        s = min(1.0, self.sharing / self.full_sharing)
        beta = self.low + (self.high - self.low) * s
        beta -= 0.2 * max(0.0, self.imbalance - 1.5)
        self.beta = min(0.95, max(0.05, beta))
        return self.beta


class Router:
    """Picks workers for requests and keeps the views in step with what it routed.

    Call order per request: choose_prefill (or choose_collocated) -> prefill_started ->
    prefill_finished; choose_decode -> decode_started -> decode_finished.
    """

    def __init__(self, policy: str = "flexlb", *, beta: float | str = 0.65, gamma: float = 1.0,
                 cache_threshold: float = 0.5, balance_abs_threshold: int = 32 * 1024,
                 balance_rel_threshold: float = 1.5):
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.policy = policy
        self.auto = AutoBeta() if beta == "auto" else None
        if self.auto is None:
            beta = float(beta)
            if not 0.0 <= beta <= 1.0:
                raise ValueError(f"beta must lie in [0, 1] or be 'auto', got {beta}")
        self.beta = self.auto.beta if self.auto else beta
        self.gamma = gamma
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.workers: dict[str, WorkerView] = {}
        self.pools: dict[str, Pool] = {}
        self.disks: dict[str, TierView] = {}   # disk KV tiers by id: one for the workers sharing a directory
        self._mean_output = 0.0          # running average of actual output lengths
        self._outputs_seen = 0
        self.stats = RouterStats()

    # -- membership ------------------------------------------------------------------------------

    def add_worker(self, view: WorkerView) -> WorkerView:
        if view.name in self.workers:
            raise ValueError(f"worker {view.name} is already registered")
        pool = self.pools.setdefault(view.role, Pool(view.role))
        view._join(pool)
        self.workers[view.name] = view
        return view

    def report(self, view: WorkerView, report: WorkerReport) -> None:
        """A worker's stats: its view refreshed, and joined to the disk tier it reads from (the one
        other workers reporting the same directory read, which holds what was routed to any of them)."""
        view.apply_report(report)
        disk = old = self.disks.get(report.disk_id) if report.disk_id else None
        if report.disk_id and (old is None or not old.fits(report.disk_blocks, report.block_size)):
            # the first worker reporting it, or one with a larger budget: the mirror starts again, for all its readers
            disk = self.disks[report.disk_id] = TierView(report.disk_blocks, report.block_size)
            if old is not None:
                disk.members = old.members
                for member in old.members:
                    member.disk = disk
        if view.disk is not None and view.disk is not disk:
            view.disk.members.discard(view)
        view.disk = disk
        if disk is not None:
            disk.members.add(view)

    def set_healthy(self, name: str, healthy: bool) -> None:
        w = self.workers[name]
        if w.healthy and not healthy:
            # its in-flight work is gone with it; its cache may be too
            w.inflight_queue = 0
            w.reserved_tokens = 0
            w.expected_remaining = 0.0
        w.healthy = healthy

    def candidates(self, role: str, exclude=()) -> list[WorkerView]:
        pool = self.pools.get(role)
        if pool is None:
            return []
        ok = pool.usable(exclude)
        return [v for v, good in zip(pool.views, ok) if good]

    def _pool(self, role: str, exclude) -> tuple[Pool, np.ndarray]:
        pool = self.pools.get(role)
        ok = pool.usable(exclude) if pool is not None else np.zeros(0, bool)
        if not ok.any():
            raise LookupError(f"no healthy {role} worker")
        return pool, ok

    def _round_robin(self, pool: Pool, ok: np.ndarray) -> int:
        n = len(pool.views)
        for k in range(n):
            i = (pool.rr + k) % n
            if ok[i]:
                pool.rr = i + 1
                return i
        raise LookupError(f"no healthy {pool.role} worker")

    # -- prefill side ----------------------------------------------------------------------------

    def choose_prefill(self, tokens, exclude=(), role: str = "prefill") -> tuple[WorkerView, int]:
        """The worker to run R's prompt, and how many of its tokens it is believed to hold."""
        pool, ok = self._pool(role, exclude)
        views = pool.views
        n = max(len(tokens), 1)
        if self.policy == "round-robin":
            w = views[self._round_robin(pool, ok)]
            return w, w.match(tokens)
        queue = pool.queue_ms()
        if self.policy == "least-loaded":
            load = np.where(ok, queue + 1e-9 * pool.running, np.inf)
            w = views[int(np.argmin(load))]
            return w, w.match(tokens)
        key = _first_block(tokens, views[0].block_size)
        holders = [i for i in pool.first_block.get(key, ()) if ok[i]] if key is not None else []
        if self.policy == "cache-aware":
            return self._cache_aware(pool, ok, queue, holders, tokens, n)
        mean_queue = float(queue[ok].mean())
        # the queue term's unit: R's own uncached prefill time, or the mean queue time once
        # queues are longer than that (then it is relative load, and a full prefix hit
        # outweighs a queue up to beta / (1 - beta) times the mean before balance wins)
        own_ms = n / max(float(pool.speed()[ok].mean()), 1e-6)
        penalty = queue / max(own_ms, mean_queue)
        hits: dict[int, int] = {}  # each holder matched at most once

        def hit(i: int) -> int:
            if i not in hits:
                hits[i] = views[i].match(tokens)
            return hits[i]

        if self.auto is not None:
            best_hit = max((hit(i) for i in holders), default=0)
            cv = float(queue[ok].std() / mean_queue) if mean_queue > 0 else 0.0
            self.beta = self.auto.observe(best_hit / n, cv)
        beta = self.beta
        penalty = np.where(ok, (1 - beta) * penalty, np.inf)
        # workers holding nothing of R score -penalty: the best of them is the least loaded.
        # Holders are tried from the least loaded up, until even a full hit could not win.
        best = int(np.argmin(penalty))
        best_hit = hit(best) if best in holders else 0
        best_score = beta * best_hit / n - penalty[best]
        for i in sorted(holders, key=penalty.__getitem__):
            if beta - penalty[i] <= best_score:
                break
            h = hit(i)
            score = beta * h / n - penalty[i]
            if score > best_score:
                best, best_hit, best_score = i, h, score
        return views[best], best_hit

    def choose_collocated(self, tokens, exclude=()) -> tuple[WorkerView, int]:
        return self.choose_prefill(tokens, exclude, role="collocated")

    def _cache_aware(self, pool: Pool, ok, queue, holders, tokens, n) -> tuple[WorkerView, int]:
        """SGLang router's rule: balance when loads diverge, else follow the longest match
        above a threshold, else the worker with the most room in its cache."""
        views = pool.views
        loads = np.maximum(pool.inflight_queue, pool.reported_queue)
        lo, hi = float(loads[ok].min()), float(loads[ok].max())
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            i = int(np.argmin(np.where(ok, loads, np.inf)))
            return views[i], views[i].match(tokens)
        hits = {i: views[i].match(tokens) for i in holders}
        top = max(hits.values(), default=0)
        if top / n > self.cache_threshold:
            i = min((i for i, h in hits.items() if h == top), key=lambda j: loads[j])
            return views[i], top
        size = np.array([v.tree.num_cached_blocks for v in views], dtype=np.float64)
        i = int(np.argmin(np.where(ok, size + loads / (hi + 1.0), np.inf)))
        return views[i], hits.get(i, 0)

    def prefill_started(self, w: WorkerView, tokens, hit: int) -> None:
        """R was sent to w: its prompt joins w's tree and w's queue."""
        w.record(tokens)
        key = _first_block(tokens, w.block_size)
        if key is not None:
            holders = w.pool.first_block.setdefault(key, set())
            holders.add(w.index)
            if w.disk is not None:  # the workers sharing its disk tier will find it there
                holders.update(v.index for v in w.disk.members if v.pool is w.pool)
        w.inflight_queue += len(tokens) - hit
        s = self.stats
        s.requests += 1
        s.prompt_tokens += len(tokens)
        s.hit_tokens += hit
        if self.auto is not None and s.requests % 64 == 0:
            s.beta_trace.append(self.beta)

    def prefill_finished(self, w: WorkerView, computed_tokens: int) -> None:
        """R's prefill on w is over; computed_tokens were queued for it. (w's speed comes from
        its own reports: a time the master measures would include the queue.)"""
        w.inflight_queue = max(0, w.inflight_queue - computed_tokens)

    # -- decode side -----------------------------------------------------------------------------

    def expected_output(self, max_tokens: int) -> float:
        if self._outputs_seen < 16:
            return float(max_tokens)
        return min(float(max_tokens), self._mean_output)

    def choose_decode(self, prompt_len: int, max_tokens: int, exclude=()) -> WorkerView:
        pool, ok = self._pool("decode", exclude)
        if self.policy == "round-robin":
            return pool.views[self._round_robin(pool, ok)]
        if self.policy in ("least-loaded", "cache-aware"):
            score = -pool.running + 1e-12 * pool.free_tokens
        else:
            free = pool.free_tokens - pool.reserved_tokens
            score = free - self.gamma * pool.expected_remaining
            need = prompt_len + self.expected_output(max_tokens)
            score = np.where(free < need, score - 1e12, score)  # would preempt: only when all are that full
        return pool.views[int(np.argmax(np.where(ok, score, -np.inf)))]

    def decode_started(self, w: WorkerView, prompt_len: int, max_tokens: int) -> float:
        """Returns the expected output length booked on w (give it back to decode_finished)."""
        expected = self.expected_output(max_tokens)
        w.reserved_tokens += prompt_len
        w.expected_remaining += expected
        w.running += 1
        return expected

    def decode_finished(self, w: WorkerView, prompt_len: int, expected: float, generated: int) -> None:
        w.reserved_tokens = max(0, w.reserved_tokens - prompt_len)
        w.expected_remaining = max(0.0, w.expected_remaining - expected)
        w.running = max(0, w.running - 1)
        self._outputs_seen += 1
        self._mean_output += (generated - self._mean_output) / min(self._outputs_seen, 512)
