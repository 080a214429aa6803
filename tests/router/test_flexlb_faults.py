"""The FlexLB master's fault handling, in process and in milliseconds: a real Master and its
Starlette routes, with the workers replaced by an httpx MockTransport that answers as each
test says (tests/router/test_flexlb.py drives the same paths against real workers).

Two collocated workers, a and b; `Fake.answer` is what the next request(s) get, by call.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.applications import Starlette

from rtp.config import RouteConfig
from rtp.router.flexlb import Master
from rtp.wire import rpc
from rtp.wire.kv_layout import KVLayout

A, B = "http://a", "http://b"
OK = {"choices": [{"text": " fine", "finish_reason": "length"}], "usage": {"completion_tokens": 1}}


def openai_error(status: int, message: str, param=None) -> dict:
    return {"error": {"message": message, "type": "x", "param": param, "code": status}}


class Tokenizer:
    def encode(self, text):
        return [ord(c) for c in text]


class Fake:
    """The workers: /health and /rpc/stats as `health` says, the OpenAI routes from `answers`
    (one per call, the last repeated); `calls` is the worker each OpenAI request reached."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.health = {A: 200, B: 200}
        self.calls: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        worker = f"http://{request.url.host}"
        if request.url.path == "/health":
            if self.health[worker] is None:
                raise httpx.ConnectError("refused", request=request)
            return httpx.Response(self.health[worker], json=openai_error(503, "the engine is down")
                                  if self.health[worker] != 200 else None)
        if request.url.path == "/rpc/stats":
            if self.health[worker] is None:
                raise httpx.ConnectError("refused", request=request)
            return httpx.Response(200, content=rpc.encode(rpc.WorkerStats(
                role="collocated", model="m", block_size=16, total_blocks=64, free_blocks=64, used_blocks=0,
                cached_blocks=0, num_waiting=0, num_running=0, num_reserved=0, queued_prompt_tokens=0,
                prefill_tokens_per_ms=0.0, decode_step_ms=0.0, kv_cache_usage=0.0,
                kv_layout=KVLayout("float32", [[2, 4]]))))
        self.calls.append(worker)
        answer = self.answers[min(len(self.calls), len(self.answers)) - 1]
        return answer(request) if callable(answer) else answer


def run(fake: Fake, *requests: dict, stream_path: str = "/v1/completions"):
    """The master's answers to `requests` (JSON bodies), and the master."""

    async def go():
        master = Master(RouteConfig(collocated=[A, B], poll_interval=60), Tokenizer())
        master._client = httpx.AsyncClient(transport=httpx.MockTransport(fake))
        await master.poll_all()
        app = Starlette(routes=master.routes())
        out = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://master") as c:
            for body in requests:
                out.append(await c.post(stream_path, json=body) if body is not None else await c.get("/health"))
        await master.close()
        return out, master

    return asyncio.run(go())


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


def healthy(master: Master) -> dict[str, bool]:
    return {url: w.view.healthy for url, w in master.workers.items()}


def retries(master: Master) -> float:
    return master.m_retries._value.get()


REQUEST = {"prompt": "hello", "max_tokens": 4}


@pytest.mark.parametrize("status,body", [
    (500, openai_error(500, "the request failed: RuntimeError('injected')")),
    (400, openai_error(400, "top_p must be in (0, 1]", "top_p")),
    (503, openai_error(503, "the engine is down")),  # no Retry-After: the engine failed on it
    (502, {"error": "from a proxy"}),
    (504, {"error": "from a proxy"}),
])
def test_a_worker_error_passes_through_unretried(status, body):
    fake = Fake(httpx.Response(status, json=body), httpx.Response(200, json=OK))
    (r,), master = run(fake, REQUEST)
    assert r.status_code == status and r.json() == body
    assert len(fake.calls) == 1 and retries(master) == 0
    assert all(healthy(master).values())  # the request's fault, not the worker's


def test_a_503_with_retry_after_goes_to_the_other_worker():
    fake = Fake(httpx.Response(503, json=openai_error(503, "overloaded"), headers={"Retry-After": "1"}),
                httpx.Response(200, json=OK))
    (r,), master = run(fake, REQUEST)
    assert r.status_code == 200 and r.json() == OK
    assert sorted(fake.calls) == [A, B] and retries(master) == 1


def test_when_every_worker_says_come_back_the_client_gets_the_last_answer():
    refusal = httpx.Response(503, json=openai_error(503, "the server is shutting down"), headers={"Retry-After": "5"})
    fake = Fake(refusal)
    (r,), _ = run(fake, REQUEST)
    assert error_of(r, 503)["message"] == "the server is shutting down" and r.headers["retry-after"] == "5"
    assert sorted(fake.calls) == [A, B]


def test_an_unreachable_worker_is_retried_elsewhere_and_leaves_the_pool():
    def refused(request):
        raise httpx.ConnectError("connection refused", request=request)

    fake = Fake(refused, httpx.Response(200, json=OK))
    (r,), master = run(fake, REQUEST)
    assert r.status_code == 200 and sorted(fake.calls) == [A, B]
    assert sorted(healthy(master).values()) == [False, True]


@pytest.mark.parametrize("alive", [True, False])
def test_a_reset_is_retried_only_while_the_worker_lives(alive):
    """A worker that died holding the request may have died of it: the request stops there."""
    def reset(request):
        fake.health[fake.calls[-1]] = 200 if alive else None
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)

    fake = Fake(reset, httpx.Response(200, json=OK))
    (r,), master = run(fake, REQUEST)
    if alive:
        assert r.status_code == 200 and len(fake.calls) == 2 and all(healthy(master).values())
    else:
        assert "not retried" in error_of(r, 502)["message"] and len(fake.calls) == 1
        assert not master.workers[fake.calls[0]].view.healthy


class _Stream(httpx.AsyncByteStream):
    def __init__(self, chunks):
        self.chunks = chunks

    async def __aiter__(self):
        async for chunk in self.chunks:
            yield chunk


def test_a_stream_broken_midway_ends_with_an_openai_error_event():
    async def body():
        yield b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choi'
        raise httpx.ReadError("connection reset")

    fake = Fake(lambda request: httpx.Response(200, headers={"content-type": "text/event-stream"},
                                               stream=_Stream(body())))
    (r,), master = run(fake, {**REQUEST, "stream": True})
    events = [e for e in r.text.split("\n\n") if e]
    assert events[0] == 'data: {"choices": [{"text": "a"}]}'  # the half event was held back
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert error["code"] == 502 and error["param"] is None and "mid-stream" in error["message"]
    assert events[2] == "data: [DONE]" and len(fake.calls) == 1


def test_health_and_requests_say_when_no_worker_is_up():
    fake = Fake(httpx.Response(200, json=OK))
    fake.health = {A: 503, B: None}  # one engine dead (stats still answer), one process gone
    (health, r), master = run(fake, None, REQUEST)
    assert not any(healthy(master).values())
    assert "no healthy collocated worker" in error_of(health, 503)["message"]
    assert error_of(r, 503)["type"] == "service_unavailable" and r.headers["retry-after"]
    assert fake.calls == []
