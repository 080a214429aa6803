"""Nothing a client sends costs more than its own request, against a real `rtp serve` on loopback.

Grammars: a spec past a limit is a 400 naming its field at once; a grammar no output satisfies is a
400 before the answer starts; compiles of clients that hung up are dropped or killed, so a new
small grammar is answered in under a second behind three abandoned large ones; one client's
compiles delay another's by at most one. The request's fields: every field that could change the
output is honoured or a 400 naming it; conversations, template variables and logit_bias keys are
checked; /detokenize runs off the event loop; /v1/models shows no local path.

The server runs the default model from its path (so /v1/models has a path to hide), with room for
large grammars (--grammar-max-bytes 4MiB: the isolation tests need schemas of 330 KB that take
llguidance seconds) and the default compile timeout (2 s).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import httpx
import jsonschema
import pytest

from servers import Server, chat

SLOW = 6000  # properties of a schema that takes llguidance about 4 s to build (past the 2 s timeout)


@pytest.fixture(scope="module")
def server(default_gguf):
    s = Server("--model", str(default_gguf), "--max-model-len", "256", "--max-num-seqs", "8",
               "--kv-cache-memory", "64MiB", "--max-num-batched-tokens", "256", "--grammar-max-bytes", "4MiB")
    yield s.wait_ready()
    s.stop()


def post(url: str, path: str, body, timeout: float = 120, local: str | None = None) -> httpx.Response:
    """POST from a loopback address of our choosing (127.0.0.x): each address is a client of its own."""
    transport = httpx.HTTPTransport(local_address=local) if local else None
    with httpx.Client(transport=transport, timeout=timeout) as c:
        return c.post(url + path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


def assert_400(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    message = error["message"]
    # one sentence: never a backtrace, a parser state dump or a Python exception's text
    for bad in ("\n", "Traceback", "<state>", "panicked", "backtrace", "Error(", "Exception"):
        assert bad not in message, message
    return message


def slow_schema(tag: str) -> dict:
    return {"type": "object", "properties": {f"{tag}{i}": {"type": "string", "pattern": "[a-z]{1,50}"}
                                             for i in range(SLOW)}}


def metric(url: str, name: str, **labels) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- grammars --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, says", [
    ("guided_choice", [f"choice number {i}" for i in range(100_000)], "--grammar-max-choices"),
    ("guided_regex", "a{1000000}", "--grammar-max-repetition"),
    ("guided_grammar", 'start: "a"{100000}', "--grammar-max-repetition"),
    ("guided_json", {"type": "string", "pattern": "(ab{1000}){1000}"}, "--grammar-max-repetition"),
    ("guided_regex", "x" * (5 << 20), "--grammar-max-bytes"),
])
def test_a_grammar_past_a_limit_is_a_400_naming_its_field_at_once(server, field, value, says):
    body = {"prompt": "hi", "max_tokens": 4, field: value}
    started = time.perf_counter()
    r = post(server.url, "/v1/completions", body)
    seconds = time.perf_counter() - started
    assert says in assert_400(r, field)
    # the limit is checked before anything is compiled: the time is the body's upload and decode
    assert seconds < (0.5 if field != "guided_regex" or len(value) < 1000 else 2.0), seconds


@pytest.mark.parametrize("field, value", [
    ("guided_regex", r"[^\x00-\x{10FFFF}]"),
    ("guided_grammar", 'start: a\na: a "x"'),
    ("guided_json", {"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_no_output_satisfies_is_a_400_before_the_answer_starts(server, field, value, stream):
    r = post(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 4, field: value, "stream": stream})
    assert "no output satisfies" in assert_400(r, field)


def test_a_grammar_that_leads_nowhere_fails_its_request_as_the_grammars_fault(server):
    """Some text begins it, so it compiles; after that text no token can follow: the request fails
    as a 400 naming the field (an error event naming it when streamed), never a 500."""
    body = {"prompt": "Say x:", "max_tokens": 8, "temperature": 0, "guided_grammar": 'start: "x" a\na: a "x"'}
    assert "cannot be continued" in assert_400(post(server.url, "/v1/completions", body), "guided_grammar")
    r = post(server.url, "/v1/completions", {**body, "stream": True})
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == 400 and events[-1]["error"]["param"] == "guided_grammar"


def test_three_abandoned_large_grammars_do_not_delay_a_new_small_one(server):
    """Three clients send large grammars that take seconds to build and hang up after half a second;
    a new client's small grammar is then answered in under a second, and no abandoned compile ran on to
    its 2 s timeout: each was killed or dropped (cancelled) or, where the server saw the hang-up before
    it asked for one, never started. (A loaded CI machine twice counted fewer than three cancellations:
    a request whose client left before its compile was asked for costs nothing and counts nothing.)"""
    def refused(cause: str) -> float:
        return metric(server.url, "rtp:grammar_refused_total", cause=cause)

    before = {cause: refused(cause) for cause in ("cancelled", "timeout")}

    def abandon(i: int) -> None:
        with pytest.raises(httpx.TimeoutException):
            post(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 4,
                                                 "guided_json": slow_schema(f"gone{i}_")}, timeout=0.5)

    sent = time.monotonic()
    threads = [threading.Thread(target=abandon, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    started = time.perf_counter()
    r = post(server.url, "/v1/completions", {"prompt": "Is the sky blue?", "max_tokens": 2,
                                             "guided_choice": ["yes", "maybe"]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("yes", "maybe")
    seconds = time.perf_counter() - started
    assert seconds < 1.0, f"a small grammar waited {seconds:.2f} s behind abandoned ones"
    # past the 2 s timeout of any compile the abandoned requests started (a second's margin): the server had
    # 1.5 s after each hang-up to stop its compile
    time.sleep(max(0.0, sent + 3.0 - time.monotonic()))
    assert refused("timeout") == before["timeout"], "an abandoned compile ran on to its timeout"
    assert refused("cancelled") > before["cancelled"], "no abandoned compile was cancelled"


def test_a_compile_past_the_timeout_is_a_400_and_one_clients_flood_waits_its_turn(server):
    flood: list[httpx.Response] = []

    def send(i: int) -> None:
        flood.append(post(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 4,
                                                          "guided_json": slow_schema(f"flood{i}_")},
                          local="127.0.0.2"))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # the flood is queued: two compiles run, four wait
    started = time.perf_counter()
    r = post(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "guided_choice": ["a", "b"]},
             local="127.0.0.3")
    seconds = time.perf_counter() - started
    assert r.status_code == 200
    # behind at most one compile of the flood (each is killed at the 2 s timeout)
    assert seconds < 3.0, f"another client's small grammar waited {seconds:.2f} s behind a flood"
    assert len(flood) < 6, "the other client's grammar waited for the whole flood"
    for t in threads:
        t.join()
    for response in flood:
        assert "longer than 2 s to compile" in assert_400(response, "guided_json")


def test_grammar_syntax_is_tried_not_guessed(server):
    # Lark whose literal holds GBNF's rule sign: tried as GBNF, then run as Lark
    r = post(server.url, "/v1/completions", {"prompt": "Pick:", "max_tokens": 8, "temperature": 0,
                                             "guided_grammar": 'start: "a::=b" | "c"'})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("a::=b", "c")
    r = post(server.url, "/v1/completions", {"prompt": "Pick:", "max_tokens": 8,
                                             "structured_outputs": {"grammar": 'start: "a::=b"',
                                                                    "grammar_syntax": "gbnf"}})
    assert "not GBNF" in assert_400(r, "structured_outputs")


def test_min_tokens_a_grammar_cannot_reach_is_refused_not_dropped(server):
    body = {"prompt": "Is the sky blue?", "max_tokens": 8, "min_tokens": 5, "guided_choice": ["yes", "no"]}
    assert "min_tokens" in assert_400(post(server.url, "/v1/completions", body), "min_tokens")
    # where the grammar can go on, min_tokens holds it open
    body = {"prompt": "Count:", "max_tokens": 12, "min_tokens": 6, "temperature": 0, "guided_regex": "[0-9 ]{1,60}"}
    r = post(server.url, "/v1/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 6


def test_guided_whitespace_pattern_is_honoured(server):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"prompt": "JSON:", "max_tokens": 24, "temperature": 0, "guided_json": schema,
            "guided_whitespace_pattern": "[ ]?"}
    r = post(server.url, "/v1/completions", body)
    assert r.status_code == 200
    text = r.json()["choices"][0]["text"]
    jsonschema.validate(json.loads(text), schema)
    assert "\n" not in text
    r = post(server.url, "/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_regex": "a+",
                                             "guided_whitespace_pattern": " "})
    assert_400(r, "guided_whitespace_pattern")


# -- the request's fields --------------------------------------------------------------------------------

@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "typical_p", 0.5),
    ("/v1/completions", "mirostat", 2),
    ("/v1/completions", "tfs_z", 0.5),
    ("/v1/chat/completions", "reasoning_effort", "high"),
    ("/v1/chat/completions", "service_tier", "flex"),
    ("/v1/completions", "frobnicate", 1),
    ("/v1/chat/completions", "frobnicate", {"a": 1}),
])
def test_a_field_that_could_change_the_output_is_a_400_naming_it(server, path, field, value):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": chat("hi")}
    message = assert_400(post(server.url, path, {**body, "max_tokens": 2, field: value}), field)
    assert field in message


def test_stream_options_without_stream_is_a_400(server):
    r = post(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                             "stream_options": {"include_usage": True}})
    assert_400(r, "stream_options")


def test_max_completion_tokens_counts_on_completions_too(server):
    r = post(server.url, "/v1/completions", {"prompt": "Once upon a time", "max_completion_tokens": 5,
                                             "max_tokens": 50, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def test_ignored_fields_cannot_change_the_output(server):
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "logprobs": 2}
    plain = post(server.url, "/v1/completions", body).json()["choices"][0]
    noisy = post(server.url, "/v1/completions", {
        **body, "user": "u-1", "store": True, "metadata": {"run": "a"}, "prompt_cache_key": "k",
        "safety_identifier": "s", "service_tier": "auto"}).json()["choices"][0]
    assert noisy["text"] == plain["text"] and noisy["logprobs"] == plain["logprobs"]


@pytest.mark.parametrize("key", ["1_000", " 12 ", "\u0663", "05", "-1", "1e3", "0x10", ""])
def test_logit_bias_keys_are_canonical_token_ids(server, key):
    r = post(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": {key: 5}})
    assert_400(r, "logit_bias")


@pytest.mark.parametrize("messages, where", [
    ([{"role": "robot", "content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "42", "tool_call_id": "nope"}],
     "messages[1].tool_call_id"),
    ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}], "messages[1].tool_call_id"),
])
def test_a_conversation_that_does_not_hold_together_is_a_400_naming_the_message(server, messages, where):
    r = post(server.url, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert assert_400(r, "messages").startswith(where)


def test_chat_template_kwargs_cannot_replace_the_templates_own_variables(server):
    for name in ("messages", "add_generation_prompt", "bos_token", "raise_exception"):
        r = post(server.url, "/v1/chat/completions", {"messages": chat("hi"), "max_tokens": 2,
                                                      "chat_template_kwargs": {name: []}})
        assert name in assert_400(r, "chat_template_kwargs")


def test_detokenize_runs_off_the_event_loop(server):
    ids = [1234] * 1_000_000
    done, result = threading.Event(), {}

    def send():
        result["r"] = post(server.url, "/detokenize", {"tokens": ids})
        done.set()

    threading.Thread(target=send).start()
    slowest = 0.0
    while not done.is_set():
        started = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        slowest = max(slowest, time.monotonic() - started)
        time.sleep(0.01)
    assert result["r"].status_code == 200 and len(result["r"].json()["prompt"]) > 1_000_000
    assert slowest < 0.25, f"/health took {slowest:.2f} s while a million ids were detokenized"


def test_models_shows_no_local_path(server, default_gguf):
    cards = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
    for card in cards:
        for value in (card["id"], card["root"]):
            assert "/" not in value and str(default_gguf.parent) not in value, card
    # the path the server was started with is still accepted as the model's name
    r = post(server.url, "/v1/completions", {"model": str(default_gguf), "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200
    r = post(server.url, "/v1/completions", {"model": cards[0]["id"], "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200


def test_num_speculative_tokens_past_what_a_step_verifies_is_refused_at_startup():
    out = subprocess.run([sys.executable, "-m", "rtp", "generate", "--speculative", "ngram",
                          "--num-speculative-tokens", "1000000", "--prompt", "hi"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert "--num-speculative-tokens 1000000" in last and "Traceback" not in out.stderr, out.stderr


# -- outputs under a constraint are valid ----------------------------------------------------------------

VALID = [
    ("guided_regex", r"[A-Z][a-z]{1,8}( [a-z]{1,8}){0,3}\.", lambda t: re.fullmatch(r"[A-Z][a-z]{1,8}( [a-z]{1,8}){0,3}\.", t)),
    ("guided_choice", ["red", "green", "blue"], lambda t: t in ("red", "green", "blue")),
    ("guided_grammar", 'start: NUM ("+" NUM)*\nNUM: /[1-9][0-9]?/', lambda t: re.fullmatch(r"[1-9][0-9]?(\+[1-9][0-9]?)*", t)),
    ("guided_grammar", 'root ::= "(" [a-c]+ ")"', lambda t: re.fullmatch(r"\([a-c]+\)", t)),
    ("guided_json", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                                      "s": {"type": "string", "maxLength": 5}},
                     "required": ["n", "s"], "additionalProperties": False},
     lambda t: jsonschema.validate(json.loads(t), VALID[4][1]) or True),
]


@pytest.mark.parametrize("field, value, valid", VALID, ids=[f"{v[0]}-{i}" for i, v in enumerate(VALID)])
def test_every_answer_that_stops_satisfies_its_constraint(server, field, value, valid):
    for temperature, seed in ((0, None), (1.0, 1), (1.0, 2)):
        body = {"prompt": "Answer:", "max_tokens": 40, "temperature": temperature, field: value, "n": 2}
        if seed is not None:
            body["seed"] = seed
        r = post(server.url, "/v1/completions", body)
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            if choice["finish_reason"] == "stop":
                assert valid(choice["text"]), choice["text"]
