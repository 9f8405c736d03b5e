"""Qwen3-MoE names: attention and per-head norms as Qwen3 (converters/qwen.py), experts as Qwen2-MoE's
(converters/qwen2_moe.py: router `mlp.gate`, one tensor per expert in files, stacked in transformers' memory),
no shared expert; layers outside the sparse pattern have LLaMA's dense MLP."""
from __future__ import annotations

from colozoo.models.qwen2_moe import is_sparse
from colozoo.models.qwen3_moe import Qwen3MoeForCausalLM

from .llama import QK_NORMS, attention_and_norms, dense_mlp, per_layer
from .qwen2_moe import experts
from .source import Source

CONVERTS = (Qwen3MoeForCausalLM,)
HF_PREFIX = "model."
IGNORED_HF = ()


def _common(config) -> dict[str, Source]:
    out = {**attention_and_norms(config), **per_layer(config, *QK_NORMS)}
    for i in range(config.num_hidden_layers):
        hf, ours = f"{HF_PREFIX}layers.{i}.mlp.", f"layers.{i}.mlp."
        if is_sparse(config, i):
            out[f"{ours}gate.weight"] = Source.of(f"{hf}gate.weight")
        else:
            out.update(dense_mlp(hf, ours))
    return out


def hf_sources(config) -> dict[str, Source]:
    return {**_common(config), **experts(config)}


def module_sources(config) -> dict[str, Source]:
    return {**_common(config), **experts(config, in_memory=True)}
