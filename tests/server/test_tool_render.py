"""Tool calls through the server's renderer, streamed and whole, for every parser and tool_choice.

Texts mixing content and calls (valid ones, calls of functions not offered, arguments that are
not an object, JSON that never closes, markers and whitespace between calls) are cut into random
pieces and fed as engine updates through `ChatRender.write_chunks` (the SSE a client reads) and
through `ChatRender.add` + `response()` (the whole answer). What a client adds up from the stream
must be the whole answer: the same content (null in a whole answer of calls only), the same calls
(ids aside) and the same finish_reason. Where the text is built of known parts, the whole answer
must also be the one its parts call for.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rtp.server.async_engine import ChoiceDelta, Update
from rtp.server.render import ChatRender
from rtp.server.tools import plan_tools

OFFERED = ("get_weather", "search")
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}} for name in OFFERED]
TEMPLATE = "{% for t in tools %}{{ t }}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
CHOICES = {"hermes": "auto", "llama3_json": "auto", "mistral": "auto", "required": "required",
           "named": {"type": "function", "function": {"name": "get_weather"}}}


class Tokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return f"<{ids[0]}>"


def plan(parser: str):
    return plan_tools(TOOLS, CHOICES[parser], None, parser=parser if CHOICES[parser] == "auto" else None,
                      template=TEMPLATE, structured=False)


def updates(text: str, sizes: list[int], reason: str, logprobs: bool, apart: bool, index: int = 0) -> list[Update]:
    """The text as engine steps of the given sizes; the finish with the last piece or apart."""
    out, at = [], 0
    for size in sizes + [len(text)]:
        if at >= len(text):
            break
        piece, at = text[at:at + size], at + size
        out.append(Update(0, [ChoiceDelta(index, piece, 1, [{len(out): -0.5}] if logprobs else None)]))
    if apart or not out:
        out.append(Update(0, [ChoiceDelta(index, "", 0, None)]))
    out[-1].choices[0].finish_reason = reason
    return out


def new_render(parser: str, logprobs: bool, n: int = 1) -> ChatRender:
    return ChatRender("chatcmpl-1", "m", Tokenizer(), [[1, 2, 3]], n, top_logprobs=0 if logprobs else None,
                      tools=plan(parser))


def stream(render: ChatRender, steps: list[Update]) -> list[dict]:
    """What a client adds up from the SSE events, per choice: content, calls, finish_reason, and how
    many logprob entries came."""
    buf = bytearray(render.opening())
    for update in steps:
        render.write_chunks(update, buf)
    choices: dict[int, dict] = {}
    for event in bytes(buf).split(b"\n\n")[:-1]:
        assert event.startswith(b"data: ")
        for c in json.loads(event[6:])["choices"]:
            got = choices.setdefault(c["index"], {"content": "", "calls": [], "finish": None, "logprobs": 0})
            assert got["finish"] is None, "an event after the finish"
            delta = c["delta"]
            got["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                f = call["function"]
                if "id" in call:  # a call's first delta: its id, type and name
                    assert call["index"] == len(got["calls"]) and call["type"] == "function"
                    assert call["id"].startswith("call_") and f["arguments"] == ""
                    got["calls"].append([call["id"], f["name"], ""])
                else:  # then its arguments in pieces
                    assert call["index"] == len(got["calls"]) - 1 and "name" not in f
                    got["calls"][-1][2] += f["arguments"]
            got["finish"] = c["finish_reason"]
            got["logprobs"] += len((c.get("logprobs") or {}).get("content") or [])
    return [choices[i] for i in sorted(choices)]


def whole(render: ChatRender, steps: list[Update]):
    for update in steps:
        render.add(update)
    return render.response().choices


def check(parser: str, text: str, sizes: list[int], reason: str, logprobs: bool, apart: bool):
    """Streamed == whole; returns the whole answer's (content, [(name, arguments)], finish_reason)."""
    steps = updates(text, sizes, reason, logprobs, apart)
    (choice,) = whole(new_render(parser, logprobs), steps)
    (got,) = stream(new_render(parser, logprobs), updates(text, sizes, reason, logprobs, apart))
    message, calls = choice.message, [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert got["content"] == (message.content or "")
    assert message.content is not None or calls, "no content and no calls"
    assert [(name, arguments) for _, name, arguments in got["calls"]] == calls
    assert len({call_id for call_id, _, _ in got["calls"]}) == len(calls)
    assert got["finish"] == choice.finish_reason
    assert got["logprobs"] == sum(len(u.choices[0].logprobs or []) for u in steps)  # every token's, once
    for name, arguments in calls:
        assert name in OFFERED and isinstance(json.loads(arguments), dict)
    if not calls:
        assert message.content == text and choice.finish_reason == reason
    return message.content, calls, choice.finish_reason


# -- texts built of known parts, with the answer they call for --------------------------------------

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(
    max_size=6)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=4), inner, max_size=3), max_leaves=8)
