"""`rtp serve`: load the engine, serve the OpenAI API on hypercorn, drain on SIGTERM.

Shutdown: SIGTERM (or SIGINT) marks the server draining -- new requests get 503,
/health turns 503 -- and hypercorn stops accepting connections, then waits up to
the grace period for in-flight requests to finish. Whatever still runs after it
is cancelled (which aborts it in the engine), the engine thread stops, and the
process exits 0. A second signal exits at once, with status 1.

A fatal engine failure (rtp/errors.py EngineFatal) fails every request in flight,
turns /health, /rpc/stats and /metrics' rtp:engine_healthy to failure at once, and
the process exits with status 1 within a second, for its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from rtp.config import EngineConfig, ServeConfig

log = logging.getLogger("rtp.serve")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_FATAL_GRACE = 0.5  # seconds the server lingers after its engine failed, to finish writing the errors


def serve(config: EngineConfig, options: ServeConfig) -> int:
    from rtp.engine.engine import LLMEngine
    from rtp.http import check_bindable
    from rtp.server.async_engine import AsyncEngine
    from rtp.server.metrics import ServerMetrics
    from rtp.server.openai_api import OpenAIServing
    from rtp.server.pd import PDNode

    options.validate()
    if options.role != "collocated" and config.parallel.tensor_parallel_size > 1:
        raise ValueError("--role prefill/decode with --tp > 1 is not supported yet")
    if options.role != "collocated" and config.cache.kv_cache_dtype == "int8":
        raise ValueError("--kv-cache-dtype int8 with --role prefill/decode is not supported yet (the KV transfer "
                         "moves blocks without their scales)")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per RPC call otherwise
    check_bindable(options.host, options.port)  # fail now, not after loading the model
    names, root, aliases = model_names(config.load.model, options.served_model_names)
    metrics = ServerMetrics(names[0])
    # loaded on the thread that steps it: one OpenMP pool (AsyncEngine.load says why)
    async_engine = AsyncEngine.load(lambda: LLMEngine(config), metrics)
    metrics.read_stats = lambda: async_engine.stats
    pd = PDNode(async_engine, metrics, role=options.role, model_name=names[0], token=options.rpc_token,
                api_key=options.api_key, decode_peer=options.decode_peer, lease_seconds=options.kv_lease)
    if options.rpc_token is None and options.api_key is None and options.role != "collocated":
        log.warning("the /rpc routes are open to anyone who can reach %s:%d: pass --rpc-token", options.host,
                    options.port)
    serving = OpenAIServing(async_engine, metrics, model_names=names, model_root=root, model_aliases=aliases,
                            api_key=options.api_key,
                            max_body_bytes=options.max_body_bytes, max_queue=options.max_queue, pd=pd,
                            tool_call_parser=options.tool_call_parser, reasoning_parser=options.reasoning_parser)
    if serving.reasoning is not None:
        log.info("reasoning parser %s%s", serving.reasoning.name,
                 " (the chat template calls for it; --reasoning-parser none turns it off)"
                 if serving.reasoning_inferred else "")
    metrics.read_healthy = lambda: async_engine.dead is None
    asyncio.run(_run(serving, options))
    if async_engine.dead is not None:  # for the supervisor (systemd, Kubernetes) to restart it
        log.error("exiting with status 1: the engine failed (%s)", async_engine.dead)
        return 1
    log.info("server stopped")
    return 0


def model_names(model: str | None, served: list[str] | None) -> tuple[list[str], str, tuple[str, ...]]:
    """The names clients may send in "model" (the first is the one reported), what /v1/models gives as
    the model's `root`, and names accepted without being listed. A model given as a local path is
    named and rooted by its file or directory name, the path itself only accepted: the server's
    file layout is nobody's business. A Hub ID is its own name."""
    if model is None:
        return served or [DEFAULT_MODEL_NAME], DEFAULT_MODEL_NAME, ()
    local = Path(model).exists()
    name = Path(model).name.removesuffix(".gguf") if local else model
    names = served or [name]
    return names, name, (model,) if model not in names else ()


async def _run(serving, options: ServeConfig) -> None:
    from rtp.http import HTTPService
    from rtp.server.openai_api import build_app

    def drain(signame: str) -> None:
        log.info("%s: draining, up to %.0f s for %d in-flight requests", signame, options.grace_period,
                 serving.engine.num_unstarted + serving.engine.stats.get("num_running", 0))
        serving.draining = True

    http = HTTPService(options.host, options.port, options.grace_period, on_drain=drain)

    def engine_failed() -> None:
        # every request in flight has been failed already (AsyncEngine._die): nothing to drain
        # but the error responses themselves, which are written by now or within moments
        serving.draining = True
        http.stop(grace=_FATAL_GRACE)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop = asyncio.get_running_loop()
        # on the engine thread, the moment it dies (a failed step, a tensor-parallel follower gone):
        # /health, /metrics and /rpc/stats already say so
        serving.engine.on_dead = lambda error: loop.call_soon_threadsafe(engine_failed)
        serving.engine.start()  # the engine thread delivers into this loop
        if serving.pd is not None:
            await serving.pd.open_kv_port(options.host, options.kv_port)
        try:
            yield
        finally:
            if serving.pd is not None:
                await serving.pd.close()
            serving.engine.stop()

    app = build_app(serving, lifespan)
    role = serving.pd.role if serving.pd is not None else "collocated"
    log.info("serving %s on http://%s:%d (role %s%s)", ", ".join(serving.model_names), options.host, options.port,
             role, f", decoding on {serving.pd.decode_peer}" if role == "prefill" and serving.pd.decode_peer else "")
    await http.serve(app)
