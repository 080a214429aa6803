import numpy as np
import pytest

from rtp.runtime import FINISH_LENGTH, FINISH_NONE, FINISH_REMOTE, FINISH_STOP, StepPlan, Scheduler
from runtime_sim import ToyRunner, make_scheduler, oracle, run_to_completion

VOCAB = 50


def expected(prompt, max_tokens, max_model_len, stop_ids=()):
    budget = min(max_tokens, max(max_model_len - len(prompt), 1))
    return oracle(prompt, budget, VOCAB, stop_ids)


def test_generates_what_the_oracle_generates():
    s = make_scheduler(eos_token_ids=[0])
    r = ToyRunner(s, VOCAB)
    rng = np.random.default_rng(0)
    prompts = {i: rng.integers(1, VOCAB, size=int(rng.integers(1, 40))).tolist() for i in range(12)}
    for i, p in prompts.items():
        s.add_request(i, p, max_tokens=10)
    out = run_to_completion(r)
    for i, p in prompts.items():
        assert out[i] == expected(p, 10, 64, stop_ids=(0,))
    assert s.allocator.num_used == 0


def test_full_prompt_cache_hit_leaves_a_token_to_compute():
    s = make_scheduler(max_num_batched_tokens=64)
    r = ToyRunner(s, VOCAB)
    prompt = list(range(1, 17))  # exactly 4 blocks
    s.add_request(1, prompt, max_tokens=1)
    assert run_to_completion(r)[1] == expected(prompt, 1, 64)
    assert s.allocator.num_cached == 4
    s.add_request(2, prompt, max_tokens=3)
    s.schedule()
    st = s.request_state(2)
    assert st["cached_prompt_tokens"] == 12  # capped at len-1, rounded down to a block
    assert s.plan.num_tokens == 4 and s.plan.num_samples == 1
    assert s.update(r.forward()) == 1 and s.event_tokens[0] == expected(prompt, 3, 64)[0]
    s.check_integrity()
    assert run_to_completion(r)[2] == expected(prompt, 3, 64)[1:]


def test_preempted_request_that_hits_the_cache_recounts_computed_tokens():
    # 9 usable blocks of 4 tokens: two growing requests cannot both fit
    s = make_scheduler(num_blocks=10, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=36)
    r = ToyRunner(s, VOCAB)
    a, b = list(range(1, 13)), list(range(20, 32))
    s.add_request(1, a, max_tokens=20)
    s.add_request(2, b, max_tokens=20)
    out = run_to_completion(r)
    assert s.num_preemptions >= 1
    assert out[1] == expected(a, 20, 36) and out[2] == expected(b, 20, 36)
    assert len(out[1]) == len(out[2]) == 20
    assert s.allocator.num_used == 0


def test_preempted_request_resumes_from_its_cached_prefix():
    s = make_scheduler(num_blocks=10, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=36)
    r = ToyRunner(s, VOCAB)
    s.add_request(1, list(range(1, 13)), max_tokens=20)
    s.add_request(2, list(range(20, 32)), max_tokens=20)
    while s.num_preemptions == 0:
        r.step()
        s.check_integrity()
    (victim,) = s.waiting_request_ids()
    assert victim == 2  # the newest running request goes first
    st = s.request_state(victim)
    assert st["num_computed_tokens"] == 0 and st["block_ids"].size == 0
    assert st["num_tokens"] > st["prompt_len"]  # it had generated tokens: they are recomputed


