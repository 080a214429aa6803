"""Streamed responses that always run their cleanup.

Starlette cancels a streaming body's iterator when the client disconnects; the
iterator may not even have started, so its own `finally` is not enough to abort
the request behind it. These run `on_close` however the response ends: done,
client gone, or cancelled.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.responses import StreamingResponse


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
