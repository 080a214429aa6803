"""A reasoning model's text -> its thinking and its answer, as the text arrives (`--reasoning-parser`).

    qwen3        <think>thinking</think>answer: the model opens its thinking itself, first thing (Qwen3,
                 whose template leaves <think> to the model); an output that does not open with
                 <think> is all answer
    deepseek_r1  thinking</think>answer: the template opened the thinking in the prompt (DeepSeek-R1,
                 QwQ, Qwen3-Thinking-2507), so the output begins inside it; a <think> the model writes
                 first anyway is dropped

As vLLM splits them: the text before </think> is the thinking (`reasoning_content`), the text after
it the answer (`content`, as written, whitespace included); thinking that never closes (max_tokens)
is all thinking. A request whose chat_template_kwargs set enable_thinking to false thinks not at all
(the template renders no thinking): its output is all answer and no parser reads it.

Each parser reads one choice's text piece by piece (`feed`, then `finish`) and returns what each
piece adds to the thinking and to the answer; it holds back only what may be the start of a marker
(at most a marker's length), so a stream adds up to what the whole text parses to (`parse`),
however the text was cut. The answer goes on to the tool parser (rtp/server/render.py): a call
written inside the thinking is thinking, not a call.

`infer` picks a parser from the chat template when the server is given none (`choose`).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from rtp.sampling_params import ReasoningSpan
from rtp.server.tool_parsers import partial_suffix


class Split(NamedTuple):
    reasoning: str
    content: str


_OPENING, _THINKING, _ANSWER = "opening", "thinking", "answer"


class ReasoningParser:
    """One choice's text -> (thinking, answer); a family's subclass says where its thinking is."""

    name = ""
    start = "<think>"
    end = "</think>"
    in_prompt = False  # the prompt opened the thinking: an output that does not open with `start` is in it

    def __init__(self):
        self.state = _OPENING  # until the output is known to open with `start` or not
        self.held = ""         # text not placed yet: it may be (the start of) a marker

    @classmethod
    def span(cls) -> ReasoningSpan:
        """Where the thinking is, for a grammar to let it through (rtp/engine/grammar/reasoning.py)."""
        return ReasoningSpan(start=cls.start, end=cls.end, in_prompt=cls.in_prompt)

    @classmethod
    def special_markers(cls, tokenizer) -> bool:
        """Whether the tokenizer has a marker as a special token (which skip_special_tokens drops from
        the text: the server keeps special tokens in a thinking request's text then)."""
        special = {t.content for t in tokenizer.backend.get_added_tokens_decoder().values() if t.special}
        return cls.start in special or cls.end in special

    def feed(self, text: str) -> Split:
        self.held += text
        return self._run(final=False)

    def finish(self) -> Split:
        return self._run(final=True)

    def parse(self, text: str) -> Split:
        """A whole response's thinking and answer."""
        head, tail = self.feed(text), self.finish()
        return Split(head.reasoning + tail.reasoning, head.content + tail.content)

    def _run(self, final: bool) -> Split:
        text, self.held = self.held, ""
        if self.state == _OPENING:
            if text.startswith(self.start):
                text, self.state = text[len(self.start):], _THINKING
            elif self.start.startswith(text) and not final:
                self.held = text  # all of it may yet be the opening marker
                return Split("", "")
            else:
                self.state = _THINKING if self.in_prompt else _ANSWER
        if self.state == _THINKING:
            at = text.find(self.end)
            if at >= 0:
                self.state = _ANSWER
                return Split(text[:at], text[at + len(self.end):])
            keep = 0 if final else partial_suffix(text, self.end)
            self.held = text[len(text) - keep:]
            return Split(text[:len(text) - keep], "")
        return Split("", text)


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    in_prompt = True


PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)}


def thinks(chat_template_kwargs: dict | None) -> bool:
    """Whether a request's template renders thinking: all do but those that turn it off, as Qwen3's
    and DeepSeek's templates read `enable_thinking`."""
    return not (chat_template_kwargs and chat_template_kwargs.get("enable_thinking") is False)


def choose(name: str | None, tokenizer) -> tuple[type[ReasoningParser] | None, bool]:
    """The parser for --reasoning-parser `name` ("none": no parser; None: the template's, if any),
    and whether it was inferred."""
    if name == "none":
        return None, False
    if name is not None:
        return PARSERS[name], False
    inferred = infer(tokenizer)
    return (PARSERS[inferred], True) if inferred is not None else (None, False)


def infer(tokenizer) -> str | None:
    """The parser a chat template calls for, when the server is given none: deepseek_r1 where the
    template's generation prompt ends in an open <think> (DeepSeek-R1, QwQ, Qwen3-Thinking-2507),
    qwen3 where the template writes <think> and reads `enable_thinking` (Qwen3's hybrid
    templates); else none. A template that only mentions <think> (to drop old thinking from the
    history, as Qwen3-Instruct-2507's does) is no thinking template."""
    template = tokenizer.chat_template
    if not template or "<think>" not in template:
        return None
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    except Exception:  # a template that needs more than one user message to render
        prompt = ""
    if prompt.rstrip().endswith(DeepSeekR1ReasoningParser.start):
        return DeepSeekR1ReasoningParser.name
    if re.search(r"\benable_thinking\b", template):
        return Qwen3ReasoningParser.name
    return None
