"""EPLB while serving (rtp/engine/expert_balancer.py) through the real engine.

Tiny random Mixtral checkpoints (tests/tiny_models.py's) run through LLM in fp32. The
rebalance interval is a few steps, so the experts move (and replicas appear) several
times while the requests decode; the greedy tokens must not change. The CPU graphs
the runner would capture for decode steps refuse MoE layers (their routing runs torch
ops outside rtp's kernels), so these runs are eager; the place() moves copy in place,
which is what keeps captured graphs valid where they exist (test_moves_keep_addresses).
"""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch
from tiny_models import MOE, make_deepseek, make_moe, prompts_of, routed, write_word_tokenizer

from rtp.engine.expert_balancer import ExpertBalancer, redundant_slots
from rtp.models.moe import FusedMoE

KW = {"dtype": "float32", "compile": False, "max_model_len": 128, "enable_prefix_caching": False}


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path, _ = make_moe("mixtral", tmp_path_factory.mktemp("eplb") / "ckpt")
    write_word_tokenizer(path, MOE["vocab_size"])
    return str(path)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """DeepSeek-V3 (MLA, sigmoid group-limited routing, a dense first layer, shared experts)."""
    path, _ = make_deepseek("q-lora-yarn", tmp_path_factory.mktemp("eplb") / "ckpt")
    write_word_tokenizer(path, MOE["vocab_size"])
    return str(path)


def run(path, prompts, max_tokens=20, **config):
    from rtp import LLM, SamplingParams

    llm = LLM(model=path, **KW, **config)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [o.outputs[0] for o in outs]


@pytest.mark.parametrize("model", ["mixtral", "deepseek"])
def test_rebalancing_mid_generation_keeps_greedy_outputs(model, request, caplog):
    """EPLB on, a rebalance every 3 steps: tokens equal EPLB off, logprobs within 1e-5 (the
    layers with spare slots pad expert groups to 16 rows, other MKL kernels), and bit for bit
    equal to EPLB on without any rebalance (moves and replicas change nothing)."""
    mixtral = request.getfixturevalue(model)
    prompts = prompts_of((5, 23, 40, 9), seed=2)
    _, off = run(mixtral, prompts)
    with caplog.at_level(logging.INFO, logger="rtp.eplb"):
        llm, on = run(mixtral, prompts, enable_eplb=True, eplb_step_interval=3, eplb_window_size=4)
    _, still = run(mixtral, prompts, enable_eplb=True, eplb_step_interval=10**6)
    b = llm.engine.balancer
    # a tripwire: the day CPU graphs capture MoE decode steps, this test must run with them on
    assert llm.engine.runner.graph_steps == 0
    assert b.num_ranks == 4 and b.spare == 4  # 5 % of 8 experts, rounded up to one slot per rank
    assert b.rebalances >= 3 and b.steps > 3 * b.interval  # moves happened while requests decoded
    assert (b.replicas() == 4).all()
    for layer, slots in zip(b.layers, b.current):  # the layers' tables follow the applied slots
        assert torch.equal(layer.replica_count, torch.bincount(torch.from_numpy(slots[slots >= 0]), minlength=8))
    assert not (b.current[:, :8] == np.arange(8)).all()  # experts left their load-time slots
    for a, c, s in zip(off, on, still):
        assert a.token_ids == c.token_ids == s.token_ids
        assert c.logprobs == s.logprobs
        assert abs(a.cumulative_logprob - c.cumulative_logprob) < 1e-5
    lines = [r.getMessage() for r in caplog.records if "EPLB rebalance" in r.getMessage()]
    assert len(lines) == b.rebalances and "max/min rank load" in lines[0] and "replicas 4 per layer" in lines[0]


def test_moves_keep_addresses(mixtral):
    """A rebalance copies into the same storage (weights, dispatch tables, counters): a graph
    captured before it reads the moved experts after it."""
    from rtp import LLM

    llm = LLM(model=mixtral, **KW, enable_eplb=True, eplb_step_interval=10**6)
    b = llm.engine.balancer
    names = ("w13", "w2", "logical_to_physical", "replica_count", "expert_load")
    before = [[getattr(m, n).data_ptr() for n in names] for m in b.layers]
    slots = b.current.copy()
    slots[:, 8:] = [1, 3, 5, 7]
    b.apply(slots[:, ::-1].copy())
    assert [[getattr(m, n).data_ptr() for n in names] for m in b.layers] == before
    assert (b.replicas() == 4).all() and int(b.layers[0].replica_count[1]) == 2


