"""rtp's Llama-family models against transformers, logit for logit (fp32, tiny random configs).

Each test saves a random transformers model as a real checkpoint, loads it through
rtp's loader, and drives it through the real runtime (scheduler, paged KV cache,
prefix cache, chunked prefill): prompts of different lengths batched together,
prefill and then 16 decode steps, every sampled row's logits compared with
transformers' logits at the same position. The tokens fed back are transformers'
own greedy choices, so one near-tie cannot make the two runs drift apart. The checkpoints
and the runner are tests/tiny_models.py's, shared with the MoE, DeepSeek and parallel tests.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import DENSE_CONFIGS, hf_reference, make_dense, run_rtp

from rtp.checkpoint.loader import CheckpointError, load_model


@pytest.mark.parametrize("kind", list(DENSE_CONFIGS))
def test_logits_match_transformers(kind, tmp_path):
    path, hf = make_dense(kind, tmp_path)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 160, n).tolist() for n in (5, 23, 40)]
    refs = hf_reference(hf, prompts)
    worst, _ = run_rtp(path, prompts, refs)
    assert worst < 1e-4, f"{kind}: max abs logit difference {worst}"


def test_chunked_prefill_and_prefix_reuse_keep_logits(tmp_path):
    path, hf = make_dense("qwen2-bias", tmp_path)
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
    path, hf = make_dense("llama", tmp_path)
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
    path, _ = make_dense("llama", tmp_path)
    import json
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):  # names the supported ones
        load_model(path, torch.float32, torch.device("cpu"))
    (path / "config.json").write_text(json.dumps({**cfg, "hidden_size": 32}))
    with pytest.raises(CheckpointError, match="shape"):
        load_model(path, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("key, value, message", [
    ("num_attention_heads", "four", r"config\.json num_attention_heads = 'four' is not a positive integer"),
    ("num_attention_heads", 0, r"config\.json num_attention_heads = 0 is not a positive integer"),
    ("num_hidden_layers", 1.5, r"config\.json num_hidden_layers = 1\.5 is not a positive integer"),
    ("hidden_size", 60, r"hidden_size 60 is not a multiple of num_attention_heads 8"),
    ("num_key_value_heads", 3, r"num_attention_heads 8 is not a multiple of num_key_value_heads 3"),
    ("rms_norm_eps", "tiny", r"config\.json rms_norm_eps = 'tiny' is not a positive number"),
    ("vocab_size", None, r"config\.json lacks 'vocab_size'"),
])
def test_nonsense_in_config_json_is_an_error_naming_its_key(tmp_path, key, value, message):
    """A config.json that parses but holds nonsense fails naming the key, not with a TypeError or a
    ZeroDivisionError from the config's arithmetic."""
    import json
    path, _ = make_dense("llama", tmp_path)
    cfg = {**json.loads((path / "config.json").read_text()), "num_attention_heads": 8, "head_dim": None}
    cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        load_model(path, torch.float32, torch.device("cpu"))
