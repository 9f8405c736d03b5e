"""Times every torch.distributed collective a step calls, by kind: the time a rank spends inside the call (and, for an
async collective, inside its wait), which is the communication the step does not hide."""
from __future__ import annotations

import sys
import time
from collections import defaultdict

import torch.distributed as dist

import colozoo.core.groups as groups
import colozoo.layers.comm as comm

# colozoo calls the plain all-reduce through torch.distributed, the single-tensor gathers through names core.groups and
# comm bound at import (torch's deprecated aliases call the new names: patching both would count twice)
_PATCHED = ((dist, "all_reduce", "all_reduce"), (groups, "_all_gather_single", "all_gather"),
            (comm, "_reduce_scatter_single", "reduce_scatter"))
SMALL = 1 << 14  # elements: an all-reduce this small is a weight gradient of a norm (or another small vector)


class _TimedWork:
    def __init__(self, work, timer, kind, start_cost):
        self._work, self._timer, self._kind = work, timer, kind
        self._timer._add(kind, start_cost, calls=1)

    def wait(self, *args, **kwargs):
        start = time.perf_counter()
        out = self._work.wait(*args, **kwargs)
        self._timer._add(self._kind, time.perf_counter() - start, calls=0)
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


class CommTimer:
    """`with CommTimer() as t: ...steps...; t.steps.append(step_seconds)`, then t.summary()."""

    def __init__(self):
        self.seconds, self.calls, self.steps = defaultdict(float), defaultdict(int), []
        self._saved = []

    def _add(self, kind, seconds, calls):
        self.seconds[kind] += seconds
        self.calls[kind] += calls

    def _kind(self, base, tensor) -> str | None:
        caller = sys._getframe(2)
        if caller.f_code.co_filename.endswith("tp_step.py"):  # the bench's own timing all-reduce
            return None
        frame = caller
        while frame is not None:
            if "cross_entropy" in frame.f_code.co_filename or "CrossEntropy" in frame.f_code.co_qualname:
                return "loss"
            frame = frame.f_back
        if base == "all_reduce" and tensor.numel() <= SMALL:
            return "all_reduce_small"
        return base

    def _wrap(self, fn, base, tensor_arg):
        def timed(*args, **kwargs):
            kind = self._kind(base, args[tensor_arg] if len(args) > tensor_arg else kwargs.get("tensor"))
            if kind is None:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if kwargs.get("async_op"):
                return _TimedWork(out, self, kind, time.perf_counter() - start)
            self._add(kind, time.perf_counter() - start, calls=1)
            return out

        return timed

    def __enter__(self):
        for module, name, base in _PATCHED:
            fn = getattr(module, name)
            self._saved.append((module, name, fn))
            setattr(module, name, self._wrap(fn, base, 0 if base == "all_reduce" else 1))
        return self

    def __exit__(self, *exc):
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved.clear()

    def summary(self) -> dict:
        steps = len(self.steps)
        step = sum(self.steps) / steps
        kinds = {kind: {"calls_per_step": self.calls[kind] / steps, "s_per_step": seconds / steps,
                        "share_of_step": seconds / steps / step} for kind, seconds in sorted(self.seconds.items())}
        total = sum(self.seconds.values()) / steps
        return {"step_s": step, "comm_s_per_step": total, "comm_share": total / step, "by_kind": kinds}


def op_breakdown(step, steps: int = 1) -> dict:
    """Seconds per step of torch.profiler's self CPU time by kind of op: matmuls, attention, collectives (c10d ops and
    the autograd mappings that wait on them), everything else (elementwise, copies, norms, the loss)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    out = defaultdict(float)
    for event in prof.key_averages():
        name = event.key
        if name in ("aten::mm", "aten::addmm", "aten::bmm"):
            kind = "matmul"
        elif "scaled_dot_product" in name:
            kind = "attention"
        elif name.startswith("c10d::") or "Parallel" in name or "Sequence" in name or "gloo" in name:
            kind = "collectives"
        else:
            kind = "other_ops"
        out[kind] += event.self_cpu_time_total / 1e6 / steps
    return dict(out)
