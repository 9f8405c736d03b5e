"""A tracking allocator for any device: the bytes of the storages that ops run inside the mode allocate and that are
still alive, and their peak. Storages made outside the mode (the inputs, the parameters) do not count, nor do the
views of them that ops inside return. FSDP2 frees and re-allocates its gathered weights by resizing their storages
in place, which no op shows: those resizes are followed too. Used by the memory tests and bench/fused_head.py."""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.counted: dict[int, list] = {}  # storage -> [the bytes counted for it], for those allocated inside
        self.outside: set[int] = set()  # storages made before, seen as arguments, while they live
        self._restore = []

    def __enter__(self):
        self._follow_fsdp2_resizes()
        return super().__enter__()

    def __exit__(self, *exc):
        for module, name, original in self._restore:
            setattr(module, name, original)
        self._restore.clear()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                key = self._key(t)
                if key not in self.counted and key not in self.outside:  # forgotten when freed: its address is reused
                    self.outside.add(key)
                    weakref.finalize(t.untyped_storage(), self.outside.discard, key)
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                key = self._key(t)
                if key not in self.counted and key not in self.outside:
                    self._count(t.untyped_storage(), t.untyped_storage().nbytes())
        return out

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata  # the same storage through an in-place resize

    def _count(self, storage, nbytes: int):
        counted = self.counted[storage._cdata] = [0]
        weakref.finalize(storage, self._free, storage._cdata, counted)
        self._set(counted, nbytes)

    def _set(self, counted: list, nbytes: int):
        self.live += nbytes - counted[0]
        counted[0] = nbytes
        self.peak = max(self.peak, self.live)

    def _free(self, key: int, counted: list):
        self.live -= counted[0]
        self.counted.pop(key, None)

    def _resized(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        if storage._cdata in self.counted:
            self._set(self.counted[storage._cdata], storage.nbytes())
        elif storage._cdata not in self.outside:
            self._count(storage, storage.nbytes())

    def _follow_fsdp2_resizes(self):
        try:
            from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
        except ImportError:
            return
        for module in (_fsdp_param, _fsdp_param_group):
            for name in ("alloc_storage", "free_storage"):
                if hasattr(module, name):
                    original = getattr(module, name)
                    self._restore.append((module, name, original))
                    setattr(module, name, self._following(original))

    def _following(self, resize):
        def resized(tensor):
            resize(tensor)
            self._resized(tensor)
        return resized
