"""Gemma 2 / Gemma 3 text names: LLaMA's (fused q/k/v and gate/up) plus the two feed-forward norms of every layer
and, in Gemma 3, the per-head `self_attn.{q,k}_norm`."""
from __future__ import annotations

from .llama import HF_PREFIX, IGNORED_HF, QK_NORMS, attention_and_norms, dense_mlp, per_layer  # noqa: F401
from .source import Source


def hf_sources(config) -> dict[str, Source]:
    out = attention_and_norms(config)
    for i in range(config.num_hidden_layers):
        out.update(dense_mlp(f"{HF_PREFIX}layers.{i}.mlp.", f"layers.{i}.mlp."))
    qk = QK_NORMS if config.model_type == "gemma3_text" else ()
    return {**out, **per_layer(config, "pre_feedforward_layernorm", "post_feedforward_layernorm", *qk)}
