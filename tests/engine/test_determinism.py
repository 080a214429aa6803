"""Deterministic by default (docs/determinism.md): a request's tokens and logprobs are the same bits
alone and beside any mix of other requests -- whatever arrives when, at any row position, greedy or
seeded -- on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) in its default dtype (bf16).

Each mix is a random draw (prompt lengths, max_tokens, arrival steps, sampling) from a fixed seed, so a
failure names a mix that reproduces; every request of it is then run alone in the same engine and
compared bit for bit.
"""

from __future__ import annotations

import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rtp import LLM, SamplingParams
from rtp.engine.output import RequestOutput
from rtp.kernels import quant

WORDS = ("the river owl tea stone lamp quiet north seven paper bridge winter song garden copper "
         "market letter candle harbor meadow thunder violin orchard").split()


def make_requests(rng: random.Random, count: int, prefix: list[int] | None = None):
    """count (prompt ids, params): prompts of 3-120 tokens (some sharing `prefix`), greedy or seeded."""
    out = []
    for i in range(count):
        ids = [rng.randrange(200, 40000) for _ in range(rng.randint(3, 120))]
        if prefix is not None and rng.random() < 0.5:
            ids = prefix + ids[:20]
        seeded = rng.random() < 0.4
        params = SamplingParams(max_tokens=rng.randint(4, 40), ignore_eos=True, logprobs=2,
                                temperature=0.8 if seeded else 0.0, top_p=0.95 if seeded else 1.0,
                                seed=rng.randrange(1 << 30) if seeded else None)
        out.append((ids, params))
    return out


def mix(seed: int, count: int = 12, span: int = 20, repeat: bool = False):
    """(requests, arrival steps) of a random mix from `seed`: count requests (make_requests) arriving over
    `span` steps; repeat: each prompt its first 8 tokens over again (so that n-gram drafts match)."""
    rng = random.Random(seed)
    requests = make_requests(rng, count)
    if repeat:
        requests = [((ids[:8] * 6)[:60], params) for ids, params in requests]
    return requests, [rng.randrange(0, span) for _ in requests]


def run(llm: LLM, requests, arrivals: list[int]) -> list[tuple[list[int], list]]:
    """Each request added at its arrival step (counted in engine steps); its tokens and logprobs."""
    engine = llm.engine
    results: dict[str, RequestOutput] = {}
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    step = added = 0
    while added < len(order) or engine.has_unfinished_requests():
        while added < len(order) and arrivals[order[added]] <= step:
            i = order[added]
            ids, params = requests[i]
            engine.add_request(f"det-{i}", ids, params)
            results[f"det-{i}"] = RequestOutput.start(f"det-{i}", None, ids, params)
            added += 1
        for delta in engine.step():
            results[delta.request_id].add(delta)
        step += 1
    outs = [results[f"det-{i}"].outputs[0] for i in range(len(requests))]
    return [(o.token_ids, o.logprobs) for o in outs]


def alone(llm: LLM, requests) -> list[tuple[list[int], list]]:
    return [run(llm, [r], [0])[0] for r in requests]


def assert_same(mixed, single):
    for i, ((toks, lps), (want_toks, want_lps)) in enumerate(zip(mixed, single)):
        assert toks == want_toks, f"request {i}: tokens differ from the same request alone"
        assert lps == want_lps, f"request {i}: logprobs differ from the same request alone"


def assert_same_as_alone(engine: LLM, llm: LLM, requests, arrivals, stat: tuple[str, int]) -> None:
    """The mix on `engine`, whose stats()[name] must pass `least` (what it is there to exercise
    happened), each request against itself alone on the plain engine llm."""
    mixed = run(engine, requests, arrivals)
    name, least = stat
    assert engine.engine.stats()[name] > least, engine.engine.stats()
    assert_same(mixed, alone(llm, requests))


@pytest.fixture(scope="module")
def llm(default_gguf):
    assert quant.deterministic()  # the default
    return LLM(model=str(default_gguf), max_model_len=512, max_num_seqs=16)


@pytest.fixture(scope="module")
def chunked(default_gguf):
    """Prompts in chunks of at most 40 tokens a step (shared by every prompt of the step), no prefix cache."""
    return LLM(model=str(default_gguf), max_model_len=512, max_num_seqs=16, max_num_batched_tokens=40,
               enable_prefix_caching=False)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_request_gets_the_same_bits_alone_and_in_any_mix(llm, seed):
    """Random mixes: 12 requests arriving over 20 steps, so each decodes beside 0-11 others, in every
    row position, beside prompt chunks and alone at its tail. Run alone afterwards, each prompt hits the
    prefix cache up to its last whole block (the mix cached it), so a prompt whose last token is alone
    past a block boundary (seed 2 has two) prefills that one token -- as a prompt chunk, with prefill
    attention, as in the mix (a one-token chunk once took decode attention and other bits)."""
    requests, arrivals = mix(seed)
    assert_same(run(llm, requests, arrivals), alone(llm, requests))


