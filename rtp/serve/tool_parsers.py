"""A model's text -> tool calls, as the text arrives (`--tool-call-parser`).

Models write their calls in their own formats:

    hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call>  (Hermes, Qwen 2.5/3, the
                 ChatML template rtp ships)
    llama3_json  {"name": "f", "parameters": {...}}  the whole reply, after an optional <|python_tag|>;
                 several calls separated by ";" (Llama 3.1/3.2/3.3)
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]  (Mistral's v3 format)

Each parser reads one choice's text piece by piece (`feed`, then `finish`) and returns events:
content to show, a call's start (its index, id and name) and pieces of its arguments' JSON. The
server turns the events into OpenAI's streamed deltas (the name first, the arguments in pieces, as
the `openai` client's stream helpers expect) and a whole response adds them up, so both go through
one code path. Text that is not a call stays content; a call whose JSON breaks off becomes content
again in a whole response (`parse`), as vLLM answers.

The JSON of a call is scanned one character at a time: only the calls' text pays for it, and a
streaming JSON library would still need the "which key is this value under" bookkeeping below.
"""

from __future__ import annotations

import json
import uuid
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


class _BadCall(Exception):
    pass


def _json(text: str):
    """A JSON value of the call's text; what does not parse is not a call."""
    try:
        return json.loads(text)
    except ValueError:
        raise _BadCall(text) from None


class _CallScanner:
    """The calls in one JSON value, read as it arrives: an object {"name": ..., "arguments": ...}
    (array=False) or an array of them. Reports each call's name once it is whole, and the raw text
    of its arguments as it comes (held back until the name is known, so the name always goes
    first). `done` once the value is complete; `rest` is the text after it."""

    def __init__(self, first_index: int, *, array: bool, argument_keys: tuple[str, ...]):
        self.argument_keys = argument_keys
        self.opening = "[" if array else "{"
        self.call_depth = 2 if array else 1   # the depth at which a call's keys sit
        self.index = first_index              # the index of the call being read
        self.buf = ""
        self.pos = 0                          # the next character to scan
        self.depth = 0
        self.in_string = self.escape = False
        self.done = False
        self._new_call()

    def _new_call(self) -> None:
        self.id = call_id()
        self.key: str | None = None           # the key whose value comes next, at the call's depth
        self.key_start = -1
        self.awaiting_value = False           # after the key's ":", before its first character
        self.value_start = -1                 # where the value being read starts (-1: between values)
        self.name: str | None = None
        self.args_start = self.args_end = -1  # the arguments' raw JSON text (end -1: not whole yet)
        self.args_sent = 0                    # characters of it reported
        self.announced = False

    @property
    def rest(self) -> str:
        return self.buf[self.pos:]

    def feed(self, text: str) -> list:
        self.buf += text
        events: list = []
        buf, at_call = self.buf, self.call_depth
        while self.pos < len(buf) and not self.done:
            i = self.pos
            c = buf[i]
            self.pos += 1
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == at_call and self.value_start < 0:
                        self.key = _json(buf[self.key_start:i + 1])
                continue
            if c in " \t\r\n":
                continue
            if self.depth == 0:
                if c != self.opening:
                    raise _BadCall(c)
                self.depth = 1
                continue
            if self.awaiting_value:
                self.awaiting_value, self.value_start = False, i
                if self.key in self.argument_keys:
                    self.args_start = i
            elif self.depth < at_call and c not in "{,]":
                raise _BadCall(c)  # between the calls of an array: only calls and commas
            elif self.depth == at_call and self.value_start < 0 and c not in '":,}':
                raise _BadCall(c)  # between a call's keys and values: JSON's punctuation only
            if c == '"':
                self.in_string = True
                if self.depth == at_call and self.value_start < 0:
                    self.key_start = i
            elif c == ":" and self.depth == at_call and self.value_start < 0:
                self.awaiting_value = True
            elif c == "{" or c == "[":
                if self.depth == at_call - 1:
                    if c != "{":
                        raise _BadCall(c)
                    self._new_call()
                self.depth += 1
            elif c == "}" or c == "]" or (c == "," and self.depth == at_call):
                if self.depth == at_call and self.value_start >= 0:
                    self._end_value(i, events)
                if c != ",":
                    self.depth -= 1
                    if self.depth == at_call - 1:
                        self._end_call(events)
                    self.done = self.depth == 0
        self._stream_arguments(events)
        return events

    def _end_value(self, end: int, events: list) -> None:
        value = self.buf[self.value_start:end].rstrip()
        if self.key == "name":
            self.name = _json(value)
            if not isinstance(self.name, str):
                raise _BadCall(value)
        elif self.key in self.argument_keys:
            self.args_end = self.value_start + len(value)
        self.value_start, self.key = -1, None
        self._stream_arguments(events)

    def _stream_arguments(self, events: list) -> None:
        if self.name is not None and not self.announced:
            self.announced = True
            events.append(CallStart(self.index, self.id, self.name))
        if not self.announced or self.args_start < 0:
            return
        whole = self.args_end >= 0
        if self.buf[self.args_start] == '"':
            # arguments given as a JSON string (some models do): sent decoded, once whole
            if whole and not self.args_sent:
                self.args_sent = 1
                arguments = _json(self.buf[self.args_start:self.args_end])
                if not isinstance(arguments, str):
                    raise _BadCall("arguments")
                events.append(CallArguments(self.index, arguments))
            return
        # the scanned text, less trailing whitespace (it may be the value's end: sent once it is not)
        end = self.args_end if whole else self.args_start + len(self.buf[self.args_start:self.pos].rstrip())
        if self.args_start + self.args_sent < end:
            events.append(CallArguments(self.index, self.buf[self.args_start + self.args_sent:end]))
            self.args_sent = end - self.args_start

    def _end_call(self, events: list) -> None:
        if self.name is None:
            raise _BadCall("a call without a name")
        if self.args_start < 0:  # no arguments: an empty object, as OpenAI sends
            events.append(CallArguments(self.index, "{}"))
        self.index += 1
        self._new_call()