objects = st.dictionaries(st.text(max_size=6), values, max_size=4)
spaces = st.sampled_from(["", " ", "\n", "\n\n", " \n "])
prose = st.text(alphabet="ab .!?\n\t", max_size=8)  # no character that opens a marker or a call
KINDS = ["valid", "valid", "valid", "no_arguments", "string_arguments", "extra_key", "not_offered", "not_an_object",
         "both_keys", "name_twice"]


@st.composite
def calls(draw, key: str):
    """(a call's JSON as a model might write it, (its name, its arguments) if it is a call, else None)"""
    separators = draw(st.sampled_from([(", ", ": "), (",", ":"), (",\n  ", ": ")]))
    ascii_only = draw(st.booleans())

    def dump(value) -> str:
        return json.dumps(value, ensure_ascii=ascii_only, separators=separators)

    kind, key = draw(st.sampled_from(KINDS)), draw(st.sampled_from([key, "arguments", "parameters"]))
    name, arguments = draw(st.sampled_from(OFFERED)), dump(draw(objects))
    members, expected = [("name", dump(name))], (name, arguments)
    if kind == "valid":
        members.append((key, arguments))
    elif kind == "no_arguments":
        expected = (name, "{}")
    elif kind == "string_arguments":  # arguments as a JSON string: sent decoded
        members.append((key, dump(arguments)))
    elif kind == "extra_key":
        members += [("type", dump("function")), (key, arguments)]
    else:
        expected = None
        if kind == "not_offered":
            members = [("name", dump("drop_tables")), (key, arguments)]
        elif kind == "not_an_object":
            members.append((key, draw(st.sampled_from(["null", "[1, 2]", "3", "true", '"x"', '"[1]"', '"{oops"']))))
        elif kind == "both_keys":
            members += [("arguments", arguments), ("parameters", arguments)]
        else:
            members += [(key, arguments), ("name", dump(name))]
    members = draw(st.permutations(members))
    return "{" + separators[0].join(dump(k) + separators[1] + v for k, v in members) + "}", expected


def cut(draw, text: str) -> str:
    """The text cut off before its JSON closes (max_tokens)."""
    return text[:draw(st.integers(0, len(text) - 1))]


class Answer:
    """A text built part by part, and the answer it calls for: its calls up to the first that is
    none; from there on, all is content."""

    def __init__(self):
        self.text, self.content, self.calls, self.failed = "", "", [], None

    def prose(self, text: str) -> None:
        if self.failed is None:
            self.content += text
        self.text += text

    def calls_in(self, text: str, expected: list | None, content: str = "") -> None:
        """Text holding calls: all of `expected` (less `content`, which is content), or (None) none."""
        if self.failed is None:
            if expected is None:
                self.failed = len(self.text)
            else:
                self.calls += expected
                self.content += content
        self.text += text

    def result(self):
        content = self.content + (self.text[self.failed:] if self.failed is not None else "")
        return self.text, None if self.calls and not content.strip() else content, self.calls


def all_or_none(group: list) -> list | None:
    return [expected for _, expected in group] if group and all(e for _, e in group) else None


@st.composite
def hermes(draw):
    a = Answer()
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.booleans()):
            a.prose(draw(prose))
            continue
        call, expected = draw(calls("arguments"))
        ended = draw(st.booleans()) or draw(st.booleans())  # the end marker may be left out
        after = draw(spaces)  # left out, the space after the JSON is content
        a.calls_in("<tool_call>" + draw(spaces) + call + after + ("</tool_call>" if ended else ""),
                   [expected] if expected else None, "" if ended else after)
    if draw(st.booleans()):  # cut off in a call
        a.calls_in("<tool_call>" + draw(spaces) + cut(draw, draw(calls("arguments"))[0]), None)
    return a.result()


