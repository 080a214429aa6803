"""The OpenAI-compatible HTTP API: Starlette routes over an AsyncEngine.

Handlers run on the event loop and do only cheap work: decode the body
(msgspec), check its fields, tokenize, submit the request to the engine thread,
await its admission there (the engine checks the request against the model and
compiles its grammar: rtp/server/async_engine.py) and stream back what it sends.
The loop never calls into the engine itself. Every rejection is an OpenAI-shaped error body
`{"error": {"message", "type", "param", "code"}}`; nothing a client sends can
raise past a handler, so one bad request never takes the server down.

    POST /v1/completions, /v1/chat/completions   generate (SSE when "stream": true)
    GET  /v1/models, /health, /metrics
    POST /tokenize, /detokenize
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from rtp.errors import EngineFull, InvalidRequest, one_line
from rtp.sampling_params import SamplingParams
from rtp.server.async_engine import AsyncEngine, EngineDead, Stream
from rtp.server.conversation import plain_messages, template_kwargs
from rtp.server.metrics import ServerMetrics
from rtp.server.pd import PDNode, PeerError
from rtp.server.protocol import (
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    asks_for,
    encoder,
)
from rtp.server import reasoning_parsers
from rtp.server.render import ChatRender, CompletionRender
from rtp.http import EventStream
from rtp.server.structured import logit_bias, structured_outputs
from rtp.server.tools import plan_tools
from rtp.wire.error_body import error_body

log = logging.getLogger("rtp.serve")

_OFF_LOOP_CHARS = 16 << 10  # prompts this long or longer are tokenized off the event loop
_OFF_LOOP_TOKENS = 4096     # token lists this long or longer are checked and decoded off the event loop


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param)

    def response(self) -> Response:
        return Response(self.body(), self.status, self.headers, media_type="application/json")


def _engine_error(e: Exception, grammar_field: str | None = None) -> APIError:
    """The error an engine-side failure of one request shows its client (rtp/errors.py); a failure
    of its grammar names the field the grammar came from (response_format, guided_json, ..., tools)."""
    if isinstance(e, InvalidRequest):  # refused before it ran, or its grammar failed it
        param = grammar_field if e.param == "structured_outputs" and grammar_field else e.param
        return APIError(400, str(e), param)
    if isinstance(e, EngineFull):
        return APIError(503, f"the server is overloaded: {e}", headers={"Retry-After": "1"})
    if isinstance(e, EngineDead):
        return APIError(503, f"the engine is down: {e}")
    if isinstance(e, PeerError):  # the decode node failed it: another pair may not (the master retries)
        return APIError(503, str(e))
    return APIError(500, f"the request failed: {e!r}")


def _json_media_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def _until_disconnected(request: Request, work):
    """Await `work` and return its result, but give up (_ClientGone, `work` cancelled) as soon as
    the client hangs up."""
    job = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((job, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not job.done():
            job.cancel()
    if not job.done() or job.cancelled():
        raise _ClientGone()
    if gone.done() and not gone.cancelled():
        # both ended in one turn of the loop: the disconnect is read and will never come again, so a
        # response would stream to nobody (its own watch for the disconnect waits forever) -- the
        # work's result, a Stream already admitted, is closed (aborted) here instead
        if job.exception() is None and hasattr(job.result(), "close"):
            job.result().close()
        raise _ClientGone()
    return job.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _ClientGone(Exception):
    pass


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, *, model_names: list[str],
                 model_root: str | None = None, model_aliases: tuple[str, ...] = (), api_key: str | None = None, max_body_bytes: int = 8 << 20, max_queue: int = 512,
                 pd: PDNode | None = None, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None):
        self.engine = engine
        self.pd = pd  # the RPC routes; on a prefill node, the relay through a decode node
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.model_names = model_names
        # what /v1/models says the model is (a name or Hub ID, never a path on this machine), and names
        # "model" may also give (the path --model was given as) without /v1/models listing them
        self.model_root = model_root or model_names[0]
        self.model_aliases = model_aliases
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.max_queue = max_queue
        self.tool_call_parser = tool_call_parser
        # given, or the one the chat template calls for (rtp/server/reasoning_parsers.py choose)
        self.reasoning, self.reasoning_inferred = reasoning_parsers.choose(reasoning_parser, self.tokenizer)
        # where the tokenizer counts a marker as a special token, skip_special_tokens would drop it
        self._reasoning_markers_special = self.reasoning is not None and self.reasoning.special_markers(self.tokenizer)
        self.draining = False
        self.created = int(time.time())
        # one thread: large prompts are tokenized one at a time, beside the loop and the engine
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="rtp-tokenize")

    def routes(self) -> list[Route]:
        api = self._api
        return [
            Route("/v1/completions", api(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", api(self.chat_completions), methods=["POST"]),
            Route("/v1/models", api(self.models), methods=["GET"]),
            Route("/tokenize", api(self.tokenize), methods=["POST"]),
            Route("/detokenize", api(self.detokenize), methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_text, methods=["GET"]),
            *(self.pd.routes() if self.pd is not None else []),
        ]

    def _api(self, handler):
        """Wrap a handler: API key first; every failure becomes an OpenAI error body."""

        async def endpoint(request: Request) -> Response:
            try:
                self._authorize(request)
                return await handler(request)
            except APIError as e:
                return e.response()
            except (_ClientGone, ClientDisconnect):
                return Response(status_code=499)  # nobody reads it; the request was aborted
            except Exception as e:
                log.exception("%s %s failed", request.method, request.url.path)
                return APIError(500, f"internal error: {e!r}").response()

        return endpoint

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or incorrect API key (send Authorization: Bearer <key>)",
                           headers={"WWW-Authenticate": "Bearer"})

    async def _decode(self, request: Request, kind: type, unsupported: tuple[str, ...] = ()):
        """The body as `kind`. 415 for a body that does not say it is JSON (text/plain is a request
        any web page can send cross-origin without asking), 413 past the size limit, 400 for what
        does not decode (named where msgspec names it) or asks for a field rtp does not implement."""
        content_type = request.headers.get("content-type")
        if content_type is not None and not _json_media_type(content_type):
            raise APIError(415, f"the body must be JSON (Content-Type: application/json), not {content_type}")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise APIError(413, f"the body has {length} bytes, more than the limit of {self.max_body_bytes}")
        chunks, size = [], 0
        async for chunk in request.stream():  # counted as it comes: chunked bodies carry no length
            size += len(chunk)
            if size > self.max_body_bytes:
                raise APIError(413, f"the body exceeds the limit of {self.max_body_bytes} bytes")
            chunks.append(chunk)
        data = b"".join(chunks)
        try:
            body = msgspec.json.decode(data, type=kind)
            keys = msgspec.json.decode(data, type=dict[str, msgspec.Raw]).keys()  # a scan, values unparsed
        except msgspec.ValidationError as e:
            # "Expected `int`, got `str` - at `$.n`", "Object missing required field `prompt`"
            where = re.search(r"`\$\.(\w+)|required field `(\w+)`", str(e))
            raise APIError(400, str(e), where and (where.group(1) or where.group(2))) from None
        except msgspec.DecodeError as e:
            raise APIError(400, f"the body is not valid JSON: {e}") from None
        except RecursionError:
            raise APIError(400, "the body is nested too deeply") from None
        unknown = sorted(keys - set(kind.__struct_fields__))
        if unknown:  # a field rtp does not know might have mattered: never answer as if it were absent
            raise APIError(400, f"`{unknown[0]}` is not a field rtp takes on {request.url.path}", unknown[0])
        n = getattr(body, "n", 1)
        for name in unsupported:
            if asks_for(name, getattr(body, name), n):
                raise APIError(400, f"`{name}` is not supported by rtp", name)
        if getattr(body, "stream_options", None) is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
        return body

    def _model(self, name: str | None) -> str:
        if name is None:
            return self.model_names[0]
        if name not in self.model_names and name not in self.model_aliases:
            raise APIError(400, f"the model `{name}` does not exist; this server serves "
                           f"{', '.join(self.model_names)}", "model")
        return name

    # -- generation --------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        body = await self._decode(request, CompletionRequest, UNSUPPORTED_COMPLETION)
        model = self._model(body.model)
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported (no prompt logprobs)", "echo")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params, grammar_field = self._params(body, max_tokens, body.logprobs)
        texts, prompts = await self._completion_prompts(body.prompt)
        stream = await self._start(request, "cmpl", prompts, params, "prompt", grammar_field)
        echo = [t if t is not None else self.tokenizer.decode(p) for t, p in zip(texts, prompts)] \
            if body.echo else None
        render = CompletionRender(stream.request_id, model, self.tokenizer, prompts, params.n,
                                  logprobs=body.logprobs is not None, echo=echo)
        return await self._respond(request, body, stream, render, grammar_field)

    async def chat_completions(self, request: Request) -> Response:
        body = await self._decode(request, ChatCompletionRequest, UNSUPPORTED_CHAT)
        model = self._model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params, grammar_field = self._params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
        try:
            tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                               parser=self.tool_call_parser, template=self.tokenizer.chat_template,
                               structured=params.structured_outputs is not None)
        except InvalidRequest as e:
            raise APIError(400, str(e), e.param) from None
        if tools is not None and tools.grammar is not None:
            params.structured_outputs, grammar_field = tools.grammar, "tools"
        if tools is not None and tools.choice == "auto" and tools.parser != "hermes":
            params.skip_special_tokens = False  # [TOOL_CALLS] and <|python_tag|> are special tokens
        ids = await self._chat_prompt(body.messages, body.add_generation_prompt, body.chat_template_kwargs,
                                      tools.tools if tools is not None else None)
        reasoning = self.reasoning if reasoning_parsers.thinks(body.chat_template_kwargs) else None
        if reasoning is not None and params.structured_outputs is not None:
            # the grammar (the request's own or its tools') holds the answer, and lets the thinking through
            params.structured_outputs = msgspec.structs.replace(params.structured_outputs, reasoning=reasoning.span())
        if reasoning is not None and self._reasoning_markers_special:
            params.skip_special_tokens = False  # the parser reads the markers in the text
        stream = await self._start(request, "chatcmpl", [ids], params, "messages", grammar_field)
        render = ChatRender(stream.request_id, model, self.tokenizer, [ids], params.n,
                            top_logprobs=(body.top_logprobs or 0) if body.logprobs else None, tools=tools,
                            reasoning=reasoning)
        return await self._respond(request, body, stream, render, grammar_field)

    async def _completion_prompts(self, prompt) -> tuple[list[str | None], list[list[int]]]:
        """(texts, token ids) of each prompt of a completion request."""
        if isinstance(prompt, str) or not prompt or all(isinstance(t, int) for t in prompt):
            items = [prompt]  # one prompt ([] is one empty prompt)
        elif all(isinstance(p, (str, list)) for p in prompt):
            items = prompt
        else:
            raise APIError(400, "prompt must be a string, a list of strings, a list of token ids "
                           "or a list of token id lists", "prompt")
        texts = [item if isinstance(item, str) else None for item in items]
        size = sum(len(t) for t in texts if t is not None)
        prompts = await self._off_loop(size, lambda: [self.tokenizer.encode(item) if isinstance(item, str)
                                                      else item for item in items])
        return texts, prompts

    async def _off_loop(self, size: int, work, threshold: int = _OFF_LOOP_CHARS):
        """Run `work` (tokenizing, rendering a template, detokenizing) here when its input is small,
        else on the tokenizing thread: a prompt of megabytes takes seconds, and the loop must keep
        answering."""
        if size < threshold:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, work)

    async def _chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool,
                           kwargs: dict | None, tools: list[dict] | None = None) -> list[int]:
        """The conversation checked (rtp/server/conversation.py) and rendered through the chat template."""
        try:
            plain, size = plain_messages(messages, self.tokenizer.chat_template)
            extra, extra_size = template_kwargs(kwargs)
        except InvalidRequest as e:
            raise APIError(400, str(e), e.param) from None
        if tools is not None:
            extra["tools"] = tools

        def render() -> list[int]:
            return self.tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt,
                                                      tokenize=True, **extra)

        try:
            return await self._off_loop(size + extra_size, render)
        except Exception as e:  # the template rejected these messages (raise_exception, turn order)
            raise APIError(400, f"the chat template failed on these messages: {one_line(str(e))}",
                           "messages") from None

    def _params(self, body, max_tokens: int | None, logprobs: int | None) -> tuple[SamplingParams, str | None]:
        """The request's SamplingParams, and the field its structured output came from (to name)."""
        def given(value, default):
            return default if value is None else value

        try:
            spec, field = structured_outputs(body)
            return SamplingParams(
                logit_bias=logit_bias(body.logit_bias), structured_outputs=spec,
                n=body.n, temperature=given(body.temperature, 1.0), top_p=given(body.top_p, 1.0),
                top_k=given(body.top_k, 0), min_p=given(body.min_p, 0.0),
                presence_penalty=given(body.presence_penalty, 0.0),
                frequency_penalty=given(body.frequency_penalty, 0.0),
                repetition_penalty=given(body.repetition_penalty, 1.0), seed=body.seed,
                max_tokens=max_tokens, min_tokens=body.min_tokens, stop=body.stop,
                stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, logprobs=logprobs,
                skip_special_tokens=body.skip_special_tokens,
                include_stop_str_in_output=body.include_stop_str_in_output), field
        except InvalidRequest as e:
            raise APIError(400, str(e), e.param) from None

    async def _start(self, request: Request, kind: str, prompts: list[list[int]], params: SamplingParams,
                     prompt_param: str, grammar_field: str | None) -> Stream:
        """Submit the request and wait for the engine's admission (rtp/server/async_engine.py): its
        Stream, or the refusal as an APIError (a 400 naming the field, its grammar's by the name the
        client gave it; a 503 when the engine is full or down). It runs here, or on a prefill node
        through its decode node (rtp/server/pd/). A client that hangs up meanwhile withdraws it,
        its grammar's compile included."""
        request_id = f"{kind}-{uuid.uuid4().hex}"
        client = request.client.host if request.client is not None else "unknown"  # the compiler's fairness
        relayed = self.pd is not None and self.pd.relays(len(prompts), params)
        self._admit(1 if relayed else len(prompts) * params.n)
        try:
            if relayed:
                peer = self.pd.peer_for(request.headers)
                work = self.pd.start(request_id, prompts[0], params, peer, client=client, prompt_param=prompt_param)
            else:
                work = self.engine.submit(request_id, prompts, params, client=client, prompt_param=prompt_param)
            return await _until_disconnected(request, work)
        except PeerError as e:
            log.warning("%s", e)
            raise APIError(503, str(e), headers={"Retry-After": "1"}) from None
        except (InvalidRequest, EngineFull, EngineDead) as e:
            raise _engine_error(e, grammar_field) from None

    def _admit(self, sequences: int) -> None:
        """Room in the queue for `sequences` more (prompts x n): the queue bounds the work waiting,
        so one request of many prompts or a large n cannot lock everyone else out."""
        if self.engine.dead is not None:
            raise APIError(503, f"the engine is down: {self.engine.dead}")
        if self.draining:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": "5"})
        waiting = self.engine.num_unstarted
        if waiting + sequences > self.max_queue and (waiting or sequences > self.max_queue):
            raise APIError(503, f"the server is overloaded: {waiting} sequences are waiting and this request "
                           f"adds {sequences} (limit {self.max_queue}); retry later", headers={"Retry-After": "1"})

    async def _respond(self, request: Request, body, stream: Stream, render, grammar_field: str | None) -> Response:
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return EventStream(self._events(stream, render, usage, grammar_field), on_close=stream.close)
        try:
            await _until_disconnected(request, self._collect(stream, render, grammar_field))
        finally:
            stream.close()
        return Response(encoder.encode(render.response()), media_type="application/json")

    async def _collect(self, stream: Stream, render, grammar_field: str | None) -> None:
        async for updates in stream:
            for update in updates:
                if update.error is not None:
                    raise _engine_error(update.error, grammar_field)
                render.add(update)

    async def _events(self, stream: Stream, render, include_usage: bool,
                      grammar_field: str | None) -> AsyncIterator[bytes]:
        opening = render.opening()
        if opening:
            yield opening
        async for updates in stream:
            buf = bytearray()
            for update in updates:
                if update.error is not None:
                    # the status line is long gone: the error travels as an event, then the stream ends
                    error = _engine_error(update.error, grammar_field)
                    log.warning("stream %s failed: %s", stream.request_id, error.message)
                    yield bytes(buf) + b"data: " + error.body() + b"\n\ndata: [DONE]\n\n"
                    return
                render.write_chunks(update, buf)
            if buf:
                yield bytes(buf)
        if include_usage:
            yield render.usage_chunk()
        yield b"data: [DONE]\n\n"

    # -- the rest ---------------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        cards = [ModelCard(id=name, created=self.created, root=self.model_root, max_model_len=self.max_model_len)
                 for name in self.model_names]
        return Response(encoder.encode(ModelList(cards)), media_type="application/json")

    async def tokenize(self, request: Request) -> Response:
        body = await self._decode(request, TokenizeRequest)
        self._model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            ids = await self._chat_prompt(body.messages, body.add_generation_prompt, None)
        else:
            ids = await self._off_loop(len(body.prompt), lambda: self.tokenizer.encode(
                body.prompt, add_special_tokens=body.add_special_tokens))
        return Response(encoder.encode(TokenizeResponse(len(ids), self.max_model_len, ids)),
                        media_type="application/json")

    async def detokenize(self, request: Request) -> Response:
        body = await self._decode(request, DetokenizeRequest)
        self._model(body.model)
        vocab = self.engine.vocab_size

        def decode() -> str | None:
            if not all(0 <= t < vocab for t in body.tokens):
                return None
            return self.tokenizer.decode(body.tokens)

        # a million ids take a quarter of a second to check and decode: never on the loop
        text = await self._off_loop(len(body.tokens) * 4, decode, threshold=_OFF_LOOP_TOKENS * 4)
        if text is None:
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
        return Response(encoder.encode(DetokenizeResponse(text)), media_type="application/json")

    async def health(self, request: Request) -> Response:
        if self.engine.dead is not None:
            return APIError(503, f"the engine is down: {self.engine.dead!r}").response()
        if self.draining:
            return APIError(503, "the server is shutting down").response()
        return Response(status_code=200)

    async def metrics_text(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return APIError(exc.status_code, exc.detail or "error").response()


def build_app(serving: OpenAIServing, lifespan=None) -> Starlette:
    return Starlette(routes=serving.routes(), exception_handlers={HTTPException: _http_error},
                     lifespan=lifespan)
