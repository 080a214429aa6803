"""Speculative decoding with a draft model end to end: a request's output is what it would have been.

The draft proposes its greedy continuation, a one-hot proposal the scheduler's verification takes
exactly, so whatever the draft model is -- the target itself (every draft kept), or a small random
model sharing its vocabulary (few kept) -- greedy and seeded output must be the plain engine's token
for token. The draft's KV cache takes the target's block ids, so the prefix cache, preemption and
the rollback of rejected drafts govern it too: the target as its own draft keeps (nearly) every
draft through all of them, which it cannot if any of its KV were stale.

The default model (SmolLM2-135M-Instruct, bf16, rtp's kernels) is the target, as in
test_speculative.py; the tiny checkpoints of tests/tiny_models.py are targets and drafts where the
vocabulary is the point."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from rtp import LLM, SamplingParams
from rtp.config import EngineConfig

from speculation import (TEXT, assert_drafted_positions_distributed_as_plain,
                         assert_logprobs_stops_and_min_tokens_are_plain, assert_seeded_sampling_is_plain, chat,
                         first_tokens_by_position)

ASKS = [f"Repeat this text exactly:\n\n{TEXT}", f"Summarise this text in two sentences:\n\n{TEXT}",
        "Write a short poem about the sea.", "What is the capital of France?"]
ENGINE = dict(dtype="bfloat16", max_num_seqs=16, kv_cache_memory=256 << 20, max_model_len=2048)


def acceptance(llm: LLM, since: tuple[int, int] = (0, 0)) -> float:
    s = llm.engine.scheduler
    drafted, accepted = s.spec_draft_tokens - since[0], s.spec_accepted_tokens - since[1]
    assert drafted > 0
    return accepted / drafted


def counters(llm: LLM) -> tuple[int, int]:
    s = llm.engine.scheduler
    return s.spec_draft_tokens, s.spec_accepted_tokens


def small_llama_with_the_default_vocabulary(path, default_gguf):
    """A 2-layer random Llama with SmolLM2's 49,152 tokens and its tokenizer: a draft that shares the
    target's vocabulary and little else."""
    from rtp.checkpoint.tokenizer import Tokenizer

    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                                      tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    model.save_pretrained(path)
    Tokenizer.from_gguf(default_gguf).backend.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def engines(default_gguf, tmp_path_factory):
    plain = LLM(**ENGINE)
    own = LLM(**ENGINE, speculative_measured=False, speculative_model=str(default_gguf), num_speculative_tokens=4)
    other = small_llama_with_the_default_vocabulary(tmp_path_factory.mktemp("small-draft"), default_gguf)
    small = LLM(**ENGINE, speculative_measured=False, speculative_model=str(other), num_speculative_tokens=3)
    return plain, own, small


def test_greedy_alone_is_token_for_token_what_it_was(engines):
    plain, own, small = engines
    sp = SamplingParams(temperature=0, max_tokens=64)
    since_own, since_small = counters(own), counters(small)
    for ask in ASKS:
        ids = chat(plain, ask)
        want = plain.generate([ids], sp, use_tqdm=False)[0].outputs[0]
        for llm in (own, small):
            got = llm.generate([ids], sp, use_tqdm=False)[0].outputs[0]
            assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert acceptance(own, since_own) > 0.97  # the target drafting for itself: bit for bit its own choices
    assert acceptance(small, since_small) < 0.5
    for llm in (own, small):
        assert llm.engine.allocator.num_used == 0
        llm.engine.scheduler.check_integrity()


