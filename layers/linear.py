"""Column- and row-parallel linear layers (Megatron-style), with optional sequence parallelism.

Column-parallel: weight (out/tp, in), each rank computes a slice of the output features; fused outputs
(q/k/v, gate/up) are declared as chunks so each rank gets its share of every part. A chunk with fewer `parts`
(kv heads) than ranks is replicated over `replica_group` (tp / parts consecutive ranks), whose partial weight
gradients are summed in backward.
Row-parallel: weight (out, in/tp), each rank holds a slice of the input features and the partial outputs
are summed (all-reduce, or reduce-scatter along the sequence under sequence parallelism).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from colozoo.kernels.activations import GELU_APPROXIMATION, linear_gelu, swiglu, swiglu_linear
from colozoo.kernels.fused_functions import linear_of_its_own
from colozoo.kernels.priced import pricing

from .activations import get_activation
from .comm import (SEQ_DIM, all_gather, copy_to_parallel, gather_from_parallel, gather_from_sequence, group_rank,
                   group_size, reduce_from_parallel, reduce_scatter_to_sequence, start_reduce, sum_replica_grads)
from .matmul import linear
from .shard import Split, local_pieces, replicated_pieces, shard


def _init_linear(weight: nn.Parameter, bias: nn.Parameter | None, fan_in: int):
    if weight.device.type == "meta":
        return
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1 / math.sqrt(fan_in)
        nn.init.uniform_(bias, -bound, bound)


class _ColumnParallel(torch.autograd.Function):
    """linear(x, weight, bias) on x entering the tensor-parallel region: as it is (f: its gradient is summed over the
    group), or all-gathered along the sequence under sequence parallelism (its gradient reduce-scattered back).
    Backward starts that reduction of the input gradient and computes the weight gradient while it runs (Megatron's
    column-parallel backward); autograd would only start it once both gradients were done."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel):
        device = x.device.type
        # under autocast, cast here: backward's matmuls must see the dtypes forward's used
        if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            x, weight, bias = (t.to(dtype) if t is not None else None for t in (x, weight, bias))
        if sequence_parallel:
            x = all_gather(x, SEQ_DIM, group)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.sequence_parallel, ctx.bias = group, sequence_parallel, bias is not None
        return linear_of_its_own(x, weight, bias)  # not a view: the rotary may turn a qkv projection in place

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = start_reduce(grad.matmul(weight), ctx.group, SEQ_DIM if ctx.sequence_parallel else None)
        grad = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_weight = grad.t().matmul(x.reshape(-1, x.shape[-1]))
        if ctx.bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_x() if grad_x is not None else None, grad_weight, grad_bias, None, None


def _watched(module: nn.Module) -> bool:
    """Whether forward hooks watch `module` (its own or global ones): they see its output, so it runs on its own.
    While the profiler prices the fusions (kernels.priced), its own global hooks (which track modules) do not count."""
    hooks = torch.nn.modules.module
    if module._forward_hooks or module._forward_pre_hooks:
        return True
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks) and not pricing()


def enter_parallel(x, group, sequence_parallel: bool):
    """x entering the tensor-parallel region: copied (its gradient summed), or gathered along the sequence."""
    return gather_from_sequence(x, group) if sequence_parallel else copy_to_parallel(x, group)


def column_parallel_linear(x, weight, bias, group, sequence_parallel: bool = False) -> torch.Tensor:
    """F.linear of x (replicated, or sequence-sharded under sequence parallelism) with a column-parallel weight.
    Under torch.compile the plain mappings: dynamo turns their collectives into functional ones it schedules itself
    (an async wait inside an autograd Function's backward would break the graph); without gradients (inference),
    layers.matmul.linear, which multiplies a decoding step's few rows faster on CPU."""
    if group_size(group) > 1 and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        return _ColumnParallel.apply(x, weight, bias, group, sequence_parallel)
    return linear(enter_parallel(x, group, sequence_parallel), weight, bias)


