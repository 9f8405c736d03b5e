"""Sizes and ranks of process groups (None or a group of one: a single process), the plain all-reduce and
all-gather, and the slice of a vocabulary each rank of a group holds. Every layer of the system uses these."""
from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


# torch >= 2.13 renames the single-tensor collectives; older releases only have the old names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The ranks' `x` joined along `dim`. The collective writes them one after another (rank-major); joining along a
    later dim is then one copy into a contiguous result (none along dim 0, or when the dims before `dim` are ones)."""
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x, group=group)
    return out.view(size, *x.shape).movedim(0, dim).flatten(dim, dim + 1)


def vocab_range(vocab_size: int, group) -> tuple[int, int, int]:
    """(start, stop, local_size) of this rank's vocab slice, padded to a multiple of the group size; stop
    excludes padding."""
    tp = group_size(group)
    per = -(-vocab_size // tp)
    start = group_rank(group) * per
    return start, max(start, min(start + per, vocab_size)), per  # stop >= start: a rank may hold only padding