def test_greedy_batched_is_token_for_token_what_it_was(engines):
    """Beside a companion that never drafts (a penalty keeps it a token a step) and outlives them:
    steps of several requests, drafting and not, prompt chunks beside decodes."""
    plain, own, small = engines
    sp = SamplingParams(temperature=0, max_tokens=48)
    companion = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, presence_penalty=0.1)
    prompts = [chat(plain, a) for a in ASKS]

    def run(llm):
        outs = llm.generate([chat(llm, "Count to five hundred.")] + prompts, [companion] + [sp] * len(prompts),
                            use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    since = counters(own)
    want = run(plain)[1:]  # the companion ends alone, on other kernels when the others finish sooner
    assert run(own)[1:] == want
    assert acceptance(own, since) > 0.9  # a draft step of one row runs other kernels than the target's batch
    assert run(small)[1:] == want


def test_seeded_sampling_is_what_it_was_and_reproduces_itself(engines):
    plain, own, small = engines
    ids = chat(plain, ASKS[0])
    for llm in (own, small):
        assert_seeded_sampling_is_plain(plain, llm, ids, max_tokens=48)


def test_logprobs_stop_strings_and_min_tokens_are_what_they_were(engines):
    plain, own, _ = engines
    assert_logprobs_stops_and_min_tokens_are_plain(plain, own, chat(plain, ASKS[0]))


def test_every_step_keeps_the_runtime_whole_and_verified_tokens_go_out_as_one_delta(engines):
    plain, own, _ = engines
    engine = own.engine
    sp = SamplingParams(temperature=0, max_tokens=60)
    companion = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, presence_penalty=0.1)
    engine.add_request("companion", chat(own, "Count to five hundred."), companion)
    for i, ask in enumerate(ASKS[:3]):
        engine.add_request(f"r{i}", chat(own, ask), sp)
    widest, tokens = 0, {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            for choice in delta.choices:
                assert choice.num_tokens == len(choice.token_ids)
                widest = max(widest, choice.num_tokens)
                tokens.setdefault(delta.request_id, []).extend(choice.token_ids)
        engine.scheduler.check_integrity()
    assert widest > 1
    want = plain.generate([chat(plain, "Count to five hundred.")] + [chat(plain, a) for a in ASKS[:3]],
                          [companion] + [sp] * 3, use_tqdm=False)[1:]
    assert [tokens[f"r{i}"] for i in range(3)] == [o.outputs[0].token_ids for o in want]
    assert engine.allocator.num_used == 0
    assert engine.stats()["draft_model"]["draft_steps"] > 0


def test_a_prefix_cache_hit_brings_the_drafts_kv_too(engines):
    """The second run of a prompt finds its blocks cached: the draft's KV in them is the draft's own
    (written in the same steps as the target's), so it keeps drafting what the target chooses."""
    plain, own, _ = engines
    ids = chat(plain, "Repeat this sentence three times: the cat sat on the mat by the door, twice.")
    sp = SamplingParams(temperature=0, max_tokens=48)
    want = [plain.generate([ids], sp, use_tqdm=False)[0] for _ in range(2)]  # its second run hits the cache too
    first = own.generate([ids], sp, use_tqdm=False)[0]
    since = counters(own)
    again = own.generate([ids], sp, use_tqdm=False)[0]
    assert again.num_cached_tokens == want[1].num_cached_tokens >= 16
    assert [first.outputs[0].token_ids, again.outputs[0].token_ids] == [w.outputs[0].token_ids for w in want]
    assert acceptance(own, since) > 0.97


# -- tiny checkpoints: startup checks, and a draft of another shape ------------------------------------

def tiny(kind, path, vocab=160, words="t"):
    """A tiny random checkpoint of tests/tiny_models.py with a word tokenizer (token i is f"{words}{i}")."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from tiny_models import DENSE, DENSE_CONFIGS, random_hf_model

    cfg_cls, extra = DENSE_CONFIGS[kind]
    random_hf_model(cfg_cls(**{**DENSE, **extra, "vocab_size": vocab})).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"{words}{i}": i for i in range(vocab)}, unk_token=f"{words}0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-drafts")
    return {"target": tiny("llama", root / "target"), "other": tiny("llama-tied-mha", root / "other"),
            "vocab": tiny("llama", root / "vocab", vocab=200), "words": tiny("llama", root / "words", words="w")}


def test_a_draft_of_another_shape_on_a_tiny_target_keeps_greedy_output(tiny_dirs):
    """fp32, eager: the target as its own draft keeps nearly everything; a draft with other weights,
    tied embeddings and twice the KV heads (its own cache layout over the same block ids) keeps
    little; both generate the plain engine's tokens, batched and with the prefix cache shared."""
    from tiny_models import prompts_of

    target = str(tiny_dirs["target"])
    common = dict(model=target, dtype="float32", max_num_seqs=8, max_model_len=128)
    prompts = prompts_of([5, 17, 30, 9, 40, 22], seed=4)
    prompts += [prompts[1] + prompts[2]]  # a prefix of an earlier one
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(**common).generate(prompts, sp, use_tqdm=False)]
    own = LLM(**common, speculative_measured=False, speculative_model=target, num_speculative_tokens=3)
    other = LLM(**common, speculative_measured=False, speculative_model=str(tiny_dirs["other"]),
                num_speculative_tokens=3)
    for llm in (own, other):
        for batch in (prompts, *[[p] for p in prompts[:3]]):
            got = [o.outputs[0].token_ids for o in llm.generate(batch, sp, use_tqdm=False)]
            assert got == [want[prompts.index(p)] for p in batch]
        llm.engine.scheduler.check_integrity()
        assert llm.engine.allocator.num_used == 0
    assert acceptance(own) > 0.9
    assert acceptance(other) < 0.5


