"""What both drafters' end-to-end tests hold (tests/engine/test_speculative.py: n-gram;
tests/engine/test_draft_model.py: a draft model): a request's output with drafts is what it is
without them, greedy, seeded, with logprobs and stops, and unseeded sampling keeps its
distribution."""

from __future__ import annotations

from collections import Counter

import pytest

from rtp import LLM, SamplingParams

from stats import same_distribution

TEXT = ("The Amazon rainforest covers much of the Amazon basin of South America. The basin covers seven "
        "million square kilometres, of which five and a half million are covered by the rainforest. The "
        "region includes territory belonging to nine nations and 3,344 indigenous territories.")


def chat(llm: LLM, text: str) -> list[int]:
    return llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def assert_seeded_sampling_is_plain(plain: LLM, spec: LLM, ids: list[int], max_tokens: int) -> None:
    """A seeded row draws each token's noise from (seed, its index in the output): a drafted position
    draws what the plain engine draws for that token, and the seed reproduces itself."""
    sp = SamplingParams(temperature=0.7, top_p=0.95, seed=11, max_tokens=max_tokens, n=2)
    want = [c.token_ids for c in plain.generate([ids], sp, use_tqdm=False)[0].outputs]
    got = [c.token_ids for c in spec.generate([ids], sp, use_tqdm=False)[0].outputs]
    assert got == want
    assert [c.token_ids for c in spec.generate([ids], sp, use_tqdm=False)[0].outputs] == got


def assert_logprobs_stops_and_min_tokens_are_plain(plain: LLM, spec: LLM, ids: list[int]) -> None:
    sp = SamplingParams(temperature=0, max_tokens=80, logprobs=2, stop=["square kilometres"], min_tokens=20)
    want = plain.generate([ids], sp, use_tqdm=False)[0].outputs[0]
    got = spec.generate([ids], sp, use_tqdm=False)[0].outputs[0]
    assert got.text == want.text and got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    assert len(got.logprobs) == len(want.logprobs) == len(got.token_ids)
    for a, b in zip(got.logprobs, want.logprobs):
        assert a.keys() == b.keys() and all(a[t] == pytest.approx(b[t], abs=1e-5) for t in a)


def first_tokens_by_position(model: str, prompt: list[int], **engine) -> tuple[LLM, list[Counter]]:
    """An engine of `model` (fp32, 32 sequences) and the tokens it samples at each of the first 4
    positions: 300 requests of 10 choices, temperature 1 over the top 8."""
    sp = SamplingParams(temperature=1.0, top_k=8, max_tokens=4, n=10, ignore_eos=True)  # 10 running: rows spare
    llm = LLM(model=model, dtype="float32", max_num_seqs=32, **engine)
    by_position = [Counter() for _ in range(4)]
    for _ in range(300):
        for choice in llm.generate([prompt], sp, use_tqdm=False)[0].outputs:
            for i, t in enumerate(choice.token_ids):
                by_position[i][t] += 1
    return llm, by_position


def assert_drafted_positions_distributed_as_plain(plain: list[Counter], spec: list[Counter]) -> None:
    """Positions 1-3 (those drafts can reach) as without drafts: rejected at p < 1e-4. The two engines
    must have other seeds: one seed would draw the same random numbers in both, so their tokens
    would agree far more than two independent samples do, and hide a difference."""
    for position in range(1, 4):
        same, stat, df = same_distribution(plain[position], spec[position])
        assert same, (position, stat, df)
