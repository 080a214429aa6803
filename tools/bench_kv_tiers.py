"""The multi-tier KV cache on a multi-turn agent workload: tiers off, the host tier, the disk tier, and
the disk tier after a restart, side by side in one run (rtp/engine/kv_tiers/, docs/kv_tiers.md).

The workload: --conversations conversations of --turns turns; each turn adds --turn-tokens user tokens
to the conversation's history and generates --answer-tokens; every conversation sends its next turn
as soon as its previous answer is complete, so all of them are in flight at once. The KV pool holds
--pool-conversations full conversations (default two), so with tiers off a returning conversation
finds its context evicted and computes it again.

For each configuration: TTFT (add to first token) of warm turns (every turn after a conversation's
first) at P50 and P99, queueing included, the whole workload's wall time, and each tier load's
measured time against the recompute time the engine estimated for it (a hit must never be slower).
Then, on the same engine, one more turn of each conversation alone (the pool emptied first, so its
context comes from the tiers, or is computed with tiers off): TTFT without queueing. Then a restart:
a new engine on the disk tier's directory (its files dropped from the page cache first) runs that
turn of each conversation alone. The drive's sequential read rate is measured beside the disk tier's.

Examples:
  python tools/bench_kv_tiers.py                       # 16 conversations x 10 turns of 700 + 32 tokens
  python tools/bench_kv_tiers.py --conversations 4 --turns 3 --turn-tokens 200   # a quick look
"""

from __future__ import annotations

import _common  # noqa: F401  (puts the repository's rtp first)

import gc
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import cpu_description, evict_from_page_cache, note, parser_from_doc

