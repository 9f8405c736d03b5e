"""Dynamic loss scaling for fp16 mixed precision, over the whole mesh (torch.amp.GradScaler's rule).

fp16 gradients below ~6e-8 flush to zero. The backward is therefore run on the loss times a scale S (a power of
two, so scaling and unscaling are exact); the gradients are divided by S before clipping and the optimizer step.
If any gradient on any rank is inf or nan, every rank skips the step and S halves; after `growth_interval`
good steps in a row S doubles.

    scaler = DynamicLossScaler()
    loss = model.forward_backward(ids, labels, grad_scale=scaler.scale)   # the returned loss is unscaled
    overflow = scaler.unscale_(model)           # collective: one all-reduce over the whole world
    if not overflow:
        clip_grad_norm_(model, 1.0); optimizer.step()
    scaler.update(overflow)

Each rank unscales and checks its own local gradients (FSDP2 DTensor shards, tp shards, pipeline stages,
replicas): overflow on one stage does not always reach the others (a later stage's gradients are computed
before an earlier stage's overflow), so the verdict is a MAX over every rank.
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from colozoo.layers.shard import local_part


class DynamicLossScaler:
    """The scale for forward_backward's grad_scale; `enabled=False` (bf16, fp32) keeps it at 1 and never skips."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0 or growth_interval < 1:
            raise ValueError(f"need growth_factor > 1, 0 < backoff_factor < 1 and growth_interval >= 1, got "
                             f"{growth_factor}, {backoff_factor}, {growth_interval}")
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0      # since the last overflow or growth
        self.skipped_steps = 0   # over the whole run

    @torch.no_grad()
    def unscale_(self, model) -> bool:
        """Divide this rank's gradients by the scale and return whether any rank saw inf/nan (collective)."""
        if not self.enabled:
            return False
        by_device = defaultdict(list)  # torch's fused check-and-unscale takes tensors of one device and dtype
        for p in model.parameters():
            if p.grad is not None:
                g = local_part(p.grad)
                by_device[(g.device, g.dtype)].append(g)
        device = model.parallel.device if hasattr(model, "parallel") else torch.device("cpu")
        found_inf = torch.zeros(1, device=device)
        for (where, _), grads in by_device.items():
            found, inv_scale = torch.zeros(1, device=where), torch.full((1,), 1.0 / self.scale, device=where)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)
            found_inf += found.to(device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return bool(found_inf.item())

    def update(self, overflow: bool):
        """After the step: halve the scale on overflow, double it after `growth_interval` good steps in a row."""
        if not self.enabled:
            return
        if overflow:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict):
        self.scale, self.good_steps, self.skipped_steps = state["scale"], state["good_steps"], state["skipped_steps"]


__all__ = ["DynamicLossScaler"]
