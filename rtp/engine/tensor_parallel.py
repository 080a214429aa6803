"""Tensor-parallel engines: rank 0 schedules, every rank runs the step.

Rank 0 is the LLMEngine a user or the server drives. Ranks 1..N-1 are followers,
spawned on this host by rank 0 (or started by torchrun): each holds its shard of
the model and of the KV cache and runs exactly rank 0's steps. Before each
forward rank 0 broadcasts the step's plan: a header of counts and the StepPlan's
fixed-size numpy buffers, never a pickled object. Every rank then runs the model,
whose collectives keep the ranks in lockstep; the logits are all-gathered on every
rank and only rank 0 samples. A follower stops on rank 0's stop message, or with
an error when a collective times out because a rank died.
"""

from __future__ import annotations

import logging
import os
import socket

import torch

from rtp.distributed import destroy_parallel, init_parallel
from rtp.engine.component import Component
from rtp.runtime import PLAN_ARRAYS

log = logging.getLogger("rtp.tp")

_STOP, _STEP, _REBALANCE = 0, 1, 2


class PlanChannel(Component):
    """Rank 0's plan, broadcast to the other ranks through the StepPlan's own buffers; on rank 0 an
    engine component, the first: each step's plan goes out before anything runs on it."""

    def before_forward(self, step) -> None:
        self.send_step()

    def __init__(self, plan):
        self.plan = plan
        self.header = torch.zeros(5, dtype=torch.int64)
        self._header = self.header.numpy()  # written in place: nothing allocated per step
        self.arrays = [torch.from_numpy(getattr(plan, name)) for name in PLAN_ARRAYS]

    def send_step(self) -> None:
        import torch.distributed as dist

        p = self.plan
        self._header[:] = (_STEP, p.num_tokens, p.num_rows, p.num_decode_rows, p.num_samples)
        dist.broadcast(self.header, 0)
        for array in self.arrays:
            dist.broadcast(array, 0)

    def send_rebalance(self, slots, kv_limit: int) -> None:
        """EPLB's new slots [layers, num_slots] (int64), to be applied by every rank now, and
        the KV pool's limit that goes with them."""
        import torch.distributed as dist

        self._header[:4] = (_REBALANCE, *slots.shape, kv_limit)
        dist.broadcast(self.header, 0)
        dist.broadcast(torch.from_numpy(slots), 0)

    def send_stop(self) -> None:
        import torch.distributed as dist

        self._header[0] = _STOP
        dist.broadcast(self.header, 0)

    def receive(self, on_rebalance=None) -> bool:
        """Wait for rank 0's next step; True with the plan in place, False on stop. Rebalances
        sent before it are handed to on_rebalance(slots, kv_limit) in order, as they arrive."""
        import torch.distributed as dist

        dist.broadcast(self.header, 0)
        while self._header[0] == _REBALANCE:
            slots = torch.empty(int(self._header[1]), int(self._header[2]), dtype=torch.int64)
            dist.broadcast(slots, 0)
            if on_rebalance is None:
                raise RuntimeError("rank 0 rebalanced experts, but this rank runs no EPLB")
            on_rebalance(slots.numpy(), int(self._header[3]))
            dist.broadcast(self.header, 0)
        if self._header[0] == _STOP:
            return False
        for array in self.arrays:
            dist.broadcast(array, 0)
        self.plan.follow(*self._header[1:].tolist())
        return True


def threads_per_rank(size: int) -> int:
    """The cores of this host shared out between its ranks (`size` of them, or torchrun's
    LOCAL_WORLD_SIZE when a multi-node run puts fewer on each host), unless RTP_NUM_THREADS
    says how many each rank gets: several servers sharing one host would otherwise each take
    every core, and OpenMP teams that outnumber the cores spin against each other.
    (OMP_NUM_THREADS is not read: torchrun sets it to 1 whatever the host.)"""
    told = os.environ.get("RTP_NUM_THREADS", "").strip()
    if told:
        if not told.isdigit() or int(told) < 1:
            raise ValueError(f"RTP_NUM_THREADS must be a whole number of threads (1 or more), not {told!r}")
        return int(told)
    return max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", size)))


