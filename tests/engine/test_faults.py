"""Fault isolation in the engine itself (rtp/errors.py, LLMEngine.step), on the real default model.

A fault caused by one request -- its sampling row, a token outside the vocabulary, its
detokenizer -- fails that request alone: the others in the same steps finish with exactly
the tokens they would have had, and the runtime's state holds together. A fault of a
shared stage is EngineFatal. Requests that used to kill the engine are refused up front.
"""

from __future__ import annotations

import pytest

from rtp import LLM, SamplingParams
from rtp.checkpoint import tokenizer as tokenizer_module
from rtp.engine import sampler as sampler_module
from rtp.errors import EngineFatal, InvalidRequest

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primary colors.",
             "What is 12 times 7?", "Who wrote Romeo and Juliet?"]
MARK = 1.25  # a presence_penalty that marks the request the injected fault hits
AFTER = 3    # the fault hits once the marked request has this many tokens: mid-generation


@pytest.fixture(scope="module")
def llm(default_gguf):
    return LLM(model=str(default_gguf), dtype="float32", compile=False, max_model_len=256, max_num_seqs=8)


def prompts(llm):
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                              tokenize=True) for q in QUESTIONS]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kw)


def assert_idle(llm):
    engine = llm.engine
    assert not engine.has_unfinished_requests() and not len(engine.requests) and not len(engine.outputs)
    engine.scheduler.check_integrity()
    assert engine.allocator.num_used == 0


def run_with_one_faulty(llm, faulty: int):
    params = [greedy(presence_penalty=MARK) if i == faulty else greedy() for i in range(len(QUESTIONS))]
    return llm.generate(prompts(llm), params)


def check_isolated(llm, outs, faulty: int, message: str):
    clean = llm.generate(prompts(llm), greedy())
    for i, (out, ref) in enumerate(zip(outs, clean)):
        if i == faulty:
            assert out.error is not None and message in str(out.error)
            assert out.finished and out.outputs[0].finish_reason == "error"
        else:
            assert out.error is None
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids, i
            assert out.outputs[0].text == ref.outputs[0].text
    assert_idle(llm)


def test_a_sampler_that_raises_for_one_request_fails_it_alone(llm, monkeypatch):
    gather = sampler_module.SamplingBatch.gather.__func__

    def faulty_gather(cls, settings, slots, tokens, **kw):
        marked = settings.presence[slots] == MARK
        if marked.any() and (tokens.output_lengths(slots)[marked] >= AFTER).any():
            raise RuntimeError("injected sampler failure")
        return gather(cls, settings, slots, tokens, **kw)

    monkeypatch.setattr(sampler_module.SamplingBatch, "gather", classmethod(faulty_gather))
    outs = run_with_one_faulty(llm, faulty=2)
    assert len(outs[2].outputs[0].token_ids) == AFTER  # it had streamed tokens before the fault
    monkeypatch.undo()
    check_isolated(llm, outs, 2, "injected sampler failure")


def test_a_token_outside_the_vocabulary_fails_its_request_alone(llm, monkeypatch):
    call = sampler_module.Sampler.__call__

    def wild(self, logits, batch):
        out = call(self, logits, batch)
        if batch.any_penalty:  # only the marked request has a penalty
            rows = batch.pen_rows.tolist() if batch.pen_rows is not None else [0]
            out.token_ids[rows] = 10 ** 7
        return out

    monkeypatch.setattr(sampler_module.Sampler, "__call__", wild)
    outs = run_with_one_faulty(llm, faulty=0)
    monkeypatch.undo()
    check_isolated(llm, outs, 0, "outside the vocabulary")


def test_a_detokenizer_that_raises_for_one_request_fails_it_alone(llm, monkeypatch):
    marked = prompts(llm)[3]
    init, add = tokenizer_module.IncrementalDetokenizer.__init__, tokenizer_module.IncrementalDetokenizer.add

    def faulty_init(self, tok, prompt_ids=(), **kw):
        init(self, tok, prompt_ids, **kw)
        self.faulty = list(prompt_ids) == marked
        self.added = 0

    def faulty_add(self, token_id):
        if self.faulty and self.added >= AFTER:
            raise RuntimeError("injected detokenizer failure")
        self.added += 1
        return add(self, token_id)

    monkeypatch.setattr(tokenizer_module.IncrementalDetokenizer, "__init__", faulty_init)
    monkeypatch.setattr(tokenizer_module.IncrementalDetokenizer, "add", faulty_add)
    outs = llm.generate(prompts(llm), greedy())
    monkeypatch.undo()
    check_isolated(llm, outs, 3, "injected detokenizer failure")


