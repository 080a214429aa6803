"""The offline API: `rtp.LLM(...).generate(prompts, SamplingParams(...))`, shaped like vLLM's."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rtp.config import EngineConfig
from rtp.engine.engine import LLMEngine
from rtp.engine.output import RequestOutput
from rtp.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """Offline generation over a batch of prompts.

    >>> llm = LLM()                      # the default SmolLM2-135M-Instruct
    >>> out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
    ...                SamplingParams(temperature=0, max_tokens=16))
    >>> out[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", **config):
        self.engine = LLMEngine(EngineConfig.from_flat(model=model, dtype=dtype, **config))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in the prompts' order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        for p in params:
            p.validate()  # every prompt checked before any is queued
        results: dict[str, RequestOutput] = {}
        try:
            for prompt, p in zip(prompts, params):
                request_id = self._next_id()
                text = prompt if isinstance(prompt, str) else None
                ids = self.tokenizer.encode(prompt) if text is not None else list(prompt)
                self.engine.add_request(request_id, ids, p)
                results[request_id] = RequestOutput.start(request_id, text, ids, p)
        except Exception:
            for request_id in results:
                self.engine.abort_request(request_id)
            raise
        return self._run(results, use_tqdm)

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | None = None, add_generation_prompt: bool = True, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template; `tools`
        (OpenAI's function list) and `chat_template_kwargs` reach the template, as vLLM's LLM.chat."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        extra = dict(chat_template_kwargs or {})
        if tools is not None:
            extra["tools"] = tools
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt,
                                                      tokenize=True, **extra) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _next_id(self) -> str:
        self._counter += 1
        return f"offline-{self._counter}"

    def _run(self, results: dict[str, RequestOutput], use_tqdm: bool | None) -> list[RequestOutput]:
        """Step until every request finished, adding each step's deltas to its output."""
        show = sys.stderr.isatty() if use_tqdm is None else use_tqdm
        bar = None
        if show:
            from tqdm import tqdm

            bar = tqdm(total=len(results), desc="generating", unit="req", file=sys.stderr)
        pending = len(results)
        while pending:
            for delta in self.engine.step():
                out = results.get(delta.request_id)
                if out is None or out.finished:
                    continue
                out.add(delta)
                if out.finished:
                    pending -= 1
                    if bar is not None:
                        bar.update(1)
            if pending and not self.engine.has_unfinished_requests():
                raise RuntimeError(f"engine stopped with {pending} requests unfinished")
        if bar is not None:
            bar.close()
        return list(results.values())
