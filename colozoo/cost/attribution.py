"""A model trace attributed to units: every op, saved tensor and collective to the embedding, a kind of layer or
the head (by module name and by position around the layers), with each unit's parameters, kernels and traffic."""
from __future__ import annotations

from collections import defaultdict

from colozoo.core.mesh import ParallelConfig
from colozoo.cost.report import UnitCost
from colozoo.cost.trace import Trace, kernel_key

ATTENTION_KERNEL = "scaled_dot_product"  # in the op names of the fused attention kernels the trace runs (trace.py)


def rename_layers(trace: Trace, layer_prefix: str, renamed: dict):
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


def unit_of_steps(trace: Trace, layer_prefix: str | None):
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


def units_of(trace: Trace, step_unit, layer_prefix, kinds, local_seq: int) -> dict[str, UnitCost]:
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
    saved_by = defaultdict(set)  # unit -> record ids of the tensors it saves
    for rid, saved in trace.saved.items():
        name = _unit_of_saved(saved, trace, step_unit, layer_prefix)
        saved_by[name].add(rid)
        u = unit(name)
        if u is None:
            continue
        u.saved_bytes += saved.nbytes
        u.ops.setdefault(saved.op, {"calls": 0, "fwd_flops": 0, "bwd_flops": 0, "saved_bytes": 0})
        u.ops[saved.op]["saved_bytes"] += saved.nbytes
        if len(saved.shape) >= 2 and saved.shape[-1] == saved.shape[-2] == local_seq:
            u.attention_core_bytes += saved.nbytes
        if ATTENTION_KERNEL in saved.op:  # v, a slice of the fused qkv projection, keeps all of its output
            u.attention_unviewed_bytes += saved.nbytes - saved.viewed_bytes
        if layer_prefix and saved.module.startswith(layer_prefix):  # "mlp.experts|mul|2880": module, op, width
            key = f"{saved.module[len(layer_prefix):].partition('.')[2]}|{saved.op}|{saved.shape[-1:]}"
            u.module_saved[key] = u.module_saved.get(key, 0) + saved.nbytes
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
                inside = layer_prefix + name.split(":", 1)[1] + "."
                u.norm_inputs = {m[len(inside):]: n for m, n in trace.module_inputs.items()
                                 if m.startswith(inside) and m.endswith("norm")}
    walk_memory(units, trace, step_unit, temps, saved_by)
    return units


def walk_memory(units: dict, trace: Trace, step_unit, temps: list, saved_by: dict):
    """What each unit holds at its worst op, in its forward and in its backward: the tensors it has saved so far (a
    layer's MLP saves nothing before its attention has run), or not yet released (autograd frees a node's saved
    tensors once the node has run, so the MLP has let go of its own before the attention's backward begins), beside
    the temporaries alive then (`temps`); and in its backward the gradients it makes: each one only until it is added
    to one kept from before (a later micro-batch's, or a buffer's), or, with nothing there yet, all it has made so
    far. `saved_by`: unit -> record ids of the tensors it saves.
    Sets UnitCost.fwd_unsaved_bytes, bwd_released_bytes, bwd_fresh_grad_bytes, bwd_kept_grad_bytes,
    bwd_outlived_bytes and grad_bytes."""
    life = trace.storages
    ops, grads_by = defaultdict(list), defaultdict(set)  # unit -> its ops / record ids of the gradients it makes
    for i, name in enumerate(step_unit):
        ops[name].append(i)
    for rid in trace.grad_keys:  # the final gradients, alive from the op that makes them on
        if life[rid].birth < len(step_unit):
            grads_by[step_unit[life[rid].birth]].add(rid)
    for name, u in units.items():
        made_in_bwd = grads_by[name] - saved_by[name]  # one made in the forward (the fused head's) is saved till then
        held = trace.alive_at_each_op(life[r] for r in saved_by[name])
        made = trace.alive_at_each_op(life[r] for r in made_in_bwd)  # never freed: made[i] - made[i - 1] is op i's
        fwd = [held[i] + temps[i] for i in ops[name] if trace.steps[i][1] == "forward"]
        bwd = [i for i in ops[name] if trace.steps[i][1] != "forward"]
        if fwd:
            u.fwd_unsaved_bytes = max(0, u.saved_bytes + u.fwd_transient_bytes - max(fwd))
        if bwd:
            worst = max(held[i] + temps[i] for i in bwd)
            u.bwd_released_bytes = max(0, u.saved_bytes + u.bwd_transient_bytes - worst)
            u.bwd_fresh_grad_bytes = max(held[i] + temps[i] + made[i] - (made[i - 1] if i else 0) for i in bwd) - worst
            u.bwd_kept_grad_bytes = max(held[i] + temps[i] + made[i] for i in bwd) - worst
            u.bwd_outlived_bytes = sum(life[r].nbytes for r in saved_by[name] - grads_by[name]
                                       if life[r].death is None or life[r].death > bwd[-1] + 1)
        u.grad_bytes = sum(life[r].nbytes for r in grads_by[name])


def _unit_of_saved(saved, trace: Trace, step_unit, layer_prefix) -> str:
    """A tensor is packed just before or just after its op is recorded: take the nearest op of its module."""
    i = min(saved.step, len(step_unit) - 1)
    if layer_prefix and saved.module.startswith(layer_prefix):
        return f"layer:{saved.module[len(layer_prefix):].split('.')[0]}"
    while i > 0 and layer_prefix and trace.steps[i][0].startswith(layer_prefix):
        i -= 1
    return step_unit[i]


def module_units(trace: Trace, step_unit) -> dict[str, str]:
    """Module name -> the unit in whose forward it (or a submodule) first ran."""
    out = {}
    for (module, phase, _, _), unit in zip(trace.steps, step_unit):
        if phase != "forward":
            continue
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            out.setdefault(".".join(parts[:i]), unit)
    return out


def assign_params(units, params, prefix, kinds, module_unit, root: str):
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


def tied_head_bytes(trace: Trace, params, prefix, module_unit, root) -> int:
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


def global_params(params, degrees: ParallelConfig) -> int:
    """Global parameter count: local shards scaled back up along every split (vocab padding included)."""
    from colozoo.layers.shard import spec_of

    sizes = {"tp": degrees.tp, "ep": degrees.ep}
    total = 0
    for p in params.values():
        n = p.numel()
        for split in spec_of(p):  # fused chunks know their global length (replicated kv heads count once)
            n = n // p.shape[split.dim] * sum(split.chunks) if split.chunks else n * sizes.get(split.mesh_dim, 1)
        total += n
    return total
