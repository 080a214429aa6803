"""A client that hangs up in the very turn of the event loop its request is admitted in.

`_until_disconnected` (rtp/server/openai_api.py) races the admission against the client's
disconnect. When both end in one turn, the disconnect message has been read: nobody would read
it again, so a response streamed from there on would run to max_tokens for nobody (on a prefill
node, a decode node decoding for a client gone). The admitted stream must be closed instead.
Starlette's real Request over an ASGI receive that says the client left.
"""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from rtp.server.openai_api import _ClientGone, _until_disconnected


class Admitted:
    """What an admission returns (a Stream, a Relay): closing it aborts the request."""

    closed = False

    def close(self) -> None:
        self.closed = True


def _request(disconnect_after: int) -> Request:
    calls = 0

    async def receive():
        nonlocal calls
        calls += 1
        if calls > disconnect_after:
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


def test_an_admission_that_ends_with_the_disconnect_is_closed_not_returned():
    async def run():
        admitted = Admitted()

        async def admit():
            return admitted

        with pytest.raises(_ClientGone):
            await _until_disconnected(_request(0), admit())  # both done in the first turn
        return admitted

    assert asyncio.run(run()).closed


def test_an_admission_before_the_disconnect_is_returned_open():
    async def run():
        admitted = Admitted()

        async def admit():
            return admitted

        request = Request({"type": "http", "method": "POST", "path": "/", "headers": []},
                          lambda: asyncio.sleep(3600))
        got = await _until_disconnected(request, admit())
        return admitted, got

    admitted, got = asyncio.run(run())
    assert got is admitted and not admitted.closed


def test_a_disconnect_before_the_admission_cancels_it():
    async def run():
        cancelled = asyncio.Event()

        async def admit():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        with pytest.raises(_ClientGone):
            await _until_disconnected(_request(0), admit())
        await asyncio.sleep(0)
        return cancelled.is_set()

    assert asyncio.run(run())
