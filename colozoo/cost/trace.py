"""Trace one forward+backward on meta tensors and record what it costs, op by op (the MAP idea).

Nothing is computed and nothing is allocated: every tensor lives on the meta device. A dispatch mode sees
every aten and c10d op, counts its FLOPs with torch.utils.flop_counter's formulas, follows the lifetime of
every storage it creates (to find the temporaries alive at each op), and records each collective's payload
and process group. Saved-tensor hooks record the bytes autograd keeps for backward (deduplicated by
storage, parameters excluded), and a walk of the autograd graph names the op that saved each one.
Everything is attributed to the innermost module running, in forward and in backward (ModuleTracker).
"""
from __future__ import annotations

import gc
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.module_tracker import ModuleTracker

from colozoo.cost.op_flops import FLOP_REGISTRY, grouped_gemm_shape

aten = torch.ops.aten


# c10d op -> (collective name, which tensor argument's bytes are the payload)
COLLECTIVES = {
    "allreduce_": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all",
    "broadcast_": "broadcast",
    "send": "send",
    "recv_": "recv",
}


def storage_key(t: torch.Tensor):
    try:
        return StorageWeakRef(t.untyped_storage()).cdata
    except (NotImplementedError, RuntimeError):
        return None


def op_name_of_node(node) -> str:
    """'NativeLayerNormBackward0' -> 'native_layer_norm' (custom Functions keep their class name)."""
    name = re.sub(r"Backward\d*$", "", node.name())
    if name.startswith("_") or "." in name:
        return name
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


@dataclass
class StorageLife:
    nbytes: int
    birth: int
    death: int | None = None


@dataclass
class Collective:
    step: int
    module: str
    phase: str
    name: str
    group: str
    group_size: int
    nbytes: int


@dataclass
class SavedTensor:
    module: str
    step: int
    nbytes: int
    shape: tuple
    dtype: torch.dtype
    op: str = "?"
    views: set = field(default_factory=set)  # (offset, shape, stride) of each distinct view saved of it

    @property
    def viewed_bytes(self) -> int:
        """Bytes of the storage the saved views cover (at most the storage: views may overlap)."""
        return min(self.nbytes, sum(math.prod(shape) for _, shape, _ in self.views) * self.dtype.itemsize)


@dataclass
class Trace:
    """Raw per-op records of one traced step; `steps[i]` is (module, phase, op name, flops) of op i."""
    steps: list = field(default_factory=list)
    storages: dict = field(default_factory=dict)       # record id -> StorageLife
    saved: dict = field(default_factory=dict)          # record id -> SavedTensor
    collectives: list = field(default_factory=list)
    params_used_by: dict = field(default_factory=lambda: defaultdict(set))  # param name -> modules that used it
    module_inputs: dict = field(default_factory=dict)  # module name -> bytes of its first tensor input
    grad_keys: set = field(default_factory=set)       # record ids of the parameters' gradients
    static_ids: set = field(default_factory=set)      # parameters and buffers (and their views)
    kernels: dict = field(default_factory=dict)       # step -> Kernel of the ops that launch one (not views)

    def temporaries(self) -> list[int]:
        """Bytes of op outputs alive at each op that are neither saved for backward nor final gradients."""
        kept = self.saved.keys() | self.grad_keys | self.static_ids
        return self.alive_at_each_op(life for key, life in self.storages.items() if key not in kept)

    def alive_at_each_op(self, lives) -> list[int]:
        """Bytes of the storages `lives` (StorageLife records) alive at each op: from the op that made one up to the
        one at which it was found freed (to the end when it never was)."""
        n = len(self.steps)
        delta = [0] * (n + 2)
        for life in lives:
            delta[life.birth] += life.nbytes
            delta[n + 1 if life.death is None else life.death] -= life.nbytes
        out, live = [], 0
        for i in range(n):
            live += delta[i]
            out.append(live)
        return out


TARGETS = ("cuda", "cpu", "eager")

GEMMS = ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm")
ALLOCATIONS = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")  # no kernel: memory only


@dataclass(frozen=True)
class Kernel:
    """What one op costs a GPU besides its FLOPs: the bytes it reads and writes, and for a matrix product its
    (batch, m, n, k) shape; `kind` is "gemm", "attention" (a fused attention kernel) or "memory" (elementwise,
    reductions, copies: bound by memory bandwidth)."""
    kind: str
    nbytes: int
    shape: tuple = ()
    causal: bool = False


