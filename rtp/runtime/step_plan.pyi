"""Type stub for rtp.runtime.step_plan (see step_plan.pyx)."""

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int32]

# name -> (numpy dtype name, extent: "tokens", "seqs", "seqs + 1" or "seqs x width")
PLAN_ARRAYS: dict[str, tuple[str, str]]

def plan_array_shapes(max_num_tokens: int, max_num_seqs: int,
                      width: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]: ...


class StepPlan:
    """Preallocated per-step buffers, as PLAN_ARRAYS declares them."""
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
    sample_offsets: IntArray   # 0, or j for the row verifying a request's j-th drafted token
    def __init__(self, max_num_tokens: int, max_num_seqs: int, width: int,
                 **arrays: np.ndarray) -> None: ...
    @property
    def query_lens(self) -> IntArray: ...
    def follow(self, num_tokens: int, num_rows: int, num_decode_rows: int, num_samples: int) -> None: ...
    def take(self, num_tokens: int, num_rows: int, num_decode_rows: int, num_samples: int) -> None: ...
