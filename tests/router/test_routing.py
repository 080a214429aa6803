"""FlexLB's routing decisions (rtp/router/routing.py) and the cluster simulator (rtp/sim/).

The router runs on the runtime's real RadixCache; the simulator on the real Scheduler.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from rtp.router.routing import AutoBeta, Router, WorkerReport, WorkerView
from rtp.sim import traces
from rtp.sim.cluster import Cluster, WorkerConfig
from rtp.sim.cost_model import H200, LLAMA3_8B, SMOLLM2_135M, StepCost

BS = 16


def make_router(policy="flexlb", beta=0.65, prefill=2, decode=0, blocks=256, mu=10.0, **kw) -> Router:
    r = Router(policy, beta=beta, **kw)
    for k in range(prefill):
        r.add_worker(WorkerView(f"p{k}", "prefill", total_blocks=blocks, block_size=BS, prefill_tokens_per_ms=mu))
    for k in range(decode):
        r.add_worker(WorkerView(f"d{k}", "decode", total_blocks=blocks, block_size=BS))
    return r


def prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, size=n, dtype=np.int32)


def test_a_shared_prefix_goes_where_it_is_cached_and_beta_0_goes_by_queue():
    system = prompt(1, 512)
    r = make_router(beta=0.65)
    first, hit = r.choose_prefill(system)
    assert hit == 0
    r.prefill_started(first, system, hit)
    r.prefill_finished(first, len(system))
    follow_up = np.concatenate([system, prompt(2, 40)])
    w, hit = r.choose_prefill(follow_up)
    assert w is first and hit == 512
    # a queue on the holder: affinity still wins while the queue is short against the prompt...
    first.reported_queue = 200
    assert r.choose_prefill(follow_up)[0] is first
    # ...and beta = 0 ignores the prefix and goes to the shorter queue
    r.beta = 0.0
    w, hit = r.choose_prefill(follow_up)
    assert w is not first and hit == 0


def test_flexlb_choice_equals_scoring_every_worker():
    """The search only matches workers that may hold a prefix; it must pick what scoring all would."""
    rng = np.random.default_rng(7)
    systems = [prompt(100 + k, int(rng.integers(64, 400))) for k in range(6)]
    for trial in range(40):
        r = make_router(beta=float(rng.choice([0.2, 0.5, 0.65, 0.9])), prefill=8)
        views = list(r.workers.values())
        for v in views:
            for s in rng.choice(len(systems), size=3):
                v.tree.record(systems[s][: int(rng.integers(16, len(systems[s]) + 1))])
                r.prefill_started(v, systems[s], 0)  # fills the first-block index the search uses
            v.inflight_queue = float(rng.integers(0, 4000))
            v.reported_queue = 0
            v.mu = float(rng.uniform(5, 20))
        q = np.concatenate([systems[int(rng.integers(len(systems)))], prompt(trial, 30)])
        chosen, hit = r.choose_prefill(q)
        queue = np.array([v.queue_ms for v in views])
        own = len(q) / np.mean([v.mu for v in views])
        unit = max(own, queue.mean())
        scores = [r.beta * v.match(q) / len(q) - (1 - r.beta) * qm / unit for v, qm in zip(views, queue)]
        assert scores[views.index(chosen)] == pytest.approx(max(scores), abs=1e-9)
        assert hit == chosen.match(q)


def test_decode_choice_and_health():
    r = make_router(prefill=1, decode=3)
    d = [r.workers[f"d{k}"] for k in range(3)]
    for k, v in enumerate(d):
        v.apply_report(WorkerReport(total_blocks=256, free_blocks=100 + 50 * k, block_size=BS))
    assert r.choose_decode(100, 50) is d[2]
    e = r.decode_started(d[2], 100, 50)
    d[2].expected_remaining += 10_000  # long generations still running there
    assert r.choose_decode(100, 50) is d[1]
    r.decode_finished(d[2], 100, e, 50)
    r.set_healthy("d1", False)
    assert r.choose_decode(100, 50, exclude=["d2"]) is d[0]
    r.set_healthy("d0", False)
    with pytest.raises(LookupError):
        r.choose_decode(100, 50, exclude=["d2"])
    r.set_healthy("d0", True)
    assert r.choose_decode(100, 50, exclude=["d2"]) is d[0]
    with pytest.raises(ValueError, match="routing policy"):
        Router("fastest")
    with pytest.raises(ValueError, match="beta"):
        Router(beta=1.5)


def test_the_mirror_follows_the_workers_reports():
    r = make_router(prefill=1, blocks=64)
    v = r.workers["p0"]
    v.tree.record(prompt(3, 40 * BS))
    assert v.tree.num_cached_blocks == 40
    v.apply_report(WorkerReport(total_blocks=64, free_blocks=64, block_size=BS, cached_blocks=10))
    assert v.tree.num_cached_blocks == 10  # the worker evicted: so does the master's view
    v.apply_report(WorkerReport(total_blocks=128, free_blocks=128, block_size=BS, queued_prompt_tokens=77,
                                prefill_tokens_per_ms=3.5))
    assert v.tree.num_cached_blocks == 0 and v.total_blocks == 128  # restarted with another cache
    assert v.queued_tokens == 77 and v.mu == 3.5


def test_auto_beta_follows_sharing_and_imbalance():
    a = AutoBeta(halflife=10)
    for _ in range(200):
        a.observe(0.9, 0.2)
    assert a.beta == pytest.approx(0.8, abs=0.01)   # heavy sharing: the top of the line
    for _ in range(200):
        a.observe(0.3, 0.2)
    assert a.beta == pytest.approx(0.65, abs=0.01)  # half of full sharing: halfway up
    for _ in range(200):
        a.observe(0.0, 0.2)
    assert a.beta == pytest.approx(0.5, abs=0.01)
    for _ in range(200):
        a.observe(0.9, 3.5)  # the queue all on a few workers: affinity is hurting
    assert a.beta < 0.6


def test_cache_aware_policy():
    r = make_router("cache-aware", prefill=3, balance_abs_threshold=1000, balance_rel_threshold=1.5)
    system = prompt(9, 320)
    holder = r.workers["p1"]
    holder.tree.record(system)
    r.prefill_started(holder, system, 0)
    q = np.concatenate([system, prompt(10, 20)])
    assert r.choose_prefill(q)[0] is holder             # match above the threshold
    holder.inflight_queue = 5000                          # imbalance past both thresholds: balance
    assert r.choose_prefill(q)[0] is not holder


# -- the simulator -----------------------------------------------------------------------------------


def test_cost_model_rooflines():
    c = StepCost(H200, LLAMA3_8B)
    one, many = c.decode_step_time(1, 1000), c.decode_step_time(64, 1000)
    assert one < many < 64 * one                          # decode: weights read once per step
    # prefill is compute-bound: 8k tokens cost about 8x 1k tokens
    assert 6 < c.prefill_time(8192) / c.prefill_time(1024) < 12
    assert c.prefill_time(4096, cached=3072) < c.prefill_time(4096) / 3
    assert c.transfer_tail(2048) < LLAMA3_8B.kv_bytes_per_token * 2048 / H200.link_bw


@pytest.mark.parametrize("mode", ["collocated", "pd"])
def test_the_simulated_cluster_serves_every_request(mode):
    trace = traces.make("conversational", 600, rate=20.0, seed=3)
    cost = StepCost(H200, LLAMA3_8B)
    cfg = WorkerConfig(kv_tokens=200_000)
    kw = {"collocated": 4} if mode == "collocated" else {"prefill": 2, "decode": 2}
    res = Cluster(cost, router=Router("flexlb"), config=cfg, **kw).run(trace, mode, warmup=0.0)
    assert res.finished == len(trace)
    assert res.output_tokens == int(trace.output_len.sum())
    assert len(res.ttft) == len(trace) and (res.ttft > 0).all()
    # every token after the first has a gap; P/D's first gap includes the KV hand-off
    assert len(res.tbt) == int(trace.output_len.sum()) - len(trace)
    assert res.hit_ratio > 0.3                            # shared system prompts and histories
    again = Cluster(cost, router=Router("flexlb"), config=cfg, **kw).run(trace, mode, warmup=0.0)
    assert np.array_equal(again.ttft, res.ttft)          # deterministic


def test_the_simulator_refuses_when_every_worker_is_full():
    trace = traces.make("code", 40, rate=100.0, seed=1)
    cfg = WorkerConfig(kv_tokens=40_000, max_model_len=32_768)
    res = Cluster(StepCost(H200, LLAMA3_8B), collocated=2, router=Router("round-robin"), config=cfg).run(
        trace, "tiny", warmup=0.0)
    assert res.finished + res.extra["rejected"] == len(trace)
    assert res.finished > 0


def test_rtp_simulate_prints_a_table_and_a_json_line():
    out = subprocess.run(
        [sys.executable, "-m", "rtp", "simulate", "--traces", "conversational", "--workers", "4",
         "--requests", "400", "--seeds", "2", "--skip", "load", "beta", "--jobs", "1",
         "--model", "smollm2-135m"],
        capture_output=True, text=True, timeout=300, check=True).stdout
    assert "pd flexlb beta=0.65" in out and "collocated least-loaded" in out
    report = json.loads(out.strip().splitlines()[-1])
    rows = report["traces"]["conversational"]["table"]
    assert len(rows) == 9 and all(r["finished"] == 800 and r["seeds"] == 2 for r in rows)  # pooled
    assert SMOLLM2_135M.name == report["model"]


def _tiers(total=64, host=0, host_saving=0.0, disk_id="", disk_blocks=0, disk_saving=0.0, cached=None):
    return WorkerReport(total_blocks=total, free_blocks=total, block_size=BS, cached_blocks=cached,
                        host_blocks=host, host_saving=host_saving, disk_id=disk_id, disk_blocks=disk_blocks,
                        disk_saving=disk_saving)


def test_a_prefix_in_a_kv_tier_counts_at_what_loading_it_saves_and_a_shared_disk_serves_every_worker():
    r = make_router(prefill=3, blocks=64)
    p0, p1, p2 = (r.workers[f"p{k}"] for k in range(3))
    r.report(p0, _tiers(host=64, host_saving=0.9, disk_id="a/model", disk_blocks=1000, disk_saving=0.5))
    r.report(p1, _tiers())                                                          # no tiers
    r.report(p2, _tiers(disk_id="a/model", disk_blocks=500, disk_saving=0.4))       # shares p0's directory
    assert p0.disk is p2.disk and p0.disk.blocks == 1000 and p1.disk is None and p2.host is None
    system = prompt(11, 32 * BS)
    r.prefill_started(p0, system, 0)
    follow_up = np.concatenate([system, prompt(12, 40)])
    # the pool's hit counts whole; the shared disk's counts its saving (p2's own, 0.4) on p2, nothing on p1
    assert p0.match(follow_up) == 32 * BS and p1.match(follow_up) == 0
    assert p2.match(follow_up) == pytest.approx(0.4 * 32 * BS)
    assert r.choose_prefill(follow_up) == (p0, 32 * BS)      # equal queues: the pool hit wins
    # a long queue on p0: the prefix goes to p2, which reads it from the disk, not to p1 (an equal queue)
    p0.reported_queue = 20_000
    w, hit = r.choose_prefill(follow_up)
    assert w is p2 and hit == pytest.approx(0.4 * 32 * BS)
    # p0's pool evicted it: its host tier still holds it, at the host's saving
    r.report(p0, _tiers(host=64, host_saving=0.9, disk_id="a/model", disk_blocks=1000, disk_saving=0.5, cached=0))
    assert p0.tree.num_cached_blocks == 0 and p0.match(follow_up) == pytest.approx(0.9 * 32 * BS)
    # past the host tier's size only the disk's share is left; the disk as a whole follows its largest budget
    r.prefill_started(p0, prompt(13, 63 * BS), 0)
    assert p0.match(follow_up) == pytest.approx(0.5 * 32 * BS)
    r.report(p2, _tiers(disk_id="a/model", disk_blocks=4000, disk_saving=0.4))
    assert p0.disk is p2.disk and p2.disk.blocks == 4000 and p2.disk.members == {p0, p2}
    # a loading slower than recompute (saving 0) counts nothing; a worker that stops reporting a tier loses it
    r.prefill_started(p2, system, 0)
    r.report(p0, _tiers(disk_id="a/model", disk_blocks=1000, disk_saving=0.0, cached=0))
    assert p0.host is None and p0.match(follow_up) == 0
    r.report(p2, _tiers(cached=0))
    assert p2.disk is None and p2.match(follow_up) == 0 and r.disks["a/model"].members == {p0}


def test_flexlb_choice_with_tiers_equals_scoring_every_worker():
    """Workers sharing a disk can hold a prefix none of them was sent: the search must still find them."""
    rng = np.random.default_rng(8)
    systems = [prompt(200 + k, int(rng.integers(64, 400))) for k in range(6)]
    for trial in range(30):
        r = make_router(beta=float(rng.choice([0.2, 0.5, 0.65, 0.9])), prefill=6, blocks=16)
        views = list(r.workers.values())
        for k, v in enumerate(views):
            r.report(v, _tiers(total=16, host=int(rng.choice([0, 24])), host_saving=float(rng.uniform(0, 1)),
                               disk_id=str(rng.choice(["", "x", "y"])), disk_blocks=int(rng.integers(0, 200)),
                               disk_saving=float(rng.uniform(0, 1))))
        for v in views:
            for s in rng.choice(len(systems), size=3):
                r.prefill_started(v, systems[s], 0)
            v.inflight_queue = float(rng.integers(0, 4000))
            v.mu = float(rng.uniform(5, 20))
        q = np.concatenate([systems[int(rng.integers(len(systems)))], prompt(trial, 30)])
        chosen, hit = r.choose_prefill(q)
        queue = np.array([v.queue_ms for v in views])
        unit = max(len(q) / np.mean([v.mu for v in views]), queue.mean())
        scores = [r.beta * v.match(q) / len(q) - (1 - r.beta) * qm / unit for v, qm in zip(views, queue)]
        assert scores[views.index(chosen)] == pytest.approx(max(scores), abs=1e-9)
        assert hit == pytest.approx(chosen.match(q))
