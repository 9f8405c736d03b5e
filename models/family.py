"""The family table: what colozoo knows of each model family, declared once, in the family's model file, as

    FAMILIES = (Family("llama", ("llama",), LlamaForCausalLM, converter="llama", gated_mlp=True),)

and read by everything that must tell families apart: building a model (colozoo.models.build_shard), its converter
(colozoo.converters.family_module), pipeline partitioning (gated MLPs and position tables weigh on a stage),
generation (a position table bounds prompt + new tokens) and the registry (model_configs/<name>.json). Adding a
family touches its model file, its converter and its registry file; tests/test_families.py lists what each must
provide.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from functools import cache
from pathlib import Path


@dataclass(frozen=True)
class Family:
    name: str                       # our name, and that of its registry file colozoo/model_configs/<name>.json
    model_types: tuple[str, ...]    # the transformers config.model_type values it builds
    model: type                     # its ParallelModel class (encoders: the base model, whose for_task picks a head)
    converter: str                  # the module of colozoo.converters holding its HF name map
    gated_mlp: bool = False         # gate, up and down projections (what a layer weighs in pipeline partitioning)
    learned_positions: bool = False  # a position table: every sequence must fit max_position_embeddings
    # multimodal model types whose text model this family builds: (model_type, text architecture, what is left out)
    text_model_of: tuple[tuple[str, str, str], ...] = ()
    registered: bool = True         # has a registry file (False: its models are registered under another family)


@cache
def families() -> dict[str, Family]:
    """model_type -> Family, from the FAMILIES of every module of colozoo.models (this module's package)."""
    table: dict[str, Family] = {}
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        module = importlib.import_module(f"{__package__}.{info.name}")
        for family in getattr(module, "FAMILIES", ()):
            for model_type in family.model_types:
                if model_type in table:
                    raise ValueError(f"model type {model_type!r} is declared by two families: "
                                     f"{table[model_type].name} and {family.name}")
                table[model_type] = family
    return table


def family_of(model_type: str) -> Family:
    """The family that builds `model_type` (a transformers config.model_type or one of our family names)."""
    table = families()
    if model_type in table:
        return table[model_type]
    by_name = {f.name: f for f in table.values()}
    if model_type in by_name:
        return by_name[model_type]
    raise ValueError(f"unsupported model type {model_type!r}; supported: {sorted(table)}")


def text_model(model_type: str) -> tuple[str, str] | None:
    """(text architecture, what is left out) when colozoo builds only the text model of `model_type`, else None."""
    for family in set(families().values()):
        for parent, architecture, left_out in family.text_model_of:
            if parent == model_type:
                return architecture, left_out
    return None