def test_replicas_are_dropped_under_kv_pressure_and_return(mixtral, caplog):
    """A KV cache of 11 usable blocks: two 72-token prompts (80 with their tokens) fill 10 of them (91 % > 85 %), and
    the replicas go at once, without waiting for the interval; once the long requests finish,
    the next interval's plan brings them back. Tokens equal EPLB off throughout."""
    block = 16 * 2 * 2 * 2 * 16 * 4  # tokens x layers x (K, V) x kv heads x head dim x fp32
    kv = {"kv_cache_memory": 12 * block, "block_size": 16}
    short, long = prompts_of((6, 7), seed=5), prompts_of((72, 72), seed=6)
    from rtp import LLM, SamplingParams
    from rtp.engine.output import RequestOutput

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = LLM(model=mixtral, **KW, **kv)
    want = [[o.outputs[0].token_ids for o in ref.generate(p, params, use_tqdm=False)] for p in (short, long, short)]
    llm = LLM(model=mixtral, **KW, **kv, enable_eplb=True, eplb_step_interval=4, eplb_window_size=4)
    b, engine = llm.engine.balancer, llm.engine
    assert engine.allocator.num_blocks - 1 == 11
    got = [[o.outputs[0].token_ids for o in llm.generate(short, params, use_tqdm=False)]]
    assert (b.replicas() == 4).all()
    with caplog.at_level(logging.INFO, logger="rtp.eplb"):
        outs = {}
        for i, p in enumerate(long):
            engine.add_request(f"long{i}", p, params)
            outs[f"long{i}"] = RequestOutput.start(f"long{i}", None, p, params)
        usage, replicas = [], []
        while engine.has_unfinished_requests():
            for delta in engine.step():
                outs[delta.request_id].add(delta)
            usage.append(engine.allocator.num_used / 11)
            replicas.append(int(b.replicas().max()))
    got.append([outs[f"long{i}"].outputs[0].token_ids for i in range(2)])
    assert max(usage) > 0.85
    # no replicas after any step that ended over 85 % (the step's end is when plans are made)
    assert all(r == 0 for u, r in zip(usage, replicas) if u > 0.85)
    assert any("(kv pressure)" in r.getMessage() for r in caplog.records)
    got.append([o.outputs[0].token_ids for o in llm.generate(short, params, use_tqdm=False)])
    assert (b.replicas() == 4).all()  # pressure gone: the interval's plan replicates again
    assert got == want


