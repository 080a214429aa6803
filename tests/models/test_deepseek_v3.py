"""DeepSeek-V3 (MLA + sigmoid-routed MoE) against transformers, and what its latent cache costs.

The logit tests follow tests/models/test_models.py (and share its runner, in
tests/tiny_models.py): a random transformers model saved as a real checkpoint, loaded by
rtp's loader, prompts of different lengths batched through prefill and 16 decode steps on
the real runtime, every row's logits compared in fp32. The decode rows go through the
absorbed form (W_UK folded into q, W_UV into the output) and the prefill chunks through the
decompressed one, so agreement with transformers (which always decompresses) checks both.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from tiny_models import (
    DEEPSEEK,
    DEEPSEEK_CONFIGS,
    NEW_TOKENS,
    hf_reference,
    make_deepseek,
    prompts_of,
    run_rtp,
    write_word_tokenizer,
)

from rtp.engine.kv_cache import bytes_per_block
from rtp.checkpoint.loader import load_model
from rtp.engine.runner import ModelRunner
from rtp.models.moe import FusedMoE
from rtp.runtime import BlockAllocator, RadixCache, Scheduler


@pytest.mark.parametrize("kind", list(DEEPSEEK_CONFIGS))
def test_logits_match_transformers(kind, tmp_path):
    path, hf = make_deepseek(kind, tmp_path)
    prompts = prompts_of((5, 23, 40), seed=1)
    worst, _ = run_rtp(path, prompts, hf_reference(hf, prompts), max_batched=32)  # 40 tokens: two chunks
    assert worst < 1e-4, f"{kind}: max abs logit difference {worst}"


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_from_safetensors_matches_transformers(method, tmp_path):
    """DeepSeek-V2's softmax routing (no correction bias; greedy as V2-Lite, or within the groups whose best
    expert scores highest, scaled by routed_scaling_factor) on the same MLA model."""
    from tiny_models import random_hf_model

    keys = {**DEEPSEEK, "q_lora_rank": None, "topk_method": method, "norm_topk_prob": False,
            "n_group": 4 if method != "greedy" else 1, "topk_group": 2 if method != "greedy" else 1,
            "routed_scaling_factor": 2.5 if method != "greedy" else 1.0}
    hf = random_hf_model(transformers.DeepseekV2Config(**keys))
    hf.save_pretrained(tmp_path)
    prompts = prompts_of((5, 23, 40), seed=2)
    worst, _ = run_rtp(tmp_path, prompts, hf_reference(hf, prompts), max_batched=32)
    assert worst < 1e-4, f"{method}: max abs logit difference {worst}"


def drive(model, prompts, refs, *, between_steps=None, new_tokens=NEW_TOKENS, max_batched=32):
    """run_rtp over an already loaded model: the worst difference from transformers' logits,
    every sampled row's logits in step order, and the prompt tokens found in the prefix cache.
    between_steps(step) runs after each step's update."""
    block_size, max_seqs = 4, 8
    alloc = BlockAllocator(256, block_size)
    runner = ModelRunner(model, num_blocks=256, block_size=block_size, max_num_seqs=max_seqs,
                         max_num_batched_tokens=max_batched, max_model_len=128, kv_dtype=torch.float32,
                         device=torch.device("cpu"))
    cache = RadixCache(alloc)
    sched = Scheduler(alloc, runner.plan, cache=cache, max_num_seqs=max_seqs,
                      max_num_batched_tokens=max_batched, max_model_len=128)
    for i, p in enumerate(prompts):
        sched.add_request(i, p, max_tokens=new_tokens, ignore_eos=True)
    length = {i: len(p) for i, p in enumerate(prompts)}
    worst, seen, step = 0.0, [], 0
    while sched.has_unfinished:
        sched.schedule()
        logits = runner.forward()
        seen.append(logits.clone())
        feed = np.zeros(len(logits), dtype=np.int64)
        for k, rid in enumerate(runner.sample_req_ids().tolist()):
            seq, ref = refs[rid]
            pos = length[rid] - 1
            worst = max(worst, (logits[k] - ref[pos]).abs().max().item())
            feed[k] = seq[pos + 1]
            length[rid] += 1
        sched.update(feed)
        step += 1
        if between_steps is not None:
            between_steps(step)
    return worst, seen, cache.hit_tokens


