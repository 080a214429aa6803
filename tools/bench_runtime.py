#!/usr/bin/env python3
"""Micro-benchmarks for rtp.runtime, the compiled scheduler / KV allocator / radix cache.

Three questions, one function each:

1. Scheduler step time. How long does one schedule()+update() take with 64 and
   256 sequences decoding? The runtime exists so that this stays far below a GPU
   decode step (targets: median < 50 us at 64 sequences, < 200 us at 256).
2. Radix cache throughput. How many prompts per second can RadixCache.record()
   (match + insert + LRU eviction) handle on a shared-system-prompt workload,
   compared with a pure-Python radix tree written the way SGLang writes its own
   (target: at least 20x faster)?
3. Allocator. How many allocate/free pairs per second go through the Python API,
   one block at a time and 64 blocks at a time?

The script prints a table, then (as the very last line of stdout) one JSON
object with the same figures, so a CI job can do `tail -n1 | jq`. Progress goes
to stderr. Everything random is seeded (--seed), so two runs measure the same
workload.

Examples:
    python tools/bench_runtime.py                 # full run, a few seconds on a laptop core
    python tools/bench_runtime.py --quick         # smoke run, about a second
    python tools/bench_runtime.py --only radix    # one benchmark
    python tools/bench_runtime.py 2>/dev/null | tail -n1 | python -m json.tool
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import os
import sys
import time

import numpy as np

from _common import parser_from_doc
from rtp.runtime import BlockAllocator, RadixCache, Scheduler, StepPlan

BLOCK_SIZE = 16
VOCAB = 32000
MAX_MODEL_LEN = 8192
PROMPT_LEN_RANGE = (512, 4096)     # scheduler prompts, inclusive

TARGET_STEP_US = {"64": 50.0, "256": 200.0}   # on the median step time
TARGET_RADIX_SPEEDUP = 20.0                   # rtp record() vs the Python tree


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------
# Progress on stderr
# ---------------------------------------------------------------------------------------

class Progress:
    """One self-overwriting status line on stderr, so stdout stays a clean report.

    Updates are throttled to a few per second; callers only update it between
    timed sections, never inside one.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._last = 0.0
        self._width = 0

    def update(self, label: str, done: int | None = None, total: int | None = None) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        final = done is not None and done == total
        if not final and now - self._last < 0.2 and done is not None:
            return
        self._last = now
        text = label if done is None else f"{label}: {done}/{total} ({100 * done // max(total, 1)}%)"
        self._width = max(self._width, len(text))
        sys.stderr.write("\r" + text.ljust(self._width))
        sys.stderr.flush()

    def clear(self) -> None:
        if self.enabled and self._width:
            sys.stderr.write("\r" + " " * self._width + "\r")
            sys.stderr.flush()
            self._width = 0


# ---------------------------------------------------------------------------------------
# 1. Scheduler step time
# ---------------------------------------------------------------------------------------

