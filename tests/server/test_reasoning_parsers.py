"""The reasoning parsers (rtp/server/reasoning_parsers.py) on texts in each family's format, fed whole
and in pieces of every size and at random cuts up to 1,000 characters: the pieces add up to what the
whole text parses to, and that is what the family's rule says (an oracle written from the rule, with
str.partition). Then the chain through the server's renderer: thinking -> reasoning_content, the
answer -> the tool parser, so a call written inside the thinking is thinking, never a call; streamed
and whole alike. And the choice of a parser: the flag's names, the template's inference, and
enable_thinking.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from rtp.checkpoint.tokenizer import Tokenizer
from rtp.config import REASONING_PARSERS, ServeConfig
from rtp.server.async_engine import ChoiceDelta, Update
from rtp.server.reasoning_parsers import (
    PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    choose,
    infer,
    thinks,
)
from rtp.server.render import ChatRender
from rtp.server.tools import plan_tools

QWEN3, R1 = Qwen3ReasoningParser, DeepSeekR1ReasoningParser

# (parser, text as the model wrote it, reasoning_content expected, content expected)
RECORDED = [
    # Qwen3-8B, thinking on: it opens <think> itself
    (QWEN3, "<think>\nOkay, the user asks for 2 + 2. That is 4.\n</think>\n\nThe answer is **4**.",
     "\nOkay, the user asks for 2 + 2. That is 4.\n", "\n\nThe answer is **4**."),
    # Qwen3 after /no_think: empty thinking
    (QWEN3, "<think>\n\n</think>\n\nHello!", "\n\n", "\n\nHello!"),
    # no <think> at all: all answer, a stray </think> included
    (QWEN3, "Paris is the capital of France.", "", "Paris is the capital of France."),
    (QWEN3, "a </think> b", "", "a </think> b"),
    # <think> later than the very start is no thinking
    (QWEN3, "Sure. <think>x</think>y", "", "Sure. <think>x</think>y"),
    # cut off by max_tokens inside the thinking, and inside the markers
    (QWEN3, "<think>\nLet me count: 1, 2, 3", "\nLet me count: 1, 2, 3", ""),
    (QWEN3, "<think>\nLet me count</thi", "\nLet me count</thi", ""),
    (QWEN3, "<thi", "", "<thi"),
    (QWEN3, "", "", ""),
    # DeepSeek-R1-Distill: the template opened <think>, the output starts inside it
    (R1, "Okay, so I need to find 2 + 2.\n</think>\n\n**Answer:** 4",
     "Okay, so I need to find 2 + 2.\n", "\n\n**Answer:** 4"),
    # an R1 model that writes <think> anyway: dropped
    (R1, "<think>\nHmm.\n</think>\n\n4", "\nHmm.\n", "\n\n4"),
    # unclosed: all thinking; a second </think> or a later <think> is the text's
    (R1, "I am still thinking about it", "I am still thinking about it", ""),
    (R1, "a<think>b</think>c</think>d", "a<think>b", "c</think>d"),
    (R1, "</think>", "", ""),
    (R1, "", "", ""),
]


def oracle(parser, text: str) -> tuple[str, str]:
    """The family's rule, written plainly: opened by <think> at the very start (or, deepseek_r1, by
    the prompt), closed by the first </think>; the rest is the answer."""
    if text.startswith("<think>"):
        text = text[len("<think>"):]
    elif not parser.in_prompt:
        return "", text
    reasoning, closed, content = text.partition("</think>")
    return reasoning, content if closed else ""


def streamed(parser, text: str, cuts: list[int]) -> tuple[str, str]:
    """The text fed at `cuts` (ascending), then finished: what a client adds up."""
    p, reasoning, content, at = parser(), [], [], 0
    for cut in [*cuts, len(text)]:
        if cut > at:
            split = p.feed(text[at:cut])
            reasoning.append(split.reasoning)
            content.append(split.content)
            at = cut
    split = p.finish()
    return "".join(reasoning) + split.reasoning, "".join(content) + split.content


def every_size(text: str, size: int) -> list[int]:
    return list(range(size, len(text), size))


@pytest.mark.parametrize("parser, text, reasoning, content", RECORDED)
def test_recorded_texts_whole_and_in_pieces_of_every_size(parser, text, reasoning, content):
    assert tuple(parser().parse(text)) == (reasoning, content) == oracle(parser, text)
    for size in range(1, len(text) + 2):
        assert streamed(parser, text, every_size(text, size)) == (reasoning, content), size


def test_a_piece_holds_back_only_what_may_be_a_marker():
    p = QWEN3()
    assert tuple(p.feed("<th")) == ("", "")  # may be <think>
    assert tuple(p.feed("ink>I think")) == ("I think", "")
    assert tuple(p.feed(" hard</th")) == (" hard", "")  # may be </think>
    assert tuple(p.feed("ere")) == ("</there", "")  # was not
    assert tuple(p.feed("</think>Yes")) == ("", "Yes")
    assert tuple(p.feed(" <think> </think>")) == ("", " <think> </think>")  # the answer is the answer
    assert tuple(p.finish()) == ("", "")
    assert tuple(QWEN3().feed("Hi")) == ("", "Hi")  # no <think>: known from the first character


FRAGMENTS = ["<think>", "</think>", "<think", "</thin", "k>", "<", "</", ">", "think", "\n", " ", "a", "é", "x" * 40]


@settings(max_examples=400, deadline=None)
@given(parts=st.lists(st.sampled_from(FRAGMENTS), max_size=40), parser=st.sampled_from([QWEN3, R1]),
       data=st.data())
def test_any_text_any_cuts_adds_up_to_the_rule(parts, parser, data):
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=30)))
    assert streamed(parser, text, cuts) == tuple(parser().parse(text)) == oracle(parser, text)


@pytest.mark.parametrize("parser", [QWEN3, R1], ids=["qwen3", "deepseek_r1"])
def test_long_texts_at_random_cuts_up_to_1000_characters(parser):
    rng = random.Random(7)
    words = ["<think>", "</think>", "</th", "<", "thinking", "answer", "\n", " ", "ü", "😀"]
    for trial in range(40):
        opening = "<think>" if trial % 2 else ""
        text = opening + "".join(rng.choice(words) for _ in range(rng.randint(0, 600)))
        cuts, at = [], 0
        while at < len(text):
            at += rng.randint(1, 1000)
            cuts.append(at)
        assert streamed(parser, text, cuts) == oracle(parser, text)


# -- the chain: reasoning parser -> tool parser, through the server's renderer -----------------------

TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
         for name in ("get_weather", "search")]
TEMPLATE = "{% for t in tools %}{{ t }}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
IN_THOUGHT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
CALL = '<tool_call>\n{"name": "search", "arguments": {"q": "weather Paris"}}\n</tool_call>'


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return f"<{ids[0]}>"


def render(parser, tools: bool, n: int = 1) -> ChatRender:
    plan = plan_tools(TOOLS, "auto", None, parser="hermes", template=TEMPLATE, structured=False) if tools else None
    return ChatRender("chatcmpl-1", "m", _Tokenizer(), [[1, 2]], n, top_logprobs=None, tools=plan, reasoning=parser)


def steps(text: str, size: int, reason: str, index: int = 0) -> list[Update]:
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    out = [Update(0, [ChoiceDelta(index, piece, 1, None)]) for piece in pieces]
    out[-1].choices[0].finish_reason = reason
    return out


def client_view(render_: ChatRender, updates: list[Update]) -> list[dict]:
    """What a client adds up from the SSE events, per choice."""
    buf = bytearray(render_.opening())
    for update in updates:
        render_.write_chunks(update, buf)
    choices: dict[int, dict] = {}
    for event in bytes(buf).split(b"\n\n")[:-1]:
        for c in json.loads(event[len(b"data: "):])["choices"]:
            got = choices.setdefault(c["index"], {"reasoning": "", "content": "", "calls": [], "finish": None})
            assert got["finish"] is None, "an event after the finish"
            delta = c["delta"]
            assert not ("reasoning_content" in delta and ("content" in delta or "tool_calls" in delta))
            got["reasoning"] += delta.get("reasoning_content") or ""
            got["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                if "id" in call:
                    got["calls"].append([call["function"]["name"], ""])
                else:
                    got["calls"][-1][1] += call["function"]["arguments"]
            got["finish"] = c["finish_reason"]
    return [choices[i] for i in sorted(choices)]


def whole(render_: ChatRender, updates: list[Update]):
    for update in updates:
        render_.add(update)
    return render_.response().choices


def answer(parser, text: str, reason: str = "stop", tools: bool = True, size: int = 1000):
    """(reasoning_content, content, [(name, arguments)], finish_reason) of the whole response, after
    checking that the stream adds up to it."""
    (choice,) = whole(render(parser, tools), steps(text, size, reason))
    (got,) = client_view(render(parser, tools), steps(text, size, reason))
    m = choice.message
    calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
    assert (got["reasoning"], got["content"], [tuple(c) for c in got["calls"]], got["finish"]) == (
        m.reasoning_content or "", m.content or "", calls, choice.finish_reason)
    return m.reasoning_content, m.content, calls, choice.finish_reason


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13, 1000])
def test_calls_come_from_the_answer_and_a_call_in_the_thinking_is_thinking(size):
    thought = f"\nI could call {IN_THOUGHT} but search is better.\n"
    text = f"<think>{thought}</think>\n\n{CALL}"
    assert answer(QWEN3, text, size=size) == (thought, None, [("search", '{"q": "weather Paris"}')], "tool_calls")
    assert answer(R1, text[len("<think>"):], size=size) == (
        thought, None, [("search", '{"q": "weather Paris"}')], "tool_calls")


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_thinking_that_never_closes_is_all_reasoning_and_no_call(size):
    text = f"<think>Maybe {IN_THOUGHT} and then"
    assert answer(QWEN3, text, "length", size=size) == (text[len("<think>"):], None, [], "length")
    assert answer(R1, "Still going", "length", tools=False, size=size) == ("Still going", None, [], "length")


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_no_thinking_is_all_content_and_its_calls(size):
    assert answer(QWEN3, "Hello there.", size=size) == (None, "Hello there.", [], "stop")
    assert answer(QWEN3, CALL, size=size) == (None, None, [("search", '{"q": "weather Paris"}')], "tool_calls")
    assert answer(QWEN3, "<think>Hi</think>Hello", tools=False, size=size) == ("Hi", "Hello", [], "stop")


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.sampled_from(["<think>", "</think>", "<thi", "nk>", IN_THOUGHT, CALL, "<tool_call>", "{",
                                       "}", " ", "\n", "ok"]), max_size=16),
       size=st.integers(1, 12), parser=st.sampled_from([QWEN3, R1]), reason=st.sampled_from(["stop", "length"]))
def test_any_text_through_both_parsers_streamed_is_whole(parts, size, parser, reason):
    text = "".join(parts)
    reasoning, content, calls, _ = answer(parser, text, reason, size=size)
    expected_reasoning, expected_answer = oracle(parser, text)
    assert (reasoning or "") == expected_reasoning
    if not calls:
        assert (content or "") == expected_answer


def test_two_choices_each_their_own():
    updates = [Update(0, [ChoiceDelta(0, "<think>a</th", 1, None), ChoiceDelta(1, "Hi", 1, None)]),
               Update(0, [ChoiceDelta(0, "ink>b", 1, None, "stop"), ChoiceDelta(1, " <think>", 1, None, "length")])]
    got = client_view(render(QWEN3, False, n=2), updates)
    choices = whole(render(QWEN3, False, n=2), updates)
    assert [(g["reasoning"], g["content"], g["finish"]) for g in got] == [
        ("a", "b", "stop"), ("", "Hi <think>", "length")]
    assert [(c.message.reasoning_content, c.message.content) for c in choices] == [("a", "b"), (None, "Hi <think>")]


def test_without_a_reasoning_parser_nothing_changes():
    (choice,) = whole(render(None, False), steps("<think>x</think>y", 3, "stop"))
    assert (choice.message.reasoning_content, choice.message.content) == (None, "<think>x</think>y")
    (got,) = client_view(render(None, False), steps("<think>x</think>y", 3, "stop"))
    assert (got["reasoning"], got["content"]) == ("", "<think>x</think>y")


# -- which parser -----------------------------------------------------------------------------------

def test_the_flags_names_are_the_registrys():
    assert set(REASONING_PARSERS) == set(PARSERS)
    for name in [*PARSERS, "none", None]:
        ServeConfig(reasoning_parser=name).validate()


def test_an_unknown_name_is_a_one_line_startup_error():
    run = subprocess.run([sys.executable, "-m", "rtp", "serve", "--reasoning-parser", "nope"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert "--reasoning-parser" in lines[0] and "'nope'" in lines[0]
    assert all(name in lines[0] for name in [*PARSERS, "none"])


def test_enable_thinking_false_turns_the_parser_off():
    assert thinks(None) and thinks({}) and thinks({"enable_thinking": True}) and thinks({"documents": []})
    assert not thinks({"enable_thinking": False})


QWEN3_TEMPLATE = (  # the parts of Qwen3's hybrid template that matter here
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}")
R1_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'user' %}<｜User｜>{{ message['content'] }}"
               "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}")
INSTRUCT_2507_TEMPLATE = (  # writes no thinking: only drops old thinking from the history
    "{%- for message in messages %}{%- set content = message.content %}{%- if '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1] %}{%- endif %}<|im_start|>{{ message.role }}\n{{ content }}"
    "<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
    "{# <think> #}")


@pytest.mark.parametrize("template, expected", [
    (QWEN3_TEMPLATE, "qwen3"), (R1_TEMPLATE, "deepseek_r1"), (INSTRUCT_2507_TEMPLATE, None),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None), (None, None)])
def test_the_template_says_which_parser(default_gguf, template, expected):
    tokenizer = Tokenizer(Tokenizer.from_pretrained(default_gguf).backend, chat_template=template)
    assert infer(tokenizer) == expected


def test_the_default_models_template_infers_none(default_gguf):
    assert infer(Tokenizer.from_pretrained(default_gguf)) is None


def test_markers_the_tokenizer_counts_as_special_are_known(default_gguf):
    """skip_special_tokens would drop such a marker from the text: the server keeps special tokens in
    a thinking request's text then."""
    tokenizer = Tokenizer.from_pretrained(default_gguf)
    assert not QWEN3.special_markers(tokenizer)
    tokenizer.backend.add_tokens([tokenizers.AddedToken("</think>", special=True)])
    assert QWEN3.special_markers(tokenizer) and R1.special_markers(tokenizer)
    end = tokenizer.backend.token_to_id("</think>")
    assert tokenizer.decode([end]) == "" and tokenizer.decode([end], skip_special_tokens=False) == "</think>"


def test_the_flag_wins_and_none_turns_the_inference_off(default_gguf):
    qwen3 = Tokenizer(Tokenizer.from_pretrained(default_gguf).backend, chat_template=QWEN3_TEMPLATE)
    assert choose(None, qwen3) == (QWEN3, True)
    assert choose("deepseek_r1", qwen3) == (R1, False)
    assert choose("none", qwen3) == (None, False)
    assert choose(None, Tokenizer.from_pretrained(default_gguf)) == (None, False)
