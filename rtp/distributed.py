"""Process groups for tensor and expert parallelism, below models and engine.

One process per rank, joined by torch.distributed: NCCL on GPUs, gloo on CPUs,
never a home-made transport. `init_parallel` joins the group (from torchrun's
environment or explicit arguments). There is one group, the world, shared by
both kinds of parallelism the way vLLM's `enable_expert_parallel` shares its TP
ranks with EP: with W = max(tp, ep) processes, tp and ep are each 1 or W.

  tp = W, ep = 1   attention, dense MLPs and vocabulary sharded; every rank holds
                   every expert (computed replicated)
  tp = 1, ep = W   attention and dense layers replicated (every rank runs the same
                   tokens), the expert slots split between the ranks
  tp = W, ep = W   both: attention sharded, experts split

The parallel layers in rtp/models/layers.py shard their weights by `tp_rank()` /
`tp_size()` and call the collectives here, torch's functional collective ops, which a
compiled graph traces. The expert exchange
(rtp/models/expert_parallel.py) uses `all_to_all` and `ep_all_gather`. With one rank
(the default) every collective is the identity and nothing here touches
torch.distributed.

A rank runs the whole engine on its shard: the scheduler is deterministic, so
ranks given the same requests plan the same steps (how the tests drive tp=2).
"""

from __future__ import annotations

import datetime
import os

import torch

_WORLD_RANK = 0
_WORLD_SIZE = 1
_TP_RANK = 0
_TP_SIZE = 1
_TP_GROUP = None
_EP_RANK = 0
_EP_SIZE = 1
_EP_GROUP = None

# A rank that dies leaves the others in a collective: they give up after this long.
DEFAULT_TIMEOUT_S = 120.0


def tp_rank() -> int:
    return _TP_RANK


def tp_size() -> int:
    return _TP_SIZE


def ep_rank() -> int:
    return _EP_RANK


def ep_size() -> int:
    return _EP_SIZE


def world_rank() -> int:
    """This process's rank among all of rtp's ranks (0: the one that schedules)."""
    return _WORLD_RANK


def world_size() -> int:
    """rtp's processes: max(tp_size(), ep_size())."""
    return _WORLD_SIZE


def local_rank() -> int:
    """This rank's index among the ranks on its host, which picks its GPU: torchrun's
    LOCAL_RANK (across nodes, RANK keeps counting but each host starts again at 0), else
    the world rank (rtp's own launcher starts every rank on one host)."""
    return int(os.environ.get("LOCAL_RANK", _WORLD_RANK))


def check_sizes(tp: int, ep: int) -> int:
    """The world size of tp x ep (max of the two); raises unless each is 1 or that size."""
    world = max(tp, ep)
    if tp < 1 or ep < 1 or tp not in (1, world) or ep not in (1, world):
        raise ValueError(f"tensor parallel size {tp} and expert parallel size {ep}: each must be 1 or "
                         f"the number of ranks ({world}); rtp runs both over the same ranks")
    return world


