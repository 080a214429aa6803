"""The prefill budget: sized from measured step costs, grown while the waiting queue ages."""

import pytest

from rtp.engine.prefill_budget import PrefillBudget


def test_the_cap_holds_until_both_kinds_of_step_were_measured():
    b = PrefillBudget(0.1, cap=2048, floor=16)
    assert b.budget(0, -1, now=0.0) == 2048
    b.observe(0.5, prompt_tokens=2048, decode_rows=0)   # a prefill-only step: 0.25 ms a prompt token
    assert b.budget(1, -1, now=0.5) == 2048             # no decode step yet
    b.observe(0.03, prompt_tokens=0, decode_rows=16)
    assert b.budget(2, -1, now=0.6) == int((0.1 - 0.03) / (0.5 / 2048))


def test_a_mixed_step_is_split_into_its_decode_part_and_its_prompt_tokens():
    b = PrefillBudget(0.1, cap=4096, floor=16)
    b.observe(0.03, prompt_tokens=0, decode_rows=64)
    b.observe(0.03 + 256 * 0.0002, prompt_tokens=256, decode_rows=63)
    assert b.token_s == pytest.approx(0.0002)
    assert b.budget(5, -1, now=1.0) == pytest.approx(350, abs=1)
    # a slower machine (or a bigger batch): the averages follow, the budget shrinks
    for _ in range(40):
        b.observe(0.08, prompt_tokens=0, decode_rows=64)
    assert b.budget(6, -1, now=1.1) == pytest.approx((0.1 - 0.08) / 0.0002, abs=2)
    # decode steps past the target leave the floor, never nothing
    for _ in range(40):
        b.observe(0.2, prompt_tokens=0, decode_rows=64)
    assert b.budget(7, -1, now=1.2) == 16


def test_the_budget_doubles_for_each_target_the_oldest_request_waited_past_one():
    b = PrefillBudget(0.1, cap=100_000, floor=16)
    b.observe(0.03, prompt_tokens=0, decode_rows=8)
    b.observe(0.03 + 100 * 0.0007, prompt_tokens=100, decode_rows=8)   # base: 100 tokens
    for step in range(10):
        b.budget(step, -1, now=step * 0.1)                           # step k began at 0.1 k s
    assert b.budget(10, 9, now=1.0) == 100                            # waited one step: no boost
    assert b.budget(11, 8, now=1.1) == pytest.approx(400, abs=1)     # 0.3 s: 2^(3 - 1)
    assert b.budget(12, 2, now=1.2) == pytest.approx(100 * 2**9, abs=2)
    small = PrefillBudget(0.1, cap=512, floor=16)
    small.decode_s, small.token_s = b.decode_s, b.token_s
    for step in range(3):
        small.budget(step, -1, now=step * 0.1)
    assert small.budget(3, 0, now=5.0) == 512                         # never past the cap


def test_ageing_grows_the_budget_even_where_a_decode_step_alone_takes_the_target():
    b = PrefillBudget(0.07, cap=2048, floor=16)
    b.observe(0.075, prompt_tokens=0, decode_rows=64)                  # decode alone: past the target
    b.observe(0.075 + 64 * 0.0005, prompt_tokens=64, decode_rows=63)
    for step in range(10):
        b.budget(step, -1, now=step * 0.07)
    assert b.budget(10, -1, now=0.7) == 16                            # nobody waits: the floor
    assert b.budget(11, 10, now=0.77) == 16                           # waited one target: no boost
    assert b.budget(12, 5, now=0.84) == pytest.approx(16 * 2**6, abs=1)  # waited 7 targets: 2^(7 - 1)


def test_the_engine_sizes_each_step_and_reports_it(default_gguf):
    from rtp import LLM, SamplingParams

    llm = LLM(dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=512, step_time_target=0.05,
              max_model_len=1024, kv_cache_memory=64 << 20)
    engine = llm.engine
    assert engine.prefill_budget is not None and engine.prefill_budget.cap == 512
    prompts = [[100 + i] * (40 + 30 * i) for i in range(12)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    b = engine.prefill_budget
    assert b.decode_s > 0 and b.token_s > 0 and 16 <= b.last <= 512
    assert engine.stats()["prefill_budget"] == b.last
    assert engine.scheduler.max_prefill_tokens_with_decodes == b.last
    engine.scheduler.check_integrity()
    fixed = LLM(dtype="bfloat16", max_num_seqs=8, max_model_len=1024, kv_cache_memory=64 << 20).engine
    assert fixed.prefill_budget is None and "prefill_budget" not in fixed.stats()
