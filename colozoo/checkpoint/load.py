"""The one loader: a (possibly meta-initialised) sharded model reads only its own slices, from any source that
looks tensors up by our global names (an HF checkpoint through `HFTensors`, a colozoo checkpoint, fresh tensors)."""
from __future__ import annotations

import dataclasses
import re

import torch

import math

from colozoo.layers.shard import held_pieces, local_shape, materialize, spec_of
from colozoo.core.mesh import coords_of

from colozoo.converters import family_module, hf_tensor_names
from colozoo.core.errors import CheckpointError

from .format import ColozooTensor
from .layout import ModelLayout
from .readers import GlobalTensor, TensorReader

def _resolve_prefix(reader: TensorReader, sources, prefix: str, namings=()):
    """Checkpoints of a base model (e.g. GPT2Model) lack the task-model prefix; adapt the names. `namings`: lists
    of (regex, replacement) renames to other namings of the same tensors (transformers' in-memory names where they
    differ from those it saves, a multimodal checkpoint's text model), used when one matches the checkpoint better."""
    namings = [renames for renames in namings if renames]
    if namings:
        candidates = [sources] + [{k: s.renamed(renames) for k, s in sources.items()} for renames in namings]
        names = set(reader.names())
        resolved = [_resolve_prefix(reader, c, prefix) for c in candidates]
        return max(resolved, key=lambda c: len(hf_tensor_names(c) & names))
    names = set(reader.names())
    wanted = hf_tensor_names(sources)
    if not prefix or wanted & names or not any(n.startswith(prefix) for n in wanted):
        return sources
    stripped = {k: dataclasses.replace(s, names=tuple(n.removeprefix(prefix) for n in s.names))
                for k, s in sources.items()}
    return stripped if hf_tensor_names(stripped) & names else sources


def resolve_sources(reader: TensorReader, conv, sources):
    """A family's map (`conv`: its converter module) as the loader applies it to what `reader` holds: with or
    without the task prefix, under whichever naming matches (saved, in memory, a multimodal checkpoint's)."""
    return _resolve_prefix(reader, sources, getattr(conv, "HF_PREFIX", ""),
                           (getattr(conv, "NAME_ALIASES", ()), getattr(conv, "CHECKPOINT_ALIASES", ())))


def check_unexpected(reader: TensorReader, sources, ignored=()):
    known = hf_tensor_names(sources)
    unexpected = [n for n in reader.names() if n not in known and not any(re.search(p, n) for p in ignored)]
    if unexpected:
        raise CheckpointError(f"unexpected tensors in the checkpoint: {unexpected[:8]}"
                              f"{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)} in all)")


class HFTensors:
    """An HF checkpoint's tensors under our global names: the family's map resolved against what the reader holds
    (with or without the base-model prefix, either naming of a family with two), unexpected tensors refused.
    `tensor(name)` is a lazy GlobalTensor, read slice by slice."""

    def __init__(self, reader: TensorReader, config, family: str | None = None, strict: bool = True):
        conv = family_module(family or config.model_type)
        self.reader, self.config = reader, config
        self.sources = resolve_sources(reader, conv, conv.hf_sources(config))
        if strict:
            ignored = tuple(getattr(conv, "IGNORED_HF", ()))
            if getattr(config, "tie_word_embeddings", False):
                ignored += (r"^lm_head\.weight$",)  # the tied copy some state dicts carry
            check_unexpected(reader, self.sources, ignored)

    def tensor(self, name: str) -> GlobalTensor:
        if name not in self.sources:
            raise CheckpointError(f"{self.config.model_type}: no HF source for {name!r} (converter map incomplete)")
        return GlobalTensor(self.reader, self.sources[name], name)


@torch.no_grad()
def load_global_tensors(model, lookup, device=None, layout: ModelLayout | None = None):
    """Materialise `model` with its local shards, reading only its slices of `lookup(global name)`."""
    aliases = layout.aliases if layout is not None else {}
    device = torch.device(device) if device is not None else model.parallel.device
    if any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers()):
        materialize(model, device)
        if hasattr(model, "reset_buffers"):
            model.reset_buffers()
    coords = coords_of(model.parallel)
    for name, param in model.named_parameters():
        tensor = lookup(aliases.get(name, name))
        spec = spec_of(param)
        if layout is not None:
            expected_global = layout.tensors[aliases.get(name, name)].shape
            if tuple(tensor.shape) != expected_global:
                raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)} in the checkpoint, but the "
                                      f"config gives {expected_global}")
        expected = local_shape(tensor.shape, spec, coords)
        if expected != tuple(param.shape):
            raise CheckpointError(f"{name}: checkpoint shape {tuple(tensor.shape)} gives a local shard {expected}, "
                                  f"but the model expects {tuple(param.shape)} (does the config match the weights?)")
        copy_slices(tensor, param, spec, coords)
    return model


def copy_slices(tensor, param: torch.Tensor, spec, coords):
    """Read each of the rank's slices of the global `tensor` straight into its place in `param`."""
    pieces = list(held_pieces(tuple(tensor.shape), spec, coords))
    covered = sum(math.prod(s.stop - s.start for s in _bounded(g, tensor.shape)) for _, g, _ in pieces)
    if covered != param.numel():
        param.zero_()  # vocabulary padding rows
    direct = isinstance(tensor, ColozooTensor) and param.device.type == "cpu"
    for _, g_index, l_index in pieces:
        if direct:
            tensor.read(g_index, out=param[l_index])
        else:
            param[l_index].copy_(tensor.read(g_index))


def _bounded(index, shape):
    return [slice(*s.indices(n)[:2]) for s, n in zip(index, shape)] + [slice(0, n) for n in shape[len(index):]]


def load_hf_weights(model, reader: TensorReader, device=None, strict: bool = True):
    """Materialise `model` (meta or not) with its local shards read from an HF checkpoint's reader."""
    return load_global_tensors(model, HFTensors(reader, model.config, model.family, strict).tensor, device)
