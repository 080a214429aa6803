# cython: language_level=3
"""The Scheduler: continuous batching under one token budget per step, writing each
step's plan into a StepPlan's buffers, over a BlockAllocator and (optionally) a RadixCache.
Its codes (finish reasons, request states, policies) are declared in scheduler.pxd."""

from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memmove, memset

import numpy as np
cimport numpy as cnp

from .common cimport _as_int32_ptr, _as_int64_ptr, _cdiv, _int32_array, _is_contiguous, _zeroed

cnp.import_array()

FINISH_NONE = _FINISH_NONE
FINISH_STOP = _FINISH_STOP
FINISH_LENGTH = _FINISH_LENGTH
FINISH_ABORT = _FINISH_ABORT
FINISH_REMOTE = _FINISH_REMOTE
FINISH_REASONS = {_FINISH_NONE: None, _FINISH_STOP: "stop", _FINISH_LENGTH: "length",
                  _FINISH_ABORT: "abort", _FINISH_REMOTE: "remote"}

STATE_NAMES = {_FREE: "free", _WAITING: "waiting", _RUNNING: "running", _HELD: "held",
               _RESERVED: "reserved", _READY: "ready",
               _DEFERRED: "deferred"}

POLICY_FCFS = _POLICY_FCFS
POLICY_LPM = _POLICY_LPM