def test_dropped_replicas_lend_their_memory_to_the_kv_cache(mixtral, caplog):
    """Replicas dropped under pressure give their slots' pages back and the pool grows by the
    blocks those bytes pay for; when pressure eases, the replicas wait while a lent block still
    holds KV, and come back once the pool could shrink. Tokens equal EPLB off throughout.

    The arithmetic: a Mixtral slot is w13 [2 x 112, 64] + w2 [64, 112] fp32 = 86016 bytes,
    21 whole pages (the stacks are page-aligned); 4 spare slots in each of 2 MoE layers give
    8 x 86016 bytes, at 8192 bytes a block (16 tokens x 2 layers x K, V x 2 heads x 16 x fp32)
    84 blocks."""
    from rtp import LLM, SamplingParams

    block = 16 * 2 * 2 * 2 * 16 * 4
    slot = (2 * 112 * 64 + 64 * 112) * 4
    assert slot % 4096 == 0 and 8 * slot // block == 84
    kv = {"kv_cache_memory": 12 * block, "block_size": 16}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    batches = [prompts_of((6, 7), seed=s) for s in (5, 7, 8, 9)]
    ref = LLM(model=mixtral, **KW, **kv)
    want = [[o.outputs[0].token_ids for o in ref.generate(p, params, use_tqdm=False)] for p in batches]
    llm = LLM(model=mixtral, **KW, **kv, enable_eplb=True, eplb_step_interval=4, eplb_window_size=4)
    engine, b, a = llm.engine, llm.engine.balancer, llm.engine.allocator
    assert (a.num_blocks, a.capacity) == (12, 96) and engine.runner.kv_caches[0].shape[1] == 96

    def generate(prompts):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    got = [generate(batches[0])]
    assert (b.replicas() == 4).all() and a.num_blocks == 12
    held = a.allocate(10)  # 10 of 11 blocks held: pressure at the next step
    with caplog.at_level(logging.INFO, logger="rtp.eplb"):
        got.append(generate(batches[1]))
    assert (b.replicas() == 0).all() and b.released.sum() == 8
    assert a.num_blocks == 96 and b.stats()["kv_blocks_lent"] == b.kv_blocks_gained == 84
    assert any("(kv pressure)" in r.getMessage() and "KV blocks +84 (84 lent)" in r.getMessage()
               for r in caplog.records)
    for m, slots in zip(b.layers, b.current):  # the emptied slots' pages were given back: zeros
        for k in np.nonzero(slots < 0)[0]:
            assert not m.w13[k].any() and not m.w2[k].any()
    # pressure gone, but a lent block still holds KV: the interval's plan waits
    lent = a.allocate(3)  # the last own block, then two lent ones
    assert lent.max() >= 12
    a.free(held)
    got.append(generate(batches[2]))
    assert b.kv_waits >= 1 and (b.replicas() == 0).all() and a.num_blocks == 96
    assert b.planned_ratio.tolist() == b.ratio.tolist()  # nothing was applied
    a.free(lent)
    with caplog.at_level(logging.INFO, logger="rtp.eplb"):
        got.append(generate(batches[3]))
    assert (b.replicas() == 4).all() and not b.released.any()
    assert a.num_blocks == 12 and b.kv_blocks_returned == 84 and b.stats()["kv_blocks_lent"] == 0
    # handed back in one plan, or layer by layer where a plan keeps a layer's placement
    deltas = [int(m[1]) for r in caplog.records if (m := re.search(r"KV blocks ([-+]\d+)", r.getMessage()))]
    assert sum(d for d in deltas if d < 0) == -84
    assert got == want
    engine.scheduler.check_integrity()


def test_no_whole_page_in_a_slot_lends_nothing(caplog):
    """Slots smaller than a page give nothing back: the pool keeps its size, and the log says why."""
    layers = [FusedMoE(8, 16, 8, num_slots=12) for _ in range(2)]  # 1.5 KiB a slot
    assert all(m.releasable(k) == 0 for m in layers for k in range(12))
    b = ExpertBalancer(layers, num_ranks=4, window=4, interval=6, kv_pressure=0.85, kv_block_bytes=1024,
                       kv_base=10, kv_capacity=10)
    slots = b.current.copy()
    slots[:, 8:] = [1, 3, 5, 7]
    b.apply(slots, kv_limit=b.kv_limit_after(slots))
    dropped = slots.copy()
    dropped[:, 8:] = -1
    with caplog.at_level(logging.INFO, logger="rtp.eplb"):
        b.apply(dropped, kv_limit=b.kv_limit_after(dropped))
    assert b.released.sum() == 8 and b.kv_limit_after(b.current) == 10 and b.kv_blocks_gained == 0
    assert any("memory stays allocated (no whole page in a slot)" in r.getMessage() for r in caplog.records)


