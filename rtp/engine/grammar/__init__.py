"""Structured outputs: grammars that constrain what a request may generate, run by llguidance.

Why llguidance (measured against xgrammar on this project's CPU: docs/benchmarks.md,
"Structured outputs"): no dependencies (xgrammar pulls transformers and triton into a
server that needs neither), no ahead-of-time vocabulary compilation per schema (its Earley
parser computes a mask lazily, so a schema each request brings costs about a millisecond),
JSON Schema, regex, Lark and GBNF grammars, and a parallel batch API for masks and tokens.

    spec.py      a request's StructuredOutputs -> the grammar texts to try, and the limits every
                 spec is checked against before anything is compiled
    sandbox.py   a compile in a child process: killed past its time or when nobody waits
    compiler.py  GrammarCompiler: the cache, the queue fair between clients, the sandbox, the build
    slots.py     GrammarSlots: one matcher per constrained request, each step's token bitmask

The names below are imported on first use: the sandbox's child process imports this package
and must not pay for torch.
"""

_LAZY = {"COMPILE_BUCKETS": "compiler", "GrammarCompiler": "compiler", "GrammarSlots": "slots",
         "GrammarLimits": "spec"}
__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"rtp.engine.grammar.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'rtp.engine.grammar' has no attribute {name!r}")
