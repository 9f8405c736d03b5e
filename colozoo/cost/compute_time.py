"""How long a traced unit's kernels take on a GPU: each kernel at the slower of its math and its memory traffic.

A matrix product (GEMM) runs at the fraction of peak the hardware's best-shaped GEMMs reach
(Hardware.matmul_efficiency, measured) times how well its output tiles fill the GPU: cuBLAS computes an m x n
output in tiles (Hardware.gemm_tile; Hardware.small_tile, slower, where the large ones leave SMs idle) spread over
the streaming multiprocessors in waves, so dimensions that are not
tile multiples (tile quantization) and a last wave left part empty (wave quantization) waste the rest (NVIDIA, Matrix
Multiplication Background User's Guide, ch. 3); a product of a few rows runs on the vector units instead. Small per-GPU batches and narrow tensor-parallel slices make few
tiles: those GEMMs run slower than big ones. No GEMM beats its own memory traffic either: bytes over the bandwidth
a large copy reaches (the roofline). A fused attention kernel runs on the (query, key) pairs it computes: half of
them under a causal mask (the kernels skip the masked blocks, FLOP counters count them all), at the rate its
implementation was measured at on this GPU for its head dimension and sequence length (Hardware.attention_speed,
colozoo.cost.attention_speed), else at Hardware.attention_efficiency of peak. Every other kernel is memory-bound. A kernel takes at least Hardware.kernel_floor_s, and the host
must issue them: a unit takes at least its kernel count x Hardware.launch_s.

Units keep their kernels as colozoo.cost.trace.kernel_key -> [count, FLOPs, bytes] (colozoo.cost.report.UnitCost).
"""
from __future__ import annotations

import math

from colozoo.cost.attention_speed import pass_tflops
from colozoo.cost.hardware import Hardware


def wave_efficiency(batch: int, m: int, n: int, hw: Hardware) -> float:
    """The share of the SMs' tile slots a (batch x) m x n GEMM output fills, in the better tile orientation, on the
    large tile or (at its lower rate) the small one where that fills the SMs better, as cuBLAS picks a tile per
    shape: 1 for outputs of large tiles filling whole waves."""
    if not hw.sm_count:
        return 1.0
    tiles = [(hw.gemm_tile, 1.0)] + ([(hw.small_tile, hw.small_tile_efficiency)] if hw.small_tile else [])
    best = 0.0
    for tile, rate in tiles:
        for tm, tn in (tile, tuple(reversed(tile))):
            count = batch * math.ceil(m / tm) * math.ceil(n / tn)
            waves = math.ceil(count / hw.sm_count)
            best = max(best, rate * batch * m * n / (waves * hw.sm_count * tm * tn))
    return best


def gemm_seconds(flops: float, nbytes: float, shape, hw: Hardware) -> float:
    """One GEMM of `shape` (batch, m, n, k): the slower of its math and its memory traffic, on tensor-core tiles,
    or for products too skinny to fill a tile (a few rows) on the vector units, which cuBLAS's GEMV kernels use."""
    batch, m, n, _ = shape
    rate = hw.peak_flops * hw.matmul_efficiency * wave_efficiency(batch, m, n, hw)
    memory = nbytes / hw.memory_bandwidth
    tiles = max(flops / rate, memory)
    skinny = max(flops / hw.vector_flops, memory) if hw.vector_flops else tiles
    return max(min(tiles, skinny), hw.kernel_floor_s)


def attention_seconds(flops: float, nbytes: float, causal: bool, hw: Hardware, phase: str = "fwd", shape=(),
                      kernel: str = "flash2") -> float:
    """One fused attention kernel, forward or backward (`phase`), of `shape` (batch x heads, query length, key
    length, head dim), run by the implementation `kernel` ("flash2", "flash1")."""
    computed = flops / 2 if causal else flops
    measured = pass_tflops(hw.attention_speed, kernel, shape[3], causal, shape[2], phase) if shape else None
    rate = measured * 1e12 if measured else hw.peak_flops * hw.attention_efficiency
    return max(computed / rate, nbytes / hw.memory_bandwidth, hw.kernel_floor_s)


def memory_seconds(nbytes: float, hw: Hardware) -> float:
    return max(nbytes / hw.memory_bandwidth, hw.kernel_floor_s)


def kernel_seconds(key: str, count: float, flops: float, nbytes: float, hw: Hardware,
                   attention: str = "flash2") -> float:
    """All `count` kernels of one kernel_key, whose FLOPs and bytes are totals; `attention` names the fused
    attention kernels' implementation."""
    if count <= 0:
        return 0.0
    phase, kind, _, shape, causal = key.split("|")
    dims = tuple(int(d) for d in shape.split("x")) if shape else ()
    each_flops, each_bytes = flops / count, nbytes / count
    if kind == "gemm":
        one = gemm_seconds(each_flops, each_bytes, dims, hw)
    elif kind == "attention":
        one = attention_seconds(each_flops, each_bytes, causal == "causal", hw, phase, dims, attention)
    else:
        one = memory_seconds(each_bytes, hw)
    return count * one


def unit_seconds(kernels: dict, hw: Hardware, phase: str, core_only: bool = False, core_scale: float = 1.0,
                 attention: str = "flash2") -> float:
    """Seconds of one unit's `phase` ("fwd" or "bwd") kernels; `core_only`: just the attention core's (what
    selective recomputation repeats); `core_scale` multiplies the core (ring attention: a context-parallel rank's
    queries meet the keys of every chunk, cp times its local core); `attention`: the fused attention kernels'
    implementation."""
    gpu, count = 0.0, 0.0
    for key, (n, flops, nbytes) in kernels.items():
        kernel_phase, _, core, _, _ = key.split("|")
        if kernel_phase != phase or (core_only and not core):
            continue
        scale = core_scale if core else 1.0
        gpu += scale * kernel_seconds(key, n, flops, nbytes, hw, attention)
        count += scale * n
    return max(gpu, count * hw.launch_s)
