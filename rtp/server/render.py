"""Engine updates -> OpenAI response bodies and SSE chunks, one renderer per request.

A renderer counts usage as updates pass and either accumulates them into one
response (`add`, then `response`) or writes each as a `data: {json}\\n\\n` event
(`write_chunks`). Streaming reuses one chunk Struct per request, mutated and
re-encoded for every event, so a token costs an encode into the event buffer
and nothing more.
"""

from __future__ import annotations

import time

from rtp.server.async_engine import ChoiceDelta, Update
from rtp.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    FunctionCall,
    FunctionCallDelta,
    PromptTokensDetails,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
    encoder,
)
from rtp.server.reasoning_parsers import ReasoningParser
from rtp.server.tool_parsers import CallArguments, CallStart, Content
from rtp.server.tools import ToolPlan


class _Render:
    def __init__(self, request_id: str, model: str, tokenizer, prompts: list[list[int]], n: int):
        self.id = request_id
        self.model = model
        self.tokenizer = tokenizer
        self.created = int(time.time())
        self.n = n
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.completion_tokens = 0
        self.cached = [0] * len(prompts)
        slots = len(prompts) * n  # choice slot = prompt index * n + choice index
        self.texts: list[list[str]] = [[] for _ in range(slots)]
        self.entries: list[list[dict[int, float]]] = [[] for _ in range(slots)]
        self.finish: list[tuple[str | None, int | str | None]] = [(None, None)] * slots
        self._token_texts: dict[int, str] = {}

    def _count(self, update: Update) -> None:
        self.cached[update.prompt] = update.num_cached_tokens
        for d in update.choices:
            self.completion_tokens += d.num_tokens

    def add(self, update: Update) -> None:
        """Accumulate for a non-streamed response."""
        self._count(update)
        for d in update.choices:
            slot = update.prompt * self.n + d.index
            self.texts[slot].append(d.text)
            if d.logprobs:
                self.entries[slot].extend(d.logprobs)
            if d.finish_reason is not None:
                self.finish[slot] = (d.finish_reason, d.stop_reason)

    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.completion_tokens, self.prompt_tokens + self.completion_tokens,
                     PromptTokensDetails(sum(self.cached)))

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    @staticmethod
    def _event(chunk, buf: bytearray) -> None:
        buf += b"data: "
        encoder.encode_into(chunk, buf, -1)
        buf += b"\n\n"

    @staticmethod
    def _skip(d: ChoiceDelta) -> bool:
        # a token that completed no text (half a UTF-8 character, a held-back stop prefix) sends nothing
        return not d.text and d.finish_reason is None and not d.logprobs


class CompletionRender(_Render):
    def __init__(self, request_id, model, tokenizer, prompts, n, *, logprobs: bool, echo: list[str] | None):
        super().__init__(request_id, model, tokenizer, prompts, n)
        self.logprobs = logprobs
        self.echo = echo
        self.offsets = [0] * len(self.texts)  # text_offset of the next token, per slot
        self._choice = CompletionChoice(0, "")
        self._chunk = CompletionResponse(id=request_id, created=self.created, model=model, choices=[self._choice])

    def opening(self) -> bytes:
        if self.echo is None:
            return b""
        buf = bytearray()
        for slot in range(len(self.texts)):
            self._choice.index, self._choice.text = slot, self.echo[slot // self.n]
            self._event(self._chunk, buf)
        return bytes(buf)

    def _logprobs(self, slot: int, entries: list[dict[int, float]]) -> CompletionLogprobs:
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for entry in entries:
            token_id, logprob = next(iter(entry.items()))  # the sampled token comes first
            text = self.token_text(token_id)
            offsets.append(self.offsets[slot])
            self.offsets[slot] += len(text)
            tokens.append(text)
            token_logprobs.append(logprob)
            tops.append({self.token_text(t): lp for t, lp in entry.items()})
        return CompletionLogprobs(offsets, token_logprobs, tokens, tops)

    def write_chunks(self, update: Update, buf: bytearray) -> None:
        self._count(update)
        c = self._choice
        for d in update.choices:
            if self._skip(d):
                continue
            slot = update.prompt * self.n + d.index
            c.index, c.text, c.finish_reason, c.stop_reason = slot, d.text, d.finish_reason, d.stop_reason
            c.logprobs = self._logprobs(slot, d.logprobs) if self.logprobs and d.logprobs else None
            self._event(self._chunk, buf)

    def usage_chunk(self) -> bytes:
        buf = bytearray()
        self._event(CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[],
                                       usage=self.usage()), buf)
        return bytes(buf)

    def response(self) -> CompletionResponse:
        choices = []
        for slot, parts in enumerate(self.texts):
            text = "".join(parts)
            if self.echo is not None:
                text = self.echo[slot // self.n] + text
            logprobs = self._logprobs(slot, self.entries[slot]) if self.logprobs else None
            reason, stop = self.finish[slot]
            choices.append(CompletionChoice(slot, text, logprobs, reason, stop))
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  usage=self.usage())


