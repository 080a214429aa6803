"""Type stub for rtp._runtime, the compiled tier-2 runtime (see _runtime.pyx)."""

from typing import Iterable

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int32]
Tokens = Iterable[int] | npt.NDArray[np.integer]

FINISH_NONE: int    # 0: still running
FINISH_STOP: int    # 1: eos or a stop token id
FINISH_LENGTH: int  # 2: max_tokens or max_model_len
FINISH_ABORT: int   # 3
FINISH_REMOTE: int  # 4: prefill-only request done; blocks held until Scheduler.release()
FINISH_REASONS: dict[int, str | None]
STATE_NAMES: dict[int, str]
POLICY_FCFS: int   # Scheduler.policy values
POLICY_LPM: int

class BlockAllocator:
    """Paged KV blocks with refcounts; block 0 is the reserved null block."""
    num_blocks: int     # the limit: ids below it make up the pool now
    capacity: int       # what grow() may raise the limit to
    base: int           # the limit as built
    block_size: int
    num_evictions: int
    def __init__(self, num_blocks: int, block_size: int, capacity: int = 0) -> None: ...
    @property
    def num_free(self) -> int: ...          # truly free + evictable
    @property
    def num_truly_free(self) -> int: ...
    @property
    def num_evictable(self) -> int: ...
    @property
    def num_cached(self) -> int: ...
    @property
    def num_protected(self) -> int: ...
    @property
    def num_used(self) -> int: ...
    @property
    def usage(self) -> float: ...
    def can_allocate(self, n: int) -> bool: ...
    def allocate(self, n: int) -> IntArray: ...      # MemoryError when fewer than n remain
    def acquire(self, blocks: Tokens) -> None: ...   # +1 ref each, root first
    def free(self, blocks: Tokens) -> None: ...      # -1 ref each, last block first
    def ref_count(self, block: int) -> int: ...
    def evict(self, n: int) -> int: ...
    def grow(self, new_limit: int) -> None: ...
    def can_shrink(self, new_limit: int) -> bool: ...
    def shrink(self, new_limit: int) -> bool: ...   # False (nothing changed) if a block >= new_limit is in use
    def check_integrity(self) -> None: ...

class RadixCache:
    """Block-granular radix tree: token prefixes -> KV block ids."""
    allocator: BlockAllocator
    block_size: int
    num_nodes: int
    num_queries: int
    query_tokens: int
    hit_tokens: int
    num_splits: int
    def __init__(self, allocator: BlockAllocator) -> None: ...
    def match_prefix(self, tokens: Tokens, leave_last: bool = True) -> tuple[IntArray, int]: ...
    def insert(self, tokens: Tokens, blocks: Tokens) -> tuple[IntArray, int]: ...
    def lock(self, blocks: Tokens) -> None: ...
    def unlock(self, blocks: Tokens) -> None: ...
    def evict(self, num_blocks: int) -> int: ...
    def record(self, tokens: Tokens) -> int: ...     # standalone: returns tokens already cached
    @property
    def num_cached_blocks(self) -> int: ...
    @property
    def num_evictable_blocks(self) -> int: ...
    @property
    def num_protected_blocks(self) -> int: ...
    @property
    def num_cached_tokens(self) -> int: ...
    def reset_stats(self) -> None: ...
    def check_integrity(self) -> None: ...

class StepPlan:
    """Preallocated per-step buffers; see the table in _runtime.pyx."""
    max_num_tokens: int
    max_num_seqs: int
    width: int
    num_tokens: int
    num_rows: int
    num_decode_rows: int
    num_samples: int
    input_ids: IntArray
    positions: IntArray
    slot_mapping: npt.NDArray[np.int64]
    block_tables: IntArray
    seq_lens: IntArray
    query_start_loc: IntArray
    logits_indices: IntArray
    sample_slots: IntArray
    sample_req_ids: npt.NDArray[np.int64]
    def __init__(self, max_num_tokens: int, max_num_seqs: int, width: int,
                 **arrays: np.ndarray) -> None: ...
    @property
    def query_lens(self) -> IntArray: ...
    def follow(self, num_tokens: int, num_rows: int, num_decode_rows: int, num_samples: int) -> None: ...

class Scheduler:
    """Continuous batching under one token budget per step."""
    allocator: BlockAllocator
    cache: RadixCache | None
    plan: StepPlan
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_prefill_tokens_with_decodes: int
    max_model_len: int
    max_requests: int
    vocab_size: int
    policy: int
    chunked_prefill: bool
    lpm_aging: float
    lpm_window: int
    num_running: int
    num_waiting: int
    num_held: int
    num_reserved: int   # decode side: blocks reserved, KV not yet arrived
    num_ready: int      # decode side: resumed, joining the batch at the next schedule()
    in_flight: bool
    step_count: int
    num_preemptions: int
    queued_prompt_tokens: int
    event_req_ids: npt.NDArray[np.int64]
    event_tokens: IntArray
    event_finish: npt.NDArray[np.int8]
    def __init__(self, allocator: BlockAllocator, plan: StepPlan, *, cache: RadixCache | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 max_model_len: int = 4096, eos_token_ids: Iterable[int] = (),
                 max_requests: int = 16384, vocab_size: int = 0, policy: str = "fcfs",
                 chunked_prefill: bool = True, lpm_aging: float = 8.0, lpm_window: int = 64,
                 max_prefill_tokens_with_decodes: int = 0) -> None: ...
    def add_request(self, req_id: int, prompt_token_ids: Tokens, *, max_tokens: int = 16,
                    min_tokens: int = 0, stop_token_ids: Iterable[int] = (),
                    ignore_eos: bool = False, prefill_only: bool = False) -> int: ...
    def abort(self, req_id: int) -> bool: ...
    def reserve(self, req_id: int, prompt_token_ids: Tokens, *, max_tokens: int = 16,
                min_tokens: int = 0, stop_token_ids: Iterable[int] = (),
                ignore_eos: bool = False) -> IntArray: ...   # MemoryError when the pool is short
    def resume(self, req_id: int, first_token: int) -> None: ...
    def release(self, req_id: int) -> None: ...
    def schedule(self) -> int: ...
    def update(self, sampled_token_ids: npt.ArrayLike) -> int: ...
    def slot_of_request(self, req_id: int) -> int: ...
    def has_request(self, req_id: int) -> bool: ...
    def request_state(self, req_id: int) -> dict: ...
    def cached_prompt_tokens(self, req_id: int) -> int: ...
    def waiting_request_ids(self) -> list[int]: ...
    def running_request_ids(self) -> list[int]: ...
    def stats(self) -> dict[str, int | float]: ...
    @property
    def has_unfinished(self) -> bool: ...
    def check_integrity(self) -> None: ...
