"""Per-family maps between HF names/layouts and ours: `hf_sources(config)` gives, for each of our global
parameter names, the HF tensors that make it up (a `Source`). Which module serves a family is the family table's
word (colozoo.models.family: Family.converter)."""
from __future__ import annotations

import importlib

from colozoo.core.errors import CheckpointError
from colozoo.models.family import families, family_of


def family_module(family: str):
    """The converter module of a family (its name or one of its transformers model types)."""
    try:
        converter = family_of(family).converter
    except ValueError:
        raise CheckpointError(f"no converter for model family {family!r}; known: {sorted(families())}") from None
    return importlib.import_module(f"colozoo.converters.{converter}")


def hf_tensor_names(sources) -> set[str]:
    return {name for source in sources.values() for name in source.names}
