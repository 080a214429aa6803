"""Process groups for tensor and expert parallelism (below models and engine).

Until the parallelism work lands, rtp runs one rank: these helpers answer for a
single process, and the parallel layers in rtp/models/layers.py already shard
their weights by them, so tp > 1 only has to set the group here.
"""

from __future__ import annotations

_TP_RANK = 0
_TP_SIZE = 1


def tp_rank() -> int:
    return _TP_RANK


def tp_size() -> int:
    return _TP_SIZE
