"""HTTP plumbing both processes serve with, `rtp serve` (rtp/server/) and `rtp route` (rtp/router/):
one lifecycle -- an ASGI app on hypercorn, a drain on SIGTERM, the end -- and streamed responses
that always run their clean-up.

It imports starlette (hypercorn when it serves) and nothing of rtp, so the router takes it
without the server, and `rtp/wire/` stays msgspec alone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Callable

from starlette.responses import StreamingResponse

log = logging.getLogger("rtp.http")


class HTTPService:
    """One ASGI app served by hypercorn on host:port, until it is told to end:

        SIGTERM or SIGINT  on_drain(signal name) runs first (the app turns new work away from then
                           on: 503, /health 503), then hypercorn stops accepting connections and
                           gives the requests in flight up to grace_period seconds; whatever still
                           runs after it is cancelled. A second signal exits at once, status 1.
        stop(grace)        the same from the code (e.g. the engine died), the grace shortened.

    serve() returns once hypercorn has shut down and the app's lifespan has ended."""

    def __init__(self, host: str, port: int, grace_period: float, on_drain: Callable[[str], None] | None = None):
        self.host, self.port = host, port
        self.grace_period = grace_period
        self.on_drain = on_drain
        self._stop = asyncio.Event()
        self._config = None

    def stop(self, grace: float | None = None) -> None:
        """End serving (from the event loop's thread): at most `grace` seconds for what is in flight."""
        if grace is not None:
            self.grace_period = min(self.grace_period, grace)
            if self._config is not None:
                self._config.graceful_timeout = self.grace_period
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def serve(self, app) -> None:
        from hypercorn.asyncio import serve as hypercorn_serve
        from hypercorn.config import Config

        config = self._config = Config()
        config.bind = [bind_address(self.host, self.port)]
        config.graceful_timeout = self.grace_period
        config.accesslog = None  # rtp logs one line per request itself
        config.errorlog = logging.getLogger("hypercorn.error")
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT)
        for sig in signals:
            loop.add_signal_handler(sig, self._signalled, sig.name)
        try:
            await hypercorn_serve(app, config, shutdown_trigger=self._stop.wait)
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)

    def _signalled(self, signame: str) -> None:
        if self._stop.is_set():  # a second signal: the operator does not want to wait
            log.warning("%s again: exiting without draining", signame)
            os._exit(1)
        if self.on_drain is not None:
            self.on_drain(signame)
        self._stop.set()


def bind_address(host: str, port: int) -> str:
    """host:port as hypercorn binds it (an IPv6 address in brackets)."""
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{host}:{port}"


def check_bindable(host: str, port: int) -> None:
    """OSError naming the address when nothing can listen there now: said at once, not after the
    slow part of a start (loading a model, a tokenizer)."""
    host = host.strip("[]")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as hypercorn binds
        try:
            s.bind((host, port))
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None


# -- streamed responses -----------------------------------------------------------------------------
#
# Starlette cancels a streaming body's iterator when the client disconnects; the iterator may not
# even have started, so its own `finally` is not enough to abort the request behind it. These run
# `on_close` however the response ends: done, client gone, or cancelled.


class ClosingStream(StreamingResponse):
    def __init__(self, content, on_close: Callable[[], None], media_type: str, headers: dict | None = None):
        super().__init__(content, media_type=media_type, headers=headers)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class EventStream(ClosingStream):
    """Server-sent events (the OpenAI routes' streams), never buffered by a proxy."""

    def __init__(self, content, on_close: Callable[[], None]):
        super().__init__(content, on_close, "text/event-stream",
                         {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
