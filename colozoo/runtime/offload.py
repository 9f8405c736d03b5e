"""CPU offload at run time. `OffloadedAdamW` runs the "optimizer" level: fp32 master weights and AdamW states
live on the CPU. At `step()` the parameters go through a three-stage pipeline in chunks (the ZeRO-Offload
schedule): chunk i+1's gradients copy down and chunk i-1's new weights copy up, on copy-engine streams, while
the CPU updates chunk i. The "params" level is FSDP2's CPUOffloadPolicy (`fsdp2_offload_policy`).
`colozoo.runtime.training.parallelize(model, offload=...)` and `build_optimizer` wire both levels into
training; colozoo.cost.offload prices them.
"""
from __future__ import annotations

import contextlib

import torch

from colozoo.layers.shard import local_part
from colozoo.runtime.options import OFFLOAD as LEVELS

CHUNK_BYTES = 64 * 2 ** 20  # fp32 master bytes per pipelined chunk of OffloadedAdamW.step


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
