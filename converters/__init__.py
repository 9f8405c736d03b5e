"""Per-family maps between HF names/layouts and ours: `hf_sources(config)` gives, for each of our global
parameter names, the HF tensors that make it up (a `Source`). A converter module declares the model classes it maps
(`CONVERTS = (LlamaForCausalLM, ...)`, imported from their model files, so the import graph holds the link), and
`family_module` finds the one declaring a family's class among the modules of this package, as the family table
finds FAMILIES among the model files."""
from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from colozoo.core.errors import CheckpointError
from colozoo.models.family import families, family_of


@cache
def converters() -> dict[type, object]:
    """Model class -> the converter module whose CONVERTS declares it (every module of this package)."""
    table: dict[type, object] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for model in getattr(module, "CONVERTS", ()):
            if model in table:
                raise ValueError(f"{model.__name__} is declared by two converters: {table[model].__name__} and "
                                 f"{module.__name__}")
            table[model] = module
    return table


def family_module(family: str):
    """The converter module of a family (its name or one of its transformers model types)."""
    try:
        model = family_of(family).model
    except ValueError:
        raise CheckpointError(f"no converter for model family {family!r}; known: {sorted(families())}") from None
    module = converters().get(model)
    if module is None:
        raise CheckpointError(f"no converter declares {model.__name__} (family {family!r}): add it to the CONVERTS "
                              f"of a module of colozoo.converters")
    return module


def hf_tensor_names(sources) -> set[str]:
    return {name for source in sources.values() for name in source.names}