@pytest.mark.parametrize("seed", [3, 4])
def test_prompt_chunk_boundaries_do_not_change_a_request(llm, chunked, seed):
    """A mix whose prompts are cut into chunks of up to 40 tokens a step, wherever the other prompts of
    the step leave the boundary (one-token chunks included), against each request alone in one chunk."""
    requests, arrivals = mix(seed)
    assert_same(run(chunked, requests, arrivals), alone(llm, requests))


def test_a_prefix_cache_hit_on_a_prompt_gives_the_same_bits(llm):
    """Prompts sharing a 64-token prefix (four whole blocks): the later ones hit the prefix cache and
    prefill only their tails, beside the same requests run alone after a miss."""
    rng = random.Random(7)
    prefix = [rng.randrange(200, 40000) for _ in range(64)]
    requests = make_requests(rng, 8, prefix=prefix)
    arrivals = [2 * i for i in range(len(requests))]
    # alone, every prompt is then a hit up to its last whole block (cached by the mix)
    assert_same(run(llm, requests, arrivals), alone(llm, requests))


def test_preemption_and_recompute_do_not_change_a_request(llm, default_gguf):
    """A KV pool of 33 blocks for a mix that needs more: the newest requests are preempted and later
    recomputed -- their generated tokens on decode rows, as they were first computed -- and every
    request still gets the bits it gets alone in a pool with room."""
    tight = LLM(model=str(default_gguf), max_model_len=512, max_num_seqs=16, kv_cache_memory=12 << 20)
    assert_same_as_alone(tight, llm, *mix(0), ("num_preemptions", 0))


def test_n_gram_speculation_does_not_change_a_request(llm, default_gguf):
    """Requests whose prompts repeat (so that n-gram drafts are accepted), in a mix on an engine that
    drafts 4 tokens a step, against each alone on a plain engine: the same tokens and logprobs, greedy
    and seeded (a draft is verified on decode rows, as the token would have been decoded)."""
    speculating = LLM(model=str(default_gguf), max_model_len=512, max_num_seqs=16, speculative="ngram",
                      num_speculative_tokens=4, speculative_measured=False)
    assert_same_as_alone(speculating, llm, *mix(11, count=8, span=10, repeat=True), ("spec_accepted_tokens", 20))


def test_speculation_leaves_a_prompts_last_token_to_prefill(llm, default_gguf):
    """Prompts of 48 tokens cut 47 + 1 by the chunk budget, on an engine that drafts: the prompt's
    lone last token is not drafted after (drafts make every row of a request a decode row, and that
    token would take decode attention where alone it takes prefill attention: other bits); drafting
    starts from its first generated token."""
    speculating = LLM(model=str(default_gguf), max_model_len=512, max_num_seqs=16, speculative="ngram",
                      num_speculative_tokens=4, speculative_measured=False, max_num_batched_tokens=47,
                      enable_prefix_caching=False)
    requests = [r for r in mix(12, count=12, repeat=True)[0] if len(r[0]) == 48][:4]
    assert len(requests) == 4
    assert_same_as_alone(speculating, llm, requests, [0, 4, 8, 12], ("spec_accepted_tokens", 4))


def test_a_draft_models_speculation_does_not_change_a_request(llm, default_gguf):
    """The same with a draft model (the default GGUF drafting for itself, 4 tokens a step): its drafts are
    verified on the target's decode rows, so every request gets the bits it gets alone on a plain engine."""
    drafting = LLM(model=str(default_gguf), max_model_len=512, max_num_seqs=16, speculative_model=str(default_gguf),
                   num_speculative_tokens=4, speculative_measured=False)
    assert_same_as_alone(drafting, llm, *mix(1, count=8, span=10), ("spec_accepted_tokens", 20))


ONE_THREAD = """
import pickle, sys
sys.path.insert(0, {here!r})
from test_determinism import mix, run
from rtp import LLM
llm = LLM(model={model!r}, max_model_len=512, max_num_seqs=16)
sys.stdout.buffer.write(pickle.dumps(run(llm, *mix(5))))
"""


def test_the_thread_count_does_not_change_a_request(llm, default_gguf):
    """No kernel splits one row's sums over threads: the same mix on one thread (a process of its own)
    gives every request the bits it gets on this process's threads."""
    if torch.get_num_threads() < 2:
        pytest.skip("this process runs one thread already")
    code = ONE_THREAD.format(here=str(Path(__file__).parent), model=str(default_gguf))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert_same(pickle.loads(done.stdout), run(llm, *mix(5)))


def test_the_one_row_kernels_are_a_switch_away(default_gguf):
    """--no-deterministic brings back the exact one-row kernels for a lone request (faster on one
    stream, docs/determinism.md); the switch is the engine's, restored for the rest of the process by
    the next engine built."""
    with quant.determinism(True):
        fast = LLM(model=str(default_gguf), max_model_len=256, max_num_seqs=2, deterministic=False)
        assert not quant.deterministic()
        out = fast.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0]
        assert len(out.token_ids) == 4
    assert quant.deterministic()
