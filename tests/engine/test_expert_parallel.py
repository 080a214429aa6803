"""Expert parallelism on torch.distributed (gloo, 2 processes on this CPU).

Each rank holds half of every MoE layer's physical expert slots; the pairs routed to
the other half travel over all_to_all_single and back (rtp/models/expert_parallel.py).
Whatever the placement (EPLB replicas split across ranks, weights moved between ranks
by FusedMoE.place), the micro-chunking or the overlap, the output must be the
single-process layer's, and a whole model's logits the single-process model's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ranks import run_ranks
from tiny_models import (
    MOE,
    NEW_TOKENS,
    hf_reference,
    make_dense,
    make_moe,
    prompts_of,
    random_experts,
    routed,
    write_word_tokenizer,
)

import rtp.distributed as dist
from rtp.engine.eplb import eplb_placement
from rtp.checkpoint.loader import load_model
from rtp.engine.runner import ModelRunner
from rtp.models.expert_parallel import AllToAllExchange
from rtp.models.moe import FusedMoE
from rtp.runtime import BlockAllocator, Scheduler

# -- one layer ---------------------------------------------------------------------------

def _layer_rank(rank: int, init: str) -> dict:
    """ep=2 against the single-process layer on the same weights, over several placements,
    chunkings and token counts."""
    full = random_experts(hidden=128, inter=64, num_slots=10)  # 8 experts, 2 spare slots; before joining
    dist.init_parallel(tp=1, ep=2, rank=rank, backend="gloo", init_method=init, timeout_s=60)
    layer = FusedMoE(8, 128, 64, num_slots=10)
    assert (layer.local_slots, layer.slot_offset) == (5, 5 * rank)
    assert isinstance(layer.exchange, AllToAllExchange)
    with torch.no_grad():
        layer.w13.copy_(full.w13[5 * rank:5 * rank + 5])
        layer.w2.copy_(full.w2[5 * rank:5 * rank + 5])
    report = {"worst": 0.0, "cases": 0, "moved": False}
    exchange = layer.exchange
    with torch.no_grad():
        for placement_round in range(3):
            for tokens in (1, 3, 40, 97):
                x, weights, ids = routed(tokens, hidden=128, seed=tokens + placement_round)
                ids[:, 0] = torch.where(ids[:, 0] % 3 == 0, 1, ids[:, 0])  # expert 1 hot: worth replicating
                want = full(x, weights, ids)
                for chunks, overlap, split in ((1, False, "experts"), (2, True, "experts"), (2, True, "tokens"),
                                               (4, True, "tokens")):
                    exchange.chunks, exchange.overlap, exchange.split = chunks, overlap, split
                    exchange.min_chunk_tokens = 4
                    got = layer(x, weights, ids)
                    report["worst"] = max(report["worst"], (got - want).abs().max().item())
                    report["cases"] += 1
            # plan from the (identical) load both ranks counted; move weights across ranks
            placement = eplb_placement(full.expert_load.numpy()[None], num_ranks=2, extra_slots=2)
            slots = placement.slots[0].reshape(-1).tolist()
            before = layer.w13.clone()
            full.place(slots)
            layer.place(slots)
            report["moved"] |= not torch.equal(before, layer.w13)
            assert torch.equal(layer.logical_to_physical, full.logical_to_physical)
            assert torch.equal(layer.w13, full.w13[5 * rank:5 * rank + 5])  # the weights really moved here
            assert int(layer.replica_count.max()) >= 2
    report["load"] = layer.expert_load.tolist()
    report["full_load"] = full.expert_load.tolist()
    return report


def _layer_ranks(rank: int, init: str) -> tuple[dict, list]:
    report = _layer_rank(rank, init)
    return report, _overlap_rank(rank)


@pytest.fixture(scope="module")
def layer_reports(tmp_path_factory) -> list:
    """Both layer checks in one pair of processes (starting them is most of the time)."""
    return run_ranks(_layer_ranks, tmp_path=tmp_path_factory.mktemp("layer"))


def test_ep2_layer_matches_one_rank_with_replicas_moves_and_overlap(layer_reports):
    """Replicas of a hot expert on both ranks, weights moved between ranks by place(), 1-97
    tokens (ranks with no token of their own), one synchronous exchange or 2 and 4 overlapped
    micro-chunks split by expert or by token: always the single-process output (fp32, 1e-5);
    the load counter is global."""
    for report, _ in layer_reports:
        assert report["cases"] == 3 * 4 * 4 and report["moved"]
        assert report["worst"] < 1e-5, report["worst"]
        # 4 exchanges per batch against the reference's one; counted over all tokens on each rank
        assert report["load"] == [4 * n for n in report["full_load"]]


def _overlap_rank(rank: int) -> list:
    layer = random_experts(hidden=128, inter=64, num_slots=10, seed=rank)  # each rank its own slots
    x, weights, ids = routed(256, hidden=128, seed=7)
    outs = []
    with torch.no_grad():
        for chunks, overlap, split in ((1, False, "experts"), (4, True, "experts"), (4, True, "tokens"),
                                       (4, False, "tokens")):
            layer.exchange.chunks, layer.exchange.overlap, layer.exchange.split = chunks, overlap, split
            assert layer.exchange.num_chunks(256) == (chunks if overlap else 1)
            outs.append(layer(x, weights, ids))
    return [(outs[0] - o).abs().max().item() for o in outs[1:]]


def test_overlap_on_equals_overlap_off(layer_reports):
    """4 overlapped micro-chunks, split by expert or by token, give the output of one
    synchronous exchange bit for bit (an expert's rows stay one group, or its groups are
    padded to REPRODUCIBLE_GROUP_ROWS), on both ranks."""
    for _, diffs in layer_reports:
        assert diffs == [0.0, 0.0, 0.0], diffs


# -- whole models ------------------------------------------------------------------------

def logits_of_run(model, prompts, refs) -> list[torch.Tensor]:
    """Prefill then NEW_TOKENS decode steps through the real runtime, feeding transformers'
    greedy tokens; every step's logits."""
    runner = ModelRunner(model, num_blocks=128, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                         max_model_len=128, kv_dtype=torch.float32, device=torch.device("cpu"), compile=False)
    runner.warmup(progress=False)
    sched = Scheduler(BlockAllocator(128, 4), runner.plan, max_num_seqs=8, max_num_batched_tokens=64,
                      max_model_len=128)
    for i, p in enumerate(prompts):
        sched.add_request(i, p, max_tokens=NEW_TOKENS, ignore_eos=True)
    length = {i: len(p) for i, p in enumerate(prompts)}
    steps = []
    while sched.has_unfinished:
        sched.schedule()
        logits = runner.forward().clone()
        feed = np.zeros(len(logits), dtype=np.int64)
        for k, rid in enumerate(runner.sample_req_ids().tolist()):
            feed[k] = refs[rid][0][length[rid]]
            length[rid] += 1
        steps.append(logits)
        sched.update(feed)
    return steps


