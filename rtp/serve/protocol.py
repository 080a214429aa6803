"""The OpenAI API's request and response bodies, as msgspec Structs.

Requests decode straight from the body bytes (`msgspec.json.decode(body, type=...)`):
a wrong type fails there, with the path of the field, before any handler code runs.
Unknown fields are ignored, as the OpenAI API and vLLM do. Field names and defaults
follow the OpenAI API; the sampling extras (top_k, min_p, repetition_penalty,
stop_token_ids, ignore_eos, ...) follow vLLM.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

# -- requests -------------------------------------------------------------------------------


class StreamOptions(Struct):
    include_usage: bool = False


class _Sampling(Struct, kw_only=True):
    """Fields both generation endpoints share; None means the API's default."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionRequest(_Sampling, kw_only=True):
    # a string, a list of strings, a list of token ids or a list of such lists
    # (msgspec allows one array type per union, so the list's items are checked in the handler)
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class TextPart(Struct):
    type: str
    text: str | None = None


class ChatMessage(Struct):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None             # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: int | None = None  # wins over max_tokens when both are set
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


# -- responses ------------------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(Struct):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's extra: the stop string or token id that ended it


class CompletionResponse(Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[TokenLogprob] | None


class AssistantMessage(Struct):
    content: str | None
    role: str = "assistant"


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(Struct, omit_defaults=True):
    # the first chunk of a choice carries the role, the others only content
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "rtp"
    root: str
    max_model_len: int


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(Struct):
    prompt: str


class ErrorInfo(Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(Struct):
    error: ErrorInfo


encoder = msgspec.json.Encoder()
