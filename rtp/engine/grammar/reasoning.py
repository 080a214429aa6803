"""A request's grammar with free thinking before it (StructuredOutputs.reasoning): a reasoning
model thinks first, and its grammar constrains the answer only, as vLLM's structured outputs do
with a reasoning parser.

    start: thinking WS @answer         the prompt opened the thinking (in_prompt): the output begins in it
    start: (thinking WS)? @answer      else: thinking only where the output opens with its start marker
    thinking: START? closed            (START required where the thinking is optional)
    closed: closed_as_text | THOUGHT <[end's token]>
    closed_as_text[lazy]: THOUGHT "END"
    THOUGHT: any text

`@answer` is the request's own grammar, whatever its form (JSON Schema, regex, choice, Lark, GBNF),
unchanged, as a sub-grammar. A lazy lexeme ends where it first can, so the first END closes the
thinking (and ends the THOUGHT that would have gone on to END's token), and all after it, past the
whitespace models write there, is held to the answer's grammar. The output cannot end inside the
thinking: the answer is what the grammar is for.

A marker may be one token that llguidance takes as special: it reads an added token written like
`<...>` (Qwen3's <think> and </think>) as special, and special tokens match no text literal, so
such a marker is taken as its token, or as its text spelled in ordinary tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from rtp.sampling_params import ReasoningSpan

ANSWER = "answer"  # the sub-grammar's name (the request's own grammar)


def after_reasoning(grammar: str, span: ReasoningSpan, special: Callable[[str], int | None]) -> str:
    """`grammar` (an llguidance grammar: Lark text or a JSON TopLevelGrammar) preceded by free
    thinking; `special(marker)` is the token id of a marker that is one special token, else None."""
    if grammar.lstrip().startswith("{"):
        answer = json.loads(grammar)["grammars"]
    else:
        answer = [{"lark_grammar": grammar}]
    answer[0] = {**answer[0], "name": ANSWER}
    start, end_token = _literal(span.start, special(span.start)), special(span.end)
    rules = [
        "%llguidance {}",
        f"start: thinking WS @{ANSWER}" if span.in_prompt else f"start: (thinking WS)? @{ANSWER}",
        f"thinking: ({start})? closed" if span.in_prompt else f"thinking: ({start}) closed",
        "closed: closed_as_text" + (f" | THOUGHT <[{end_token}]>" if end_token is not None else ""),
        f"closed_as_text[lazy]: THOUGHT {json.dumps(span.end)}",
        "THOUGHT: /(?s:.)*/",
        r"WS: /[ \t\r\n]*/",
    ]
    return json.dumps({"grammars": [{"name": "reasoning", "lark_grammar": "\n".join(rules) + "\n"}, *answer]})


def _literal(marker: str, token: int | None) -> str:
    """A marker in Lark: its text, or its special token."""
    return json.dumps(marker) + (f" | <[{token}]>" if token is not None else "")
