"""Heterogeneous memory (the Elixir idea): what to keep in GPU memory and what in CPU memory.

`decide_offload` takes one rank's memory need and the hardware and picks the least offload that fits:
nothing; then the optimizer states and fp32 master weights (they are touched once per step, so the cost is
one gradient copy down and one weight copy up, overlapped with backward and the next forward); then the
parameters and gradients too (FSDP2's CPUOffloadPolicy: every micro-batch copies the sharded weights up,
prefetched behind compute). It prices each with the PCIe bandwidth, the CPU Adam rate and the compute
time available to hide transfers, and checks the host has the memory.

`OffloadedAdamW` runs the "optimizer" level: fp32 master weights and AdamW states live on the CPU. At
`step()` the parameters go through a three-stage pipeline in chunks (the ZeRO-Offload schedule): chunk i+1's
gradients copy down and chunk i-1's new weights copy up, on copy-engine streams, while the CPU updates chunk
i. `colozoo.training.parallelize(model, offload=...)` and `build_optimizer` wire both levels into training.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass

import torch

from colozoo.hardware import GiB, Hardware
from colozoo.layers.shard import local_part

LEVELS = ("none", "optimizer", "params")
CHUNK_BYTES = 64 * 2 ** 20  # fp32 master bytes per pipelined chunk of OffloadedAdamW.step


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


def _chunks(sizes: list[int], chunk_bytes: int) -> list[range]:
    """Consecutive parameter indices grouped into chunks of about chunk_bytes (a larger tensor is its own)."""
    chunks, start, filled = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and filled + size > chunk_bytes:
            chunks.append(range(start, i))
            start, filled = i, 0
        filled += size
    return chunks + [range(start, len(sizes))] if sizes else chunks


class OffloadedAdamW:
    """AdamW whose fp32 master weights and states live in CPU memory (the "optimizer" offload level).

    Works on plain tensors and on DTensor shards (FSDP2, tensor parallel): it keeps this rank's local part.
    `step()` takes the gradients as they are then (after the data-parallel reduction and after any clipping;
    copying them as backward produces them would miss both) and pipelines the update over chunks of about
    CHUNK_BYTES of masters: all gradient copies are queued on a download stream at once, the CPU updates each
    chunk as soon as its gradients have arrived, and queues its new weights on an upload stream, so the copy
    engines work while the CPU does. The next forward queues behind the uploads; the next step waits for them
    before it writes the masters again. It is not a torch.optim.Optimizer: attach learning-rate schedulers to
    its `.optimizer` (the CPU AdamW whose param_groups it shares).
    """

    def __init__(self, params, chunk_bytes: int = CHUNK_BYTES, **adamw_kwargs):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("OffloadedAdamW got no parameters that require gradients")
        local = [local_part(p) for p in self.params]
        pin = torch.cuda.is_available()
        self.master = [t.detach().to("cpu", torch.float32, copy=True) for t in local]
        if pin:
            self.master = [m.pin_memory() for m in self.master]
        self.grad_buffers = [torch.zeros_like(m, pin_memory=pin) for m in self.master]
        self.optimizer = torch.optim.AdamW(self.master, **adamw_kwargs)
        self.chunks = _chunks([m.numel() * 4 for m in self.master], chunk_bytes)
        on_gpu = any(t.is_cuda for t in local)
        self.down = torch.cuda.Stream() if on_gpu else None
        self.up = torch.cuda.Stream() if on_gpu else None
        self._uploaded = None  # event after the last weight upload

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @torch.no_grad()
    def step(self):
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the last upload read the masters we are about to overwrite
        if self.down is not None:
            self.down.wait_stream(torch.cuda.current_stream())  # the final gradients are written
        arrived = [self._download(chunk) for chunk in self.chunks]
        for chunk, event in zip(self.chunks, arrived):
            if event is not None:
                event.synchronize()
            with_grad = [i for i in chunk if self.params[i].grad is not None]
            for i in with_grad:
                self.master[i].grad = self.grad_buffers[i]
            self.optimizer.step()  # AdamW skips masters without a gradient: this updates the chunk's alone
            for i in with_grad:
                self.master[i].grad = None
            self._upload(chunk)
        if self.up is not None:
            torch.cuda.current_stream().wait_stream(self.up)  # the next forward reads the new weights
            self._uploaded = torch.cuda.Event()
            self._uploaded.record(self.up)

    def _download(self, chunk):
        """Queue this chunk's gradient copies; the event they complete (None on CPU, where they are done)."""
        if self.down is None:
            for i in chunk:
                if self.params[i].grad is not None:
                    self.grad_buffers[i].copy_(local_part(self.params[i].grad))
            return None
        with torch.cuda.stream(self.down):
            for i in chunk:
                if self.params[i].grad is not None:
                    self.grad_buffers[i].copy_(local_part(self.params[i].grad), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return event

    def _upload(self, chunk):
        with torch.cuda.stream(self.up) if self.up is not None else contextlib.nullcontext():
            for i in chunk:
                local_part(self.params[i]).copy_(self.master[i], non_blocking=self.up is not None)

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
                local_part(p).copy_(m)
