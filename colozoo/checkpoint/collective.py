"""Collective steps of a save: every rank runs a step, and a failure anywhere is raised on every rank."""
from __future__ import annotations

import torch.distributed as dist

from colozoo.core.errors import CheckpointError


def world():
    initialized = dist.is_available() and dist.is_initialized()
    return (dist.get_rank(), dist.get_world_size()) if initialized else (0, 1)


def collective(what: str, fn) -> list:
    """Run `fn` on every rank; if it fails anywhere, every rank raises (no rank is left waiting). Returns all results."""
    try:
        mine, error = (None, fn()), None
    except Exception as e:  # noqa: BLE001 - reported to every rank
        mine, error = (f"{type(e).__name__}: {e}", None), e
    _, size = world()
    gathered = [mine]
    if size > 1:
        gathered = [None] * size
        dist.all_gather_object(gathered, mine)
    if error is not None:
        raise error
    failed = [(rank, message) for rank, (message, _) in enumerate(gathered) if message]
    if failed:
        raise CheckpointError(f"{what} failed on rank {failed[0][0]}: {failed[0][1]}")
    return [result for _, result in gathered]
