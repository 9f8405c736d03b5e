"""Learning rate: linear warmup from 0, then cosine decay to `min_lr_ratio` of the peak at the last step."""
from __future__ import annotations

import math

import torch


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> float:
    """The multiplier of the peak learning rate for optimizer step `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                    min_lr_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"need warmup_steps >= 0 and total steps >= 1, got {warmup_steps} and {total_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, warmup_steps, total_steps, min_lr_ratio))
