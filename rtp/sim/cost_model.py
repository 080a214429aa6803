"""How long one engine step takes on a device, from what the step computes and reads.

A step costs a fixed overhead (launch, scheduling, sampling) plus two
rooflines, one after the other: the dense layers (the larger of their GEMM
time and the time to read the weights) and attention (the larger of its
FLOP time and the time to read the KV it attends to).

    dense     = max(2 * active_params * tokens / (peak FLOP/s * mfu), weight bytes / bandwidth')
    attention = max(attention FLOPs / (peak FLOP/s * mfu), KV bytes read / bandwidth')

(bandwidth' = bandwidth * its efficiency).

Attention FLOPs count 4 * layers * q_heads * head_dim per (query token, context
token) pair; KV bytes read are the context tokens of every row times the KV
bytes per token. Devices are either measured here (`DeviceProfile.measure`:
a bf16 matmul and a large copy, about a second) or taken from published
figures for H100/H200-class GPUs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    peak_flops: float          # bf16 dense FLOP/s
    mem_bw: float              # bytes/s
    step_overhead_s: float     # per engine step, whatever it computes
    mfu: float = 0.55          # share of peak FLOP/s a large GEMM reaches
    bw_eff: float = 0.80       # share of peak bandwidth a step's reads reach
    link_bw: float = 50e9      # bytes/s between a prefill and a decode worker
    link_latency_s: float = 50e-6

    @classmethod
    def measure(cls, name: str = "this-cpu", seconds: float = 1.0) -> DeviceProfile:
        """Calibrate on this machine: bf16 matmul FLOP/s and copy bandwidth, measured with torch."""
        import torch

        a = torch.randn(512, 2048, dtype=torch.bfloat16)
        b = torch.randn(2048, 2048, dtype=torch.bfloat16)
        torch.mm(a, b)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 2:
            torch.mm(a, b)
            n += 1
        flops = n * 2 * 512 * 2048 * 2048 / (time.perf_counter() - t0)
        src = torch.empty(64 << 20, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 2:
            dst.copy_(src)
            n += 1
        bw = n * 2 * src.numel() / (time.perf_counter() - t0)  # a copy reads and writes
        # the matmul and the copy above are the achieved figures already: efficiencies of 1;
        # loopback between two local servers moves about 1 GB/s (tools/bench_pd.py)
        return cls(name, peak_flops=flops, mem_bw=bw, step_overhead_s=1.5e-3, mfu=1.0, bw_eff=1.0,
                   link_bw=1e9, link_latency_s=200e-6)


# published dense bf16 FLOP/s and HBM bandwidth; steps captured as CUDA graphs
H100 = DeviceProfile("h100", peak_flops=989e12, mem_bw=3.35e12, step_overhead_s=0.4e-3)
H200 = DeviceProfile("h200", peak_flops=989e12, mem_bw=4.8e12, step_overhead_s=0.4e-3)
DEVICES = {"h100": H100, "h200": H200}


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float              # weights read per step (all of them for a dense model)
    active_params: float       # multiplied per token
    layers: int
    q_heads: int
    head_dim: int
    kv_bytes_per_token: int    # all layers, K and V
    weight_bytes_per_param: float = 2.0

    @classmethod
    def llama(cls, name: str, params: float, layers: int, q_heads: int, kv_heads: int, head_dim: int,
              dtype_bytes: int = 2) -> ModelShape:
        return cls(name, params, params, layers, q_heads, head_dim,
                   2 * layers * kv_heads * head_dim * dtype_bytes)


SMOLLM2_135M = ModelShape.llama("smollm2-135m", 135e6, 30, 9, 3, 64)
LLAMA3_8B = ModelShape.llama("llama3-8b", 8.0e9, 32, 32, 8, 128)
MODELS = {"smollm2-135m": SMOLLM2_135M, "llama3-8b": LLAMA3_8B}


class StepCost:
    """Step time of one worker running `model` on `device`."""

    def __init__(self, device: DeviceProfile, model: ModelShape):
        self.device, self.model = device, model
        self._flops = device.peak_flops * device.mfu
        self._bw = device.mem_bw * device.bw_eff
        self._weights = model.params * model.weight_bytes_per_param
        self._attn = 4.0 * model.layers * model.q_heads * model.head_dim

    def step(self, tokens: int, attended_pairs: float, context_tokens: float) -> float:
        """tokens computed, (query, key) pairs attended, KV tokens read.

        The dense layers (GEMMs over all tokens, reading the weights) and attention
        (reading each row's KV) are separate kernels that run one after the other,
        so each is its own roofline and their times add."""
        dense = max(2.0 * self.model.active_params * tokens / self._flops, self._weights / self._bw)
        attention = max(self._attn * attended_pairs / self._flops,
                        self.model.kv_bytes_per_token * context_tokens / self._bw)
        return self.device.step_overhead_s + dense + attention

    def plan_step(self, plan) -> float:
        """Cost of the step a Scheduler just wrote into `plan`."""
        rows = plan.num_rows
        seq = plan.seq_lens[:rows].astype(np.float64)
        context = float(seq.sum())
        if plan.num_tokens == rows:  # decodes only
            return self.step(rows, context, context)
        q = np.diff(plan.query_start_loc[:rows + 1]).astype(np.float64)
        # each query token attends to the cached prefix plus the chunk up to itself
        pairs = float((q * (seq - q) + q * (q + 1) / 2).sum())
        return self.step(plan.num_tokens, pairs, context)

    def prefill_time(self, tokens: int, cached: int = 0) -> float:
        """One prompt alone (for capacity estimates)."""
        n = tokens - cached
        return self.step(n, n * cached + n * (n + 1) / 2, tokens)

    def decode_step_time(self, batch: int, context: int) -> float:
        return self.step(batch, batch * context, batch * context)

    def transfer_tail(self, tokens: int) -> float:
        """KV hand-off time the decode side waits for after the prefill's last layer:
        the layers stream while later ones compute, so only one layer's share is left."""
        nbytes = self.model.kv_bytes_per_token * tokens
        return self.device.link_latency_s + nbytes / self.model.layers / self.device.link_bw
