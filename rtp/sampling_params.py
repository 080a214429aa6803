"""SamplingParams: how one request turns logits into tokens and when it stops.

The field names and defaults follow vLLM's SamplingParams (and through it the
OpenAI API), so a request body maps onto it field for field. Validation runs
once, when the object is built (``__post_init__`` also runs when msgspec
decodes one, where a ValueError surfaces as msgspec.ValidationError).
"""

from __future__ import annotations

import msgspec

# Below this temperature a row is sampled greedily: dividing logits by a
# temperature this small only overflows to the same argmax.
GREEDY_TEMPERATURE = 1e-5

MAX_LOGPROBS = 20


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

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or ())
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field whose value is out of range."""
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must not exceed max_tokens, got min_tokens={self.min_tokens} "
                f"> max_tokens={self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        bad = [t for t in self.stop_token_ids or () if t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be non-negative, got {bad}")
        if any(not s for s in self.stop or ()):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0 or top_k 1)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
