"""Speculative decoding (n-gram) end to end: a request's output is what it would have been.

The default model (SmolLM2-135M-Instruct, bf16, rtp's kernels) is asked to quote and to edit
text, which its n-gram drafts copy. A request decoding alone runs its drafts through the exact
one-row kernels it decodes with a token a step; several requests run the AMX kernels at every
row count: either way every kernel treats rows independently, so greedy and seeded output must
match the plain engine token for token. Unseeded sampling is held to the plain engine's
distribution on a tiny model (chi-square)."""

from __future__ import annotations

import pytest

from rtp import LLM, SamplingParams

from speculation import (TEXT, assert_drafted_positions_distributed_as_plain,
                         assert_logprobs_stops_and_min_tokens_are_plain, assert_seeded_sampling_is_plain, chat,
                         first_tokens_by_position)

CODE = '''def area(shapes):
    total = 0
    for shape in shapes:
        if shape.kind == "square":
            total += shape.side * shape.side
        elif shape.kind == "circle":
            total += 3.14159 * shape.radius * shape.radius
    return total
'''
ASKS = [f"Repeat this text exactly:\n\n{TEXT}", f"Summarise this text in two sentences:\n\n{TEXT}",
        f"Rename the function to total_area and return the same code:\n\n{CODE}",
        "Write a short poem about the sea.", "What is the capital of France?"]


@pytest.fixture(scope="module")
def engines(default_gguf):
    plain = LLM(dtype="bfloat16", max_num_seqs=16, kv_cache_memory=256 << 20)
    spec = LLM(dtype="bfloat16", max_num_seqs=16, kv_cache_memory=256 << 20, speculative="ngram",
               num_speculative_tokens=4, speculative_measured=False)  # these tests count drafts: at every size
    return plain, spec


def test_greedy_alone_is_token_for_token_what_it_was(engines):
    plain, spec = engines
    sp = SamplingParams(temperature=0, max_tokens=96)
    s = spec.engine.scheduler
    for ask in ASKS:
        ids = chat(plain, ask)
        want = plain.generate([ids], sp, use_tqdm=False)[0].outputs[0]
        before = s.spec_accepted_tokens
        got = spec.generate([ids], sp, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want.token_ids and got.text == want.text and got.finish_reason == want.finish_reason
        if ask == ASKS[0]:  # quoting: most of its tokens were drafted and kept (33 of 41 here). Not the total
            # over every ask: that hung on whether the code ask fell into a repetition loop, a near-tie of logits
            assert s.spec_accepted_tokens - before > len(got.token_ids) // 2
    assert spec.engine.allocator.num_used == 0
    s.check_integrity()


def test_greedy_batched_is_token_for_token_what_it_was(engines):
    """Beside a companion that never drafts (a penalty keeps it a token a step) and outlives them,
    every step holds several requests in both engines: the AMX kernels, bit for bit per row."""
    plain, spec = engines
    sp = SamplingParams(temperature=0, max_tokens=64)
    companion = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, presence_penalty=0.1)
    prompts = [chat(plain, a) for a in ASKS]

    def run(llm):
        outs = llm.generate([chat(llm, "Count to five hundred.")] + prompts, [companion] + [sp] * len(prompts),
                            use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs[1:]]

    assert run(spec) == run(plain)


def test_seeded_sampling_is_what_it_was_and_reproduces_itself(engines):
    plain, spec = engines
    assert_seeded_sampling_is_plain(plain, spec, chat(plain, ASKS[0]), max_tokens=80)


def test_logprobs_stop_strings_and_min_tokens_are_what_they_were(engines):
    plain, spec = engines
    assert_logprobs_stops_and_min_tokens_are_plain(plain, spec, chat(plain, ASKS[0]))


def test_verified_tokens_go_out_as_one_delta_and_nothing_leaks(engines):
    _, spec = engines
    engine = spec.engine
    engine.add_request("quote", chat(spec, ASKS[0]), SamplingParams(temperature=0, max_tokens=60))
    widest = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            for choice in delta.choices:
                assert choice.num_tokens == len(choice.token_ids)
                widest = max(widest, choice.num_tokens)
        engine.scheduler.check_integrity()
    assert widest > 1  # several kept drafts and the model's own token, in one delta
    assert engine.allocator.num_used == 0


def test_structured_outputs_and_penalties_decode_a_token_a_step(engines):
    _, spec = engines
    s = spec.engine.scheduler
    ids = chat(spec, ASKS[0])
    from rtp.sampling_params import StructuredOutputs

    for sp in (SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.1),
               SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputs(regex="[A-Z][a-z ]+"))):
        before = s.spec_draft_tokens
        spec.generate([ids], sp, use_tqdm=False)
        assert s.spec_draft_tokens == before


def test_unseeded_sampling_keeps_the_plain_distribution(tmp_path):
    """A tiny random model, temperature 1 over its top 8: the prompt holds every token once, so
    whatever was sampled last was seen before and every step drafts what followed it there (kept
    when sampled again). The tokens are distributed as without drafts: rejected at p < 1e-4
    (normal approximation of the chi-square)."""
    from tiny_models import make_dense, write_word_tokenizer

    path, _ = make_dense("llama", tmp_path)
    write_word_tokenizer(tmp_path, 160)
    prompt = list(range(1, 160))
    _, plain = first_tokens_by_position(str(path), prompt, seed=1)
    llm, spec = first_tokens_by_position(str(path), prompt, seed=2, speculative="ngram", num_speculative_tokens=3,
                                         speculative_max_running=32, speculative_measured=False)
    assert llm.engine.scheduler.spec_draft_tokens > 1000  # the drafts were verified, and some kept
    assert llm.engine.scheduler.spec_accepted_tokens > 0
    assert_drafted_positions_distributed_as_plain(plain, spec)
