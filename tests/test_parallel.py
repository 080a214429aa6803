"""Tensor parallelism on torch.distributed (gloo, 2 processes on this CPU).

Each rank loads its shard of a real checkpoint through the real loader and runs the
whole runtime on the same requests (the scheduler is deterministic, so both ranks
plan the same steps); the logits every rank sees after the vocabulary all-gather
must equal transformers' logits as closely as the single-process model's do.
"""

from __future__ import annotations

import traceback

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from test_models import hf_reference, make_checkpoint, run_rtp

import rtp.distributed as dist
from rtp.engine.loader import load_model


def _rank(rank: int, size: int, init: str, path, prompts, refs, results) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    try:
        dist.init_tensor_parallel(size, rank, backend="gloo", init_method=init, timeout_s=60)
        worst, _ = run_rtp(path, prompts, refs)
        model, _ = load_model(path, torch.float32, torch.device("cpu"))
        shard = (model.model.embed_tokens.weight.shape[0], model.model.layers[0].self_attn.num_heads)
        results.put((rank, worst, shard, None))
    except Exception:
        results.put((rank, None, None, traceback.format_exc()))
    finally:
        dist.destroy_tensor_parallel()


def run_tensor_parallel(path, prompts, refs, tmp_path, size=2) -> list[float]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = f"file://{tmp_path}/rendezvous"
    procs = [ctx.Process(target=_rank, args=(r, size, init, path, prompts, refs, results)) for r in range(size)]
    for p in procs:
        p.start()
    out = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    errors = [err for *_, err in out if err]
    assert not errors, errors[0]
    assert all(shard == (160 // size, 4 // size) for _, _, shard, _ in out)  # vocabulary and heads split
    return [worst for _, worst, _, _ in sorted(out)]


@pytest.mark.parametrize("kind", ["llama", "qwen2-bias", "qwen3-qknorm"])
def test_tp2_logits_match_transformers(kind, tmp_path):
    """tp=2 shards q/kv heads, the MLP and the vocabulary (Qwen2: qkv bias and tied
    embeddings; Qwen3: q/k norm); every rank's gathered logits stay within 1e-4."""
    path, hf = make_checkpoint(kind, tmp_path / "ckpt")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 160, n).tolist() for n in (5, 23, 40)]
    refs = hf_reference(hf, prompts)
    single, _ = run_rtp(path, prompts, refs)
    worst = run_tensor_parallel(path, prompts, refs, tmp_path)
    assert single < 1e-4 and max(worst) < 1e-4, (single, worst)


def test_vocabulary_must_split_evenly(monkeypatch):
    from rtp.models.layers import VocabParallelEmbedding

    monkeypatch.setattr(dist, "_TP_SIZE", 2)
    with pytest.raises(ValueError, match="does not split"):
        VocabParallelEmbedding(161, 8)


def test_heads_must_split_evenly(monkeypatch):
    """SmolLM2-135M (9 heads, 3 kv heads) cannot run at tp=2: a clear error, not a wrong model."""
    from rtp.models.layers import QKVParallelLinear

    monkeypatch.setattr(dist, "_TP_SIZE", 2)
    with pytest.raises(ValueError, match="9 attention heads and 3 kv heads do not split over 2"):
        QKVParallelLinear(576, 64, 9, 3, bias=False)
    QKVParallelLinear(64, 16, 4, 1, bias=False)  # one kv head: replicated on both ranks


def test_bad_rank_is_refused():
    with pytest.raises(ValueError, match="not a rank"):
        dist.init_tensor_parallel(2, 2)
    assert dist.tp_size() == 1