def test_prefix_cache_hits_and_small_chunks_keep_logits(tmp_path):
    """Prompts sharing a 30-token prefix, prefilled 16 tokens a step: later prompts attend to
    latents another request wrote (a prefix-cache hit), chunks to their own earlier chunks."""
    path, hf = make_deepseek("q-lora-yarn", tmp_path)
    rng = np.random.default_rng(2)
    shared = rng.integers(1, 160, 30).tolist()
    prompts = [shared + rng.integers(1, 160, n).tolist() for n in (3, 11)] + [shared[:17]]
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    worst, _, hits = drive(model, prompts, hf_reference(hf, prompts), max_batched=16)
    assert hits > 0
    assert worst < 1e-4


def test_kv_cache_holds_only_the_latent_and_rope_key(tmp_path):
    """Per token and layer the cache costs (kv_lora_rank + qk_rope_head_dim) * itemsize: what
    the engine sizes its block budget by, and what the runner allocates."""
    path, _ = make_deepseek("q-lora-yarn", tmp_path)
    model, _config = load_model(path, torch.float32, torch.device("cpu"))
    layers = model.attention_layers()
    per_token = (DEEPSEEK["kv_lora_rank"] + DEEPSEEK["qk_rope_head_dim"]) * 4 * DEEPSEEK["num_hidden_layers"]
    assert len(layers) == DEEPSEEK["num_hidden_layers"]
    assert bytes_per_block([layer.kv_cache_spec for layer in layers], 16, torch.float32) == 16 * per_token
    runner = ModelRunner(model, num_blocks=10, block_size=16, max_num_seqs=2, max_num_batched_tokens=32,
                         max_model_len=128, kv_dtype=torch.float32, device=torch.device("cpu"))
    assert sum(cache.nbytes for cache in runner.kv_caches) == 10 * 16 * per_token


def test_deepseek_v3_shape_caches_576_values_per_token_and_layer():
    """The released DeepSeek-V3 config (transformers' defaults are its numbers), built on the meta
    device: 61 layers x (512 + 64) bf16 values = 70,272 bytes per token."""
    from rtp.config import ModelConfig
    from rtp.models import model_class

    hf = transformers.DeepseekV3Config().to_dict() | {"architectures": ["DeepseekV3ForCausalLM"]}
    config = ModelConfig.from_hf(hf)
    assert config.num_experts == 256 and [config.is_moe_layer(i) for i in range(4)] == [False] * 3 + [True]
    with torch.device("meta"):
        model = model_class(hf["architectures"])(config)
    specs = [layer.kv_cache_spec for layer in model.attention_layers()]
    assert bytes_per_block(specs, 1, torch.bfloat16) == 61 * 576 * 2 == 70272


