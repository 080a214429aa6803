"""`rtp serve`, end to end: the real server with the default model, in a subprocess on loopback.

Two servers start together at the top of the module (loading overlaps) and are shared:
- `server`: what a user runs, with an API key, a short context (512) and a 64 KiB body limit,
  in float32: greedy tokens must not depend on the batch, and bf16 matmuls round
  differently at different batch sizes (flipping near-ties), fp32 ones practically never;
- `small`: --max-queue 1 and a fault hook (FAULTY_SERVE, in tests/servers.py), for the 503,
  one-request-failure and SIGTERM tests; the SIGTERM test ends it, so it comes last. Its step
  budget is one whole context (512 tokens), which keeps the start-up capture of its step graph short.

The fault hook is the one difference from `rtp serve`: the detokenizer raises for
prompts that contain FAULT_MARK, the way a tokenizer bug would hit one request.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from servers import FAULT_MARK, FAULTY_SERVE, KEY, MODEL, ROOT, Server, chat, metrics, wait_idle


@pytest.fixture(scope="module")
def servers():
    launched = {
        "server": Server("--api-key", KEY, "--max-model-len", "512", "--max-body-bytes", "64KiB",
                         "--dtype", "float32", "--kv-cache-memory", "1GiB"),
        "small": Server("--max-queue", "1", "--grace-period", "30", "--max-num-seqs", "8",
                        "--max-model-len", "512", "--max-num-batched-tokens", "512", "--kv-cache-memory", "64MiB",
                        launcher=[sys.executable, "-c", FAULTY_SERVE]),
    }
    yield launched
    for s in launched.values():
        s.stop()


@pytest.fixture(scope="module")
def server(servers) -> Server:
    return servers["server"].wait_ready()


@pytest.fixture(scope="module")
def small(servers) -> Server:
    return servers["small"].wait_ready()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _aborted(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(re.search(r'^rtp:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$', text, re.MULTILINE).group(1))


# -- the happy paths, through the official client ---------------------------------------------------


def test_health_models_and_metrics(server):
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed
    models = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == 512
    m = metrics(server.url)
    for name in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
                 "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_free_blocks",
                 "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "prompt_tokens_total", "generation_tokens_total", "event_loop_cpu_seconds_total"):
        assert f"rtp:{name}" in m, name
    assert "rtp:request_success_total{" in httpx.get(server.url + "/metrics").text


def test_the_default_model_knows_the_capital_of_france(client):
    r = client.chat.completions.create(model=MODEL, messages=chat("What is the capital of France?"),
                                       temperature=0, max_tokens=24)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # the same prompt again: its blocks come from the prefix cache
    again = client.chat.completions.create(model=MODEL, messages=chat("What is the capital of France?"),
                                           temperature=0, max_tokens=24)
    assert again.choices[0].message.content == r.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_completions_stream_equals_non_stream(client):
    kwargs = {"model": MODEL, "prompt": "The three primary colors are", "temperature": 0, "max_tokens": 12}
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text and text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_stream_equals_non_stream(client):
    kwargs = {"model": MODEL, "messages": chat("Name a fruit."), "temperature": 0, "max_completion_tokens": 16}
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_n_stop_and_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", n=2, temperature=1.0, seed=7,
                                  max_tokens=10, logprobs=2, stop=["\n"])
    assert sorted(c.index for c in r.choices) == [0, 1]
    for c in r.choices:
        assert "\n" not in c.text
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == len(c.logprobs.top_logprobs)
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
        assert all(1 <= len(top) <= 3 for top in c.logprobs.top_logprobs)
    assert r.choices[0].text != r.choices[1].text or r.choices[0].logprobs.token_logprobs != \
        r.choices[1].logprobs.token_logprobs  # seed + i: the choices differ
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=16,
                                        stop=" 6")
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text.strip() == "5,"
    c = client.chat.completions.create(model=MODEL, messages=chat("Say hi."), temperature=0, max_tokens=6,
                                       logprobs=True, top_logprobs=3, n=2)
    for choice in c.choices:
        assert len(choice.logprobs.content) == c.usage.completion_tokens // 2 or choice.finish_reason == "stop"
        assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
        assert "".join(t.token for t in choice.logprobs.content).startswith(choice.message.content[:3])


def test_prompt_forms_and_echo(client, server):
    ids = httpx.post(server.url + "/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                     json={"prompt": "The sea is"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] == 512
    back = httpx.post(server.url + "/detokenize", headers={"Authorization": f"Bearer {KEY}"},
                      json={"tokens": ids["tokens"]}).json()
    assert back["prompt"] == "The sea is"
    by_text = client.completions.create(model=MODEL, prompt="The sea is", temperature=0, max_tokens=6)
    by_ids = client.completions.create(model=MODEL, prompt=ids["tokens"], temperature=0, max_tokens=6)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=MODEL, prompt=[ids["tokens"], "The sea is"], temperature=0,
                                      max_tokens=6)
    assert [c.text for c in batch.choices] == [by_text.choices[0].text] * 2
    assert batch.usage.prompt_tokens == 2 * by_text.usage.prompt_tokens
    echo = client.completions.create(model=MODEL, prompt="The sea is", temperature=0, max_tokens=6, echo=True)
    assert echo.choices[0].text == "The sea is" + by_text.choices[0].text


# -- bad clients and bad input -------------------------------------------------------------------------

LONG = "hello " * 600  # over 512 tokens

BAD = [  # (id, path, raw body, expected status, expected param)
    ("malformed json", "/v1/completions", b'{"prompt": "hi", ', 400, None),
    ("not an object", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("wrong type n", "/v1/completions", {"prompt": "hi", "n": "2"}, 400, "n"),
    ("wrong type messages", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("missing prompt", "/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("mixed prompt list", "/v1/completions", {"prompt": ["hi", 3]}, 400, "prompt"),
    ("wrong type nested", "/v1/chat/completions", {"messages": [{"role": 1, "content": "hi"}]}, 400, "messages"),
    ("unknown model", "/v1/completions", {"model": "gpt-17", "prompt": "hi"}, 400, "model"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("empty token prompt", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("token out of vocabulary", "/v1/completions", {"prompt": [1, 10**7]}, 400, "prompt"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("prompt over max_model_len", "/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("chat over max_model_len", "/v1/chat/completions", {"messages": chat(LONG)}, 400, "messages"),
    ("max_tokens over the context", "/v1/completions", {"prompt": "hi", "max_tokens": 600}, 400, "max_tokens"),
    ("max_tokens zero", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("negative temperature", "/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("top_p zero", "/v1/chat/completions", {"messages": chat("hi"), "top_p": 0}, 400, "top_p"),
    ("top_p over one", "/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("n zero", "/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("empty stop string", "/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {"messages": chat("hi"), "top_logprobs": 2},
     400, "top_logprobs"),
    ("too many logprobs", "/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("oversized body", "/v1/completions", {"prompt": "x" * 70_000}, 413, None),
    ("unknown route", "/v1/engines", {}, 404, None),
]


@pytest.mark.parametrize("path, body, status, param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_gets_an_openai_error(server, path, body, status, param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=raw, timeout=30,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == status
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}],
                         ids=["missing", "wrong", "not bearer"])
def test_api_key_is_required(server, headers):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 401


def test_still_serving_after_bad_input(client):
    # runs after the bad-input tests: nothing they sent left a mark
    r = client.completions.create(model=MODEL, prompt="The sea is", temperature=0, max_tokens=4)
    assert r.choices[0].text and r.choices[0].finish_reason == "length"


# -- load ------------------------------------------------------------------------------------------------


def test_concurrent_greedy_streams_equal_sequential(client):
    prompts = [f"Write a short sentence about the number {i}." for i in range(16)]  # 16 streams decode as one batch

    def one(prompt: str, stream: bool) -> str:
        kwargs = {"model": MODEL, "messages": chat(prompt), "temperature": 0, "max_tokens": 8}
        if not stream:
            return client.chat.completions.create(**kwargs).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True))

    sequential = [one(p, False) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        concurrent = list(pool.map(lambda p: one(p, True), prompts))
    assert concurrent == sequential


def test_disconnect_storm_leaves_no_ghosts(server):
    idle = metrics(server.url)
    assert idle["rtp:num_requests_running"] == 0
    headers = {"Authorization": f"Bearer {KEY}"}
    rng = random.Random(0)
    n = 100  # more than the server's 64 running sequences: some leave while they still wait

    async def one(client: httpx.AsyncClient, i: int) -> str:
        body = {"model": MODEL, "prompt": f"Story {i}: once upon a time", "max_tokens": 12, "stream": True,
                "temperature": 0.7, "seed": i}
        if i % 2:  # the clients that leave ask for long outputs: a ghost would keep running for minutes
            body.update(max_tokens=400, ignore_eos=True)
        if i % 2 == 0:  # finishes
            async with client.stream("POST", server.url + "/v1/completions", json=body, headers=headers) as r:
                lines = [line async for line in r.aiter_lines() if line]
            assert lines[-1] == "data: [DONE]", lines[-3:]
            return "done"
        if i % 10 == 1:  # a non-streaming request whose client gives up
            try:
                await client.post(server.url + "/v1/completions", json={**body, "stream": False},
                                  headers=headers, timeout=rng.uniform(0.05, 1.0))
            except httpx.TimeoutException:
                return "gave up"
            return "done"
        leave_after = rng.randint(0, 6)  # chunks read before hanging up (0: right after the headers)
        async with client.stream("POST", server.url + "/v1/completions", json=body, headers=headers) as r:
            seen = 0
            async for _ in r.aiter_lines():
                seen += 1
                if seen > leave_after:
                    break
        return "left"

    async def storm():
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)))

    aborted_before = _aborted(server.url)
    outcomes = asyncio.run(storm())
    assert outcomes.count("done") == n // 2
    after = wait_idle(server.url, idle["rtp:num_free_blocks"], timeout=10)
    # every stream that left was aborted (a non-streamed one may leave before it was even queued)
    assert outcomes.count("left") <= _aborted(server.url) - aborted_before <= n // 2
    assert after["rtp:num_requests_running"] == 0 and after["rtp:num_requests_waiting"] == 0
    assert after["rtp:num_free_blocks"] == idle["rtp:num_free_blocks"]
    assert after["rtp:kv_cache_usage_perc"] == 0
    # and it still answers
    r = httpx.post(server.url + "/v1/completions", headers=headers, timeout=60,
                   json={"prompt": "The sea is", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_bench_serve_against_rtp_serve(server):
    out = subprocess.run([sys.executable, "-m", "rtp.bench", "serve", "--base-url", server.url, "--api-key", KEY,
                          "--num-prompts", "8", "--input-len", "32", "--output-len", "8", "--max-concurrency", "4",
                          "--ignore-eos", "--disable-tqdm", "--endpoint", "/v1/chat/completions"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["completed"] == 8 and figures["failed"] == 0
    assert figures["total_output_tokens"] == 8 * 8  # ignore_eos: every request runs to max_tokens
    assert figures["output_throughput"] > 0 and figures["p99_itl_ms"] > 0
    # read from rtp serve's /metrics: the HTTP side's share of the server's CPU
    assert 0 < figures["server_event_loop_cpu_share"] < 1 and figures["server_event_loop_us_per_output_token"] > 0
    assert "Serving Benchmark Result" in out.stdout


# -- the small server: overload, one failing request, SIGTERM ------------------------------------------


def test_one_failing_request_fails_alone(small):
    good, started = {"lines": []}, threading.Event()

    def stream_good():
        with httpx.stream("POST", small.url + "/v1/completions", timeout=120,
                          json={"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line:
                    good["lines"].append(line)
                    started.set()  # running now, so the next request is not refused for the queue

    thread = threading.Thread(target=stream_good)
    thread.start()
    assert started.wait(120)
    bad = httpx.post(small.url + "/v1/completions", timeout=120,
                     json={"prompt": f"{FAULT_MARK} once upon a time", "max_tokens": 8})
    assert bad.status_code == 500, bad.text
    assert bad.json()["error"]["type"] == "server_error" and "injected" in bad.json()["error"]["message"]
    streamed = httpx.post(small.url + "/v1/chat/completions", timeout=120,
                          json={"messages": chat(FAULT_MARK), "max_tokens": 8, "stream": True})
    events = [line for line in streamed.text.splitlines() if line]
    assert events[-1] == "data: [DONE]" and "injected" in json.loads(events[-2][6:])["error"]["message"]
    thread.join(120)
    assert good["lines"][-1] == "data: [DONE]"
    assert json.loads(good["lines"][-2][6:])["choices"][0]["finish_reason"] == "length"
    assert httpx.get(small.url + "/health").status_code == 200
    after = httpx.post(small.url + "/v1/completions", timeout=60, json={"prompt": "The sea is", "max_tokens": 4})
    assert after.status_code == 200


def test_a_full_queue_answers_503(small):
    def one(i):
        return httpx.post(small.url + "/v1/completions", timeout=120,
                          json={"prompt": f"Request {i} says", "max_tokens": 4})

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(one, range(8)))
    statuses = [r.status_code for r in responses]
    assert 200 in statuses and 503 in statuses, statuses
    assert set(statuses) <= {200, 503}
    rejected = next(r for r in responses if r.status_code == 503)
    assert rejected.headers["retry-after"] and rejected.json()["error"]["code"] == 503


def test_sigterm_drains_then_exits_0(small):
    with httpx.stream("POST", small.url + "/v1/completions", timeout=120,
                      json={"prompt": "Once upon a time", "max_tokens": 32, "ignore_eos": True,
                            "stream": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert first.startswith("data: {")
        small.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"  # ran to the end
    assert small.proc.wait(60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(small.url + "/health", timeout=2)
    assert "draining" in small.output()
