"""A tracking allocator for any device: the bytes of the storages that ops run inside the mode allocate and that are
still alive, and their peak. Storages made outside the mode (the inputs, the parameters) do not count, nor do the
views of them that ops inside return. Used by the memory tests and bench/fused_head.py."""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.counted: set[int] = set()  # data pointers of the storages allocated inside, alive
        self.outside: set[int] = set()  # and of those made before, seen as arguments

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._note(t.untyped_storage(), self.outside)
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._note(t.untyped_storage(), self.counted)
        self.peak = max(self.peak, self.live)
        return out

    def _note(self, storage, into: set):
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr and ptr not in self.counted and ptr not in self.outside:
            into.add(ptr)
            self.live += nbytes if into is self.counted else 0
            weakref.finalize(storage, self._free, ptr, nbytes if into is self.counted else 0, into)

    def _free(self, ptr: int, nbytes: int, into: set):
        into.discard(ptr)
        self.live -= nbytes
