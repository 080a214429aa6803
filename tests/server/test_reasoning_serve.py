"""`rtp serve --reasoning-parser deepseek_r1` on the default model, through the real `openai` client,
streamed and whole (each stream must add up to the whole answer, piece by piece).

SmolLM2-135M does not think, so its outputs are made to hold thinking in two real ways:
- under deepseek_r1 the prompt is taken to have opened the thinking, so a plain greedy answer, which
  never writes </think>, is all reasoning (content null, finish_reason length at max_tokens);
- a few-shot history of assistant turns written `Thinking.</think>A` makes the model write its own
  answer that way (greedy), and `...<tool_call>...</tool_call>...</think><tool_call>...` likewise
  for calls: the call inside the thinking must stay thinking.
A grammar (response_format, guided_choice, a named tool) must hold the answer and let the thinking
through: the thinking is the same text the model writes unconstrained.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.servers import MODEL, Server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def server():
    # one thread: on a 2-core machine with other work, a team of two spins (minutes, not seconds, here)
    s = Server("--reasoning-parser", "deepseek_r1", "--chat-template", "chatml-tools", "--tool-call-parser", "hermes",
               "--max-num-seqs", "8", "--kv-cache-memory", "256MiB", threads=1).wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# assistant turns that think first: the model answers the next one the same way
FEW_SHOT = [*ask("Say A"), {"role": "assistant", "content": "Thinking.</think>A"},
            *ask("Say B"), {"role": "assistant", "content": "Thinking.</think>B"}, *ask("Say C")]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _call(city: str) -> str:
    return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>' % city


# ... and that write a call inside their thinking, then make it
CALLS_FEW_SHOT = [turn for city in ("Paris", "Oslo") for turn in (
    *ask(f"Weather in {city}?"),
    {"role": "assistant", "content": f"Maybe {_call(city)} is right.</think>{_call(city)}"})] + ask("Weather in Rome?")


def answer(client, **kwargs) -> tuple[str | None, str | None, list[tuple[str, dict]], str]:
    """(reasoning_content, content, calls, finish_reason) of the whole answer, once its stream has
    been checked to add up to it."""
    choice = client.chat.completions.create(model=MODEL, temperature=0, **kwargs).choices[0]
    m = choice.message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
    reasoning = getattr(m, "reasoning_content", None)
    pieces: dict[str, list[str]] = {"reasoning": [], "content": []}
    streamed_calls: list[list] = []
    finish = None
    for chunk in client.chat.completions.create(model=MODEL, temperature=0, stream=True, **kwargs):
        for c in chunk.choices:
            assert finish is None, "a chunk after the finish"
            if getattr(c.delta, "reasoning_content", None):
                pieces["reasoning"].append(c.delta.reasoning_content)
            if c.delta.content:
                pieces["content"].append(c.delta.content)
            for call in c.delta.tool_calls or []:
                if call.id:
                    streamed_calls.append([call.function.name, ""])
                else:
                    streamed_calls[-1][1] += call.function.arguments
            finish = c.finish_reason
    assert "".join(pieces["reasoning"]) == (reasoning or "")
    assert "".join(pieces["content"]) == (m.content or "")
    assert [(name, json.loads(arguments)) for name, arguments in streamed_calls] == calls
    assert finish == choice.finish_reason
    if reasoning and len(reasoning) > 12:
        assert len(pieces["reasoning"]) > 1, "the thinking came in one piece: not streamed"
    return reasoning, m.content, calls, choice.finish_reason


def test_an_answer_that_never_closes_its_thinking_is_all_reasoning(client):
    reasoning, content, calls, finish = answer(client, messages=ask("What is 2+2?"), max_tokens=8)
    assert reasoning and content is None and not calls and finish == "length"
    # enable_thinking false: no thinking, the same tokens are all content
    assert answer(client, messages=ask("What is 2+2?"), max_tokens=8,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}}) == (None, reasoning, [], "length")


def test_thinking_then_the_answer(client):
    assert answer(client, messages=FEW_SHOT, max_tokens=20) == ("Thinking.", "C", [], "stop")


def test_a_call_written_in_the_thinking_is_thinking_and_the_one_after_it_is_a_call(client):
    reasoning, content, calls, finish = answer(client, messages=CALLS_FEW_SHOT, tools=TOOLS, max_tokens=80)
    assert "<tool_call>" in reasoning and '"get_weather"' in reasoning  # written, and not called
    assert content is None and finish == "tool_calls"
    assert [name for name, _ in calls] == ["get_weather"] and set(calls[0][1]) == {"city"}


LETTER = {"type": "object", "properties": {"letter": {"type": "string", "enum": ["A", "B", "C"]}},
          "required": ["letter"], "additionalProperties": False}


def test_a_grammar_holds_the_answer_after_the_thinking(client):
    reasoning, content, _, finish = answer(client, messages=FEW_SHOT, max_tokens=30, response_format={
        "type": "json_schema", "json_schema": {"name": "letter", "schema": LETTER}})
    assert reasoning == "Thinking." and finish == "stop"
    jsonschema.validate(json.loads(content), LETTER)
    reasoning, content, calls, finish = answer(client, messages=FEW_SHOT, tools=TOOLS, max_tokens=60,
                                               tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert reasoning == "Thinking." and content is None and finish == "tool_calls"
    assert [name for name, _ in calls] == ["get_weather"]


def test_a_grammar_lets_the_thinking_through_as_the_model_writes_it(client):
    free = answer(client, messages=ask("What is 2+2?"), max_tokens=8)
    constrained = answer(client, messages=ask("What is 2+2?"), max_tokens=8,
                         extra_body={"guided_choice": ["yes", "no"]})
    assert constrained == free and free[0]  # the same thinking, unclosed: no answer yet
    # no thinking: the grammar holds the output from its first token
    _, content, _, finish = answer(client, messages=ask("What is 2+2?"), max_tokens=8, extra_body={
        "guided_choice": ["yes", "no"], "chat_template_kwargs": {"enable_thinking": False}})
    assert content in ("yes", "no") and finish == "stop"


def test_completions_are_not_parsed(server):
    body = httpx.post(server.url + "/v1/completions", json={"prompt": "Thinking.</think>A", "max_tokens": 5,
                                                             "temperature": 0}, timeout=120).json()
    assert set(body["choices"][0]) == {"index", "text", "logprobs", "finish_reason", "stop_reason"}
    assert body["choices"][0]["text"]
