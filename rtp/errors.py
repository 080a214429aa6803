"""The two kinds of failure every layer of rtp tells apart.

InvalidRequest  the input was refused before it ran: a client's mistake, shown as a 400
                that names the field (`param`). Nothing was queued, nothing changed.
EngineFull      the engine holds as many requests as it can now: a 503 with Retry-After.
EngineFatal     shared state can no longer be trusted (the runtime's integrity check
                failed, memory ran out, the model's forward or a collective raised): the
                engine stops, the server says so on every surface and exits non-zero
                for its supervisor to restart it.

Anything else raised while one request is processed (sampling, detokenizing, stop
strings, a KV hand-off) is that request's fault: it finishes with an error and the
engine steps on (LLMEngine.step).
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request refused as given; `param` names the field it is about (None: the whole body)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineFull(RuntimeError):
    """No room for another request now; the same request may succeed later."""


class EngineFatal(RuntimeError):
    """A step failed in a way that leaves the engine's shared state unusable."""


def one_line(message: str, limit: int = 300) -> str:
    """An error text as one sentence: its first line, without llguidance's state dumps or a panic's
    backtrace, cut to `limit` characters."""
    line = next((s.strip() for s in message.splitlines() if s.strip()), "unknown error")
    line = line.replace("<non-verbose/>", "").strip().rstrip(":;,").strip()
    return line if len(line) <= limit else line[:limit - 3] + "..."
