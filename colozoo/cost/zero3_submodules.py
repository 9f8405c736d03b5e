"""ZeRO-3 gathers at the granularity DeepSpeed runs them: each submodule (a linear layer, the attention core between
them) fetches its own parameters as it runs (DeepSpeed's PartitionedParameterCoordinator.fetch_sub_module), and
prefetches what the next submodules need up to `stage3_prefetch_bucket_size` elements (5e7 by default in the
DeepSpeed of 2021, deepspeed/runtime/zero/constants.py): less than any one weight of a large transformer, so the
next submodule's weight and no more. A submodule's gather then hides behind the one before it only: the MLP's
4h x h weight behind the attention output projection's h x h, the query/key/value weight behind the MLP's
down projection; layer-wide sums (FSDP's unit, colozoo.cost.step_time) balance what submodules do not.

With activation recomputation DeepSpeed frees each weight after the recomputed forward too and gathers it again for
its backward; every submodule's gradients are reduce-scattered as its backward ends, behind the next one's.
"""
from __future__ import annotations

from colozoo.cost.compute_time import kernel_seconds


def submodules(kernels: dict, hw, attention: str = "flash2") -> list[tuple[float, float]]:
    """(forward seconds, share of the unit's weights) of each submodule of a traced unit in the order it runs:
    one per linear (its forward GEMM, weight n x k), the attention core's kernels between them as one submodule
    without weights; the other memory-bound kernels (norms, activations) spread over the linears by their time."""
    subs, rest = [], 0.0
    for key, (n, flops, nbytes) in kernels.items():
        phase, kind, core, shape, _ = key.split("|")
        if phase != "fwd":
            continue
        seconds = kernel_seconds(key, n, flops, nbytes, hw, attention)
        if core:
            if subs and subs[-1][1] == 0:
                subs[-1] = (subs[-1][0] + seconds, 0)
            else:
                subs.append((seconds, 0))
        elif kind == "gemm":
            subs.append((seconds, _weight_elements(shape)))
        else:
            rest += seconds
    weights = sum(w for _, w in subs)
    if not weights:  # no linear (an embedding): the unit is one submodule
        return [(sum(s for s, _ in subs) + rest, 1.0)]
    linear = sum(s for s, w in subs if w) or 1.0
    return [(s + rest * s / linear if w else s, w / weights) for s, w in subs]


def held_share(kernels: dict) -> float:
    """The largest share of a unit's weights gathered at once: a submodule's and the next one's, prefetched while
    it computes (1 for a unit without linears)."""
    sizes = [_weight_elements(key.split("|")[3]) for key in kernels if key.startswith("fwd|gemm||")]
    if not sizes:
        return 1.0
    pairs = [a + b for a, b in zip(sizes, sizes[1:])] or sizes
    return max(pairs) / sum(sizes)


def _weight_elements(shape: str) -> int:
    """Elements of the weight of a forward GEMM of kernel shape "batch x m x n x k" (batch x n x k)."""
    batch, _, out, inner = (int(d) for d in shape.split("x"))
    return batch * out * inner


def submodule_ops(units: list, reduce: bool) -> tuple[list[tuple[float, float]], float]:
    """(compute, traffic) of every submodule step of one micro-batch, and the seconds of buffer fills among the
    compute. The steps in order: the forwards, then each unit's
    recomputed forward and its backward in reverse. `units`: (submodules, forward seconds, backward seconds
    without recomputation, gather(share), reduce-scatter(share), fill(share), recomputed, gathers in backward) of
    each unit in forward order, the three functions giving seconds for a share of the unit's weights; `fill`: what
    the compute stream spends preparing a gather's buffer (the DeepSpeed of 2021 allocates it with torch.zeros,
    a write of the whole weight, in deepspeed/runtime/zero/partition_parameters.py's _allgather_param)."""
    fwd = [(f * s + _weighted(fill, w), _weighted(gather, w)) for subs, f, _, gather, _, fill, _, _ in units
           for s, w in _scaled(subs)]
    bwd = []
    pending = 0.0  # the reduce-scatter of the submodule whose backward ran last
    for subs, f, b, gather, reduce_scatter, fill, recomputed, again in reversed(units):
        regathered = int(recomputed and again > 0)
        if recomputed:
            bwd += [(f * s + regathered * _weighted(fill, w), regathered * _weighted(gather, w))
                    for s, w in _scaled(subs)]
        for s, w in reversed(_scaled(subs)):
            gathers = again - regathered
            bwd.append((b * s + gathers * _weighted(fill, w), gathers * _weighted(gather, w) + pending))
            pending = _weighted(reduce_scatter, w) if reduce else 0.0
    if reduce:  # the last reduce-scatter runs behind the next micro-batch's first forward
        fwd[0] = (fwd[0][0], fwd[0][1] + pending)
    kernels = sum(f + (f if recomputed else 0.0) + b for _, f, b, _, _, _, recomputed, _ in units)
    return fwd + bwd, sum(c for c, _ in fwd + bwd) - kernels


def _weighted(collective, share: float) -> float:
    """A collective's seconds for a share of a unit's weights; none for a submodule without weights."""
    return collective(share) if share else 0.0


def _scaled(subs: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Submodules with their forward seconds as shares of the unit's."""
    total = sum(s for s, _ in subs) or 1.0
    return [(s / total, w) for s, w in subs]
