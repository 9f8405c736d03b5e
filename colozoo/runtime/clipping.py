"""Gradient clipping by the true global norm: every element of the full model's gradient counted once."""
from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist

from colozoo.core.mesh import coords_of
from colozoo.layers.shard import local_part, replicated_pieces
from colozoo.runtime.errors import TrainingError
from colozoo.runtime.parallelize import training_setup


@torch.no_grad()
def global_grad_norm(model, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the full model's gradient: every element counted once, whatever holds it (tp/ep shards,
    FSDP dp shards, pipeline stages; tp-replicated, dp-replicated and tied-copy gradients only once)."""
    setup = training_setup(model)
    parallel = model.parallel
    if norm_type not in (2.0, math.inf):
        raise TrainingError(f"norm_type must be 2 or inf, got {norm_type!r}")
    tied = setup.tied
    acc = torch.zeros((), dtype=torch.float32, device=parallel.device)
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if tied is not None and name == tied[0] and not model.is_first:
            continue  # the last stage's copy of the tied embedding
        dims = {split.mesh_dim for split in setup.specs[name]}
        if "tp" not in dims and parallel.rank("tp") != 0:
            continue
        replicated_over = "edp" if name in setup.experts else "dp_cp"
        if not setup.sharded and parallel.rank(replicated_over) != 0:
            continue
        # one read of the gradient, accumulated in fp32 without an fp32 copy of it (what the planner prices:
        # colozoo.cost.software.Software.grad_clip_passes)
        part = torch.linalg.vector_norm(_counted_here(p.grad, setup.specs[name], coords_of(parallel)), norm_type,
                                        dtype=torch.float32)
        acc = torch.maximum(acc, part) if norm_type == math.inf else acc + part.square()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(acc, op=dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM)
    return acc if norm_type == math.inf else acc.sqrt()


def _counted_here(grad, spec, coords) -> torch.Tensor:
    """This rank's local gradient without the replicated pieces (kv heads over tp > kv heads) that another rank of
    their replica group counts."""
    skip = [(dim, l0, l1) for dim, l0, l1, _, primary in replicated_pieces(spec, coords) if not primary]
    if not skip:
        return local_part(grad)
    keep = torch.ones(grad.shape, dtype=torch.bool, device=local_part(grad).device)
    for dim, l0, l1 in skip:
        keep.narrow(dim, l0, l1 - l0).fill_(False)
    if hasattr(grad, "device_mesh"):  # FSDP2's shard over the data ranks: the rows of the mask that it holds
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(grad.shape, grad.device_mesh, grad.placements)
        keep = keep[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
    return local_part(grad)[keep]


@torch.no_grad()
def clip_grad_norm_(model, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale all local gradients so the global norm is at most max_norm (torch's rule); returns the norm before."""
    total = global_grad_norm(model, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_device = defaultdict(list)  # offloaded gradients live on the CPU
    for grad in (local_part(p.grad) for p in model.parameters() if p.grad is not None):
        by_device[grad.device].append(grad)
    for device, grads in by_device.items():
        torch._foreach_mul_(grads, coef.to(device))
    return total
