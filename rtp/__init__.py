"""rtp: an LLM inference and serving engine.

Model definitions stay plain PyTorch (rtp/models), the per-step hot loop —
scheduler, paged KV block allocator, radix prefix cache — runs compiled Cython
(rtp._runtime), and `rtp serve` exposes an OpenAI-compatible API.
"""

__version__ = "0.1.0"