def test_the_kv_limit_follows_the_released_slots():
    """kv_limit_after: the limit as built plus what the slots released after a placement pay for
    (emptied now, or released before and still empty; the spare slots as loaded do not count)."""
    torch.manual_seed(0)
    layers = [FusedMoE(8, 64, 32, num_slots=12) for _ in range(2)]  # 24 KiB a slot, 6 pages
    per_slot = layers[0].releasable(0)
    assert per_slot == (2 * 32 * 64 + 64 * 32) * 4 == 6 * 4096
    b = ExpertBalancer(layers, num_ranks=4, window=4, interval=6, kv_pressure=0.85, kv_block_bytes=8192,
                       kv_base=10, kv_capacity=10 + 8 * per_slot // 8192)
    assert b.kv_limit_after(b.current) == 10  # as loaded: nothing released
    full = b.current.copy()
    full[:, 8:] = [1, 3, 5, 7]
    b.apply(full, kv_limit=b.kv_limit_after(full))
    assert b.kv_limit == 10
    dropped = full.copy()
    dropped[:, 8:] = -1
    assert b.kv_limit_after(dropped) == 10 + 8 * per_slot // 8192 == 34
    one_layer = full.copy()
    one_layer[0, 8:] = -1
    assert b.kv_limit_after(one_layer) == 10 + 4 * per_slot // 8192
    b.apply(dropped, kv_limit=34)
    again = dropped.copy()  # a later plan that keeps them empty keeps them released
    assert b.kv_limit_after(again) == 34
    partly = dropped.copy()
    partly[:, 8:10] = [2, 4]  # two replicas back per layer: half the memory returns
    assert b.kv_limit_after(partly) == 10 + 4 * per_slot // 8192


def test_planner_never_exceeds_its_memory_cap():
    rng = np.random.default_rng(0)
    for _ in range(500):
        experts, ranks = int(rng.choice([8, 16, 64, 256])), int(rng.choice([1, 2, 4, 8]))
        slot_bytes, free = int(rng.integers(1, 1 << 20)), int(rng.integers(0, 1 << 26))
        cap = float(rng.uniform(0, 0.3))
        requested = None if rng.random() < 0.5 else int(rng.integers(0, 64))
        spare = redundant_slots(experts, ranks, requested=requested, share=0.05, slot_bytes=slot_bytes,
                                free_bytes=free, memory_cap=cap)
        assert spare % ranks == 0 and spare >= 0
        assert spare * slot_bytes <= cap * free
    # plenty of memory: the share (rounded up to the ranks) or what was asked for
    assert redundant_slots(256, 16, requested=None, share=0.05, slot_bytes=1, free_bytes=1 << 40, memory_cap=0.15) == 16
    assert redundant_slots(256, 16, requested=20, share=0.05, slot_bytes=1, free_bytes=1 << 40, memory_cap=0.15) == 32


def test_engine_with_no_memory_for_replicas_keeps_one_slot_per_expert(mixtral):
    llm, _ = run(mixtral, prompts_of((9,), seed=1), max_tokens=8, enable_eplb=True, num_redundant_experts=4,
                 eplb_memory_cap=0.0, eplb_step_interval=2)
    b = llm.engine.balancer
    assert b.spare == 0 and all(m.num_slots == 8 for m in b.layers) and (b.replicas() == 0).all()


def test_window_load_is_the_last_window_of_steps():
    """Counters snapshotted where a window starts: the plans at steps 6 and 12 see the 4 steps
    before them only."""
    torch.manual_seed(0)
    layers = [FusedMoE(8, 64, 32, num_slots=12) for _ in range(2)]
    for m in layers:
        torch.nn.init.normal_(m.w13, std=0.1)
        torch.nn.init.normal_(m.w2, std=0.1)
    b = ExpertBalancer(layers, num_ranks=4, window=4, interval=6, kv_pressure=0.85)
    per_step = []
    with torch.no_grad():
        for step in range(12):
            x, w, ids = routed(3 + step, seed=step)
            for m in layers:
                m(x, w, ids)
            per_step.append(np.bincount(ids.flatten().numpy(), minlength=8))
            decision = b.count_step(0.0)
            assert (decision is not None) == ((step + 1) % 6 == 0)
            if decision is not None:
                for layer in range(2):
                    assert np.array_equal(decision.load[layer], sum(per_step[-4:]))
                b.apply(decision.slots, decision)
    assert b.rebalances == 2 and (b.replicas() == 4).all()
    assert sorted(b._snapshots) == [8]  # older snapshots dropped: no plan needs them


def test_metrics_show_ratio_replicas_and_moves(mixtral):
    from prometheus_client import generate_latest

    from rtp.server.metrics import ServerMetrics

    llm, _ = run(mixtral, prompts_of((12, 30), seed=3), max_tokens=10, enable_eplb=True, eplb_step_interval=3)
    metrics = ServerMetrics("m")
    metrics.read_stats = llm.engine.stats
    text = generate_latest(metrics.registry).decode()
    s = llm.engine.stats()["eplb"]
    assert s["rebalances"] >= 2 and s["move_seconds"] > 0
    assert f'rtp:eplb_rank_load_ratio{{layer="1",model_name="m"}} {s["rank_load_ratio"][1]}' in text
    assert f'rtp:eplb_planned_rank_load_ratio{{layer="0",model_name="m"}} {s["planned_rank_load_ratio"][0]}' in text
    assert 'rtp:eplb_replicas{layer="0",model_name="m"} 4.0' in text
    assert f'rtp:eplb_rebalances_total{{model_name="m"}} {float(s["rebalances"])}' in text
    assert "rtp:eplb_move_seconds_total" in text and "rtp:eplb_rank_load_ratio_max" in text
    assert 'rtp:eplb_kv_blocks_lent{model_name="m"} 0.0' in text  # no pressure: nothing lent
    for name in ("gained", "returned"):
        assert f'rtp:eplb_kv_blocks_{name}_total{{model_name="m"}} 0.0' in text
    assert 'rtp:eplb_kv_waits_total{model_name="m"} 0.0' in text
    assert s["rank_load_ratio_max"] >= max(s["planned_rank_load_ratio"]) >= 1.0


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 1)])
def test_two_ranks_rebalance_at_the_same_step(mixtral, tp, ep):
    """Rank 0 plans and sends the slots; every rank moves its experts between the same two
    steps: with --ep 2 over the all-to-all (each rank holds half the slots), with --tp 2 each
    rank moves its full copy. Tokens equal the single-process run."""
    from rtp import distributed as dist

    prompts = prompts_of((7, 30, 12), seed=4)
    _, want = run(mixtral, prompts, max_tokens=12)
    from rtp import LLM, SamplingParams

    llm = LLM(model=mixtral, **KW, kv_cache_memory=1 << 22, tensor_parallel_size=tp, expert_parallel_size=ep,
              enable_eplb=True, eplb_step_interval=3, eplb_num_ranks=2)
    try:
        b = llm.engine.balancer
        # (8 experts + 2 spare) over 2 ranks
        assert b.num_ranks == 2 and b.layers[0].local_slots == (5 if ep == 2 else 10)
        got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        assert b.rebalances >= 2 and (b.replicas() == 2).all()
    finally:
        llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.token_ids for o in want]
    assert dist.world_size() == 1


