"""Building blocks with their tensor-parallel shard dimension declared.

Each parallel layer owns a slice of the full weight along `shard_dim` (0 for
column-parallel: output features; 1 for row-parallel: input features; 0 of the
vocabulary for embeddings) and a `weight_loader(param, full_tensor, shard_id)`
that copies its slice of a checkpoint tensor into place. Fused layers (qkv,
gate_up) take their parts by shard_id, so the loader maps names and nothing else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rtp.distributed import all_gather, all_reduce, tp_rank, tp_size
from rtp.kernels import cpu_kernels, packed
from rtp.kernels.quant import BlockQuantized


def _shard(full: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's slice of full along dim."""
    size = full.shape[dim] // tp_size()
    return full.narrow(dim, tp_rank() * size, size)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} does not fit {tuple(dst.shape)}")
    dst.copy_(src)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """For replicated parameters without a loader of their own (norm weights)."""
    _copy_checked(param.data, loaded, "replicated parameter")


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32; returns the input dtype (rows [T, H] on CPUs with rtp's kernels: one kernel)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.rms_norm_supported(x, self.weight):
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).to(x.dtype)

    def add_norm(self, residual: torch.Tensor, delta: torch.Tensor | None,
                 out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, norm(residual + delta) in out_dtype) for an fp32 residual stream;
        one fused pass on CPUs with rtp's kernels (the residual is then updated in place)."""
        if cpu_kernels.norm_supported(residual, self.weight):
            return residual, cpu_kernels.add_rms_norm(residual, delta, self.weight, self.eps, out_dtype)
        if delta is not None:
            residual = residual + delta.float()
        return residual, self(residual).to(out_dtype)


