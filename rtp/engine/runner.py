"""The model runner: static step buffers, the KV cache, and one forward per step.

Every tensor a step reads is allocated once here. The runtime's StepPlan writes
straight into their numpy views (on CPU the same memory; on CUDA a pinned
staging copy that is sent with non-blocking copies), so building a step costs
no allocation and no host sync.
"""

from __future__ import annotations

import numpy as np
import torch

from rtp._runtime import StepPlan
from rtp.models.attention import AttentionMetadata, PrefillRow, forward_context

_PLAN_ARRAYS = {
    "input_ids": torch.int32,
    "positions": torch.int32,
    "slot_mapping": torch.int64,
    "block_tables": torch.int32,
    "seq_lens": torch.int32,
    "query_start_loc": torch.int32,
    "logits_indices": torch.int32,
    "sample_slots": torch.int32,
    "sample_req_ids": torch.int64,
}


class ModelRunner:
    def __init__(self, model: torch.nn.Module, *, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, kv_dtype: torch.dtype,
                 device: torch.device):
        self.model = model
        self.device = device
        self.block_size = block_size
        width = -(-max_model_len // block_size)
        shapes = {
            "input_ids": (max_num_batched_tokens,),
            "positions": (max_num_batched_tokens,),
            "slot_mapping": (max_num_batched_tokens,),
            "block_tables": (max_num_seqs, width),
            "seq_lens": (max_num_seqs,),
            "query_start_loc": (max_num_seqs + 1,),
            "logits_indices": (max_num_seqs,),
            "sample_slots": (max_num_seqs,),
            "sample_req_ids": (max_num_seqs,),
        }
        pin = device.type == "cuda"
        self.host = {name: torch.zeros(shape, dtype=_PLAN_ARRAYS[name], pin_memory=pin)
                     for name, shape in shapes.items()}
        self.plan = StepPlan(max_num_batched_tokens, max_num_seqs, width,
                             **{name: t.numpy() for name, t in self.host.items()})
        # on CPU the device tensors are the host tensors; on CUDA they are copies made each step
        self.dev = self.host if device.type == "cpu" else {
            name: torch.zeros_like(t, device=device) for name, t in self.host.items()}
        layers = model.attention_layers()
        cfg = model.config
        kv_heads = layers[0].num_kv_heads
        self.kv_caches = [torch.zeros(2, num_blocks, block_size, kv_heads, cfg.head_dim, dtype=kv_dtype,
                                      device=device) for _ in layers]
        for layer, cache in zip(layers, self.kv_caches):
            layer.kv_cache = cache

    def _to_device(self, name: str, n: int | tuple[int, int]) -> torch.Tensor:
        host = self.host[name]
        part = host[:n] if isinstance(n, int) else host[: n[0], : n[1]]
        if self.dev is self.host:
            return part
        dev = self.dev[name]
        dpart = dev[:n] if isinstance(n, int) else dev[: n[0], : n[1]]
        dpart.copy_(part, non_blocking=True)
        return dpart

    def metadata(self) -> AttentionMetadata:
        """The attention metadata of the step the plan describes (host-side numpy reads only)."""
        p = self.plan
        bs = self.block_size
        nd, nr = p.num_decode_rows, p.num_rows
        seq_lens = p.seq_lens
        qsl = p.query_start_loc
        meta = AttentionMetadata(slot_mapping=self._to_device("slot_mapping", p.num_tokens),
                                 block_size=bs, num_decode=nd)
        if nd:
            width = -(-int(seq_lens[:nd].max()) // bs)
            meta.decode_block_tables = self._to_device("block_tables", (nd, width))
            meta.decode_seq_lens = self._to_device("seq_lens", nd)
        if nr > nd:
            tables = self._to_device("block_tables", (nr, p.width))
            for r in range(nd, nr):
                length = int(seq_lens[r])
                meta.prefill.append(PrefillRow(int(qsl[r]), int(qsl[r + 1]), length,
                                               tables[r, : -(-length // bs)]))
        return meta

    @torch.inference_mode()
    def forward(self) -> torch.Tensor:
        """Run the planned step; logits [num_samples, vocab] in fp32 for the sampling rows."""
        p = self.plan
        n = p.num_tokens
        meta = self.metadata()
        input_ids = self._to_device("input_ids", n)
        positions = self._to_device("positions", n)
        with forward_context(meta):
            hidden = self.model(input_ids, positions)
        rows = self._to_device("logits_indices", p.num_samples)
        return self.model.compute_logits(hidden[rows])

    def sample_req_ids(self) -> np.ndarray:
        return self.plan.sample_req_ids[: self.plan.num_samples]
