"""Tracing a model on meta tensors in a fake world of the mesh's tensor/expert sizes: one layer of each kind with
the embedding and the head, every collective the layers issue, every tensor saved for backward; then the trace
attributed to units (embedding, each kind of layer, head) with their parameters."""
from __future__ import annotations

import contextlib
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from colozoo.core.mesh import ParallelConfig
from colozoo.core.dtypes import NAMES as DTYPES
from colozoo.cost.trace import Trace, kernel_key, trace_step
from colozoo.cost.report import UnitCost
from colozoo.cost.setup import ProfilerError, get_config, parse_mesh


@contextlib.contextmanager
def fake_world(world_size: int):
    """A process-local "fake" default group: collectives succeed instantly and move no data."""
    if dist.is_available() and dist.is_initialized():
        raise ProfilerError("profile() builds fake process groups and cannot run inside an initialised "
                            "torch.distributed job; profile before init_process_group or in a separate process")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _layer_signature(layer: nn.Module):
    return (type(layer).__name__, tuple((n, tuple(p.shape), p.dtype) for n, p in layer.named_parameters()))


def _layer_container(model: nn.Module):
    """(prefix, container) of the repeated blocks: `model.layers` for colozoo models, else the largest list."""
    if isinstance(getattr(model, "layers", None), (nn.ModuleDict, nn.ModuleList)):
        return "layers", model.layers
    best = (None, None)
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict)) and len(mod) > 1:
            if best[1] is None or len(mod) > len(best[1]):
                best = (name, mod)
    return best


def _kinds(container) -> dict:
    """Layer kind (first key of a signature) -> global layer keys of that kind, in order."""
    groups = defaultdict(list)
    first = {}
    for key, layer in container.items() if isinstance(container, nn.ModuleDict) else enumerate(container):
        sig = _layer_signature(layer)
        first.setdefault(sig, str(key))
        groups[first[sig]].append(str(key))
    return dict(groups)


def _build_parallel_model(config, pc: ParallelConfig, dtype):
    """Our model of `config` on meta with fake tp/ep groups of the mesh's sizes (pp and cp are modelled), with the
    run that drives its forward."""
    from colozoo.core.mesh import ParallelContext
    from colozoo.models import build_shard
    from colozoo.runtime.run import Run

    trace_config = ParallelConfig(tp=pc.tp, dp=pc.ep, ep=pc.ep, sequence_parallel=pc.sequence_parallel)
    context = ParallelContext(trace_config, device=torch.device("cpu"))
    model = build_shard(config, pc=context, device="meta", dtype=dtype)
    Run(model)
    return model, context


@contextlib.contextmanager
def balanced_routing(model: nn.Module):
    """Meta tensors have no routing counts: trace every MoE layer with its "balanced" routing option (each expert
    gets an equal share of the tokens), then give the layers back their own routing."""
    from colozoo.layers.moe import MoE

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    before = [m.routing for m in layers]
    for m in layers:
        m.routing = "balanced"
    try:
        yield
    finally:
        for m, routing in zip(layers, before):
            m.routing = routing


def _meta_like(p: torch.Tensor, dtype) -> torch.Tensor:
    return torch.empty_like(p, device="meta", dtype=dtype if p.is_floating_point() else p.dtype)


def _meta_copy_run(model: nn.Module, inputs: dict, dtype):
    """Run `model` with meta stand-ins for its parameters and buffers (for models not built on meta)."""
    from torch.func import functional_call

    stand_ins = {name: nn.Parameter(_meta_like(p, dtype), requires_grad=p.requires_grad)
                 for name, p in model.named_parameters()}
    stand_ins.update({name: _meta_like(b, dtype) for name, b in model.named_buffers()})
    return lambda m: _loss_of(functional_call(m, stand_ins, (), inputs))


@contextlib.contextmanager
def _representatives_only(model: nn.Module, prefix, container, kinds):
    """Temporarily keep one layer of each kind in the model's layer container (the model's own loop then runs
    just those). Yields {traced key: representative key} where a ModuleList renumbers them."""
    if container is None or len(kinds) == len(container):
        yield {}
        return
    reps = sorted(kinds, key=lambda k: int(k) if k.isdigit() else k)
    if isinstance(container, nn.ModuleDict):
        subset, renamed = nn.ModuleDict({k: container[k] for k in reps}), {}
    else:
        subset = nn.ModuleList([container[int(k)] for k in reps])
        renamed = {str(i): k for i, k in enumerate(reps)}
    parent_name, _, attr = prefix.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    stages = model.run.stages if getattr(model, "run", None) is not None else []  # a colozoo model's one stage
    setattr(parent, attr, subset)
    for stage in stages:
        stage.layers = subset
    try:
        yield renamed
    finally:
        setattr(parent, attr, container)
        for stage in stages:
            stage.layers = container


