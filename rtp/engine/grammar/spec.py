"""A request's StructuredOutputs -> the grammar texts llguidance may run, bounded before any compile.

Everything here is cheap (linear in the spec's size) and runs before a compile is queued, so a
spec past a limit is refused within milliseconds, whatever its size:

    size        the spec's bytes as JSON (--grammar-max-bytes)
    choices     how many strings a choice lists (--grammar-max-choices)
    repetition  the most characters one bounded repetition spells out, nested counts multiplied:
                `a{1000000}` is 1,000,000, `(ab{100}){100}` 10,100 (--grammar-max-repetition).
                llguidance expands such counts in its lexer while it generates: past about a million
                it fails mid-request ("too many expressions constructed"), so the bound is taken
                here, on the regex, on a Lark grammar's regexes and repetitions, and on a JSON
                Schema's patterns.

A grammar given as text is GBNF or Lark. Which one is decided by an explicit
`grammar_syntax`, or else by trying each: GBNF first when the text has `::=` (GBNF's rule
sign), then Lark; the compiler takes the first candidate that builds. A Lark grammar with
`::=` inside a literal therefore still runs as Lark.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import msgspec

from rtp.engine.grammar.reasoning import after_reasoning
from rtp.errors import InvalidRequest, one_line
from rtp.sampling_params import StructuredOutputs

# JSON as a model should write it for a machine: one canonical layout, no runs of whitespace
# (small models given free whitespace can fill max_tokens with newlines inside a valid document)
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarLimits(msgspec.Struct, frozen=True, kw_only=True):
    """The bounds a spec is checked against (rtp/config.py StructuredOutputConfig fills them)."""

    max_bytes: int = 128 << 10
    max_choices: int = 4096
    max_repetition: int = 10_000
    compile_timeout: float = 2.0


def check_limits(spec: StructuredOutputs, limits: GrammarLimits) -> None:
    """InvalidRequest (param structured_outputs) for a spec past a limit; nothing is compiled."""
    size = len(msgspec.json.encode(spec))
    if size > limits.max_bytes:
        raise InvalidRequest(f"the structured output is {size:,} bytes, more than the limit of "
                             f"{limits.max_bytes:,} (--grammar-max-bytes)", "structured_outputs")
    if spec.choice is not None and len(spec.choice) > limits.max_choices:
        raise InvalidRequest(f"the choice lists {len(spec.choice):,} strings, more than the limit of "
                             f"{limits.max_choices:,} (--grammar-max-choices)", "structured_outputs")
    if spec.regex is not None:
        _check_repetition(regex_repetition(spec.regex), "the regex", limits)
    elif spec.grammar is not None:
        _check_repetition(lark_repetition(spec.grammar), "the grammar", limits)
    elif spec.json is not None:
        schema = _schema(spec)
        _check_repetition(max((regex_repetition(p) for p in _schema_patterns(schema)), default=0),
                          "a pattern of the JSON schema", limits)
    if spec.whitespace_pattern is not None:
        _check_repetition(regex_repetition(spec.whitespace_pattern), "the whitespace pattern", limits)


def _check_repetition(repetition: int, what: str, limits: GrammarLimits) -> None:
    if repetition > limits.max_repetition:
        raise InvalidRequest(f"{what} repeats a piece to {repetition:,} characters, more than the limit of "
                             f"{limits.max_repetition:,} (--grammar-max-repetition)", "structured_outputs")


def candidates(spec: StructuredOutputs, special: Callable[[str], int | None] = lambda marker: None
               ) -> tuple[list[str], dict[str, str]]:
    """The llguidance grammars to try in order (the first that builds is the request's), and why a
    syntax the text was tried as could not even be read ({"gbnf": why}). InvalidRequest for what
    cannot be read at all (a schema that is not JSON, GBNF asked for that does not convert).
    A spec with `reasoning` gets each grammar after free thinking (reasoning.py; `special` says
    which of its markers are one special token, by id)."""
    grammars, unread = _answer_candidates(spec)
    if spec.reasoning is not None:
        grammars = [after_reasoning(grammar, spec.reasoning, special) for grammar in grammars]
    return grammars, unread


def _answer_candidates(spec: StructuredOutputs) -> tuple[list[str], dict[str, str]]:
    import llguidance as llg

    from_lark = llg.LLMatcher.grammar_from_lark
    try:
        if spec.json is not None or spec.json_object:
            schema = {"type": "object"} if spec.json_object else _schema(spec)
            options = _JSON_OPTIONS if spec.whitespace_pattern is None else {"whitespace_pattern": spec.whitespace_pattern}
            return [llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)], {}
        if spec.regex is not None:
            return [llg.LLMatcher.grammar_from_regex(spec.regex)], {}
        if spec.choice is not None:
            # one terminal, the union of the choices as Lark string literals (JSON's escapes, so any
            # text is taken literally): one lexeme, where alternatives of a rule would be an Earley
            # row of one item each (llguidance caps a row at 2,000; 4,096 choices build in 20 ms)
            return [from_lark("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in spec.choice))], {}
    except InvalidRequest:
        raise
    except Exception as e:  # llguidance's JSON Schema converter refused it
        raise InvalidRequest(f"the structured output cannot be read: {one_line(str(e))}",
                             "structured_outputs") from None
    syntax = spec.grammar_syntax
    grammars, unread = [], {}
    if syntax == "gbnf" or (syntax is None and "::=" in spec.grammar):
        lark, why = _gbnf_to_lark(spec.grammar)
        if lark is not None:
            grammars.append(from_lark(lark))
        elif syntax == "gbnf":
            raise InvalidRequest(f"the grammar is not GBNF: {why}", "structured_outputs")
        else:
            unread["gbnf"] = why
    if syntax in (None, "lark"):
        grammars.append(from_lark(spec.grammar))
    return grammars, unread


def _gbnf_to_lark(text: str) -> tuple[str | None, str | None]:
    """(the Lark form of a GBNF grammar, None), or (None, why it is not GBNF in one line)."""
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(text), None
    except Exception as e:
        return None, one_line(str(e))


def _schema(spec: StructuredOutputs):
    schema = spec.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise InvalidRequest(f"the JSON schema is not JSON: {e}", "structured_outputs") from None
    return schema


def _schema_patterns(schema):
    """Every regex a JSON Schema holds (pattern values, patternProperties keys), at any depth."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                yield pattern
            props = node.get("patternProperties")
            if isinstance(props, dict):
                yield from (k for k in props if isinstance(k, str))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


# -- repetition: the most characters one bounded repetition spells out --------------------------------

_QUANTIFIER = re.compile(r"\{(\d{1,12})(?:,(\d{0,12}))?\}")


class _Walk:
    """Sizes of a pattern's pieces, as a stack of groups: each group's size so far and the size of
    the piece a quantifier would apply to. A repetition's size multiplies its piece by its count;
    nested repetitions multiply through their group. The result is an upper bound (alternatives
    add up), which is all a limit needs."""

    def __init__(self):
        self.stack = [[0, 0]]  # [size of the group so far, size of its last piece]
        self.worst = 0

    def atom(self, size: int = 1) -> None:
        top = self.stack[-1]
        top[0] += size
        top[1] = size

    def open(self) -> None:
        self.stack.append([0, 0])

    def close(self) -> None:
        if len(self.stack) > 1:
            size = self.stack.pop()[0]
            self.atom(size)

    def repeat(self, count: int) -> None:
        top = self.stack[-1]
        total = top[1] * count
        top[0] += total - top[1]
        top[1] = total
        self.worst = max(self.worst, total)

    def result(self) -> int:
        while len(self.stack) > 1:
            self.close()
        return self.worst


def _quantifier(text: str, i: int) -> tuple[int, int] | None:
    """(count, length) of a `{n}`, `{n,}` or `{n,m}` at text[i], else None."""
    m = _QUANTIFIER.match(text, i)
    if m is None:
        return None
    low, high = int(m.group(1)), m.group(2)
    return max(low, int(high) if high else low), m.end() - i


def _skip_class(text: str, i: int) -> int:
    """The index after the character class opening at text[i] ('[')."""
    i += 1
    depth = 1
    if i < len(text) and text[i] == "^":
        i += 1
    if i < len(text) and text[i] == "]":
        i += 1  # a leading ] is a literal
    while i < len(text) and depth:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        i += 1
    return i


def _skip_escape(text: str, i: int) -> int:
    """The index after the escape at text[i] ('\\'): \\x{...}, \\u{...}, \\p{...} take their braces."""
    if i + 1 < len(text) and text[i + 1] in "xupP" and i + 2 < len(text) and text[i + 2] == "{":
        end = text.find("}", i + 3)
        return len(text) if end < 0 else end + 1
    return i + 2


def _regex_into(walk: _Walk, text: str, start: int = 0, end: int | None = None) -> None:
    i, end = start, len(text) if end is None else end
    while i < end:
        c = text[i]
        if c == "\\":
            i = _skip_escape(text, i)
            walk.atom()
        elif c == "[":
            i = _skip_class(text, i)
            walk.atom()
        elif c == "(":
            walk.open()
            i += 1
            if text.startswith("?", i):  # (?:, (?i), (?P<name>: the group's flags and name
                close = re.match(r"\?(?:P?<[^>]*>|[a-zA-Z-]*:?)", text[i:end])
                i += close.end() if close else 1
        elif c == ")":
            walk.close()
            i += 1
        elif c == "{" and (q := _quantifier(text, i)) is not None:
            walk.repeat(q[0])
            i += q[1]
        elif c in "*+?|":
            i += 1
        else:
            walk.atom()
            i += 1


def regex_repetition(text: str) -> int:
    """The most characters one bounded repetition of a regex spells out (0: none)."""
    walk = _Walk()
    _regex_into(walk, text)
    return walk.result()


def lark_repetition(text: str) -> int:
    """The same for a Lark or GBNF grammar: its regex terminals, and `{n,m}` / `~ n..m` on rules,
    literals and groups (a rule's own size is counted as one piece where it is named)."""
    walk = _Walk()
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"' or c == "'":  # a literal
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            walk.atom(max(1, j - i - 1))
            i = j + 1
        elif c == "/" and i + 1 < n and text[i + 1] == "/":  # a comment
            i = text.find("\n", i)
            i = n if i < 0 else i
        elif c == "#":
            i = text.find("\n", i)
            i = n if i < 0 else i
        elif c == "/":  # a regex terminal: /.../flags
            j = i + 1
            while j < n and text[j] != "/" and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            inner = _Walk()
            _regex_into(inner, text, i + 1, min(j, n))
            walk.worst = max(walk.worst, inner.result())
            walk.atom(max(1, inner.stack[0][0]))
            i = j + 1
        elif c == "[":  # a GBNF character class
            i = _skip_class(text, i)
            walk.atom()
        elif c == "(":
            walk.open()
            i += 1
        elif c == ")":
            walk.close()
            i += 1
        elif c == "{" and (q := _quantifier(text, i)) is not None:
            walk.repeat(q[0])
            i += q[1]
        elif c == "~" and (m := re.match(r"~\s*(\d{1,12})(?:\s*\.\.\s*(\d{1,12}))?", text[i:i + 40])):
            walk.repeat(int(m.group(2) or m.group(1)))
            i += m.end()
        elif c == "\n":  # a rule ends where a line starting a new one begins: sizes do not carry over
            walk.stack = [[0, 0]]
            i += 1
        elif c.isalnum() or c == "_":
            j = i
            while j < n and (text[j].isalnum() or text[j] in "_-"):
                j += 1
            walk.atom()
            i = j
        else:
            i += 1
    return walk.result()