@st.composite
def mistral(draw):
    a = Answer()
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):
            a.prose(draw(prose))
            continue
        group = draw(st.lists(calls("arguments"), max_size=3))
        a.calls_in("[TOOL_CALLS]" + draw(spaces) + "[" + draw(spaces) + ", ".join(c for c, _ in group) + "]",
                   all_or_none(group))
    if draw(st.booleans()):  # cut off in the array, or no "]"
        group = draw(st.lists(calls("arguments"), min_size=1, max_size=2))
        a.calls_in("[TOOL_CALLS]" + draw(spaces) + cut(draw, "[" + ", ".join(c for c, _ in group) + "]"), None)
    return a.result()


@st.composite
def llama3_json(draw):
    a = Answer()
    if draw(st.integers(0, 5)) == 0:  # prose first: no calls
        a.prose(draw(prose.filter(str.strip)) + draw(calls("parameters"))[0])
        return a.result()
    start = draw(spaces) + draw(st.sampled_from(["", "<|python_tag|>"])) + draw(spaces)
    for i in range(draw(st.integers(1, 3))):
        call, expected = draw(calls("parameters"))
        a.calls_in((draw(spaces) + ";" + draw(spaces) if i else start) + call, [expected] if expected else None)
    if draw(st.booleans()):  # cut off in a call
        a.calls_in(draw(spaces) + ";" + draw(spaces) + cut(draw, draw(calls("parameters"))[0]), None)
    else:
        a.prose(draw(prose))
    return a.result()


@st.composite
def required(draw):
    a = Answer()
    group = draw(st.lists(calls("parameters"), max_size=3))
    array = "[" + ",".join(c for c, _ in group) + "]"
    if draw(st.booleans()):
        a.calls_in(draw(spaces) + cut(draw, array), None)
    else:
        a.calls_in(draw(spaces) + array, all_or_none(group))
    a.prose(draw(spaces))
    return a.result()


@st.composite
def named(draw):
    a = Answer()
    arguments = json.dumps(draw(objects), separators=draw(st.sampled_from([(", ", ": "), (",", ":")])))
    kind = draw(st.sampled_from(["valid", "valid", "cut", "not_an_object"]))
    if kind == "cut":
        arguments = cut(draw, arguments)
    elif kind == "not_an_object":
        arguments = draw(st.sampled_from(["null", "[]", "3", '"{}"', "{} {}"]))
    a.calls_in(draw(spaces) + arguments, [("get_weather", arguments)] if kind == "valid" else None)
    a.prose(draw(spaces))
    return a.result()


BUILT = {"hermes": hermes(), "mistral": mistral(), "llama3_json": llama3_json(), "required": required(),
         "named": named()}
sizes = st.lists(st.integers(1, 9), max_size=80)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), parser=st.sampled_from(sorted(BUILT)), sizes=sizes, logprobs=st.booleans(),
       apart=st.booleans())
def test_built_texts_streamed_and_whole(data, parser, sizes, logprobs, apart):
    text, content, expected = data.draw(BUILT[parser])
    got = check(parser, text, sizes, "stop", logprobs, apart)
    assert got == (content, expected, "tool_calls" if expected else "stop")


# -- any text: streamed == whole ------------------------------------------------------------------

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "call>", "[TOOL_CALLS]", "[TOOL_", "<|python_tag|>", "<|python",
             CALL, "[" + CALL + "]", '{"name": "drop_tables", "parameters": {}}', '{"name": "search"',
             ', "parameters": ', ', "arguments": ', "null", "[1]", '"{}"', "{", "}", "[", "]", '"', "\\", ":", ",", ";",
             " ", "\n", "\n\n", "x", "é", "{}", '"a"', "1"]


@settings(max_examples=500, deadline=None)
@given(parts=st.lists(st.sampled_from(FRAGMENTS), max_size=30), sizes=sizes,
       parser=st.sampled_from(sorted(CHOICES)), reason=st.sampled_from(["stop", "length"]), logprobs=st.booleans(),
       apart=st.booleans())
def test_any_text_streamed_and_whole(parts, sizes, parser, reason, logprobs, apart):
    check(parser, "".join(parts), sizes, reason, logprobs, apart)


