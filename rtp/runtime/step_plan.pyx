# cython: language_level=3
"""The StepPlan: the numpy buffers one engine step is described by, and PLAN_ARRAYS, the
one declaration of those buffers that the model runner and the tensor-parallel ranks
build theirs from."""

from libc.stdint cimport int32_t, int64_t
from libc.stdlib cimport free
from libc.string cimport memcpy, memset

import numpy as np
cimport numpy as cnp

from .common cimport _as_int32_ptr, _as_int64_ptr, _zeroed

cnp.import_array()

# Every array of a step plan: its dtype and its extent, in terms of the plan's sizes
# (tokens: max_num_tokens, seqs: max_num_seqs, width: block-table columns). Insertion order
# is the order tensor-parallel ranks receive them in. Tokens are packed row after row.
PLAN_ARRAYS = {
    "input_ids": ("int32", "tokens"),            # token ids to compute
    "positions": ("int32", "tokens"),            # their positions in their sequences
    "slot_mapping": ("int64", "tokens"),         # KV slot = block * block_size + offset
    "block_tables": ("int32", "seqs x width"),   # each row's block ids, zero past its length
    "seq_lens": ("int32", "seqs"),               # context length after this step
    "query_start_loc": ("int32", "seqs + 1"),    # row r's tokens: [qsl[r], qsl[r+1])
    "logits_indices": ("int32", "seqs"),         # token index of each row that samples
    "sample_slots": ("int32", "seqs"),           # scheduler slot of each sampling row
    "sample_req_ids": ("int64", "seqs"),         # request id of each sampling row
    "sample_offsets": ("int32", "seqs"),         # its token's place past the request's last: 0, or
                                                 # j for the row verifying its j-th drafted token
}


def plan_array_shapes(int max_num_tokens, int max_num_seqs, int width):
    """{name: (shape, numpy dtype)} of every PLAN_ARRAYS array for a plan of these sizes."""
    extents = {"tokens": (max_num_tokens,), "seqs": (max_num_seqs,), "seqs + 1": (max_num_seqs + 1,),
               "seqs x width": (max_num_seqs, width)}
    return {name: (extents[extent], np.dtype(dtype)) for name, (dtype, extent) in PLAN_ARRAYS.items()}


