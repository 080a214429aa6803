"""`rtp serve --speculative ngram`: a real server on loopback, the real openai client. Drafted and
verified tokens stream out as the plain deltas do (a verification's kept tokens as one delta), the
streamed text is the non-streamed one, and /metrics carries vLLM's spec_decode counters and the
costs the speculation governor measured."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from servers import MODEL, Server, chat, metrics

ASK = "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon."


@pytest.fixture(scope="module")
def server():
    # one request at a time here: 5 sequences (a step verifies at most max-num-seqs - 1 drafts: 4) and a
    # 512-token step (one whole context) are CPU graphs enough
    s = Server("--speculative", "ngram", "--num-speculative-tokens", "4", "--max-model-len", "512",
               "--kv-cache-memory", "64MiB", "--max-num-seqs", "5", "--max-num-batched-tokens", "512")
    yield s.wait_ready()
    s.stop()


def test_drafted_tokens_stream_out_and_are_counted(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    whole = client.chat.completions.create(model=MODEL, messages=chat(ASK), temperature=0, max_tokens=48)
    stream = client.chat.completions.create(model=MODEL, messages=chat(ASK), temperature=0, max_tokens=48,
                                            stream=True, stream_options={"include_usage": True})
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(parts) == whole.choices[0].message.content and "banana" in whole.choices[0].message.content
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert len(parts) < usage.completion_tokens  # some deltas carried a verification's several tokens
    m = metrics(server.url)
    assert m["rtp:spec_decode_num_draft_tokens_total"] > 0
    assert 0 < m["rtp:spec_decode_num_accepted_tokens_total"] <= m["rtp:spec_decode_num_draft_tokens_total"]
    text = httpx.get(server.url + "/metrics").text
    one = r'rtp:spec_decode_seconds_per_token\{batch_size="1",drafts="(yes|no)",[^}]*\} ([0-9.e+-]+)'
    costs = re.findall(one, text)
    assert ("yes" in {d for d, _ in costs}) and all(0 < float(v) < 10 for _, v in costs), costs
