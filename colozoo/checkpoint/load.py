"""Load HF weights into a (possibly meta-initialised) sharded model: each rank reads only its own slices."""
from __future__ import annotations

import dataclasses
import re

import torch

from colozoo.layers.shard import load_shard, local_shape, materialize, spec_of
from colozoo.core.mesh import coords_of

from colozoo.converters import family_module, hf_tensor_names
from colozoo.core.errors import CheckpointError

from .sources import GlobalTensor, TensorReader

def _resolve_prefix(reader: TensorReader, sources, prefix: str, aliases=()):
    """Checkpoints of a base model (e.g. GPT2Model) lack the task-model prefix; adapt the names. `aliases`:
    (regex, replacement) renames to another naming of the same tensors (ViT: transformers' in-memory names
    differ from those it saves), used when they match the checkpoint better."""
    if aliases:
        renamed = {k: dataclasses.replace(s, names=tuple(_rename(n, aliases) for n in s.names)) for k, s in sources.items()}
        names = set(reader.names())
        candidates = [_resolve_prefix(reader, c, prefix) for c in (sources, renamed)]
        return max(candidates, key=lambda c: len(hf_tensor_names(c) & names))
    names = set(reader.names())
    wanted = hf_tensor_names(sources)
    if not prefix or wanted & names or not any(n.startswith(prefix) for n in wanted):
        return sources
    stripped = {k: dataclasses.replace(s, names=tuple(n.removeprefix(prefix) for n in s.names))
                for k, s in sources.items()}
    return stripped if hf_tensor_names(stripped) & names else sources


def _rename(name: str, renames) -> str:
    for pattern, replacement in renames:
        name = re.sub(pattern, replacement, name)
    return name


def check_unexpected(reader: TensorReader, sources, ignored=()):
    known = hf_tensor_names(sources)
    unexpected = [n for n in reader.names() if n not in known and not any(re.search(p, n) for p in ignored)]
    if unexpected:
        raise CheckpointError(f"unexpected tensors in the checkpoint: {unexpected[:8]}"
                              f"{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)} in all)")


@torch.no_grad()
def load_hf_weights(model, reader: TensorReader, device=None, strict: bool = True):
    """Materialise `model` (meta or not) with its local shards read from an HF checkpoint."""
    conv = family_module(model.family)
    sources = _resolve_prefix(reader, conv.hf_sources(model.config), getattr(conv, "HF_PREFIX", ""),
                              getattr(conv, "NAME_ALIASES", ()))
    if strict:
        ignored = tuple(getattr(conv, "IGNORED_HF", ()))
        if getattr(model.config, "tie_word_embeddings", False):
            ignored += (r"^lm_head\.weight$",)  # the tied copy some state dicts carry
        check_unexpected(reader, sources, ignored)
    device = torch.device(device) if device is not None else model.pc.device
    if any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers()):
        materialize(model, device)
        if hasattr(model, "reset_buffers"):
            model.reset_buffers()
    coords = coords_of(model.pc)
    for name, param in model.named_parameters():
        if name not in sources:
            raise CheckpointError(f"parameter {name!r} of {model.family} has no HF source (converter map incomplete)")
        tensor = GlobalTensor(reader, sources[name], name)
        spec = spec_of(param)
        expected = local_shape(tensor.shape, spec, coords)
        if expected != tuple(param.shape):
            raise CheckpointError(f"{name}: checkpoint tensor {sources[name].names} has global shape {tensor.shape}, "
                                  f"which gives a local shard {expected}, but the model expects {tuple(param.shape)} "
                                  f"(does the config match the weights?)")
        param.copy_(load_shard(tensor.read, tensor.shape, spec, coords, dtype=param.dtype, device=param.device))
    return model