cdef class StepPlan:
    """The numpy buffers one engine step is described by, allocated once.

    The scheduler writes into them in place; the model runner aliases them as
    tensors (torch.from_numpy on CPU, pinned staging on CUDA). Tokens are packed
    row after row; rows with one generated token to compute (decodes) come first: rows
    [0, num_decode_rows) each compute exactly one token (a prompt's lone last token is a
    prompt row, which takes prefill attention as every prompt token does). A request
    verifying drafted tokens (speculative decoding) takes one such row per token, consecutive,
    each sampling: the rows of one request are always next to each other.

    Its arrays, their dtypes, shapes and contents: PLAN_ARRAYS above.

    Everything past num_tokens / num_rows / num_samples is zero (slot 0 is the null
    block), so a captured graph padded to a bucket reads harmless values.
    """

    def __cinit__(self, int max_num_tokens, int max_num_seqs, int width, **arrays):
        if max_num_tokens < 1 or max_num_seqs < 1 or width < 1:
            raise ValueError("StepPlan sizes must be positive")
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.width = width
        shapes = plan_array_shapes(max_num_tokens, max_num_seqs, width)
        unknown = set(arrays) - set(shapes)
        if unknown:
            raise TypeError(f"unknown StepPlan arrays: {sorted(unknown)}")
        made = {}
        for name, (shape, dtype) in shapes.items():
            arr = arrays.get(name)
            if arr is None:
                arr = np.zeros(shape, dtype=dtype)
            elif (not isinstance(arr, np.ndarray) or arr.shape != shape or arr.dtype != dtype
                  or not arr.flags.c_contiguous or not arr.flags.writeable):
                raise ValueError(f"StepPlan.{name} must be a writable contiguous {dtype} "
                                 f"array of shape {shape}")
            else:
                arr[...] = 0
            made[name] = arr
        self.input_ids = made["input_ids"]
        self.positions = made["positions"]
        self.slot_mapping = made["slot_mapping"]
        self.block_tables = made["block_tables"]
        self.seq_lens = made["seq_lens"]
        self.query_start_loc = made["query_start_loc"]
        self.logits_indices = made["logits_indices"]
        self.sample_slots = made["sample_slots"]
        self.sample_req_ids = made["sample_req_ids"]
        self.sample_offsets = made["sample_offsets"]
        self.p_input_ids = _as_int32_ptr(self.input_ids)
        self.p_positions = _as_int32_ptr(self.positions)
        self.p_slot_mapping = _as_int64_ptr(self.slot_mapping)
        self.p_block_tables = _as_int32_ptr(self.block_tables.reshape(-1))
        self.p_seq_lens = _as_int32_ptr(self.seq_lens)
        self.p_qsl = _as_int32_ptr(self.query_start_loc)
        self.p_logits_indices = _as_int32_ptr(self.logits_indices)
        self.p_sample_slots = _as_int32_ptr(self.sample_slots)
        self.p_sample_req_ids = _as_int64_ptr(self.sample_req_ids)
        self.p_sample_offsets = _as_int32_ptr(self.sample_offsets)
        self.row_width = <int32_t*>_zeroed(<size_t>(max_num_seqs) * sizeof(int32_t))
        if not self.row_width:
            raise MemoryError()

    def __dealloc__(self):
        free(self.row_width)

    def follow(self, int num_tokens, int num_rows, int num_decode_rows, int num_samples):
        """Take the extent of a plan another process wrote into these arrays (a tensor-parallel
        rank receiving rank 0's step): the arrays already hold it, the counts come here."""
        self._check_extent(num_tokens, num_rows, num_decode_rows, num_samples)
        self.num_tokens = num_tokens
        self.num_rows = num_rows
        self.num_decode_rows = num_decode_rows
        self.num_samples = num_samples

    def take(self, int num_tokens, int num_rows, int num_decode_rows, int num_samples):
        """Take the extent of a step this process wrote into these arrays from Python (the draft
        model's sub-steps, rtp/engine/draft_model.py): what the previous step wrote past it is
        zeroed, as the scheduler's own steps clear it (whole block-table rows: numpy writes record
        no widths), then the counts, as follow() takes them."""
        self._check_extent(num_tokens, num_rows, num_decode_rows, num_samples)
        cdef int r
        for r in range(num_rows, self.num_rows):
            self.row_width[r] = self.width
        self._clear_tail(num_tokens, num_rows, num_samples)
        self.num_decode_rows = num_decode_rows

    cdef int _check_extent(self, int num_tokens, int num_rows, int num_decode_rows, int num_samples) except -1:
        if not (0 <= num_decode_rows <= num_rows <= self.max_num_seqs and 0 <= num_samples <= num_rows
                and num_rows <= num_tokens <= self.max_num_tokens):
            raise ValueError(f"a plan of {num_tokens} tokens, {num_rows} rows ({num_decode_rows} decode), "
                             f"{num_samples} samples does not fit this StepPlan")
        return 0

    cdef void _put_token(self, int t, int32_t token, int pos, const int32_t* blocks, int block_size) noexcept nogil:
        """Token t: its id at position pos of a sequence whose KV lies in blocks."""
        self.p_input_ids[t] = token
        self.p_positions[t] = pos
        self.p_slot_mapping[t] = <int64_t>blocks[pos // block_size] * block_size + pos % block_size

    cdef void _put_row(self, int row, const int32_t* blocks, int nb, int seq_len, int end) noexcept nogil:
        """Row `row`: attends over the first seq_len tokens in blocks[:nb]; its tokens end at token `end`."""
        cdef int32_t* bt_row = self.p_block_tables + <int64_t>row * self.width
        memcpy(bt_row, blocks, nb * sizeof(int32_t))
        if self.row_width[row] > nb:  # stale columns from a longer request
            memset(bt_row + nb, 0, (self.row_width[row] - nb) * sizeof(int32_t))
        self.row_width[row] = nb
        self.p_seq_lens[row] = seq_len
        self.p_qsl[row + 1] = end

    cdef void _put_sample(self, int k, int t, int slot, int64_t req_id, int offset) noexcept nogil:
        """Sampling row k: the logits of token t, for request req_id (in scheduler slot `slot`), its
        offset-th sample of the step (drafts verified: 1, 2, ...)."""
        self.p_logits_indices[k] = t
        self.p_sample_slots[k] = slot
        self.p_sample_req_ids[k] = req_id
        self.p_sample_offsets[k] = offset

    cdef void _clear_tail(self, int num_tokens, int num_rows, int num_samples) noexcept nogil:
        """Zero what the previous step wrote past this step's extent."""
        cdef int r
        if self.num_tokens > num_tokens:
            memset(self.p_input_ids + num_tokens, 0, (self.num_tokens - num_tokens) * sizeof(int32_t))
            memset(self.p_positions + num_tokens, 0, (self.num_tokens - num_tokens) * sizeof(int32_t))
            memset(self.p_slot_mapping + num_tokens, 0, (self.num_tokens - num_tokens) * sizeof(int64_t))
        for r in range(num_rows, self.num_rows):
            if self.row_width[r]:
                memset(self.p_block_tables + <int64_t>r * self.width, 0, self.row_width[r] * sizeof(int32_t))
                self.row_width[r] = 0
            self.p_seq_lens[r] = 0
            self.p_qsl[r + 1] = 0
        if self.num_samples > num_samples:
            r = self.num_samples - num_samples
            memset(self.p_logits_indices + num_samples, 0, r * sizeof(int32_t))
            memset(self.p_sample_slots + num_samples, 0, r * sizeof(int32_t))
            memset(self.p_sample_req_ids + num_samples, 0, r * sizeof(int64_t))
            memset(self.p_sample_offsets + num_samples, 0, r * sizeof(int32_t))
        self.num_tokens = num_tokens
        self.num_rows = num_rows
        self.num_samples = num_samples

    @property
    def query_lens(self):
        qsl = self.query_start_loc
        return np.diff(qsl[: self.num_rows + 1])
