"""SamplingParams: how one request turns logits into tokens and when it stops.

The field names and defaults follow vLLM's SamplingParams (and through it the
OpenAI API), so a request body maps onto it field for field. This file is the
one place a request's settings are checked, offline and served alike: types and
ranges when the object is built (`validate`), the bounds the loaded model sets
(vocabulary, context length) when the engine admits it (`validate_for`, called by
LLMEngine.check_request, which the HTTP layer calls too before it queues).
Every refusal is an InvalidRequest naming its field.
"""

from __future__ import annotations

import math

import msgspec

from rtp.errors import InvalidRequest

# Below this temperature a row is sampled greedily: dividing logits by a
# temperature this small only overflows to the same argmax.
GREEDY_TEMPERATURE = 1e-5

MAX_LOGPROBS = 20
MAX_N = 128  # completions per prompt, as the OpenAI API caps n


class ReasoningSpan(msgspec.Struct, kw_only=True, frozen=True):
    """The thinking a reasoning model writes before its answer, which a grammar lets through as free
    text: the grammar constrains the answer after it (as vLLM's structured outputs do with a
    reasoning parser; rtp/engine/grammar/reasoning.py builds the grammar).

    start      the marker that opens the thinking
    end        the marker that closes it; the answer follows (after any whitespace)
    in_prompt  the prompt opened the thinking (DeepSeek-R1's template): the output begins inside it,
               and a `start` it writes first anyway is let through. Else the thinking is optional and
               opens with `start` at the very start of the output, or the output is all answer.
    """

    start: str
    end: str
    in_prompt: bool = False


