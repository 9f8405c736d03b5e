"""Heterogeneous memory (the Elixir idea): what to keep in GPU memory and what in CPU memory.

`decide_offload` takes one rank's memory need and the hardware and picks the least offload that fits:
nothing; then the optimizer states and fp32 master weights (they are touched once per step, so the cost is
one gradient copy down and one weight copy up, overlapped with backward and the next forward); then the
parameters and gradients too (FSDP2's CPUOffloadPolicy: every micro-batch copies the sharded weights up,
prefetched behind compute). It prices each with the PCIe bandwidth, the CPU Adam rate and the compute
time available to hide transfers, and checks the host has the memory.

`OffloadedAdamW` runs the "optimizer" level: fp32 master weights and AdamW states live on the CPU; each
gradient is copied down on a side stream as soon as backward produces it, and the updated weights go back
with non-blocking copies.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from colozoo.hardware import GiB, Hardware

LEVELS = ("none", "optimizer", "params")


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
    per_mb = need.compute_seconds / m
    cpu_step = need.params / hw.cpu_adam_params_per_s
    if level == "optimizer":
        down, up = need.grads, need.weights
        # gradients stream down during the last micro-batch's backward (~2/3 of it), weights come back up
        # while the next step's first forward (~1/3) waits on them layer by layer
        exposed = max(0.0, down / hw.pcie_bw - per_mb * 2 / 3) + max(0.0, up / hw.pcie_bw - per_mb / 3)
        return down + up, exposed + cpu_step
    # params: every micro-batch brings the sharded weights up for forward and again for backward and sends
    # its gradient shard down, all prefetched behind that micro-batch's compute
    traffic = m * (2 * need.weights + need.grads)
    return traffic, max(0.0, traffic / hw.pcie_bw - need.compute_seconds * 0.8) + cpu_step


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


def fsdp2_offload_policy(decision: OffloadDecision):
    """The FSDP2 `offload_policy` for `fully_shard`: CPU offload of parameters at the "params" level."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if decision.level == "params":
        return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    return OffloadPolicy()


class OffloadedAdamW:
    """AdamW whose fp32 master weights and states live in CPU memory (the "optimizer" offload level).

    Gradients are copied to the CPU as each one is accumulated (a side stream overlaps the copies with the
    rest of backward); `step()` waits for them, updates the masters with torch's AdamW on the CPU and copies
    the new weights back without blocking.
    """

    def __init__(self, params, **adamw_kwargs):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("OffloadedAdamW got no parameters that require gradients")
        pin = torch.cuda.is_available()
        self.master = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]
        if pin:
            self.master = [m.pin_memory() for m in self.master]
        for m in self.master:
            m.grad = torch.zeros_like(m, pin_memory=pin)
        self.optimizer = torch.optim.AdamW(self.master, **adamw_kwargs)
        self.stream = torch.cuda.Stream() if any(p.is_cuda for p in self.params) else None
        self._hooks = [p.register_post_accumulate_grad_hook(self._copy_down(i)) for i, p in enumerate(self.params)]

    def _copy_down(self, i):
        def hook(p):
            if self.stream is None:
                self.master[i].grad.copy_(p.grad)
                return
            self.stream.wait_stream(torch.cuda.current_stream(p.device))
            with torch.cuda.stream(self.stream):
                self.master[i].grad.copy_(p.grad, non_blocking=True)
        return hook

    @torch.no_grad()
    def step(self):
        if self.stream is not None:
            self.stream.synchronize()
        self.optimizer.step()
        for p, m in zip(self.params, self.master):
            p.copy_(m, non_blocking=True)

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        for m in self.master:
            m.grad.zero_()

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(), "master": [m.clone() for m in self.master]}

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state["optimizer"])
        for m, saved in zip(self.master, state["master"]):
            m.copy_(saved)

    def remove_hooks(self):
        for h in self._hooks:
            h.remove()
