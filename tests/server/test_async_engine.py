"""AsyncEngine alone, over a stub engine (no model): the thread protocol and the command surface.

Every call into the engine comes from the engine thread (the stub records the thread of each);
admission happens there, once, and the caller awaits its answer; a grammar compiles off the
engine thread while the others keep stepping, and a caller that leaves cancels its compile.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest

from rtp.errors import EngineFull, InvalidRequest
from rtp.sampling_params import SamplingParams, StructuredOutputs
from rtp.server.async_engine import AsyncEngine, EngineDead, Withdrawn

SPEC = StructuredOutputs(choice=["yes", "no"])


class StubEngine:
    """An LLMEngine's surface without a model. Records each call and the thread it came from; `step`
    yields one token per request (never finishing them), or raises. A prompt holding 99 is
    refused; `compile_grammar` hands out Futures the test settles; `full` makes the second prompt
    of a request find the engine full; a KV write of layer 13 fails."""

    def __init__(self, fail_step: bool = False):
        self.tokenizer, self.max_model_len, self.model_path = None, 64, "stub"
        self.model_config = SimpleNamespace(vocab_size=100)
        self.scheduler = SimpleNamespace(block_size=16)
        self.config = SimpleNamespace(parallel=SimpleNamespace(ranks=1))
        self.fail_step = fail_step
        self.full = False
        self.calls: list[str] = []
        self.threads: set[str] = set()
        self.requests: dict = {}
        self.compiles: list[tuple[Future, str]] = []

    def _called(self, what: str) -> None:
        self.calls.append(what)
        self.threads.add(threading.current_thread().name)

    def kv_layout(self):
        return SimpleNamespace(dtype="float32", layers=[[2, 1, 4]])

    def stats(self) -> dict:
        return {"num_running": len(self.requests)}

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def check_request(self, prompt_ids, params, prompt_param="prompt"):
        self._called(f"check {prompt_ids}")
        if 99 in prompt_ids:
            raise InvalidRequest("token 99 is not in this vocabulary", prompt_param)

    def compile_grammar(self, spec, client="local") -> Future:
        self._called(f"compile for {client}")
        future: Future = Future()
        self.compiles.append((future, client))
        return future

    def add_request(self, request_id, prompt, params, kv_sink=None):
        self._called(f"add {request_id}")
        if self.full and request_id.endswith("-1"):
            raise EngineFull("every request slot is taken")
        self.requests[request_id] = prompt

    def abort_request(self, request_id):
        self._called(f"abort {request_id}")
        self.requests.pop(request_id, None)

    def reserve_request(self, request_id, prompt, params):
        self._called(f"reserve {request_id}")
        return np.array([3, 4])

    def write_kv(self, layer, blocks, num_tokens, kv):
        self._called(f"write {layer}")
        if layer == 13:
            raise RuntimeError("the cache write failed")

    def step(self):
        self._called("step")
        time.sleep(0.01)
        if self.fail_step:
            raise RuntimeError("the device fell over")
        from rtp.engine.output import ChoiceDelta, RequestDelta

        return [RequestDelta(request_id, [ChoiceDelta(0, "x", 1, None, token_ids=[7])])
                for request_id in self.requests]

    def shutdown(self):
        pass


async def until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def run(stub: StubEngine, body) -> None:
    """body(engine) on a started AsyncEngine over stub; then every call must have come from its thread."""

    async def main():
        engine = AsyncEngine(stub)
        engine.start()
        try:
            await body(engine)
        finally:
            engine.stop()

    asyncio.run(main())
    assert stub.threads <= {"rtp-engine"}, f"the engine was called from {stub.threads}"


def test_async_engine_aborts_before_the_next_step_and_idles_blocked():
    stub = StubEngine()
    calls = []

    async def body(engine):
        stream = await engine.submit("r", [[1, 2]], SamplingParams(max_tokens=1000))
        updates = await stream.__anext__()
        assert updates[0].choices[0].text == "x"
        stream.close()
        await asyncio.sleep(0.1)
        calls.extend(stub.calls)
        await asyncio.sleep(0.2)
        assert stub.calls == calls  # idle: the thread waits on the queue, no more steps

    run(stub, body)
    # checked, then added; the abort came in between two steps: no step ran for the request after it
    assert calls[:2] == ["check [1, 2]", "add r-0"] and calls[-1] == "abort r-0" and calls[-2] == "step"


def test_async_engine_survives_a_failing_step_and_reports_it():
    stub = StubEngine(fail_step=True)
    seen = {}

    async def body(engine):
        results = await asyncio.gather(*(engine.submit(f"r{i}", [[1]], SamplingParams()) for i in range(2)),
                                       return_exceptions=True)
        # admitted before the step failed: the stream says why; after it: refused at admission
        seen["errors"] = [r if isinstance(r, BaseException) else (await r.__anext__())[0].error for r in results]
        with pytest.raises(EngineDead):
            await engine.submit("late", [[1]], SamplingParams())
        seen["dead"] = engine.dead

    run(stub, body)
    assert all(isinstance(e, EngineDead) and "fell over" in str(e) for e in seen["errors"]), seen
    assert isinstance(seen["dead"], RuntimeError)


def test_async_engine_loads_on_the_thread_that_steps_it():
    """One OpenMP pool: the model is built on the engine thread, not the caller's (AsyncEngine.load)."""
    threads = {}

    class Recording(StubEngine):
        def step(self):
            threads.setdefault("step", threading.current_thread())
            return super().step()

    def build():
        threads["build"] = threading.current_thread()
        return Recording()

    async def run_loaded():
        engine = AsyncEngine.load(build)
        engine.start()
        stream = await engine.submit("r", [[1, 2]], SamplingParams(max_tokens=1000))
        await stream.__anext__()
        stream.close()
        engine.stop()

    asyncio.run(run_loaded())
    assert threads["build"] is threads["step"] and threads["build"] is not threading.main_thread()
    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine.load(lambda: (_ for _ in ()).throw(ValueError("no such model")))
    unstarted = AsyncEngine.load(Recording)
    unstarted.stop()  # stopping an engine never started ends its thread too
    assert not unstarted._thread.is_alive()