def test_block_table_width_at_max_model_len():
    # a prompt of exactly max_model_len tokens needs cdiv(max_model_len, block_size) columns
    s = make_scheduler(num_blocks=40, block_size=4, max_model_len=30, max_num_batched_tokens=32)
    assert s.plan.width == 8
    r = ToyRunner(s, VOCAB)
    prompt = list(range(1, 31))
    s.add_request(1, prompt, max_tokens=5)
    s.schedule()
    assert (s.plan.block_tables[0] > 0).all()  # all 8 columns used
    n = s.update(r.forward())
    assert n == 1 and s.event_finish[0] == FINISH_LENGTH
    assert s.event_tokens[0] == expected(prompt, 5, 30)[0]
    s.check_integrity()
    # a plan one column short is refused up front
    from rtp.runtime import BlockAllocator
    with pytest.raises(ValueError, match="wide"):
        Scheduler(BlockAllocator(40, 4), StepPlan(32, 8, 7), max_model_len=30, max_num_seqs=8,
                  max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(2, list(range(1, 32)))


def test_no_stale_rows_or_columns_after_a_longer_batch():
    s = make_scheduler(max_num_batched_tokens=64)
    r = ToyRunner(s, VOCAB)
    s.add_request(1, list(range(1, 40)), max_tokens=1)  # one long row that finishes at once
    s.add_request(2, [2, 3], max_tokens=2)
    s.schedule()
    assert s.plan.num_rows == 2 and (s.plan.block_tables[0, :10] > 0).all()
    s.update(r.forward())
    for i in range(3, 6):
        s.add_request(i, [i], max_tokens=3)
    s.schedule()  # row 0 now holds a one-block request: the long row's columns must be cleared
    assert s.plan.num_rows == 4
    assert not s.plan.block_tables[:, 1:].any()
    s.update(r.forward())
    s.schedule()  # fewer rows again: the rows past the end must be cleared too
    assert s.plan.num_rows == 3 and not s.plan.block_tables[3:].any()
    assert not s.plan.seq_lens[3:].any() and not s.plan.input_ids[3:].any()
    s.update(r.forward())  # ToyRunner.forward asserts the whole padded region is zero too
    s.check_integrity()


def test_decode_is_not_starved_by_a_long_prompt():
    s = make_scheduler(num_blocks=128, max_num_batched_tokens=16, max_model_len=256)
    r = ToyRunner(s, VOCAB)
    s.add_request(1, [3, 4, 5], max_tokens=30)
    r.step()
    s.add_request(2, list(np.arange(200) % 40 + 1), max_tokens=2)
    chunks = 0
    while s.has_unfinished and s.request_state(1)["state"] == "running":
        s.schedule()
        assert s.plan.num_decode_rows >= 1 and s.plan.sample_req_ids[0] == 1  # the decode runs every step
        assert s.plan.num_tokens <= 16
        chunks += s.plan.num_rows == 2
        events = s.update(r.forward())
        assert 1 in s.event_req_ids[:events].tolist()
        s.check_integrity()
        if not s.has_request(1):
            break
    assert chunks >= 13  # the 200-token prompt went in chunks of at most 15


def test_prompt_chunks_shrink_while_decodes_run():
    """With decodes running a step takes at most max_prefill_tokens_with_decodes prompt tokens
    (running chunks and admissions together); with none, the whole budget. Outputs unchanged."""
    s = make_scheduler(num_blocks=128, max_num_batched_tokens=32, max_model_len=256,
                       max_prefill_tokens_with_decodes=8)
    r = ToyRunner(s, VOCAB)
    long_a, long_b = list(np.arange(60) % 40 + 1), list(np.arange(50) % 30 + 2)
    s.add_request(1, long_a, max_tokens=3)
    s.schedule()
    assert s.plan.num_tokens == 32  # nothing decodes yet: the full budget
    s.update(r.forward())
    s.add_request(2, [3, 4, 5], max_tokens=40)
    s.schedule()
    assert s.plan.num_tokens == 28 + 3  # still no decode: the rest of request 1 and all of 2
    s.update(r.forward())
    s.add_request(3, long_b, max_tokens=2)
    out: dict[int, list[int]] = {}
    capped = 0
    while s.has_unfinished:
        s.schedule()
        if s.has_request(1) or s.has_request(2):  # something decodes this step
            assert s.plan.num_tokens - s.plan.num_decode_rows <= 8
            capped += s.plan.num_rows > s.plan.num_decode_rows
        n = s.update(r.forward())
        for rid, tok in zip(s.event_req_ids[:n].tolist(), s.event_tokens[:n].tolist()):
            out.setdefault(rid, []).append(tok)
        s.check_integrity()
    assert capped >= 6  # request 3's prompt went in 8 tokens at a time while 1 and 2 decoded
    assert out[2] == expected([3, 4, 5], 40, 256)[1:] and out[3] == expected(long_b, 2, 256)
    assert out[1] == expected(long_a, 3, 256)[1:]
    s2 = make_scheduler(num_blocks=128, max_num_batched_tokens=32, max_model_len=256)
    assert s2.max_prefill_tokens_with_decodes == 0
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decodes"):
        make_scheduler(max_prefill_tokens_with_decodes=-1)


def test_stop_conditions():
    s = make_scheduler(eos_token_ids=[0, 1])
    r = ToyRunner(s, VOCAB)
    prompt = [5, 6, 7]
    free_run = oracle(prompt, 30, VOCAB)
    stop_tok = free_run[3]
    s.add_request(1, prompt, max_tokens=30, stop_token_ids=[stop_tok], ignore_eos=True)
    s.add_request(2, prompt, max_tokens=4, ignore_eos=True)
    s.add_request(3, prompt, max_tokens=30, stop_token_ids=[stop_tok], min_tokens=10, ignore_eos=True)
    out = run_to_completion(r)
    assert out[1] == free_run[: free_run.index(stop_tok) + 1]
    assert out[2] == free_run[:4]
    later = [i for i, t in enumerate(free_run) if t == stop_tok and i >= 9]
    assert out[3] == free_run[: (later[0] + 1 if later else 30)]


def test_eos_is_honoured_unless_ignored():
    prompt = [9, 8, 7, 6]
    run = oracle(prompt, 40, VOCAB)
    eos = run[5]
    s = make_scheduler(eos_token_ids=[eos])
    r = ToyRunner(s, VOCAB)
    s.add_request(1, prompt, max_tokens=40)
    s.add_request(2, prompt, max_tokens=8, ignore_eos=True)
    out = run_to_completion(r)
    assert out[1] == run[: run.index(eos) + 1]
    assert out[2] == run[:8]


def test_finish_reasons_in_events():
    prompt = [2, 3]
    run = oracle(prompt, 10, VOCAB)
    assert run[1] != run[0]
    s = make_scheduler(eos_token_ids=[run[1]])
    r = ToyRunner(s, VOCAB)
    s.add_request(1, prompt, max_tokens=10)
    s.add_request(2, prompt, max_tokens=1, ignore_eos=True)
    reasons = {}
    while s.has_unfinished:
        for rid, _, fin in r.step():
            reasons.setdefault(rid, []).append(fin)
    assert reasons[1] == [FINISH_NONE, FINISH_STOP] and reasons[2] == [FINISH_LENGTH]


def test_abort_anywhere_frees_everything():
    s = make_scheduler(max_num_seqs=2)
    r = ToyRunner(s, VOCAB)
    for i in range(4):
        s.add_request(i, list(range(1, 20)), max_tokens=50)
    r.step()
    assert s.abort(3)  # waiting
    assert s.abort(0)  # running, between steps
    assert not s.abort(0) and not s.abort(99)
    s.check_integrity()
    s.schedule()
    assert s.abort(1)  # in flight: its blocks stay until update()
    assert s.request_state(1)["aborted"]
    blocks = s.request_state(1)["block_ids"]
    assert all(s.allocator.ref_count(int(b)) > 0 for b in blocks)
    s.check_integrity()
    n = s.update(r.forward())
    assert 1 not in s.event_req_ids[:n].tolist()
    assert not s.has_request(1)
    s.abort(2)
    s.check_integrity()
    assert s.allocator.num_used == 0 and not s.has_unfinished


def test_prefill_only_request_holds_its_blocks_until_released():
    s = make_scheduler()
    r = ToyRunner(s, VOCAB)
    prompt = list(range(1, 11))
    s.add_request(7, prompt, max_tokens=20, prefill_only=True)
    events = r.step()
    assert events == [(7, expected(prompt, 1, 64)[0], FINISH_REMOTE)]
    st = s.request_state(7)
    assert st["state"] == "held" and st["block_ids"].size == 3 and s.num_held == 1
    assert not s.has_unfinished
    s.check_integrity()
    s.release(7)
    assert s.allocator.num_used == 0 and s.num_held == 0
    with pytest.raises(KeyError):
        s.release(7)
    s.check_integrity()


def _hand_over(p: ToyRunner, p_blocks, d: ToyRunner, d_blocks, n: int) -> None:
    """Copy n tokens of toy KV from p's blocks to d's, token by token (block sizes may differ)."""
    pos = np.arange(n)
    bp, bd = p.sched.block_size, d.sched.block_size
    src = np.asarray(p_blocks, dtype=np.int64)[pos // bp] * bp + pos % bp
    dst = np.asarray(d_blocks, dtype=np.int64)[pos // bd] * bd + pos % bd
    d.kv_token[dst], d.kv_pos[dst] = p.kv_token[src], p.kv_pos[src]


@pytest.mark.parametrize("decode_block_size", [4, 8, 2])
def test_a_reserved_request_resumes_where_the_prefill_node_stopped(decode_block_size):
    # prefill node: block size 4; decode node: its own block size, other requests already running
    p = ToyRunner(make_scheduler(), VOCAB)
    d = ToyRunner(make_scheduler(block_size=decode_block_size, eos_token_ids=[0]), VOCAB)
    prompt = list(range(3, 14))
    d.sched.add_request(1, [5, 6, 7], max_tokens=6)
    d.step()
    blocks = d.sched.reserve(7, prompt, max_tokens=9, min_tokens=2)
    assert blocks.size == -(-len(prompt) // decode_block_size) and d.sched.num_reserved == 1
    d.step()  # a reserved request takes no part in steps
    assert d.sched.request_state(7)["state"] == "reserved"
    d.sched.check_integrity()
    p.sched.add_request(7, prompt, max_tokens=9, prefill_only=True)
    [(_, first, reason)] = p.step()
    assert reason == FINISH_REMOTE
    _hand_over(p, p.sched.request_state(7)["block_ids"], d, blocks, len(prompt))
    p.sched.release(7)
    d.sched.resume(7, first)
    assert d.sched.request_state(7)["state"] == "ready" and d.sched.has_unfinished
    d.sched.check_integrity()
    out = run_to_completion(d)
    assert [first] + out[7] == expected(prompt, 9, 64, stop_ids=(0,))
    assert len(out[7]) == 8  # max_tokens counts the token sampled on the prefill node
    assert d.sched.allocator.num_used == 0 and d.sched.num_reserved == 0 and d.sched.num_ready == 0


def test_reserve_refuses_when_short_and_an_aborted_reservation_caches_nothing():
    s = make_scheduler(num_blocks=6)  # 5 usable blocks of 4 tokens
    with pytest.raises(MemoryError):
        s.reserve(1, list(range(1, 23)), max_tokens=1)  # 6 blocks
    assert not s.has_request(1) and s.allocator.num_used == 0
    blocks = s.reserve(1, list(range(1, 17)), max_tokens=4)
    assert blocks.size == 4 and s.allocator.num_used == 4
    with pytest.raises(MemoryError):
        s.reserve(2, list(range(1, 9)), max_tokens=4)
    s.check_integrity()
    assert s.abort(1)
    # partial KV never reaches the prefix cache: the same prompt later finds nothing cached
    assert s.allocator.num_used == 0 and s.allocator.num_cached == 0 and s.num_reserved == 0
    s.check_integrity()


def test_resume_refuses_a_first_token_that_finishes_the_request():
    s = make_scheduler(eos_token_ids=[0])
    s.reserve(1, [1, 2, 3], max_tokens=4)
    with pytest.raises(ValueError):
        s.resume(1, 0)  # eos: the prefill node answers such requests itself
    with pytest.raises(ValueError):
        s.resume(1, -1)
    st = s.request_state(1)
    assert st["state"] == "reserved" and st["num_tokens"] == 3
    with pytest.raises(KeyError):
        s.resume(2, 5)
    s.resume(1, 5)
    with pytest.raises(KeyError):
        s.resume(1, 5)  # only once
    assert s.abort(1) and s.allocator.num_used == 0
    s.check_integrity()


def test_lpm_prefers_cached_prefixes_but_ages_cold_requests():
    s = make_scheduler(num_blocks=256, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=128,
                       policy="lpm", lpm_aging=4.0)
    r = ToyRunner(s, VOCAB)
    hot = list(range(1, 33))
    s.add_request(0, hot + [40], max_tokens=1)
    run_to_completion(r)
    s.add_request(100, [45] * 20, max_tokens=1)  # cold: nothing cached
    s.add_request(1, hot + [41], max_tokens=1)
    order = []
    nxt = 2
    while s.has_request(100):
        s.schedule()
        order.extend(s.plan.sample_req_ids[: s.plan.num_samples].tolist())
        s.update(r.forward())
        s.add_request(nxt, hot + [nxt % 9 + 1], max_tokens=1)  # hot requests keep coming
        nxt += 1
    order.append(100) if order[-1] != 100 else None
    assert order[0] == 1  # the hot request jumped the queue
    # 32 matched tokens at 4 tokens/step of aging: the cold request waits about 8 steps, not forever
    assert 100 in order and order.index(100) <= 10
    s.check_integrity()


def test_fcfs_keeps_arrival_order():
    s = make_scheduler(max_num_seqs=1, max_num_batched_tokens=64)
    r = ToyRunner(s, VOCAB)
    for i in range(5):
        s.add_request(i, [i + 1, i + 2], max_tokens=1)
    order = []
    while s.has_unfinished:
        order += [rid for rid, _, _ in r.step()]
    assert order == [0, 1, 2, 3, 4]


def test_bad_requests_are_refused_and_change_nothing():
    s = make_scheduler(num_blocks=8, vocab_size=VOCAB, max_requests=3)
    s.add_request(1, [1, 2, 3])
    for call, err in [
        (lambda: s.add_request(1, [1]), ValueError),  # duplicate id
        (lambda: s.add_request(2, []), ValueError),
        (lambda: s.add_request(2, [VOCAB]), ValueError),
        (lambda: s.add_request(2, [-1]), ValueError),
        (lambda: s.add_request(2, [1.5]), TypeError),
        (lambda: s.add_request(2, [[1, 2]]), ValueError),
        (lambda: s.add_request(2, [1], max_tokens=0), ValueError),
        (lambda: s.add_request(2, [1], max_tokens=2, min_tokens=3), ValueError),
        (lambda: s.add_request(2, [1] * 40, max_tokens=20), ValueError),  # needs more blocks than exist
        (lambda: s.update([1]), RuntimeError),  # no step in flight
    ]:
        with pytest.raises(err):
            call()
        s.check_integrity()
    s.add_request(2, [1])
    s.add_request(3, [1])
    with pytest.raises(OverflowError):
        s.add_request(4, [1])
    s.schedule()
    with pytest.raises(RuntimeError):
        s.schedule()
    with pytest.raises(ValueError):
        s.update([1])  # three rows sample
    with pytest.raises(ValueError):
        s.update([1, 2, VOCAB])  # out of the vocabulary: nothing appended
    assert all(s.request_state(i)["num_tokens"] == n for i, n in [(1, 3), (2, 1), (3, 1)])
    assert s.update([1, 2, 3]) == 3
    s.check_integrity()


def test_constructor_checks():
    from rtp.runtime import BlockAllocator, RadixCache
    a = BlockAllocator(16, 4)
    plan = StepPlan(32, 4, 16)
    with pytest.raises(ValueError):
        Scheduler(a, plan, max_num_seqs=8)  # plan has fewer rows
    with pytest.raises(ValueError):
        Scheduler(a, plan, max_num_seqs=4, max_num_batched_tokens=64)
    with pytest.raises(ValueError):
        Scheduler(a, plan, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, policy="lpm")
    with pytest.raises(ValueError):
        Scheduler(a, plan, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, policy="sjf")
    with pytest.raises(ValueError):
        Scheduler(a, plan, cache=RadixCache(BlockAllocator(16, 4)), max_num_seqs=4,
                  max_num_batched_tokens=32, max_model_len=64)
    with pytest.raises(ValueError):
        StepPlan(32, 4, 16, input_ids=np.zeros(32, dtype=np.int64))
    ids = np.zeros(32, dtype=np.int32)
    p = StepPlan(32, 4, 16, input_ids=ids)
    assert p.input_ids is ids  # caller-owned buffers are written in place



def test_step_plan_arrays_come_from_plan_arrays():
    # the runner and the tensor-parallel ranks build their buffers from the same schema
    from rtp.runtime import PLAN_ARRAYS, plan_array_shapes
    shapes = plan_array_shapes(32, 4, 16)
    assert list(shapes) == list(PLAN_ARRAYS)
    assert shapes["block_tables"] == ((4, 16), np.dtype(np.int32))
    assert shapes["query_start_loc"][0] == (5,)
    plan = StepPlan(32, 4, 16)
    for name, (shape, dtype) in shapes.items():
        array = getattr(plan, name)
        assert array.shape == shape and array.dtype == dtype, name
    given = {name: np.zeros(shape, dtype) for name, (shape, dtype) in shapes.items()}
    plan = StepPlan(32, 4, 16, **given)
    assert all(getattr(plan, name) is array for name, array in given.items())
    with pytest.raises(ValueError, match="block_tables"):
        StepPlan(32, 4, 16, block_tables=np.zeros((4, 15), np.int32))
    with pytest.raises(TypeError, match="unknown"):
        StepPlan(32, 4, 16, logits=np.zeros(4, np.int32))

def test_concurrent_identical_prompts_share_blocks_after_prefill():
    s = make_scheduler(max_num_batched_tokens=64)
    r = ToyRunner(s, VOCAB)
    prompt = list(range(1, 21))
    s.add_request(1, prompt, max_tokens=8)
    s.add_request(2, prompt, max_tokens=8)
    first = r.step()
    s.check_integrity()
    b1, b2 = s.request_state(1)["block_ids"], s.request_state(2)["block_ids"]
    assert b1[:5].tolist() == b2[:5].tolist()  # duplicates were swapped for the cached blocks
    assert s.allocator.num_used == 5  # 20 tokens: five full blocks, held by both
    out = run_to_completion(r)
    want = expected(prompt, 8, 64)
    assert [t for _, t, _ in first] == want[:1] * 2
    assert out[1] == out[2] == want[1:]


def test_stats():
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        s.add_request(i, [1, 2, 3, 4, 5], max_tokens=2)
    st = s.stats()
    assert st["num_waiting"] == 3 and st["queued_prompt_tokens"] == 15
    ToyRunner(s, VOCAB).step()
    st = s.stats()
    assert st["num_running"] == 2 and st["num_waiting"] == 1 and st["queued_prompt_tokens"] == 5
    # the shared first block was deduplicated once both prompts were computed
    assert st["used_blocks"] == 3 and st["prefix_cache_queries"] == 2
    assert 0 < st["kv_cache_usage"] < 1


def test_sampled_tokens_must_be_integers():
    s = make_scheduler()
    s.add_request(1, [1, 2, 3])
    s.schedule()
    with pytest.raises(TypeError):
        s.update(np.array([1.0]))
    assert s.update(np.array([4], dtype=np.int32)) == 1
    s.check_integrity()


def test_a_step_written_from_python_takes_its_extent_and_clears_the_last_ones_tail():
    """StepPlan.take: a step written with numpy (the draft model's sub-steps) after a larger one
    leaves nothing of the larger past its extent (whole block-table rows, qsl, samples), keeps
    its own, and an extent that does not fit is a ValueError changing nothing."""
    plan = StepPlan(32, 4, 6)
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "logits_indices", "sample_slots",
                 "sample_req_ids", "sample_offsets", "block_tables"):
        getattr(plan, name)[...] = 7
    plan.query_start_loc[:] = np.arange(5) * 8
    plan.take(32, 4, 0, 4)
    plan.input_ids[:3] = [1, 2, 3]
    plan.query_start_loc[:3] = [0, 1, 3]
    plan.take(3, 2, 1, 2)
    assert (plan.num_tokens, plan.num_rows, plan.num_decode_rows, plan.num_samples) == (3, 2, 1, 2)
    assert plan.input_ids[:3].tolist() == [1, 2, 3] and not plan.input_ids[3:].any()
    assert not plan.positions[3:].any() and not plan.slot_mapping[3:].any()
    assert (plan.block_tables[:2] == 7).all() and not plan.block_tables[2:].any()
    assert (plan.seq_lens[:2] == 7).all() and not plan.seq_lens[2:].any()
    assert plan.query_start_loc.tolist() == [0, 1, 3, 0, 0]
    for name in ("logits_indices", "sample_slots", "sample_req_ids", "sample_offsets"):
        assert (getattr(plan, name)[:2] == 7).all() and not getattr(plan, name)[2:].any(), name
    with pytest.raises(ValueError, match="does not fit"):
        plan.take(3, 5, 0, 0)
    assert (plan.num_tokens, plan.num_rows) == (3, 2)


def test_a_deferred_request_waits_out_of_the_queue_until_undeferred():
    s = make_scheduler()
    r = ToyRunner(s, VOCAB)
    a, b = list(range(1, 10)), list(range(20, 30))
    s.add_request(1, a, max_tokens=3)
    s.add_request(2, b, max_tokens=3)
    s.defer(1)
    assert (s.num_waiting, s.num_deferred, s.request_state(1)["state"]) == (1, 1, "deferred")
    s.check_integrity()
    with pytest.raises(KeyError):
        s.defer(1)          # not waiting
    with pytest.raises(KeyError):
        s.undefer(2)        # not deferred
    out = {}
    for _ in range(20):  # 2 runs to its end; 1 never runs: it waits for undefer()
        for rid, tok, _ in r.step():
            out.setdefault(rid, []).append(tok)
        s.check_integrity()
    assert out == {2: expected(b, 3, 64)} and s.has_unfinished and s.num_deferred == 1
    s.undefer(1)
    assert run_to_completion(r) == {1: expected(a, 3, 64)}
    s.add_request(3, a, max_tokens=3)
    s.defer(3)
    assert s.abort(3) and s.num_deferred == 0 and not s.has_unfinished
    s.check_integrity()
    assert s.allocator.num_used == 0


def test_extend_gives_a_running_request_computed_blocks_from_elsewhere():
    s = make_scheduler(max_num_batched_tokens=6)
    r = ToyRunner(s, VOCAB)
    prompt = list(range(1, 30))
    s.add_request(1, prompt, max_tokens=4)
    r.step()  # 6 of 29 prompt tokens computed: its blocks end inside the second block
    assert s.request_state(1)["num_computed_tokens"] == 6
    with pytest.raises(ValueError):
        s.extend(1, 1)   # not past what is computed
    with pytest.raises(ValueError):
        s.extend(1, 8)   # 32 tokens: none left to compute
    before = s.allocator.num_used
    blocks = s.extend(1, 5)  # up to token 20: the partial block and three new ones
    st = s.request_state(1)
    assert st["num_computed_tokens"] == 20 and len(blocks) == 4 and list(blocks) == list(st["block_ids"][1:])
    assert s.allocator.num_used == before + 3
    s.check_integrity()
    for t in range(4, 20):  # the caller writes their KV (the partial block's computed tokens the same)
        slot = int(st["block_ids"][t // 4]) * 4 + t % 4
        r.kv_token[slot], r.kv_pos[slot] = prompt[t], t
    assert run_to_completion(r) == {1: expected(prompt, 4, 64)}
    assert s.allocator.num_used == 0
    with pytest.raises(KeyError):
        s.extend(1, 2)
