"""Type stub for rtp.runtime.scheduler (see scheduler.pyx)."""

from typing import Iterable

import numpy as np
import numpy.typing as npt

from rtp.runtime.block_allocator import BlockAllocator
from rtp.runtime.radix_cache import RadixCache
from rtp.runtime.step_plan import StepPlan

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


class Scheduler:
    """Continuous batching under one token budget per step."""
    allocator: BlockAllocator
    cache: RadixCache | None
    plan: StepPlan
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_prefill_tokens_with_decodes: int   # writable: the engine's PrefillBudget sets it each step
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
    num_deferred: int   # out of the queue until undefer() (their KV read from a cache tier)
    in_flight: bool
    step_count: int
    num_preemptions: int
    oldest_waiting_step: int   # arrival step of the longest-waiting request, -1 when none waits
    queued_prompt_tokens: int
    event_req_ids: npt.NDArray[np.int64]
    event_tokens: IntArray
    event_finish: npt.NDArray[np.int8]
    event_rows: IntArray          # the sampling row each event's token came from
    num_speculative_tokens: int   # most drafted tokens a request verifies a step (0: off)
    spec_ngram_min: int
    spec_ngram_max: int
    spec_max_running: int
    external_drafts: bool         # drafts written by set_drafts() (a draft model's), not by prompt lookup
    spec_verifications: int       # requests' steps that verified drafts
    spec_draft_tokens: int        # tokens drafted, and of them accepted
    spec_accepted_tokens: int
    spec_emitted_tokens: int      # by verifying steps: the kept drafts and the model's own token after
    def __init__(self, allocator: BlockAllocator, plan: StepPlan, *, cache: RadixCache | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 max_model_len: int = 4096, eos_token_ids: Iterable[int] = (),
                 max_requests: int = 16384, vocab_size: int = 0, policy: str = "fcfs",
                 chunked_prefill: bool = True, lpm_aging: float = 8.0, lpm_window: int = 64,
                 max_prefill_tokens_with_decodes: int = 0, num_speculative_tokens: int = 0,
                 spec_ngram_min: int = 1, spec_ngram_max: int = 4, spec_max_running: int = 16,
                 external_drafts: bool = False) -> None: ...
    def add_request(self, req_id: int, prompt_token_ids: Tokens, *, max_tokens: int = 16,
                    min_tokens: int = 0, stop_token_ids: Iterable[int] = (),
                    ignore_eos: bool = False, prefill_only: bool = False, speculate: bool = False) -> int: ...
    def abort(self, req_id: int) -> bool: ...
    def reserve(self, req_id: int, prompt_token_ids: Tokens, *, max_tokens: int = 16,
                min_tokens: int = 0, stop_token_ids: Iterable[int] = (),
                ignore_eos: bool = False, speculate: bool = False) -> IntArray: ...   # MemoryError: pool short
    def resume(self, req_id: int, first_token: int) -> None: ...
    def defer(self, req_id: int) -> None: ...     # waiting -> deferred (KeyError otherwise)
    def undefer(self, req_id: int) -> None: ...   # deferred -> first in the queue
    def extend(self, req_id: int, upto_blocks: int) -> IntArray: ...   # a running request's KV from a tier
    def release(self, req_id: int) -> None: ...
    def schedule(self) -> int: ...
    def set_drafts(self, draft_token_ids: npt.ArrayLike) -> None: ...   # per sampling row; between schedule and forward
    def update(self, sampled_token_ids: npt.ArrayLike) -> int: ...
    def slot_of_request(self, req_id: int) -> int: ...
    def has_request(self, req_id: int) -> bool: ...
    def request_state(self, req_id: int) -> dict: ...
    def cached_prompt_tokens(self, req_id: int) -> int: ...
    def is_first_token(self, req_id: int) -> bool: ...
    def stop_settings(self) -> tuple[np.ndarray, np.ndarray]: ...   # (min_tokens int32, ignore_eos uint8) by slot: views
    def stop_ids(self, slot: int) -> tuple[int, ...]: ...
    def output_lengths(self, slots: np.ndarray) -> np.ndarray: ...
    def slot_tokens(self, slot: int) -> tuple[np.ndarray, np.ndarray]: ...
    def prompt_length(self, slot: int) -> int: ...
    def copy_tokens(self, slot: int, start: int, out: np.ndarray) -> None: ...
    def waiting_request_ids(self) -> list[int]: ...
    def running_request_ids(self) -> list[int]: ...
    def stats(self) -> dict[str, int | float]: ...
    @property
    def has_unfinished(self) -> bool: ...
    def check_integrity(self) -> None: ...