def is_core_op(op: str) -> bool:
    """The attention core's ops (fused kernels, or the math path's batched matmuls): what makes (s, s)."""
    return "attention" in op or op in ("bmm", "softmax", "safe_softmax")


def kernel_key(phase: str, op: str, kernel: Kernel) -> str:
    """How a unit groups its kernels: phase, kind, whether the attention core ran it, shape, causal mask."""
    shape = "x".join(map(str, kernel.shape))
    return "|".join((phase, kernel.kind, "core" if is_core_op(op) else "", shape, "causal" if kernel.causal else ""))


def _tensor_bytes(tree) -> tuple[int, set]:
    total, keys = 0, set()
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
            keys.add(storage_key(t))
    return total, keys


def kernel_of(func, args, kwargs, out, flops: int) -> Kernel | None:
    """The kernel an aten op launches, or None for views (outputs aliasing an input, nothing written) and bare
    allocations (whatever fills them, a kernel or a collective, is priced itself). An out= tensor is written, not
    read."""
    name = func._overloadpacket.__name__
    read, inputs = _tensor_bytes((args, {k: v for k, v in kwargs.items() if k != "out"}))
    written, outputs = _tensor_bytes(out)
    if func.is_view or (not func._schema.is_mutable and outputs and outputs <= inputs) or name in ALLOCATIONS:
        return None
    if (grouped := grouped_gemm_shape(name, args, kwargs, out, flops)) is not None:  # MoE: a GEMM an expert
        return Kernel("gemm", read + written, grouped)
    if name in GEMMS and isinstance(out, torch.Tensor) and out.dim() >= 2 and flops:
        m, n = out.shape[-2], out.shape[-1]
        batch = out.numel() // (m * n)
        return Kernel("gemm", read + written, (batch, m, n, max(1, flops // (2 * batch * m * n))))
    if "attention" in name and flops:
        given = {**dict(zip((a.name for a in func._schema.arguments), args)), **kwargs}
        q, k = given.get("query"), given.get("key")  # shape: (batch x heads, q length, k length, head dim)
        shape = (q.shape[0] * q.shape[1], q.shape[2], k.shape[2], q.shape[3]) if getattr(q, "ndim", 0) == 4 else ()
        return Kernel("attention", read + written, shape, causal=bool(given.get("is_causal", False)))
    return Kernel("memory", read + written)


class _SdpaKernel(TorchFunctionMode):
    """Route meta attention (and, for CUDA, dropout) to the kernels the target device runs.

    On meta, SDPA would decompose into the eager math path, which saves the (s x s) probabilities. GPUs
    (and CPUs without dropout) run a flash kernel that saves only q, k, v, the output and the row
    log-sum-exp; the CPU flash op has the same saved set and meta support, so it stands in for both.
    "eager" models a GPU running attention unfused in the activation dtype (Megatron's kernels, as in
    Korthikanti et al. 2022): q @ k^T, softmax, a 1-byte-mask dropout and probs @ v. Megatron scales inside the
    first product and fuses the causal mask into its softmax kernel (Narayanan et al. 2021, §4.2), so neither
    passes over the (s, s) scores once more.
    """

    def __init__(self, target: str):
        super().__init__()
        self.target = target

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args and args[0].device.type == "meta":
            return self._fused(*args, **kwargs)
        if func is torch.bincount and args and args[0].device.type == "meta":
            # MoE expert counts depend on the data; the profiler routes tokens evenly (MoE.routing = "balanced")
            minlength = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
            return torch.zeros(minlength, dtype=torch.long, device="meta")
        if func is F.dropout and self.target in ("cuda", "eager") and args and args[0].device.type == "meta":
            return self._dropout(*args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _dropout(x, p=0.5, training=True, inplace=False):
        """CUDA runs the fused native_dropout, which keeps a 1-byte mask (CPU keeps one of the input's dtype)."""
        if not training or p == 0.0:
            return x
        return torch.native_dropout(x, p, True)[0]

    @staticmethod
    def _eager(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if enable_gqa and k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        scores = (q * (scale if scale is not None else q.shape[-1] ** -0.5)) @ k.transpose(-2, -1)
        if attn_mask is not None:  # additive biases (the causal mask is the softmax kernel's): saves nothing
            if attn_mask.dtype == torch.bool:  # as an additive mask: the same sizes, nothing saved
                attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device)
            scores = scores + attn_mask
        probs = torch.softmax(scores, dim=-1)
        if dropout_p > 0:
            probs = torch.native_dropout(probs, dropout_p, True)[0]
        return probs @ v

    def _fused(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if self.target == "eager":
            return self._eager(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if self.target == "cpu" and dropout_p > 0:  # CPU runs dropout attention on the math path
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                  is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if enable_gqa and k.shape[1] != q.shape[1] and self.target == "cpu":  # CUDA's kernels keep k/v unrepeated
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # the kernels take an additive float mask
            attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device)
        if v.shape[-1] != q.shape[-1]:
            # values narrower than the keys (MLA): the flash kernels want one head dim; CUDA runs the memory-efficient
            # kernel (the same saved set: q, k, v, the output and the log-sum-exp), CPU the math path
            if self.target == "cpu":
                return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                      is_causal=is_causal, scale=scale)
            return aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask, q.requires_grad, dropout_p,
                                                                is_causal, scale=scale)[0]
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, attn_mask=attn_mask,
                                                                scale=scale)[0]


class _Recorder(TorchDispatchMode):
    def __init__(self, trace: Trace, tracker: ModuleTracker, group_names: dict):
        super().__init__()
        self.trace, self.tracker, self.group_names = trace, tracker, group_names
        self.phase = "forward"
        self.live: dict = {}  # storage key -> (StorageWeakRef, record id) of storages not yet freed
        self.param_keys: dict = {}  # storage key -> parameter name

    def record_id(self, t: torch.Tensor, step: int):
        """The lifetime record of t's storage, opened now if unseen. Storage keys are addresses that a freed
        storage hands on, so records carry their own ids."""
        key = storage_key(t)
        if key is None:
            return None
        entry = self.live.get(key)
        if entry is not None and not entry[0].expired():
            return entry[1]
        if entry is not None:
            self.trace.storages[entry[1]].death = step
        rid = len(self.trace.storages)
        self.live[key] = (StorageWeakRef(t.untyped_storage()), rid)
        self.trace.storages[rid] = StorageLife(t.untyped_storage().nbytes(), step)
        return rid

    def module(self) -> str:
        return max(self.tracker.parents, key=len, default="Global")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        step = len(self.trace.steps)
        module = self.module()
        packet = func._overloadpacket
        flops = 0
        if packet in FLOP_REGISTRY:
            flops = FLOP_REGISTRY[packet](*args, **kwargs, out_val=out)
        self.trace.steps.append((module, self.phase, packet.__name__.lstrip("_"), flops))
        if self.phase == "forward":
            self._params_used(args, module)
        if func.namespace == "c10d":
            self._collective(func, args, step, module)
        elif (kernel := kernel_of(func, args, kwargs, out, flops)) is not None:
            self.trace.kernels[step] = kernel
        self._sweep(step)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.record_id(t, step)
        return out

    def _params_used(self, args, module: str):
        """Note the parameters an op takes (a head tied to the embedding uses its weight without saving it, as the
        fused LM head and loss does)."""
        for a in args:
            if isinstance(a, torch.Tensor) and (name := self.param_keys.get(storage_key(a))) is not None:
                self.trace.params_used_by[name].add(module)

    def _sweep(self, step: int):
        dead = [key for key, (ref, _) in self.live.items() if ref.expired()]
        for key in dead:
            self.trace.storages[self.live.pop(key)[1]].death = step

    def _collective(self, func, args, step, module):
        name = COLLECTIVES.get(func._overloadpacket.__name__)
        if name is None:
            return
        tensors = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
        group = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
        pg = dist.ProcessGroup.unbox(group) if group is not None else None
        size = pg.size() if pg is not None else 1
        if name in ("all_gather",):  # (output, input): the payload is the gathered output
            nbytes = tensors[0].numel() * tensors[0].element_size()
        elif name in ("reduce_scatter", "all_to_all"):  # (output, input): the payload is the full input
            nbytes = tensors[-1].numel() * tensors[-1].element_size()
        else:
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
        group_name = self.group_names.get(pg, f"group{size}")
        self.trace.collectives.append(Collective(step, module, self.phase, name, group_name, size, nbytes))


def _record_graph_ops(trace: Trace, recorder, roots):
    """Name the op that saved each tensor by walking the autograd graph once."""
    seen, stack = set(), [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        op = op_name_of_node(node)
        for attr in dir(node):
            if not attr.startswith("_saved_") and attr != "saved_tensors":
                continue
            try:
                value = getattr(node, attr)
            except RuntimeError:  # freed or unavailable
                continue
            for t in (value if isinstance(value, (tuple, list)) else (value,)):
                if isinstance(t, torch.Tensor):
                    rid = recorder.record_id(t, len(trace.steps))
                    if rid in trace.saved and trace.saved[rid].op == "?":
                        trace.saved[rid].op = op
        stack.extend(n for n, _ in node.next_functions if n is not None)


def named_tracker(module: torch.nn.Module, wrappers=()) -> ModuleTracker:
    """A ModuleTracker that names `module`'s submodules as module.named_modules() does (under the module's class name),
    whatever runs them: `wrappers` (a colozoo model's pipeline stages) hold those submodules too and pass for the
    module itself, instead of renaming them after their own children the first time they run."""
    tracker = ModuleTracker()
    root = type(module).__name__
    for name, sub in module.named_modules():
        tracker._known_modules[sub] = f"{root}.{name}" if name else root
        tracker._seen_modules.add(sub)
    for wrapper in wrappers:
        tracker._known_modules[wrapper] = root
        tracker._seen_modules.add(wrapper)
    return tracker


def trace_step(module: torch.nn.Module, run, target: str = "cuda", group_names: dict | None = None,
               wrappers=(), stand_ins: dict | None = None) -> Trace:
    """Trace `loss = run(module)` and `loss.backward()` on meta tensors; `module`'s parameters must be on meta, or
    `stand_ins` holds, by name, the meta tensors `run` puts in place of its parameters and buffers
    (torch.func.functional_call). `wrappers`: modules that run `module`'s submodules for it (see named_tracker)."""
    if target not in TARGETS:
        raise ValueError(f"target {target!r} not one of {TARGETS}")
    trace = Trace()
    state = stand_ins if stand_ins is not None else {**dict(module.named_parameters()), **dict(module.named_buffers())}
    params = {name: t for name, t in state.items() if isinstance(t, torch.nn.Parameter)}
    param_keys = {}
    for name, p in params.items():
        param_keys.setdefault(storage_key(p), name)
    buffer_keys = {storage_key(b) for name, b in state.items() if name not in params}
    tracker = named_tracker(module, wrappers)
    recorder = _Recorder(trace, tracker, group_names or {})
    recorder.param_keys = param_keys
    for t in state.values():
        trace.static_ids.add(recorder.record_id(t, 0))

    def pack(t):
        key = storage_key(t)
        if key is None or key in buffer_keys:
            return t
        if key in param_keys:
            trace.params_used_by[param_keys[key]].add(recorder.module())
        else:
            if (rid := recorder.record_id(t, len(trace.steps))) not in trace.saved:
                trace.saved[rid] = SavedTensor(recorder.module(), len(trace.steps), t.untyped_storage().nbytes(),
                                               tuple(t.shape), t.dtype)
            trace.saved[rid].views.add((t.storage_offset(), tuple(t.shape), t.stride()))
        return t

    def remember_input(mod, args):
        name = tracker._get_mod_name(mod) if hasattr(tracker, "_get_mod_name") else None
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if name is not None and first is not None and name not in trace.module_inputs:
            trace.module_inputs[name] = first.numel() * first.element_size()

    handle = torch.nn.modules.module.register_module_forward_pre_hook(remember_input)
    # storages held only by reference cycles die whenever the cyclic collector runs: keep it out of the
    # trace so lifetimes (and the temporaries) are deterministic, counting such storages as still alive (a full
    # collection first would not change what the trace sees, and costs a second in a big process)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with _SdpaKernel(target), tracker, recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = run(module)
            _record_graph_ops(trace, recorder, [loss.grad_fn])
            recorder.phase = "backward"
            loss.backward()
            del loss
            recorder._sweep(len(trace.steps))
    finally:
        handle.remove()
        if gc_was_enabled:
            gc.enable()
    trace.grad_keys = {recorder.record_id(p.grad, len(trace.steps)) for p in params.values() if p.grad is not None}
    return trace
