"""Discrete-event simulation of a serving cluster, driven by rtp's real parts.

Every worker is the real runtime -- a BlockAllocator, a RadixCache (prefill and
collocated workers) and the continuous-batching Scheduler -- fed with real token
ids; only the model is replaced, by the step-time cost model. The master is the
real Router (rtp/router/routing.py). So prefix hits, chunked prefill,
preemption, KV reservation on decode workers and the routing decisions are
the code that serves, and only time is simulated.

Events, in simulated seconds: a request arrives (the master routes it); a
worker's step ends (the scheduler applies the sampled tokens, the next step is
planned and costed); a request's KV lands on its decode worker (the prefill
worker streamed it layer by layer; what is left is the last layer's share);
and a stats poll (every worker reports to the master, as the stats RPC does).

P/D flow per request, as rtp serve runs it: the prefill worker runs the prompt
(`prefill_only`), samples the first token (the time to first token), and
releases its blocks, keeping the prefix cached; the decode worker reserved
blocks for the prompt (`Scheduler.reserve`) and resumes it with that first
token when the KV has landed (`Scheduler.resume`). A decode worker with no
room refuses; the request waits at the master until one has room.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from rtp.runtime import FINISH_REMOTE, BlockAllocator, RadixCache, Scheduler, StepPlan
from rtp.router.routing import Router, WorkerReport, WorkerView
from rtp.sim.cost_model import StepCost
from rtp.sim.traces import Trace

_ARRIVE, _STEP, _KV, _POLL = 0, 1, 2, 3


@dataclass
class WorkerConfig:
    kv_tokens: int = 262_144
    block_size: int = 64
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_prefill_tokens_with_decodes: int = 2048   # collocated: bound a decode's stall per step
    max_model_len: int = 32_768


class SimWorker:
    """One worker: the runtime's scheduler and caches (the cluster costs its steps)."""

    def __init__(self, name: str, role: str, cfg: WorkerConfig):
        self.name, self.role = name, role
        blocks = cfg.kv_tokens // cfg.block_size + 1
        self.alloc = BlockAllocator(blocks, cfg.block_size)
        self.cache = RadixCache(self.alloc) if role != "decode" else None
        width = -(-cfg.max_model_len // cfg.block_size)
        self.plan = StepPlan(cfg.max_num_batched_tokens, cfg.max_num_seqs, width)
        self.sched = Scheduler(
            self.alloc, self.plan, cache=self.cache, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=cfg.max_model_len,
            max_prefill_tokens_with_decodes=cfg.max_prefill_tokens_with_decodes if role == "collocated" else 0)
        self.busy = False
        self.prefill_tokens = 0     # computed in prefill rows since the last poll
        self.prefill_time = 0.0
        self.mu = 0.0               # measured prefill tokens per ms, moving average

    def report(self) -> WorkerReport:
        if self.prefill_time > 0:
            rate = self.prefill_tokens / (self.prefill_time * 1e3)
            self.mu = rate if self.mu == 0 else self.mu + 0.3 * (rate - self.mu)
            self.prefill_tokens, self.prefill_time = 0, 0.0
        s = self.sched
        return WorkerReport(total_blocks=self.alloc.num_blocks - 1, free_blocks=self.alloc.num_free,
                            block_size=self.alloc.block_size, queued_prompt_tokens=s.queued_prompt_tokens,
                            running=s.num_running, waiting=s.num_waiting, prefill_tokens_per_ms=self.mu,
                            cached_blocks=self.cache.num_cached_blocks if self.cache is not None else None)


@dataclass
class Result:
    label: str
    requests: int
    finished: int
    duration_s: float
    output_tokens: int
    ttft: np.ndarray
    tbt: np.ndarray
    hit_ratio: float
    wall_s: float
    preemptions: int
    extra: dict = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    def p(self, what: str, q: float) -> float:
        a = self.ttft if what == "ttft" else self.tbt
        return float(np.percentile(a, q)) if len(a) else math.nan

    def row(self) -> dict:
        return {"label": self.label, "throughput_tok_s": round(self.throughput, 1),
                "p50_ttft_ms": round(self.p("ttft", 50) * 1e3, 1),
                "p99_ttft_ms": round(self.p("ttft", 99) * 1e3, 1),
                "p99_tbt_ms": round(self.p("tbt", 99) * 1e3, 2),
                "prefix_hit": round(self.hit_ratio, 3), "finished": self.finished,
                "requests": self.requests, "wall_s": round(self.wall_s, 1), **self.extra}


class Cluster:
    """Workers plus a master; `run(trace)` simulates the trace to its end."""

    def __init__(self, cost: StepCost, *, collocated: int = 0, prefill: int = 0, decode: int = 0,
                 router: Router, config: WorkerConfig | None = None, poll_s: float = 0.1):
        if collocated and (prefill or decode):
            raise ValueError("a cluster is either collocated or prefill/decode, not both")
        if not collocated and not (prefill and decode):
            raise ValueError("a P/D cluster needs at least one prefill and one decode worker")
        self.cost, self.router, self.poll_s = cost, router, poll_s
        self.cfg = cfg = config or WorkerConfig()
        self.pd = not collocated
        self.workers: dict[str, SimWorker] = {}
        # until a worker has measured itself, the master assumes a mid-size prompt's rate
        mu0 = 2048 / (cost.prefill_time(2048) * 1e3)
        for role, n in (("collocated", collocated), ("prefill", prefill), ("decode", decode)):
            for k in range(n):
                w = SimWorker(f"{role[0]}{k}", role, cfg)
                self.workers[w.name] = w
                router.add_worker(WorkerView(w.name, role, total_blocks=w.alloc.num_blocks - 1,
                                             block_size=cfg.block_size, prefill_tokens_per_ms=mu0))

    def run(self, trace: Trace, label: str = "", progress: bool = False, warmup: float = 0.2) -> Result:
        """Simulate the whole trace. Latencies count requests that arrive after the first
        `warmup` share of the trace: before that, caches are cold and queues empty."""
        wall0 = time.perf_counter()
        n = len(trace)
        measured = trace.arrival >= trace.arrival[0] + warmup * (trace.arrival[-1] - trace.arrival[0])
        router, cost, workers = self.router, self.cost, self.workers
        views = router.workers
        ttft = np.full(n, np.nan)
        done = np.full(n, np.nan)
        last = np.full(n, np.nan)              # time of each request's latest token
        booked = np.zeros(n, np.int64)         # prompt tokens booked on its prefill worker's queue
        expected = np.zeros(n)                 # output tokens booked on its decode worker
        decode_of: list[str | None] = [None] * n
        pending_tokens: dict[int, np.ndarray] = {}
        waiting_decode: deque[int] = deque()   # prefilled, no decode worker had room yet
        gaps: list[np.ndarray] = []
        zeros = np.zeros(max(w.plan.max_num_seqs for w in workers.values()), np.int32)
        events: list[tuple] = []
        seq = 0

        def push(t, kind, arg):
            nonlocal seq
            seq += 1
            heapq.heappush(events, (t, seq, kind, arg))

        def start_step(w: SimWorker, now: float) -> None:
            rows = w.sched.schedule()
            if rows == 0:  # nothing runnable (all waiting on memory or KV): close the empty step
                w.sched.update(zeros[:0])
                w.busy = False
                return
            plan = w.plan
            dt = cost.plan_step(plan)
            prefill = plan.num_tokens - plan.num_decode_rows
            if prefill > 0:
                w.prefill_tokens += prefill
                w.prefill_time += dt
            w.busy = True
            push(now + dt, _STEP, w)

        def kick(w: SimWorker, now: float) -> None:
            if not w.busy:
                start_step(w, now)

        def try_decode(i: int, now: float) -> bool:
            """Reserve room for request i on a decode worker and schedule its KV landing."""
            tokens = pending_tokens[i]
            out = int(trace.output_len[i])
            tried = []
            while True:
                try:
                    v = router.choose_decode(len(tokens), out, exclude=tried)
                except LookupError:
                    return False
                d = workers[v.name]
                try:
                    d.sched.reserve(i, tokens, max_tokens=out, ignore_eos=True)
                except MemoryError:
                    tried.append(v.name)
                    continue
                decode_of[i] = v.name
                expected[i] = router.decode_started(v, len(tokens), out)
                push(now + cost.transfer_tail(len(tokens)), _KV, i)
                return True

        for i in range(n):
            push(float(trace.arrival[i]), _ARRIVE, i)
        push(self.poll_s, _POLL, None)
        finished = rejected = 0
        next_report = 0.1
        while events and finished + rejected < n:
            now, _, kind, arg = heapq.heappop(events)
            if kind == _STEP:
                w: SimWorker = arg
                plan, s = w.plan, w.sched
                ns = plan.num_samples
                ids = plan.sample_req_ids[:ns].copy()
                n_ev = s.update(zeros[:ns])
                first = np.isnan(last[ids])
                if first.any():
                    for i in ids[first].tolist():
                        ttft[i] = now
                        router.prefill_finished(views[w.name], int(booked[i]))
                if not first.all():
                    seen = ids[~first]
                    seen = seen[measured[seen]]
                    gaps.append(now - last[seen])
                last[ids] = now
                fin = s.event_finish[:n_ev]
                ended = np.flatnonzero(fin)
                freed = False
                for k in ended.tolist():
                    i = int(s.event_req_ids[k])
                    if fin[k] == FINISH_REMOTE:
                        s.release(i)
                        if trace.output_len[i] <= 1:
                            done[i] = now
                            finished += 1
                            pending_tokens.pop(i, None)
                        elif not try_decode(i, now):
                            waiting_decode.append(i)
                    else:
                        done[i] = now
                        finished += 1
                        freed = True
                        if w.role == "decode":
                            router.decode_finished(views[w.name], len(pending_tokens.pop(i)),
                                                   expected[i], int(trace.output_len[i]))
                start_step(w, now)
                if freed and waiting_decode:
                    for _ in range(len(waiting_decode)):
                        i = waiting_decode.popleft()
                        if not try_decode(i, now):
                            waiting_decode.append(i)
                            break
            elif kind == _ARRIVE:
                i = arg
                tokens = trace.tokens(i)
                out = int(trace.output_len[i])
                refused = []
                while True:  # a worker whose scheduler is full refuses; the master tries another
                    try:
                        v, hit = router.choose_prefill(tokens, refused, role="prefill" if self.pd else "collocated")
                    except LookupError:
                        v = None
                        break
                    w = workers[v.name]
                    try:
                        w.sched.add_request(i, tokens, max_tokens=out, ignore_eos=True, prefill_only=self.pd)
                        break
                    except OverflowError:
                        refused.append(v.name)
                if v is None:
                    rejected += 1
                    continue
                router.prefill_started(v, tokens, hit)
                booked[i] = len(tokens) - hit
                if self.pd:
                    pending_tokens[i] = tokens
                kick(w, now)
            elif kind == _KV:
                i = arg
                d = workers[decode_of[i]]
                d.sched.resume(i, 0)
                kick(d, now)
            else:  # _POLL
                for name, w in workers.items():
                    views[name].apply_report(w.report())
                if events:
                    push(now + self.poll_s, _POLL, None)
            if progress and now > next_report * trace.arrival[-1]:
                print(f"  {label}: {finished}/{n} finished, t={now:.1f}s, wall {time.perf_counter() - wall0:.0f}s",
                      flush=True)
                next_report += 0.1
        ok = ~np.isnan(done)
        first_arrival = float(trace.arrival[0])
        duration = float(np.nanmax(done)) - first_arrival if ok.any() else 0.0
        tbt = np.concatenate(gaps) if gaps else np.empty(0)
        return Result(label, n, int(ok.sum()), duration, int(trace.output_len[ok].sum()),
                      (ttft - trace.arrival)[~np.isnan(ttft) & measured], tbt, router.stats.hit_ratio,
                      time.perf_counter() - wall0,
                      sum(w.sched.num_preemptions for w in workers.values()), {"rejected": rejected})
