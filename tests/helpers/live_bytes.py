"""A tracking allocator for any device: the bytes of the storages that ops run inside the mode allocate and that are
still alive, and their peak (tensors made outside the mode, such as the inputs, do not count). Used by the memory
tests and bench/fused_head.py."""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t.untyped_storage())
        self.peak = max(self.peak, self.live)
        return out

    def _track(self, storage):
        ptr = storage.data_ptr()
        if ptr and ptr not in self.seen:
            self.seen.add(ptr)
            self.live += storage.nbytes()
            weakref.finalize(storage, self._free, ptr, storage.nbytes())

    def _free(self, ptr: int, nbytes: int):
        self.seen.discard(ptr)
        self.live -= nbytes
