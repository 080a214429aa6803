"""A second process on a shared KV disk tier, for tests/engine/test_kv_tiers.py: it runs prompts through
its own engine (the default model) and prints, as its last line, a JSON object with each prompt's greedy
tokens and logprobs and its tiers' counters.

    python kv_tier_worker.py --dir D --prompts FILE [--fsize-limit BYTES] [--forever]

--fsize-limit: no file this process writes may grow past BYTES (RLIMIT_FSIZE): a disk that is full.
--forever: after the prompts, run fresh random prompts until killed (a writer to kill mid-write).
"""

from __future__ import annotations

import argparse
import json
import resource
import signal
import sys

import numpy as np

from kv_tier_common import ENGINE, PARAMS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--fsize-limit", type=int, default=0)
    ap.add_argument("--forever", action="store_true")
    args = ap.parse_args()
    from rtp import LLM

    llm = LLM(kv_host_cache_gb=0.05, kv_disk_cache=args.dir, **ENGINE)
    tiers = llm.engine._component_named("kv_tiers")
    if args.fsize_limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize_limit, resource.RLIM_INFINITY))
    with open(args.prompts) as f:
        prompts = json.load(f)
    outs = []
    for p in prompts:
        out = llm.generate([p], PARAMS)[0].outputs[0]
        outs.append({"tokens": out.token_ids, "logprobs": [d[t] for d, t in zip(out.logprobs, out.token_ids)]})
    tiers.flush()
    print("ready", flush=True)
    rng = np.random.default_rng(1)
    while args.forever:
        llm.generate([rng.integers(100, 20000, 600).tolist()], PARAMS)
    print(json.dumps({"outputs": outs, "stats": tiers.stats()}), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
