"""Speculative decoding in the runtime: n-gram drafts verified as decode rows, the kept ones
appended, the rejected ones' KV given back. The toy model (runtime_sim.repeating_token) mostly
repeats its text, so drafts are often right and sometimes wrong; a request's output must be the
oracle's whatever was drafted, and the runtime's invariants hold after every step."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rtp.runtime import FINISH_LENGTH, FINISH_STOP
from runtime_sim import ToyRunner, make_scheduler, oracle, repeating_token, run_to_completion

VOCAB = 50


def spec_scheduler(k=4, **kw):
    return make_scheduler(num_speculative_tokens=k, **kw)


def test_drafts_are_verified_as_decode_rows_and_the_output_is_the_oracles():
    s = spec_scheduler(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=96)
    r = ToyRunner(s, VOCAB, model=repeating_token)
    prompt = [3, 9, 4, 1, 7, 2, 8] * 3  # period 7: the toy model continues it
    s.add_request(1, prompt, max_tokens=40, speculate=True)
    s.schedule()
    assert s.update(r.forward()) == 1  # the prompt, and the first token
    first = [int(s.event_tokens[0])]
    s.check_integrity()
    s.schedule()
    plan = s.plan
    d = plan.num_rows - 1
    assert d == 4 and plan.num_decode_rows == plan.num_rows == plan.num_samples == 5
    n = len(prompt) + 1
    assert plan.positions[:5].tolist() == list(range(n - 1, n + 4))
    assert plan.seq_lens[:5].tolist() == list(range(n, n + 5))
    assert plan.sample_offsets[:5].tolist() == [0, 1, 2, 3, 4]
    assert (plan.sample_slots[:5] == plan.sample_slots[0]).all()
    events = s.update(r.forward())
    assert 1 <= events <= 5 and s.event_rows[:events].tolist() == list(range(events))
    verified = [int(t) for t in s.event_tokens[:events]]
    s.check_integrity()
    out = run_to_completion(r)
    got = first + verified + out.get(1, [])
    assert got == oracle(prompt, 40, VOCAB, model=repeating_token)
    assert s.spec_draft_tokens > s.spec_accepted_tokens > 0  # some kept, some rejected
    assert s.spec_emitted_tokens == s.spec_accepted_tokens + s.spec_verifications
    assert s.allocator.num_used == 0


def test_without_speculate_a_request_decodes_a_token_a_step():
    s = spec_scheduler()
    r = ToyRunner(s, VOCAB, model=repeating_token)
    s.add_request(1, [3, 9, 4, 1, 7, 2, 8] * 2, max_tokens=10)
    out = run_to_completion(r)
    assert out[1] == oracle([3, 9, 4, 1, 7, 2, 8] * 2, 10, VOCAB, model=repeating_token)
    assert s.spec_draft_tokens == 0


def test_a_stop_id_or_max_tokens_inside_an_accepted_run_ends_it_there():
    prompt = [3, 9, 4, 1, 7, 2, 8] * 3
    want = oracle(prompt, 30, VOCAB, model=repeating_token)
    stop = want[5]
    s = spec_scheduler(max_num_batched_tokens=64, max_model_len=96)
    r = ToyRunner(s, VOCAB, model=repeating_token)
    s.add_request(1, prompt, max_tokens=30, stop_token_ids=[stop], speculate=True)
    s.add_request(2, prompt[:-1], max_tokens=6, speculate=True)
    finishes = {}
    outs: dict[int, list[int]] = {}
    while s.has_unfinished:
        for rid, tok, fin in r.step():
            outs.setdefault(rid, []).append(tok)
            if fin:
                finishes[rid] = fin
        s.check_integrity()
    assert outs[1] == want[: want.index(stop) + 1] and finishes[1] == FINISH_STOP
    assert outs[2] == oracle(prompt[:-1], 6, VOCAB, model=repeating_token) and finishes[2] == FINISH_LENGTH
    assert s.spec_accepted_tokens > 0 and s.allocator.num_used == 0


def test_drafts_take_only_spare_rows_and_never_cost_a_preemption():
    # 2 rows: one request decoding alone may draft one token, never more
    s = spec_scheduler(k=4, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=96)
    r = ToyRunner(s, VOCAB, model=repeating_token)
    s.add_request(1, [3, 9, 4, 1, 7, 2, 8] * 3, max_tokens=12, speculate=True)
    rows = []
    while s.has_unfinished:
        s.schedule()
        rows.append(s.plan.num_rows)
        s.update(r.forward())
        s.check_integrity()
    assert max(rows) == 2 and s.spec_draft_tokens > 0
    # a pool too small for drafts: they shrink, nothing is preempted
    s = spec_scheduler(k=4, num_blocks=8, max_num_batched_tokens=64, max_model_len=28)
    r = ToyRunner(s, VOCAB, model=repeating_token)
    prompt = [3, 9, 4, 1, 7, 2, 8] * 2
    s.add_request(1, prompt, max_tokens=13, speculate=True)
    out = run_to_completion(r)
    assert out[1] == oracle(prompt, 13, VOCAB, model=repeating_token) and s.num_preemptions == 0


def test_an_abort_while_drafts_are_in_flight_frees_everything():
    s = spec_scheduler()
    r = ToyRunner(s, VOCAB, model=repeating_token)
    s.add_request(1, [3, 9, 4, 1, 7, 2, 8] * 2, max_tokens=20, speculate=True)
    r.step()
    s.schedule()
    assert s.plan.num_rows > 1
    s.abort(1)
    s.update(r.forward())
    s.check_integrity()
    assert not s.has_unfinished and s.allocator.num_used == 0


def add_repeating_requests(data, s) -> dict[int, tuple[list[int], int]]:
    """1-6 requests whose prompts repeat a drawn unit (so n-grams match), drafting or not, added to
    scheduler s; request id -> (prompt, max_tokens)."""
    prompts = {}
    for i in range(data.draw(st.integers(1, 6))):
        unit = data.draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=7))
        prompt = (unit * 8)[: data.draw(st.integers(1, 30))]
        max_tokens = data.draw(st.integers(1, 24))
        prompts[i] = (prompt, max_tokens)
        s.add_request(i, prompt, max_tokens=max_tokens, speculate=data.draw(st.booleans()))
    return prompts


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_mix_of_drafting_requests_generates_the_oracles_tokens(data):
    k = data.draw(st.integers(1, 6))
    max_num_seqs = data.draw(st.integers(1, 8))
    s = spec_scheduler(k=k, num_blocks=data.draw(st.integers(24, 64)), max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=data.draw(st.integers(16, 64)), max_model_len=64,
                       spec_ngram_min=data.draw(st.integers(1, 2)), spec_ngram_max=data.draw(st.integers(2, 5)))
    r = ToyRunner(s, VOCAB, model=repeating_token)
    prompts = add_repeating_requests(data, s)
    out = run_to_completion(r)
    for i, (prompt, max_tokens) in prompts.items():
        budget = min(max_tokens, max(64 - len(prompt), 1))
        assert out[i] == oracle(prompt, budget, VOCAB, model=repeating_token)
    assert s.allocator.num_used == 0


# -- drafts from outside the runtime (a draft model's): schedule() reserves rows, set_drafts() fills them --

def external_drafts(s, guess):
    """What a draft model does between schedule() and the forward: for each drafting request of the
    planned step, guess(context) token by token, one per draft row; set_drafts() takes them. Returns
    the drafts by request id."""
    plan = s.plan
    ns = plan.num_samples
    offsets, slots, rids = plan.sample_offsets[:ns], plan.sample_slots[:ns], plan.sample_req_ids[:ns]
    tokens = np.zeros(ns, dtype=np.int64)
    drafted = {}
    for k in range(ns):
        if offsets[k] == 0:
            prompt, out = s.slot_tokens(int(slots[k]))
            context = list(prompt) + list(out)
        else:
            tokens[k] = guess(np.asarray(context))
            context.append(int(tokens[k]))
            drafted.setdefault(int(rids[k]), []).append(int(tokens[k]))
    s.set_drafts(tokens)
    return drafted


def run_with_external_drafts(s, r, guess):
    outputs = {}
    while s.has_unfinished:
        s.schedule()
        drafted = external_drafts(s, guess)
        plan = s.plan
        for rid, drafts in drafted.items():  # the rows now compute the drafts
            rows = np.flatnonzero(plan.sample_req_ids[: plan.num_samples] == rid)
            assert plan.input_ids[plan.logits_indices[rows[1:]]].tolist() == drafts
        n = s.update(r.forward())
        for rid, tok in zip(s.event_req_ids[:n].tolist(), s.event_tokens[:n].tolist()):
            outputs.setdefault(rid, []).append(tok)
        s.check_integrity()
    return outputs


def test_external_drafts_take_every_row_they_may_and_the_output_is_the_oracles():
    prompts = {1: [3, 9, 4, 1, 7, 2, 8] * 3, 2: [5, 6, 11] * 4, 3: [12, 30, 2, 44, 1]}
    for guess, kept in ((lambda c: repeating_token(c, VOCAB), "all"),  # the model itself: every draft kept
                        (lambda c: int(c[-1]), "some"),                # repeat the last token
                        (lambda c: (int(c.sum()) * 7 + 3) % VOCAB, "few")):
        s = spec_scheduler(k=3, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=96, external_drafts=True)
        r = ToyRunner(s, VOCAB, model=repeating_token)
        for rid, prompt in prompts.items():
            s.add_request(rid, prompt, max_tokens=25, speculate=True)
        out = run_with_external_drafts(s, r, guess)
        for rid, prompt in prompts.items():
            assert out[rid] == oracle(prompt, 25, VOCAB, model=repeating_token)
        assert s.spec_draft_tokens > 0 and s.allocator.num_used == 0
        if kept == "all":
            assert s.spec_accepted_tokens == s.spec_draft_tokens
        assert s.spec_emitted_tokens == s.spec_accepted_tokens + s.spec_verifications


def test_set_drafts_refuses_ids_outside_the_vocabulary_and_needs_a_step():
    s = spec_scheduler(k=2, vocab_size=VOCAB, external_drafts=True)
    r = ToyRunner(s, VOCAB, model=repeating_token)
    with pytest.raises(RuntimeError):
        s.set_drafts(np.zeros(4, dtype=np.int64))
    s.add_request(1, [3, 9, 4, 1], max_tokens=10, speculate=True)
    r.step()
    s.schedule()
    ns = s.plan.num_samples
    assert ns == 3 and s.plan.sample_offsets[:3].tolist() == [0, 1, 2]
    last = s.request_state(1)["token_ids"][-1]
    assert (s.plan.input_ids[:3] == last).all()  # placeholders until set_drafts
    with pytest.raises(ValueError, match="outside"):
        s.set_drafts(np.array([0, 1, VOCAB], dtype=np.int64))
    assert (s.plan.input_ids[:3] == last).all()  # refused whole
    s.set_drafts([7, 1, 2])  # row 0 verifies nothing: its entry is not read
    assert s.plan.input_ids[:3].tolist() == [last, 1, 2]
    s.update(r.forward())
    s.check_integrity()


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_mix_with_external_drafts_generates_the_oracles_tokens(data):
    k = data.draw(st.integers(1, 5))
    s = spec_scheduler(k=k, num_blocks=data.draw(st.integers(24, 64)), max_num_seqs=data.draw(st.integers(1, 8)),
                       max_num_batched_tokens=data.draw(st.integers(16, 64)), max_model_len=64, external_drafts=True)
    r = ToyRunner(s, VOCAB, model=repeating_token)
    salt = data.draw(st.integers(0, 3))  # 0: the model's own guess; else wrong now and then
    rng_tokens = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=8, max_size=8))

    def guess(c):
        tok = repeating_token(c, VOCAB)
        return rng_tokens[len(c) % 8] if salt and len(c) % (salt + 1) == 0 else tok

    prompts = add_repeating_requests(data, s)
    out = run_with_external_drafts(s, r, guess)
    for i, (prompt, max_tokens) in prompts.items():
        assert out[i] == oracle(prompt, min(max_tokens, max(64 - len(prompt), 1)), VOCAB, model=repeating_token)
    assert s.allocator.num_used == 0
