"""Which layers live on which pipeline stage.

Layers are split into contiguous runs, one per (virtual) stage, minimising the heaviest stage. A layer's
weight is its parameter count by default; the first stage also carries the embeddings and the last the
head, so they get fewer layers when those are large. `layers_per_stage` overrides the balance. What a layer, the
embeddings and the head of a model weigh is the models' business (colozoo.models.partition): this module knows
only weights and counts.
"""
from __future__ import annotations

from functools import lru_cache


class PartitionError(ValueError):
    pass


def balanced_partition(weights: list[float], parts: int, first_extra: float = 0.0, last_extra: float = 0.0) -> list[int]:
    """Sizes of `parts` contiguous runs (each >= 1) of `weights` minimising the maximum run weight, and among
    those the sum of squared run weights (so stages below the maximum are balanced too)."""
    n = len(weights)
    if parts > n:
        raise PartitionError(f"cannot split {n} layers over {parts} stages: every stage needs at least one layer")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    @lru_cache(maxsize=None)
    def best(start: int, k: int) -> tuple[float, float, tuple[int, ...]]:
        # split weights[start:] into k runs; stage index is parts - k
        stage = parts - k
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == parts - 1 else 0.0)
        if k == 1:
            cost = prefix[n] - prefix[start] + extra
            return cost, cost * cost, (n - start,)
        result = (float("inf"), float("inf"), ())
        for end in range(start + 1, n - k + 2):
            head = prefix[end] - prefix[start] + extra
            if head > result[0]:
                break
            tail_max, tail_squares, tail = best(end, k - 1)
            candidate = (max(head, tail_max), head * head + tail_squares, (end - start, *tail))
            if candidate[:2] < result[:2]:
                result = candidate
        return result

    return list(best(0, parts)[2])


def stage_layers(num_layers: int, num_stages: int, layers_per_stage: list[int] | None = None,
                 layer_weights: list[float] | None = None, first_extra: float = 0.0, last_extra: float = 0.0) -> list[list[int]]:
    """Global layer indices of every stage."""
    if layers_per_stage is not None:
        if len(layers_per_stage) != num_stages or sum(layers_per_stage) != num_layers or min(layers_per_stage) < 1:
            raise PartitionError(f"layers_per_stage={layers_per_stage} must have {num_stages} entries >= 1 "
                                 f"adding up to {num_layers} layers")
        sizes = list(layers_per_stage)
    else:
        sizes = balanced_partition(layer_weights or [1.0] * num_layers, num_stages, first_extra, last_extra)
    out, start = [], 0
    for size in sizes:
        out.append(list(range(start, start + size)))
        start += size
    return out


def virtual_stage_layers(num_layers: int, pp: int, virtual_stages: int = 1, **balance) -> list[list[list[int]]]:
    """For every pp rank, the layer runs of its virtual stages. Virtual stage k of rank r is stage r + k*pp
    (the looped placement torch's interleaved schedules expect)."""
    if virtual_stages < 1:
        raise PartitionError(f"virtual_stages must be >= 1, got {virtual_stages}")
    stages = stage_layers(num_layers, pp * virtual_stages, **balance)
    return [[stages[rank + k * pp] for k in range(virtual_stages)] for rank in range(pp)]


def rank_layers(num_layers: int, pp: int, pp_rank: int, virtual_stages: int = 1, **balance) -> list[int]:
    """Global layer indices one pp rank holds (all its virtual stages), for `build_model(layer_ids=...)`."""
    return [i for run in virtual_stage_layers(num_layers, pp, virtual_stages, **balance)[pp_rank] for i in run]
