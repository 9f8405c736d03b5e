"""Dropout under model parallelism: activations every tp rank holds whole draw one mask on the default generator
(the same on every rank, seeded alike), sharded ones (heads, sequence shares) draw on the tracked tensor-parallel
generator, so each rank's mask is its own."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from colozoo.core.rng import get_rng_tracker


def dropout(x: torch.Tensor, p: float, training: bool, sharded: bool) -> torch.Tensor:
    """Dropout whose mask agrees across tp ranks for replicated activations and differs for sharded ones."""
    if not training or p == 0.0:
        return x
    if sharded:
        with get_rng_tracker().fork(device_type=x.device.type):
            return F.dropout(x, p, True)
    return F.dropout(x, p, True)
