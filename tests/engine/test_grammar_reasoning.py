"""A grammar after free thinking (StructuredOutputs.reasoning, rtp/engine/grammar/reasoning.py), run
by llguidance on the default model's tokenizer: the thinking is free text (a call, JSON, markers of
other kinds), the first end marker closes it, and from there the request's own grammar holds the
answer, whatever its form. Markers are text here (SmolLM2 spells </think> in three tokens) and, on
the same tokenizer with <think> and </think> added as tokens (as Qwen3's are), special tokens to
llguidance, taken as the token or as the text spelled out; through the compiler and the slots the
engine uses, masks included.
"""

from __future__ import annotations

import llguidance as llg
import numpy as np
import pytest
import tokenizers

from rtp.checkpoint.tokenizer import Tokenizer
from rtp.engine.grammar import GrammarCompiler, GrammarSlots
from rtp.engine.grammar.spec import candidates
from rtp.sampling_params import ReasoningSpan, StructuredOutputs

QWEN3 = ReasoningSpan(start="<think>", end="</think>")
R1 = ReasoningSpan(start="<think>", end="</think>", in_prompt=True)
EOS = 2

FORMS = {  # each form, with an answer it takes and one it does not
    "json": (StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
             '{"a":1}', '{"a":"x"}'),
    "json_object": (StructuredOutputs(json_object=True), '{"b":[1]}', "[1]"),
    "regex": (StructuredOutputs(regex=r"(yes|no) \d"), "no 7", "maybe 7"),
    "choice": (StructuredOutputs(choice=["red", "green"]), "green", "blue"),
    "lark": (StructuredOutputs(grammar='start: "A" b\nb: "B"+'), "ABB", "BA"),
    "gbnf": (StructuredOutputs(grammar='root ::= "x" [0-9]+'), "x42", "y42"),
}
THOUGHT = 'Let me see: <tool_call>{"name": "f"}</tool_call>, {"a": "x"}, <b>maybe</b> </thi'


class Vocab:
    """A tokenizer as llguidance and the server see it; `added`: <think> and </think> as tokens."""

    def __init__(self, path, added: bool):
        self.tokenizer = Tokenizer.from_pretrained(path)
        backend = self.tokenizer.backend
        if added:
            backend.add_tokens([tokenizers.AddedToken("<think>", special=False),
                                tokenizers.AddedToken("</think>", special=False)])
            self.tokenizer = Tokenizer(backend, chat_template=self.tokenizer.chat_template)
        self.size = backend.get_vocab_size()
        self.llg = llg.LLTokenizer(backend.to_str(), n_vocab=self.size, eos_token=[EOS])

    def special(self, text: str) -> int | None:
        token = self.tokenizer.backend.token_to_id(text)
        return token if token is not None and self.llg.is_special_token(token) else None

    def ids(self, text: str, spelled: bool = False) -> list[int]:
        """`text`'s tokens; `spelled`: the markers as text in ordinary tokens, not as their tokens."""
        if not spelled:
            return self.tokenizer.encode(text, add_special_tokens=False)
        out = []
        for piece in text.replace("<think>", "\0<\0think>\0").replace("</think>", "\0</\0think>\0").split("\0"):
            out += self.tokenizer.encode(piece, add_special_tokens=False) if piece else []
        return out

    def matcher(self, spec: StructuredOutputs, span: ReasoningSpan):
        spec = StructuredOutputs(**{f: getattr(spec, f) for f in spec.__struct_fields__ if f != "reasoning"},
                                 reasoning=span)
        for grammar in candidates(spec, self.special)[0]:  # the first that builds, as the compiler takes it
            m = llg.LLMatcher(self.llg, grammar, log_level=0)
            if not m.is_error():
                return m
        raise AssertionError("no candidate builds")


def takes(matcher, ids: list[int]) -> bool:
    """Whether the grammar takes all of `ids` and then may end there."""
    return all(matcher.consume_token(t) for t in ids) and matcher.consume_token(EOS) and matcher.is_stopped()


@pytest.fixture(scope="module", params=[False, True], ids=["text_markers", "token_markers"])
def vocab(request, default_gguf):
    return Vocab(default_gguf, request.param)


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("spelled", [False, True], ids=["as_tokenized", "spelled"])
def test_free_thinking_then_the_answer_held_to_the_grammar(vocab, form, spelled):
    spec, good, bad = FORMS[form]
    outputs = {  # output -> (taken under qwen3's span, taken under deepseek_r1's)
        f"<think>{THOUGHT}</think>\n\n{good}": (True, True),
        f"<think>\n</think>{good}": (True, True),
        f"{THOUGHT}</think> {good}": (False, True),   # thinking opened by the prompt only
        good: (True, False),                           # no thinking: qwen3's may answer at once
        f"<think>{THOUGHT}</think>\n\n{bad}": (False, False),
        f"<think>{THOUGHT}</think></think>{good}": (False, False),  # the first </think> closed it
        f"<think>{THOUGHT}": (False, False),           # the output cannot end in the thinking
    }
    for output, expected in outputs.items():
        got = tuple(takes(vocab.matcher(spec, span), vocab.ids(output, spelled)) for span in (QWEN3, R1))
        assert got == expected, output


def test_markers_are_tokens_where_llguidance_takes_them_as_special(vocab):
    assert (vocab.special("</think>") is not None) == (vocab.size > 49152)
    assert vocab.special("x") is None


def mask_of(slots: GrammarSlots, vocab: Vocab) -> set[int]:
    slots.fill(np.array([0]))
    bits = np.unpackbits(slots.bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab.size]
    return set(np.flatnonzero(bits).tolist())


@pytest.mark.parametrize("spelled", [False, True], ids=["as_tokenized", "spelled"])
@pytest.mark.parametrize("span", [QWEN3, R1], ids=["qwen3", "deepseek_r1"])
def test_through_the_compiler_and_the_slots_the_thinking_is_free_and_the_answer_masked(vocab, span, spelled):
    compiler = GrammarCompiler(vocab.tokenizer, vocab.size, [EOS], workers=1)
    try:
        template = compiler.compile(StructuredOutputs(choice=["red", "green"], reasoning=span)).result(60)
    finally:
        compiler.close()
    slots = GrammarSlots(1, 1, vocab.size)
    slots.set(0, template.deep_copy())
    opening = vocab.ids("<think>") if not span.in_prompt else []
    for token in opening + vocab.ids("I think so."):
        failed, done = slots.advance(np.array([0]), np.array([token]), set())
        assert not failed and not done
    thinking = mask_of(slots, vocab)
    assert len(thinking) > 0.9 * 49152 and EOS not in thinking  # any text, and no end before the answer
    for token in vocab.ids("</think>\n", spelled):  # the text after it is the answer's, however </think> came
        slots.advance(np.array([0]), np.array([token]), set())
    answer = mask_of(slots, vocab)
    assert 0 < len(answer) < 200 and {vocab.ids("red")[0], vocab.ids("green")[0]} <= answer
    for token in vocab.ids("green"):
        failed, done = slots.advance(np.array([0]), np.array([token]), set())
        assert not failed
    assert done == {0}  # the answer complete: the request ends with stop
