"""Sizes and ranks of process groups (None or a group of one: a single process), the plain all-reduce, and
the slice of a vocabulary each rank of a group holds. Every layer of the system uses these."""
from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


# gloo's all-reduce of a small tensor takes several rounds of messages, about 2-3x the latency of an all-gather of
# it (measured on one machine's loopback); up to this many gathered elements, all-gather and sum locally instead
SMALL_ALL_REDUCE = 1 << 18
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """The sum over `group`, in `x` (made contiguous) and returned. Small CPU tensors are all-gathered and summed in
    rank order: the same bits on every rank, and for two ranks the same as gloo's sum (a + b == b + a)."""
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    if x.device.type == "cpu" and x.numel() * size <= SMALL_ALL_REDUCE:
        gathered = x.new_empty(size * x.numel())
        _all_gather_single(gathered, x.view(-1), group=group)
        return x.copy_(gathered.view(size, *x.shape).sum(0))
    dist.all_reduce(x, group=group)
    return x


def vocab_range(vocab_size: int, group) -> tuple[int, int, int]:
    """(start, stop, local_size) of this rank's vocab slice, padded to a multiple of the group size; stop
    excludes padding."""
    tp = group_size(group)
    per = -(-vocab_size // tp)
    start = group_rank(group) * per
    return start, max(start, min(start + per, vocab_size)), per  # stop >= start: a rank may hold only padding
