#!/usr/bin/env python3
"""Start-up: how long `rtp serve` takes from its command to its first answer, and where it goes.

Each round starts `rtp serve` (the default model unless --model, plus any --serve-args) on a free
port, polls /health every 20 ms until it answers 200, and stops it with SIGTERM. The phases come
from the server's own log lines, timed as they arrive: the checkpoint loaded ("loaded ... ready
in"), the engine ready (CPU graphs captured, KV cache allocated), HTTP serving. "CPU s" is the
server process's user + system time until ready (both cores: it exceeds the wall time when the
OpenMP team works). The medians over --rounds rounds make the table, then one JSON line.

    python tools/bench_startup.py
    python tools/bench_startup.py --rounds 5 --serve-args "--max-num-seqs 16 --dtype float32"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from _common import free_port

PHASES = (("loaded", "rtp.loader: loaded"), ("engine ready", "rtp.engine: engine ready"),
          ("serving", "rtp.serve: serving"))


def one_round(args: argparse.Namespace) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "rtp", "serve", "--port", str(port), *shlex.split(args.serve_args)]
    if args.model:
        cmd += ["--model", args.model]
    seen: dict[str, float] = {}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def watch() -> None:  # phase times as the log lines arrive
        for line in proc.stdout:
            for name, marker in PHASES:
                if marker in line and name not in seen:
                    seen[name] = time.perf_counter() - t0

    reader = threading.Thread(target=watch, daemon=True)
    reader.start()
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"rtp serve exited with {proc.returncode}: {' '.join(cmd)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.perf_counter() - t0 > args.timeout:
                raise SystemExit(f"rtp serve did not answer /health within {args.timeout} s")
            time.sleep(0.02)
        ready = time.perf_counter() - t0
        with open(f"/proc/{proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(5)
    return {"ready_s": round(ready, 3), "cpu_s": round(cpu, 2), **{k: round(v, 3) for k, v in seen.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default=None, help="checkpoint (default: rtp serve's default model)")
    ap.add_argument("--serve-args", default="", help="more rtp serve options, one string")
    ap.add_argument("--rounds", type=int, default=3, help="server starts to time (default 3)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds one start may take (default 300)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    rounds = []
    for i in range(args.rounds):
        rounds.append(one_round(args))
        print(f"[round {i + 1}/{args.rounds}] {rounds[-1]}", file=sys.stderr)
    keys = ["loaded", "engine ready", "serving", "ready_s", "cpu_s"]
    median = {k: round(statistics.median(r[k] for r in rounds), 3) for k in keys if all(k in r for r in rounds)}
    print(f"rtp serve {args.serve_args}".rstrip() + f": start-up over {args.rounds} rounds (medians, seconds "
          "from the command)")
    print(f"  {'checkpoint loaded':<22}{median.get('loaded', float('nan')):>8.2f}")
    print(f"  {'engine ready':<22}{median.get('engine ready', float('nan')):>8.2f}   (CPU graphs, KV cache)")
    print(f"  {'serving HTTP':<22}{median.get('serving', float('nan')):>8.2f}")
    print(f"  {'/health answers':<22}{median['ready_s']:>8.2f}   CPU {median['cpu_s']:.2f} s")
    print(json.dumps({"serve_args": args.serve_args, "model": args.model, "median": median, "rounds": rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