class ChatRender(_Render):
    """Each choice's text goes through its reasoning parser (the thinking becomes reasoning_content),
    then what it answers through its tool parser (calls out of the content): a chain, so no call is
    read out of the thinking. Either may be absent."""

    def __init__(self, request_id, model, tokenizer, prompts, n, *, top_logprobs: int | None,
                 tools: ToolPlan | None = None, reasoning: type[ReasoningParser] | None = None):
        super().__init__(request_id, model, tokenizer, prompts, n)
        self.top_logprobs = top_logprobs  # None: no logprobs
        self.tools = tools
        self.reasoning = reasoning
        # streaming: per choice, one parser splits the thinking off as it comes, one reads the calls
        self.reasoners = [reasoning() for _ in range(n)] if reasoning is not None else [None] * n
        self.parsers = [tools.new_parser() for _ in range(n)] if tools is not None else [None] * n
        self.called = [False] * n
        self._choice = ChatChunkChoice(0, ChatDelta())
        self._chunk = ChatCompletionChunk(id=request_id, created=self.created, model=model,
                                          choices=[self._choice])

    def opening(self) -> bytes:
        # as OpenAI does: each choice opens with the role and empty content
        buf = bytearray()
        self._choice.delta = ChatDelta(role="assistant", content="")
        for index in range(self.n):
            self._choice.index = index
            self._event(self._chunk, buf)
        self._choice.delta = ChatDelta()
        return bytes(buf)

    def _token(self, token_id: int, logprob: float) -> tuple[str, float, list[int]]:
        text = self.token_text(token_id)
        return text, logprob, list(text.encode())

    def _logprobs(self, entries: list[dict[int, float]]) -> ChatLogprobs:
        content = []
        for entry in entries:
            token_id, logprob = next(iter(entry.items()))  # the sampled token comes first
            # the entry holds the top k plus the sampled token when it is not among them
            top = sorted(entry.items(), key=lambda kv: -kv[1])[: self.top_logprobs]
            content.append(TokenLogprob(*self._token(token_id, logprob),
                                        [TopLogprob(*self._token(t, lp)) for t, lp in top]))
        return ChatLogprobs(content)

    def write_chunks(self, update: Update, buf: bytearray) -> None:
        self._count(update)
        c = self._choice
        for d in update.choices:
            if self._skip(d):
                continue
            reason, thought, text = d.finish_reason, "", d.text
            reasoner, parser = self.reasoners[d.index], self.parsers[d.index]
            if reasoner is not None:
                thought, text = reasoner.feed(d.text) if d.text else ("", "")
                if reason is not None:
                    rest = reasoner.finish()
                    thought, text = thought + rest.reasoning, text + rest.content
            if parser is not None:
                events = parser.feed(text) if text else []
                if reason is not None:
                    events += parser.finish()
                deltas = self._tool_deltas(d.index, events)
                if reason == "stop" and self.called[d.index]:
                    reason = "tool_calls"
            else:
                deltas = [(text, None)] if text else []
            # (reasoning_content, content, tool_calls): the thinking comes first in the text
            deltas = [(None, content, calls) for content, calls in deltas]
            if thought:
                deltas.insert(0, (thought, None, None))
            if not deltas:
                if reason is None and not d.logprobs:
                    continue  # held back: it may be (the start of) a marker or a call
                deltas = [(None, None, None)]
            # one event per delta: the step's logprobs go with the first, its finish with the last
            c.index, last = d.index, len(deltas) - 1
            c.logprobs = self._logprobs(d.logprobs) if self.top_logprobs is not None and d.logprobs else None
            for i, (reasoning, content, calls) in enumerate(deltas):
                c.delta.reasoning_content, c.delta.content, c.delta.tool_calls = reasoning, content, calls
                c.finish_reason, c.stop_reason = (reason, d.stop_reason) if i == last else (None, None)
                self._event(self._chunk, buf)
                c.logprobs = None
        c.delta.reasoning_content = c.delta.tool_calls = None

    def _tool_deltas(self, index: int, events: list) -> list[tuple[str | None, list[ToolCallDelta] | None]]:
        """A parser's events as deltas (content, calls), as OpenAI streams a call: its id, type and
        name first, then its arguments in pieces, each piece a delta of its own."""
        deltas: list = []
        for e in events:
            if isinstance(e, Content):
                if deltas and deltas[-1][1] is None:
                    deltas[-1] = (deltas[-1][0] + e.text, None)
                else:
                    deltas.append((e.text, None))
            elif isinstance(e, CallStart):
                self.called[index] = True
                deltas.append((None, [ToolCallDelta(e.index, e.id, "function", FunctionCallDelta(e.name, ""))]))
            elif isinstance(e, CallArguments):
                deltas.append((None, [ToolCallDelta(e.index, function=FunctionCallDelta(arguments=e.text))]))
        return deltas

    def usage_chunk(self) -> bytes:
        buf = bytearray()
        self._event(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                                        usage=self.usage()), buf)
        return bytes(buf)

    def response(self) -> ChatCompletionResponse:
        choices = []
        for index, parts in enumerate(self.texts):
            logprobs = self._logprobs(self.entries[index]) if self.top_logprobs is not None else None
            reason, stop = self.finish[index]
            thought, content = "", "".join(parts)
            if self.reasoning is not None:  # the same parsers as a stream's: the same thinking, content, calls
                thought, content = self.reasoning().parse(content)
            # a reply that was all thinking has no content (null), as one of calls only has none
            message = AssistantMessage(content if content or not thought else None, "assistant", thought or None)
            parser = self.tools.new_parser() if self.tools is not None else None
            if parser is not None:
                parsed = parser.parse(content)
                if parsed.calls:
                    message.content = parsed.content
                    message.tool_calls = [ToolCall(call.id, FunctionCall(call.name, call.arguments))
                                          for call in parsed.calls]
                    reason = "tool_calls" if reason == "stop" else reason
            choices.append(ChatChoice(index, message, logprobs, reason, stop))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=self.usage())
