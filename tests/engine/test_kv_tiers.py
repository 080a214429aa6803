"""The multi-tier KV cache (rtp/engine/kv_tiers/) on the default model: a prefix's KV from the pool,
the host tier, the disk tier (also after a restart, also written by another process) or recomputed
gives a request the same greedy tokens and logprobs, bit for bit; loads in flight survive aborts and
preemption without leaking; a flipped, truncated or foreign block file, an unwritable directory, a
full disk and a writer killed mid-write cost recomputation at most, never a request."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from kv_tier_common import ENGINE, PARAMS

from rtp import LLM
from rtp.engine.kv_tiers.disk import _HEADER, DiskTier

HERE = Path(__file__).resolve().parent
BS = 16


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 20000, n).tolist()


A = _prompt(1, 500)        # a long context, 31 full blocks and 4 tokens
TURNS = [A + _prompt(10 + i, 37) for i in range(4)]   # later turns of it: the prefix ends mid-block
FILLERS = [_prompt(100 + i, 600) for i in range(3)]   # enough to push A out of the pool


def _run(llm, prompt):
    out = llm.generate([prompt], PARAMS)[0].outputs[0]
    return out.token_ids, [d[t] for d, t in zip(out.logprobs, out.token_ids)]


@pytest.fixture(scope="module")
def reference():
    """Each prompt computed from scratch: an engine without tiers, its pool emptied before each."""
    llm = LLM(**ENGINE)
    refs = {}
    for i, p in enumerate([*TURNS, A]):
        llm.engine.cache.evict(llm.engine.allocator.num_blocks)
        refs[i] = _run(llm, p)
    return refs


def _tiers(llm):
    return llm.engine._component_named("kv_tiers")


def _push_out_of_pool(llm):
    for f in FILLERS:
        llm.generate([f], PARAMS)
    assert len(llm.engine.cache.match_prefix(A, count=False)[0]) == 0


def _drop_host(tiers, prompt=A):
    for key in tiers._chain(-1, np.asarray(prompt, dtype=np.int32), len(prompt) // BS):
        tiers.host.discard(key)
    tiers._keys.pop(-1, None)


def test_a_prefix_gets_the_same_tokens_from_every_tier_and_after_a_restart(reference, tmp_path):
    disk = tmp_path / "kv"
    llm = LLM(kv_host_cache_gb=0.1, kv_disk_cache=str(disk), **ENGINE)
    tiers = _tiers(llm)
    assert _run(llm, A) == reference[4]                       # computed, then saved to both tiers
    assert _run(llm, TURNS[0]) == reference[0]                # from the pool
    _push_out_of_pool(llm)
    before = tiers.stats()
    assert _run(llm, TURNS[1]) == reference[1]                # from the host tier
    after = tiers.stats()
    assert after["host_tokens"] - before["host_tokens"] == 31 * BS
    _push_out_of_pool(llm)
    _drop_host(tiers)
    assert _run(llm, TURNS[2]) == reference[2]                # from the disk tier
    assert tiers.stats()["disk_tokens"] - after["disk_tokens"] == 31 * BS
    tiers.flush()
    del llm, tiers

    restarted = LLM(kv_host_cache_gb=0.1, kv_disk_cache=str(disk), **ENGINE)
    tiers = _tiers(restarted)
    assert _run(restarted, TURNS[3]) == reference[3]          # from the disk, in a new process's engine
    s = tiers.stats()
    assert s["disk_tokens"] == 31 * BS and s["disk"]["corrupt_skipped"] == 0
    assert s["decided_load"] == 1 and tiers.decisions[-1]["load_seconds"] < tiers.decisions[-1]["recompute_seconds"]


def test_an_int8_cache_keeps_its_int8_blocks_and_scales_in_every_tier(tmp_path):
    """--kv-cache-dtype int8: the tiers hold the pool's own int8 blocks (K rotated as the cache rotates
    it) with their scales, about half a bf16 block's bytes, and a hit gives the tokens recomputing gives."""
    engine = dict(ENGINE, kv_cache_memory=80 * 368640 * 68 // 128, kv_cache_dtype="int8")
    plain = LLM(**engine)
    refs = []
    for p in (A, TURNS[0], TURNS[1]):
        plain.engine.cache.evict(plain.engine.allocator.num_blocks)
        refs.append(_run(plain, p))
    del plain
    llm = LLM(kv_host_cache_gb=0.1, kv_disk_cache=str(tmp_path / "kv"), **engine)
    tiers = _tiers(llm)
    assert tiers.host.block_bytes == 30 * 16 * 3 * 2 * (64 + 4)   # layers, tokens, kv heads, K and V, D + scale
    assert _run(llm, A) == refs[0]
    tiers.flush()
    llm.engine.cache.evict(llm.engine.allocator.num_blocks)
    assert _run(llm, TURNS[0]) == refs[1]                     # from the host tier
    llm.engine.cache.evict(llm.engine.allocator.num_blocks)
    _drop_host(tiers)
    assert _run(llm, TURNS[1]) == refs[2]                     # from the disk tier
    s = tiers.stats()
    assert s["host_tokens"] == 31 * BS and s["disk_tokens"] == 31 * BS and s["disk"]["corrupt_skipped"] == 0


def test_one_hit_spans_the_pool_the_host_and_the_disk(reference, tmp_path):
    llm = LLM(kv_host_cache_gb=0.1, kv_disk_cache=str(tmp_path / "kv"), **ENGINE)
    tiers, engine = _tiers(llm), llm.engine
    _run(llm, A)
    tiers.flush()
    assert engine.cache.evict(20) == 20  # the pool keeps A's first 11 blocks (leaves go first)
    keys = tiers._chain(-2, np.asarray(A, dtype=np.int32), 31)
    for key in keys[23:]:                # the host keeps blocks 11..22, the disk all 31
        assert tiers.host.discard(key)
    assert _run(llm, TURNS[0]) == reference[0]
    d = tiers.decisions[-1]
    assert (d["pool_tokens"], d["host_tokens"], d["disk_tokens"]) == (11 * BS, 12 * BS, 8 * BS)
    engine.scheduler.check_integrity()
    tiers.check_integrity()


def test_cost_decides_a_disk_slower_than_recompute_is_not_read(reference, tmp_path):
    llm = LLM(kv_host_cache_gb=0.1, kv_disk_cache=str(tmp_path / "kv"), **ENGINE)
    tiers = _tiers(llm)
    _run(llm, A)
    tiers.flush()
    _push_out_of_pool(llm)
    _drop_host(tiers)
    tiers.costs.per_byte["disk"] = 1e-3     # as if the disk gave 1 kB/s
    assert _run(llm, TURNS[1]) == reference[1]
    d = tiers.decisions[-1]
    assert not d["load"] and d["load_seconds"] > d["recompute_seconds"] and tiers.stats()["disk_tokens"] == 0


def _steps(engine, check=True):
    outputs = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            for c in delta.choices:
                outputs.setdefault(delta.request_id, []).extend(c.token_ids or ())
        if check:
            engine.scheduler.check_integrity()
            engine._component_named("kv_tiers").check_integrity()
    return outputs


def test_aborts_and_preemption_while_blocks_load_leak_nothing(reference, tmp_path):
    llm = LLM(kv_host_cache_gb=0.1, kv_disk_cache=str(tmp_path / "kv"), **ENGINE)
    engine, tiers = llm.engine, _tiers(llm)
    _run(llm, A)
    tiers.flush()
    _push_out_of_pool(llm)
    _drop_host(tiers)
    # one request loads from disk and is aborted before its read lands; another loads and runs beside
    # long requests that preempt each other in the small pool
    engine.add_request("gone", TURNS[0], PARAMS)
    engine.step()
    assert engine.scheduler.num_deferred == 1
    assert engine.abort_request("gone")
    _drop_host(tiers)
    from rtp import SamplingParams

    long = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)  # 3 x 550 tokens: past the pool's 1280
    for i, f in enumerate(FILLERS):
        engine.add_request(f"long{i}", f[:400], long)
    engine.add_request("loads", TURNS[1], PARAMS)
    out = _steps(engine)
    assert out["loads"] == reference[1][0]
    assert engine.scheduler.stats()["num_preemptions"] > 0
    s = tiers.stats()
    alone = LLM(**ENGINE)
    for i, f in enumerate(FILLERS):  # and generated what they generate alone
        assert out[f"long{i}"] == alone.generate([f[:400]], long)[0].outputs[0].token_ids
    tiers.flush()
    assert engine.allocator.num_used == 0 and engine.scheduler.num_deferred == 0
    assert not tiers._reads and not tiers._orphans and not tiers._prompts
    assert not tiers.host.pins.any(), "a host row stayed pinned"


