"""Activation checkpointing: a layer ("full") or its attention block ("selective") recomputes its forward in
backward. Modules are wrapped in place by torch's composable `checkpoint` (forward hooks), so their names, and
with them every global parameter name, stay as they were."""
from __future__ import annotations

import contextlib

import torch
from torch.distributed._composable import checkpoint
from torch.distributed._composable.contract import _get_registry

from colozoo.core.rng import get_rng_tracker
from colozoo.runtime.errors import TrainingError
from colozoo.runtime.options import CHECKPOINTING

ATTENTION_BLOCK_NAMES = ("attn", "self_attn", "attention")  # for layers that declare no `attention_block`


def _rng_tracker_contexts():
    """Recompute with the tracked (tensor-parallel) RNG states of the forward, so dropout masks on sharded
    activations match; torch's checkpoint restores only the default generators."""
    tracker = get_rng_tracker()
    saved = tracker.get_states()

    @contextlib.contextmanager
    def recompute():
        current = tracker.get_states()
        tracker.set_states(saved)
        try:
            yield
        finally:
            tracker.set_states(current)

    return contextlib.nullcontext(), recompute()


def checkpoint_module(module: torch.nn.Module):
    checkpoint(module, context_fn=_rng_tracker_contexts)


def is_checkpointed(module: torch.nn.Module) -> bool:
    return "checkpoint" in (_get_registry(module) or {})


def attention_block(layer: torch.nn.Module, index) -> torch.nn.Module:
    """The child module a layer names in `attention_block` (or the one child named like attention)."""
    name = getattr(layer, "attention_block", None)
    if name is None:
        names = [n for n, _ in layer.named_children() if n in ATTENTION_BLOCK_NAMES]
        name = names[0] if len(names) == 1 else None
    block = getattr(layer, name, None) if name is not None else None
    if not isinstance(block, torch.nn.Module):
        raise TrainingError(f"selective checkpointing found no attention block module in layer {index} "
                            f"({type(layer).__name__}: {[n for n, _ in layer.named_children()]}); "
                            f"the layer should name its attention module in `attention_block`")
    return block


def apply_activation_checkpointing(model, mode: str, layers: int | None = None):
    """Recompute each layer ("full") or only its attention block ("selective") in backward. With "full",
    `layers` recomputes only the first that many layers of this rank's stage (what the planner's
    checkpoint_layers means): the fewest that fit cost the least recomputation."""
    if mode not in CHECKPOINTING or mode == "none":
        raise TrainingError(f"activation checkpointing must be one of {CHECKPOINTING[1:]}, got {mode!r}")
    if layers is not None and (mode != "full" or not isinstance(layers, int) or layers < 0):
        raise TrainingError(f"checkpoint layers must be a count >= 0 with activation_checkpointing='full', got "
                            f"{layers!r} with {mode!r}")
    for position, (index, layer) in enumerate(model.layers.items()):
        if mode == "selective":
            checkpoint_module(attention_block(layer, index))
        elif layers is None or position < layers:
            checkpoint_module(layer)
