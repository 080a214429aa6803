"""What the server and the router say to each other and to clients: msgspec structs, no torch.

    rpc.py         the internal RPC between nodes (stats, reserve, push_kv, decode, abort) and
                   its frames; the FlexLB master polls /rpc/stats with it
    kv_layout.py   KVLayout: a node's KV cache as the RPC describes it (the server builds it
                   from the engine's own description)
    error_body.py  the OpenAI-shaped error body every HTTP error of either process carries

Imports: msgspec, the standard library and rtp's Base tier (rtp/sampling_params.py,
rtp/errors.py), nothing else: the router (rtp/router/) imports this package and must stay free
of torch and of the engine; the engine never imports it (tests/router/test_process_imports.py).
"""