def bench_scheduler_step(num_seqs: int, steps: int, *, use_cache: bool, max_batched_tokens: int,
                         seed: int, progress: Progress) -> dict:
    """Time schedule()+update() per decode step with num_seqs sequences all decoding.

    Why: this pair runs once per engine step on the CPU, between two GPU forward
    passes; if it is not much cheaper than a decode step it caps throughput. We
    first prefill every prompt (chunked, under max_batched_tokens), so that the
    timed steps are pure decode with every sequence in the batch, and give each
    request enough max_tokens and the allocator enough blocks that nothing
    finishes or gets preempted while we time. With the radix cache on, update()
    also inserts each newly filled block into the tree, so that cost is included.
    """
    rng = np.random.default_rng([seed, 1, num_seqs])
    lo, hi = PROMPT_LEN_RANGE
    prompt_lens = rng.integers(lo, hi + 1, size=num_seqs)
    prompts = [rng.integers(0, VOCAB, size=int(n), dtype=np.int32) for n in prompt_lens]

    # Steps before all prompts are done: at most one per max_batched_tokens of prompt,
    # plus one per request for chunk boundaries. Sequences done early decode meanwhile.
    warmup_bound = cdiv(int(prompt_lens.sum()), max_batched_tokens) + num_seqs
    max_steps = warmup_bound + steps
    max_tokens = MAX_MODEL_LEN - hi
    if max_steps + 1 >= max_tokens:
        raise SystemExit(f"{steps} timed steps would let sequences finish; "
                         f"use fewer than {max_tokens - warmup_bound - 1}")
    num_blocks = num_seqs * (hi + max_steps + BLOCK_SIZE) // BLOCK_SIZE + 16

    alloc = BlockAllocator(num_blocks, BLOCK_SIZE)
    cache = RadixCache(alloc) if use_cache else None
    plan = StepPlan(max_num_tokens=max_batched_tokens, max_num_seqs=num_seqs,
                    width=cdiv(MAX_MODEL_LEN, BLOCK_SIZE))
    sched = Scheduler(alloc, plan, cache=cache, max_num_seqs=num_seqs,
                      max_num_batched_tokens=max_batched_tokens, max_model_len=MAX_MODEL_LEN,
                      eos_token_ids=[])
    for i, prompt in enumerate(prompts):
        sched.add_request(i, prompt, max_tokens=max_tokens)

    label = f"scheduler {num_seqs} seqs{'' if use_cache else ' (no cache)'}"
    warmup_steps = 0
    while True:
        sched.schedule()
        all_decoding = plan.num_decode_rows == num_seqs and plan.num_rows == num_seqs
        sched.update(np.full(plan.num_samples, 7, dtype=np.int64))
        warmup_steps += 1
        if all_decoding:
            break
        if warmup_steps > warmup_bound:
            raise RuntimeError(f"prefill did not finish in {warmup_bound} steps")
        progress.update(f"{label}: prefill", warmup_steps, warmup_bound)

    # One preallocated array of non-eos tokens (the eos list is empty anyway).
    tokens = rng.integers(0, VOCAB, size=num_seqs).astype(np.int64)
    times = np.empty(steps, dtype=np.int64)
    schedule, update, clock = sched.schedule, sched.update, time.perf_counter_ns
    gc.collect()
    for k in range(steps):
        t0 = clock()
        schedule()
        update(tokens)
        times[k] = clock() - t0
        if k % 256 == 255:
            progress.update(label, k + 1, steps)
    progress.update(label, steps, steps)

    if sched.num_running != num_seqs or sched.num_preemptions or sched.num_waiting:
        raise RuntimeError(f"{label}: the batch changed during the timed steps "
                           f"(running {sched.num_running}, preemptions {sched.num_preemptions})")
    try:
        sched.check_integrity()   # untimed: a fast but broken step is not a result
    except AssertionError as exc:
        raise RuntimeError(f"{label}: the scheduler failed its integrity check: {exc}") from exc
    us = times / 1000.0
    window = max(1, steps // 10)
    return {
        "median": float(np.median(us)),
        "p99": float(np.percentile(us, 99)),
        "mean": float(us.mean()),
        "first10pct_median": float(np.median(us[:window])),
        "last10pct_median": float(np.median(us[-window:])),
        "steps": steps,
        "warmup_steps": warmup_steps,
        "cache_nodes": cache.num_nodes if cache is not None else None,
    }


# ---------------------------------------------------------------------------------------
# 2. Radix cache: rtp vs a pure-Python tree in SGLang's style
# ---------------------------------------------------------------------------------------

class TreeNode:
    """A node of the Python baseline tree, with the fields SGLang's TreeNode uses here.

    key holds token ids (a whole number of pages), value one block id per page.
    """

    def __init__(self, now: int = 0):
        self.children: dict[tuple, TreeNode] = {}
        self.parent: TreeNode | None = None
        self.key: list[int] = []
        self.value: list[int] = []
        self.lock_ref = 0
        self.last_access_time = now

    def __lt__(self, other: "TreeNode") -> bool:   # heapq orders leaves by recency
        return self.last_access_time < other.last_access_time


class PyRadixTree:
    """Baseline: a paged radix tree written the way SGLang writes its RadixCache in Python.

    Why this baseline: it is the design rtp's RadixCache replaces, so the speedup
    we report is over a realistic implementation, not a strawman. The algorithm
    follows SGLang's (children keyed by the first page's tokens, page-by-page key
    comparison, node split on partial matches in both match_prefix and insert,
    leaf-heap LRU eviction that pushes a parent once it becomes a leaf). Where we
    deviate, it is in the baseline's favour: dict.get instead of a membership test
    plus a lookup, deleting a leaf by its key instead of scanning the parent's
    children, lists instead of tensors, and a counter instead of time.monotonic()
    for the access time (which also makes eviction order deterministic).

    The "KV pool" is a plain list of fake block ids, capacity blocks in all.
    """

    def __init__(self, page_size: int, capacity: int):
        self.page_size = page_size
        self.root = TreeNode()
        self.root.lock_ref = 1          # the root is never evicted
        self.free_blocks = list(range(capacity, 0, -1))
        self.clock = 0
        self.evictable_blocks = 0
        self.protected_blocks = 0
        self.num_evicted = 0

    def _child_key(self, key: list[int]) -> tuple:
        return tuple(key[: self.page_size])

    def _key_match(self, key0: list[int], key1: list[int]) -> int:
        """Tokens shared by two keys, compared one page at a time."""
        ps = self.page_size
        n = min(len(key0), len(key1))
        i = 0
        while i < n:
            if key0[i: i + ps] != key1[i: i + ps]:
                break
            i += ps
        return i

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut child after split_len tokens; the new upper node takes its place."""
        upper = TreeNode(self.clock)
        upper.parent = child.parent
        upper.lock_ref = child.lock_ref
        upper.key = child.key[:split_len]
        upper.value = child.value[: split_len // self.page_size]
        child.parent = upper
        child.key = child.key[split_len:]
        child.value = child.value[split_len // self.page_size:]
        upper.children = {self._child_key(child.key): child}
        upper.parent.children[self._child_key(upper.key)] = upper
        return upper

    def match_prefix(self, key: list[int]) -> tuple[list[int], TreeNode]:
        """Block ids of the longest cached page-aligned prefix, and the node it ends at."""
        key = key[: len(key) // self.page_size * self.page_size]
        self.clock += 1
        node = self.root
        node.last_access_time = self.clock
        value: list[int] = []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access_time = self.clock
            n = self._key_match(child.key, key)
            if n < len(child.key):
                node = self._split_node(child, n)
                value.extend(node.value)
                break
            value.extend(child.value)
            node = child
            key = key[n:]
        return value, node

    def insert(self, key: list[int], value: list[int]) -> int:
        """Add key -> value (one block per page); returns the tokens already present."""
        ps = self.page_size
        self.clock += 1
        node = self.root
        node.last_access_time = self.clock
        matched = 0
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access_time = self.clock
            n = self._key_match(child.key, key)
            matched += n
            key = key[n:]
            value = value[n // ps:]
            if n < len(child.key):
                child = self._split_node(child, n)
            node = child
        if key:
            leaf = TreeNode(self.clock)
            leaf.parent = node
            leaf.key = key
            leaf.value = value
            node.children[self._child_key(key)] = leaf
            self.evictable_blocks += len(value)
        return matched

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_blocks -= len(node.value)
                self.protected_blocks += len(node.value)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable_blocks += len(node.value)
                self.protected_blocks -= len(node.value)
            node.lock_ref -= 1
            node = node.parent

    def _collect_leaves(self) -> list[TreeNode]:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        return leaves

    def _delete_leaf(self, node: TreeNode) -> None:
        del node.parent.children[self._child_key(node.key)]
        self.evictable_blocks -= len(node.value)

    def evict(self, num_blocks: int) -> int:
        """Free at least num_blocks blocks from least recently used unlocked leaves."""
        leaves = self._collect_leaves()
        heapq.heapify(leaves)
        evicted = 0
        while evicted < num_blocks and leaves:
            leaf = heapq.heappop(leaves)
            if leaf is self.root:
                break
            if leaf.lock_ref > 0:
                continue
            self.free_blocks.extend(leaf.value)
            evicted += len(leaf.value)
            self._delete_leaf(leaf)
            self.num_evicted += len(leaf.value)
            parent = leaf.parent
            if not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return evicted

    def record(self, key: list[int]) -> int:
        """Same contract as RadixCache.record(): match, lock, evict if short, insert, unlock."""
        ps = self.page_size
        key = key[: len(key) // ps * ps]
        value, node = self.match_prefix(key)
        matched = len(value)
        need = len(key) // ps - matched
        self.inc_lock_ref(node)
        free = self.free_blocks
        if need > len(free):
            self.evict(need - len(free))
        n = min(need, len(free))
        if n:
            new_blocks = free[-n:]
            del free[-n:]
            self.insert(key[: (matched + n) * ps], value + new_blocks)
        self.dec_lock_ref(node)
        return matched * ps


def make_shared_prefix_prompts(num_prompts: int, prompt_len: int, num_system: int, system_len: int,
                               seed: int) -> tuple[list[np.ndarray], int]:
    """Prompts = one of num_system random system prompts + a random suffix, in random order.

    Returns the prompts (contiguous int32 arrays) and how many distinct full
    blocks they hold together (what a cache needs to keep all of them).
    """
    rng = np.random.default_rng([seed, 2])
    systems = rng.integers(0, VOCAB, size=(num_system, system_len), dtype=np.int32)
    which = rng.integers(0, num_system, size=num_prompts)
    suffixes = rng.integers(0, VOCAB, size=(num_prompts, prompt_len - system_len), dtype=np.int32)
    prompts = [np.ascontiguousarray(np.concatenate([systems[w], suffixes[i]])) for i, w in enumerate(which)]
    # system prompts and suffixes are page-aligned here, so distinct blocks add up
    sys_blocks = system_len // BLOCK_SIZE
    distinct = len(set(which.tolist())) * sys_blocks + num_prompts * (prompt_len // BLOCK_SIZE - sys_blocks)
    return prompts, distinct


def run_rtp_records(prompts: list[np.ndarray], capacity: int) -> tuple[float, list[int], int]:
    """One pass of RadixCache.record() over the prompts with a fresh cache.

    Returns (seconds, tokens already cached for each prompt, blocks evicted).
    """
    alloc = BlockAllocator(capacity + 1, BLOCK_SIZE)   # +1: block 0 is reserved
    cache = RadixCache(alloc)
    record = cache.record
    gc.collect()
    t0 = time.perf_counter()
    matched = [record(p) for p in prompts]
    elapsed = time.perf_counter() - t0
    try:
        cache.check_integrity()   # untimed: numbers from a corrupted tree would mean nothing
    except AssertionError as exc:
        raise RuntimeError(f"RadixCache failed its integrity check after {len(prompts)} record() calls "
                           f"with {capacity} blocks: {exc}") from exc
    return elapsed, matched, alloc.num_evictions


def run_python_records(prompts: list[list[int]], capacity: int) -> tuple[float, list[int], int]:
    """One pass of the Python baseline over the same prompts; returns as run_rtp_records()."""
    tree = PyRadixTree(BLOCK_SIZE, capacity)
    record = tree.record
    gc.collect()
    t0 = time.perf_counter()
    matched = [record(p) for p in prompts]
    elapsed = time.perf_counter() - t0
    return elapsed, matched, tree.num_evicted


def bench_radix(num_prompts: int, prompt_len: int, num_system: int, system_len: int,
                repeats: int, seed: int, progress: Progress) -> dict:
    """Throughput of match+insert(+evict) for rtp's RadixCache vs the Python baseline.

    Why: the FlexLB master runs RadixCache standalone to mirror every worker's
    cache and routes each request by its prefix hit, so record() sits on the
    request path. We run each side twice: with room for everything (no eviction;
    both sides must report exactly the same hit for every prompt), and with a
    quarter of that, so LRU eviction runs on most prompts. Both sides get their
    input pre-converted (int32 arrays for rtp, lists for Python) outside the
    timer. Each timing is the best of `repeats` passes over a fresh cache.
    """
    prompts_np, distinct_blocks = make_shared_prefix_prompts(num_prompts, prompt_len, num_system,
                                                             system_len, seed)
    prompts_py = [p.tolist() for p in prompts_np]
    runs = {"full": distinct_blocks, "evicting": max(prompt_len // BLOCK_SIZE, distinct_blocks // 4)}
    out: dict = {"distinct_blocks": distinct_blocks}
    total_passes = 2 * len(runs) * repeats
    done = 0
    for name, capacity in runs.items():
        best = {"rtp": float("inf"), "python": float("inf")}
        matched, evicted = {}, {}
        for _ in range(repeats):
            for side, fn, prompts in (("rtp", run_rtp_records, prompts_np),
                                      ("python", run_python_records, prompts_py)):
                progress.update(f"radix {name}: {side}", done, total_passes)
                elapsed, got, evicted[side] = fn(prompts, capacity)
                best[side] = min(best[side], elapsed)
                if matched.setdefault(side, got) != got:
                    raise RuntimeError(f"radix {name}: {side} is not deterministic across passes")
                done += 1
        progress.update("radix", done, total_passes)
        agree = sum(a == b for a, b in zip(matched["rtp"], matched["python"]))
        if name == "full" and (evicted["rtp"] or evicted["python"]):
            raise AssertionError(f"radix full: nothing should be evicted, got {evicted}")
        if name == "full" and agree != num_prompts:
            first = next(i for i, (a, b) in enumerate(zip(matched["rtp"], matched["python"])) if a != b)
            raise AssertionError(f"rtp and Python disagree on prompt {first}: "
                                 f"{matched['rtp'][first]} vs {matched['python'][first]} tokens cached")
        tokens = num_prompts * prompt_len
        out[name] = {
            "capacity_blocks": capacity,
            "rtp_prompts_per_s": num_prompts / best["rtp"],
            "python_prompts_per_s": num_prompts / best["python"],
            "rtp_tokens_per_s": tokens / best["rtp"],
            "python_tokens_per_s": tokens / best["python"],
            "speedup": best["python"] / best["rtp"],
            "hit_rate_rtp": sum(matched["rtp"]) / tokens,
            "hit_rate_python": sum(matched["python"]) / tokens,
            "agreeing_prompts": agree,
            "rtp_evicted_blocks": evicted["rtp"],
            "python_evicted_blocks": evicted["python"],
        }
    return out


# ---------------------------------------------------------------------------------------
# 3. Allocator
# ---------------------------------------------------------------------------------------

def bench_allocator_single(iters: int, repeats: int) -> float:
    """allocate(1)/free() pairs per second through the Python API (best of repeats).

    Why: shows the floor a Python caller pays per call. The C work is a few list
    operations; almost all of the time is call overhead, the numpy array that
    allocate() returns and the validation in free().
    """
    alloc = BlockAllocator(1024, BLOCK_SIZE)
    allocate, free = alloc.allocate, alloc.free
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        for _ in range(iters):
            b = allocate(1)
            free(b)
        best = min(best, time.perf_counter() - t0)
    alloc.check_integrity()
    return iters / best


def bench_allocator_batched(iters: int, batch: int, repeats: int) -> float:
    """Blocks per second when allocating and freeing batch blocks per call (best of repeats).

    Why: the scheduler and RadixCache move blocks in batches from C, so the
    per-block cost, with the per-call overhead spread over a batch, is the
    relevant figure for them.
    """
    alloc = BlockAllocator(4 * batch + 1, BLOCK_SIZE)
    allocate, free = alloc.allocate, alloc.free
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        for _ in range(iters):
            blocks = allocate(batch)
            free(blocks)
        best = min(best, time.perf_counter() - t0)
    alloc.check_integrity()
    return iters * batch / best


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------

def _runtime_path() -> str:
    """Which build was measured (PYTHONPATH can point at another one)."""
    return sys.modules[BlockAllocator.__module__].__file__


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def print_report(results: dict, args: argparse.Namespace) -> None:
    """The human-readable table (stdout)."""
    print(f"rtp.runtime benchmarks  (seed {args.seed}{', quick' if args.quick else ''}; "
          f"module {_runtime_path()})")
    sched = results.get("scheduler_step_us")
    if sched:
        print()
        print(f"1. Scheduler: schedule()+update() per decode step, block_size {BLOCK_SIZE}, "
              f"prompts {PROMPT_LEN_RANGE[0]}..{PROMPT_LEN_RANGE[1]} tokens, "
              f"max_num_batched_tokens {args.max_batched_tokens}")
        print(f"   {'sequences':<16}{'steps':>7}{'median us':>11}{'p99 us':>9}{'mean us':>9}"
              f"{'first 10%':>11}{'last 10%':>10}{'target':>9}{'met':>5}")
        for key, r in sched.items():
            target = TARGET_STEP_US.get(key)
            tgt = f"<{target:.0f}" if target else "-"
            met = _yes(r["median"] < target) if target else "-"
            label = key.replace("_no_cache", " (no cache)")
            print(f"   {label:<16}{r['steps']:>7}{r['median']:>11.1f}{r['p99']:>9.1f}{r['mean']:>9.1f}"
                  f"{r['first10pct_median']:>11.1f}{r['last10pct_median']:>10.1f}{tgt:>9}{met:>5}")
        print(f"   best of {args.sched_repeats} run(s) by median; targets apply to the median; "
              "'first/last 10%' are medians over the first and last tenth of the timed steps")
        for key, r in sched.items():
            if r["last10pct_median"] > 1.5 * r["first10pct_median"]:
                print(f"   note: at {key} the step time grows as sequences get longer "
                      f"({r['first10pct_median']:.1f} -> {r['last10pct_median']:.1f} us over {r['steps']} steps; "
                      f"{r['cache_nodes']} radix nodes at the end)")
    radix = results.get("radix_detail")
    if radix:
        print()
        print(f"2. Radix cache: record() = match + insert (+ LRU eviction), {args.radix_prompts} prompts "
              f"x {args.prompt_len} tokens over {args.num_system} system prompts of {args.system_len}; "
              f"best of {args.radix_repeats}")
        print(f"   {'run':<10}{'capacity':>10}{'impl':>8}{'prompts/s':>12}{'Mtokens/s':>11}"
              f"{'hit rate':>10}{'evicted':>10}{'speedup':>9}{'agree':>12}")
        for name in ("full", "evicting"):
            r = radix[name]
            for side in ("rtp", "python"):
                # run-wide columns only on the rtp row
                run, capacity, speed, agree = ((name, r["capacity_blocks"], f"{r['speedup']:.1f}x",
                                                f"{r['agreeing_prompts']}/{args.radix_prompts}")
                                               if side == "rtp" else ("", "", "", ""))
                print(f"   {run:<10}{capacity:>10}{side:>8}{r[side + '_prompts_per_s']:>12,.0f}"
                      f"{r[side + '_tokens_per_s'] / 1e6:>11.1f}{r['hit_rate_' + side]:>10.1%}"
                      f"{r[side + '_evicted_blocks']:>10}{speed:>9}{agree:>12}")
        print(f"   target: rtp >= {TARGET_RADIX_SPEEDUP:.0f}x the Python tree without eviction: "
              f"{_yes(radix['full']['speedup'] >= TARGET_RADIX_SPEEDUP)}; with eviction the trees may "
              "differ (rtp evicts single blocks, the Python tree whole leaves)")
    alloc = results.get("allocator")
    if alloc:
        print()
        print("3. Allocator through the Python API")
        print(f"   {'single: allocate(1) + free()':<40}{alloc['single_pairs_per_s']:>14,.0f} pairs/s"
              "   (bound by Python call overhead, not by the allocator)")
        print(f"   {f'batched: allocate({args.alloc_batch}) + free()':<40}"
              f"{alloc['batched_blocks_per_s']:>14,.0f} blocks/s"
              f"  ({alloc['batched_blocks_per_s'] / args.alloc_batch:,.0f} pairs/s)")


def build_parser() -> argparse.ArgumentParser:
    parser = parser_from_doc(__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run (about a second): fewer steps, prompts and iterations; "
                             "figures are noisier and not comparable with a full run")
    parser.add_argument("--only", choices=("scheduler", "radix", "allocator"), action="append",
                        help="run only this benchmark (repeatable); default: all three")
    parser.add_argument("--seed", type=int, default=0, help="seed for every random workload (default 0)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="show a progress line on stderr (default: only when stderr is a terminal)")
    g = parser.add_argument_group("scheduler sizes")
    g.add_argument("--steps-64", type=int, help="timed decode steps at 64 sequences (default 2000, quick 400)")
    g.add_argument("--steps-256", type=int, help="timed decode steps at 256 sequences (default 1000, quick 200)")
    g.add_argument("--sched-repeats", type=int,
                   help="runs per configuration; the one with the lowest median counts (default 3, quick 1)")
    g.add_argument("--max-batched-tokens", type=int, default=8192,
                   help="token budget per step, which sets how fast the prompts prefill (default 8192)")
    g = parser.add_argument_group("radix cache sizes")
    g.add_argument("--radix-prompts", type=int, help="prompts recorded per pass (default 1000, quick 200)")
    g.add_argument("--prompt-len", type=int, default=2048, help="tokens per prompt (default 2048)")
    g.add_argument("--num-system", type=int, default=32, help="distinct system prompts (default 32)")
    g.add_argument("--system-len", type=int, default=1024, help="tokens per system prompt (default 1024)")
    g.add_argument("--radix-repeats", type=int, help="passes per side; the best counts (default 5, quick 1)")
    g = parser.add_argument_group("allocator sizes")
    g.add_argument("--alloc-iters", type=int, help="allocate/free pairs per pass (default 200000, quick 20000)")
    g.add_argument("--alloc-batch", type=int, default=64, help="blocks per batched allocate() (default 64)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    defaults = {  # (full, quick)
        "steps_64": (2000, 400), "steps_256": (1000, 200), "sched_repeats": (3, 1),
        "radix_prompts": (1000, 200), "radix_repeats": (5, 1), "alloc_iters": (200_000, 20_000),
    }
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.system_len % BLOCK_SIZE or args.prompt_len % BLOCK_SIZE or not 0 < args.system_len < args.prompt_len:
        parser.error(f"--system-len and --prompt-len must be multiples of {BLOCK_SIZE}, "
                     "with the system prompt shorter than the prompt")
    for name in ("steps_64", "steps_256", "sched_repeats", "radix_prompts", "radix_repeats", "alloc_iters",
                 "alloc_batch", "max_batched_tokens", "num_system"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    args.only = set(args.only or ("scheduler", "radix", "allocator"))
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the selected benchmarks, print the table, then the JSON line last."""
    args = parse_args(argv)
    progress = Progress(enabled=sys.stderr.isatty() if args.progress is None else args.progress)
    results: dict = {}
    targets_met: dict = {}
    started = time.perf_counter()

    if "scheduler" in args.only:
        sched = {}
        for key, n, steps, use_cache in (("64", 64, args.steps_64, True),
                                         ("256", 256, args.steps_256, True),
                                         ("64_no_cache", 64, args.steps_64, False)):
            # same seed each time, so every repeat times the same workload; keep the least
            # disturbed run (other processes share the CPU)
            runs = [bench_scheduler_step(n, steps, use_cache=use_cache,
                                         max_batched_tokens=args.max_batched_tokens,
                                         seed=args.seed, progress=progress)
                    for _ in range(args.sched_repeats)]
            sched[key] = min(runs, key=lambda r: r["median"])
        results["scheduler_step_us"] = sched
        for key, target in TARGET_STEP_US.items():
            targets_met[f"scheduler_{key}_median_lt_{target:.0f}us"] = sched[key]["median"] < target

    if "radix" in args.only:
        detail = bench_radix(args.radix_prompts, args.prompt_len, args.num_system, args.system_len,
                             args.radix_repeats, args.seed, progress)
        results["radix_detail"] = detail
        results["radix"] = {
            "rtp_prompts_per_s": detail["full"]["rtp_prompts_per_s"],
            "python_prompts_per_s": detail["full"]["python_prompts_per_s"],
            "rtp_tokens_per_s": detail["full"]["rtp_tokens_per_s"],
            "python_tokens_per_s": detail["full"]["python_tokens_per_s"],
            "speedup": detail["full"]["speedup"],
            "evicting_rtp_prompts_per_s": detail["evicting"]["rtp_prompts_per_s"],
            "evicting_python_prompts_per_s": detail["evicting"]["python_prompts_per_s"],
            "evicting_speedup": detail["evicting"]["speedup"],
            "evicting_agreeing_prompts": detail["evicting"]["agreeing_prompts"],
        }
        targets_met[f"radix_speedup_ge_{TARGET_RADIX_SPEEDUP:.0f}x"] = \
            detail["full"]["speedup"] >= TARGET_RADIX_SPEEDUP

    if "allocator" in args.only:
        repeats = 1 if args.quick else 3
        progress.update("allocator: single-block pairs")
        single = bench_allocator_single(args.alloc_iters, repeats)
        progress.update("allocator: batched")
        batched = bench_allocator_batched(max(1, args.alloc_iters // 4), args.alloc_batch, repeats)
        results["allocator"] = {"single_pairs_per_s": single, "batched_blocks_per_s": batched,
                                "batch": args.alloc_batch}

    progress.clear()
    print_report(results, args)
    elapsed = time.perf_counter() - started
    print(f"\n(total {elapsed:.1f} s)")
    results["targets_met"] = targets_met
    results["config"] = {"quick": args.quick, "seed": args.seed, "block_size": BLOCK_SIZE,
                         "elapsed_s": round(elapsed, 2), "module": _runtime_path()}
    print(json.dumps(results, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:   # stdout piped into e.g. `head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
