# cython: language_level=3
"""The StepPlan's C surface: the scheduler writes a step through these pointers."""

from libc.stdint cimport int32_t, int64_t


cdef class StepPlan:
    cdef readonly object input_ids, positions, slot_mapping, block_tables, seq_lens
    cdef readonly object query_start_loc, logits_indices, sample_slots, sample_req_ids, sample_offsets
    cdef readonly int max_num_tokens, max_num_seqs, width
    cdef readonly int num_tokens, num_rows, num_decode_rows, num_samples
    cdef int32_t* p_input_ids
    cdef int32_t* p_positions
    cdef int64_t* p_slot_mapping
    cdef int32_t* p_block_tables
    cdef int32_t* p_seq_lens
    cdef int32_t* p_qsl
    cdef int32_t* p_logits_indices
    cdef int32_t* p_sample_slots
    cdef int64_t* p_sample_req_ids
    cdef int32_t* p_sample_offsets
    cdef int32_t* row_width          # columns written in each row last time (to clear stale ones)

    cdef void _put_token(self, int t, int32_t token, int pos, const int32_t* blocks, int block_size) noexcept nogil
    cdef void _put_row(self, int row, const int32_t* blocks, int nb, int seq_len, int end) noexcept nogil
    cdef void _put_sample(self, int k, int t, int slot, int64_t req_id, int offset) noexcept nogil
    cdef void _clear_tail(self, int num_tokens, int num_rows, int num_samples) noexcept nogil
    cdef int _check_extent(self, int num_tokens, int num_rows, int num_decode_rows, int num_samples) except -1
