"""`rtp serve` tried as a hostile client would: no request can take it down.

Two servers of the default model on loopback:
- `server`: a short context (64 tokens), so that whatever a generated body asks for
  finishes quickly; the fuzz test throws bodies at it across every field, and after each
  the server must still be healthy, serve a plain request, and (once idle) hold exactly
  the free KV blocks it held before. Its step budget (128 tokens: two whole prompts of the
  context) keeps the start-up capture of its step graph short;
- `doomed`: a fault hook whose request fault is followed by a failing integrity check,
  the way a runtime bug would show: the process must say so everywhere and exit non-zero
  at once, for its supervisor to restart it. It serves one request at a time (one CPU
  graph to capture at start-up, while `server` loads beside it).

RTP_FUZZ_EXAMPLES sets the number of generated bodies (default 150, the suite's CI profile
for property tests; every strategy below is drawn from in each run, and each CI run draws
new bodies). RTP_FUZZ_EXAMPLES=1000 for a longer hunt.
"""

from __future__ import annotations

import json
import os
import sys
import time

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servers import Server, chat

VOCAB = 49152
MARK = 1.25  # the presence_penalty of the request whose fault is followed by the failing check

# The engine's integrity check fails after the marked request's sampling faults: a fatal fault.
DOOMED_SERVE = f"""
import sys
from rtp.engine import core, sampler

gather = sampler.SamplingBatch.gather.__func__

def faulty_gather(cls, settings, slots, *args, **kw):
    if (settings.presence[slots] == {MARK}).any():
        raise RuntimeError("injected sampler failure")
    return gather(cls, settings, slots, *args, **kw)

def corrupt(self):
    raise core.EngineFatal("the runtime's integrity check failed after a request fault: injected")

sampler.SamplingBatch.gather = classmethod(faulty_gather)
core.EngineCore.check_integrity = corrupt
from rtp.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def servers():
    launched = {
        "server": Server("--max-model-len", "64", "--max-num-seqs", "16", "--kv-cache-memory", "64MiB",
                         "--max-num-batched-tokens", "128", "--max-queue", "256", "--max-body-bytes", "1MiB"),
        "doomed": Server("--max-model-len", "64", "--kv-cache-memory", "16MiB", "--grace-period", "30",
                         "--max-num-seqs", "1", "--max-num-batched-tokens", "64",
                         launcher=[sys.executable, "-c", DOOMED_SERVE]),
    }
    yield launched
    for s in launched.values():
        s.stop()


@pytest.fixture(scope="module")
def server(servers) -> Server:
    return servers["server"].wait_ready()


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("rtp:") and "{" in line:
            name, value = line.split("{", 1)[0], line.rsplit(" ", 1)[1]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def wait_idle(url: str, free: float | None = None, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = m["rtp:num_requests_running"] == 0 and m["rtp:num_requests_waiting"] == 0
        if idle and (free is None or m["rtp:num_free_blocks"] == free):
            return m
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {m}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def idle_free_blocks(server) -> float:
    return wait_idle(server.url)["rtp:num_free_blocks"]


def post(url: str, path: str, body, headers=None, timeout: float = 60):
    raw = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    return httpx.post(url + path, content=raw, timeout=timeout,
                      headers={"Content-Type": "application/json", **(headers or {})})


def assert_openai_error(r, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_still_serving(server, idle_free_blocks):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = post(server.url, "/v1/completions", {"prompt": "The sea is", "max_tokens": 1})
    assert r.status_code == 200, r.text
    wait_idle(server.url, idle_free_blocks)


# -- the three requests that each killed the engine, and the rest of the boundary ------------------------

def test_the_three_requests_that_killed_the_engine(server, idle_free_blocks):
    r = post(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "top_k": 9223372036854775808})
    assert_openai_error(r, 400, "top_k")
    r = post(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "top_p": 1e-300})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1  # top_p at float32's limit
    r = post(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "min_tokens": 2,
                                             "stop_token_ids": [100000]})
    assert_openai_error(r, 400, "stop_token_ids")
    assert_still_serving(server, idle_free_blocks)


UNSUPPORTED = [
    # tools need a template that renders them: SmolLM2's own does not (--chat-template chatml-tools does)
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("/v1/chat/completions", "tool_choice", "required"),  # without tools
    ("/v1/completions", "best_of", 3),
    ("/v1/completions", "suffix", "x"),
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/completions", "use_beam_search", True),
]


@pytest.mark.parametrize("path, field, value", UNSUPPORTED, ids=[f"{u[1]}{u[0][3:7]}" for u in UNSUPPORTED])
def test_a_field_rtp_does_not_implement_is_a_400_naming_it(server, path, field, value):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": chat("hi")}
    error = assert_openai_error(post(server.url, path, {**body, "max_tokens": 2, field: value}), 400, field)
    assert field in error["message"]


def test_inert_values_of_unsupported_fields_and_the_ignored_fields_are_accepted(server):
    body = {"messages": chat("hi"), "max_tokens": 2, "tool_choice": "none", "tools": [], "logit_bias": {},
            "response_format": {"type": "text"}, "best_of": 1, "store": False, "metadata": {"a": "b"},
            "parallel_tool_calls": True, "typical_p": 1.0, "mirostat": 0, "service_tier": "auto"}
    assert post(server.url, "/v1/chat/completions", body).status_code == 200
    error = assert_openai_error(post(server.url, "/v1/chat/completions", {**body, "stor": False}), 400, "stor")
    assert "stor" in error["message"]


def test_a_tool_call_in_the_history_is_refused_not_dropped(server):
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                                                                        "function": {"name": "f", "arguments": "{}"}}]}]
    error = assert_openai_error(post(server.url, "/v1/chat/completions", {"messages": messages}), 400, "messages")
    assert "--chat-template" in error["message"]  # SmolLM2's template would drop them silently


@pytest.mark.parametrize("depth", [50_000])
def test_deeply_nested_json_is_a_400(server, depth):
    body = b'{"prompt": "hi", "extra": ' + b"[" * depth + b"]" * depth + b"}"
    assert_openai_error(post(server.url, "/v1/completions", body), 400)
    body = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    assert_openai_error(post(server.url, "/v1/completions", body), 400)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_body_that_is_not_declared_json_is_a_415(server, content_type):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}',
                   headers={"Content-Type": content_type})
    assert_openai_error(r, 415)


def test_max_queue_counts_sequences_not_requests(server):
    # 300 prompts x n=3 against --max-queue 256: refused whole, with Retry-After
    r = post(server.url, "/v1/completions", {"prompt": ["hi"] * 300, "n": 3, "max_tokens": 2})
    assert_openai_error(r, 503)
    assert r.headers["retry-after"]


def test_a_large_prompt_does_not_stall_the_event_loop(server):
    """Tokenizing most of a megabyte takes a while; /health must answer meanwhile."""
    import threading

    big = "lorem ipsum dolor sit amet " * 38_000  # ~1 MB
    done = threading.Event()
    result = {}

    def send():
        result["r"] = post(server.url, "/v1/completions", {"prompt": big, "max_tokens": 2}, timeout=120)
        done.set()

    threading.Thread(target=send).start()
    slowest = 0.0
    while not done.is_set():
        started = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        slowest = max(slowest, time.monotonic() - started)
        time.sleep(0.01)
    assert_openai_error(result["r"], 400, "prompt")  # far over the context
    assert slowest < 0.5, f"/health took {slowest:.2f} s while a large prompt was tokenized"


# -- the fuzz test -------------------------------------------------------------------------------------

_extreme_ints = st.sampled_from([0, 1, -1, 2, 63, 64, 65, VOCAB - 1, VOCAB, VOCAB + 1, 2 ** 31, 2 ** 63 - 1, 2 ** 63,
                                 2 ** 64 - 1, 2 ** 64, -(2 ** 63), -(2 ** 63) - 1, 10 ** 30])
ints = st.one_of(st.integers(-3, 70), _extreme_ints, st.integers())
floats = st.one_of(st.floats(-3, 3), st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 1e-45, 1.17e-38, 1e300, 3.5e38, 2.0, 1.0, 0.5]))
token_ids = st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([VOCAB - 1, VOCAB, VOCAB + 1, -1, 2 ** 31, 2 ** 63]))
texts = st.one_of(st.text(max_size=30), st.sampled_from(["", " ", "\x00", "\ud7ff\ue000", "😀" * 8, "hi " * 80,
                                                         "<|im_end|>", "<|im_start|>assistant"]))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                        max_size=3), max_leaves=6)


schemas = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "frob"])},
                          optional={"maxLength": st.integers(-1, 8), "enum": st.lists(st.text(max_size=3), max_size=2)}),
    lambda inner: st.one_of(
        st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(st.text(max_size=4), inner,
                                                                                        max_size=3)},
                              optional={"required": st.lists(st.text(max_size=4), max_size=2),
                                        "additionalProperties": st.booleans()}),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner}, optional={"maxItems": st.integers(-1, 3)}),
        st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=2)})),
    max_leaves=5)


def field(strategy):
    return st.one_of(strategy, strategy, strategy, junk)  # mostly well-typed, sometimes anything


# grammars built to hurt: none of their outputs exist, their counts explode, their lists are huge
UNSATISFIABLE = {"guided_regex": [r"[^\x00-\x{10FFFF}]", r"a\bb", "[]"],
                 "guided_grammar": ['start: a\na: a "x"', 'start: "x" a\na: a "x"', "root ::= root"],
                 "guided_json": [{"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"},
                                 {"allOf": [{"type": "string"}, {"type": "integer"}]},
                                 {"type": "integer", "minimum": 5, "maximum": 1}]}
counts = st.sampled_from([0, 1, 999, 10_000, 10_001, 100_000, 10 ** 6, 10 ** 12])
hostile_regex = st.one_of(st.sampled_from(UNSATISFIABLE["guided_regex"]),
                          st.builds(lambda c, n: f"{c}{{{n}}}", st.sampled_from(["a", "(ab)", "[a-z]", "(a{100})"]),
                                    counts))
hostile_grammar = st.one_of(st.sampled_from(UNSATISFIABLE["guided_grammar"]),
                            st.builds(lambda n: f'start: "a"{{{n}}}', counts),
                            st.builds(lambda n: f"start: /x{{{n}}}/", counts))
hostile_choice = st.builds(lambda n, w: [f"{w}{i}" for i in range(n)], st.sampled_from([1, 2000, 4096, 4097, 20_000]),
                           st.sampled_from(["", "choice ", "😀"]))
# logit_bias keys as arbitrary strings (only canonical decimal token ids are ids)
bias_keys = st.one_of(st.integers(-1, VOCAB + 1).map(str), st.text(max_size=6),
                      st.sampled_from(["1_000", " 12 ", "\u0663", "05", "+5", "1e3", "0x10"]))


SAMPLING = {
    "n": field(st.one_of(st.integers(0, 3), ints)),
    "temperature": field(floats),
    "top_p": field(floats),
    "top_k": field(ints),
    "min_p": field(floats),
    "presence_penalty": field(floats),
    "frequency_penalty": field(floats),
    "repetition_penalty": field(floats),
    "seed": field(ints),
    "stop": field(st.one_of(texts, st.lists(texts, max_size=4))),
    "stop_token_ids": field(st.lists(token_ids, max_size=4)),
    "ignore_eos": field(st.booleans()),
    "min_tokens": field(st.one_of(st.integers(0, 70), ints)),
    "max_tokens": field(st.one_of(st.integers(0, 70), ints, st.none())),
    "skip_special_tokens": field(st.booleans()),
    "include_stop_str_in_output": field(st.booleans()),
    "stream": st.booleans(),
    "logit_bias": field(st.dictionaries(bias_keys, floats, max_size=2)),
    "user": field(texts),
    # grammars: schemas of any shape (some no JSON Schema), regexes and grammars of any text, and hostile ones
    "guided_json": field(st.one_of(schemas, st.sampled_from(UNSATISFIABLE["guided_json"]))),
    "guided_regex": field(st.one_of(texts, hostile_regex)),
    "guided_choice": field(st.one_of(st.lists(texts, max_size=3), hostile_choice)),
    "guided_grammar": field(st.one_of(texts, st.just('root ::= "a" | "b"'), hostile_grammar)),
}
COMPLETION = st.fixed_dictionaries(
    {"prompt": field(st.one_of(texts, st.lists(token_ids, max_size=6), st.lists(texts, min_size=1, max_size=3),
                               st.lists(st.lists(token_ids, max_size=4), max_size=2)))},
    optional={**SAMPLING, "logprobs": field(st.one_of(st.integers(0, 5), ints)), "echo": field(st.booleans()),
              "suffix": field(texts), "best_of": field(ints)})
message = st.fixed_dictionaries({"role": field(st.sampled_from(["user", "assistant", "system", "tool", "developer"])),
                                 "content": field(st.one_of(texts, st.lists(st.fixed_dictionaries(
                                     {"type": st.sampled_from(["text", "image_url"]), "text": texts}), max_size=2)))},
                                optional={"name": field(texts), "tool_call_id": field(texts),
                                          "tool_calls": field(st.lists(st.fixed_dictionaries(
                                              {"id": texts, "type": st.just("function"), "function": st.fixed_dictionaries(
                                                  {"name": texts, "arguments": st.one_of(texts, st.just("{}"))})}),
                                              max_size=2))})
CHAT = st.fixed_dictionaries(
    {"messages": field(st.lists(message, max_size=3))},
    optional={**SAMPLING, "logprobs": field(st.booleans()), "top_logprobs": field(st.one_of(st.integers(0, 5), ints)),
              "max_completion_tokens": field(st.one_of(st.integers(0, 70), ints)),
              "add_generation_prompt": field(st.booleans()),
              "tool_choice": field(st.one_of(texts, st.sampled_from(["none", "auto", "required"]),
                                             st.fixed_dictionaries({"type": st.just("function"),
                                                                    "function": st.fixed_dictionaries({"name": texts})}))),
              "tools": field(st.lists(st.fixed_dictionaries(
                  {"type": st.just("function"), "function": st.fixed_dictionaries(
                      {"name": st.one_of(texts, st.just("f"))}, optional={"parameters": schemas})}), max_size=2)),
              "response_format": field(st.one_of(
                  st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "yaml"])}),
                  st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
                      {"name": texts, "schema": schemas}, optional={"strict": st.booleans()})})))})

ALLOWED = {200, 400, 413, 415}  # never a 500: whatever a client sends is answered, or refused as its mistake


def check_response(r: httpx.Response, body: dict, streamed: bool) -> None:
    assert r.status_code in ALLOWED, r.text
    if r.status_code != 200:
        error = assert_openai_error(r, r.status_code)
        assert "\n" not in error["message"] and "Traceback" not in error["message"], error
        return
    if not streamed:
        for choice in r.json()["choices"]:
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            if choice["finish_reason"] == "stop":
                check_constraint(body, text)
        return
    events = [line for line in r.text.splitlines() if line]
    assert events[-1] == "data: [DONE]", events[-3:]
    for e in events[:-1]:
        payload = json.loads(e.removeprefix("data: "))
        if "error" in payload:  # after the first byte a request's grammar failing it travels as an event
            assert payload["error"]["code"] == 400, payload


def check_constraint(body: dict, text: str | None) -> None:
    """A constrained answer that finished with stop satisfies its constraint (where Python can tell)."""
    if body.get("stop") or body.get("stop_token_ids") or text is None:
        return  # a stop string or id may end it before the grammar does
    choices = body.get("guided_choice")
    if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
        assert text in choices, (text, choices[:5])
    schema = body.get("guided_json")
    if isinstance(schema, dict):
        document = json.loads(text)
        try:
            jsonschema.validate(document, schema)
        except jsonschema.SchemaError:
            pass  # not a JSON Schema that jsonschema reads (llguidance read it its own way)


@settings(max_examples=int(os.environ.get("RTP_FUZZ_EXAMPLES", "150")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(kind=st.sampled_from(["completions", "chat/completions"]), data=st.data())
def test_fuzzed_bodies_never_take_the_server_down(server, idle_free_blocks, kind, data):
    body = data.draw(COMPLETION if kind == "completions" else CHAT)
    r = post(server.url, f"/v1/{kind}", body, timeout=120)
    check_response(r, body, streamed=body.get("stream") is True and r.headers.get("content-type", "").startswith(
        "text/event-stream"))
    assert_still_serving(server, idle_free_blocks)


# -- a fatal fault --------------------------------------------------------------------------------------

def test_a_fatal_fault_exits_non_zero_at_once_and_says_so_until_then(servers):
    doomed = servers["doomed"].wait_ready()
    assert metrics(doomed.url)["rtp:engine_healthy"] == 1
    r = post(doomed.url, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "presence_penalty": MARK})
    failed_at = time.monotonic()
    assert r.status_code in (500, 503), r.text
    answers = []
    while doomed.proc.poll() is None and time.monotonic() - failed_at < 10:
        try:
            answers.append(httpx.get(doomed.url + "/health", timeout=1).status_code)
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    exited_after = time.monotonic() - failed_at
    assert doomed.proc.wait(10) == 1
    assert set(answers) <= {503}, answers  # never a zombie that answers 200
    assert exited_after < 3.0, f"exited {exited_after:.2f} s after the fault"
    out = doomed.output()
    assert "engine failed" in out and "integrity check failed" in out
    with pytest.raises(httpx.ConnectError):
        httpx.get(doomed.url + "/health", timeout=2)

