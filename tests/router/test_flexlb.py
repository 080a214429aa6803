"""`rtp route`, the FlexLB master, end to end: real `rtp serve` workers and masters on loopback.

Two prefill nodes, one decode node and two collocated nodes start together (loading
overlaps) and are shared by the module; all run float32, as tests/server/test_pd.py's do, so
greedy tokens do not depend on batching. Two masters route over the prefill/decode
workers, one at the default beta and one at beta = 0; a third over the collocated pair,
which also serves as the P/D output's reference. The collocated nodes carry
tests/servers.py's fault hook (a prompt with FAULT_MARK fails in the detokenizer),
which touches no other prompt. The last tests kill a prefill node, then both collocated ones.

The master's pure parts -- when to retry, which pair to try next, SSE event cuts -- are
tested first, without servers.
"""

from __future__ import annotations

import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from servers import FAULT_MARK, FAULTY_SERVE, MODEL, Server

from rtp.config import RouteConfig
from rtp.router.flexlb import FINAL, RETRY, RETRY_IF_ALIVE, Master, _Events, retry_rule

TOKEN = "flexlb-test-secret"
COMMON = ("--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "96MiB", "--max-num-seqs", "16")


def start_master(*args: str) -> Server:
    return Server("--rpc-token", TOKEN, "--poll-interval", "0.2", *args, command=("route",))


def client_of(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def metric(url: str, name: str) -> dict[str, float]:
    """Samples of one metric: {labels text: value}."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {m.group(1) or "": float(m.group(2))
            for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? ([0-9.e+-]+)$", text, re.MULTILINE)}


def prefix_hits(server) -> float:
    return sum(metric(server.url, "rtp:prefix_cache_hits_total").values())


def routed(master: Server) -> dict[str, float]:
    """Requests each prefill worker got from this master: {url: count}."""
    out = {}
    for labels, v in metric(master.url, "rtp:route_requests_total").items():
        if 'role="prefill"' in labels:
            out[re.search(r'worker="([^"]+)"', labels).group(1)] = v
    return out


def error_of(r: httpx.Response, status: int) -> dict:
    """The OpenAI-shaped error body of r, checked to have that status and shape."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    return error


def errors_seen(server: Server) -> float:
    return sum(v for k, v in metric(server.url, "rtp:request_success_total").items() if 'reason="error"' in k)


# -- the pure parts ---------------------------------------------------------------------------------


def test_retry_only_what_never_reached_an_engine():
    assert retry_rule(error=httpx.ConnectError("refused")) == RETRY
    assert retry_rule(error=httpx.ConnectTimeout("slow")) == RETRY
    assert retry_rule(error=httpx.RemoteProtocolError("no response")) == RETRY_IF_ALIVE
    assert retry_rule(error=httpx.ReadError("reset")) == RETRY_IF_ALIVE
    assert retry_rule(error=httpx.ReadTimeout("busy")) == FINAL  # the worker has it
    assert retry_rule(503, {"Retry-After": "1"}) == RETRY       # full queue, draining, no decode peer
    assert retry_rule(503, {"content-type": "application/json"}) == FINAL  # its engine failed on it
    for status in (400, 401, 404, 413, 500, 502, 504):
        assert retry_rule(status, {"retry-after": "1"}) == FINAL


def test_a_retry_changes_the_worker_or_the_pair():
    class Tokenizer:
        def encode(self, text):
            return [1, 2, 3]

    pd = Master(RouteConfig(prefill=["http://p0", "http://p1"], decode=["http://d0"]), Tokenizer())
    co = Master(RouteConfig(collocated=["http://c0", "http://c1"]), Tokenizer())
    for m in (pd, co):
        for url in m.workers:
            m.router.set_healthy(url, True)
    names = lambda picked: (picked[0].url, picked[2] and picked[2].url)  # noqa: E731
    # a prefill 503 may be the decode peer's: the next attempt changes what it can
    assert names(pd._pick([1, 2, 3], 8, [("http://p0", "http://d0")])) == ("http://p1", "http://d0")
    with pytest.raises(LookupError):
        pd._pick([1, 2, 3], 8, [("http://p0", "http://d0"), ("http://p1", "http://d0")])
    assert names(co._pick([1, 2, 3], 8, [("http://c0", None)])) == ("http://c1", None)
    with pytest.raises(LookupError):
        co._pick([1, 2, 3], 8, [("http://c0", None), ("http://c1", None)])


def test_a_relayed_stream_is_cut_at_event_boundaries():
    events = _Events()
    assert events.whole(b"data: {\"a\"") == b""
    assert events.whole(b": 1}\n\ndata: {\"b") == b"data: {\"a\": 1}\n\n"
    assert events.tail == b"data: {\"b"  # dropped if the stream breaks now: the error event stands alone
    assert events.whole(b"\": 2}\n\n") == b"data: {\"b\": 2}\n\n" and events.tail == b""


# -- the cluster ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    decode = Server("--role", "decode", "--rpc-token", TOKEN, *COMMON, threads=1)
    faulty = [sys.executable, "-c", FAULTY_SERVE]
    nodes = {
        "decode": decode,
        "p0": Server("--role", "prefill", "--rpc-token", TOKEN, *COMMON, threads=1),
        "p1": Server("--role", "prefill", "--rpc-token", TOKEN, *COMMON, threads=1),
        "collocated": Server(*COMMON, threads=1, launcher=faulty),
        "collocated2": Server(*COMMON, threads=1, launcher=faulty),
    }
    # the masters start while the nodes load (their URLs are known): a master polls its workers
    # until they answer, and is used only once it counts every one of them healthy
    workers = ("--prefill", nodes["p0"].url, nodes["p1"].url, "--decode", decode.url)
    masters = [start_master(*workers), start_master(*workers, "--beta", "0"),
               start_master("--collocated", nodes["collocated"].url, nodes["collocated2"].url)]
    try:
        for node in nodes.values():
            node.wait_ready()
        for m, count in zip(masters, (3, 3, 2)):
            m.wait_ready()
            deadline = time.monotonic() + 30
            while sorted(metric(m.url, "rtp:route_worker_healthy").values()) != [1.0] * count:
                assert time.monotonic() < deadline, metric(m.url, "rtp:route_worker_healthy")
                time.sleep(0.1)
        yield {**nodes, "master": masters[0], "master_beta0": masters[1], "master_co": masters[2]}
    finally:
        for m in masters:
            m.stop()
        for node in nodes.values():
            node.stop()


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a quiet village,",
           "List three primary colors:", "Water boils at", "The quick brown fox", "In 1969, humans",
           "A haiku about autumn:"]


def test_beta_0_spreads_requests_by_queue(cluster):
    """First in the module: no worker has measured its prefill speed yet, so the master takes
    them as equal and the split follows queued tokens alone (with measured speeds it follows
    queue time, which on this shared machine can differ between the two nodes several-fold)."""
    master = cluster["master_beta0"]
    client = client_of(master)
    before = routed(master)
    shared = "Summarise the following in a word. " * 20
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: client.completions.create(
            model=MODEL, prompt=f"{shared} Item {k}.", max_tokens=24, temperature=0), range(8)))
    counts = [n - before.get(url, 0) for url, n in routed(master).items()]
    assert sum(counts) == 8 and min(counts) >= 2  # the shared prefix did not pull them together