def test_a_refused_request_is_the_callers_exception_and_nothing_is_queued():
    stub = StubEngine()

    async def body(engine):
        with pytest.raises(InvalidRequest) as refused:
            await engine.submit("bad", [[1], [99]], SamplingParams(), prompt_param="messages")
        assert refused.value.param == "messages"  # the field the caller named
        assert engine.num_unstarted == 0
        stub.full = True  # the second prompt finds no room: the first goes too, all or none
        with pytest.raises(EngineFull):
            await engine.submit("two", [[1], [2]], SamplingParams())
        assert engine.num_unstarted == 0 and not stub.requests

    run(stub, body)
    assert not any(call.startswith("add bad") for call in stub.calls)
    assert stub.calls[-3:] == ["add two-0", "add two-1", "abort two-0"]


def test_a_grammar_compiles_off_the_engine_thread_while_others_step():
    stub = StubEngine()

    async def body(engine):
        running = await engine.submit("plain", [[1]], SamplingParams(max_tokens=1000))
        waiting = asyncio.ensure_future(engine.submit("g", [[1]], SamplingParams(structured_outputs=SPEC),
                                                      client="10.0.0.7"))
        await until(lambda: stub.compiles)
        assert stub.compiles[0][1] == "10.0.0.7"  # the compiler's fairness is by client
        steps = stub.calls.count("step")
        await asyncio.sleep(0.1)
        assert stub.calls.count("step") > steps  # the engine steps on while the grammar compiles
        assert "add g-0" not in stub.calls and not waiting.done()
        stub.compiles[0][0].set_result("a matcher")  # on this thread, as a compiler's worker would
        stream = await waiting
        assert "add g-0" in stub.calls
        assert (await stream.__anext__())[0].choices[0].text == "x"
        stream.close()
        running.close()

    run(stub, body)
    assert stub.calls.index("check [1]", stub.calls.index("add plain-0")) < stub.calls.index("compile for 10.0.0.7")


def test_a_grammar_the_compiler_refuses_is_the_callers_exception():
    stub = StubEngine()

    async def body(engine):
        waiting = asyncio.ensure_future(engine.submit("g", [[1]], SamplingParams(structured_outputs=SPEC)))
        await until(lambda: stub.compiles)
        stub.compiles[0][0].set_exception(InvalidRequest("no output satisfies it", "structured_outputs"))
        with pytest.raises(InvalidRequest, match="no output satisfies"):
            await waiting
        assert engine.num_unstarted == 0

    run(stub, body)
    assert "add g-0" not in stub.calls


def test_a_caller_that_leaves_while_its_grammar_compiles_cancels_the_compile():
    stub = StubEngine()

    async def body(engine):
        waiting = asyncio.ensure_future(engine.submit("gone", [[1]], SamplingParams(structured_outputs=SPEC)))
        await until(lambda: stub.compiles)
        waiting.cancel()  # the HTTP client hung up
        with pytest.raises(asyncio.CancelledError):
            await waiting
        future = stub.compiles[0][0]
        await until(future.cancelled)  # the compiler drops or kills a compile nobody waits for
        assert engine.num_unstarted == 0
        # a request refused at admission costs no compile
        with pytest.raises(InvalidRequest):
            await engine.submit("bad", [[99]], SamplingParams(structured_outputs=SPEC))
        assert len(stub.compiles) == 1

    run(stub, body)
    assert "add gone-0" not in stub.calls


def test_reserve_and_write_kv_run_on_the_engine_thread():
    stub = StubEngine()

    async def body(engine):
        reserving = asyncio.ensure_future(engine.reserve("pd-r", [1, 2], SamplingParams(structured_outputs=SPEC)))
        await until(lambda: stub.compiles)
        assert "reserve pd-r" not in stub.calls  # after its grammar, as a request is added
        stub.compiles[0][0].set_result("a matcher")
        assert list(await reserving) == [3, 4]
        await engine.write_kv("pd-r", 0, np.array([3, 4]), 2, b"kv")
        with pytest.raises(RuntimeError, match="cache write failed"):
            await engine.write_kv("pd-r", 13, np.array([3, 4]), 2, b"kv")

    run(stub, body)
    # a failed write drops the request: its KV is incomplete
    assert stub.calls[-3:] == ["write 0", "write 13", "abort pd-r"]


def test_a_reserve_dropped_while_its_grammar_compiles_is_refused_and_its_compile_cancelled():
    """The prefill node's abort reaches a decode node whose reserve still waits for its grammar."""
    stub = StubEngine()

    async def body(engine):
        reserving = asyncio.ensure_future(engine.reserve("pd-r", [1, 2], SamplingParams(structured_outputs=SPEC)))
        await until(lambda: stub.compiles)
        engine.drop("pd-r")
        with pytest.raises(Withdrawn):
            await reserving
        assert stub.compiles[0][0].cancelled()

    run(stub, body)
    assert "reserve pd-r" not in stub.calls
