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
