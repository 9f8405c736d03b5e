"""The family table: what colozoo knows of each model family, declared once, in the family's model file, as

    FAMILIES = (Family("llama", ("llama",), LlamaForCausalLM, gated_mlp=True, tiny=Tiny(dict(hidden_size=64, ...))),)

and read by everything that must tell families apart: building a model (colozoo.models.build_shard), its converter
(colozoo.converters.family_module: the converter module whose CONVERTS names the class), pipeline partitioning
(gated MLPs and position tables weigh on a stage; the class's hooks give the sizes), generation (a position table
bounds prompt + new tokens), the registry (model_configs/<name>.json), the README's family table
(`colozoo models --markdown`) and the tests: every check that runs per family (parity with transformers on every
mesh the family supports, round trips, generation, packing, LoRA, checkpoints, the planner) takes its cases from
the families' `tiny` configs, so a family is tested the day it is declared. Adding a family touches its model file,
its converter and its registry file; tests/test_families.py lists what each must provide.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path


# what most tiny configs share (transformers' common names); each family's Tiny adds its own settings and overrides
TINY = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)


@dataclass(frozen=True)
class Tiny:
    """The tiny transformers config a family is tested with, and how: transformers' model of
    `AutoConfig.for_model(model type, **config)` is the reference ours must match. Small (hidden 64, 2-4 layers, an
    odd vocabulary that no tp divides), with the settings that make the family's features matter at that size: a
    window shorter than the tests' sequences (12-16 positions, prompts of 9 + 6 new tokens), sinks, NoPE layers,
    YaRN's mscale, biases and norm weights drawn away from their defaults by the tests."""

    config: dict = field(compare=False)
    attention: str = "sdpa"  # transformers' attn_implementation of the reference (soft-capped scores need "eager")
    # the meshes of the parity tests beyond one process: "tp2-sp" is tp=2 with sequence parallelism, "pp2-tp2" two
    # stages of 2 tp ranks, "ep2" 2 expert-parallel ranks, "cp2-ring" / "cp2-all_to_all" context parallelism
    meshes: tuple[str, ...] = ("tp2-sp", "pp2-tp2")
    lora: str | tuple[str, ...] = "all-linear"  # the modules its LoRA test adapts (PEFT's target_modules)
    generates: bool = True  # a causal LM whose greedy generation is compared with transformers'


@dataclass(frozen=True)
class Family:
    name: str                       # our name, and that of its registry file colozoo/model_configs/<name>.json
    model_types: tuple[str, ...]    # the transformers config.model_type values it builds
    model: type                     # its ParallelModel class (encoders: the base model, whose for_task picks a head)
    gated_mlp: bool = False         # gate, up and down projections (what a layer weighs in pipeline partitioning)
    learned_positions: bool = False  # a position table: every sequence must fit max_position_embeddings
    # multimodal model types whose text model this family builds: (model_type, text architecture, what is left out)
    text_model_of: tuple[tuple[str, str, str], ...] = ()
    registered: bool = True         # has a registry file (False: its models are registered under another family)
    tiny: Tiny | None = field(default=None, compare=False)  # the config its tests build (every family has one)
    title: str = ""                 # its name in the README's family table (default: `name`)
    features: str = ""              # what it is, for that table: the head(s) and what sets it apart


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
