"""A model's text -> tool calls, as the text arrives (`--tool-call-parser`).

Models write their calls in their own formats:

    hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call>  (Hermes, Qwen 2.5/3, the
                 ChatML template rtp ships)
    llama3_json  {"name": "f", "parameters": {...}}  the whole reply, after an optional <|python_tag|>;
                 several calls separated by ";" (Llama 3.1/3.2/3.3)
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]  (Mistral's v3 format)

and for tool_choice "required" or a named function rtp's grammar writes them (rtp/server/tools.py):
a JSON array of {"name", "parameters"} objects, or the named function's arguments alone.

A call is a call only if its JSON closes (all of a Mistral or `required` array), its name is one of
the functions offered, and its arguments (under "arguments" or "parameters"; neither: {}) are a
JSON object, or a JSON string holding one, as some models write them: sent decoded. Anything else,
from the marker that opened it to the end of the reply, is content as the model wrote it.

Each parser reads one choice's text piece by piece (`feed`, then `finish`) and returns events:
content to show, a call's start (its index, id and name) and pieces of its arguments' JSON. The
server turns the events into OpenAI's streamed deltas and a whole response (`parse`) adds up the
events of the whole text, so a stream and a whole response agree however the text was cut up:

- a call is held back until it is known to be one (its JSON closed and checked); then its start
  goes out, then its arguments in the pieces the model wrote them in, as OpenAI streams them;
- content that is only whitespace is held back until other content follows: a reply of calls only
  has no content (null), so the newlines between parallel calls are no content either;
- after text that is not a call, llama3_json and `required` read no more calls (their calls open
  the reply), and after a call that is not one, no parser does.

Where a call's JSON closes is found by scanning it one character at a time (only the calls' text
pays for it); then it is decoded once, and its arguments are sent as the model wrote them.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class Content:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class CallArguments:
    index: int
    text: str


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass
class Parsed:
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _NotACall(Exception):
    pass


def _no_constant(name: str):
    raise ValueError(name)  # NaN and Infinity: Python reads them, JSON has none


_DECODER = json.JSONDecoder(parse_constant=_no_constant)
_SPACE = re.compile(r"[ \t\n\r]*")


def _space(text: str, at: int) -> int:
    return _SPACE.match(text, at).end()


def _value(text: str, at: int):
    """The JSON value that starts at text[at], and where it ends."""
    try:
        return _DECODER.raw_decode(text, at)
    except (ValueError, RecursionError):
        raise _NotACall from None


def _members(text: str, at: int) -> tuple[dict, int]:
    """The JSON object at text[at] as {key: (value, where it starts, where it ends)}, and its end."""
    members: dict = {}
    at = _space(text, at + 1)
    if text.startswith("}", at):
        return members, at + 1
    while True:
        if not text.startswith('"', at):
            raise _NotACall
        key, at = _value(text, at)
        at = _space(text, at)
        if not text.startswith(":", at):
            raise _NotACall
        start = _space(text, at + 1)
        value, at = _value(text, start)
        if key in members:
            raise _NotACall  # a key twice: which value was meant is anyone's guess
        members[key] = (value, start, at)
        at = _space(text, at)
        if text.startswith("}", at):
            return members, at + 1
        if not text.startswith(",", at):
            raise _NotACall
        at = _space(text, at + 1)


def _pieces(text: str, cuts: list[int], start: int, end: int) -> list[str]:
    """text[start:end] cut where the pieces fed ended (`cuts`, ascending)."""
    out = []
    for cut in cuts:
        if start < cut < end:
            out.append(text[start:cut])
            start = cut
    out.append(text[start:end])
    return out


class _Value:
    """The JSON object or array after a call's marker, held as it arrives until it closes. Each
    piece is scanned once, on arrival, and the pieces are joined once, when asked for."""

    def __init__(self, opening: str):
        self.opening = opening
        self.start = self.end = -1  # where it opens, and where it closed (-1: not yet)
        self.cuts: list[int] = []   # where each piece fed ended
        self._parts: list[str] = []
        self._depth = 0
        self._in_string = self._escape = False

    @property
    def text(self) -> str:
        if len(self._parts) != 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0]

    @property
    def rest(self) -> str:
        return self.text[self.end:]

    def feed(self, text: str) -> bool:
        """Add text; True once the value has closed. _NotACall if it opens with anything else."""
        base = self.cuts[-1] if self.cuts else 0
        self._parts.append(text)
        self.cuts.append(base + len(text))
        depth, in_string, escape = self._depth, self._in_string, self._escape
        for i, c in enumerate(text):
            if depth == 0:
                if c == self.opening:
                    depth, self.start = 1, base + i
                elif c not in " \t\r\n":
                    raise _NotACall
            elif in_string:
                if escape:
                    escape = False
                elif c == "\\":
                    escape = True
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c == "{" or c == "[":
                depth += 1
            elif c == "}" or c == "]":
                depth -= 1
                if depth == 0:
                    self.end = base + i + 1
                    return True
        self._depth, self._in_string, self._escape = depth, in_string, escape
        return False


class ToolParser:
    """One choice's text -> content and tool calls (the format's subclass says where calls are)."""

    name = ""
    start = ""                 # the marker before a call (at_start: optional)
    end = ""                   # the marker after a call, if any (optional)
    array = False              # a call marker opens an array of calls, not one
    separator = ""             # between consecutive calls without markers (llama3_json: ";")
    argument_keys: tuple[str, ...] = ("arguments", "parameters")
    at_start = False           # the calls open the reply, or there are none

    def __init__(self, functions: Iterable[str]):
        self.functions = frozenset(functions)  # the names a call may have
        self.opening = "[" if self.array else "{"
        self.pending = ""      # text not placed yet: it may be (the start of) a marker
        self.value: _Value | None = None  # the call(s) being read, held back until known
        self.marker = ""       # the text that opened them (content if they are no calls)
        self.calls = 0         # calls sent
        self.awaiting_end = False
        self.aside: list[str] = []  # whitespace and markers that may open or close a call
        self.led = False       # the marker that opens the next call (at_start) is among them
        self.text_only = False  # the rest of the reply is content
        self.space: list[str] = []  # content of only whitespace so far, held back
        self.shown = False     # content other than whitespace was sent

    def feed(self, text: str) -> list:
        events: list = []
        if self.text_only:
            self._content(events, text)
        else:
            self.pending += text
            self._run(events, final=False)
        return events

    def finish(self) -> list:
        events: list = []
        if not self.text_only:
            self._run(events, final=True)
            if self.value is not None:
                self._fail(events)  # its JSON never closed: no call
        if self.space and not self.calls:
            events.append(Content("".join(self.space)))  # only whitespace and no call: the reply
        self.space = []
        return events

    def parse(self, text: str) -> Parsed:
        """A whole response: its content and calls."""
        return assemble(self.feed(text) + self.finish())

    def _run(self, events: list, final: bool) -> None:
        try:
            while True:
                if self.awaiting_end and not self._drop_end(final):
                    return
                if self.value is None and not self._find_call(events, final):
                    return
                text, self.pending = self.pending, ""
                if not self.value.feed(text):
                    return
                self._send(events, self.value)
                self.pending, self.value, self.awaiting_end = self.value.rest, None, bool(self.end)
        except _NotACall:
            self._fail(events)

    def _fail(self, events: list) -> None:
        """Not a call after all: from its marker on, the reply is content."""
        text = self.marker + (self.value.text if self.value is not None else "") + self.pending
        self.value, self.pending, self.text_only = None, "", True
        self._content(events, text)

    def _content(self, events: list, text: str) -> None:
        if not text:
            return
        if not self.shown and text.isspace():
            self.space.append(text)  # shown once other content follows; none at all if calls do
            return
        events.append(Content("".join(self.space) + text))
        self.space, self.shown = [], True

    def _find_call(self, events: list, final: bool) -> bool:
        """Show the text before the next call and open a value on it. False: no call (yet)."""
        if self.at_start:
            return self._next_at_start(events, final)
        text = self.pending
        at = text.find(self.start)
        if at < 0:
            keep = 0 if final else partial_suffix(text, self.start)
            self._content(events, text[:len(text) - keep])
            self.pending = text[len(text) - keep:]
            return False
        self._content(events, text[:at])
        return self._begin(text[at + len(self.start):], self.start)

    def _next_at_start(self, events: list, final: bool) -> bool:
        """The calls open the reply (after `start`, which may be left out) and follow each other after
        `separator`: other text ends them, and is content with all that follows. What may open a
        call (whitespace, the marker) is set aside as it comes, each character once."""
        if self.calls and not self.separator:
            return self._end_calls(events)  # no separator: one value of calls, and it is over
        lead = self.separator if self.calls else self.start
        while True:
            s = self.pending.lstrip()
            self._set_aside(len(self.pending) - len(s))
            if not s and not final:
                return False
            if lead and not self.led:
                if s.startswith(lead):
                    self._set_aside(len(lead))
                    self.led = True
                    continue
                if lead.startswith(s) and not final:
                    return False  # the start of the marker
                if self.calls:
                    return self._end_calls(events)  # no separator: the calls are over
            if not s.startswith(self.opening):
                return self._end_calls(events)
            marker, self.aside, self.led = "".join(self.aside), [], False
            return self._begin(s, marker)

    def _set_aside(self, n: int) -> None:
        if n:
            self.aside.append(self.pending[:n])
            self.pending = self.pending[n:]

    def _end_calls(self, events: list) -> bool:
        """Text where a call could be that is none: it and all that follows are content."""
        text, self.aside, self.pending, self.text_only = "".join(self.aside) + self.pending, [], "", True
        self._content(events, text)
        return False

    def _begin(self, call_text: str, marker: str) -> bool:
        self.marker, self.value, self.pending = marker, _Value(self.opening), call_text
        return True

    def _drop_end(self, final: bool) -> bool:
        """After a call's JSON, its end marker (and the whitespace before it, set aside as it comes).
        False: not enough text to tell yet."""
        s = self.pending.lstrip()
        self._set_aside(len(self.pending) - len(s))
        if s.startswith(self.end):
            self.aside, self.pending = [], s[len(self.end):]
        elif self.end.startswith(s) and not final:
            return False
        else:
            self.pending, self.aside = "".join(self.aside) + s, []  # no end marker: all is text
        self.awaiting_end = False
        return True

    def _send(self, events: list, value: _Value) -> None:
        """The calls of a closed value, all of them or (_NotACall) none."""
        text, at = value.text[:value.end], value.start
        if not self.array:
            calls = [self._call(value, text, at)[0]]
        else:
            calls = []
            at = _space(text, at + 1)
            while True:
                if not text.startswith("{", at):
                    raise _NotACall  # only calls in the array, and at least one ("[]" is text)
                call, at = self._call(value, text, at)
                calls.append(call)
                at = _space(text, at)
                if text.startswith("]", at):
                    break
                if not text.startswith(",", at):
                    raise _NotACall
                at = _space(text, at + 1)
        for name, pieces in calls:
            events.append(CallStart(self.calls, call_id(), name))
            events.extend(CallArguments(self.calls, piece) for piece in pieces)
            self.calls += 1

    def _call(self, value: _Value, text: str, at: int) -> tuple[tuple[str, list[str]], int]:
        """The call object at text[at] as (name, its arguments in pieces), and where it ends."""
        members, end = _members(text, at)
        name = members.get("name", (None,))[0]
        if not isinstance(name, str) or name not in self.functions:
            raise _NotACall
        given = [members[key] for key in self.argument_keys if key in members]
        if not given:
            return (name, ["{}"]), end  # no arguments: an empty object, as OpenAI sends
        if len(given) > 1:
            raise _NotACall  # both "arguments" and "parameters"
        arguments, start, stop = given[0]
        if isinstance(arguments, str):
            try:
                decoded = _DECODER.decode(arguments)
            except (ValueError, RecursionError):
                raise _NotACall from None
            if not isinstance(decoded, dict):
                raise _NotACall
            return (name, [arguments]), end
        if not isinstance(arguments, dict):
            raise _NotACall
        return (name, _pieces(text, value.cuts, start, stop)), end


def assemble(events: list) -> Parsed:
    """Events added up as a client adds up a stream; a reply of calls only has no content (null)."""
    content, calls = [], {}
    for e in events:
        if isinstance(e, Content):
            content.append(e.text)
        elif isinstance(e, CallStart):
            calls[e.index] = ToolCall(e.id, e.name, "")
        else:
            calls[e.index].arguments += e.text
    joined = "".join(content)
    return Parsed(joined if joined or not calls else None, list(calls.values()))


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back: the marker may follow)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    start = "<|python_tag|>"
    separator = ";"
    at_start = True


class MistralParser(ToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"
    array = True


class RequiredCallsParser(ToolParser):
    """tool_choice "required": the grammar makes the whole reply a JSON array of
    {"name", "parameters"} objects (rtp/server/tools.py)."""

    name = "required"
    array = True
    at_start = True


class NamedCallParser:
    """tool_choice naming a function: the grammar makes the whole reply its arguments, which are
    held back to the end (where the grammar ends the reply): a reply that is not one JSON object,
    cut off by max_tokens say, is content."""

    def __init__(self, function: str):
        self.function = function
        self.text = ""
        self.cuts: list[int] = []

    def feed(self, text: str) -> list:
        self.text += text
        self.cuts.append(len(self.text))
        return []

    def finish(self) -> list:
        text = self.text
        start, end = _space(text, 0), len(text.rstrip(" \t\r\n"))
        try:
            arguments, stop = _value(text, start)
        except _NotACall:
            arguments, stop = None, -1
        if not isinstance(arguments, dict) or stop != end:
            return [Content(text)] if text else []
        return [CallStart(0, call_id(), self.function),
                *(CallArguments(0, piece) for piece in _pieces(text, self.cuts, start, end))]

    def parse(self, text: str) -> Parsed:
        return assemble(self.feed(text) + self.finish())


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}
