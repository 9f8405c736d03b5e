"""Heterogeneous memory (the Elixir idea): what to keep in GPU memory and what in CPU memory.

`decide_offload` takes one rank's memory need and the hardware and picks the least offload that fits:
nothing; then the optimizer states and fp32 master weights (they are touched once per step, so the cost is
one gradient copy down and one weight copy up, overlapped with backward and the next forward); then the
parameters and gradients too (FSDP2's CPUOffloadPolicy: every micro-batch copies the sharded weights up,
prefetched behind compute). It prices each with the PCIe bandwidth, the CPU Adam rate and the compute
time available to hide transfers, and checks the host has the memory.

`OffloadedAdamW` runs the "optimizer" level: fp32 master weights and AdamW states live on the CPU; the
final gradients are copied down on a side stream at `step()`, and the updated weights go back with
non-blocking copies. `colozoo.training.parallelize(model, offload=...)` and `build_optimizer` wire both
levels into training.
"""
from __future__ import annotations

import contextlib
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


def fsdp2_offload_policy(level):
    """The FSDP2 `offload_policy` for `fully_shard`: CPU offload of parameters at the "params" level.
    `level` is an OffloadDecision, a level name or None."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    level = getattr(level, "level", level) or "none"
    if level not in LEVELS:
        raise ValueError(f"offload level {level!r} not one of {LEVELS}")
    if level == "params":
        return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    return OffloadPolicy()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor (FSDP2 shard, tp shard): this rank's part


class OffloadedAdamW:
    """AdamW whose fp32 master weights and states live in CPU memory (the "optimizer" offload level).

    Works on plain tensors and on DTensor shards (FSDP2, tensor parallel): it keeps this rank's local part.
    `step()` copies the gradients down, as they are then (after the data-parallel reduction and after any
    clipping; copying them as backward produces them would miss both), on a side stream whose copies run on
    the copy engine in pinned memory; updates the masters with torch's AdamW on the CPU; and sends the new
    weights up with non-blocking copies that the next forward queues behind. The next step waits for those
    uploads before it writes the masters again. It is not a torch.optim.Optimizer: attach learning-rate
    schedulers to its `.optimizer` (the CPU AdamW whose param_groups it shares).
    """

    def __init__(self, params, **adamw_kwargs):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("OffloadedAdamW got no parameters that require gradients")
        local = [_local(p) for p in self.params]
        pin = torch.cuda.is_available()
        self.master = [t.detach().to("cpu", torch.float32, copy=True) for t in local]
        if pin:
            self.master = [m.pin_memory() for m in self.master]
        self.grad_buffers = [torch.zeros_like(m, pin_memory=pin) for m in self.master]
        self.optimizer = torch.optim.AdamW(self.master, **adamw_kwargs)
        self.stream = torch.cuda.Stream() if any(t.is_cuda for t in local) else None
        self._uploaded = None  # event after the last weight upload

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @torch.no_grad()
    def step(self):
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the last upload read the masters we are about to overwrite
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            for p, m, buf in zip(self.params, self.master, self.grad_buffers):
                if p.grad is None:
                    m.grad = None  # as torch's AdamW: no gradient, no update
                    continue
                buf.copy_(_local(p.grad), non_blocking=True)
                m.grad = buf
        if self.stream is not None:
            self.stream.synchronize()
        self.optimizer.step()
        for p, m in zip(self.params, self.master):
            _local(p).copy_(m, non_blocking=True)
        if self.stream is not None:
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(), "master": [m.clone() for m in self.master]}

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for p, m, saved in zip(self.params, self.master, state["master"]):
                m.copy_(saved)
                _local(p).copy_(m)
