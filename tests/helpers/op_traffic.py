"""Memory traffic counted op by op: every aten op's tensor arguments read (an in-place one read and written) and its
new outputs written, each tensor weighed by a function of the test's choosing (its bytes, or 1 for the tensors it
follows)."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class OpTraffic(TorchDispatchMode):
    """`weight(tensor)` summed over every read and write; arguments named in `read_only` count as read even where the
    schema marks them writable."""

    def __init__(self, weight, read_only=()):
        super().__init__()
        self.weight, self.read_only, self.total = weight, set(read_only), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]
        for arg, value in zip(schema.arguments, values):
            written = arg.alias_info is not None and arg.alias_info.is_write and arg.name not in self.read_only
            self.total += self._weigh(value) * (2 if written else 1)
        for ret, value in zip(schema.returns, out if isinstance(out, tuple) else (out,)):
            if ret.alias_info is None:
                self.total += self._weigh(value)
        return out

    def _weigh(self, value) -> float:
        return sum(self.weight(t) for t in tree_leaves(value) if isinstance(t, torch.Tensor))
