"""An optimizer's state by parameter name, for checkpoints any mesh reads: each parameter's tensor states (AdamW's
exp_avg / exp_avg_sq, an OffloadedAdamW's fp32 master) have the parameter's local shape and are saved as global
tensors beside it; its scalar states (the step) and the param groups' hyperparameters go to JSON."""
from __future__ import annotations

import torch

from colozoo.core.errors import CheckpointError
from colozoo.runtime.offload import OffloadedAdamW


def _by_parameter(model, optimizer):
    """[(name, parameter, the key of its state in the torch optimizer)] (an OffloadedAdamW's key is the master)."""
    names = {id(p): n for n, p in model.named_parameters()}
    if isinstance(optimizer, OffloadedAdamW):
        return optimizer.optimizer, [(names[id(p)], p, m) for p, m in zip(optimizer.params, optimizer.master)]
    return optimizer, [(names[id(p)], p, p) for group in optimizer.param_groups for p in group["params"]]


def _json_value(value):
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, tuple):
        return list(value)
    return value


def optimizer_tensors(model, optimizer, canonical=lambda name: name) -> tuple[dict, dict]:
    """({parameter name: {kind: local tensor}}, JSON: param groups and {canonical name: {kind: [value, dtype]}})."""
    inner, entries = _by_parameter(model, optimizer)
    tensors, scalars = {}, {}
    for name, param, key in entries:
        mine = tensors.setdefault(name, {})
        if isinstance(optimizer, OffloadedAdamW):
            mine["master"] = key
        for kind, value in inner.state.get(key, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                mine[kind] = value
            else:
                dtype = str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else None
                scalars.setdefault(canonical(name), {})[kind] = [_json_value(value), dtype]
    groups = [{k: _json_value(v) for k, v in group.items() if k != "params"} for group in inner.param_groups]
    return tensors, {"class": type(optimizer).__name__, "param_groups": groups, "scalars": scalars}


@torch.no_grad()
def restore_optimizer(model, optimizer, checkpoint, saved: dict):
    """Fill the optimizer's state from a TrainingCheckpoint (this rank's slices) and its JSON `saved`."""
    inner, entries = _by_parameter(model, optimizer)
    if len(saved["param_groups"]) != len(inner.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved['param_groups'])} parameter groups, "
                              f"this run's {len(inner.param_groups)}")
    for group, values in zip(inner.param_groups, saved["param_groups"]):
        for k, v in values.items():
            if k in group:
                group[k] = tuple(v) if isinstance(group[k], tuple) else v
    for name, param, key in entries:
        if isinstance(optimizer, OffloadedAdamW):
            kind = "master" if checkpoint.has("master", name) else None  # else the (equal) fp32 weights
            checkpoint.read_into(model, name, param, target=key, kind=kind)
        state = {}
        for kind, (value, dtype) in saved["scalars"].get(checkpoint.layout.canonical(name), {}).items():
            state[kind] = torch.tensor(value, dtype=getattr(torch, dtype)) if dtype else value
        for kind in checkpoint.state_kinds(name):
            if kind != "master":
                state[kind] = torch.zeros_like(key, memory_format=torch.preserve_format)
                checkpoint.read_into(model, name, param, target=state[kind], kind=kind)
        if state:
            inner.state[key] = state
        else:
            inner.state.pop(key, None)