def _model_rank(rank: int, init: str, path, prompts, refs, want, tp: int) -> float:
    dist.init_parallel(tp=tp, ep=2, rank=rank, backend="gloo", init_method=init, timeout_s=60)
    model, _ = load_model(path, torch.float32, torch.device("cpu"), redundant_experts=2)
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert layers and all(layer.local_slots == 5 for layer in layers)
    logits_of_run(model, prompts, refs)  # measure the load the placement is planned from
    load = np.stack([layer.expert_load.numpy() for layer in layers])
    placement = eplb_placement(load, num_ranks=2, extra_slots=2)
    for layer, slots in zip(layers, placement.slots):
        layer.place(slots.reshape(-1).tolist())
        layer.exchange.min_chunk_tokens = 4  # prefill steps run in 2 overlapped micro-chunks
    got = logits_of_run(model, prompts, refs)
    assert len(got) == len(want)
    return max((g - w).abs().max().item() for g, w in zip(got, want))


@pytest.mark.parametrize(("kind", "tp"), [("mixtral", 1), ("qwen2_moe", 2)])
def test_ep2_model_logits_equal_ep1(kind, tp, tmp_path):
    """Mixtral with attention replicated (tp=1) and Qwen2-MoE (shared expert, a dense layer)
    with attention sharded over the same two ranks (tp=2), at ep=2 with EPLB replicas placed
    from the measured load: every step's logits equal the single-process model's (fp32, 1e-4)."""
    path, hf = make_moe(kind, tmp_path / "ckpt")
    prompts = prompts_of((5, 23, 40), seed=1)
    refs = hf_reference(hf, prompts)
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    want = logits_of_run(model, prompts, refs)
    worst = run_ranks(_model_rank, path, prompts, refs, want, tp, tmp_path=tmp_path)
    assert max(worst) < 1e-4, worst


def test_sizes_are_checked():
    with pytest.raises(ValueError, match="each must be 1 or the number of ranks"):
        dist.check_sizes(2, 4)
    assert dist.check_sizes(1, 4) == 4 and dist.check_sizes(2, 2) == 2


def test_engine_ep2_generates_what_ep1_does(tmp_path):
    """LLM(expert_parallel_size=2) spawns a follower holding half the experts (attention
    replicated): greedy tokens equal the single-process engine's."""
    from rtp import LLM, SamplingParams

    path, _ = make_moe("qwen2_moe", tmp_path / "ckpt")
    write_word_tokenizer(path, MOE["vocab_size"])
    prompts = prompts_of((7, 30, 12), seed=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = {"dtype": "float32", "compile": False, "max_model_len": 128, "kv_cache_memory": 1 << 22}
    want = [o.outputs[0].token_ids for o in LLM(model=str(path), **kw).generate(prompts, params)]
    llm = LLM(model=str(path), expert_parallel_size=2, **kw)
    try:
        assert dist.ep_size() == 2 and dist.tp_size() == 1 and len(llm.engine._followers) == 1
        layer = next(m for m in llm.engine.model.modules() if isinstance(m, FusedMoE))
        assert layer.local_slots == 4
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.engine.shutdown()
    assert got == want
    assert dist.world_size() == 1 and not llm.engine._followers[0].is_alive()


def test_ep_needs_experts_to_split(tmp_path):
    """--ep 2 on a dense model is a clear error on every rank, not two ranks repeating one model."""
    from rtp import LLM

    path, _ = make_dense("llama", tmp_path / "ckpt")
    write_word_tokenizer(path, MOE["vocab_size"])
    with pytest.raises(ValueError, match="has no experts to split"):
        LLM(model=str(path), dtype="float32", compile=False, max_model_len=128, kv_cache_memory=1 << 22,
            expert_parallel_size=2)
    assert dist.world_size() == 1
