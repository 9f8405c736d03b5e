"""LoRA in the cost model: how many adapter parameters each layer puts on one tp rank, counted on a meta model
with colozoo.runtime.lora.apply_lora (so the count follows the same targets and fused-chunk layout as training).
Column-parallel bases keep A whole and split B over tp; row-parallel bases split A and keep B whole. Modules in
`modules_to_save` (a classifier head, trained whole beside the adapters) are replicated and count whole."""
from __future__ import annotations

import math

from colozoo.core.mesh import ParallelContext
from colozoo.cost.setup import ProfilerError
from colozoo.runtime.lora import LoraSettings

_CACHE: dict = {}  # pure: keyed by the config's values, the mesh and the LoRA settings


def _config_key(config) -> str:
    """What the counts depend on: the config's values (not the object, which a caller may change between calls)."""
    return config.to_json_string(use_diff=False)


def _targets(lora: LoraSettings):
    return lora.targets if isinstance(lora.targets, str) else tuple(lora.targets)


def adapter_params_per_layer(config, tp: int, lora: LoraSettings) -> dict[str, int]:
    """{global layer index (as a string): adapter parameters on one tp rank of that layer's stage}."""
    from colozoo.layers.shard import local_shape
    from colozoo.models import build_shard
    from colozoo.runtime.lora import apply_lora, lora_modules

    if config is None:
        raise ProfilerError("LoRA costs need the model's config (profile a registered name or a config)")
    targets = _targets(lora)
    key = (_config_key(config), tp, lora.r, targets)
    if key not in _CACHE:
        model = build_shard(config, parallel=ParallelContext.virtual(), device="meta")
        try:
            apply_lora(model, r=lora.r, targets=targets)
        except ValueError as e:
            raise ProfilerError(str(e)) from None
        counts: dict[str, int] = {}
        coords = {"tp": (0, tp)}  # a kv head replicated over tp keeps its whole B rows on each replica
        for name, lora in lora_modules(model).items():
            (a_shape, b_shape), (a_spec, b_spec) = lora.global_shapes, (lora.a_spec, lora.b_spec)
            local = math.prod(local_shape(a_shape, a_spec, coords)) + math.prod(local_shape(b_shape, b_spec, coords))
            layer = name.split(".")[1]  # every adapted linear sits in a layer: "layers.{i}...."
            counts[layer] = counts.get(layer, 0) + local
        _CACHE[key] = counts
    return _CACHE[key]


def saved_params_per_unit(config, task: str | None, lora: LoraSettings) -> dict[str, int]:
    """{unit: parameters trained whole beside the adapters}: units are global layer indices (as strings), "embed"
    (before the layers) and "head" (after them). `lora.modules_to_save` None: the task's default, as apply_lora."""
    from colozoo.models import build_shard
    from colozoo.runtime.lora import apply_lora

    targets = _targets(lora)
    saved = lora.modules_to_save if lora.modules_to_save is None else tuple(lora.modules_to_save)
    key = ("saved", _config_key(config), task, targets, saved)
    if key not in _CACHE:
        model = build_shard(config, parallel=ParallelContext.virtual(), device="meta", task=task)
        try:
            apply_lora(model, r=1, targets=targets, modules_to_save=saved)
        except ValueError as e:
            raise ProfilerError(str(e)) from None
        counts, unit = {}, "embed"
        for name, p in model.named_parameters():
            if name.startswith("layers."):
                unit = "head"  # what follows the layers
            if not p.requires_grad or ".lora." in f".{name}":
                continue
            where = name.split(".")[1] if name.startswith("layers.") else unit
            counts[where] = counts.get(where, 0) + p.numel()
        _CACHE[key] = counts
    return _CACHE[key]
