"""Pricing CPU offload (the Elixir idea): what to keep in GPU memory and what in CPU memory.

`decide_offload` takes one rank's memory need and the hardware and picks the least offload that fits:
nothing; then the optimizer states and fp32 master weights (they are touched once per step, so the cost is
one gradient copy down and one weight copy up, overlapped with backward and the next forward); then the
parameters and gradients too (FSDP2's CPUOffloadPolicy: every micro-batch copies the sharded weights up,
prefetched behind compute). It prices each with the PCIe bandwidth, the CPU Adam rate and the compute
time available to hide transfers, and checks the host has the memory. colozoo.runtime.offload runs them.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from colozoo.cost.hardware import GiB, Hardware
from colozoo.runtime.offload import CHUNK_BYTES
from colozoo.runtime.options import OFFLOAD as LEVELS


@dataclass
class MemoryNeed:
    """Bytes one rank needs in GPU memory with nothing offloaded, and the time its step computes."""
    weights: float
    grads: float
    master: float
    optimizer: float
    activations: float
    transient: float = 0.0
    fsdp_buffers: float = 0.0
    params: int = 0                  # local parameter count (after sharding): what the CPU optimizer updates
    compute_seconds: float = 0.0     # forward + backward of the whole step on this rank
    num_microbatches: int = 1

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.master + self.optimizer + self.activations + self.transient
                + self.fsdp_buffers)


@dataclass
class OffloadDecision:
    level: str
    fits: bool
    gpu_bytes: float
    cpu_bytes: float
    transfer_bytes: float        # PCIe traffic per step
    exposed_seconds: float       # what transfers and the CPU optimizer step add to the step time
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def split(need: MemoryNeed, level: str) -> tuple[float, float]:
    """(GPU bytes, CPU bytes) at an offload level."""
    if level not in LEVELS:
        raise ValueError(f"offload level {level!r} not one of {LEVELS}")
    cpu = 0.0
    if level in ("optimizer", "params"):
        cpu += need.master + need.optimizer
    if level == "params":
        cpu += need.weights + need.grads
    gpu = need.total - cpu
    if level == "params":  # the gathered layers being computed stay on the GPU (FSDP's unsharded buffers)
        gpu = max(gpu, need.fsdp_buffers)
    return gpu, cpu


def transfer_cost(need: MemoryNeed, level: str, hw: Hardware) -> tuple[float, float]:
    """(bytes over PCIe per step, seconds they and the CPU optimizer add after overlap with compute)."""
    if level == "none":
        return 0.0, 0.0
    m = need.num_microbatches
    cpu_step = need.params / hw.cpu_adam_params_per_s
    if level == "optimizer":
        down, up = need.grads, need.weights
        return down + up, pipelined((down / hw.pcie_bw, cpu_step, up / hw.pcie_bw),
                                    chunks=max(1, math.ceil(need.master / CHUNK_BYTES)))
    # params: every micro-batch brings the sharded weights up for forward and again for backward and sends
    # its gradient shard down, all prefetched behind that micro-batch's compute
    traffic = m * (2 * need.weights + need.grads)
    return traffic, max(0.0, traffic / hw.pcie_bw - need.compute_seconds * 0.8) + cpu_step


def pipelined(stages, chunks: int) -> float:
    """Seconds of a pipeline whose stages each take stages[k] for the whole work, cut into equal chunks: the
    slowest stage runs throughout, every other one adds a chunk's worth as the pipeline fills and drains."""
    return max(stages) + (sum(stages) - max(stages)) / chunks


def decide_offload(need: MemoryNeed, hw: Hardware, ranks_per_node: int | None = None,
                   allowed=LEVELS) -> OffloadDecision:
    """The least offload that fits this rank in GPU memory and its share of the host's memory."""
    cpu_share = hw.cpu_memory * 0.9 / (ranks_per_node or hw.gpus_per_node)
    limit = hw.memory_limit
    shortfalls = []
    for level in LEVELS:
        if level not in allowed:
            continue
        gpu, cpu = split(need, level)
        if gpu > limit:
            shortfalls.append(f"{level}: GPU needs {gpu / GiB:.1f} GiB > {limit / GiB:.1f} GiB")
            continue
        if cpu > cpu_share:
            shortfalls.append(f"{level}: CPU needs {cpu / GiB:.1f} GiB > its {cpu_share / GiB:.1f} GiB share")
            continue
        traffic, exposed = transfer_cost(need, level, hw)
        if level == "none":
            reason = "fits in GPU memory"
        elif level == "optimizer":
            reason = (f"GPU short by {(need.total - limit) / GiB:.1f} GiB: optimizer states and fp32 master "
                      f"weights ({cpu / GiB:.1f} GiB) move to CPU, +{exposed * 1e3:.0f} ms/step")
        else:
            reason = (f"GPU short by {(split(need, 'optimizer')[0] - limit) / GiB:.1f} GiB even without "
                      f"optimizer states: parameters and gradients move to CPU too (FSDP2 CPUOffloadPolicy), "
                      f"+{exposed * 1e3:.0f} ms/step")
        return OffloadDecision(level, True, gpu, cpu, traffic, exposed, reason)
    gpu, cpu = split(need, allowed[-1])
    return OffloadDecision(allowed[-1], False, gpu, cpu, 0.0, float("inf"), "; ".join(shortfalls))


