"""The OpenAI API's request and response bodies, as msgspec Structs.

Requests decode straight from the body bytes (`msgspec.json.decode(body, type=...)`):
a wrong type fails there, with the path of the field, before any handler code runs.
Field names and defaults follow the OpenAI API; the sampling extras (top_k, min_p,
repetition_penalty, stop_token_ids, ignore_eos, ...) follow vLLM.

Fields that would change what a request returns and that rtp does not implement are
declared too (typed `Any`, so any value decodes), for the handler to refuse by name
(`asks_for`) instead of answering as if they were absent. A few fields are taken and ignored
because no value of theirs can change the output (`_Ignored`: bookkeeping for the client's
side). Any other field is a 400 naming it: a field rtp does not know might have mattered.

The error body is the wire's (rtp/wire/error_body.py): the router writes it too.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

# -- requests -------------------------------------------------------------------------------


# What each unsupported field looks like when it asks for nothing: None, false, "" and empty
# containers always; the values below too (the OpenAI client sends some of them by default).
_INERT: dict[str, tuple] = {
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "length_penalty": (1, 1.0),
    "spaces_between_special_tokens": (True,),
    "typical_p": (1, 1.0),          # llama.cpp's samplers, off at these values
    "tfs_z": (1, 1.0),
    "mirostat": (0,),
    "service_tier": ("auto", "default"),  # how OpenAI schedules a request: rtp runs every one alike
}


def asks_for(name: str, value, n: int = 1) -> bool:
    """Whether an unsupported field's value asks for something rtp would not do."""
    if value is None or value is False or (isinstance(value, (str, list, dict)) and not value):
        return False
    if name == "best_of":  # best of n when n are returned anyway: every one is returned
        return value != n and value != 1
    return value not in _INERT.get(name, ())


class _Ignored(Struct, kw_only=True):
    """Fields taken and never read: the client's own bookkeeping, which no value can turn into a
    different output (tests/server/test_hostile_clients.py holds a request with all of them to the
    same tokens as without). Everything else a body names is read, or refused."""

    user: Any = None               # the end user, for the provider's abuse monitoring
    store: Any = None              # keep the completion for OpenAI's evals/distillation
    metadata: Any = None           # tags for the stored completion
    prompt_cache_key: Any = None   # a hint for OpenAI's prompt cache routing (rtp's cache is by content)
    safety_identifier: Any = None  # the end user, hashed, for abuse monitoring


IGNORED_FIELDS = tuple(_Ignored.__struct_fields__)


class _Unsupported(_Ignored, kw_only=True):
    """Fields of the OpenAI API, vLLM's and llama.cpp's extras that rtp does not implement (see asks_for)."""

    best_of: Any = None
    prompt_logprobs: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    truncate_prompt_tokens: Any = None
    logits_processors: Any = None
    spaces_between_special_tokens: Any = None
    typical_p: Any = None
    tfs_z: Any = None
    mirostat: Any = None
    service_tier: Any = None
    reasoning_effort: Any = None


class StreamOptions(Struct):
    include_usage: bool = False


class _Sampling(_Unsupported, kw_only=True):
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
    # structured outputs and biases (rtp/server/structured.py reads them: any JSON decodes here,
    # so that a wrong shape is a 400 that says what was expected)
    logit_bias: Any = None
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None


class CompletionRequest(_Sampling, kw_only=True):
    # a string, a list of strings, a list of token ids or a list of such lists
    # (msgspec allows one array type per union, so the list's items are checked in the handler)
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16
    max_completion_tokens: int | None = None  # the chat endpoint's name, taken here too; wins when both are set
    logprobs: int | None = None
    echo: bool = False
    suffix: Any = None        # unsupported
    prompt_embeds: Any = None  # unsupported


class TextPart(Struct):
    type: str
    text: str | None = None


class ChatMessage(Struct):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: Any = None    # an assistant's calls (rtp/server/tools.py reads them)
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an assistant's thinking, as a reply gave it (for the template)


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None             # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: int | None = None  # wins over max_tokens when both are set
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # tool calling (rtp/server/tools.py checks them)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    # unsupported
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    echo: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    documents: Any = None


_UNSUPPORTED = tuple(f for f in _Unsupported.__struct_fields__ if f not in IGNORED_FIELDS)
UNSUPPORTED_COMPLETION = _UNSUPPORTED + ("suffix", "prompt_embeds")
UNSUPPORTED_CHAT = _UNSUPPORTED + (
    "functions", "function_call", "audio", "modalities", "prediction",
    "web_search_options", "echo", "continue_final_message", "chat_template", "documents")


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


class FunctionCall(Struct):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class AssistantMessage(Struct, omit_defaults=True):
    # role has no default so that it is always written (omit_defaults leaves out the others when None)
    content: str | None
    role: str
    reasoning_content: str | None = None  # vLLM's: the thinking, with --reasoning-parser
    tool_calls: list[ToolCall] | None = None


class FunctionCallDelta(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Struct, omit_defaults=True):
    # the first delta of a call has its id, type and name; the next ones pieces of its arguments
    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCallDelta | None = None


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
    # the first chunk of a choice carries the role, the others thinking, content or tool calls
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


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


encoder = msgspec.json.Encoder()