class LinearBase(nn.Module):
    """y = x W^T + b. With `quant` set (a GGUF checkpoint's packed blocks, on a CPU with
    rtp's kernels), decode batches multiply the packed weights (BlockQuantized.takes says which)."""

    shard_dim: int | None = None  # None: replicated
    shard_order: tuple = ()       # fused layers: checkpoint parts in row order

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader
        self.quant: BlockQuantized | None = None
        self.kernel_bias: torch.Tensor | None = None  # the bias in fp32, as the kernels add it (set by the loader)
        self.packed: torch.Tensor | None = None  # oneDNN-prepacked copy (rtp/kernels/packed.py)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if self.shard_dim is not None and tp_size() > 1 and not (param is self.bias and self.shard_dim == 1):
            loaded = _shard(loaded, self.shard_dim if param.dim() > 1 else 0)
        _copy_checked(param.data, loaded, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is not None and self.quant.takes(x.shape[0]):
            if bias is not None and bias is self.bias and self.kernel_bias is not None:
                bias = self.kernel_bias
            return self.quant.linear(x, bias, x.dtype)
        if self.packed is not None and not torch.compiler.is_compiling():
            return packed.linear(x, self.packed, bias)
        return F.linear(x, self.weight, bias)


class ReplicatedLinear(LinearBase):
    shard_dim = None


class ColumnParallelLinear(LinearBase):
    """Output features split across TP ranks; no communication."""

    shard_dim = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features // tp_size(), bias)


class RowParallelLinear(LinearBase):
    """Input features split across TP ranks; the partial outputs are summed (all-reduce)."""

    shard_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features // tp_size(), out_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return self._linear(x, self.bias)
        out = all_reduce(self._linear(x, None))  # the bias once, after the sum
        return out if self.bias is None else out + self.bias


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (gate_up)."""

    # set by an MLP whose SiLU-and-mul reads this [gate | up] output: the loader then lays the
    # packed blocks out for silu_mul() (BlockQuantized.tile_layout(glu=True))
    silu_mul_after = False

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False):
        self.out_sizes = [s // tp_size() for s in out_sizes]
        self.shard_order = tuple(range(len(out_sizes)))
        super().__init__(in_features, sum(out_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            raise ValueError("a merged projection loads its parts one by one")
        offset = sum(self.out_sizes[:shard_id])
        size = self.out_sizes[shard_id]
        if tp_size() > 1:
            loaded = _shard(loaded, 0)
        _copy_checked(param.data.narrow(0, offset, size), loaded, f"part {shard_id}")

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this projection in one kernel, when its packed blocks take this
        batch; None: run the projection and the activation apart."""
        if self.quant is not None and self.quant.takes_silu_mul(x.shape[0]):
            return self.quant.silu_mul(x, self.bias if self.kernel_bias is None else self.kernel_bias)
        return None


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; kv heads are replicated when there are fewer than ranks."""

    shard_order = ("q", "k", "v")

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool):
        tp = tp_size()
        if num_heads % tp or (num_kv_heads >= tp and num_kv_heads % tp) or (num_kv_heads < tp and tp % num_kv_heads):
            raise ValueError(f"{num_heads} attention heads and {num_kv_heads} kv heads do not split over {tp} "
                             f"tensor-parallel ranks")
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size()
        self.num_kv_heads = max(1, num_kv_heads // tp_size())
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.sizes = {"q": q, "k": kv, "v": kv}
        LinearBase.__init__(self, hidden, q + 2 * kv, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id not in self.sizes:
            raise ValueError(f"qkv part must be one of q, k, v, got {shard_id!r}")
        offset = {"q": 0, "k": self.sizes["q"], "v": self.sizes["q"] + self.sizes["k"]}[shard_id]
        size = self.sizes[shard_id]
        if tp_size() > 1:
            loaded = loaded.narrow(0, (tp_rank() * size) % loaded.shape[0], size)
        _copy_checked(param.data.narrow(0, offset, size), loaded, f"{shard_id}_proj")


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across TP ranks by vocabulary range."""

    shard_dim = 0

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        if vocab_size % tp_size():
            raise ValueError(f"a vocabulary of {vocab_size} does not split over {tp_size()} ranks")
        self.vocab_size = vocab_size
        self.per_rank = vocab_size // tp_size()
        self.weight = nn.Parameter(torch.empty(self.per_rank, dim))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if tp_size() > 1:
            loaded = _shard(loaded, 0)
        _copy_checked(param.data, loaded, "embedding")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(ids, self.weight)
        # each rank looks up the ids in its vocabulary range, zeros elsewhere; the sum is exact
        local = ids - tp_rank() * self.per_rank
        outside = (local < 0) | (local >= self.per_rank)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0))

    def embed_fp32(self, ids: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """The embeddings of ids in fp32, in a tensor of their own (the residual stream starts
        here and is updated in place). scale: the rows times it first, the product in the table's
        dtype (Gemma's sqrt(hidden_size), as transformers multiplies)."""
        if tp_size() == 1 and cpu_kernels.embed_supported(ids, self.weight):
            return cpu_kernels.embed_rows(ids, self.weight, 1.0 if scale is None else scale)
        embeds = self(ids)
        if scale is not None:
            return (embeds * scale).float()
        return embeds.float() if embeds.dtype != torch.float32 else embeds.clone()


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; shares the embedding's weight when the model ties them."""

    def __init__(self, vocab_size: int, dim: int):
        super().__init__(vocab_size, dim)
        self.quant: BlockQuantized | None = None
        self.packed: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the whole vocabulary (each rank computes its range, then gathers)."""
        return all_gather(self._logits(hidden), dim=-1)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quant is not None and self.quant.takes(hidden.shape[0]):
            return self.quant.linear(hidden, None, torch.float32)
        if self.packed is not None and not torch.compiler.is_compiling():
            return packed.linear(hidden.to(self.weight.dtype), self.packed, None).float()
        # bf16 matmul where the weights are bf16, logits returned in fp32 for sampling
        return F.linear(hidden.to(self.weight.dtype), self.weight).float()


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.silu_mul_supported(x):
            return cpu_kernels.silu_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """gelu(gate) * up of x = [gate | up] (GeGLU); approximate "tanh" (gelu_pytorch_tanh) or "none"."""

    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.approximate == "tanh" and cpu_kernels.gelu_tanh_mul_supported(x):
            return cpu_kernels.gelu_tanh_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up
