"""Determinism through `rtp serve` (docs/determinism.md): 32 concurrent streams get the same tokens and
logprobs, bit for bit, as the same requests sent one at a time.

Alone, every step of a request is one row (the one-row kernels' case); together, its rows share steps
with up to 31 others at every row position, its prompt is cut into other chunks, and the prompts that
share a prefix hit the prefix cache. Greedy and seeded rows, completions and chat, streamed and not.
"""

from __future__ import annotations

import asyncio
import random

import openai
import pytest

from tests.servers import MODEL, Server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

STREAMS = 32
SHARED = ("You are a careful assistant who answers in plain words. Here is a long preamble that several "
          "requests share, so that later ones find it in the prefix cache. ")
TOPICS = ["tea", "owls", "rivers", "the moon", "bicycles", "bread", "glaciers", "violins", "maps", "salt",
          "volcanoes", "honey", "clocks", "paper", "whales", "copper"]


@pytest.fixture(scope="module")
def server():
    s = Server("--max-num-seqs", str(STREAMS), "--kv-cache-memory", "256MiB").wait_ready()
    yield s
    s.stop()


def requests() -> list[dict]:
    """STREAMS requests: half greedy, half seeded; half with the shared prefix; some chat, some streamed."""
    rng = random.Random(7)
    out = []
    for i in range(STREAMS):
        topic = TOPICS[i % len(TOPICS)]
        text = (SHARED if i % 2 else "") + f"Write two sentences about {topic}" + "!" * rng.randrange(0, 5)
        seeded = i % 4 in (1, 2)
        out.append({"chat": i % 3 == 0, "stream": i % 5 < 2, "text": text, "max_tokens": rng.randrange(6, 28),
                    "temperature": 0.9 if seeded else 0.0, "seed": 1000 + i if seeded else None})
    return out


async def run(client: openai.AsyncOpenAI, req: dict) -> tuple[list[str], list[float]]:
    """(tokens, their logprobs) of one request, read from the response or from its stream's chunks."""
    common = {"model": MODEL, "max_tokens": req["max_tokens"], "temperature": req["temperature"],
              "seed": req["seed"], "stream": req["stream"]}
    tokens: list[str] = []
    logprobs: list[float] = []
    if req["chat"]:
        r = await client.chat.completions.create(messages=[{"role": "user", "content": req["text"]}],
                                                 logprobs=True, top_logprobs=2, **common)
        for choice in ([c.choices[0] async for c in r] if req["stream"] else [r.choices[0]]):
            for entry in (choice.logprobs.content or []) if choice.logprobs else []:
                tokens.append(entry.token)
                logprobs.append(entry.logprob)
                logprobs.extend(t.logprob for t in entry.top_logprobs)
    else:
        r = await client.completions.create(prompt=req["text"], logprobs=2, **common)
        for choice in ([c.choices[0] async for c in r] if req["stream"] else [r.choices[0]]):
            if choice.logprobs:
                tokens.extend(choice.logprobs.tokens)
                logprobs.extend(choice.logprobs.token_logprobs)
                logprobs.extend(v for top in choice.logprobs.top_logprobs for v in top.values())
    return tokens, logprobs


def test_32_concurrent_streams_get_what_each_gets_alone(server):
    reqs = requests()

    async def one_at_a_time():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        return [await run(client, r) for r in reqs]

    async def all_at_once():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        return await asyncio.gather(*(run(client, r) for r in reqs))

    alone = asyncio.run(one_at_a_time())
    together = asyncio.run(all_at_once())
    assert all(tokens for tokens, _ in alone)
    assert sum(r["temperature"] > 0 for r in reqs) >= 8  # seeded rows are in the mix
    differ = [i for i in range(STREAMS) if alone[i] != together[i]]
    assert not differ, f"{len(differ)} of {STREAMS} requests differ batched: {differ}"