def test_a_fault_with_n_choices_fails_every_choice(llm, monkeypatch):
    call = sampler_module.Sampler.__call__

    def raising(self, logits, batch):
        if batch.any_penalty:
            raise RuntimeError("injected")
        return call(self, logits, batch)

    monkeypatch.setattr(sampler_module.Sampler, "__call__", raising)
    ids = prompts(llm)
    outs = llm.generate([ids[0], ids[1]], [greedy(presence_penalty=MARK, n=3), greedy(n=2)])
    monkeypatch.undo()
    assert outs[0].error is not None and [o.finish_reason for o in outs[0].outputs] == ["error"] * 3
    assert outs[1].error is None and all(len(o.token_ids) == 12 for o in outs[1].outputs)
    assert_idle(llm)


@pytest.fixture
def doomed(default_gguf):
    """An engine of its own, for tests that end it."""
    return LLM(model=str(default_gguf), dtype="float32", compile=False, max_model_len=128).engine


def test_a_failing_forward_is_fatal(doomed, monkeypatch):
    def broken():
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(doomed.runner, "forward", broken)
    doomed.add_request("r", [1, 2, 3], greedy())
    with pytest.raises(EngineFatal, match="device fell over"):
        doomed.step()


class _CorruptScheduler:
    """The real scheduler, but its integrity check fails: what a runtime bug would look like."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def check_integrity(self):
        raise AssertionError("block 3: refcount 2 but 1 holders")


def test_an_integrity_failure_after_a_request_fault_is_fatal(doomed, monkeypatch):
    engine = doomed

    def raising(self, logits, batch):
        raise RuntimeError("injected")

    monkeypatch.setattr(sampler_module.Sampler, "__call__", raising)
    engine.core.scheduler = _CorruptScheduler(engine.scheduler)  # the runtime the step runs on
    engine.add_request("r", [1, 2, 3], greedy())
    with pytest.raises(EngineFatal, match="integrity check failed.*refcount"):
        engine.step()


@pytest.mark.parametrize("kw, param", [
    (dict(top_k=9223372036854775808), "top_k"),          # overflowed an int64 tensor in the sampler
    (dict(min_tokens=2, stop_token_ids=[100000]), "stop_token_ids"),  # indexed past the vocabulary
    (dict(top_k=49153), "top_k"),
    (dict(max_tokens=300), "max_tokens"),
    (dict(min_tokens=300, max_tokens=None), "min_tokens"),
    (dict(n=129), "n"),
    (dict(seed=2 ** 64), "seed"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
])
def test_requests_that_used_to_kill_the_engine_are_refused(llm, kw, param):
    with pytest.raises(InvalidRequest) as info:
        llm.generate("hi", SamplingParams(**kw))
    assert info.value.param == param
    assert_idle(llm)


@pytest.mark.parametrize("kw", [
    dict(top_p=1e-300),                # below float32's range: taken as its smallest value (top token only)
    dict(min_p=1e-300),                # rounds to 0 in float32: off, its limit
    dict(temperature=1e300),           # above float32's range: its largest value
    dict(repetition_penalty=1e-300, temperature=0.7),  # pushed seen logits to +inf
    dict(repetition_penalty=1e300, temperature=0.7),
    dict(temperature=1e-300),          # greedy
])
def test_extreme_floats_sample_tokens_in_the_vocabulary(llm, kw):
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=4, ignore_eos=True, seed=1, **kw))[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 4
    assert all(0 <= t < llm.engine.model_config.vocab_size for t in out.outputs[0].token_ids)
    if kw.get("top_p") == 1e-300 or kw.get("temperature") == 1e-300:
        greedy_out = llm.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0,
                                                                             ignore_eos=True))[0]
        assert out.outputs[0].token_ids == greedy_out.outputs[0].token_ids
    assert_idle(llm)


def test_prompt_ids_are_checked_against_the_vocabulary(llm):
    for bad in ([1, 49152], [-1], [1.5], [True]):
        with pytest.raises(InvalidRequest, match="prompt token ids") as info:
            llm.generate([bad], SamplingParams(max_tokens=2))
        assert info.value.param == "prompt"
    assert_idle(llm)