class StructuredOutputs(msgspec.Struct, kw_only=True, frozen=True):
    """What a request's output must match; exactly one form (vLLM's StructuredOutputsParams).

    json         a JSON Schema (a dict, or its JSON text)
    json_object  any JSON object (the OpenAI API's JSON mode)
    regex        a regular expression the whole output matches
    choice       one of these strings, exactly
    grammar      a context-free grammar: GBNF/EBNF as llama.cpp and vLLM take it, or Lark
    grammar_syntax  "lark" or "gbnf" to say which the grammar is (default: tried as GBNF when it has
                 `::=`, then as Lark; rtp/engine/grammar/spec.py)
    whitespace_pattern  JSON only: a regex for the whitespace allowed between tokens of the document
                 (default: none, one canonical layout)
    reasoning    not a form: free thinking before the output the form constrains (ReasoningSpan;
                 the server sets it for a request its --reasoning-parser reads)
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    grammar_syntax: str | None = None
    whitespace_pattern: str | None = None
    reasoning: ReasoningSpan | None = None

    def validate(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise InvalidRequest(f"structured outputs take exactly one of json, json_object, regex, choice or "
                                 f"grammar, got {given or 'none'}", "structured_outputs")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidRequest("the JSON schema must be an object (or its JSON text)", "structured_outputs")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequest("choice must be a non-empty list of non-empty strings", "structured_outputs")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequest(f"{name} must be a non-empty string", "structured_outputs")
        if self.whitespace_pattern is not None:
            if self.json is None and not self.json_object:
                raise InvalidRequest("whitespace_pattern applies to JSON only", "structured_outputs")
            if not isinstance(self.whitespace_pattern, str):
                raise InvalidRequest("whitespace_pattern must be a string (a regex)", "structured_outputs")
        if self.grammar_syntax is not None:
            if self.grammar is None:
                raise InvalidRequest("grammar_syntax applies to a grammar only", "structured_outputs")
            if self.grammar_syntax not in ("lark", "gbnf"):
                raise InvalidRequest(f"grammar_syntax must be lark or gbnf, got {self.grammar_syntax!r}",
                                     "structured_outputs")
        if self.reasoning is not None:
            span = self.reasoning
            if not isinstance(span, ReasoningSpan) or not all(
                    isinstance(marker, str) and marker for marker in (span.start, span.end)):
                raise InvalidRequest("reasoning must be a ReasoningSpan with non-empty start and end markers",
                                     "structured_outputs")


class SamplingParams(msgspec.Struct, kw_only=True):
    """Per-request sampling and stopping settings.

    n                   completions per prompt (the engine forks n sequences;
                        each child should get ``seed + i`` when ``seed`` is set,
                        else all n would draw the same tokens)
    temperature         0 = greedy; otherwise logits are divided by it
    top_p               nucleus mass in (0, 1]; 1 = off
    top_k               keep the k most likely tokens; 0 or -1 = off
    min_p               drop tokens with p < min_p * p_max; 0 = off
    presence_penalty    OpenAI: subtracted once from tokens already generated
    frequency_penalty   OpenAI: subtracted per occurrence in the generated tokens
    repetition_penalty  HF/CTRL: over prompt + generated tokens, positive logits
                        are divided by it, negative ones multiplied; 1 = off
    seed                per-request seed: same request, same seed, same tokens,
                        whatever else runs in the batch
    max_tokens          cap on generated tokens; None = up to the model length
    min_tokens          eos and stop_token_ids are masked until this many
                        tokens have been generated
    stop                strings that end generation (normalised to a list)
    stop_token_ids      token ids that end generation, besides eos
    ignore_eos          keep going past eos
    logprobs            None = no logprobs; k = the sampled token's logprob plus
                        the top k (0 = only the sampled token's)
    logit_bias          token id -> a bias in [-100, 100] added to its logit before
                        sampling (OpenAI's semantics: -100 bans it, 100 all but forces it)
    structured_outputs  a grammar the output must match (StructuredOutputs)
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, (list, tuple)) or self.stop_token_ids is None:
            self.stop_token_ids = list(self.stop_token_ids or ())
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequest naming the first field whose value is of the wrong type or out of
        range. What needs the model (vocabulary, context length) is checked by validate_for()."""
        _integer("n", self.n, 1, MAX_N)
        _number("temperature", self.temperature, 0.0, None)
        _number("top_p", self.top_p, 0.0, 1.0, "in (0, 1]")
        if self.top_p == 0.0:
            raise InvalidRequest("top_p must be a finite number in (0, 1], got 0", "top_p")
        if _integer("top_k", self.top_k, None, None) < -1:
            raise InvalidRequest(f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k}", "top_k")
        _number("min_p", self.min_p, 0.0, 1.0)
        _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _number("repetition_penalty", self.repetition_penalty, 0.0, None, "greater than 0")
        if self.repetition_penalty == 0.0:
            raise InvalidRequest(f"repetition_penalty must be positive, got {self.repetition_penalty}",
                                 "repetition_penalty")
        if self.seed is not None:
            _integer("seed", self.seed, -(1 << 63), (1 << 63) - 1)
        if self.max_tokens is not None:
            _integer("max_tokens", self.max_tokens, 1, None)
        _integer("min_tokens", self.min_tokens, 0, None)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest(
                f"min_tokens must not exceed max_tokens, got min_tokens={self.min_tokens} "
                f"> max_tokens={self.max_tokens}", "min_tokens")
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if not isinstance(self.stop_token_ids, list):
            raise InvalidRequest("stop_token_ids must be a list of token ids", "stop_token_ids")
        for t in self.stop_token_ids:
            _integer("stop_token_ids", t, 0, None)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequest("stop must be a string or a list of strings", "stop")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty", "stop")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidRequest("logit_bias must map token ids to biases", "logit_bias")
            for token, bias in self.logit_bias.items():
                _integer("logit_bias", token, 0, None)
                _number("logit_bias", bias, -100.0, 100.0)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise InvalidRequest("structured_outputs must be a StructuredOutputs", "structured_outputs")
            self.structured_outputs.validate()
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(f"{name} must be true or false, got {getattr(self, name)!r}", name)

    def validate_for(self, prompt_len: int, *, vocab_size: int, max_model_len: int,
                     prompt_param: str = "prompt") -> None:
        """What the loaded model bounds: token ids below its vocabulary, top_k at most its size
        (vLLM's rule), and prompt + max_tokens (and min_tokens) within its context length."""
        if self.top_k > vocab_size:
            raise InvalidRequest(f"top_k must be at most the vocabulary size {vocab_size}, or -1 or 0 "
                                 f"for no limit; got {self.top_k}", "top_k")
        bad = [t for t in self.logit_bias or () if t >= vocab_size]
        if bad:
            raise InvalidRequest(f"logit_bias token ids must be below the vocabulary size {vocab_size}, got "
                                 f"{bad[:8]}", "logit_bias")
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise InvalidRequest(f"stop_token_ids must be below the vocabulary size {vocab_size}, got {bad[:8]}",
                                 "stop_token_ids")
        if prompt_len >= max_model_len:
            raise InvalidRequest(f"This model's maximum context length is {max_model_len} tokens. However, your "
                                 f"prompt has {prompt_len} tokens, which leaves no room for a completion.",
                                 prompt_param)
        room = max_model_len - prompt_len
        if self.max_tokens is not None and self.max_tokens > room:
            raise InvalidRequest(f"This model's maximum context length is {max_model_len} tokens. However, you "
                                 f"requested {prompt_len + self.max_tokens} tokens ({prompt_len} in the prompt, "
                                 f"{self.max_tokens} in the completion). Please reduce the length.", "max_tokens")
        if self.min_tokens > room:
            raise InvalidRequest(f"min_tokens {self.min_tokens} does not fit: the prompt has {prompt_len} tokens "
                                 f"and the context length is {max_model_len}", "min_tokens")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0 or top_k 1)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _integer(name: str, value, low: int | None, high: int | None):
    """An int (not a bool) in [low, high]; returns it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer, got {value!r}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        where = (f"in [{low}, {high}]" if low is not None and high is not None
                 else f"at least {low}" if low is not None else f"at most {high}")
        raise InvalidRequest(f"{name} must be {where}, got {value}", name)
    return value


def _number(name: str, value, low: float | None, high: float | None, words: str | None = None) -> bool:
    """A finite int or float in [low, high] (NaN and infinities refused); returns True."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{name} must be a number, got {value!r}", name)
    if not math.isfinite(value) or (low is not None and value < low) or (high is not None and value > high):
        where = words or (f"in [{low}, {high}]" if high is not None else f"at least {low}")
        raise InvalidRequest(f"{name} must be a finite number {where}, got {value}", name)
    return True
