"""rtp's Llama-family models against transformers, logit for logit (fp32, tiny random configs).

Each test saves a random transformers model as a real checkpoint, loads it through
rtp's loader, and drives it through the real runtime (scheduler, paged KV cache,
prefix cache, chunked prefill): prompts of different lengths batched together,
prefill and then 16 decode steps, every sampled row's logits compared with
transformers' logits at the same position. The tokens fed back are transformers'
own greedy choices, so one near-tie cannot make the two runs drift apart.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from rtp.checkpoint.loader import CheckpointError, load_model
from rtp.engine.runner import ModelRunner
from rtp.runtime import BlockAllocator, RadixCache, Scheduler

SMALL = dict(vocab_size=160, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-5)

CONFIGS = {
    "llama": (transformers.LlamaConfig, dict(tie_word_embeddings=False)),
    "llama-tied-mha": (transformers.LlamaConfig, dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "llama3-rope": (transformers.LlamaConfig, dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "mistral-sliding": (transformers.MistralConfig, dict(sliding_window=12, head_dim=16)),
    "qwen2-bias": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3-qknorm": (transformers.Qwen3Config, dict(head_dim=32)),
}

NEW_TOKENS = 16


def random_hf_model(config) -> torch.nn.Module:
    """transformers' fp32 model for config, seeded, its matrices drawn wider than the default
    init so that logits (and a MoE's routing) differ visibly between implementations."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    return model


def prompts_of(lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 160, n).tolist() for n in lengths]


def make_checkpoint(kind: str, tmp_path) -> tuple[str, torch.nn.Module]:
    cfg_cls, extra = CONFIGS[kind]
    model = random_hf_model(cfg_cls(**{**SMALL, **extra}))
    model.save_pretrained(tmp_path)
    return tmp_path, model


def write_word_tokenizer(path, vocab_size: int) -> None:
    """A tokenizer.json whose token i is the word t{i}: enough for rtp.LLM to detokenize."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


def hf_reference(model, prompts):
    """transformers' greedy continuation of each prompt and its logits at every position."""
    refs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                                 pad_token_id=0)
            logits = model(out).logits[0].float()
        refs.append((out[0].tolist(), logits))
    return refs


def run_rtp(path, prompts, refs, *, block_size=4, max_batched=64, prefix_cache=True, compile=False,
            max_num_seqs=8):
    model, config = load_model(path, torch.float32, torch.device("cpu"))
    alloc = BlockAllocator(256, block_size)
    runner = ModelRunner(model, num_blocks=256, block_size=block_size, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_batched, max_model_len=128,
                         kv_dtype=torch.float32, device=torch.device("cpu"), compile=compile)
    runner.warmup(progress=False)
    sched = Scheduler(alloc, runner.plan, cache=RadixCache(alloc) if prefix_cache else None,
                      max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched, max_model_len=128)
    for i, p in enumerate(prompts):
        sched.add_request(i, p, max_tokens=NEW_TOKENS, ignore_eos=True)
    length = {i: len(p) for i, p in enumerate(prompts)}
    worst = 0.0
    compared = 0
    while sched.has_unfinished:
        sched.schedule()
        logits = runner.forward()
        feed = np.zeros(len(logits), dtype=np.int64)
        for k, rid in enumerate(runner.sample_req_ids().tolist()):
            seq, ref = refs[rid]
            pos = length[rid] - 1
            worst = max(worst, (logits[k] - ref[pos]).abs().max().item())
            compared += 1
            feed[k] = seq[pos + 1]
            length[rid] += 1
        sched.update(feed)
        sched.check_integrity()
    assert compared == len(prompts) * NEW_TOKENS
    if compile:
        assert runner.compiled_steps >= NEW_TOKENS
    return worst, sched


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_logits_match_transformers(kind, tmp_path):
    path, hf = make_checkpoint(kind, tmp_path)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 160, n).tolist() for n in (5, 23, 40)]
    refs = hf_reference(hf, prompts)
    worst, _ = run_rtp(path, prompts, refs)
    assert worst < 1e-4, f"{kind}: max abs logit difference {worst}"


def test_chunked_prefill_and_prefix_reuse_keep_logits(tmp_path):
    path, hf = make_checkpoint("qwen2-bias", tmp_path)
    rng = np.random.default_rng(2)
    shared = rng.integers(1, 160, 30).tolist()
    prompts = [shared + rng.integers(1, 160, n).tolist() for n in (3, 11)] + [shared[:17]]
    refs = hf_reference(hf, prompts)
    worst, sched = run_rtp(path, prompts, refs, max_batched=16)  # prompts split into chunks
    assert worst < 1e-4
    worst, sched = run_rtp(path, prompts[:1], refs[:1])
    assert worst < 1e-4


def test_compiled_decode_graphs_match_transformers(tmp_path):
    """Buckets 1 and 2, padded rows, a dynamic block-table width, and steps that mix
    compiled decode rows with an eager prefill chunk."""
    import torch._dynamo

    torch._dynamo.reset()
    path, hf = make_checkpoint("llama", tmp_path)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 160, n).tolist() for n in (3, 30, 9)]  # three rows: bucket 2 + queueing
    refs = hf_reference(hf, prompts)
    from torch._dynamo.utils import counters

    counters.clear()
    worst, _ = run_rtp(path, prompts, refs, compile=True, max_num_seqs=2, max_batched=16)
    assert worst < 1e-4
    # one graph per bucket: the growing context never forced a recompile
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


def test_bad_checkpoints_get_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))
    path, _ = make_checkpoint("llama", tmp_path)
    import json
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):  # names the supported ones
        load_model(path, torch.float32, torch.device("cpu"))
    (path / "config.json").write_text(json.dumps({**cfg, "hidden_size": 32}))
    with pytest.raises(CheckpointError, match="shape"):
        load_model(path, torch.float32, torch.device("cpu"))