def test_routed_pd_output_equals_collocated(cluster):
    routed_client = client_of(cluster["master"])
    reference = openai.OpenAI(base_url=cluster["collocated"].url + "/v1", api_key="unused", max_retries=0)

    def complete(client, p, stream):
        if stream:
            return "".join(c.choices[0].text for c in client.completions.create(
                model=MODEL, prompt=p, max_tokens=20, temperature=0, stream=True))
        return client.completions.create(model=MODEL, prompt=p, max_tokens=20, temperature=0).choices[0].text

    def chat(client, p):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                           max_tokens=20, temperature=0)
        return r.choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda a: complete(routed_client, *a), [(p, s) for p in PROMPTS for s in (False, True)]))
        got_chat = list(pool.map(lambda p: chat(routed_client, p), PROMPTS))
        # the collocated references batch as well: float32 greedy tokens do not depend on the batch
        want = list(pool.map(lambda p: complete(reference, p, False), PROMPTS))
        want_chat = list(pool.map(lambda p: chat(reference, p), PROMPTS))
    assert got == [w for w in want for _ in (0, 1)]
    assert got_chat == want_chat
    assert all(routed(cluster["master"]).values())  # both prefill nodes served some


def test_shared_prefix_requests_land_on_the_worker_holding_it(cluster):
    master = cluster["master"]
    client = client_of(master)
    system = ("You are the reference desk of a maritime museum. Answer in one sentence, cite the gallery "
              "number, and never speculate about ships not in the collection. ") * 4
    before_hits = {k: prefix_hits(cluster[k]) for k in ("p0", "p1")}
    before_routes = routed(master)
    for q in ("When was the lighthouse lens made?", "Who built the steam tug?", "Where is the whaling exhibit?",
              "How old is the figurehead?"):
        client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": q}])
    hits = {k: prefix_hits(cluster[k]) - before_hits[k] for k in ("p0", "p1")}
    routes = {url: n - before_routes.get(url, 0) for url, n in routed(master).items()}
    holder = max(hits, key=hits.get)
    assert hits[holder] >= 3 * 100          # three follow-ups each reused the long system prompt
    assert hits[min(hits, key=hits.get)] == 0
    assert routes.get(cluster[holder].url) == 4  # every request went to the one that holds it