# -- the bugs, one by one -------------------------------------------------------------------------

@pytest.mark.parametrize("size", [1, 4, 1000])
@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>{"name": "drop_tables", "arguments": {}}</tool_call>'),
    ("llama3_json", '{"name": "drop_tables", "parameters": {}}'),
    ("mistral", '[TOOL_CALLS][{"name": "drop_tables", "arguments": {}}]'),
    ("required", '[{"name": "drop_tables", "parameters": {}}]'),
    ("hermes", '<tool_call>{"name": "search", "arguments": null}</tool_call>'),
    ("llama3_json", '{"name": "search", "parameters": null}'),
    ("mistral", '[TOOL_CALLS][{"name": "search", "arguments": [1]}]'),
    ("required", '[{"name": "search", "parameters": "3"}]'),
    ("named", "null"),
    ("mistral", '[TOOL_CALLS][{"name": "search", "arguments": {}}'),
    ("hermes", '<tool_call>{"name": "search", "arguments": {"q": "x"}'),
    ("required", '[{"name": "search", "parameters": {}}'),
    ("named", '{"q": "cake"'),
])
def test_what_is_no_call_is_content_streamed_and_whole(parser, text, size):
    assert check(parser, text, [size] * len(text), "stop", False, False) == (text, [], "stop")


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_no_newline_between_parallel_calls(size):
    call = '<tool_call>\n{"name": "search", "arguments": {"q": "%s"}}\n</tool_call>'
    text = "\n".join(call % q for q in ("cake", "pie")) + "\n"
    render = new_render("hermes", False)
    buf = bytearray()
    for update in updates(text, [size] * len(text), "stop", False, False):
        render.write_chunks(update, buf)
    assert b'"content"' not in buf
    assert check("hermes", text, [size] * len(text), "stop", False, False) == (
        None, [("search", '{"q": "cake"}'), ("search", '{"q": "pie"}')], "tool_calls")


def test_a_call_goes_out_once_it_is_known_then_its_arguments_in_pieces():
    text = '<tool_call>{"name": "search", "arguments": {"query": "cake recipes"}}</tool_call>'
    steps = updates(text, [5] * len(text), "stop", True, False)
    closing = (text.index("}}") + 1) // 5  # the step whose text closes the call's JSON
    render, buf, sent = new_render("hermes", True), bytearray(), []
    for update in steps:
        render.write_chunks(update, buf)
        sent.append([json.loads(e[6:])["choices"][0] for e in bytes(buf).split(b"\n\n")[:-1]])
        buf.clear()
    assert all([bool(c["logprobs"]) for c in events][:1] == [True] and sum(bool(c["logprobs"]) for c in events) == 1
               for events in sent)  # every step's logprobs, once, held back or not
    assert all(c["logprobs"] and not c["delta"] for events in sent[:closing] for c in events)  # held back
    deltas = [call for c in sent[closing] for call in c["delta"].get("tool_calls") or []]
    assert deltas[0]["function"] == {"name": "search", "arguments": ""} and deltas[0]["id"]
    pieces = [d["function"]["arguments"] for d in deltas[1:]]
    assert len(pieces) > 3 and "".join(pieces) == '{"query": "cake recipes"}'  # in the pieces they came in
    assert [c["finish_reason"] for c in sent[-1]] == ["tool_calls"]


def test_two_choices_each_their_own():
    call = '<tool_call>{"name": "search", "arguments": {"q": 1}}</tool_call>'
    steps = [Update(0, [ChoiceDelta(0, call[:9], 1, None), ChoiceDelta(1, "Hi ", 1, None)]),
             Update(0, [ChoiceDelta(0, call[9:], 1, None, "stop"), ChoiceDelta(1, call, 1, None, "length")])]
    got = stream(new_render("hermes", False, n=2), steps)
    choices = whole(new_render("hermes", False, n=2), steps)
    assert [(g["content"], [c[1:] for c in g["calls"]], g["finish"]) for g in got] == [
        ("", [["search", '{"q": 1}']], "tool_calls"), ("Hi ", [["search", '{"q": 1}']], "length")]
    assert [(c.message.content, c.finish_reason) for c in choices] == [(None, "tool_calls"), ("Hi ", "length")]