def test_cli_flags_reach_the_engine_config():
    from rtp.cli import build_parser
    from rtp.cli_options import engine_config
    from rtp.config import EngineConfig

    for command in (["serve"], ["generate", "--prompt", "x"]):
        args = build_parser().parse_args([*command, "--enable-eplb", "--eplb-step-interval", "50",
                                          "--eplb-window-size", "20", "--num-redundant-experts", "16",
                                          "--eplb-kv-pressure", "0.9"])
        eplb = engine_config(args).eplb
        assert (eplb.enable, eplb.step_interval, eplb.window_size) == (True, 50, 20)
        assert (eplb.num_redundant_experts, eplb.kv_pressure, eplb.memory_cap) == (16, 0.9, 0.15)
    with pytest.raises(ValueError, match="eplb_kv_pressure"):
        EngineConfig.from_flat(eplb_kv_pressure=1.5)


def test_a_plan_moves_as_few_weights_as_it_can():
    """Plans are relabelled onto the placement in use (ranks and slots within a rank are
    interchangeable): the same load planned again moves nothing, and a plan for a shuffled
    placement keeps every rank's load."""
    from rtp.engine.eplb import eplb_placement
    from rtp.engine.expert_balancer import _closest

    rng = np.random.default_rng(0)
    load = rng.zipf(1.5, (1, 32)).astype(np.int64)
    plan = eplb_placement(load, 4, 4).slots[0]
    again = _closest(eplb_placement(load, 4, 4).slots[0], plan)
    assert np.array_equal(again, plan)
    shuffled = plan[rng.permutation(4)][:, rng.permutation(9)]
    relabelled = _closest(plan, shuffled)
    assert np.array_equal(relabelled, shuffled)  # nothing to move: the same sets, already in place
    new = eplb_placement(load * rng.integers(1, 5, load.shape), 4, 4).slots[0]
    moved = _closest(new, plan)
    assert sorted(map(sorted, moved.tolist())) == sorted(map(sorted, new.tolist()))  # the same rank sets
    assert (moved != plan).sum() < (new != plan).sum()  # fewer slots rewritten than the raw plan's
