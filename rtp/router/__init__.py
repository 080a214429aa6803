"""The router: `rtp route`, its own process, no torch and no engine (DESIGN.md's Router tier).

    flexlb.py   Master: the FlexLB master, an OpenAI-compatible front that tokenizes each prompt,
                picks the workers, proxies, retries what no engine saw, polls their stats
    routing.py  Router: the routing policy (FlexLB, round-robin, least-loaded, cache-aware) and its
                view of each worker; the cluster simulator (rtp/sim/) routes with it too

It imports the wire (rtp/wire/), the HTTP plumbing (rtp/http.py), the runtime's RadixCache (no
torch) and the tokenizer, never rtp/server/ nor rtp/engine/: tests/router/test_process_imports.py.
"""
