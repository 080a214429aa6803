"""rtp: an LLM inference and serving engine.

Model definitions stay plain PyTorch (rtp/models), the per-step hot loop —
scheduler, paged KV block allocator, radix prefix cache — runs compiled Cython
(rtp/runtime), and `rtp serve` exposes an OpenAI-compatible API.

    from rtp import LLM, SamplingParams
    llm = LLM()   # the default SmolLM2-135M-Instruct
    print(llm.generate("The capital of France is", SamplingParams(temperature=0))[0].outputs[0].text)
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "__version__"]

_LAZY = {"LLM": "rtp.llm", "SamplingParams": "rtp.sampling_params", "EngineConfig": "rtp.config"}


def __getattr__(name):
    # imported on first use, so `rtp --help` and the runtime alone never load torch
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rtp' has no attribute {name!r}")