def _block_files(disk: Path) -> list[Path]:
    return sorted(disk.rglob("*.kv"))


@pytest.mark.parametrize("fault", ["flipped", "truncated", "foreign"])
def test_a_bad_block_file_is_skipped_and_recomputed(reference, tmp_path, fault, caplog):
    disk = tmp_path / "kv"
    llm = LLM(kv_host_cache_gb=0.1, kv_disk_cache=str(disk), **ENGINE)
    tiers = _tiers(llm)
    _run(llm, A)
    tiers.flush()
    _push_out_of_pool(llm)
    _drop_host(tiers)
    keys = tiers._chain(-3, np.asarray(A, dtype=np.int32), 31)
    bad = tiers.disk.path(keys[20])
    data = bytearray(bad.read_bytes())
    if fault == "flipped":
        data[len(data) // 2] ^= 0x40
    elif fault == "truncated":
        data = data[: len(data) - 1000]
    else:  # the same block of another model: its header's fingerprint differs
        data[12 + 4:12 + 4 + 16] = bytes(16)
    bad.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="rtp.kv_tiers"):
        assert _run(llm, TURNS[2]) == reference[2]
    s = tiers.stats()
    assert s["disk"]["corrupt_skipped"] == 1 and s["disk_tokens"] == 20 * BS
    assert "skipped" in caplog.text
    tiers.flush()  # the recomputed blocks were saved again: the file is whole once more
    row = np.empty(tiers.host.block_bytes, dtype=np.uint8)
    assert tiers.disk.read(keys[20], np.asarray(A[20 * BS:21 * BS], dtype=np.int32), row)
    assert tiers.stats()["disk"]["corrupt_skipped"] == 1


