# cython: language_level=3
"""The Scheduler's C surface and the codes it writes: finish reasons, request states,
waiting-queue policies."""

from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t

from .block_allocator cimport BlockAllocator
from .radix_cache cimport RadixCache
from .step_plan cimport StepPlan

# Finish reasons written into update()'s events (FINISH_* and FINISH_REASONS in scheduler.pyx).
cdef enum:
    _FINISH_NONE = 0
    _FINISH_STOP = 1      # an eos id or one of the request's stop token ids
    _FINISH_LENGTH = 2    # max_tokens or max_model_len reached
    _FINISH_ABORT = 3
    _FINISH_REMOTE = 4    # prefill-only request: decoding continues elsewhere, blocks held

# Request states (STATE_NAMES in scheduler.pyx).
cdef enum:
    _FREE = 0        # slot unused
    _WAITING = 1     # queued; holds no blocks
    _RUNNING = 2     # admitted; holds blocks for its computed tokens
    _HELD = 3        # prefill-only and done: holds its blocks until release()
    _RESERVED = 4    # decode side: blocks reserved for a prompt whose KV another node computes
    _READY = 5       # decode side: KV arrived, first token given; joins the batch at the next schedule()
    _DEFERRED = 6    # out of the queue until undefer(): something it needs first (its KV from a cache tier)

# Waiting-queue policies (POLICY_* in scheduler.pyx).
cdef enum:
    _POLICY_FCFS = 0      # first come, first served
    _POLICY_LPM = 1       # longest cached prefix first, with aging


cdef class Scheduler:
    cdef readonly BlockAllocator allocator
    cdef readonly RadixCache cache         # None: prefix caching off
    cdef readonly StepPlan plan
    cdef readonly int block_size, max_num_seqs, max_num_batched_tokens, max_model_len
    cdef public int max_prefill_tokens_with_decodes  # the engine may resize it between steps
    cdef readonly int max_requests, vocab_size, policy, lpm_window
    cdef readonly double lpm_aging
    cdef readonly bint chunked_prefill
    # speculative decoding (n-gram / prompt lookup): most drafted tokens a request takes a step,
    # the n-gram lengths matched, and the most running requests for which drafting is on
    cdef readonly int num_speculative_tokens, spec_ngram_min, spec_ngram_max
    cdef public int spec_max_running  # the engine lowers it to 0 for steps where drafting measured slower
    # drafts come from outside the runtime (a draft model): schedule() reserves each drafting request's
    # rows and set_drafts() fills them before the forward, instead of _propose
    cdef readonly bint external_drafts
    cdef int32_t* eos_ids
    cdef int n_eos
    # per-request state, indexed by slot
    cdef int64_t* r_id
    cdef uint8_t* r_state
    cdef uint8_t* r_aborted          # aborted while in flight: freed at update()
    cdef uint8_t* r_ignore_eos
    cdef uint8_t* r_prefill_only
    cdef int32_t** r_tokens
    cdef int32_t** r_blocks
    cdef int32_t** r_stop_ids
    cdef int32_t* r_nstop
    cdef int32_t* r_capacity         # most tokens the request can ever hold
    cdef int32_t* r_num_tokens
    cdef int32_t* r_prompt_len
    cdef int32_t* r_num_computed
    cdef int32_t* r_nblocks
    cdef int32_t* r_max_tokens
    cdef int32_t* r_min_tokens
    cdef int32_t* r_cached_tokens    # prompt tokens found in the cache at first admission
    cdef int32_t* r_inserted         # full blocks already inserted into the cache
    cdef int32_t* r_preemptions
    cdef int64_t* r_arrival_step
    cdef uint8_t* r_spec             # drafting allowed for it
    cdef int32_t* r_spec_k           # drafts it may take now (adapted to its acceptance)
    cdef int32_t* r_spec_pause       # steps left without drafting, after drafts kept failing
    cdef int32_t* r_spec_misses      # verifications in a row that accepted nothing
    cdef int64_t* r_spec_drafted
    cdef int64_t* r_spec_accepted
    cdef int32_t* free_slots
    cdef int n_free_slots
    # queues
    cdef int32_t* running            # admission order; the last one is preempted first
    cdef readonly int num_running
    cdef int32_t* waiting            # front first
    cdef readonly int num_waiting
    cdef readonly int num_held
    cdef int32_t* ready              # _READY slots, oldest first
    cdef readonly int num_ready
    cdef readonly int num_reserved
    cdef readonly int num_deferred
    cdef dict slot_of
    # this step
    cdef int32_t* sched_slot
    cdef int32_t* sched_n            # tokens of the row(s): a prompt chunk, or 1 + its drafted tokens
    cdef int32_t* sched_draft        # of which drafted
    cdef int n_sched
    cdef readonly bint in_flight
    # events from update()
    cdef readonly object event_req_ids, event_tokens, event_finish, event_rows
    cdef int64_t* e_req_ids
    cdef int32_t* e_tokens
    cdef int8_t* e_finish
    cdef int32_t* e_rows             # the sampling row each event's token came from
    # stats
    cdef readonly int64_t step_count
    cdef readonly int64_t num_preemptions
    cdef readonly int64_t queued_prompt_tokens
    cdef readonly int64_t spec_verifications, spec_draft_tokens, spec_accepted_tokens, spec_emitted_tokens

    # queues and request lifetimes
    cdef bint _in_step(self, int s) noexcept nogil
    cdef void _enqueue(self, int s, bint front) noexcept nogil
    cdef void _remove_waiting(self, int idx) noexcept nogil
    cdef void _remove_running(self, int s) noexcept nogil
    cdef int _cache_blocks(self, int s) except -1
    cdef int _free_blocks(self, int s) except -1
    cdef int _drop(self, int s) except -1
    cdef int _preempt(self, int s) except -1
    cdef int _pick_waiting(self) except -1
    # the step
    cdef int _schedule(self) except -1
    cdef void _write_plan(self) noexcept
    cdef int _stop_reason(self, int s, int32_t tok) noexcept nogil
    cdef int _propose(self, int s, int kmax) noexcept nogil
    cdef int _rows(self, int s, int c, int n) noexcept nogil
    cdef int _fit_rows(self, int s, int c, int n, int free) noexcept nogil
    cdef int _reserve_drafts(self, int s, int kmax) noexcept nogil
    cdef int _emit(self, int s, int32_t tok, int row, int events) except -1
    cdef int _verify(self, int s, const int64_t* sampled, int k, int d, int events) except -1
    cdef int _update(self, const int64_t* sampled) except -1
    cdef int _slot(self, int64_t req_id) except -1
