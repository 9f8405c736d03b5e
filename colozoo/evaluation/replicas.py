"""Evaluation requests dealt over the data-parallel replicas of the mesh, and their answers gathered back.

    answers = on_replicas(model, requests, length=len, score=lambda share: [...])   # every rank: every answer

The harness sees one process (rank 0 of a world of 1), so it hands every rank every request; each replica (the tp x pp
ranks of one dp coordinate, which score a batch together) scores a share of them: the requests sorted longest first
and dealt round-robin, so the replicas get similar work. Every rank of a replica gets the same share; one
`all_gather_object` over the replicas' group puts the answers back in the requests' order on every rank, also where a
replica's share is empty. On one replica, or where a forward is collective over the replicas (a model sharded over dp
by FSDP, as during fine-tuning: each replica must run every forward), every replica scores every request.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch.distributed as dist


def replica_group(model):
    """(the process group over the replicas, their count, this rank's replica): the "edp" group, which is the dp
    group at ep=1 (with ep > 1 the ep ranks of a group exchange tokens inside each forward: they form one replica).
    (None, 1, 0) where the replicas cannot score apart."""
    parallel = model.parallel
    if parallel.size("edp") == 1 or sharded_over_replicas(model):
        return None, 1, 0
    return parallel.group("edp"), parallel.size("edp"), parallel.rank("edp")


def sharded_over_replicas(model) -> bool:
    """Whether FSDP shards the model over the dp ranks: its forward gathers the parameters from every replica."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(module, FSDPModule) for module in model.modules())


def deal(lengths: Sequence[int], replicas: int) -> list[list[int]]:
    """The indices of `lengths` each replica gets: longest first, round-robin (ties in the original order)."""
    shares = [[] for _ in range(replicas)]
    for turn, index in enumerate(sorted(range(len(lengths)), key=lambda i: -lengths[i])):
        shares[turn % replicas].append(index)
    return shares


def on_replicas(model, requests: Sequence, length: Callable[[object], int], score: Callable[[list], list],
                together: Callable[[object], Hashable] | None = None) -> tuple[list, list[int]]:
    """(the answers to every request, in their order, on every rank; each replica's `extra`). `score(share)` returns
    (its answers to the share, in the share's order, extra); `length(request)` orders the dealing; the requests of
    one `together(request)` key go to one replica (one unit, as long as its longest). Collective over the replicas:
    every rank of the mesh calls it alike."""
    group, replicas, me = replica_group(model)
    if replicas == 1:
        answers, extra = score(list(requests))
        return answers, [extra]
    units = _units(requests, together)
    shares = deal([max(length(requests[i]) for i in unit) for unit in units], replicas)
    mine = [i for unit in shares[me] for i in units[unit]]
    answers, extra = score([requests[i] for i in mine])
    gathered = [None] * replicas
    dist.all_gather_object(gathered, (mine, answers, extra), group=group)
    ordered = [None] * len(requests)
    for indices, theirs, _ in gathered:
        for i, answer in zip(indices, theirs, strict=True):
            ordered[i] = answer
    return ordered, [theirs_extra for _, _, theirs_extra in gathered]


def _units(requests: Sequence, together) -> list[list[int]]:
    if together is None:
        return [[i] for i in range(len(requests))]
    units: dict[Hashable, list[int]] = {}
    for i, request in enumerate(requests):
        units.setdefault(together(request), []).append(i)
    return list(units.values())