def test_greedy_generation_matches_transformers_and_runs_eagerly(tmp_path):
    """rtp.LLM from a save_pretrained checkpoint through the real loader: greedy tokens equal
    transformers' generate. In bf16 (rtp's CPU kernels on) the CPU-graph capture refuses MLA's
    torch ops at warm-up, and every step runs eagerly."""
    from rtp import LLM, SamplingParams

    path, hf = make_deepseek("q-lora-yarn", tmp_path)
    write_word_tokenizer(path, DEEPSEEK["vocab_size"])
    prompts = prompts_of((4, 17, 31), seed=4)
    new_tokens = 12
    llm = LLM(model=str(path), dtype="float32", compile=False, max_model_len=128, enable_prefix_caching=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref
    bf16 = LLM(model=str(path), dtype="bfloat16", compile=False, max_model_len=128)
    out = bf16.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    assert bf16.engine.runner.cpu_graphs == [] and bf16.engine.runner.graph_steps == 0


def test_eplb_replicas_and_a_rebalance_mid_generation_keep_logits_bit_for_bit(tmp_path):
    """Experts replicated and moved by EPLB plans from the model's own load counters (4 ranks of
    3 slots, 4 of them replicas), applied before the run and again between decode steps: every
    logit equals the run on the identity placement, bit for bit, and both match transformers."""
    from rtp.engine.eplb import eplb_placement

    path, hf = make_deepseek("q-lora-yarn", tmp_path)
    prompts = prompts_of((5, 23, 40), seed=5)
    refs = hf_reference(hf, prompts)
    model, _ = load_model(path, torch.float32, torch.device("cpu"), redundant_experts=4)
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(layers) == 2 and all(layer.num_slots == 12 for layer in layers)
    worst, identity, _ = drive(model, prompts, refs)
    assert worst < 1e-4

    def rebalance(step=None):
        load = torch.stack([layer.expert_load for layer in layers]).numpy()
        placement = eplb_placement(load, num_ranks=4, extra_slots=4)
        for layer, slots in zip(layers, placement.slots):
            layer.place(slots.reshape(-1).tolist())
        assert max(int(layer.replica_count.max()) for layer in layers) >= 2

    rebalance()  # from the whole first run's load
    for layer in layers:
        layer.expert_load.zero_()
    worst, placed, _ = drive(model, prompts, refs, between_steps=lambda step: step in (3, 9) and rebalance())
    assert worst < 1e-4
    assert len(placed) == len(identity)
    for a, b in zip(placed, identity):
        assert torch.equal(a, b)


def test_tp2_splits_heads_and_matches_transformers(tmp_path):
    """Two gloo ranks: each holds half the heads of q_proj, kv_b_proj (so half of W_UK and W_UV
    in the absorbed decode) and o_proj, and half the vocabulary; the latent cache, the router
    and the experts are whole on each. Every rank's gathered logits stay within 1e-4."""
    from ranks import run_tensor_parallel

    path, hf = make_deepseek("no-q-lora-yarn", tmp_path / "ckpt")
    prompts = prompts_of((5, 23, 40), seed=1)
    worst = run_tensor_parallel(path, prompts, hf_reference(hf, prompts), tmp_path)
    assert max(worst) < 1e-4, worst


def test_loader_skips_the_multi_token_prediction_layer_and_refuses_fp8(tmp_path):
    """The released checkpoints carry one more layer than num_hidden_layers (the MTP head):
    rtp skips it, as transformers does, and loads the same weights. An FP8 release (weights
    with *_scale_inv) is refused by name, not loaded wrong."""
    from safetensors.torch import load_file, save_file

    from rtp.checkpoint import CheckpointError

    path, _ = make_deepseek("q-lora-yarn", tmp_path)
    plain, _ = load_model(path, torch.float32, torch.device("cpu"))
    tensors = load_file(path / "model.safetensors")
    last = DEEPSEEK["num_hidden_layers"] - 1
    mtp = {name.replace(f"layers.{last}.", f"layers.{last + 1}."): t.clone()
           for name, t in tensors.items() if f"layers.{last}." in name}
    mtp[f"model.layers.{last + 1}.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**tensors, **mtp}, path / "model.safetensors", metadata={"format": "pt"})
    with_mtp, _ = load_model(path, torch.float32, torch.device("cpu"))
    for (name, a), (_, b) in zip(plain.state_dict().items(), with_mtp.state_dict().items()):
        assert torch.equal(a, b), name
    scale = {"model.layers.0.self_attn.q_a_proj.weight_scale_inv": torch.ones(1, 1)}
    save_file({**tensors, **scale}, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="FP8"):
        load_model(path, torch.float32, torch.device("cpu"))
