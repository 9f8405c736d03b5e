"""Per-family maps between HF names/layouts and ours: `hf_sources(config)` gives, for each of our global
parameter names, the HF tensors that make it up (a `Source`)."""
from __future__ import annotations

import importlib

from colozoo.core.errors import CheckpointError

FAMILY_CONVERTERS = {"gpt2": "gpt2", "opt": "opt", "bert": "bert", "vit": "vit", "llama": "llama",
                     "mistral": "llama", "mixtral": "mixtral", "qwen2_moe": "qwen2_moe",
                     "qwen2": "qwen", "qwen3": "qwen", "qwen3_moe": "qwen3_moe", "gemma2": "gemma",
                     "gemma3_text": "gemma", "phi3": "phi3",
                     "gpt_neox": "gpt_neox"}


def family_module(family: str):
    try:
        return importlib.import_module(f"colozoo.converters.{FAMILY_CONVERTERS[family]}")
    except KeyError:
        raise CheckpointError(f"no converter for model family {family!r}; known: {sorted(FAMILY_CONVERTERS)}") from None


def hf_tensor_names(sources) -> set[str]:
    return {name for source in sources.values() for name in source.names}
