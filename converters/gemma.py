"""Gemma 2 / Gemma 3 text names: LLaMA's (fused q/k/v and gate/up) plus the two feed-forward norms of every layer
and, in Gemma 3, the per-head `self_attn.{q,k}_norm`."""
from __future__ import annotations

from .llama import HF_PREFIX, IGNORED_HF, attention_and_norms, dense_mlp  # noqa: F401 (the loader reads them here)
from .source import Source


def hf_sources(config) -> dict[str, Source]:
    out = attention_and_norms(config)
    for i in range(config.num_hidden_layers):
        hf, ours = f"{HF_PREFIX}layers.{i}.", f"layers.{i}."
        out.update(dense_mlp(f"{hf}mlp.", f"{ours}mlp."))
        names = ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        if config.model_type == "gemma3_text":
            names += ["self_attn.q_norm", "self_attn.k_norm"]
        for name in names:
            out[f"{ours}{name}.weight"] = Source.of(f"{hf}{name}.weight")
    return out
