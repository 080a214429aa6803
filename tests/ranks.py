"""Functions run as gloo ranks in spawned processes on this CPU, for the tensor- and
expert-parallel tests (tests/engine/) and DeepSeek-V3's tensor-parallel test (tests/models/).

The spawned children import the rank function by module name: sys.path travels with the spawn,
so a function in any test module (or here) will do.
"""

from __future__ import annotations

import traceback

import torch
import torch.multiprocessing as mp
from tiny_models import run_rtp

import rtp.distributed as dist
from rtp.checkpoint.loader import load_model


def _run_rank(rank: int, init: str, fn, args, results) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    try:
        results.put((rank, fn(rank, init, *args), None))
    except Exception:  # noqa: BLE001 - any failure goes back to the test, with its traceback
        results.put((rank, None, traceback.format_exc()))
    finally:
        dist.destroy_parallel()


def run_ranks(fn, *args, tmp_path, size=2) -> list:
    """fn(rank, init, *args) in `size` spawned processes; their results in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = f"file://{tmp_path}/rendezvous"
    procs = [ctx.Process(target=_run_rank, args=(r, init, fn, args, results)) for r in range(size)]
    for p in procs:
        p.start()
    out = sorted(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    errors = [err for *_, err in out if err]
    assert not errors, errors[0]
    return [value for _, value, _ in out]


def _tp_rank(rank: int, init: str, size: int, path, prompts, refs):
    dist.init_tensor_parallel(size, rank, backend="gloo", init_method=init, timeout_s=60)
    worst, _ = run_rtp(path, prompts, refs)
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    return worst, (model.model.embed_tokens.weight.shape[0], model.model.layers[0].self_attn.num_heads)


def run_tensor_parallel(path, prompts, refs, tmp_path, size=2) -> list[float]:
    """run_rtp on `size` tensor-parallel ranks: each rank's worst logit difference from refs."""
    out = run_ranks(_tp_rank, size, path, prompts, refs, tmp_path=tmp_path, size=size)
    assert all(shard == (160 // size, 4 // size) for _, shard in out)  # vocabulary and heads split
    return [worst for worst, _ in out]
