"""rtp's mixture-of-experts models against transformers, and the expert layer's own properties.

The model tests follow tests/models/test_models.py (and share its runner, in
tests/tiny_models.py): a random transformers model saved as a real checkpoint, loaded by
rtp's loader, prompts of different lengths batched through prefill and 16 decode steps,
every row's logits compared in fp32. The
layer tests check what EPLB will rely on: the load counter counts exactly the routed
(token, expert) pairs, and moving or replicating experts across slots leaves the
output bit-for-bit unchanged.
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import (
    MOE,
    MOE_CONFIGS,
    hf_reference,
    make_moe,
    prompts_of,
    random_experts,
    routed,
    run_rtp,
    write_word_tokenizer,
)
from torch.utils._python_dispatch import TorchDispatchMode

from rtp.checkpoint import CheckpointError
from rtp.checkpoint.loader import load_model
from rtp.models.moe import (
    REPRODUCIBLE_GROUP_ROWS,
    FusedMoE,
    grouped_mm,
    grouped_mm_per_group,
)


@pytest.mark.parametrize("kind", list(MOE_CONFIGS))
def test_logits_match_transformers(kind, tmp_path):
    path, hf = make_moe(kind, tmp_path)
    prompts = prompts_of((5, 23, 40), seed=1)
    worst, _ = run_rtp(path, prompts, hf_reference(hf, prompts))
    assert worst < 1e-4, f"{kind}: max abs logit difference {worst}"


def test_missing_expert_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = make_moe("mixtral", tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lacks 1 tensors.*layers\.1\.mlp\.experts\.w13#3\.up"):
        load_model(path, torch.float32, torch.device("cpu"))


def test_greedy_generation_and_load_counts_match_transformers(tmp_path):
    """rtp.LLM's greedy tokens equal transformers' generate; every MoE layer's load counter
    holds exactly the (token, expert) pairs transformers' routers chose for the tokens rtp ran."""
    from rtp import LLM, SamplingParams

    path, hf = make_moe("qwen2_moe", tmp_path)
    write_word_tokenizer(path, MOE["vocab_size"])
    prompts = prompts_of((4, 17, 31), seed=4)
    new_tokens = 12
    llm = LLM(model=str(path), dtype="float32", compile=False, max_model_len=128, enable_prefix_caching=False)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, FusedMoE)]
    assert len(layers) == 2  # the dense middle layer has none
    for layer in layers:
        layer.expert_load.zero_()  # warmup's dummy steps are not requests
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    expected = torch.zeros(len(layers), 8, dtype=torch.int64)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()
            # rtp ran the prompt and every generated token but the last
            router_logits = hf(torch.tensor([prompt + ref[:-1]]), output_router_logits=True).router_logits
        assert out.outputs[0].token_ids == ref
        assert len(router_logits) == len(layers)
        for i, logits in enumerate(router_logits):
            chosen = torch.topk(logits.float().softmax(-1), MOE["num_experts_per_tok"], dim=-1).indices
            expected[i] += torch.bincount(chosen.flatten(), minlength=8)
    assert torch.equal(torch.stack([layer.expert_load for layer in layers]), expected)


def reference_moe(layer: FusedMoE, x, weights, ids):
    """Each pair computed alone from its expert's home slot."""
    out = torch.zeros(x.shape[0], x.shape[1])
    inter = layer.intermediate_size
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            w13, w2 = layer.w13[ids[t, k]], layer.w2[ids[t, k]]
            h = w13 @ x[t]
            out[t] += weights[t, k] * (w2 @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_fused_experts_match_a_per_pair_reference(tokens):
    layer = random_experts()
    x, weights, ids = routed(tokens)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, weights, ids), reference_moe(layer, x, weights, ids),
                                   rtol=1e-5, atol=1e-5)


def test_load_counter_counts_routed_pairs():
    layer = random_experts()
    expected = torch.zeros(8, dtype=torch.int64)
    with torch.no_grad():
        for tokens in (1, 5, 33):
            x, weights, ids = routed(tokens, seed=tokens)
            buffer = layer.expert_load.data_ptr()
            layer(x, weights, ids)
            expected += torch.bincount(ids.flatten(), minlength=8)
            assert torch.equal(layer.expert_load, expected)
            assert layer.expert_load.data_ptr() == buffer  # updated in place: graph-safe
        layer.count_load = False
        layer(*routed(9))
    assert torch.equal(layer.expert_load, expected)
    assert int(expected.sum()) == 2 * (1 + 5 + 33)