def test_an_unwritable_directory_turns_writing_off_once(reference, tmp_path, caplog):
    disk = tmp_path / "kv"
    llm = LLM(kv_host_cache_gb=0.1, kv_disk_cache=str(disk), **ENGINE)
    tiers = _tiers(llm)
    shutil.rmtree(tiers.disk.dir)
    tiers.disk.dir.write_bytes(b"not a directory")  # where the tier's directory was (root ignores chmod)
    with caplog.at_level(logging.WARNING, logger="rtp.kv_tiers"):
        assert _run(llm, A) == reference[4]
        tiers.flush()
        assert _run(llm, TURNS[0]) == reference[0]
        tiers.flush()
    s = tiers.stats()["disk"]
    assert not s["writable"] and s["write_errors"] == 1 and s["files_written"] == 0
    assert caplog.text.count("stores nothing more") == 1


def _worker(disk: Path, prompts, tmp_path: Path, *extra, **popen):
    f = tmp_path / f"prompts{time.monotonic_ns()}.json"
    f.write_text(json.dumps(prompts))
    cmd = [sys.executable, str(HERE / "kv_tier_worker.py"), "--dir", str(disk), "--prompts", str(f), *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    if popen:
        return subprocess.Popen(cmd, env=env, **popen)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _pairs(result):
    return [(o["tokens"], o["logprobs"]) for o in result["outputs"]]


def test_a_full_disk_costs_no_request(reference, tmp_path):
    # every file this process writes is limited to 100 kB: each block file (368 kB) fails mid-write
    result = _worker(tmp_path / "kv", [A, TURNS[0]], tmp_path, "--fsize-limit", "100000")
    assert _pairs(result) == [reference[4], reference[0]]
    disk = result["stats"]["disk"]
    assert not disk["writable"] and disk["write_errors"] == 1 and disk["files_written"] == 0
    assert not list((tmp_path / "kv").rglob("*.tmp")), "a failed write left its temporary"


def test_two_processes_share_one_directory(reference, tmp_path):
    disk = tmp_path / "kv"
    llm = LLM(kv_host_cache_gb=0.1, kv_disk_cache=str(disk), **ENGINE)
    tiers = _tiers(llm)
    _run(llm, A)
    tiers.flush()
    other = _worker(disk, [TURNS[0], FILLERS[0]], tmp_path)  # hits what this process wrote, writes FILLERS[0]
    assert _pairs(other)[0] == reference[0]
    assert other["stats"]["disk_tokens"] == 31 * BS
    before = tiers.stats()["disk_tokens"]
    _run(llm, FILLERS[0] + [7, 8, 9])                         # hits what the other process wrote
    assert tiers.stats()["disk_tokens"] - before == 37 * BS


def test_a_writer_killed_mid_write_leaves_whole_files_only(reference, tmp_path):
    disk = tmp_path / "kv"
    proc = _worker(disk, [A], tmp_path, "--forever", stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while not list(disk.rglob("*.tmp")) and time.monotonic() < deadline:  # kill it while it writes
            time.sleep(0.001)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    left = list(disk.rglob("*.tmp"))
    llm = LLM(kv_host_cache_gb=0.1, kv_disk_cache=str(disk), **ENGINE)
    tiers = _tiers(llm)
    assert not list(disk.rglob("*.tmp")) and tiers.disk.temps_removed == len(left)
    files = _block_files(disk)
    assert len(files) >= 31
    row = np.empty(tiers.host.block_bytes, dtype=np.uint8)
    for f in files:  # every file left is a whole block
        head = f.read_bytes()[:_HEADER.size + 4 * BS]
        tokens = np.frombuffer(head[_HEADER.size:], dtype=np.int32)
        assert tiers.disk.read(bytes.fromhex(f.stem), tokens, row), f
    assert _run(llm, TURNS[1]) == reference[1]
    assert tiers.stats()["disk_tokens"] == 31 * BS


def _rewrite(root: str, seed: bytes, keys: list[bytes], stop) -> None:
    """Another process: write the same blocks again and again (each a fresh temporary and a rename) until
    told to stop."""
    tier = DiskTier(root, seed, 1 << 30, 4096, BS)
    rng = np.random.default_rng(os.getpid())
    while not stop.is_set():
        i = int(rng.integers(len(keys)))
        tier._forget(keys[i])
        tier.write(keys[i], np.full(BS, i, dtype=np.int32), np.full(4096, i % 251, dtype=np.uint8))


def test_no_torn_read_under_concurrent_writers(tmp_path):
    import multiprocessing as mp

    seed, keys = b"s" * 16, [bytes([i]) * 16 for i in range(8)]
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    writers = [ctx.Process(target=_rewrite, args=(str(tmp_path), seed, keys, stop)) for _ in range(2)]
    for w in writers:
        w.start()
    reader = DiskTier(tmp_path, seed, 1 << 30, 4096, BS)
    out = np.empty(4096, dtype=np.uint8)
    reads = 0
    try:
        # reads succeed once the writers (spawned: slow to start on a loaded machine) have written; until
        # 500 have, or a minute is up, while both keep rewriting every block
        deadline = time.monotonic() + 60
        while reads < 500 and time.monotonic() < deadline:
            for i, key in enumerate(keys):
                if reader.read(key, np.full(BS, i, dtype=np.int32), out):
                    reads += 1
                    assert (out == i % 251).all(), "a read returned another write's bytes"
        assert all(w.is_alive() for w in writers)  # the reads above ran beside both writers
    finally:
        stop.set()
        for w in writers:
            w.join(30)
    assert reader.corrupt == 0 and reads >= 500
    assert all(w.exitcode == 0 for w in writers)


def test_a_hit_waits_for_room_in_the_pool_and_later_requests_wait_behind_it(reference, tmp_path):
    from rtp import SamplingParams

    llm = LLM(kv_host_cache_gb=0.1, **ENGINE)
    engine, tiers = llm.engine, _tiers(llm)
    _run(llm, A)
    _push_out_of_pool(llm)
    engine.add_request("big", FILLERS[0] + FILLERS[1][:300], SamplingParams(max_tokens=100, temperature=0,
                                                                          ignore_eos=True))
    for _ in range(4):  # its prompt computed: it holds 57 of the 79 blocks, growing
        engine.step()
    engine.add_request("hit", TURNS[3], PARAMS)
    engine.step()
    engine.add_request("later", _prompt(7, 40), PARAMS)  # would fit now, but came after the hit
    engine.step()
    assert engine.scheduler.num_deferred == 2
    out = _steps(engine)
    assert out["hit"] == reference[3][0]
    hit = [d for d in tiers.decisions if d["host_tokens"] == 31 * BS][-1]  # (big's prompt began with a filler)
    assert tiers.stats()["waited_for_room"] == 1 and hit["loaded_tokens"] == 31 * BS
    assert engine.scheduler.stats()["num_preemptions"] == 0