def test_the_master_rejects_bad_bodies_and_reports_metrics(cluster):
    url = cluster["master"].url
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json=[1, 2])
    assert r.status_code == 400
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": -3})
    assert r.status_code == 400  # the worker's own validation, relayed
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == MODEL
    healthy = metric(url, "rtp:route_worker_healthy")
    assert len(healthy) == 3 and all(v == 1.0 for v in healthy.values())
    assert 0 < metric(url, "rtp:route_prefix_hit_ratio")[""] <= 1


def test_a_request_that_faults_a_worker_is_not_retried(cluster):
    """A request that fails inside an engine is the request's fault: the client gets the worker's own
    answer, no other worker sees the request, and the worker that did stays in the pool."""
    master, workers = cluster["master_co"], (cluster["collocated"], cluster["collocated2"])
    before = [errors_seen(w) for w in workers]
    retries = metric(master.url, "rtp:route_retries_total")[""]
    r = httpx.post(master.url + "/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": f"{FAULT_MARK} once upon a time", "max_tokens": 8})
    error = error_of(r, 500)
    assert error["type"] == "server_error" and "injected" in error["message"]
    assert sorted(errors_seen(w) - b for w, b in zip(workers, before)) == [0, 1]
    # streamed, the failure is an event after the status line: the worker's event, relayed
    streamed = httpx.post(master.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": FAULT_MARK}], "max_tokens": 8, "stream": True})
    events = [line for line in streamed.text.splitlines() if line]
    assert events[-1] == "data: [DONE]" and "injected" in json.loads(events[-2][6:])["error"]["message"]
    assert sum(errors_seen(w) - b for w, b in zip(workers, before)) == 2
    assert metric(master.url, "rtp:route_retries_total")[""] == retries
    assert list(metric(master.url, "rtp:route_worker_healthy").values()) == [1.0, 1.0]
    for w in workers:
        assert httpx.get(w.url + "/health").status_code == 200
        ok = httpx.post(w.url + "/v1/completions", timeout=60, json={"prompt": "The sea is", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def test_bad_input_passes_through_unretried(cluster):
    master = cluster["master_co"]
    retries = metric(master.url, "rtp:route_retries_total")[""]
    routed_before = sum(metric(master.url, "rtp:route_requests_total").values())
    r = httpx.post(master.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 4, "top_p": 2})
    assert error_of(r, 400)["param"] == "top_p"
    assert sum(metric(master.url, "rtp:route_requests_total").values()) == routed_before + 1
    assert metric(master.url, "rtp:route_retries_total")[""] == retries


def test_structured_outputs_through_the_master(cluster):
    """response_format and its 400s pass through `rtp route` as they are, to P/D pairs and
    collocated workers alike."""
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "age": {"type": "integer", "minimum": 0, "maximum": 99}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    reference = openai.OpenAI(base_url=cluster["collocated"].url + "/v1", api_key="unused", max_retries=0)
    want = reference.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A person:"}],
                                             max_tokens=40, temperature=0, response_format=fmt)
    for master in ("master", "master_co"):
        got = client_of(cluster[master]).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "A person:"}], max_tokens=40, temperature=0,
            response_format=fmt)
        assert got.choices[0].message.content == want.choices[0].message.content
        json.loads(got.choices[0].message.content)
        r = httpx.post(cluster[master].url + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 4, "guided_regex": "a(b"})
        assert error_of(r, 400)["param"] == "guided_regex"


