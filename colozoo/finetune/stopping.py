"""How a fine-tuning run stops early: Ctrl-C or SIGTERM asks for a clean stop agreed by every rank (finish the step,
save, exit), and a non-finite loss or gradient norm stops the run before the optimizer step."""
from __future__ import annotations

import math
import signal
import time

import torch
import torch.distributed as dist


class Interrupt:
    """Ctrl-C / SIGTERM ask for a clean stop: finish the step, save, exit. A second Ctrl-C stops at once."""

    def __init__(self):
        self.requested = False
        self.previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        # torchrun forwards the terminal's Ctrl-C to workers that already got it: only a later one means "now"
        if self.requested and time.monotonic() - self.requested_at > 2.0:
            raise KeyboardInterrupt
        if not self.requested:
            self.requested, self.requested_at = True, time.monotonic()

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def agreed(self, device) -> bool:
        """Whether any rank was interrupted (collective, so all ranks stop at the same step)."""
        flag = torch.tensor([float(self.requested)], device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class NonFiniteError(ValueError):
    pass


def check_finite(step: int, loss: float, grad_norm: float, dtype: str):
    """Stop at the first non-finite loss or gradient norm (same values on every rank, so every rank stops)."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise NonFiniteError(f"step {step}: loss {loss}, gradient norm {grad_norm} in {dtype}: not finite; stopped "
                             f"before the optimizer step, nothing saved or exported (lower --lr, check the data, or "
                             f"resume from the last checkpoint)")
