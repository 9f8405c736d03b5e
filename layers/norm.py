"""LayerNorm and RMSNorm that work inside a sequence-parallel region.

The weights are replicated over tp, but under sequence parallelism each rank normalises only its share
of the sequence, so its weight gradient is partial: `copy_to_parallel` (identity forward, all-reduce
backward) sums it over the tensor-parallel group.
"""
from __future__ import annotations

import torch
from torch import nn

from colozoo.kernels.norms import layer_norm, rms_norm, rms_norm_linear

from .comm import copy_to_parallel, group_size, reduce_from_parallel, sum_replica_grads
from .matmul import linear
from .shard import Split, local_pieces, shard


class _SequenceParallelAware(nn.Module):
    def _param(self, p):
        if p is None or not self.sequence_parallel:
            return p
        return copy_to_parallel(p, self.group)


class LayerNorm(_SequenceParallelAware):
    def __init__(self, dim: int, eps: float = 1e-5, *, elementwise_affine: bool = True, bias: bool = True,
                 group=None, sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        self.dim, self.eps, self.group, self.sequence_parallel = dim, eps, group, sequence_parallel
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype)) if elementwise_affine and bias else None

    def forward(self, x, residual=None):
        """Normalise x; given `residual`, normalise x + residual and return (normed, x + residual)."""
        return layer_norm(x, self._param(self.weight), self._param(self.bias), self.eps, residual)

    def extra_repr(self):
        return f"{self.dim}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"


class RMSNorm(_SequenceParallelAware):
    """y = x / rms(x) * weight, computed in fp32 like the LLaMA reference, cast back to the input dtype.

    `offset=True` (Gemma): y = x / rms(x) * (1 + weight), the product taken in fp32 before the cast; the stored
    weight is then zero-centred, as in the checkpoints."""

    def __init__(self, dim: int, eps: float = 1e-6, *, offset: bool = False, group=None,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        self.dim, self.eps, self.offset = dim, eps, offset
        self.group, self.sequence_parallel = group, sequence_parallel
        init = torch.zeros if offset else torch.ones
        self.weight = nn.Parameter(init(dim, device=device, dtype=dtype))

    def forward(self, x, residual=None):
        """Normalise x; given `residual`, normalise x + residual and return (normed, x + residual)."""
        return rms_norm(x, self._param(self.weight), self.eps, residual, offset=self.offset)

    def then_linear(self, x, weight, bias=None, residual=None):
        """F.linear(self(x), weight, bias) (given `residual`: of x + residual, returning (that, x + residual)), for
        the projection after this norm on one rank: fused while training on the Triton path, where only x and the
        fp32 statistic are kept (kernels.norms.rms_norm_linear). This module's forward hooks do not run: callers
        leave hooked norms to their own forward."""
        return rms_norm_linear(x, self._param(self.weight), self.eps, weight, bias, residual, offset=self.offset,
                               linear=linear)

    def extra_repr(self):
        offset = ", offset" if self.offset else ""
        return f"{self.dim}, eps={self.eps}{offset}, sequence_parallel={self.sequence_parallel}"


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole projection, every head at once (OLMo 2's q and k norms), for heads split over tp: input
    (batch, local heads, seq, head_dim). Each rank holds its heads' share of the weight; the sum of squares of a token
    is summed over the group (in backward too: every rank's share of the statistic feeds every rank's output).
    When tp exceeds `heads` each head is held by tp / heads consecutive ranks (`replica_group`), whose sums count it
    once and whose partial weight gradients are summed. y = (weight * x / rms(x)) in fp32, cast back to x's dtype."""

    def __init__(self, heads: int, head_dim: int, eps: float = 1e-6, *, group=None, replica_group=None, device=None,
                 dtype=None):
        super().__init__()
        tp = group_size(group)
        self.width, self.head_dim, self.eps, self.group = heads * head_dim, head_dim, eps, group
        self.replicas, self.replica_group = max(tp // heads, 1), replica_group
        split = Split("tp", 0, chunks=(self.width,), parts=(heads,))
        local = local_pieces(split, self.width, 0, tp)[1]
        self.weight = shard(nn.Parameter(torch.ones(local, device=device, dtype=dtype)), split)
        self.replicated_rows = [(0, local)] if self.replicas > 1 else []

    def forward(self, x):
        dtype, x = x.dtype, x.float()
        squares = x.pow(2).sum(dim=(1, 3), keepdim=True)
        if group_size(self.group) > 1:
            squares = reduce_from_parallel(copy_to_parallel(squares, self.group), self.group) / self.replicas
        x = x * torch.rsqrt(squares / self.width + self.eps)
        weight = sum_replica_grads(self.weight, self.replicated_rows, self.replica_group)
        return (weight.view(-1, 1, self.head_dim) * x).to(dtype)

    def extra_repr(self):
        return f"{self.width} (local {self.weight.shape[0]}), eps={self.eps}"