def test_unseeded_sampling_keeps_the_plain_distribution(tiny_dirs):
    """Temperature 1 over the top 8 of a tiny target, drafted by a model with other weights: its
    greedy drafts are kept only when the target samples them, so the rejection rule decides most
    tokens. Positions 1-3 (drafted ones) are distributed as without drafts: rejected at p < 1e-4."""
    target = str(tiny_dirs["target"])
    prompt = list(range(1, 60))
    _, plain = first_tokens_by_position(target, prompt, max_model_len=128, seed=1)
    llm, spec = first_tokens_by_position(target, prompt, max_model_len=128, seed=2, speculative_measured=False,
                                         speculative_model=str(tiny_dirs["other"]), num_speculative_tokens=3,
                                         speculative_max_running=32)
    s = llm.engine.scheduler
    assert s.spec_draft_tokens > 1000 and 0 < s.spec_accepted_tokens < s.spec_draft_tokens
    assert_drafted_positions_distributed_as_plain(plain, spec)


@pytest.mark.parametrize("case", ["every-step", "one-at-a-time", "small-steps"])
def test_the_draft_kv_is_the_targets_when_the_target_drafts_for_itself(tiny_dirs, case):
    """Target and draft the same model: every KV slot the draft holds valid holds what the target's
    does, and a request that drafts in a step has the draft's KV valid at every position before its
    last token (the first pass caught up on what it missed), whatever was kept, rolled back,
    batched or found in the prefix cache. one-at-a-time: nobody drafts while two or more run, and
    no draft runs in those steps; the last request left catches up on its prompt and output.
    small-steps: 16 tokens a step, too few to catch a prompt up in one: the pass goes on next step."""
    from tiny_models import prompts_of

    target = str(tiny_dirs["target"])
    kw = {"every-step": {}, "one-at-a-time": {"speculative_max_running": 1},
          "small-steps": {"speculative_max_running": 1, "max_num_batched_tokens": 16}}[case]
    llm = LLM(model=target, dtype="float32", max_model_len=128, speculative_measured=False, speculative_model=target,
              num_speculative_tokens=3, **kw)
    engine = llm.engine
    prompts = prompts_of([20, 35, 7], seed=9)
    prompts.append(prompts[1][:32] + prompts[0])  # two blocks of prompt 1 from the cache
    bs = engine.allocator.block_size
    checked = lagging = drafting = idle = partial = 0
    progress = {}

    def run(batch):
        nonlocal checked, lagging, drafting, idle, partial
        for i in batch:
            sp = SamplingParams(temperature=0, max_tokens=30 + 5 * i, ignore_eos=True)
            engine.add_request(f"r{i}", prompts[i], sp)
        while engine.has_unfinished_requests():
            steps = engine.drafter.draft_steps
            engine.step()
            plan = engine.scheduler.plan  # the step just run
            off = plan.sample_offsets[:plan.num_samples]
            drafted = {int(r): int(plan.positions[plan.logits_indices[k]])
                       for k, r in enumerate(plan.sample_req_ids[:plan.num_samples]) if off[k] == 0 and
                       k + 1 < plan.num_samples and off[k + 1] == 1}  # request -> its last token's position
            if not drafted:
                assert engine.drafter.draft_steps == steps  # nobody drafted: the draft did not run
                idle += 1
            s = engine.scheduler
            for rid in s.running_request_ids():
                st = s.request_state(rid)
                n = st["num_computed_tokens"]
                pos = np.arange(n)
                slots = st["block_ids"][pos // bs].astype(np.int64) * bs + pos % bs
                valid = torch.from_numpy(engine.drafter.valid[slots])
                blocks, at = torch.from_numpy(st["block_ids"][pos // bs].astype(np.int64)), torch.from_numpy(pos % bs)
                for t, d in zip(engine.runner.kv_caches, engine.drafter.runner.kv_caches):
                    same = torch.isclose(d[:, blocks, at], t[:, blocks, at], atol=1e-4, rtol=1e-4)
                    same = same.flatten(2).all(-1).all(0)
                    assert same[valid].all(), (rid, n, torch.nonzero(valid & ~same).flatten()[:8].tolist())
                if rid in drafted:
                    prefix = int(valid.cumprod(0).sum())
                    if prefix <= drafted[rid]:  # not caught up: only when the step had no room, and it made progress
                        assert case == "small-steps" and prefix > progress.get(rid, 0), (rid, drafted[rid], prefix)
                        partial += 1
                    else:
                        drafting += 1
                        lagging += int(not valid[n - 1])
                    progress[rid] = prefix
                checked += n
            s.check_integrity()

    run([0, 1, 2])
    s = engine.scheduler
    hits = s.stats()["prefix_cache_hit_tokens"]
    run([3])  # two blocks of prompt 1 from the cache, with the draft's KV in them
    assert s.stats()["prefix_cache_hit_tokens"] - hits >= 32
    assert checked > 500 and drafting > 5 and s.spec_accepted_tokens > 0 and lagging > 0
    assert case == "every-step" or idle > 10, idle
    assert (partial > 0) == (case == "small-steps"), partial
    # a request not caught up drafts its last token again, rejected: only small steps pay for that
    assert acceptance(llm) > (0.7 if case == "small-steps" else 0.9)


def test_preemption_under_a_tiny_kv_budget_keeps_the_output(tiny_dirs):
    """Five requests in a pool of 14 blocks (each holding both models' KV): the newest are preempted
    and recomputed, drafts and all; every output is still the plain engine's, and the target drafting
    for itself still keeps nearly every draft (no stale draft KV survived a preemption)."""
    from tiny_models import prompts_of

    target = str(tiny_dirs["target"])
    prompts = prompts_of([20, 26, 31, 18, 24], seed=7)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(model=target, dtype="float32", max_model_len=128)
            .generate(prompts, sp, use_tqdm=False)]
    # 2 layers x (K, V) x 2 heads x 16 dims x 4 bytes = 512 bytes a token and model, blocks of 16 tokens
    llm = LLM(model=target, dtype="float32", max_model_len=128, kv_cache_memory=14 * 16 * 2 * 512,
              speculative_measured=False, speculative_model=target, num_speculative_tokens=3)
    assert llm.engine.allocator.num_blocks == 14
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    s = llm.engine.scheduler
    assert s.num_preemptions > 0 and acceptance(llm) > 0.9
    assert llm.engine.allocator.num_used == 0
    s.check_integrity()


def test_a_draft_with_another_vocabulary_is_refused_at_startup(tiny_dirs):
    target = str(tiny_dirs["target"])
    with pytest.raises(ValueError, match="does not share the target's tokenizer: its vocabulary has 200 tokens"):
        LLM(model=target, dtype="float32", speculative_model=str(tiny_dirs["vocab"]))
    with pytest.raises(ValueError, match="does not share the target's tokenizer: token 0 is 't0'"):
        LLM(model=target, dtype="float32", speculative_model=str(tiny_dirs["words"]))


def test_speculative_flags():
    config = EngineConfig.from_flat(speculative_model="some/draft")
    assert config.speculative.kind == "draft_model" and config.speculative.draft_tokens == 4
    assert EngineConfig.from_flat(speculative="draft_model", speculative_model="d", num_speculative_tokens=2
                                  ).speculative.draft_tokens == 2
    assert EngineConfig.from_flat(speculative="ngram").speculative.kind == "ngram"
    assert EngineConfig.from_flat().speculative.draft_tokens == 0
    with pytest.raises(ValueError, match="takes no --speculative-model"):
        EngineConfig.from_flat(speculative="ngram", speculative_model="d")
    with pytest.raises(ValueError, match="needs --speculative-model"):
        EngineConfig.from_flat(speculative="draft_model")

    import argparse

    from rtp.cli_options import add_engine_options, engine_config

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    args = parser.parse_args(["--speculative-model", "d.gguf", "--num-speculative-tokens", "3"])
    assert engine_config(args).speculative.model == "d.gguf"
    assert "--speculative-model" in parser.format_help()


def test_a_prompt_prefilled_on_another_node_drafts_after_the_draft_catches_up(tiny_dirs):
    """A decode node's request whose prompt KV arrived from elsewhere (reserve, write_kv, resume): the
    target has that KV, the draft never computed it; the first drafting step catches the draft up on
    the whole prompt, so the target drafting for itself keeps nearly every draft, and the tokens are
    the ones a single engine generates."""
    from tiny_models import prompts_of

    from rtp.engine.kv_transfer import gather, token_slots

    target = str(tiny_dirs["target"])
    prompt = prompts_of([37], seed=5)[0]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prefill = LLM(model=target, dtype="float32", max_model_len=128).engine
    prefill.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    prefill.step()  # the prompt's step: its KV is in the prefill engine's blocks, its first token sampled
    st = prefill.scheduler.request_state(prefill.scheduler.running_request_ids()[0])
    first = int(st["token_ids"][len(prompt)])
    bs = prefill.allocator.block_size
    kv = [gather(cache, token_slots(st["block_ids"], bs, len(prompt))) for cache in prefill.runner.kv_caches]
    want = LLM(model=target, dtype="float32", max_model_len=128).generate([prompt], sp, use_tqdm=False)[0]

    # 14 blocks (as in the preemption test): other requests' blocks, their draft KV valid, come round again
    llm = LLM(model=target, dtype="float32", max_model_len=128, kv_cache_memory=14 * 16 * 2 * 512,
              speculative_measured=False, speculative_model=target, num_speculative_tokens=3)
    llm.generate(prompts_of([37, 37], seed=6), sp, use_tqdm=False)
    decode = llm.engine
    blocks = decode.reserve_request("d", prompt, sp)
    assert decode.drafter.valid.sum() > 0  # what the others left: not this prompt's draft KV
    for layer, layer_kv in enumerate(kv):
        decode.write_kv(layer, blocks, len(prompt), layer_kv)
    text = decode.resume_request("d", first).choices[0].text
    while decode.has_unfinished_requests():
        for delta in decode.step():
            text += "".join(c.text for c in delta.choices)
        decode.scheduler.check_integrity()
    s = decode.scheduler
    assert text == want.outputs[0].text and len(want.outputs[0].token_ids) == 40
    assert s.spec_draft_tokens > 10 and s.spec_accepted_tokens / s.spec_draft_tokens > 0.9
    assert decode.drafter.catch_up_tokens >= len(prompt)


def test_the_draft_runs_over_an_int8_cache_too(tiny_dirs):
    """--kv-cache-dtype int8 with a draft model: both caches int8 (with their scales, K rotated), the
    output is the int8 engine's without drafts token for token, and the target drafting for itself
    keeps nearly everything."""
    from tiny_models import prompts_of

    target = str(tiny_dirs["target"])
    common = dict(model=target, dtype="bfloat16", max_model_len=128, kv_cache_dtype="int8")
    prompts = prompts_of([20, 35, 7], seed=12)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(**common).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(**common, speculative_measured=False, speculative_model=target, num_speculative_tokens=3)
    draft = llm.engine.drafter.runner
    assert draft.kv_caches[0].dtype == torch.int8 and draft.kv_scales
    for batch in (prompts, prompts[:1]):
        got = [o.outputs[0].token_ids for o in llm.generate(batch, sp, use_tqdm=False)]
        assert got == want[:len(batch)]
    llm.engine.scheduler.check_integrity()
    assert acceptance(llm) > 0.9
