"""The family table as the tests read it: every check that runs per family (parity with transformers on each mesh
the family declares, round trips, generation, packing, LoRA, checkpoints, the planner) takes its cases from the
tiny configs the families declare beside their FAMILIES entries (colozoo.models.family.Tiny), so a family is tested
the day it is declared."""
from __future__ import annotations

import re

import pytest
import torch
import transformers

from colozoo.models import families, family_of

TABLE = {f.name: f for f in families().values()}
NAMES = sorted(TABLE)
CAUSAL = [n for n in NAMES if TABLE[n].model.task == "causal_lm"]
ENCODERS = [n for n in NAMES if n not in CAUSAL]
DECLARED = [n for n in NAMES if TABLE[n].tiny is not None]  # all of them (tests/test_families.py fails otherwise)
GENERATING = [n for n in CAUSAL if n in DECLARED and TABLE[n].tiny.generates]


def tiny_kwargs(name: str, **overrides) -> dict:
    """The family's tiny config (transformers keyword arguments), `overrides` on top."""
    return {**TABLE[name].tiny.config, **overrides}


def model_type(name: str) -> str:
    return TABLE[name].model_types[0]


def attention(name: str) -> str:
    """transformers' attention implementation of the reference of a family (its name or a model type)."""
    return family_of(name).tiny.attention


def tiny_config(name: str, **overrides):
    return transformers.AutoConfig.for_model(model_type(name), **tiny_kwargs(name, **overrides))


def has_experts(name: str) -> bool:
    return TABLE[name].model.experts(tiny_config(name)) > 0


MOE = [n for n in CAUSAL if n in DECLARED and has_experts(n)]
DEGREE = re.compile(r"(tp|pp|dp|cp|ep)(\d+)$")


def mesh_degrees(mesh: str) -> dict:
    """A mesh of the table ("tp2-sp", "pp2-tp2", "ep2", "cp2-ring", "cp2-all_to_all") as keyword arguments:
    degrees, sequence_parallel, cp_mode."""
    out = {}
    for part in mesh.split("-"):
        degree = DEGREE.match(part)
        if degree:
            out[degree.group(1)] = int(degree.group(2))
        elif part == "sp":
            out["sequence_parallel"] = True
        elif part in ("ring", "all_to_all"):
            out["cp_mode"] = part
        else:
            raise ValueError(f"unknown part {part!r} of mesh {mesh!r}")
    return out


def world_size(mesh: str) -> int:
    """Ranks the mesh takes: tp x pp x cp x dp, expert parallelism folded over dp x cp."""
    degrees = mesh_degrees(mesh)
    tp, pp, cp, ep, dp = (degrees.get(k, 1) for k in ("tp", "pp", "cp", "ep", "dp"))
    return tp * pp * cp * max(dp, ep // cp)


def mesh_cases() -> list:
    """(family, mesh) of every mesh every family declares, with readable ids."""
    return [pytest.param(name, mesh, id=f"{name}-{mesh}") for name in DECLARED for mesh in TABLE[name].tiny.meshes]


def encoder_inputs(config, batch_size: int = 2, seq_len: int = 12) -> tuple[dict, torch.Tensor | None]:
    """Inputs (transformers' keyword names) and labels for an encoder's task head: pixels for an image model, else two
    segments of token ids with the last row right-padded; labels as the config's architecture takes them."""
    g = torch.Generator().manual_seed(1)
    architecture = config.architectures[0]
    if hasattr(config, "image_size"):
        size = config.image_size if isinstance(config.image_size, tuple) else (config.image_size,) * 2
        inputs = dict(pixel_values=torch.randn(batch_size, config.num_channels, *size, generator=g))
    else:
        ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=g)
        mask = torch.ones(batch_size, seq_len, dtype=torch.long)
        mask[-1, seq_len - 3:] = 0
        types = torch.zeros(batch_size, seq_len, dtype=torch.long)
        types[:, seq_len // 2:] = 1
        inputs = dict(input_ids=ids, attention_mask=mask, token_type_ids=types)
    if architecture.endswith("ForMaskedLM"):
        masked = (torch.rand(ids.shape, generator=g) < 0.5) | (mask == 0)
        return inputs, ids.masked_fill(masked, -100)
    if architecture.endswith("Classification"):
        return inputs, torch.arange(batch_size) % config.num_labels
    return inputs, None