@pytest.mark.parametrize("tokens", [1, 3, 5, 9, 40])
def test_replicated_and_moved_experts_keep_output_bit_for_bit(tokens):
    """Expert 3 gets a replica in spare slot 8 (its tokens split across slots 3 and 8),
    expert 5 moves to spare slot 9 (slot 5 poisoned with NaN to prove nothing reads it).
    At this width MKL's small-row kernels differ in the last bits, so without the padding
    to REPRODUCIBLE_GROUP_ROWS the split groups would change the output."""
    layer = random_experts(hidden=128, inter=64, num_slots=10)
    x, weights, ids = routed(tokens, hidden=128, seed=tokens + 10)
    ids[0] = torch.tensor([3, 5])  # both have work even with one token
    with torch.no_grad():
        identity = layer(x, weights, ids)
        layer.w13[8], layer.w2[8] = layer.w13[3], layer.w2[3]
        layer.w13[9], layer.w2[9] = layer.w13[5], layer.w2[5]
        layer.w13[5] = float("nan")
        layer.logical_to_physical[3, :2] = torch.tensor([3, 8])
        layer.replica_count[3] = 2
        layer.logical_to_physical[5, 0] = 9
        placed = layer(x, weights, ids)
        assert torch.equal(placed, identity)
        if (ids == 3).sum() > 1:  # the replica really serves tokens: change it and the output changes
            layer.w2[8] += 1
            assert not torch.equal(layer(x, weights, ids), identity)


def test_small_groups_are_padded_only_where_replicas_can_split_them():
    assert random_experts().min_group_rows == 1
    assert random_experts(num_slots=9).min_group_rows == REPRODUCIBLE_GROUP_ROWS


class MatmulCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "mm" in func.overloadpacket.__name__ or func.overloadpacket.__name__ in ("linear", "matmul"):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def test_expert_compute_is_grouped():
    """Two grouped GEMMs per forward, however many tokens: no loop over tokens or experts."""
    layer = random_experts()
    counts = []
    with torch.no_grad():
        for tokens in (1, 16, 256):
            with MatmulCounter() as counter:
                layer(*routed(tokens))
            counts.append(counter.calls)
    assert counts == [2, 2, 2]


def test_grouped_mm_fallback_matches():
    """The one-matmul-per-group path (dtypes _grouped_mm lacks) computes the same groups."""
    torch.manual_seed(0)
    x, w = torch.randn(20, 16), torch.randn(4, 24, 16)
    group_end = torch.tensor([5, 5, 12, 20])
    fast, slow = grouped_mm(x, w, group_end), grouped_mm_per_group(x, w, group_end)
    torch.testing.assert_close(fast, slow)
    torch.testing.assert_close(slow[5:12], x[5:12] @ w[2].T)


def test_config_reads_moe_fields(tmp_path):
    from rtp.config import ModelConfig

    path, _ = make_moe("qwen2_moe", tmp_path)
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.shared_expert_intermediate_size == 48 and cfg.qkv_bias and not cfg.norm_topk_prob
    assert [cfg.is_moe_layer(i) for i in range(3)] == [True, False, True]
    mixtral = ModelConfig.from_hf({**json.loads((path / "config.json").read_text()),
                                   "architectures": ["MixtralForCausalLM"], "num_experts": None,
                                   "num_local_experts": 4, "mlp_only_layers": []})
    assert mixtral.norm_topk_prob and mixtral.moe_intermediate_size == 112 and mixtral.num_experts == 4
    olmoe_path, _ = make_moe("olmoe", tmp_path / "olmoe")
    olmoe = ModelConfig.from_hf(json.loads((olmoe_path / "config.json").read_text()))
    assert olmoe.moe_intermediate_size == 112 and not olmoe.norm_topk_prob and not olmoe.qk_norm
    with pytest.raises(ValueError, match="OLMoE's q/k norm spans all heads"):
        olmoe.check_tensor_parallel(2)


def test_rebalance_from_the_measured_load_keeps_output_bit_for_bit():
    """The EPLB loop on one layer: route traffic, plan from the layer's own load counter
    (replicas of the hottest experts, balanced over 4 ranks of 3 slots), move the weights
    with place(), and the same tokens give the same output; a second plan from new traffic
    moves them again."""
    from rtp.engine.eplb import eplb_placement

    layer = random_experts(hidden=128, inter=64, num_slots=12)
    x, weights, ids = routed(48, hidden=128, seed=3)
    ids[:, 0] = torch.where(ids[:, 0] % 2 == 0, 1, ids[:, 0])  # skew: expert 1 is hot
    with torch.no_grad():
        before = layer(x, weights, ids)
        for _ in range(2):
            load = layer.expert_load.numpy()[None]
            placement = eplb_placement(load, num_ranks=4, extra_slots=4)
            layer.place(placement.slots[0].reshape(-1).tolist())
            assert int(layer.replica_count[1]) >= 2  # the hot expert got copies
            assert torch.equal(layer(x, weights, ids), before)
    with pytest.raises(ValueError, match="keep every expert"):
        layer.place([0] * 12)
