"""The tool-call parsers on recorded model texts (in each model family's own format), fed whole
and in pieces of every size: the pieces add up to what the whole text parses to, a call goes out
only once it is known to be one, name first. What is no call (a function not offered, arguments
that are not an object, JSON that never closes) stays content, as written. And
rtp/server/tools.py's checks of tools and tool_choice. (tests/server/test_tool_render.py feeds
random texts through the server's renderer, streamed and whole.)"""

from __future__ import annotations

import json

import pytest

from rtp.errors import InvalidRequest
from rtp.server.tool_parsers import (
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
from rtp.server.tools import plan_tools

OFFERED = ["get_current_temperature", "get_stock", "run", "get_weather", "a", "b", "get_current_weather", "f", "g",
           "search"]

# (parser, text as a model wrote it, content expected, [(name, arguments)] expected)
RECORDED = [
    # Qwen2.5-7B-Instruct, one call
    (HermesParser, '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, '
                   'USA", "unit": "celsius"}}\n</tool_call>',
     None, [("get_current_temperature", {"location": "San Francisco, CA, USA", "unit": "celsius"})]),
    # Hermes-2-Pro, text first and two calls: the content as written, less the calls
    (HermesParser, 'I will look both up.\n<tool_call>\n{"arguments": {"symbol": "AAPL"}, "name": "get_stock"}\n'
                   '</tool_call>\n<tool_call>\n{"name": "get_stock", "arguments": {"symbol": "MSFT"}}\n</tool_call>',
     "I will look both up.\n\n", [("get_stock", {"symbol": "AAPL"}), ("get_stock", {"symbol": "MSFT"})]),
    # two calls and the newlines between them: no content
    (HermesParser, '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", '
                   '"arguments": {"x": 1}}\n</tool_call>\n',
     None, [("a", {}), ("b", {"x": 1})]),
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
    # Mistral, arguments as a JSON string (sent decoded), no parameters in the second call
    (MistralParser, '[TOOL_CALLS][{"name": "f", "arguments": "{\\"k\\": 2}"}, {"name": "g"}]', None,
     [("f", {"k": 2}), ("g", {})]),
    # the grammar's format for tool_choice "required"
    (RequiredCallsParser, '[{"name": "search", "parameters": {"query": "cake"}}, {"name": "search", "parameters": '
                          '{"query": "pie"}}]', None,
     [("search", {"query": "cake"}), ("search", {"query": "pie"})]),
]


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


def streamed(parser, text: str, size: int) -> list:
    return [e for piece in pieces(text, size) for e in parser.feed(piece)] + parser.finish()


@pytest.mark.parametrize("parser, text, content, calls", RECORDED)
def test_whole_text(parser, text, content, calls):
    parsed = parser(OFFERED).parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert len({c.id for c in parsed.calls}) == len(calls)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("parser, text, content, calls", RECORDED)
def test_pieces_add_up_and_names_come_first(parser, text, content, calls, size):
    events = streamed(parser(OFFERED), text, size)
    started = set()
    for e in events:
        if isinstance(e, CallStart):
            started.add(e.index)
        elif isinstance(e, CallArguments):
            assert e.index in started, "arguments before the call's name"
    parsed = assemble(events)  # what a client assembling the stream gets
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert parsed.content == content


def test_streamed_arguments_go_out_in_the_pieces_they_came_in():
    p = HermesParser(["f"])
    text = '<tool_call>{"name": "f", "arguments": {"a": "long value", "b": [1, 2, 3]}}</tool_call>'
    events = [p.feed(piece) for piece in pieces(text, 4)]
    close = text.index("}}") + 2
    assert not any(events[:(close - 1) // 4]), "sent before its JSON closed"
    events = [e for batch in events for e in batch] + p.finish()
    args = [e.text for e in events if isinstance(e, CallArguments)]
    assert isinstance(events[0], CallStart) and events[0].name == "f"
    assert len(args) > 3 and "".join(args) == '{"a": "long value", "b": [1, 2, 3]}'


# -- what is no call stays content, exactly as written ----------------------------------------------

NOT_CALLS = [
    # a function that was not offered
    (HermesParser, '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'),
    (Llama3JsonParser, '{"name": "rm_rf", "parameters": {}}'),
    (MistralParser, '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "rm_rf", "arguments": {}}]'),
    (RequiredCallsParser, '[{"name": "rm_rf", "parameters": {}}]'),
    # arguments that are not an object
    (HermesParser, '<tool_call>{"name": "f", "arguments": null}</tool_call>'),
    (HermesParser, '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>'),
    (HermesParser, '<tool_call>{"name": "f", "arguments": 3}</tool_call>'),
    (HermesParser, '<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>'),
    (HermesParser, '<tool_call>{"name": "f", "arguments": "[1]"}</tool_call>'),
    (HermesParser, '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'),
    (Llama3JsonParser, '{"name": "f", "parameters": null}'),
    (MistralParser, '[TOOL_CALLS][{"name": "f", "arguments": true}]'),
    (RequiredCallsParser, '[{"name": "f", "parameters": "null"}]'),
    # a name that is not a string, no name, the name twice, both argument keys
    (HermesParser, '<tool_call>{"name": 1, "arguments": {}}</tool_call>'),
    (HermesParser, '<tool_call>{"arguments": {}}</tool_call>'),
    (HermesParser, '<tool_call>{"name": "f", "name": "g", "arguments": {}}</tool_call>'),
    (Llama3JsonParser, '{"name": "f", "arguments": {}, "parameters": {}}'),
    # JSON that never closes
    (MistralParser, '[TOOL_CALLS][{"name": "f", "arguments": {}}'),
    (MistralParser, '[TOOL_CALLS][{"name": "f", "arguments": {}},'),
    (MistralParser, "[TOOL_CALLS]"),
    (HermesParser, '<tool_call>{"name": "f", "arguments": {}'),
    (HermesParser, '<tool_call>\n'),
    (Llama3JsonParser, '<|python_tag|>{"name": "f", "parameters": {"s": "}"}'),
    (RequiredCallsParser, '[{"name": "f", "parameters": {}}'),
    # JSON that is not a call, or broken
    (MistralParser, "[TOOL_CALLS][]"),
    (MistralParser, '[TOOL_CALLS][{"name": "f", "arguments": {}}, 1]'),
    (MistralParser, '[TOOL_CALLS][{"name": "f", "arguments": {}},]'),
    (HermesParser, '<tool_call>{"name": "f" "arguments": {}}</tool_call>'),
    (HermesParser, '<tool_call>{"name": "f", "arguments": {}]</tool_call>'),
    (HermesParser, '<tool_call>["f"]</tool_call>'),
    (Llama3JsonParser, '{"city": "Paris"}'),
]


@pytest.mark.parametrize("size", [1, 3, 1000])
@pytest.mark.parametrize("parser, text", NOT_CALLS)
def test_what_is_no_call_stays_content(parser, text, size):
    for events in (streamed(parser(["f", "g"]), text, len(text) + 1), streamed(parser(["f", "g"]), text, size)):
        assert not any(isinstance(e, (CallStart, CallArguments)) for e in events)
        assert "".join(e.text for e in events) == text
    assert parser(["f", "g"]).parse("Hello. " + text).content == "Hello. " + text


def test_after_a_call_that_is_none_the_rest_is_content():
    text = ('<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "h", "arguments": {}}'
            '</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    parsed = HermesParser(["f", "g"]).parse(text)
    assert [c.name for c in parsed.calls] == ["f"]
    assert parsed.content == text[text.index("</tool_call>") + len("</tool_call>"):]


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_llama3_calls_open_the_reply_or_there_are_none(size):
    call = '{"name": "f", "parameters": {}}'
    for text in ["Hi " + call, "Hi <|python_tag|>" + call, call + " Hi; " + call, call + call,
                 "\n<|python_tag|> x" + call]:
        parsed, whole = assemble(streamed(Llama3JsonParser(["f"]), text, size)), Llama3JsonParser(["f"]).parse(text)
        assert parsed.content == whole.content and len(parsed.calls) == len(whole.calls)
        assert len(parsed.calls) == (text.startswith("{") or text.startswith("\n<|python_tag|>{")), text
    parsed = Llama3JsonParser(["f"]).parse("\n\n" + call + " ;\n" + call + "\n")
    assert parsed.content is None and len(parsed.calls) == 2


@pytest.mark.parametrize("parser, text, arguments", [
    (HermesParser, '<tool_call>{"name": "f", "arguments": "{\\"k\\": [1]}"}</tool_call>', '{"k": [1]}'),
    (MistralParser, '[TOOL_CALLS][{"name": "f", "arguments": " {} "}]', " {} "),
    (Llama3JsonParser, '{"name": "f", "type": "function", "parameters": {"a":1}}', '{"a":1}'),
    (HermesParser, '<tool_call>{"name": "f"}</tool_call>', "{}"),
])
def test_arguments_as_written_or_decoded_from_a_string(parser, text, arguments):
    parsed = parser(["f"]).parse(text)
    assert parsed.content is None and [(c.name, c.arguments) for c in parsed.calls] == [("f", arguments)]


def test_whitespace_alone_is_content_when_there_is_no_call():
    assert HermesParser(["f"]).parse("\n \n").content == "\n \n"
    assert HermesParser(["f"]).parse("").content == ""
    p = HermesParser(["f"])
    assert p.feed("\n") == [] and p.feed("Hi") == [Content("\nHi")]


@pytest.mark.parametrize("text, arguments", [('{"a": 1}', '{"a": 1}'), (' {"a": {"b": []}}\n', '{"a": {"b": []}}'),
                                             ('{"a": 1', None), ('[1]', None), ('{"a": 1} {', None), ("", None)])
def test_named_call_is_the_whole_reply(text, arguments):
    p = NamedCallParser("f")
    events = [e for piece in pieces(text, 2) for e in p.feed(piece)]
    assert events == []  # held back to the end
    events += p.finish()
    parsed = NamedCallParser("f").parse(text)
    assert assemble(events).content == parsed.content and [c.arguments for c in parsed.calls] == (
        [arguments] if arguments else [])
    if arguments is None:
        assert parsed.content == text
    else:
        assert isinstance(events[0], CallStart) and events[0].name == "f"
        assert len(events) > 2 or len(text) <= 2  # the arguments in the pieces they came in


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