def start_ranks(config, checkpoint_config, device: torch.device, follower) -> tuple[list, torch.device]:
    """Rank 0 of a tensor- or expert-parallel engine: check that the model splits (before any
    rank starts, so only one process reports it), share the cores out, start ranks 1..N-1 on
    this host (under torchrun they exist already) and join their group. `follower(config)` is
    what each started rank runs once in the group (a module-level function: spawn pickles it
    by name). Returns the follower processes and this rank's device. A single-rank engine
    only gets its threads set."""
    from rtp.distributed import ep_size, local_rank, tp_size, world_size

    tp, ep = config.parallel.tensor_parallel_size, config.parallel.expert_parallel_size
    ranks = max(tp, ep)  # ParallelConfig.validate() checked each is 1 or this
    followers: list = []
    if ranks > 1 and world_size() == 1:
        if ep > 1 and not checkpoint_config.num_experts:  # each rank would only repeat the same dense model
            raise ValueError(f"expert_parallel_size {ep}: {checkpoint_config.architecture} has no experts to split")
        if tp > 1:
            checkpoint_config.check_tensor_parallel(tp)
    threads = threads_per_rank(ranks)  # a bad RTP_NUM_THREADS fails before any rank starts
    if ranks > 1 and world_size() == 1:
        init, followers = _spawn_followers(follower, config, ranks)
        init_parallel(tp, ep, 0, init_method=init)
    if ranks > 1 or os.environ.get("RTP_NUM_THREADS"):  # one rank keeps torch's default unless told
        torch.set_num_threads(threads)
    if ranks > 1 and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank())  # each rank of a host its own GPU
    if (tp_size(), ep_size()) != (tp, ep):
        raise ValueError(f"tensor_parallel_size {tp} and expert_parallel_size {ep}, but the process group "
                         f"has tp {tp_size()} and ep {ep_size()}")
    return followers, device


# How long a normal stop waits for every rank to leave the group together.
_MEET_TIMEOUT_S = 30.0


def follow(channel: PlanChannel, forward, on_rebalance=None) -> None:
    """A rank other than 0: run rank 0's steps (forward() once each) until it stops."""
    stopped = False
    try:
        while channel.receive(on_rebalance):
            forward()
        stopped = True
    finally:
        destroy_parallel(_MEET_TIMEOUT_S if stopped else None)  # rank 0 meets us on a stop


def stop_followers(channel: PlanChannel, followers: list) -> None:
    """Rank 0: tell the other ranks to stop, leave the group with them, and wait for the
    ones it started to exit."""
    sent = False
    try:
        channel.send_stop()
        sent = all(proc.is_alive() for proc in followers)  # a dead follower will not meet us
    finally:
        destroy_parallel(_MEET_TIMEOUT_S if sent else None)
        for proc in followers:
            proc.join(timeout=30)


def _spawn_followers(follower, config, size: int) -> tuple[str, list]:
    """Start ranks 1..size-1 of `config` on this host; returns the rendezvous address rank 0
    joins with init_parallel(tp, ep, 0, init_method=...), and the processes."""
    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port on loopback for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init = f"tcp://127.0.0.1:{port}"
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, size):
        proc = ctx.Process(target=_follower_main, args=(follower, config, rank, size, init), name=f"rtp-tp{rank}",
                           daemon=True)
        proc.start()
        procs.append(proc)
    log.info("started %d tensor-parallel followers (%s)", size - 1, init)
    return init, procs


def _follower_main(follower, config, rank: int, size: int, init: str) -> None:
    try:
        torch.set_num_threads(threads_per_rank(size))
        init_parallel(config.parallel.tensor_parallel_size, config.parallel.expert_parallel_size, rank,
                      init_method=init)
        follower(config)
    except Exception as e:
        # rank 0 meets the same error (the same load, or the collective this rank left) and
        # reports it; a second traceback from here would only bury that one line
        log.error("tensor-parallel rank %d stopped: %s", rank, e)
        log.debug("rank %d", rank, exc_info=e)
        raise SystemExit(1) from None