class ToolParser:
    """One choice's text -> content and tool calls (the format's subclass says where calls are)."""

    name = ""
    start = ""                 # the marker before a call (at_start: optional)
    end = ""                   # the marker after a call, if any
    array = False              # a call marker opens an array of calls, not one
    separator = ""             # between consecutive calls without markers (llama3_json: ";")
    argument_keys: tuple[str, ...] = ("arguments", "parameters")
    at_start = False           # the calls open the reply, or there are none

    def __init__(self):
        self.pending = ""      # text not yet shown: it may be (the start of) a marker
        self.scanner: _CallScanner | None = None
        self.marker = ""       # the text that opened the current call (content again if it breaks)
        self.calls = 0
        self.seen_text = False
        self.awaiting_end = False
        self.broken = False

    def feed(self, text: str) -> list:
        if self.broken:
            return [Content(text)] if text else []
        events: list = []
        self.pending += text
        self._run(events, final=False)
        return events

    def finish(self) -> list:
        events: list = []
        if self.broken:
            return events
        self._run(events, final=True)
        if self.scanner is not None and not self.scanner.announced:
            self._break(events)  # cut off before its name: it was text
        elif self.pending:
            events.append(Content(self.pending))
        self.pending, self.scanner = "", None
        return events

    def parse(self, text: str) -> Parsed:
        """A whole response: its content and calls; all content if a call is not valid JSON."""
        return assemble(self.feed(text) + self.finish(), text)

    def _run(self, events: list, final: bool) -> None:
        try:
            while True:
                if self.awaiting_end and not self._drop_end(final):
                    return
                if self.scanner is None and not self._find_call(events, final):
                    return
                text, self.pending = self.pending, ""
                events.extend(self.scanner.feed(text))
                if not self.scanner.done:
                    return
                if self.scanner.index == self.calls:
                    raise _BadCall("no call in it")  # "[]": text, not an empty list of calls
                self.calls, self.pending = self.scanner.index, self.scanner.rest
                self.scanner, self.awaiting_end = None, bool(self.end)
        except _BadCall:
            self._break(events)

    def _break(self, events: list) -> None:
        """Not a call after all: from its marker on, everything is content."""
        text = self.marker + (self.scanner.buf if self.scanner is not None else "") + self.pending
        self.broken, self.scanner, self.pending = True, None, ""
        if text:
            events.append(Content(text))

    def _find_call(self, events: list, final: bool) -> bool:
        """Show the text before the next call and open a scanner on the call. False: no call (yet)."""
        text = self.pending
        opening = "[" if self.array else "{"
        if self.calls and self.separator:
            s = text.lstrip()
            if s.startswith(self.separator):
                s = s[len(self.separator):].lstrip()
                if s.startswith(opening):
                    return self._begin(s, text[:len(text) - len(s)])
            if not final and (not s or self.separator.startswith(text.lstrip())):
                return False
            return self._show(events, text)
        if self.at_start and not self.seen_text:
            s = text.lstrip()
            if self.start and s.startswith(self.start):
                s = s[len(self.start):].lstrip()
            elif self.start and self.start.startswith(s) and not final:
                return False
            if not s:
                return False if not final else self._show(events, text)
            self.seen_text = True
            if s.startswith(opening):
                return self._begin(s, text[:len(text) - len(s)])
            return self._show(events, text)
        if not self.start:
            return self._show(events, text)
        at = text.find(self.start)
        if at < 0:
            keep = 0 if final else _partial_suffix(text, self.start)
            self._show(events, text[:len(text) - keep])
            self.pending = text[len(text) - keep:]
            return False
        self._show(events, text[:at])
        return self._begin(text[at + len(self.start):], self.start)

    def _show(self, events: list, text: str) -> bool:
        if text:
            events.append(Content(text))
            self.seen_text = True
        self.pending = ""
        return False

    def _begin(self, call_text: str, marker: str) -> bool:
        self.marker = marker
        self.scanner = _CallScanner(self.calls, array=self.array, argument_keys=self.argument_keys)
        self.pending = call_text
        return True

    def _drop_end(self, final: bool) -> bool:
        """After a call's JSON, its end marker. False: not enough text to tell yet."""
        s = self.pending.lstrip()
        if s.startswith(self.end):
            self.pending = s[len(self.end):]
        elif self.end.startswith(s) and not final:
            return False
        self.awaiting_end = False
        return True