def _rename_layers(trace: Trace, layer_prefix: str, renamed: dict):
    """Module names of a renumbered ModuleList back to the representative layer keys."""
    def fix(name):
        if name.startswith(layer_prefix):
            key, _, rest = name[len(layer_prefix):].partition(".")
            name = layer_prefix + renamed.get(key, key) + ("." + rest if rest else "")
        return name

    trace.steps = [(fix(m), *rest) for m, *rest in trace.steps]
    for saved in trace.saved.values():
        saved.module = fix(saved.module)
    for c in trace.collectives:
        c.module = fix(c.module)
    trace.params_used_by = {k: {fix(m) for m in v} for k, v in trace.params_used_by.items()}
    trace.module_inputs = {fix(k): v for k, v in trace.module_inputs.items()}


def _loss_of(out):
    loss = getattr(out, "loss", None)
    if loss is None and getattr(out, "last_hidden_state", None) is not None:  # encoders without a head (BertModel)
        return out.last_hidden_state.float().sum()
    if loss is None:
        if isinstance(out, torch.Tensor):
            return out.float().sum()
        if isinstance(out, dict) and "loss" in out:
            return out["loss"]
        raise ProfilerError("the model's output has no loss; pass inputs with labels or a model returning a tensor")
    return loss


def default_seq_len(config) -> int:
    return min(getattr(config, "max_position_embeddings", 1024) or 1024, 2048) if config is not None else 1024


@dataclass
class ModelTrace:
    """What tracing one micro-batch teaches about a model at given tp/ep/sp and local sequence length; the
    pipeline, data parallel and training options are applied afterwards by `assemble`."""
    name: str
    units: dict                  # unit key -> UnitCost
    layers: list                 # global layer keys in order
    total_params: int
    tied_bytes: int              # owned by the embedding, used by the head: duplicated on the last pp stage
    batch_size: int
    local_seq: int
    dtype: str

    config: object = None  # the HF config of a colozoo model: pipeline stages are split as the model splits them
    # what assemble derives from this trace alone (unit dicts, core FLOPs, stage splits), kept with it
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    def memoized(self, key, compute):
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    def scaled(self, batch_size: int) -> "ModelTrace":
        """The same model at another micro-batch size, scaled proportionally (the planner traces every size it
        searches, so this serves only sizes it did not trace)."""
        import copy

        f = batch_size / self.batch_size
        units = {}
        for key, u in self.units.items():
            v = copy.deepcopy(u)
            for attr in ("fwd_flops", "bwd_flops", "saved_bytes", "attention_core_bytes", "input_bytes",
                         "transient_bytes", "fwd_transient_bytes", "bwd_transient_bytes"):
                setattr(v, attr, int(round(getattr(u, attr) * f)))
            v.comm = {k: n * f for k, n in u.comm.items()}
            v.ops = {op: {k: (n if k == "calls" else int(round(n * f))) for k, n in st.items()}
                     for op, st in u.ops.items()}
            v.kernels = {key: [count * f, flops * f, nbytes * f] for key, (count, flops, nbytes) in u.kernels.items()}
            units[key] = v
        return ModelTrace(self.name, units, self.layers, self.total_params, self.tied_bytes, batch_size,
                          self.local_seq, self.dtype, config=self.config)


