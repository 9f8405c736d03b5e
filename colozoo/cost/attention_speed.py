"""Measured speed of fused attention kernels: forward + backward TFLOP/s by implementation, head dimension, causal
mask and sequence length, as FlashAttention-2's paper measured them (Dao 2023, arXiv 2307.08691, Figure 4 on an
A100 80GB SXM4 and Figure 7 on an H100 80GB SXM5; the figures are assets/flash2_a100_fwd_bwd_benchmark.png and
assets/flash2_h100_fwd_bwd_benchmark.png of Dao-AILab/flash-attention). The benchmark counts the FLOPs of the
pairs computed (half under a causal mask) and 2.5 x the forward's for the backward, as colozoo's trace does, so a
kernel of F forward FLOPs takes F / rate_fwd + 2.5 F / rate_bwd.

A kernel's rate grows with the sequence (short ones leave its tiles and SMs part empty) and with the head dimension.
The paper states the split between the passes at their best: FlashAttention-2 "reaching up to 73% of the
theoretical max throughput in the forward pass, and up to 63% ... in the backward pass" (§1, §4.1; Figures 5 and 6:
up to ~226 and 196 TFLOP/s on the A100); that ratio divides every measured forward + backward rate between them
(on Figure 4's best point, 203 TFLOP/s, it gives 226 and 195).

"flash1" is FlashAttention (v1, CUDA), also the stand-in for the Triton FlashAttention of llm-foundry (copied from
flash-attention's flash_attn_triton.py, whose header says: Triton forward faster than CUDA forward, backward slower,
"overall Triton forward + backward is slightly slower than CUDA forward + backward"). Labels a figure hides behind
its legend are left out.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

FWD_OVER_BWD = 73 / 63  # FlashAttention-2's best forward over its best backward share of peak (paper, §1, §4.1)

_FA2_PAPER = "FlashAttention-2 (arXiv 2307.08691)"
A100_SOURCE = f"{_FA2_PAPER} Figure 4, A100 80GB SXM4, forward + backward"
H100_SOURCE = f"{_FA2_PAPER} Figure 7, H100 80GB SXM5, forward + backward (no Hopper-specific instructions)"
SEQ = (512, 1024, 2048, 4096, 8192, 16384)


class Table(Mapping):
    """A read-only mapping: the published tables are shared by every preset, and a caller changing one must not
    change every later answer (types.MappingProxyType would do, but cannot be pickled: the planner sends its
    hardware to a spawned process)."""
    __slots__ = ("_items",)

    def __init__(self, items=()):
        self._items = dict(items)

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)

    def __repr__(self):
        return f"Table({self._items!r})"


def frozen(table: Mapping) -> Table:
    """`table` ({kernel key: {sequence: TFLOP/s}}) as read-only Tables, both levels."""
    return Table({key: Table(series) for key, series in table.items()})


def _series(*values) -> dict:
    return {s: v for s, v in zip(SEQ, values) if v is not None}


A100 = frozen({  # "kernel/d<head dim>/causal|full" -> {sequence: TFLOP/s forward + backward}
    "flash2/d64/full": _series(132, None, 162, 171, 175, 176),
    "flash2/d128/full": _series(None, 173, 187, 196, 201, 203),
    "flash2/d64/causal": _series(88, 119, 140, 156, 165, 171),
    "flash2/d128/causal": _series(99, 133, 155, 173, 182, 189),
    "flash1/d64/full": _series(91, 92, 104, 108, 110, 110),
    "flash1/d128/full": _series(76, 72, 76, 80, 82, 83),
    "flash1/d64/causal": _series(58, 70, 77, 87, 92, 97),
    "flash1/d128/causal": _series(55, 62, 69, 76, 80, 83),
})
H100 = frozen({
    "flash2/d64/full": _series(215, 254, 274, 288, 294, 296),
    "flash2/d128/full": _series(248, 294, 320, 326, 335, 338),
    "flash2/d64/causal": _series(141, 192, 232, 257, 273, 284),
    "flash2/d128/causal": _series(163, 221, 265, 294, 308, 328),
    "flash1/d64/full": _series(157, 159, 161, 161, 166, 168),
    "flash1/d128/full": _series(127, 127, 128, 131, 137, 139),
    "flash1/d64/causal": _series(104, 123, 136, 138, 149, 156),
    "flash1/d128/causal": _series(98, 109, 108, 126, 135, 137),
})


def _along(points: dict, x: float, log: bool) -> float:
    """Linear interpolation of {x: value} at x (in log2 x when `log`), held at the ends."""
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    if x >= xs[-1]:
        return points[xs[-1]]
    hi = next(i for i, v in enumerate(xs) if v >= x)
    a, b = xs[hi - 1], xs[hi]
    t = (math.log2(x / a) / math.log2(b / a)) if log else (x - a) / (b - a)
    return points[a] + t * (points[b] - points[a])


def fwd_bwd_tflops(table: dict, kernel: str, head_dim: int, causal: bool, seq: int) -> float | None:
    """The measured forward + backward TFLOP/s of `kernel` at this head dimension (between the measured ones, held
    at their ends) and sequence length (in log2 between the measured ones); None where nothing was measured."""
    mask = "causal" if causal else "full"
    by_dim = {}
    for key, series in table.items():
        name, dim, kind = key.split("/")
        if name == kernel and kind == mask:
            by_dim[int(dim[1:])] = _along({int(s): v for s, v in series.items()}, seq, log=True)
    return _along(by_dim, head_dim, log=False) if by_dim else None


def pass_tflops(table: dict, kernel: str, head_dim: int, causal: bool, seq: int, phase: str) -> float | None:
    """TFLOP/s of one pass ("fwd" or "bwd"): F/fwd + 2.5 F/bwd = 3.5 F/combined, with fwd = FWD_OVER_BWD x bwd."""
    both = fwd_bwd_tflops(table, kernel, head_dim, causal, seq)
    if both is None:
        return None
    bwd = both * (1 / FWD_OVER_BWD + 2.5) / 3.5
    return bwd * FWD_OVER_BWD if phase == "fwd" else bwd
