"""The speculation governor drafts at the batch sizes where the engine's own steps measured
drafting cheaper a token, and nowhere else; output never depends on it."""

from __future__ import annotations

from rtp import LLM, SamplingParams
from rtp.engine.speculation_governor import SpeculationGovernor


def steps(governor: SpeculationGovernor, running: int, n: int, draft_s: float, plain_s: float) -> list[bool]:
    """n decisions at `running` requests, each step measured as it was chosen: a token costs draft_s
    or plain_s seconds."""
    chosen = []
    for _ in range(n):
        drafting = governor.cap(running) > 0
        governor.observe((draft_s if drafting else plain_s) * running, running, running, drafting, 0)
        chosen.append(drafting)
    return chosen


def test_it_drafts_where_drafting_measured_cheaper_and_stops_where_dearer():
    g = SpeculationGovernor(max_running=16)
    alone = steps(g, 1, 200, draft_s=0.006, plain_s=0.010)  # one stream: drafts pay
    eight = steps(g, 8, 200, draft_s=0.004, plain_s=0.0025)  # eight: they cost
    assert alone[:8] == [True] * 8 and alone[8:16] == [False] * 8  # measured both ways first
    assert sum(alone[16:]) >= 181 and sum(eight[16:]) <= 4  # then the cheaper, the other 1 step in 64
    assert g.cap(20) == 16  # past the cap the scheduler drafts nothing anyway
    st = g.stats()
    assert st["1"]["draft_ms_per_token"] < st["1"]["plain_ms_per_token"]
    assert st["8"]["draft_ms_per_token"] > st["8"]["plain_ms_per_token"]
    assert set(st) == {"1", "8"}  # 5-8 running: one bucket


def test_a_change_of_workload_moves_the_choice():
    """Drafts that stop being guessed (their steps' cost per token rises) turn drafting off there; the
    exploring steps see them come back."""
    g = SpeculationGovernor(max_running=16)
    assert sum(steps(g, 2, 300, draft_s=0.005, plain_s=0.008)[16:]) > 275
    assert sum(steps(g, 2, 300, draft_s=0.012, plain_s=0.008)[-200:]) <= 4
    assert sum(steps(g, 2, 600, draft_s=0.005, plain_s=0.008)[-200:]) > 190


def test_steps_with_prompt_tokens_or_nothing_emitted_are_not_measured():
    g = SpeculationGovernor(max_running=16)
    g.observe(1.0, 4, 4, True, prompt_tokens=100)
    g.observe(1.0, 0, 0, False, prompt_tokens=0)
    assert g.stats() == {}


def test_with_the_governor_on_output_is_what_it_was(default_gguf):
    """The default engine measures its own steps: batched and alone, greedy output equals the plain
    engine's token for token, and it measured the batch sizes it ran."""
    kw = dict(dtype="bfloat16", max_num_seqs=16, kv_cache_memory=128 << 20, max_model_len=1024)
    plain = LLM(**kw)
    spec = LLM(**kw, speculative="ngram", num_speculative_tokens=4)
    assert spec.engine.governor is not None
    prompts = [plain.engine.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in (
        "Repeat exactly: the quick brown fox jumps over the lazy dog, twice.", "Count from one to twenty.",
        "Write a haiku about rain.", "List the days of the week.")]
    sp = SamplingParams(temperature=0, max_tokens=48)
    for batch in (prompts, prompts[:1]):
        want = [o.outputs[0].token_ids for o in plain.generate(batch, sp, use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in spec.generate(batch, sp, use_tqdm=False)] == want
    measured = spec.engine.stats()["speculation"]
    assert "1" in measured and "4" in measured and measured["1"]["draft_steps"] >= 4
