"""Structured outputs and tool calling through `rtp serve` on the default model, with the real
`openai` client: response_format (pydantic models through `parse`, json_schema, json_object),
vLLM's guided_* extras, logit_bias, and tools with every tool_choice, streamed and not.

The server runs with the ChatML tools template rtp ships (SmolLM2's own has no tools) and the
Hermes parser. A 135M model does not write tool calls on its own, so `auto` is driven with a
guided_regex that makes it write a Hermes call: the parser then reads real generated text.
"""

from __future__ import annotations

import asyncio
import json
import re
from enum import Enum
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.servers import MODEL, Server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def server():
    s = Server("--chat-template", "chatml-tools", "--tool-call-parser", "hermes", "--max-num-seqs", "16",
               "--kv-cache-memory", "256MiB").wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# -- a dozen shapes of pydantic models ------------------------------------------------------------


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Point(BaseModel):
    x: int
    y: int


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


class Team(BaseModel):
    name: str = Field(max_length=16)
    members: list[Person] = Field(max_length=3)


class Paint(BaseModel):
    color: Color
    opacity: float = Field(ge=0, le=1)


class Flags(BaseModel):
    enabled: bool
    retries: int = Field(ge=0, le=5)


class Tagged(BaseModel):
    tags: list[Literal["a", "b", "c"]] = Field(min_length=1, max_length=3)


class MaybeNickname(BaseModel):
    name: str = Field(max_length=12)
    nickname: str | None = Field(max_length=12)


class Box(BaseModel):
    corner: Point
    size: Point


class Review(BaseModel):
    stars: int = Field(ge=1, le=5)
    verdict: Literal["buy", "skip"]
    summary: str = Field(max_length=40)


class Matrix(BaseModel):
    rows: list[list[int]] = Field(max_length=2)


class Event(BaseModel):
    title: str = Field(max_length=24)
    day: int = Field(ge=1, le=31)
    month: Literal["jan", "feb", "mar"]
    attendees: list[str] = Field(max_length=2)


class Order(BaseModel):
    item: str = Field(max_length=16)
    quantity: int = Field(ge=1, le=9)
    price: float = Field(ge=0, le=1000)
    express: bool
    color: Color | None


MODELS = [Point, Person, Team, Paint, Flags, Tagged, MaybeNickname, Box, Review, Matrix, Event, Order]


@pytest.mark.parametrize("model", MODELS, ids=[m.__name__ for m in MODELS])
def test_parse_returns_a_valid_object(client, model):
    completion = client.chat.completions.parse(
        model=MODEL, messages=ask(f"Give me an example {model.__name__} as JSON."),
        response_format=model, max_tokens=400, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, model)
    schema = openai.lib._pydantic.to_strict_json_schema(model)
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_schema_strict_and_sampled_outputs_validate(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "population", "tags"],
              "properties": {"city": {"type": "string", "maxLength": 20},
                             "population": {"type": "integer", "minimum": 0},
                             "tags": {"type": "array", "items": {"enum": ["big", "old", "coastal"]},
                                      "maxItems": 3}}}
    completion = client.chat.completions.create(
        model=MODEL, messages=ask("Describe a city."), max_tokens=200, n=4, temperature=1.0, seed=7,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}})
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_parses(client):
    completion = client.chat.completions.create(
        model=MODEL, messages=ask("Give a JSON object with a name and an age."), max_tokens=300, temperature=0,
        response_format={"type": "json_object"})
    assert isinstance(json.loads(completion.choices[0].message.content), dict)


def test_guided_choice_and_regex(client):
    choices = ["positive", "negative", "neutral"]
    completion = client.completions.create(model=MODEL, prompt="The movie was great. Sentiment:", max_tokens=10,
                                           temperature=0.8, n=4, seed=1, extra_body={"guided_choice": choices})
    assert {c.text for c in completion.choices} <= set(choices)
    pattern = r"[A-Z][a-z]{2,8} \d{1,3}(\.\d)?"
    completion = client.completions.create(model=MODEL, prompt="A name and a number:", max_tokens=20,
                                           temperature=0, extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, completion.choices[0].text)
    assert completion.choices[0].finish_reason == "stop"


def test_structured_output_streams(client):
    schema = Person.model_json_schema()
    text = ""
    for chunk in client.completions.create(model=MODEL, prompt="A person:", max_tokens=80, temperature=0,
                                           stream=True, extra_body={"guided_json": schema}):
        text += chunk.choices[0].text
    jsonschema.validate(json.loads(text), schema)


def test_logit_bias(server, client):
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=1)
    first = plain.choices[0].logprobs.tokens[0]
    first_id = httpx.post(server.url + "/tokenize", json={"prompt": first, "add_special_tokens": False}).json()
    assert first_id["count"] == 1
    banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=1,
                                       logit_bias={str(first_id["tokens"][0]): -100})
    assert banned.choices[0].logprobs.tokens[0] != first
    forced = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=1,
                                       logit_bias={"1234": 100}, extra_body={"ignore_eos": True})
    text = httpx.post(server.url + "/detokenize", json={"tokens": [1234]}).json()["prompt"]
    assert forced.choices[0].logprobs.tokens == [text] * 4


