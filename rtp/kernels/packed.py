"""bf16 linear weights prepacked in oneDNN's blocked layout, for the CPU.

`F.linear` on a plain [out, in] bf16 weight makes oneDNN reorder the weight into
its AMX/AVX-512 tile layout on every call: a full extra pass over the weights
per matmul. Reordering once at load time and calling oneDNN's linear on the
packed copy (the same ops Inductor uses when it freezes a graph) saves that
pass on every call.

The packed tensor is opaque (an MKLDNN layout), so it lives beside the plain
weight rather than replacing it: the plain weight stays for torch.compile'd
graphs (Dynamo cannot trace an opaque tensor; Inductor packs on its own when it
freezes) and for anything that reads the weight itself (a tied embedding).
"""

from __future__ import annotations

import os

import torch

# The batch size oneDNN tunes the layout for; any number of rows works with it.
ROWS_HINT = 64


def _probe() -> bool:
    if os.environ.get("RTP_PACKED_WEIGHTS", "1") == "0":
        return False
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise") and torch.ops.mkldnn._is_mkldnn_bf16_supported())


_AVAILABLE = _probe()


def supported(weight: torch.Tensor) -> bool:
    """Whether `weight` ([out, in]) can be packed: bf16 on a CPU whose oneDNN computes bf16."""
    return _AVAILABLE and weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ROWS_HINT)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] bf16 -> [T, out] bf16, x @ W^T + bias, W given packed."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