def test_killing_a_prefill_worker(cluster):
    """Streams it was relaying fail with an error; requests that had not started are retried
    elsewhere; the master keeps serving."""
    master = cluster["master_beta0"]  # spreads by queue, so both prefill nodes hold streams
    client = client_of(master)
    before = routed(master)
    started, results = [], []

    def stream(k):
        try:
            text = ""
            for i, chunk in enumerate(client.completions.create(
                    model=MODEL, prompt=f"Count slowly from {k}:", max_tokens=100, temperature=0,
                    stream=True, extra_body={"ignore_eos": True})):
                if i == 0:
                    started.append(k)
                text += chunk.choices[0].text
            results.append(("ok", k))
        except openai.APIError as e:
            results.append(("error", str(e)))

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(stream, k) for k in range(6)]
        deadline = time.monotonic() + 60
        while len(started) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        counts = {url: n - before.get(url, 0) for url, n in routed(master).items()}
        victim = max(("p0", "p1"), key=lambda k: counts.get(cluster[k].url, 0))
        cluster[victim].proc.kill()
        for f in futures:
            f.result(timeout=300)
    errors = [r for r in results if r[0] == "error"]
    # every stream the victim relayed had started: each fails, with an error; the others finish
    assert len(started) == 6 and len(results) == 6
    assert len(errors) == counts[cluster[victim].url] >= 1
    # new requests all succeed on the survivor (retried if the master still thought the victim alive)
    for k in range(4):
        out = client.completions.create(model=MODEL, prompt=f"After the failure {k}:", max_tokens=4, temperature=0)
        assert out.choices[0].finish_reason == "length"
    assert httpx.get(master.url + "/health").status_code == 200
    healthy = metric(master.url, "rtp:route_worker_healthy")
    assert healthy[f'role="prefill",worker="{cluster[victim].url}"'] == 0.0


def test_dead_collocated_workers_leave_the_pool(cluster):
    """SIGKILL one collocated worker: it leaves the pool and requests go to the other; kill the
    other and the master says, on /health and to requests, that nothing can serve."""
    master = cluster["master_co"]
    client = client_of(master)

    def wait_for(condition, timeout=15.0):
        deadline = time.monotonic() + timeout
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.1)
        return condition()

    cluster["collocated2"].proc.kill()
    cluster["collocated2"].proc.wait()
    for k in range(4):  # the first may still be sent to the dead one: unreached, it is retried
        out = client.completions.create(model=MODEL, prompt=f"With one worker {k}:", max_tokens=2, temperature=0)
        assert out.choices[0].finish_reason == "length"
    assert wait_for(lambda: metric(master.url, "rtp:route_worker_healthy")[
        f'role="collocated",worker="{cluster["collocated2"].url}"'] == 0.0)
    assert httpx.get(master.url + "/health").status_code == 200
    cluster["collocated"].proc.kill()
    cluster["collocated"].proc.wait()
    assert wait_for(lambda: httpx.get(master.url + "/health").status_code == 503)
    assert "no healthy collocated worker" in error_of(httpx.get(master.url + "/health"), 503)["message"]
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True})):
        r = httpx.post(master.url + path, json={"model": MODEL, "max_tokens": 2, **body}, timeout=30)
        assert error_of(r, 503)["type"] == "service_unavailable" and r.headers["retry-after"]
    for m in ("master", "master_beta0", "master_co"):
        assert "never retrieved" not in cluster[m].output()
