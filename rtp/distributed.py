"""Process groups for tensor (and later expert) parallelism, below models and engine.

One process per rank, joined by torch.distributed: NCCL on GPUs, gloo on CPUs,
never a home-made transport. `init_tensor_parallel` joins the group (from
torchrun's environment or explicit arguments); the parallel layers in
rtp/models/layers.py shard their weights by `tp_rank()` / `tp_size()` and call
the collectives here, which go through torch's functional collectives so a
compiled graph traces them. With one rank (the default) every collective is
the identity and nothing here touches torch.distributed.

A rank runs the whole engine on its shard: the scheduler is deterministic, so
ranks given the same requests plan the same steps (how the tests drive tp=2).
"""

from __future__ import annotations

import datetime
import os

import torch

_TP_RANK = 0
_TP_SIZE = 1
_TP_GROUP = None

# A rank that dies leaves the others in a collective: they give up after this long.
DEFAULT_TIMEOUT_S = 120.0


def tp_rank() -> int:
    return _TP_RANK


def tp_size() -> int:
    return _TP_SIZE


def init_tensor_parallel(size: int | None = None, rank: int | None = None, *, backend: str | None = None,
                         init_method: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join a tensor-parallel group of `size` ranks as `rank` (defaults: torchrun's WORLD_SIZE
    and RANK). size 1 leaves rtp single-process. backend: nccl with CUDA, else gloo."""
    global _TP_RANK, _TP_SIZE, _TP_GROUP
    size = int(os.environ.get("WORLD_SIZE", 1)) if size is None else size
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"tensor parallel rank {rank} of {size} is not a rank of the group")
    if size == 1:
        _TP_RANK, _TP_SIZE, _TP_GROUP = 0, 1, None
        return
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, init_method=init_method or "env://", world_size=size, rank=rank,
                                timeout=datetime.timedelta(seconds=timeout_s))
    if dist.get_world_size() != size:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks, tensor parallelism asks {size}")
    _TP_RANK, _TP_SIZE, _TP_GROUP = dist.get_rank(), size, dist.group.WORLD


def destroy_tensor_parallel() -> None:
    global _TP_RANK, _TP_SIZE, _TP_GROUP
    if _TP_SIZE > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    _TP_RANK, _TP_SIZE, _TP_GROUP = 0, 1, None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the tensor-parallel ranks (x itself with one rank)."""
    if _TP_SIZE == 1:
        return x
    from torch.distributed import _functional_collectives as funcol

    return _waited(funcol.all_reduce(x, "sum", _TP_GROUP))


def all_gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The ranks' x concatenated along dim, in rank order (x itself with one rank)."""
    if _TP_SIZE == 1:
        return x
    from torch.distributed import _functional_collectives as funcol

    return _waited(funcol.all_gather_single(x.contiguous(), dim % x.dim(), _TP_GROUP))


def _waited(t: torch.Tensor) -> torch.Tensor:
    # eager calls return an AsyncCollectiveTensor: wait here, so no caller sees a pending one
    wait = getattr(t, "wait", None)
    return wait() if wait is not None else t
