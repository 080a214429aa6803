"""rtp's tier-2 runtime: the parts that run every engine step, compiled to C.

Three structures, all state in C arrays, nothing allocated per step, one module each:

    block_allocator  BlockAllocator: paged KV blocks with reference counts and one intrusive free list
    radix_cache      RadixCache: block-granular radix tree over token ids (prefix reuse)
    scheduler        Scheduler: continuous batching under a token budget, writing each step's
                     plan into the numpy buffers of a StepPlan
    step_plan        StepPlan and PLAN_ARRAYS, the one declaration of a step's buffers

Each module's .pxd declares its class's C attributes and methods, so the radix cache and
the scheduler reach the allocator (and the scheduler the cache and the plan) through cdef
calls, not Python attributes; common.pxd holds the helpers they share.

No torch here: the runtime speaks numpy, so the model runner aliases the plan's
arrays as tensors and the FlexLB master can reuse RadixCache without a model.
"""

from rtp.runtime.block_allocator import BlockAllocator
from rtp.runtime.radix_cache import RadixCache
from rtp.runtime.scheduler import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_NONE,
    FINISH_REASONS,
    FINISH_REMOTE,
    FINISH_STOP,
    POLICY_FCFS,
    POLICY_LPM,
    STATE_NAMES,
    Scheduler,
)
from rtp.runtime.step_plan import PLAN_ARRAYS, StepPlan, plan_array_shapes

__all__ = [
    "BlockAllocator", "RadixCache", "Scheduler", "StepPlan", "PLAN_ARRAYS", "plan_array_shapes",
    "FINISH_NONE", "FINISH_STOP", "FINISH_LENGTH", "FINISH_ABORT", "FINISH_REMOTE", "FINISH_REASONS",
    "STATE_NAMES", "POLICY_FCFS", "POLICY_LPM",
]