def trace_model(model_or_name, batch_size, seq_len: int, mesh=None, dtype: str = "bfloat16",
                target: str = "cuda", inputs: dict | None = None):
    """Trace one micro-batch (one layer of each kind) at the mesh's tp, ep, sp and cp (as seq_len / cp).

    `batch_size` may be a list: the model is built once and traced at each size ({size: ModelTrace})."""
    pc = parse_mesh(mesh)
    config, generic = _resolve(model_or_name)
    torch_dtype = DTYPES[dtype]
    if seq_len % pc.cp:
        raise ProfilerError(f"seq_len={seq_len} must be divisible by cp={pc.cp}")
    local_seq = seq_len // pc.cp
    if generic is not None and (pc.tp > 1 or pc.ep > 1 or pc.pp > 1):
        raise ProfilerError(f"{type(generic).__name__} is not a colozoo model: only dp and cp apply to it "
                            f"(got tp={pc.tp}, pp={pc.pp}, ep={pc.ep})")
    sizes = list(batch_size) if isinstance(batch_size, (list, tuple)) else [batch_size]
    from colozoo.kernels import use_kernels

    traces = {}
    with use_kernels("torch"), fake_world(max(pc.tp * pc.ep, 1)), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # c10d's deprecation notes on every traced collective
        if generic is not None:
            model, group_names = generic, {}
            params = {n: _meta_like(p, torch_dtype).requires_grad_(p.requires_grad and p.is_floating_point())
                      for n, p in model.named_parameters()}
        else:
            model, context = _build_parallel_model(config, pc, torch_dtype)
            params = dict(model.named_parameters())
            # tp sub-groups ("tp/2": replicated kv heads summing their gradients) are priced as tp traffic
            group_names = {g: name.split("/")[0] for name, g in context.groups.items()
                           if g is not None and name.split("/")[0] in ("tp", "ep")}
        prefix, container = _layer_container(model)
        kinds = _kinds(container) if container is not None else {}
        all_layers = [k for keys in kinds.values() for k in keys]
        with _representatives_only(model, prefix, container, kinds) as renamed:
            for size in sizes:
                batch = inputs
                if batch is None and hasattr(model, "example_inputs"):  # images, per-example labels (bert, vit)
                    batch = model.example_inputs(size, local_seq, device="meta")
                if batch is None:
                    ids = torch.zeros(size, local_seq, dtype=torch.long, device="meta")
                    batch = {"input_ids": ids, "labels": ids}
                if generic is not None:
                    run = _meta_copy_run(model, batch, torch_dtype)
                else:
                    run = lambda m, batch=batch: _loss_of(m(**batch))  # noqa: E731
                for p in params.values():
                    p.grad = None
                with balanced_routing(model):
                    stages = model.run.stages if getattr(model, "run", None) is not None else ()
                    traces[size] = trace_step(model, run, target=target, group_names=group_names, wrappers=stages)
    root = type(model).__name__
    layer_prefix = f"{root}.{prefix}." if prefix else None
    if all(k.isdigit() for k in all_layers):
        all_layers = sorted(all_layers, key=int)
    name = model_or_name if isinstance(model_or_name, str) else type(model_or_name).__name__
    out = {}
    for size, trace in traces.items():
        if renamed:
            _rename_layers(trace, f"{root}.{prefix}.", renamed)
        step_unit = _unit_of_steps(trace, layer_prefix)
        module_unit = _module_units(trace, step_unit)
        units = _units(trace, step_unit, layer_prefix, kinds, local_seq)
        _assign_params(units, params, prefix, kinds, module_unit, root)
        tied = _tied_head_bytes(trace, params, prefix, module_unit, root)
        out[size] = ModelTrace(name, units, all_layers, _global_params(params, pc), tied, size, local_seq, dtype,
                               config=config if generic is None else None)
    return out if isinstance(batch_size, (list, tuple)) else out[batch_size]


def _resolve(model_or_name):
    """(config, generic module or None)."""
    from colozoo.models.base import ParallelModel

    if isinstance(model_or_name, str):
        return get_config(model_or_name), None
    if isinstance(model_or_name, ParallelModel):
        return model_or_name.config, None
    if isinstance(model_or_name, nn.Module):
        return getattr(model_or_name, "config", None), model_or_name
    if hasattr(model_or_name, "model_type"):
        return model_or_name, None
    raise ProfilerError(f"profile() takes a model name, a transformers config or an nn.Module, got "
                        f"{type(model_or_name).__name__}")


def _unit_of_steps(trace: Trace, layer_prefix: str | None):
    """Unit name of every op: 'layer:<key>', or 'embed' / 'head' for ops before / after the layers."""
    names = []
    bounds = {}
    for i, (module, phase, _, _) in enumerate(trace.steps):
        if layer_prefix and module.startswith(layer_prefix):
            key = module[len(layer_prefix):].split(".")[0]
            names.append(f"layer:{key}")
            lo, hi = bounds.get(phase, (i, i))
            bounds[phase] = (min(lo, i), max(hi, i))
        else:
            names.append(None)
    for i, (module, phase, _, _) in enumerate(trace.steps):
        if names[i] is None:
            if phase not in bounds:
                names[i] = "model" if not layer_prefix else "embed"
            else:
                before = i < bounds[phase][0]
                names[i] = ("embed" if before else "head") if phase == "forward" else ("head" if before else "embed")
    return names