def init_parallel(tp: int = 1, ep: int = 1, rank: int | None = None, *, backend: str | None = None,
                  init_method: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the group of max(tp, ep) ranks as `rank` (default: torchrun's RANK); one rank leaves
    rtp single-process. backend: nccl with CUDA, else gloo."""
    global _WORLD_RANK, _WORLD_SIZE, _TP_RANK, _TP_SIZE, _TP_GROUP, _EP_RANK, _EP_SIZE, _EP_GROUP
    size = check_sizes(tp, ep)
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} of {size} is not a rank of the group")
    if size == 1:
        _reset()
        return
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":  # one GPU per rank of this host, before NCCL binds one
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group(backend, init_method=init_method or "env://", world_size=size, rank=rank,
                                timeout=datetime.timedelta(seconds=timeout_s))
    if dist.get_world_size() != size:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks; tp {tp} and ep {ep} ask {size}")
    rank = dist.get_rank()
    _WORLD_RANK, _WORLD_SIZE = rank, size
    _TP_RANK, _TP_SIZE, _TP_GROUP = (rank, size, dist.group.WORLD) if tp > 1 else (0, 1, None)
    _EP_RANK, _EP_SIZE, _EP_GROUP = (rank, size, dist.group.WORLD) if ep > 1 else (0, 1, None)


def init_tensor_parallel(size: int | None = None, rank: int | None = None, *, backend: str | None = None,
                         init_method: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join a tensor-parallel group of `size` ranks (default: torchrun's WORLD_SIZE), no expert parallelism."""
    size = int(os.environ.get("WORLD_SIZE", "1")) if size is None else size
    if size < 1:
        raise ValueError(f"tensor parallel rank {rank} of {size} is not a rank of the group")
    init_parallel(size, 1, rank, backend=backend, init_method=init_method, timeout_s=timeout_s)


def destroy_parallel(meet_timeout_s: float | None = None) -> None:
    """Leave the group. With meet_timeout_s every rank calls this together (a normal stop):
    each first waits, that long at most, until all have arrived, so no rank tears down its
    end while another still has a collective in flight, and the wait (GIL released) lets
    gloo's workers drop their last tensors before the group's destructor joins them (a
    worker that still needs the GIL then would deadlock it, or abort the interpreter's exit)."""
    if _WORLD_SIZE > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            if meet_timeout_s is not None:
                try:
                    dist.barrier(async_op=True).wait(datetime.timedelta(seconds=meet_timeout_s))
                except RuntimeError:  # a rank is gone: leave without it
                    pass
            dist.destroy_process_group()
    _reset()


destroy_tensor_parallel = destroy_parallel


def _reset() -> None:
    global _WORLD_RANK, _WORLD_SIZE, _TP_RANK, _TP_SIZE, _TP_GROUP, _EP_RANK, _EP_SIZE, _EP_GROUP
    _WORLD_RANK, _WORLD_SIZE = 0, 1
    _TP_RANK, _TP_SIZE, _TP_GROUP = 0, 1, None
    _EP_RANK, _EP_SIZE, _EP_GROUP = 0, 1, None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the tensor-parallel ranks (x itself with one rank)."""
    if _TP_SIZE == 1:
        return x
    # The functional collectives' own ops, named by the group, not funcol's Python wrappers:
    # in torch 2.13 an eager funcol call keeps the process group alive past
    # destroy_process_group, so gloo's worker threads outlive it and can abort the
    # interpreter's exit (a worker dropping its last tensor needs the GIL finalization holds).
    # These ops trace under torch.compile just as funcol's do.
    ops = torch.ops._c10d_functional
    return ops.wait_tensor(ops.all_reduce(x, "sum", _TP_GROUP.group_name))


def all_gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The ranks' x concatenated along dim, in rank order (x itself with one rank)."""
    if _TP_SIZE == 1:
        return x
    ops = torch.ops._c10d_functional
    dim %= x.dim()
    if dim != 0:  # the collective stacks along dim 0: gather dim-0-major, then put the ranks' parts side by side
        x = x.movedim(dim, 0)
    out = ops.wait_tensor(ops.all_gather_into_tensor(x.contiguous(), _TP_SIZE, _TP_GROUP.group_name))
    return out.movedim(0, dim).contiguous() if dim != 0 else out


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_splits: list[int] | None = None,
               input_splits: list[int] | None = None, *, async_op: bool = False):
    """torch.distributed.all_to_all_single over the expert-parallel ranks: rows
    [sum(input_splits[:r]), +input_splits[r]) of `input` go to rank r, rank r's rows for
    this rank land in `output` in rank order. With async_op the exchange runs on the
    backend's own threads (gloo) or stream (NCCL) and the returned work is waited on later."""
    import torch.distributed as dist

    return dist.all_to_all_single(output, input, output_splits, input_splits, group=_EP_GROUP,
                                  async_op=async_op)


def ep_all_gather(x: torch.Tensor) -> torch.Tensor:
    """The expert-parallel ranks' x (equal shapes) concatenated along dim 0, in rank order."""
    if _EP_SIZE == 1:
        return x
    import torch.distributed as dist

    out = x.new_empty(_EP_SIZE * x.shape[0], *x.shape[1:])
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name first
    gather(out, x.contiguous(), group=_EP_GROUP)
    return out
