"""Autograd communication mappings for tensor and sequence parallelism (Megatron's f/g operators).

Each op is a pair: what happens in forward and its adjoint in backward. All take the process group
explicitly; with a group of size 1 (or None) they are identities.

    copy_to_parallel       forward identity        backward all-reduce      (f)
    reduce_from_parallel   forward all-reduce      backward identity        (g)
    split_to_parallel      forward split           backward all-gather
    gather_from_parallel   forward all-gather      backward split
    scatter_to_sequence    forward split (seq)     backward all-gather (seq)
    gather_from_sequence   forward all-gather      backward reduce-scatter  (sequence parallel g-bar)
    reduce_scatter_to_sequence forward reduce-scatter backward all-gather  (sequence parallel g)
    sum_replica_grads      forward identity        backward all-reduce of some rows (replicated kv heads)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from colozoo.core.groups import all_gather, all_reduce, group_rank, group_size  # noqa: F401 (this module's surface)

# torch >= 2.13 renames the single-tensor collectives; older releases only have the old names
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _scatter_chunks(x: torch.Tensor, dim: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x's `size` chunks along `dim` one after another, as a reduce-scatter takes them; the empty output)."""
    if x.shape[dim] % size:
        raise ValueError(f"cannot reduce-scatter length {x.shape[dim]} over {size} ranks")
    chunks = x.unflatten(dim, (size, -1)).movedim(dim, 0).contiguous()  # a copy only when dim > 0
    return chunks.flatten(0, 1), x.new_empty(chunks.shape[1:])


def reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    chunks, out = _scatter_chunks(x, dim, size)
    _reduce_scatter_single(out, chunks, group=group)
    return out


def start_reduce(x: torch.Tensor, group, scatter_dim: int | None = None):
    """Start summing `x` over `group` without waiting for it: an all-reduce, or with `scatter_dim` a reduce-scatter
    along that dim. Returns a function that waits and returns the sum (this rank's chunk of it), so that work which
    does not need it runs meanwhile."""
    size = group_size(group)
    if size == 1:
        return lambda: x
    if scatter_dim is None:
        out = x.contiguous()
        work = dist.all_reduce(out, group=group, async_op=True)
    else:
        chunks, out = _scatter_chunks(x, scatter_dim, size)
        work = _reduce_scatter_single(out, chunks, group=group, async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        return out

    return finish


def split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ValueError(f"cannot split length {x.shape[dim]} over {size} ranks")
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()


class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, in_place):
        if not (in_place and x.is_contiguous()):  # the collective needs a contiguous tensor
            return all_reduce(x.clone(), group)
        ctx.mark_dirty(x)  # a backward that saved x now fails loudly instead of reading the sum
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def _mapping(name: str, forward_op, backward_op) -> type[torch.autograd.Function]:
    """An autograd op along a tensor dim: `forward_op(x, dim, group)` in forward, its adjoint in backward."""

    class AlongDim(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, dim, group):
            ctx.dim, ctx.group = dim, group
            return forward_op(x, dim, group)

        @staticmethod
        def backward(ctx, grad):
            return backward_op(grad, ctx.dim, ctx.group), None, None

    AlongDim.__name__ = AlongDim.__qualname__ = name
    return AlongDim


_Split = _mapping("_Split", split, all_gather)
_Gather = _mapping("_Gather", all_gather, split)
_GatherFromSequence = _mapping("_GatherFromSequence", all_gather, reduce_scatter)
_ReduceScatterToSequence = _mapping("_ReduceScatterToSequence", reduce_scatter, all_gather)


class _SumReplicaGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, rows, group):
        ctx.rows, ctx.group = rows, group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        for start, stop in ctx.rows:
            grad[start:stop] = all_reduce(grad[start:stop], ctx.group)
        return grad, None, None


def _active(group) -> bool:
    return group_size(group) > 1


def copy_to_parallel(x, group):
    return _CopyToParallel.apply(x, group) if _active(group) else x


def reduce_from_parallel(x, group, in_place: bool = False):
    """`in_place`: sum into x itself, a temporary of the caller's (a layer's partial output), saving a copy. Without
    gradients the plain all-reduce (torch.compile traces it into one graph: the Function's mark_dirty it cannot)."""
    if not _active(group):
        return x
    if not torch.is_grad_enabled():
        return all_reduce(x if in_place else x.clone(), group)
    return _ReduceFromParallel.apply(x, group, in_place)


def split_to_parallel(x, group, dim=-1):
    return _Split.apply(x, dim % x.dim(), group) if _active(group) else x


def gather_from_parallel(x, group, dim=-1):
    return _Gather.apply(x, dim % x.dim(), group) if _active(group) else x


SEQ_DIM = 1  # activations are (batch, sequence, hidden)


def scatter_to_sequence(x, group, dim=SEQ_DIM):
    return _Split.apply(x, dim, group) if _active(group) else x


def gather_from_sequence(x, group, dim=SEQ_DIM):
    return _GatherFromSequence.apply(x, dim, group) if _active(group) else x


def reduce_scatter_to_sequence(x, group, dim=SEQ_DIM):
    return _ReduceScatterToSequence.apply(x, dim, group) if _active(group) else x


def sum_replica_grads(weight, rows, group):
    """`weight` as it is; in backward, its gradient's rows [start, stop) for each of `rows` are summed over `group`:
    the ranks holding a replicated piece (one kv head) each compute a partial gradient from their own query heads."""
    return _SumReplicaGrads.apply(weight, tuple(rows), group) if rows and _active(group) else weight