def _units(trace: Trace, step_unit, layer_prefix, kinds, local_seq: int) -> dict[str, UnitCost]:
    units: dict[str, UnitCost] = {}

    def unit(name) -> UnitCost | None:
        if name not in units:
            if name.startswith("layer:"):
                key = name.split(":", 1)[1]
                if key not in kinds:  # a generic model traced whole: its other layers repeat a representative
                    return None
                units[name] = UnitCost(name=f"layer {key}", count=len(kinds[key]), layers=kinds[key])
            else:
                units[name] = UnitCost(name=name)
        return units[name]

    temps = trace.temporaries()
    for i, (module, phase, op, fl) in enumerate(trace.steps):
        u = unit(step_unit[i])
        if u is None:
            continue
        stats = u.ops.setdefault(op, {"calls": 0, "fwd_flops": 0, "bwd_flops": 0, "saved_bytes": 0})
        if phase == "forward":
            stats["calls"] += 1
            stats["fwd_flops"] += fl
            u.fwd_flops += fl
        else:
            stats["bwd_flops"] += fl
            u.bwd_flops += fl
        kernel = trace.kernels.get(i)
        if kernel is not None:
            entry = u.kernels.setdefault(kernel_key("fwd" if phase == "forward" else "bwd", op, kernel), [0, 0, 0])
            entry[0] += 1
            entry[1] += fl
            entry[2] += kernel.nbytes
        u.transient_bytes = max(u.transient_bytes, temps[i])
        if phase == "forward":
            u.fwd_transient_bytes = max(u.fwd_transient_bytes, temps[i])
        else:
            u.bwd_transient_bytes = max(u.bwd_transient_bytes, temps[i])
    for saved in trace.saved.values():
        u = unit(_unit_of_saved(saved, trace, step_unit, layer_prefix))
        if u is None:
            continue
        u.saved_bytes += saved.nbytes
        u.ops.setdefault(saved.op, {"calls": 0, "fwd_flops": 0, "bwd_flops": 0, "saved_bytes": 0})
        u.ops[saved.op]["saved_bytes"] += saved.nbytes
        if len(saved.shape) >= 2 and saved.shape[-1] == saved.shape[-2] == local_seq:
            u.attention_core_bytes += saved.nbytes
    for c in trace.collectives:
        u = unit(step_unit[c.step])
        if u is None:
            continue
        key = f"{c.group}.{c.name}"
        u.comm[key] = u.comm.get(key, 0) + c.nbytes
        u.comm_calls[key] = u.comm_calls.get(key, 0) + 1
    if layer_prefix:
        for name, u in units.items():
            if name.startswith("layer:"):
                u.input_bytes = trace.module_inputs.get(layer_prefix + name.split(":", 1)[1], 0)
    return units


def _unit_of_saved(saved, trace: Trace, step_unit, layer_prefix) -> str:
    """A tensor is packed just before or just after its op is recorded: take the nearest op of its module."""
    i = min(saved.step, len(step_unit) - 1)
    if layer_prefix and saved.module.startswith(layer_prefix):
        return f"layer:{saved.module[len(layer_prefix):].split('.')[0]}"
    while i > 0 and layer_prefix and trace.steps[i][0].startswith(layer_prefix):
        i -= 1
    return step_unit[i]


def _module_units(trace: Trace, step_unit) -> dict[str, str]:
    """Module name -> the unit in whose forward it (or a submodule) first ran."""
    out = {}
    for (module, phase, _, _), unit in zip(trace.steps, step_unit):
        if phase != "forward":
            continue
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            out.setdefault(".".join(parts[:i]), unit)
    return out


def _assign_params(units, params, prefix, kinds, module_unit, root: str):
    """Parameter bytes per unit: one layer of each kind, and the rest by where their module ran."""
    from colozoo.layers.shard import spec_of

    layer_of_key = {k: rep for rep, keys in kinds.items() for k in keys}
    fallback = "embed" if "embed" in units else next(iter(units))
    for name, p in params.items():
        nbytes = p.numel() * p.element_size()
        if prefix and name.startswith(prefix + "."):
            key = name[len(prefix) + 1:].split(".")[0]
            if layer_of_key.get(key) != key or f"layer:{key}" not in units:
                continue
            unit = units[f"layer:{key}"]
        else:
            owner = module_unit.get(f"{root}.{name.rsplit('.', 1)[0]}", fallback)
            unit = units.get(owner, units[fallback])
        unit.param_bytes += nbytes
        if not p.requires_grad:
            unit.frozen_param_bytes += nbytes
        if any(split.mesh_dim == "ep" for split in spec_of(p)):
            unit.expert_param_bytes += nbytes


def _tied_head_bytes(trace: Trace, params, prefix, module_unit, root) -> int:
    """Bytes of parameters owned before the layers but also used after them (tied embeddings): with
    pipeline parallelism the last stage holds its own copy."""
    total = 0
    for name, modules in trace.params_used_by.items():
        if prefix and name.startswith(prefix + "."):
            continue
        owner = module_unit.get(f"{root}.{name.rsplit('.', 1)[0]}")
        if owner == "embed" and any(module_unit.get(m) == "head" for m in modules):
            total += params[name].numel() * params[name].element_size()
    return total


def _global_params(params, pc: ParallelConfig) -> int:
    """Global parameter count: local shards scaled back up along every split (vocab padding included)."""
    from colozoo.layers.shard import spec_of

    sizes = {"tp": pc.tp, "ep": pc.ep}
    total = 0
    for p in params.values():
        n = p.numel()
        for split in spec_of(p):  # fused chunks know their global length (replicated kv heads count once)
            n = n // p.shape[split.dim] * sum(split.chunks) if split.chunks else n * sizes.get(split.mesh_dim, 1)
        total += n
    return total