BLOCK_BYTES = 368640  # one 16-token block of SmolLM2-135M's bf16 KV (30 layers, 3 KV heads of 64)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def engine(args, **tiers):
    from rtp import LLM

    max_len = args.turns * (args.turn_tokens + args.answer_tokens) + args.turn_tokens + 2 * args.answer_tokens
    pool = args.pool_conversations * max_len
    return LLM(kv_cache_memory=(pool // 16 + 2) * BLOCK_BYTES, max_model_len=max(max_len, 256),
               max_num_seqs=args.conversations, **tiers).engine


def user_turn(conv: int, turn: int, n: int) -> list[int]:
    return np.random.default_rng(1000 * conv + turn).integers(100, 20000, n).tolist()


def run_workload(eng, args) -> dict:
    """Every conversation through its turns; returns TTFTs by (conversation, turn), wall seconds and
    each conversation's history (for the restart's next turn)."""
    from rtp import SamplingParams

    params = SamplingParams(max_tokens=args.answer_tokens, temperature=0, ignore_eos=True)
    history = {c: [] for c in range(args.conversations)}
    sent, first, ttft, out = {}, {}, {}, {}

    def send(c: int, turn: int) -> None:
        prompt = history[c] + user_turn(c, turn, args.turn_tokens)
        history[c] = prompt
        rid = f"{c}:{turn}"
        eng.add_request(rid, prompt, params)
        sent[rid], out[rid] = time.monotonic(), []

    started = time.monotonic()
    for c in range(args.conversations):
        send(c, 0)
    while eng.has_unfinished_requests():
        for delta in eng.step():
            rid = delta.request_id
            now = time.monotonic()
            for choice in delta.choices:
                if choice.token_ids and rid not in first:
                    first[rid] = now
                    ttft[rid] = now - sent[rid]
                out[rid].extend(choice.token_ids or ())
            if delta.finished:
                c, turn = map(int, rid.split(":"))
                history[c] = history[c] + out[rid]
                if turn + 1 < args.turns:
                    send(c, turn + 1)
    wall = time.monotonic() - started
    warm = [t for rid, t in ttft.items() if not rid.endswith(":0")]
    return {"wall_s": wall, "warm_ttft": warm, "history": history,
            "tokens": sum(len(v) for v in out.values())}


def tiers_of(eng):
    """The engine's KV tiers component (None with tiers off)."""
    return eng._component_named("kv_tiers")


def load_checks(tiers) -> dict:
    """Each load's measured time against the recompute the engine estimated for it."""
    loads = [d for d in tiers.decisions if d["load"] and "loaded_seconds" in d]
    worst = max((d["loaded_seconds"] / d["recompute_seconds"] for d in loads), default=0.0)
    return {"loads": len(loads), "recomputes": sum(not d["load"] for d in tiers.decisions),
            "slower_than_recompute": sum(d["loaded_seconds"] > d["recompute_seconds"] for d in loads),
            "worst_load_over_recompute": worst}


def drop_page_cache(root: Path) -> None:
    """Written files out of the page cache, so that their next read comes from the drive."""
    os.sync()
    evict_from_page_cache(f for f in root.rglob("*") if f.is_file())


def drive_read_gbps(directory: Path, mib: int = 512) -> float:
    """The drive's sequential read rate: a file written, dropped from the page cache, read in 8 MiB reads."""
    path = directory / "sequential.bin"
    chunk = os.urandom(8 << 20)
    with open(path, "wb") as f:
        for _ in range(mib // 8):
            f.write(chunk)
    drop_page_cache(directory)
    buf = bytearray(8 << 20)
    started = time.monotonic()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    seconds = time.monotonic() - started
    path.unlink()
    return mib * (1 << 20) / seconds / 1e9


def next_turn_alone(eng, args, histories, turn: int) -> list[float]:
    """Each conversation's turn `turn` after its history, alone, the pool emptied first: TTFT."""
    from rtp import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0)
    out = []
    for c in range(args.conversations):
        room = eng.max_model_len - len(histories[c]) - 1
        prompt = histories[c] + user_turn(c, turn, min(args.turn_tokens, room))
        if eng.cache is not None:
            eng.cache.evict(eng.allocator.num_blocks)  # cold: nothing of it in the pool
        started = time.monotonic()
        eng.add_request(f"r{c}", prompt, params)
        while eng.has_unfinished_requests():
            eng.step()
        out.append(time.monotonic() - started)
    return out


def main() -> None:
    ap = parser_from_doc(__doc__)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--turn-tokens", type=int, default=700)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--pool-conversations", type=float, default=2.0)
    ap.add_argument("--host-gb", type=float, default=4.0)
    ap.add_argument("--disk-gb", type=float, default=8.0)
    ap.add_argument("--drive-mib", type=int, default=512, help="the file the drive's read rate is measured on")
    ap.add_argument("--dir", default=None, help="the disk tier's directory (default: a fresh one under /var/tmp)")
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="rtp-kv-bench-", dir="/var/tmp"))
    disk_dir = root / "tier"
    shutil.rmtree(disk_dir, ignore_errors=True)

    rows, histories = [], None
    configs = [("off", {}), ("host", {"kv_host_cache_gb": args.host_gb}),
               ("disk", {"kv_disk_cache": str(disk_dir), "kv_disk_cache_gb": args.disk_gb})]
    for name, tiers in configs:
        note(f"workload, tiers {name}")
        eng = engine(args, **tiers)
        r = run_workload(eng, args)
        histories = r["history"]
        t = tiers_of(eng)
        row = {"config": name, "wall_s": r["wall_s"], "ttft_p50_s": pct(r["warm_ttft"], 50),
               "ttft_p99_s": pct(r["warm_ttft"], 99), "turns_per_s": args.conversations * args.turns / r["wall_s"]}
        if t is not None:
            t.flush()
            s = t.stats()
            row.update(load_checks(t))
            row.update({k: s[k] for k in ("pool_tokens", "host_tokens", "disk_tokens", "missed_tokens")})
            if s["disk_seconds"]:
                row["disk_tier_read_gbps"] = s["disk_bytes_read"] / s["disk_seconds"] / 1e9
        note(f"tiers {name}: the next turn of each conversation alone")
        alone = next_turn_alone(eng, args, histories, args.turns)
        row.update(alone_p50_s=pct(alone, 50), alone_p99_s=pct(alone, 99))
        rows.append(row)
        note(f"tiers {name}: {json.dumps(row)}")
        del eng, t
        gc.collect()

    note("restart: a new engine on the disk tier's directory, the next turn of each conversation alone")
    drop_page_cache(disk_dir)
    eng = engine(args, kv_disk_cache=str(disk_dir), kv_disk_cache_gb=args.disk_gb)
    # a turn no engine has seen (the one above left its own blocks on disk), as long as that one
    warm = next_turn_alone(eng, args, histories, args.turns + 1)
    t = tiers_of(eng)
    s = t.stats()
    restart = {"ttft_p50_s": statistics.median(warm), "disk_tokens": s["disk_tokens"], **load_checks(t),
               "disk_tier_read_gbps": s["disk_bytes_read"] / s["disk_seconds"] / 1e9 if s["disk_seconds"] else None}
    del eng, t
    gc.collect()
    restart["cold_ttft_p50_s"] = rows[0]["alone_p50_s"]  # tiers off: the same turns computed whole
    restart["speedup"] = restart["cold_ttft_p50_s"] / restart["ttft_p50_s"]
    note("the drive's sequential read rate")
    drive = drive_read_gbps(root, args.drive_mib)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)

    off = rows[0]
    print(f"# {cpu_description()}; {args.conversations} conversations x {args.turns} turns of {args.turn_tokens} + "
          f"{args.answer_tokens} tokens; the pool holds {args.pool_conversations:g} conversations")
    print("| tiers | wall s | warm TTFT P50 s | P99 s | vs off P50 / P99 | next turn alone P50 / P99 s | vs off | "
          "throughput vs off | pool / host / disk / missed tokens | loads (slower than recompute) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        tiers = (f"{r.get('pool_tokens', '-')} / {r.get('host_tokens', '-')} / {r.get('disk_tokens', '-')} / "
                 f"{r.get('missed_tokens', '-')}")
        loads = f"{r['loads']} ({r['slower_than_recompute']})" if "loads" in r else "-"
        print(f"| {r['config']} | {r['wall_s']:.1f} | {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | "
              f"{r['ttft_p50_s'] / off['ttft_p50_s']:.0%} / {r['ttft_p99_s'] / off['ttft_p99_s']:.0%} | "
              f"{r['alone_p50_s']:.3f} / {r['alone_p99_s']:.3f} | "
              f"{r['alone_p50_s'] / off['alone_p50_s']:.0%} / {r['alone_p99_s'] / off['alone_p99_s']:.0%} | "
              f"{off['wall_s'] / r['wall_s']:.2f}x | {tiers} | {loads} |")
    print(f"\nrestart: next turn of an existing conversation, alone: {restart['ttft_p50_s']:.3f} s from the disk tier, "
          f"{restart['cold_ttft_p50_s']:.3f} s cold ({restart['speedup']:.1f}x)")
    rate = restart["disk_tier_read_gbps"]
    print(f"disk tier read {rate:.2f} GB/s after a restart (page cache dropped), the drive's sequential read "
          f"{drive:.2f} GB/s" if rate else f"the drive's sequential read {drive:.2f} GB/s")
    print(json.dumps({"rows": rows, "restart": restart, "drive_read_gbps": drive, "cpu": cpu_description(),
                      "args": vars(args)}))


if __name__ == "__main__":
    main()