cdef class Scheduler:
    """Continuous batching with one token budget per step (no prefill/decode phases).

    Every request has num_tokens (prompt + generated) and num_computed_tokens (whose
    KV is in the cache). A step gives each running request the tokens it still
    needs — one for a decode, a chunk for a prompt — running requests first, in
    admission order, so decodes are never starved by a long prompt; what budget
    remains admits waiting requests (radix match first, blocks only for the rest).
    When blocks run out, the newest running request is preempted by recompute.

    Usage, once per step:  plan_rows = schedule(); ...forward, sample...; update(tokens)
    """

    def __cinit__(self, BlockAllocator allocator not None, StepPlan plan not None, *,
                  RadixCache cache=None, int max_num_seqs=64, int max_num_batched_tokens=2048,
                  int max_model_len=4096, eos_token_ids=(), int max_requests=16384,
                  int vocab_size=0, str policy="fcfs", bint chunked_prefill=True,
                  double lpm_aging=8.0, int lpm_window=64, int max_prefill_tokens_with_decodes=0,
                  int num_speculative_tokens=0, int spec_ngram_min=1, int spec_ngram_max=4,
                  int spec_max_running=16, bint external_drafts=False):
        if cache is not None and cache.allocator is not allocator:
            raise ValueError("the RadixCache must be built on the same allocator")
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or max_model_len < 1 or max_requests < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens, max_model_len and max_requests must be positive")
        if max_prefill_tokens_with_decodes < 0:
            raise ValueError(f"max_prefill_tokens_with_decodes must be 0 (no limit) or positive, "
                             f"got {max_prefill_tokens_with_decodes}")
        if num_speculative_tokens < 0 or not 1 <= spec_ngram_min <= spec_ngram_max or spec_max_running < 1:
            raise ValueError(f"speculative decoding: num_speculative_tokens {num_speculative_tokens} must be 0 or "
                             f"more, 1 <= spec_ngram_min {spec_ngram_min} <= spec_ngram_max {spec_ngram_max}, "
                             f"spec_max_running {spec_max_running} positive")
        if plan.max_num_seqs < max_num_seqs:
            raise ValueError(f"plan has {plan.max_num_seqs} rows, scheduler needs {max_num_seqs}")
        if plan.max_num_tokens < max_num_batched_tokens:
            raise ValueError(f"plan has {plan.max_num_tokens} token slots, scheduler needs {max_num_batched_tokens}")
        cdef int width = _cdiv(max_model_len, allocator.block_size)
        if plan.width < width:
            raise ValueError(f"plan block tables are {plan.width} wide; max_model_len {max_model_len} "
                             f"with block_size {allocator.block_size} needs {width}")
        if policy not in ("fcfs", "lpm"):
            raise ValueError(f"policy must be 'fcfs' or 'lpm', got {policy!r}")
        if policy == "lpm" and cache is None:
            raise ValueError("policy 'lpm' needs a RadixCache")
        self.allocator = allocator
        self.cache = cache
        self.plan = plan
        self.block_size = allocator.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes
        self.max_model_len = max_model_len
        self.max_requests = max_requests
        self.vocab_size = vocab_size
        self.policy = _POLICY_LPM if policy == "lpm" else _POLICY_FCFS
        self.chunked_prefill = chunked_prefill
        self.lpm_aging = lpm_aging
        self.lpm_window = max(1, lpm_window)
        self.num_speculative_tokens = min(num_speculative_tokens, max_num_seqs - 1)
        self.spec_ngram_min = spec_ngram_min
        self.spec_ngram_max = spec_ngram_max
        self.spec_max_running = spec_max_running
        self.external_drafts = external_drafts
        eos = _int32_array(list(eos_token_ids), "eos_token_ids")
        self.n_eos = eos.size
        self.eos_ids = <int32_t*>_zeroed(max(1, eos.size) * sizeof(int32_t))
        cdef int i
        for i in range(eos.size):
            self.eos_ids[i] = eos[i]
        cdef int n = max_requests
        self.r_id = <int64_t*>_zeroed(<size_t>(n) * sizeof(int64_t))
        self.r_state = <uint8_t*>_zeroed(<size_t>(n) * sizeof(uint8_t))
        self.r_aborted = <uint8_t*>_zeroed(<size_t>(n) * sizeof(uint8_t))
        self.r_ignore_eos = <uint8_t*>_zeroed(<size_t>(n) * sizeof(uint8_t))
        self.r_prefill_only = <uint8_t*>_zeroed(<size_t>(n) * sizeof(uint8_t))
        self.r_tokens = <int32_t**>_zeroed(<size_t>(n) * sizeof(int32_t*))
        self.r_blocks = <int32_t**>_zeroed(<size_t>(n) * sizeof(int32_t*))
        self.r_stop_ids = <int32_t**>_zeroed(<size_t>(n) * sizeof(int32_t*))
        self.r_nstop = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_capacity = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_num_tokens = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_prompt_len = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_num_computed = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_nblocks = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_max_tokens = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_min_tokens = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_cached_tokens = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_inserted = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_preemptions = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_arrival_step = <int64_t*>_zeroed(<size_t>(n) * sizeof(int64_t))
        self.r_spec = <uint8_t*>_zeroed(<size_t>(n) * sizeof(uint8_t))
        self.r_spec_k = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_spec_pause = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_spec_misses = <int32_t*>_zeroed(<size_t>(n) * sizeof(int32_t))
        self.r_spec_drafted = <int64_t*>_zeroed(<size_t>(n) * sizeof(int64_t))
        self.r_spec_accepted = <int64_t*>_zeroed(<size_t>(n) * sizeof(int64_t))
        self.free_slots = <int32_t*>_zeroed(n * sizeof(int32_t))
        self.running = <int32_t*>_zeroed(max_num_seqs * sizeof(int32_t))
        self.waiting = <int32_t*>_zeroed(n * sizeof(int32_t))
        self.ready = <int32_t*>_zeroed(n * sizeof(int32_t))
        self.sched_slot = <int32_t*>_zeroed(max_num_seqs * sizeof(int32_t))
        self.sched_n = <int32_t*>_zeroed(max_num_seqs * sizeof(int32_t))
        self.sched_draft = <int32_t*>_zeroed(max_num_seqs * sizeof(int32_t))
        if not (self.eos_ids and self.r_id and self.r_state and self.r_aborted and self.r_ignore_eos
                and self.r_prefill_only and self.r_tokens and self.r_blocks and self.r_stop_ids
                and self.r_nstop and self.r_capacity and self.r_num_tokens and self.r_prompt_len
                and self.r_num_computed and self.r_nblocks and self.r_max_tokens and self.r_min_tokens
                and self.r_cached_tokens and self.r_inserted and self.r_preemptions
                and self.r_arrival_step and self.free_slots and self.running and self.waiting and self.ready
                and self.sched_slot and self.sched_n and self.sched_draft and self.r_spec and self.r_spec_k
                and self.r_spec_pause and self.r_spec_misses and self.r_spec_drafted and self.r_spec_accepted):
            raise MemoryError()
        for i in range(n):
            self.free_slots[i] = n - 1 - i  # slot 0 handed out first
        self.n_free_slots = n
        self.slot_of = {}
        self.event_req_ids = np.zeros(max_num_seqs, dtype=np.int64)
        self.event_tokens = np.zeros(max_num_seqs, dtype=np.int32)
        self.event_finish = np.zeros(max_num_seqs, dtype=np.int8)
        self.event_rows = np.zeros(max_num_seqs, dtype=np.int32)
        self.e_rows = _as_int32_ptr(self.event_rows)
        self.e_req_ids = _as_int64_ptr(self.event_req_ids)
        self.e_tokens = _as_int32_ptr(self.event_tokens)
        cdef int8_t[::1] fin = self.event_finish
        self.e_finish = &fin[0]

    def __dealloc__(self):
        cdef int i
        if self.r_tokens != NULL:
            for i in range(self.max_requests):
                free(self.r_tokens[i]); free(self.r_blocks[i]); free(self.r_stop_ids[i])
        free(self.eos_ids); free(self.r_id); free(self.r_state); free(self.r_aborted)
        free(self.r_ignore_eos); free(self.r_prefill_only); free(self.r_tokens); free(self.r_blocks)
        free(self.r_stop_ids); free(self.r_nstop); free(self.r_capacity); free(self.r_num_tokens)
        free(self.r_prompt_len); free(self.r_num_computed); free(self.r_nblocks); free(self.r_max_tokens)
        free(self.r_min_tokens); free(self.r_cached_tokens); free(self.r_inserted)
        free(self.r_preemptions); free(self.r_arrival_step); free(self.free_slots); free(self.running)
        free(self.waiting); free(self.ready); free(self.sched_slot); free(self.sched_n); free(self.sched_draft)
        free(self.r_spec); free(self.r_spec_k); free(self.r_spec_pause); free(self.r_spec_misses)
        free(self.r_spec_drafted); free(self.r_spec_accepted)

    # -- requests in and out (Python callers, once per request) ---------------------------

    def add_request(self, int64_t req_id, prompt_token_ids, *, int max_tokens=16, int min_tokens=0,
                    stop_token_ids=(), bint ignore_eos=False, bint prefill_only=False, bint speculate=False):
        """Queue a request (at the back). max_tokens counts generated tokens. speculate: its decode
        steps may verify tokens drafted from its own text (num_speculative_tokens > 0)."""
        if req_id in self.slot_of:
            raise ValueError(f"request {req_id} already exists")
        prompt = _int32_array(prompt_token_ids, "prompt_token_ids")
        stops = _int32_array(list(stop_token_ids), "stop_token_ids")
        cdef int plen = prompt.size
        if plen == 0:
            raise ValueError("the prompt is empty")
        if plen > self.max_model_len:
            raise ValueError(f"the prompt has {plen} tokens, more than max_model_len {self.max_model_len}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if min_tokens < 0 or min_tokens > max_tokens:
            raise ValueError(f"min_tokens must lie in [0, max_tokens], got {min_tokens}")
        if self.vocab_size > 0:
            bad = prompt[prompt >= self.vocab_size]
            if bad.size:
                raise ValueError(f"token id {int(bad[0])} is outside the vocabulary (size {self.vocab_size})")
        # the request never holds more than max_model_len tokens of KV; one sampled past
        # a prompt of exactly max_model_len tokens is the only exception
        cdef int64_t capacity = min(<int64_t>plen + max_tokens, max(self.max_model_len, plen + 1))
        cdef int max_blocks = _cdiv(capacity - 1, self.block_size)
        if max_blocks > self.allocator.num_blocks - 1:
            raise ValueError(f"the request may need {max_blocks} KV blocks, the cache has only "
                             f"{self.allocator.num_blocks - 1}")
        if self.n_free_slots == 0:
            raise OverflowError(f"the scheduler already holds {self.max_requests} requests")
        cdef int s = self.free_slots[self.n_free_slots - 1]
        cdef int32_t* toks = <int32_t*>malloc(capacity * sizeof(int32_t))
        cdef int32_t* blks = <int32_t*>malloc(max(1, max_blocks) * sizeof(int32_t))
        cdef int32_t* stop_buf = <int32_t*>malloc(max(1, stops.size) * sizeof(int32_t))
        if not (toks and blks and stop_buf):
            free(toks); free(blks); free(stop_buf)
            raise MemoryError()
        self.n_free_slots -= 1
        memcpy(toks, _as_int32_ptr(prompt), plen * sizeof(int32_t))
        cdef int i
        for i in range(stops.size):
            stop_buf[i] = stops[i]
        self.r_id[s] = req_id
        self.r_tokens[s] = toks
        self.r_blocks[s] = blks
        self.r_stop_ids[s] = stop_buf
        self.r_nstop[s] = stops.size
        self.r_capacity[s] = <int32_t>capacity
        self.r_num_tokens[s] = plen
        self.r_prompt_len[s] = plen
        self.r_num_computed[s] = 0
        self.r_nblocks[s] = 0
        self.r_max_tokens[s] = max_tokens
        self.r_min_tokens[s] = min_tokens
        self.r_ignore_eos[s] = ignore_eos
        self.r_prefill_only[s] = prefill_only
        self.r_aborted[s] = 0
        self.r_cached_tokens[s] = 0
        self.r_inserted[s] = 0
        self.r_preemptions[s] = 0
        self.r_arrival_step[s] = self.step_count
        self.r_spec[s] = speculate and self.num_speculative_tokens > 0 and not prefill_only
        self.r_spec_k[s] = self.num_speculative_tokens
        self.r_spec_pause[s] = 0
        self.r_spec_misses[s] = 0
        self.r_spec_drafted[s] = 0
        self.r_spec_accepted[s] = 0
        self.slot_of[req_id] = s
        self._enqueue(s, False)
        return s

    def abort(self, int64_t req_id):
        """Drop a request wherever it is; its blocks are freed now, or at update() when the
        step in flight still reads them. Returns False for an unknown or finished id."""
        slot = self.slot_of.get(req_id)
        if slot is None:
            return False
        cdef int s = slot
        if self.r_aborted[s]:
            return False
        if self.in_flight and self._in_step(s):
            self.r_aborted[s] = 1
            return True
        self._drop(s)
        return True

    def reserve(self, int64_t req_id, prompt_token_ids, *, int max_tokens=16, int min_tokens=0,
                stop_token_ids=(), bint ignore_eos=False, bint speculate=False):
        """Decode side of a disaggregated request: hold blocks for a prompt whose KV another node
        computes, outside the queues, until resume() (or abort()).

        Returns the block ids, in token order, the prompt's KV must be written into. MemoryError
        when the pool cannot hold them now; nothing changes then (query before commit). The
        blocks are never inserted into the prefix cache before resume(): until then their
        contents are whatever the transfer has written so far."""
        prompt = _int32_array(prompt_token_ids, "prompt_token_ids")
        cdef int need = _cdiv(prompt.size, self.block_size)
        if need > self.allocator.n_list:
            raise MemoryError(f"cannot reserve {need} blocks: {self.allocator.n_list} free or evictable")
        cdef int s = self.add_request(req_id, prompt, max_tokens=max_tokens, min_tokens=min_tokens,
                                      stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, speculate=speculate)
        self._remove_waiting(self.num_waiting - 1)  # add_request queued it last
        self.allocator._alloc(need, self.r_blocks[s])
        self.r_nblocks[s] = need
        self.r_num_computed[s] = self.r_prompt_len[s]  # computed elsewhere
        self.r_state[s] = _RESERVED
        self.num_reserved += 1
        blocks = np.empty(need, dtype=np.int32)
        memcpy(_as_int32_ptr(blocks), self.r_blocks[s], need * sizeof(int32_t))
        return blocks

    def resume(self, int64_t req_id, int first_token):
        """The reserved request's KV has arrived: append the first token (sampled where the prompt
        ran) and let it join the running batch at the next schedule(), as a decode of that token.
        It then counts that token as generated for max_tokens and min_tokens, exactly as a local
        request would. ValueError, changing nothing, when the token would already finish it (the
        prefill node finishes such requests itself) or lies outside the vocabulary."""
        slot = self.slot_of.get(req_id)
        if slot is None or self.r_state[<int>slot] != _RESERVED:
            raise KeyError(f"request {req_id} is not reserved")
        cdef int s = slot
        if first_token < 0 or (self.vocab_size > 0 and first_token >= self.vocab_size):
            raise ValueError(f"token id {first_token} is outside the vocabulary (size {self.vocab_size})")
        self.r_tokens[s][self.r_num_tokens[s]] = first_token
        self.r_num_tokens[s] += 1
        if self._stop_reason(s, first_token) != _FINISH_NONE:
            self.r_num_tokens[s] -= 1
            raise ValueError(f"the first token {first_token} already finishes request {req_id}")
        self.num_reserved -= 1
        self.r_state[s] = _READY
        self.ready[self.num_ready] = s
        self.num_ready += 1

    def defer(self, int64_t req_id):
        """Take a waiting request out of the queue until undefer(): a component prepares something
        it needs first (rtp/engine/kv_tiers/: its prefix's KV, read from a cache tier off the step).
        It holds no blocks meanwhile and abort() drops it as usual. KeyError unless it waits."""
        slot = self.slot_of.get(req_id)
        if slot is None or self.r_state[<int>slot] != _WAITING:
            raise KeyError(f"request {req_id} is not waiting")
        cdef int s = slot, i
        for i in range(self.num_waiting):
            if self.waiting[i] == s:
                self._remove_waiting(i)
                break
        self.r_state[s] = _DEFERRED
        self.num_deferred += 1

    def undefer(self, int64_t req_id):
        """Queue a deferred request again, first in line: what it waited for is ready (and kept
        only as long as the pool does not need its blocks). KeyError unless it is deferred."""
        slot = self.slot_of.get(req_id)
        if slot is None or self.r_state[<int>slot] != _DEFERRED:
            raise KeyError(f"request {req_id} is not deferred")
        self.num_deferred -= 1
        self._enqueue(<int>slot, True)

    def extend(self, int64_t req_id, int upto_blocks):
        """A running request's KV for its first upto_blocks blocks of tokens comes from elsewhere (a cache
        tier): its computed count jumps to upto_blocks * block_size, blocks are allocated for the new
        ones, and the ids of every block from the one its computed tokens ended in are returned (in
        token order): the caller writes their KV before the next step (the partial block's computed
        tokens with the same bits they hold). Between steps only; at least one token must be left to
        compute. MemoryError (nothing changed) when the pool has too few free or evictable blocks."""
        if self.in_flight:
            raise RuntimeError("extend() while a step is in flight")
        slot = self.slot_of.get(req_id)
        if slot is None or self.r_state[<int>slot] != _RUNNING or self.r_aborted[<int>slot]:
            raise KeyError(f"request {req_id} is not running")
        cdef int s = slot, bs = self.block_size
        cdef int c = self.r_num_computed[s], nb = self.r_nblocks[s]
        if upto_blocks * bs <= c or upto_blocks * bs > self.r_num_tokens[s] - 1:
            raise ValueError(f"request {req_id} has {c} of {self.r_num_tokens[s]} tokens computed: cannot "
                             f"extend to {upto_blocks} blocks")
        if upto_blocks - nb > self.allocator.n_list:
            raise MemoryError(f"{upto_blocks - nb} blocks needed, {self.allocator.n_list} free or evictable")
        self.allocator._alloc(upto_blocks - nb, self.r_blocks[s] + nb)
        self.r_nblocks[s] = upto_blocks
        self.r_num_computed[s] = upto_blocks * bs
        blocks = np.empty(upto_blocks - c // bs, dtype=np.int32)
        memcpy(_as_int32_ptr(blocks), self.r_blocks[s] + c // bs, blocks.size * sizeof(int32_t))
        return blocks

    def release(self, int64_t req_id):
        """Free the blocks of a prefill-only request once its KV has been sent elsewhere."""
        slot = self.slot_of.get(req_id)
        if slot is None or self.r_state[<int>slot] != _HELD:
            raise KeyError(f"request {req_id} is not held")
        self._drop(<int>slot)

    # -- the step (hot path) ---------------------------------------------------------------

    def schedule(self):
        """Fill the plan for one step and return the number of rows scheduled."""
        if self.in_flight:
            raise RuntimeError("schedule() called again before update() for the step in flight")
        self._schedule()
        return self.plan.num_rows

    def update(self, sampled_token_ids):
        """Append one sampled token per sampling row (in plan.logits_indices order), apply
        stop conditions, free finished requests and cache their prefixes. Returns the
        number of events written to event_req_ids / event_tokens / event_finish."""
        if not self.in_flight:
            raise RuntimeError("update() without a step in flight")
        arr = sampled_token_ids
        if not _is_contiguous(arr, cnp.NPY_INT64):  # the sampler's own output needs no copy
            arr = np.asarray(arr)
            if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
                raise TypeError(f"sampled_token_ids must be a 1-D integer array, got {arr.dtype} {arr.shape}")
            arr = np.ascontiguousarray(arr, dtype=np.int64)
        if cnp.PyArray_NDIM(<cnp.ndarray>arr) != 1 or cnp.PyArray_SIZE(<cnp.ndarray>arr) < self.plan.num_samples:
            raise ValueError(f"{self.plan.num_samples} rows sample, got {arr.shape} tokens")
        return self._update(<int64_t*>cnp.PyArray_DATA(<cnp.ndarray>arr))

    def set_drafts(self, draft_token_ids):
        """Fill the planned step's draft rows (external_drafts: a draft model's tokens). For every
        sampling row that verifies a drafted token (sample_offsets j > 0), draft_token_ids[row] is
        that token, its row's input: written into the plan's input_ids and past its request's
        tokens, where update() holds the model's choices against them. Other rows' entries are not
        read. Between schedule() and the forward; ValueError, changing nothing, for an id outside
        the vocabulary."""
        if not self.in_flight:
            raise RuntimeError("set_drafts() without a step in flight")
        arr = draft_token_ids
        if not _is_contiguous(arr, cnp.NPY_INT64):
            arr = np.ascontiguousarray(np.asarray(arr), dtype=np.int64)
        if cnp.PyArray_NDIM(<cnp.ndarray>arr) != 1 or cnp.PyArray_SIZE(<cnp.ndarray>arr) < self.plan.num_samples:
            raise ValueError(f"{self.plan.num_samples} rows sample, got {arr.shape} draft tokens")
        cdef const int64_t* tok = <int64_t*>cnp.PyArray_DATA(<cnp.ndarray>arr)
        cdef StepPlan plan = self.plan
        cdef int k, j, s
        cdef int64_t limit = self.vocab_size if self.vocab_size > 0 else 2147483648
        for k in range(plan.num_samples):
            if plan.p_sample_offsets[k] > 0 and not 0 <= tok[k] < limit:
                raise ValueError(f"draft token id {tok[k]} (row {k}) is outside [0, {limit})")
        for k in range(plan.num_samples):
            j = plan.p_sample_offsets[k]
            if j > 0:
                s = plan.p_sample_slots[k]
                # row k verifies the token at position num_tokens - 1 + j (its last token is offset 0)
                self.r_tokens[s][self.r_num_tokens[s] + j - 1] = <int32_t>tok[k]
                plan.p_input_ids[plan.p_logits_indices[k]] = <int32_t>tok[k]

    cdef bint _in_step(self, int s) noexcept nogil:
        cdef int k
        for k in range(self.n_sched):
            if self.sched_slot[k] == s:
                return True
        return False

    cdef void _enqueue(self, int s, bint front) noexcept nogil:
        if front:
            memmove(self.waiting + 1, self.waiting, self.num_waiting * sizeof(int32_t))
            self.waiting[0] = s
        else:
            self.waiting[self.num_waiting] = s
        self.num_waiting += 1
        self.r_state[s] = _WAITING
        self.queued_prompt_tokens += self.r_num_tokens[s]

    cdef void _remove_waiting(self, int idx) noexcept nogil:
        cdef int s = self.waiting[idx]
        memmove(self.waiting + idx, self.waiting + idx + 1, (self.num_waiting - idx - 1) * sizeof(int32_t))
        self.num_waiting -= 1
        self.queued_prompt_tokens -= self.r_num_tokens[s]

    cdef void _remove_running(self, int s) noexcept nogil:
        cdef int i = self.num_running - 1
        while self.running[i] != s:
            i -= 1
        memmove(self.running + i, self.running + i + 1, (self.num_running - i - 1) * sizeof(int32_t))
        self.num_running -= 1

    cdef int _cache_blocks(self, int s) except -1:
        """Insert s's fully computed blocks into the cache (swapping duplicates)."""
        cdef int nfull = self.r_num_computed[s] // self.block_size
        if self.cache is not None and nfull > self.r_inserted[s]:
            self.cache._insert(self.r_tokens[s], nfull, self.r_blocks[s], self.r_inserted[s])
            self.r_inserted[s] = nfull
        return 0

    cdef int _free_blocks(self, int s) except -1:
        self._cache_blocks(s)
        self.allocator._release_path(self.r_blocks[s], self.r_nblocks[s])
        self.r_nblocks[s] = 0
        self.r_inserted[s] = 0
        return 0

    cdef int _drop(self, int s) except -1:
        """Remove a request entirely (finished, aborted or released): blocks, slot, id."""
        cdef uint8_t state = self.r_state[s]
        cdef int i
        if state == _WAITING:
            for i in range(self.num_waiting):
                if self.waiting[i] == s:
                    self._remove_waiting(i)
                    break
        elif state == _RUNNING:
            self._remove_running(s)
        elif state == _HELD:
            self.num_held -= 1
        elif state == _DEFERRED:
            self.num_deferred -= 1
        elif state == _READY:
            for i in range(self.num_ready):
                if self.ready[i] == s:
                    memmove(self.ready + i, self.ready + i + 1, (self.num_ready - i - 1) * sizeof(int32_t))
                    self.num_ready -= 1
                    break
        if state == _RESERVED:
            # a transfer that never completed: the blocks hold partial KV, so they must not reach the cache
            self.num_reserved -= 1
            self.allocator._release_path(self.r_blocks[s], self.r_nblocks[s])
            self.r_nblocks[s] = 0
        elif state != _WAITING and state != _DEFERRED:
            self._free_blocks(s)
        free(self.r_tokens[s]); free(self.r_blocks[s]); free(self.r_stop_ids[s])
        self.r_tokens[s] = NULL
        self.r_blocks[s] = NULL
        self.r_stop_ids[s] = NULL
        self.r_state[s] = _FREE
        self.r_aborted[s] = 0
        del self.slot_of[self.r_id[s]]
        self.free_slots[self.n_free_slots] = s
        self.n_free_slots += 1
        return 0

    cdef int _preempt(self, int s) except -1:
        """Recompute-style preemption: cache what was computed, free it all, requeue first."""
        self._remove_running(s)
        self._free_blocks(s)
        self.r_num_computed[s] = 0
        self.r_preemptions[s] += 1
        self.num_preemptions += 1
        self._enqueue(s, True)
        return 0

    cdef int _pick_waiting(self) except -1:
        """Index in the waiting queue of the request to admit next."""
        if self.policy == _POLICY_FCFS or self.num_waiting == 1:
            return 0
        cdef int i, s, best = 0, m, n = min(self.num_waiting, self.lpm_window)
        cdef double score, best_score = -1.0
        for i in range(n):
            s = self.waiting[i]
            m = self.cache._match(self.r_tokens[s], self.cache._match_cap(self.r_num_tokens[s], True), NULL)
            # aging: every step waited counts as lpm_aging matched tokens, so a cold
            # request overtakes hot ones after a bounded wait
            score = <double>m * self.block_size + self.lpm_aging * <double>(self.step_count - self.r_arrival_step[s])
            if score > best_score:
                best_score = score
                best = i
        return best

    cdef int _schedule(self) except -1:
        cdef int budget = self.max_num_batched_tokens
        cdef int prefill_budget = budget  # tokens of prompt chunks this step
        cdef int i = 0, s, n, need, bs = self.block_size, m, idx
        cdef bint preempted = False
        cdef BlockAllocator alloc = self.allocator
        self.n_sched = 0
        # requests prefilled elsewhere join the batch first: their next token is one decode
        while self.num_ready > 0 and self.num_running < self.max_num_seqs:
            s = self.ready[0]
            self.num_ready -= 1
            memmove(self.ready, self.ready + 1, self.num_ready * sizeof(int32_t))
            self.running[self.num_running] = s
            self.num_running += 1
            self.r_state[s] = _RUNNING
        # A step that carries decodes stalls every one of them for as long as its prompt chunks
        # take: with decodes running, prompts get at most max_prefill_tokens_with_decodes.
        if self.max_prefill_tokens_with_decodes:
            for i in range(self.num_running):
                s = self.running[i]
                if self.r_num_tokens[s] - self.r_num_computed[s] == 1:
                    prefill_budget = min(budget, self.max_prefill_tokens_with_decodes)
                    break
            i = 0
        # Drafted tokens take plan rows (one each) that no running or waiting request needs,
        # and only while few requests run: past that a step is bound by compute, not by reading
        # the weights, and verifying drafts stops being nearly free.
        cdef int spare = 0, d, kmax, e
        # rows beyond one per scheduled request: drafts, and a recomputed request's generated tokens
        # (a decode row each, _fit_rows)
        cdef int extra = 0
        if self.num_speculative_tokens > 0 and self.num_running <= self.spec_max_running:
            spare = self.max_num_seqs - self.num_running - self.num_waiting
        # 1. running requests, oldest first: a decode needs 1 token (and may verify drafted ones),
        #    a prompt its next chunk
        while i < self.num_running and budget > 0:
            s = self.running[i]
            n = min(self.r_num_tokens[s] - self.r_num_computed[s], budget)
            d = 0
            if n > 1:
                n = min(n, prefill_budget)
                if n == 0:
                    i += 1
                    continue  # its next chunk waits for a step with room
                n = self._fit_rows(s, self.r_num_computed[s], n, self.max_num_seqs - self.num_running - extra)
                e = self._rows(s, self.r_num_computed[s], n) - 1
                extra += e
                spare -= e
            elif spare > 0 and self.r_spec[s] and self.r_num_computed[s] >= self.r_prompt_len[s]:
                # (not after a prompt's lone last token: with drafts every row of a request is a decode
                # row, and a prompt token takes prefill attention, docs/determinism.md)
                if self.r_spec_pause[s] > 0:
                    self.r_spec_pause[s] -= 1
                else:
                    # drafts are written past the request's tokens (its buffer holds capacity) and
                    # never past what it may still generate
                    kmax = min(self.r_spec_k[s], spare, budget - 1,
                               self.r_capacity[s] - self.r_num_tokens[s] - 1,
                               self.r_max_tokens[s] - (self.r_num_tokens[s] - self.r_prompt_len[s]) - 1)
                    if kmax > 0:
                        d = self._reserve_drafts(s, kmax) if self.external_drafts else self._propose(s, kmax)
            need = _cdiv(self.r_num_computed[s] + n + d, bs) - self.r_nblocks[s]
            while d > 0 and need > alloc.n_list:  # drafts never cost a preemption
                d -= 1
                need = _cdiv(self.r_num_computed[s] + n + d, bs) - self.r_nblocks[s]
            while need > alloc.n_list:
                preempted = True
                self._preempt(self.running[self.num_running - 1])
                if self.r_state[s] != _RUNNING:
                    break
            if self.r_state[s] != _RUNNING:
                break  # s itself was the newest: it waits for blocks
            if need > 0:
                alloc._alloc(need, self.r_blocks[s] + self.r_nblocks[s])
                self.r_nblocks[s] += need
            self.sched_slot[self.n_sched] = s
            self.sched_n[self.n_sched] = n + d
            self.sched_draft[self.n_sched] = d
            self.n_sched += 1
            budget -= n + d
            spare -= d
            extra += d
            if n > 1:
                prefill_budget -= n
            i += 1
        # 2. admit waiting requests while budget, rows and blocks allow (not after a preemption)
        budget = min(budget, prefill_budget)
        while (not preempted and budget > 0 and self.num_waiting > 0
               and self.num_running + extra < self.max_num_seqs):
            idx = self._pick_waiting()
            s = self.waiting[idx]
            m = 0
            if self.cache is not None:
                m = self.cache._match(self.r_tokens[s], self.cache._match_cap(self.r_num_tokens[s], True),
                                      self.r_blocks[s])
            n = self.r_num_tokens[s] - m * bs
            if n > budget:
                if not self.chunked_prefill:
                    break
                n = budget
            n = self._fit_rows(s, m * bs, n, self.max_num_seqs - self.num_running - 1 - extra)
            need = _cdiv(m * bs + n, bs) - m
            if need + alloc._evictable_in(self.r_blocks[s], m) > alloc.n_list:
                break  # not enough blocks: keep the queue order, try next step
            # commit: hold the matched path, then allocate the rest
            alloc._acquire_path(self.r_blocks[s], m)
            alloc._alloc(need, self.r_blocks[s] + m)
            self.r_nblocks[s] = m + need
            self.r_num_computed[s] = m * bs  # recomputed on every admission (preempted requests too)
            self.r_inserted[s] = m
            if self.r_preemptions[s] == 0:
                self.r_cached_tokens[s] = m * bs
            if self.cache is not None:
                self.cache._count_query(self.r_num_tokens[s], m)
            self._remove_waiting(idx)
            self.running[self.num_running] = s
            self.num_running += 1
            self.r_state[s] = _RUNNING
            self.sched_slot[self.n_sched] = s
            self.sched_n[self.n_sched] = n
            self.sched_draft[self.n_sched] = 0
            self.n_sched += 1
            budget -= n
            extra += self._rows(s, m * bs, n) - 1
        self._write_plan()
        self.in_flight = True
        self.step_count += 1
        return 0

    cdef int _rows(self, int s, int c, int n) noexcept nogil:
        """Plan rows the chunk [c, c + n) of s takes: its prompt tokens one row, each generated token a
        decode row of its own -- as it was computed when it was generated, so that a preempted request's
        recompute writes the same KV bits (docs/determinism.md)."""
        cdef int plen = self.r_prompt_len[s]
        cdef int first_generated = c if c > plen else plen
        if c + n <= first_generated:
            return 1
        return c + n - first_generated + (1 if c < plen else 0)

    cdef int _fit_rows(self, int s, int c, int n, int free) noexcept nogil:
        """n, or fewer tokens where the chunk's rows past its first would exceed `free`: a recompute then
        takes its generated tokens a few rows a step (at least one token a step: its own row)."""
        cdef int plen = self.r_prompt_len[s]
        if self._rows(s, c, n) - 1 <= free:
            return n
        if free < 0:
            free = 0
        if c < plen:
            return plen - c + free
        return free + 1

    cdef void _write_plan(self) noexcept:
        cdef StepPlan plan = self.plan
        cdef int k, s, n, j, pos, c, nb, row = 0, t = 0, samples = 0, pass_
        cdef int bs = self.block_size
        cdef int32_t* toks
        cdef int32_t* blocks
        plan.p_qsl[0] = 0
        # decode rows (a generated token each, or a request's drafts) first, then prompt chunks. A
        # prompt token always takes prefill attention and a generated one decode attention, so a
        # request's bits do not depend on where its chunks fall (docs/determinism.md): a prompt's lone
        # last token (a prefix-cache hit up to it, or a chunk boundary before it) is a prompt chunk
        # (and is not drafted after), and a preempted request's recompute gives each of its generated
        # tokens a decode row (pass 0) and its prompt one prompt row (pass 1); its last row samples.
        # Drafts: its last token and each drafted one a decode row, each seeing the tokens before it,
        # each sampling (the drafts sit in toks past the request's num_tokens, where they were written).
        cdef int plen, g, e, d
        for pass_ in range(2):
            for k in range(self.n_sched):
                n = self.sched_n[k]
                s = self.sched_slot[k]
                d = self.sched_draft[k]
                c = self.r_num_computed[s]  # pass 1: already past the chunk where pass 0 took it whole
                plen = self.r_prompt_len[s]
                e = c + n
                g = c if c > plen else plen  # its first generated token (drafts: c >= plen)
                toks = self.r_tokens[s]
                blocks = self.r_blocks[s]
                nb = self.r_nblocks[s]
                if pass_ == 0 and g < e:  # decode rows: generated tokens (recomputed or not) and drafts
                    for pos in range(g, e):
                        plan._put_token(t, toks[pos], pos, blocks, bs)
                        t += 1
                        plan._put_row(row, blocks, nb, pos + 1, t)
                        if d > 0 or pos + 1 == self.r_num_tokens[s]:
                            plan._put_sample(samples, t - 1, s, self.r_id[s], pos - g if d > 0 else 0)
                            samples += 1
                        row += 1
                    if c >= plen:
                        self.r_num_computed[s] = e
                    continue
                if pass_ == 0 or c >= plen:
                    continue
                if e > plen:  # the prompt part; its generated tokens went in pass 0
                    n = plen - c
                for j in range(n):
                    plan._put_token(t, toks[c + j], c + j, blocks, bs)
                    t += 1
                plan._put_row(row, blocks, nb, c + n, t)
                if c + n == self.r_num_tokens[s]:
                    plan._put_sample(samples, t - 1, s, self.r_id[s], 0)
                    samples += 1
                self.r_num_computed[s] = c + self.sched_n[k]
                row += 1
            if pass_ == 0:
                plan.num_decode_rows = row
        plan._clear_tail(t, row, samples)

    cdef int _stop_reason(self, int s, int32_t tok) noexcept nogil:
        cdef int i, out = self.r_num_tokens[s] - self.r_prompt_len[s]
        if out >= self.r_min_tokens[s]:
            if not self.r_ignore_eos[s]:
                for i in range(self.n_eos):
                    if tok == self.eos_ids[i]:
                        return _FINISH_STOP
            for i in range(self.r_nstop[s]):
                if tok == self.r_stop_ids[s][i]:
                    return _FINISH_STOP
        if out >= self.r_max_tokens[s] or self.r_num_tokens[s] >= self.max_model_len:
            return _FINISH_LENGTH
        return _FINISH_NONE

    cdef int _propose(self, int s, int kmax) noexcept nogil:
        """Draft up to kmax tokens for s by prompt lookup (vLLM's ngram, llama.cpp's lookup): the
        latest earlier place in its tokens where its last n tokens occur (n from spec_ngram_max
        down to spec_ngram_min) proposes the tokens that followed there. Written past the
        request's tokens, at toks[num_tokens:]; returns how many (0: no match)."""
        cdef int32_t* toks = self.r_tokens[s]
        cdef int total = self.r_num_tokens[s], n, i, j, d
        for n in range(min(self.spec_ngram_max, total - 1), self.spec_ngram_min - 1, -1):
            for i in range(total - n - 1, -1, -1):  # a match at i is followed by toks[i + n] < total
                if toks[i + n - 1] != toks[total - 1]:
                    continue
                j = 0
                while j < n - 1 and toks[i + j] == toks[total - n + j]:
                    j += 1
                if j == n - 1:
                    d = min(kmax, total - i - n)
                    memcpy(toks + total, toks + i + n, d * sizeof(int32_t))
                    return d
        return 0

    cdef int _reserve_drafts(self, int s, int kmax) noexcept nogil:
        """Draft rows for s whose tokens set_drafts() writes before the forward (a draft model's):
        all kmax, a placeholder in each until then (its last token: an id the model can embed)."""
        cdef int32_t* toks = self.r_tokens[s]
        cdef int total = self.r_num_tokens[s], j
        for j in range(kmax):
            toks[total + j] = toks[total - 1]
        return kmax

    cdef int _emit(self, int s, int32_t tok, int row, int events) except -1:
        """Append one sampled token to s, apply its stop conditions, record its event; returns the
        event count."""
        self.r_tokens[s][self.r_num_tokens[s]] = tok
        self.r_num_tokens[s] += 1
        cdef int reason = self._stop_reason(s, tok)
        if reason == _FINISH_NONE and self.r_prefill_only[s]:
            reason = _FINISH_REMOTE
        self.e_req_ids[events] = self.r_id[s]
        self.e_tokens[events] = tok
        self.e_finish[events] = reason
        self.e_rows[events] = row
        if reason == _FINISH_REMOTE:
            # keep the blocks for the KV transfer; what was computed is cached now
            self._cache_blocks(s)
            self._remove_running(s)
            self.r_state[s] = _HELD
            self.num_held += 1
        elif reason != _FINISH_NONE:
            self._drop(s)
        return events + 1

    cdef int _verify(self, int s, const int64_t* sampled, int k, int d, int events) except -1:
        """s verified d drafted tokens: sampling rows k .. k + d hold what the model chose after its
        last token and after each draft. The drafts it chose itself are kept, then its own token
        where it first chose otherwise (or after the last draft): tokens a request would have
        sampled one step at a time, a step each. The rejected drafts' KV is given back: the
        computed count stops after the kept ones, and blocks past it return to the pool (never
        cached: only computed blocks are). Adapts how many s drafts next."""
        cdef int32_t* toks = self.r_tokens[s]
        cdef int base = self.r_num_tokens[s], a = 0, j, keep
        while a < d and sampled[k + a] == toks[base + a]:
            a += 1
        self.r_num_computed[s] = base + a  # its last token and the kept drafts have their KV
        keep = _cdiv(base + a, self.block_size)
        if self.r_nblocks[s] > keep:
            self.allocator._release_path(self.r_blocks[s] + keep, self.r_nblocks[s] - keep)
            self.r_nblocks[s] = keep
        self.spec_verifications += 1
        self.spec_draft_tokens += d
        self.spec_accepted_tokens += a
        self.r_spec_drafted[s] += d
        self.r_spec_accepted[s] += a
        # Adaptive draft length: one more after a run kept whole, one fewer when less than half was
        # kept; three verifications in a row that kept nothing pause drafting for 8 steps (a text
        # whose repeats lead nowhere costs no more than a few wasted rows).
        if a == d:
            self.r_spec_k[s] = min(self.num_speculative_tokens, self.r_spec_k[s] + 1)
            self.r_spec_misses[s] = 0
        else:
            if 2 * a < d:
                self.r_spec_k[s] = max(1, self.r_spec_k[s] - 1)
            self.r_spec_misses[s] = self.r_spec_misses[s] + 1 if a == 0 else 0
            if self.r_spec_misses[s] >= 3:
                self.r_spec_pause[s] = 8
                self.r_spec_misses[s] = 0
        for j in range(a + 1):
            events = self._emit(s, <int32_t>sampled[k + j], k + j, events)
            self.spec_emitted_tokens += 1
            if self.r_state[s] != _RUNNING:
                break  # it stopped inside the run: the rest is never emitted
        return events

    cdef int _update(self, const int64_t* sampled) except -1:
        cdef StepPlan plan = self.plan
        cdef int k, g, s, events = 0
        cdef int64_t tok, limit = self.vocab_size if self.vocab_size > 0 else 2147483648
        for k in range(plan.num_samples):
            tok = sampled[k]
            if tok < 0 or tok >= limit:
                # checked before anything changes, so the step can be retried with good tokens
                raise ValueError(f"sampled token id {tok} (row {k}) is outside [0, {limit})")
        k = 0
        while k < plan.num_samples:
            s = plan.p_sample_slots[k]
            g = 1  # a request's sampling rows are consecutive: more than one verify drafts
            while k + g < plan.num_samples and plan.p_sample_slots[k + g] == s:
                g += 1
            if not self.r_aborted[s]:
                if g > 1:
                    events = self._verify(s, sampled, k, g - 1, events)
                else:
                    events = self._emit(s, <int32_t>sampled[k], k, events)
            k += g
        for k in range(self.n_sched):
            s = self.sched_slot[k]
            if self.r_aborted[s]:
                self._drop(s)
            elif (self.r_state[s] == _RUNNING and self.r_num_computed[s] >= self.r_prompt_len[s]
                  and self.r_inserted[s] < self.r_prompt_len[s] // self.block_size):
                # prompt done: cache it now so concurrent requests with the same prefix share
                # it (generated blocks are cached when the request finishes or is preempted)
                self._cache_blocks(s)
        self.in_flight = False
        return events

    # -- inspection --------------------------------------------------------------------------

    cdef int _slot(self, int64_t req_id) except -1:
        slot = self.slot_of.get(req_id)
        if slot is None:
            raise KeyError(f"unknown request {req_id}")
        return slot

    def slot_of_request(self, int64_t req_id):
        return self._slot(req_id)

    def has_request(self, int64_t req_id):
        return req_id in self.slot_of

    def request_state(self, int64_t req_id):
        """A dict describing one live request (for tests, debugging and the RPC layer)."""
        cdef int s = self._slot(req_id)
        cdef int n = self.r_num_tokens[s]
        tokens = np.empty(n, dtype=np.int32)
        memcpy(_as_int32_ptr(tokens), self.r_tokens[s], n * sizeof(int32_t))
        blocks = np.empty(self.r_nblocks[s], dtype=np.int32)
        if blocks.size:
            memcpy(_as_int32_ptr(blocks), self.r_blocks[s], blocks.size * sizeof(int32_t))
        return {
            "state": STATE_NAMES[self.r_state[s]],
            "slot": s,
            "token_ids": tokens,
            "prompt_len": self.r_prompt_len[s],
            "num_tokens": n,
            "num_computed_tokens": self.r_num_computed[s],
            "block_ids": blocks,
            "cached_prompt_tokens": self.r_cached_tokens[s],
            "num_preemptions": self.r_preemptions[s],
            "aborted": bool(self.r_aborted[s]),
            "speculative": bool(self.r_spec[s]),
            "spec_draft_tokens": self.r_spec_drafted[s],
            "spec_accepted_tokens": self.r_spec_accepted[s],
        }

    def cached_prompt_tokens(self, int64_t req_id):
        """Prompt tokens the prefix cache supplied when the request was first admitted."""
        return self.r_cached_tokens[self._slot(req_id)]

    def is_first_token(self, int64_t req_id):
        """Whether the request has not generated a token yet (its next sampled token is its first)."""
        cdef int s = self._slot(req_id)
        return self.r_num_tokens[s] == self.r_prompt_len[s]

    # -- a request's stop settings, by slot: the sampler masks stop tokens under min_tokens from them,
    # so they live here once (rtp/engine/sampler.py SlotSettings) --------------------------------------

    def stop_settings(self):
        """(min_tokens int32, ignore_eos uint8): numpy views of the runtime's own per-slot arrays,
        valid while this Scheduler lives (the caller keeps it)."""
        cdef int32_t[::1] min_tokens = <int32_t[:self.max_requests]> self.r_min_tokens
        cdef uint8_t[::1] ignore_eos = <uint8_t[:self.max_requests]> self.r_ignore_eos
        return np.asarray(min_tokens), np.asarray(ignore_eos)

    def stop_ids(self, int slot):
        """The stop token ids of the request at `slot` (eos not included)."""
        if slot < 0 or slot >= self.max_requests or self.r_state[slot] == _FREE:
            raise IndexError(f"slot {slot} holds no request")
        return tuple(self.r_stop_ids[slot][i] for i in range(self.r_nstop[slot]))

    # -- a request's tokens, by slot (the sampler reads them: rtp/engine/sampler.py TokenSource) -------

    def output_lengths(self, slots):
        """Tokens generated so far by the request at each of `slots` (int64 array)."""
        idx = np.asarray(slots, dtype=np.int64)
        out = np.empty(idx.shape[0], dtype=np.int64)
        cdef int64_t[:] i_view = idx
        cdef int64_t[:] o_view = out
        cdef Py_ssize_t k
        cdef int64_t s
        for k in range(idx.shape[0]):
            s = i_view[k]
            if s < 0 or s >= self.max_requests or self.r_state[s] == _FREE:
                raise IndexError(f"slot {s} holds no request")
            o_view[k] = self.r_num_tokens[s] - self.r_prompt_len[s]
        return out

    def slot_tokens(self, int slot):
        """(prompt ids, generated ids) of the request at `slot`, as int32 copies."""
        if slot < 0 or slot >= self.max_requests or self.r_state[slot] == _FREE:
            raise IndexError(f"slot {slot} holds no request")
        cdef int plen = self.r_prompt_len[slot], n = self.r_num_tokens[slot]
        cdef int32_t[:] view = <int32_t[:max(n, 1)]> self.r_tokens[slot]
        tokens = np.array(view[:n], dtype=np.int32)
        return tokens[:plen], tokens[plen:]

    def prompt_length(self, int slot):
        """The prompt's length of the request at `slot`."""
        if slot < 0 or slot >= self.max_requests or self.r_state[slot] == _FREE:
            raise IndexError(f"slot {slot} holds no request")
        return self.r_prompt_len[slot]

    def copy_tokens(self, int slot, int start, int32_t[::1] out):
        """Tokens [start, start + len(out)) of the request at `slot` into out, allocating nothing
        (the draft model reads the tokens it catches up on every step)."""
        if slot < 0 or slot >= self.max_requests or self.r_state[slot] == _FREE:
            raise IndexError(f"slot {slot} holds no request")
        cdef Py_ssize_t n = out.shape[0]
        if start < 0 or start + n > self.r_num_tokens[slot]:
            raise IndexError(f"tokens [{start}, {start + n}) of a request of {self.r_num_tokens[slot]}")
        if n:
            memcpy(&out[0], self.r_tokens[slot] + start, n * sizeof(int32_t))

    def waiting_request_ids(self):
        return [self.r_id[self.waiting[i]] for i in range(self.num_waiting)]

    def running_request_ids(self):
        return [self.r_id[self.running[i]] for i in range(self.num_running)]

    def stats(self):
        """Counters for the server's metrics and the master's routing; O(1)."""
        cdef BlockAllocator a = self.allocator
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_held": self.num_held,
            "num_reserved": self.num_reserved,
            "num_ready": self.num_ready,
            "num_deferred": self.num_deferred,
            "queued_prompt_tokens": self.queued_prompt_tokens,
            "num_blocks": a.num_blocks - 1,
            "free_blocks": a.n_list - a.n_cached_in_list,
            "evictable_blocks": a.n_cached_in_list,
            "used_blocks": a.num_blocks - 1 - a.n_list,
            "cached_blocks": a.n_cached,
            "kv_cache_usage": <double>(a.num_blocks - 1 - a.n_list) / (a.num_blocks - 1),
            "num_preemptions": self.num_preemptions,
            "prefix_cache_queries": self.cache.num_queries if self.cache is not None else 0,
            "prefix_cache_query_tokens": self.cache.query_tokens if self.cache is not None else 0,
            "prefix_cache_hit_tokens": self.cache.hit_tokens if self.cache is not None else 0,
            "num_steps": self.step_count,
            "spec_verifications": self.spec_verifications,
            "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
            "spec_emitted_tokens": self.spec_emitted_tokens,
        }

    @property
    def has_unfinished(self):
        return self.num_running > 0 or self.num_waiting > 0 or self.num_ready > 0 or self.num_deferred > 0

    @property
    def oldest_waiting_step(self):
        """The step count at which the longest-waiting request arrived (-1: none waits)."""
        cdef int i
        cdef int64_t oldest = -1
        for i in range(self.num_waiting):
            if oldest < 0 or self.r_arrival_step[self.waiting[i]] < oldest:
                oldest = self.r_arrival_step[self.waiting[i]]
        return oldest

    def check_integrity(self):
        """Assert the scheduler's invariants and those of the allocator and cache below it."""
        cdef int s, i, b, n_live = 0
        cdef BlockAllocator alloc = self.allocator
        if self.cache is not None:
            self.cache.check_integrity()
        else:
            alloc.check_integrity()
        holders = np.zeros(alloc.num_blocks, dtype=np.int64)
        counted = {"running": 0, "waiting": 0, "held": 0, "reserved": 0, "ready": 0, "deferred": 0}
        queued = 0
        for s in range(self.max_requests):
            if self.r_state[s] == _FREE:
                continue
            n_live += 1
            assert self.slot_of.get(self.r_id[s]) == s, f"slot {s} not in the id map"
            assert 0 < self.r_prompt_len[s] <= self.r_num_tokens[s] <= self.r_capacity[s]
            assert 0 <= self.r_num_computed[s] <= self.r_num_tokens[s]
            if self.r_state[s] == _WAITING:
                counted["waiting"] += 1
                queued += self.r_num_tokens[s]
                assert self.r_nblocks[s] == 0, f"waiting slot {s} holds blocks"
                assert self.r_num_computed[s] == 0, f"waiting slot {s} keeps a stale computed count"
            elif self.r_state[s] == _DEFERRED:
                counted["deferred"] += 1
                assert self.r_nblocks[s] == 0 and self.r_num_computed[s] == 0, f"deferred slot {s} holds blocks"
            else:
                counted[STATE_NAMES[self.r_state[s]]] += 1
                assert self.r_nblocks[s] == _cdiv(self.r_num_computed[s], self.block_size), \
                    f"slot {s}: {self.r_nblocks[s]} blocks for {self.r_num_computed[s]} computed tokens"
                for i in range(self.r_nblocks[s]):
                    b = self.r_blocks[s][i]
                    assert 0 < b < alloc.num_blocks, f"slot {s} holds invalid block {b}"
                    holders[b] += 1
        assert counted["running"] == self.num_running, "running count drifted"
        assert counted["waiting"] == self.num_waiting, "waiting count drifted"
        assert counted["held"] == self.num_held, "held count drifted"
        assert counted["reserved"] == self.num_reserved, "reserved count drifted"
        assert counted["ready"] == self.num_ready, "ready count drifted"
        assert counted["deferred"] == self.num_deferred, "deferred count drifted"
        assert len({self.ready[i] for i in range(self.num_ready)}) == self.num_ready, "request twice in ready"
        assert queued == self.queued_prompt_tokens, "queued prompt tokens drifted"
        assert n_live == len(self.slot_of) == self.max_requests - self.n_free_slots, "slots leaked"
        assert self.num_running <= self.max_num_seqs
        assert len(set(self.running_request_ids())) == self.num_running, "request twice in running"
        assert len(set(self.waiting_request_ids())) == self.num_waiting, "request twice in waiting"
        for b in range(1, alloc.num_blocks):
            assert alloc.ref[b] == holders[b], f"block {b}: refcount {alloc.ref[b]} but {holders[b]} holders"
