"""The tool-call parsers on recorded model texts (in each model family's own format), fed whole
and in pieces of every size: the pieces must add up to what the whole text parses to, and a
call's name must come before its arguments. And rtp/serve/tools.py's checks of tools and
tool_choice."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rtp.errors import InvalidRequest
from rtp.serve.tool_parsers import (
    CallArguments,
    CallStart,
    Content,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedCallParser,
    RequiredCallsParser,
    assemble,
)
from rtp.serve.tools import message_tool_calls, plan_tools

# (parser, text as a model wrote it, content expected, [(name, arguments)] expected)
RECORDED = [
    # Qwen2.5-7B-Instruct, one call
    (HermesParser, '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, '
                   'USA", "unit": "celsius"}}\n</tool_call>',
     None, [("get_current_temperature", {"location": "San Francisco, CA, USA", "unit": "celsius"})]),
    # Hermes-2-Pro, text first and two calls
    (HermesParser, 'I will look both up.\n<tool_call>\n{"arguments": {"symbol": "AAPL"}, "name": "get_stock"}\n'
                   '</tool_call>\n<tool_call>\n{"name": "get_stock", "arguments": {"symbol": "MSFT"}}\n</tool_call>',
     "I will look both up.\n", [("get_stock", {"symbol": "AAPL"}), ("get_stock", {"symbol": "MSFT"})]),
    # nested arguments with braces and escaped quotes inside strings
    (HermesParser, '<tool_call>{"name": "run", "arguments": {"code": "print(\\"}{\\")", "args": [1, {"a": []}]}}'
                   '</tool_call>',
     None, [("run", {"code": 'print("}{")', "args": [1, {"a": []}]})]),
    # no call at all, with angle brackets that are not a marker
    (HermesParser, "Use a < b and <tool> tags; no call here.", "Use a < b and <tool> tags; no call here.", []),
    # a call cut off by max_tokens: the text stays content
    (HermesParser, 'Sure <tool_call>\n{"name": "f", "arguments": {"x": 1', 'Sure <tool_call>\n{"name": "f", '
                                                                         '"arguments": {"x": 1', []),
    # not JSON inside the markers
    (HermesParser, "<tool_call>call f with x=1</tool_call>", "<tool_call>call f with x=1</tool_call>", []),
    # Llama-3.1-8B-Instruct, JSON reply
    (Llama3JsonParser, '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),
    # Llama 3.2 with <|python_tag|> and two calls separated by ";"
    (Llama3JsonParser, '<|python_tag|>{"name": "a", "parameters": {"n": 1}}; {"name": "b", "parameters": {}}', None,
     [("a", {"n": 1}), ("b", {})]),
    # Llama 3 answering in prose that mentions JSON later
    (Llama3JsonParser, 'The answer is {"name": "x"} in JSON.', 'The answer is {"name": "x"} in JSON.', []),
    # Mistral-7B-Instruct-v0.3
    (MistralParser, '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
                    '"format": "celsius"}}]',
     None, [("get_current_weather", {"location": "Paris, France", "format": "celsius"})]),
    # Mistral, arguments as a JSON string, no parameters in the second call
    (MistralParser, '[TOOL_CALLS][{"name": "f", "arguments": "{\\"k\\": 2}"}, {"name": "g"}]', None,
     [("f", {"k": 2}), ("g", {})]),
    # the grammar's format for tool_choice "required"
    (RequiredCallsParser, '[{"name": "search", "parameters": {"query": "cake"}}, {"name": "search", "parameters": '
                          '{"query": "pie"}}]', None,
     [("search", {"query": "cake"}), ("search", {"query": "pie"})]),
]


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


@pytest.mark.parametrize("parser, text, content, calls", RECORDED)
def test_whole_text(parser, text, content, calls):
    parsed = parser().parse(text)
    assert (parsed.content is None) == (content is None)
    assert (parsed.content or "").strip() == (content or "").strip()
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert len({c.id for c in parsed.calls}) == len(calls)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("parser, text, content, calls", RECORDED)
def test_pieces_add_up_and_names_come_first(parser, text, content, calls, size):
    p = parser()
    events = [e for piece in pieces(text, size) for e in p.feed(piece)] + p.finish()
    started = set()
    for e in events:
        if isinstance(e, CallStart):
            started.add(e.index)
        elif isinstance(e, CallArguments):
            assert e.index in started, "arguments before the call's name"
    parsed = assemble(events, text)  # what a client assembling the stream gets
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert (parsed.content or "").strip() == (content or "").strip()
    if not started:  # no call begun: every character shown once, nothing held back
        assert "".join(e.text for e in events if isinstance(e, Content)) == text


def test_streamed_arguments_arrive_in_pieces():
    p = HermesParser()
    text = '<tool_call>{"name": "f", "arguments": {"a": "long value", "b": [1, 2, 3]}}</tool_call>'
    events = [e for piece in pieces(text, 4) for e in p.feed(piece)] + p.finish()
    args = [e.text for e in events if isinstance(e, CallArguments)]
    assert len(args) > 3 and "".join(args) == '{"a": "long value", "b": [1, 2, 3]}'


def test_named_call_is_the_whole_reply():
    p = NamedCallParser("f")
    events = p.feed('{"a"') + p.feed(": 1}") + p.finish()
    assert isinstance(events[0], CallStart) and events[0].name == "f"
    assert "".join(e.text for e in events[1:]) == '{"a": 1}'
    assert p.parse('{"a": 1}').calls[0].arguments == '{"a": 1}'


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
WITH_TOOLS = "{% for t in tools %}{{ t }}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
WITHOUT = "{% for m in messages %}{{ m.content }}{% endfor %}"


def plan(tools=(TOOL,), tool_choice=None, parallel=None, parser="hermes", template=WITH_TOOLS, structured=False):
    return plan_tools(list(tools) if tools is not None else None, tool_choice, parallel, parser=parser,
                      template=template, structured=structured)


def test_plans():
    assert plan(tools=None) is None and plan(tools=[], tool_choice="none") is None
    assert plan().choice == "auto" and plan().grammar is None
    required = plan(tool_choice="required", parser=None)
    assert required.grammar.json["minItems"] == 1 and "maxItems" not in required.grammar.json
    assert plan(tool_choice="required", parallel=False).grammar.json["maxItems"] == 1
    named = plan(tool_choice={"type": "function", "function": {"name": "f"}}, parser=None)
    assert named.choice == "named" and named.grammar.json == {"type": "object"}
    assert plan(tool_choice="none", parser=None).new_parser() is None


@pytest.mark.parametrize("kwargs, says", [
    (dict(parser=None), "--tool-call-parser"),
    (dict(template=WITHOUT), "--chat-template"),
    (dict(tools=None, tool_choice="auto"), "needs tools"),
    (dict(tool_choice="always"), "tool_choice must be"),
    (dict(tool_choice={"type": "function", "function": {"name": "g"}}), "not among the tools"),
    (dict(tools=[TOOL, TOOL]), "two functions"),
    (dict(tools=[{"type": "retrieval"}]), "tools[0]"),
    (dict(tool_choice="required", structured=True), "give one"),
    (dict(parallel="yes"), "parallel_tool_calls"),
])
def test_bad_tool_requests(kwargs, says):
    with pytest.raises(InvalidRequest, match=says.replace("[", r"\[")):
        plan(**kwargs)


def test_assistant_calls_render_with_object_arguments():
    calls = message_tool_calls(1, [{"id": "c", "type": "function",
                                    "function": {"name": "f", "arguments": '{"a": 1}'}}])
    assert calls == [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]
    with pytest.raises(InvalidRequest, match="not JSON"):
        message_tool_calls(1, [{"function": {"name": "f", "arguments": "{oops"}}])


# -- any text, any pieces: the parsers never raise, and streaming agrees with the whole --------------

_FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "[TOOL_CALLS]", "<|python_tag|>", '{"name": "f"', ', "arguments": ',
              '"parameters": ', "{", "}", "[", "]", '"', "\\", ":", ",", ";", " ", "\n", "x", "é", "{}", '"a"', "1"]


@given(parts=st.lists(st.sampled_from(_FRAGMENTS), max_size=30), cuts=st.lists(st.integers(1, 7), max_size=40),
       parser=st.sampled_from([HermesParser, Llama3JsonParser, MistralParser, RequiredCallsParser]))
def test_any_text_in_any_pieces(parts, cuts, parser):
    text = "".join(parts)
    whole = parser().parse(text)
    p, events, at = parser(), [], 0
    for cut in cuts:
        events += p.feed(text[at:at + cut])
        at += cut
    events += p.feed(text[at:]) + p.finish()
    streamed = assemble(events, text)
    if whole.calls:  # what the whole text parses to, a client assembling the stream gets too
        assert [(c.name, c.arguments) for c in streamed.calls] == [(c.name, c.arguments) for c in whole.calls]
    if not any(isinstance(e, CallStart) for e in events):
        assert "".join(e.text for e in events if isinstance(e, Content)) == text