def assemble(events: list, text: str) -> Parsed:
    content, calls = [], {}
    for e in events:
        if isinstance(e, Content):
            content.append(e.text)
        elif isinstance(e, CallStart):
            calls[e.index] = ToolCall(e.id, e.name, "")
        else:
            calls[e.index].arguments += e.text
    for call in calls.values():
        try:
            json.loads(call.arguments)
        except ValueError:
            return Parsed(text or None, [])
    joined = "".join(content)
    if calls:  # content around the calls as written (as vLLM answers), none if only whitespace
        return Parsed(joined if joined.strip() else None, list(calls.values()))
    return Parsed(joined)


def _partial_suffix(text: str, marker: str) -> int:
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
    {"name", "parameters"} objects (rtp/serve/tools.py)."""

    name = "required"
    array = True
    at_start = True


class NamedCallParser:
    """tool_choice naming a function: the grammar makes the whole reply its arguments."""

    def __init__(self, function: str):
        self.function = function
        self.id = call_id()
        self.started = False

    def feed(self, text: str) -> list:
        events = []
        if not self.started:
            self.started = True
            events.append(CallStart(0, self.id, self.function))
        if text:
            events.append(CallArguments(0, text))
        return events

    def finish(self) -> list:
        return [] if self.started else self.feed("")

    def parse(self, text: str) -> Parsed:
        return Parsed(None, [ToolCall(self.id, self.function, text)])


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}