class ColumnParallelLinear(nn.Module):
    """`activation` (a config name) is applied to the local output; a GeLU takes the bias with it into one
    fused kernel on the Triton path (kernels.activations.linear_gelu)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 sequence_parallel: bool = False, gather_output: bool = False,
                 chunks: tuple[int, ...] | None = None, parts: tuple[int, ...] | None = None, replica_group=None,
                 activation: str | None = None, device=None, dtype=None):
        super().__init__()
        self.activation = activation
        self.act = get_activation(activation) if activation is not None else None
        self.group, self.sequence_parallel, self.gather_output = group, sequence_parallel, gather_output
        tp = group_size(group)
        split = Split("tp", 0, chunks=tuple(chunks) if chunks else None, parts=tuple(parts) if parts else None)
        local_out = local_pieces(split, out_features, 0, tp)[1]
        replicated = replicated_pieces((split,), {"tp": (group_rank(group), tp)})
        if replicated and {r for _, _, _, r, _ in replicated} != {group_size(replica_group)}:
            raise ValueError(f"fused parts {parts} over tp={tp} need a replica group of "
                             f"{sorted({r for _, _, _, r, _ in replicated})} ranks, got {group_size(replica_group)}")
        self.replica_group, self.replicated_rows = replica_group, []
        for _, l0, l1, _, _ in replicated:  # adjacent pieces (k, v) in one all-reduce
            if self.replicated_rows and self.replicated_rows[-1][1] == l0:
                l0 = self.replicated_rows.pop()[0]
            self.replicated_rows.append((l0, l1))
        self.in_features, self.out_features = in_features, out_features
        self.weight = shard(nn.Parameter(torch.empty(local_out, in_features, device=device, dtype=dtype)), split)
        self.bias = (shard(nn.Parameter(torch.empty(local_out, device=device, dtype=dtype)), split)
                     if bias else None)
        _init_linear(self.weight, self.bias, in_features)
        self.lora = None  # a layers.lora.LoRA adapter, once colozoo.runtime.lora.apply_lora attached one

    def forward(self, x: torch.Tensor, norm=None, residual=None):
        """`norm`: the norm before this projection (an RMSNorm), applied to x here, or to x + residual given one, which
        then returns (projection, x + residual). At tp 1, without an adapter and with no forward hook watching the
        norm, the two may fuse (RMSNorm.then_linear: nothing then keeps the normed tensor)."""
        if norm is not None:
            return self._normed_forward(x, norm, residual)
        if residual is not None:
            raise ValueError("ColumnParallelLinear: a residual is added only before the norm given with it (norm=)")
        weight = sum_replica_grads(self.weight, self.replicated_rows, self.replica_group)
        bias = sum_replica_grads(self.bias, self.replicated_rows, self.replica_group) if self.bias is not None else None
        if self.activation in GELU_APPROXIMATION and bias is not None:
            y = linear_gelu(self._linear, x, weight, bias, self.activation)
        else:
            y = self._linear(x, weight, bias)
            if self.act is not None:
                y = self.act(y)
        return gather_from_parallel(y, self.group) if self.gather_output else y

    def _normed_forward(self, x, norm, residual):
        plain = group_size(self.group) == 1 and self.lora is None and self.act is None and not self.gather_output
        if plain and hasattr(norm, "then_linear") and not _watched(norm):
            return norm.then_linear(x, self.weight, self.bias, residual)
        if residual is None:
            return self.forward(norm(x))  # forward, not __call__: this module's hooks ran once already
        normed, summed = norm(x, residual)
        return self.forward(normed), summed

    def _linear(self, x, weight, bias):
        if self.lora is None:
            return column_parallel_linear(x, weight, bias, self.group, self.sequence_parallel)
        # the adapter reads the same input: the input gradient is summed over both paths
        x = enter_parallel(x, self.group, self.sequence_parallel)
        return self.lora(x, linear(x, weight, bias))

    def extra_repr(self):
        act = f", activation={self.activation}" if self.activation else ""
        return (f"in={self.in_features}, out={self.out_features} (local {self.weight.shape[0]}), "
                f"bias={self.bias is not None}{act}")


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        tp = group_size(group)
        split = Split("tp", 1)
        local_in = local_pieces(split, in_features, 0, tp)[1]
        self.in_features, self.out_features = in_features, out_features
        self.weight = shard(nn.Parameter(torch.empty(out_features, local_in, device=device, dtype=dtype)), split)
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        _init_linear(self.weight, self.bias, in_features)
        self.lora = None  # a layers.lora.LoRA adapter, once colozoo.runtime.lora.apply_lora attached one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if group_size(self.group) == 1:  # nothing to reduce: the bias rides in the matmul (addmm)
            y = linear(x, self.weight, self.bias)
            return y if self.lora is None else self.lora(x, y)
        y = linear(x, self.weight)
        if self.lora is not None:  # the low-rank path's partial output joins the partial sum before the reduce
            y = self.lora(x, y)
        return self._reduce(y)

    def swiglu_forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up) for gate, up = gate_up.chunk(2, dim=-1): without an adapter the product and this
        projection fuse (kernels.activations.swiglu_linear: nothing then keeps the product)."""
        if self.lora is not None:
            return self(swiglu(*gate_up.chunk(2, dim=-1)))
        if group_size(self.group) == 1:
            return swiglu_linear(gate_up, self.weight, self.bias, linear=linear)
        return self._reduce(swiglu_linear(gate_up, self.weight, linear=linear))

    def _reduce(self, y):
        """The partial products of the ranks summed (or reduce-scattered along the sequence), plus the bias."""
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.group)
            bias = copy_to_parallel(self.bias, self.group) if self.bias is not None else None
        else:
            y = reduce_from_parallel(y, self.group, in_place=True)
            bias = self.bias
        return y + bias.to(y.dtype) if bias is not None else y  # under autocast y is low precision, the bias fp32

    def extra_repr(self):
        return f"in={self.in_features} (local {self.weight.shape[1]}), out={self.out_features}, bias={self.bias is not None}"


class ReplicatedLinear(nn.Module):
    """A linear layer whose weight every tp rank holds whole, applied to the tokens the rank holds: MLA's shared
    compressions (DeepSeek-V3's q_a_proj, kv_a_proj_with_mqa), which run before the heads split. Without sequence
    parallelism every rank computes the same output from the same tokens, and the caller enters the tensor-parallel
    region after it (so the gradients arriving here are already summed and equal on every rank). Under sequence
    parallelism each rank compresses only its share of the sequence: its weight gradient is partial, and
    `copy_to_parallel` sums it over tp in backward, as the sequence-parallel norms do."""

    replicated = True  # LoRA: the adapter is replicated too (layers.lora)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        _init_linear(self.weight, self.bias, in_features)
        self.lora = None  # a layers.lora.LoRA adapter, once colozoo.runtime.lora.apply_lora attached one

    def _param(self, p):
        return copy_to_parallel(p, self.group) if p is not None and self.sequence_parallel else p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self._param(self.weight), self._param(self.bias))
        return y if self.lora is None else self.lora(x, y)

    def extra_repr(self):
        return (f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, replicated, "
                f"sequence_parallel={self.sequence_parallel}")
