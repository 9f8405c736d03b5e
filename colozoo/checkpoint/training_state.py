"""Training tensors that any mesh reads: the model's parameters and, beside each, its optimizer states (AdamW's
exp_avg / exp_avg_sq, offloaded master weights), all stored as *global* tensors in the colozoo format.

A state tensor has its parameter's local shape, so it shares the parameter's shard spec and its place in the
global tensor: `local_boxes` maps each local tensor (a tp/ep shard, or an FSDP2 DTensor's rows of it) onto the
global tensor, padding excluded. Every rank writes the boxes it owns into its own safetensors file; rank 0 then
writes two indexes of the same schema over those files:

    colozoo_index.json     the model's tensors: the directory is a colozoo checkpoint (convert, from_pretrained)
    training_index.json    "exp_avg:<param>", "exp_avg_sq:<param>", "master:<param>" ...

Reading goes through ColozooCheckpoint slice reads, so another tp / pp / dp, FSDP or DDP, reads the same names.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from colozoo.checkpoint.format import INDEX_NAME, ColozooCheckpoint, make_index, tensor_entry, write_index
from colozoo.checkpoint.layout import ModelLayout
from colozoo.checkpoint.safetensors_io import SafetensorsWriter
from colozoo.core.dtypes import dtype_name
from colozoo.core.errors import CheckpointError
from colozoo.core.mesh import coords_of
from colozoo.layers.shard import local_part, local_shape, stored_pieces

TRAINING_INDEX = "training_index.json"
SEP = ":"  # "<state>:<parameter>"; parameter names never hold one


def state_name(kind: str, param: str) -> str:
    return f"{kind}{SEP}{param}"


def _bounded(index, shape) -> list[slice]:
    return [slice(*s.indices(n)[:2]) for s, n in zip(index, shape)] + [slice(0, n) for n in shape[len(index):]]


def local_boxes(param, global_shape, spec, coords) -> list[tuple[tuple, tuple]]:
    """(global slices, local slices) pairs placing the data of `local_part(param)` in the global tensor; padding
    excluded. An FSDP2 DTensor's local part is a box of the tp-local tensor (the DTensor's own global shape)."""
    tp_local = local_shape(global_shape, spec, coords)
    if isinstance(param, DTensor):
        if tuple(param.shape) != tuple(tp_local):
            raise CheckpointError(f"a DTensor of shape {tuple(param.shape)} is not the tp-local shape {tp_local}")
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        size, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    else:
        size, offset = tp_local, (0,) * len(tp_local)
    boxes = []
    for _, g_index, l_index in stored_pieces(global_shape, spec, coords):
        g, loc = _bounded(g_index, global_shape), _bounded(l_index, tp_local)
        for d in range(len(global_shape)):
            lo, hi = max(loc[d].start, offset[d]), min(loc[d].stop, offset[d] + size[d])
            if lo >= hi:
                break
            start = g[d].start + lo - loc[d].start
            g[d], loc[d] = slice(start, start + hi - lo), slice(lo - offset[d], hi - offset[d])
        else:
            boxes.append((tuple(g), tuple(loc)))
    return boxes


def _writes(param, spec, parallel) -> bool:
    """One owner per datum: tp rank 0 of a tp-replicated tensor; among data replicas, FSDP's every rank (each
    writes its own rows), else the first replica (of those holding the same experts, for an expert)."""
    split = {s.mesh_dim for s in spec}
    if "tp" not in split and parallel.rank("tp") != 0:
        return False
    if isinstance(param, DTensor):
        return True
    replica = parallel.rank("dp_cp") // parallel.size("ep") if "ep" in split else parallel.rank("dp_cp")
    return replica == 0


@torch.no_grad()
def own_pieces(model, layout: ModelLayout, states: dict[str, dict[str, torch.Tensor]]):
    """[(global name, global slices, the data: a view of a local tensor)] this rank writes. `states[param name]`:
    {kind: tensor of the parameter's local shape} (optimizer states, masters)."""
    parallel, coords = model.parallel, coords_of(model.parallel)
    out = []
    for name, param in model.named_parameters():
        info = layout.tensors.get(name)
        if name in layout.aliases or info is None or info.stage != parallel.rank("pp"):
            continue  # a tied copy: the owner's values are the same
        if not _writes(param, info.spec, parallel):
            continue
        boxes = local_boxes(param, info.shape, info.spec, coords)
        for tensor_name, tensor in [(name, param), *((state_name(k, name), t) for k, t in states.get(name, {}).items())]:
            out += [(tensor_name, g, local_part(tensor).detach()[loc]) for g, loc in boxes]
    return out


def write_rank_file(directory: Path, file: str, pieces) -> dict | None:
    """This rank's safetensors file of `own_pieces`; returns {"file", "info", "pieces": [(name, piece json,
    dtype name)]} for write_indexes."""
    if not pieces:
        return None
    counts = {}
    for name, *_ in pieces:
        counts[name] = counts.get(name, 0) + 1
    keys, seen = [], {}
    for name, *_ in pieces:
        i = seen[name] = seen.get(name, -1) + 1
        keys.append(name if counts[name] == 1 else f"{name}#{i}")
    writer = SafetensorsWriter(directory / file, [(k, data.dtype, tuple(data.shape))
                                                  for k, (_, _, data) in zip(keys, pieces)])
    try:
        for key, (_, _, data) in zip(keys, pieces):
            writer.write(key, data.cpu())
    except BaseException:
        writer.abort()
        raise
    entries = [(name, {"file": file, "key": key, "offsets": [s.start for s in g], "shape": list(data.shape)},
                dtype_name(data.dtype)) for key, (name, g, data) in zip(keys, pieces)]
    return {"file": file, "info": writer.close(), "pieces": entries}


def write_indexes(directory: Path, layout: ModelLayout, mesh: dict, shards: list):
    """Rank 0: colozoo_index.json over the model's tensors, training_index.json over the states."""
    by_index = {INDEX_NAME: ({}, {}, {}), TRAINING_INDEX: ({}, {}, {})}  # files, pieces, dtypes
    for shard in filter(None, shards):
        for name, piece, dtype in shard["pieces"]:
            files, pieces, dtypes = by_index[TRAINING_INDEX if SEP in name else INDEX_NAME]
            files[shard["file"]] = shard["info"]
            pieces.setdefault(name, []).append(piece)
            dtypes[name] = getattr(torch, dtype)
    missing = [n for n in layout.tensors if n not in by_index[INDEX_NAME][1]]
    if missing:
        raise CheckpointError(f"no rank saved {missing[:8]}")
    for index_name, (files, pieces, dtypes) in by_index.items():
        tensors = {n: tensor_entry(layout.tensors[n.rpartition(SEP)[2]], dtypes[n], p) for n, p in pieces.items()}
        write_index(directory, make_index(layout, mesh, tensors, files), index_name)


class TrainingCheckpoint:
    """A saved training state's tensors, read into any mesh's local tensors by slices."""

    def __init__(self, path, layout: ModelLayout):
        self.path, self.layout = Path(path), layout
        self.model = ColozooCheckpoint(path)
        self.states = ColozooCheckpoint(path, index_name=TRAINING_INDEX)

    def state_kinds(self, param: str) -> list[str]:
        """The states saved beside a parameter (e.g. ["exp_avg", "exp_avg_sq"])."""
        name = self.layout.canonical(param)
        return [n.rpartition(SEP)[0] for n in self.states.names() if n.rpartition(SEP)[2] == name]

    def has(self, kind: str, param: str) -> bool:
        return state_name(kind, self.layout.canonical(param)) in self.states.index["tensors"]

    @torch.no_grad()
    def read_into(self, model, param_name: str, param, target=None, kind: str | None = None):
        """Fill `target` (default: the parameter itself; a tensor of its local shape) with this rank's slices of
        the parameter, or of its state `kind`."""
        name = self.layout.canonical(param_name)
        info = self.layout.tensors[name]
        source = self.model.tensor(name) if kind is None else self.states.tensor(state_name(kind, name))
        if tuple(source.shape) != info.shape:
            raise CheckpointError(f"{self.path}: {source.name!r} has shape {tuple(source.shape)}, the model's "
                                  f"{name!r} has {info.shape}")
        local = local_part(param if target is None else target)
        boxes = local_boxes(param, info.shape, info.spec, coords_of(model.parallel))
        if sum(_numel(loc) for _, loc in boxes) != local.numel():
            local.zero_()  # vocabulary padding rows
        for g, loc in boxes:
            local[loc].copy_(source.read(g))


def _numel(index) -> int:
    n = 1
    for s in index:
        n *= s.stop - s.start
    return n