@pytest.mark.parametrize("body, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_grammar": "start: ???"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"logit_bias": {"999999": 5}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                                   "function": {"name": "g"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_structured_requests_are_400s_naming_the_field(client, body, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=5, extra_body=body)
    assert e.value.body["param"] == field, e.value.body


def test_constrained_greedy_output_is_the_same_alone_and_batched(server, client):
    """The grammar's rows of the bitmask are its own: beside unconstrained rows (and other
    grammars) a constrained greedy request writes what it writes alone. "Alone" is beside one
    unconstrained companion, whose steps the request may or may not share: rtp is deterministic
    by default (docs/determinism.md), so a request's bits do not depend on its steps' other rows
    (with --no-deterministic a one-row step took other kernels, and this test failed by timing)."""
    schema = openai.lib._pydantic.to_strict_json_schema(Review)
    prompts = ["Review a phone as JSON.", "Review a laptop.", "Review a hotel in Rome.", "Review the film Up."]

    def constrained(c, prompt):
        return c.chat.completions.create(model=MODEL, messages=ask(prompt), max_tokens=120, temperature=0,
                                         extra_body={"guided_json": schema})

    def companion(aclient):
        return aclient.completions.create(model=MODEL, prompt="Count from one to a thousand:", max_tokens=200,
                                          temperature=0, extra_body={"ignore_eos": True})

    def async_client() -> openai.AsyncOpenAI:  # one per asyncio.run: a client is bound to its event loop
        return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def alone(prompt):
        aclient = async_client()
        results = await asyncio.gather(companion(aclient), constrained(aclient, prompt))
        return results[1].choices[0].message.content

    async def batched():
        aclient = async_client()
        free = [aclient.chat.completions.create(model=MODEL, messages=ask(f"Tell me about {t}."), max_tokens=60,
                                                temperature=0.9 if t == "owls" else 0)
                for t in ("owls", "rivers", "tea")]
        results = await asyncio.gather(companion(aclient), *free, *(constrained(aclient, p) for p in prompts))
        return [r.choices[0].message.content for r in results[1 + len(free):]]

    want = [asyncio.run(alone(p)) for p in prompts]
    assert asyncio.run(batched()) == want
    for text in want:
        jsonschema.validate(json.loads(text), schema)


# -- tool calling ---------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 24},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["query"],
                   "properties": {"query": {"type": "string", "maxLength": 40}}}}}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
               r'"unit": "celsius"\}\}\n</tool_call>')


def check_calls(message, names=None):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed(client, **kwargs):
    with client.chat.completions.stream(model=MODEL, **kwargs) as stream:
        return stream.get_final_completion()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_required(client, stream):
    kwargs = dict(messages=ask("What is the weather in Paris?"), tools=TOOLS, tool_choice="required",
                  max_tokens=150, temperature=0)
    completion = streamed(client, **kwargs) if stream else client.chat.completions.create(model=MODEL, **kwargs)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_named(client, stream):
    kwargs = dict(messages=ask("Find me a cake recipe."), tools=TOOLS, max_tokens=100, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "search"}})
    completion = streamed(client, **kwargs) if stream else client.chat.completions.create(model=MODEL, **kwargs)
    message = completion.choices[0].message
    check_calls(message, ["search"])
    assert len(message.tool_calls) == 1 and not message.content


def test_streamed_call_sends_its_name_first_then_arguments_in_pieces(client):
    deltas = []
    for chunk in client.chat.completions.create(
            model=MODEL, messages=ask("What is the weather in Rome?"), tools=TOOLS, tool_choice="required",
            max_tokens=150, temperature=0, stream=True):
        for choice in chunk.choices:
            deltas.extend(choice.delta.tool_calls or [])
    first = deltas[0]
    assert first.id and first.type == "function" and first.function.name in SCHEMAS
    pieces = [d.function.arguments for d in deltas if d.index == 0 and d.function.arguments]
    assert len(pieces) > 1
    assert all(d.id is None and d.function.name is None for d in deltas[1:] if d.index == 0)
    jsonschema.validate(json.loads("".join(pieces)), SCHEMAS[first.function.name])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_parses_a_hermes_call_from_the_text(client, stream):
    kwargs = dict(messages=ask("What is the weather in Paris?"), tools=TOOLS, tool_choice="auto", max_tokens=80,
                  temperature=0, extra_body={"guided_regex": "Let me check. " + HERMES_CALL})
    completion = streamed(client, **kwargs) if stream else client.chat.completions.create(model=MODEL, **kwargs)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content.strip() == "Let me check."
    check_calls(choice.message, ["get_weather"])
    assert json.loads(choice.message.tool_calls[0].function.arguments)["unit"] == "celsius"


def test_auto_without_a_call_is_plain_content(client):
    completion = client.chat.completions.create(model=MODEL, messages=ask("Say hello."), tools=TOOLS,
                                                max_tokens=20, temperature=0)
    choice = completion.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_tool_choice_none_never_calls(client):
    completion = client.chat.completions.create(
        model=MODEL, messages=ask("Weather in Paris?"), tools=TOOLS, tool_choice="none", max_tokens=80,
        temperature=0, extra_body={"guided_regex": HERMES_CALL})
    choice = completion.choices[0]
    assert choice.message.tool_calls is None and "<tool_call>" in choice.message.content


def test_two_turn_conversation_with_a_tool_result(client, server):
    first = client.chat.completions.create(model=MODEL, messages=ask("What is the weather in Paris?"), tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           max_tokens=60, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    conversation = ask("What is the weather in Paris?") + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    rendered = httpx.post(server.url + "/tokenize", json={"messages": conversation}).json()
    text = httpx.post(server.url + "/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
    assert '"name": "get_weather"' in text and '"temperature": 21' in text and "<tool_response>" in text
    second = client.chat.completions.create(model=MODEL, messages=conversation, tools=TOOLS, max_tokens=30,
                                            temperature=0)
    assert second.choices[0].message.content
    assert second.usage.prompt_tokens > rendered["count"]  # and the tools, listed in the system turn
