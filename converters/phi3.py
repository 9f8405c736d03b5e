"""Phi-3 names: HF `model.layers.{i}.self_attn.qkv_proj` and `mlp.gate_up_proj` are already fused in our layouts
([q; k; v] and [gate; up] along the output dim), so each maps one to one onto our `self_attn.qkv` and `mlp.gate_up`;
the rest is named as in LLaMA."""
from __future__ import annotations

from .llama import HF_PREFIX, IGNORED_HF  # noqa: F401 (the loader reads HF_PREFIX and IGNORED_HF here)
from .source import Source


def hf_sources(config) -> dict[str, Source]:
    m = HF_PREFIX
    out = {"embed_tokens.weight": Source.of(f"{m}embed_tokens.weight"), "norm.weight": Source.of(f"{m}norm.weight")}
    for i in range(config.num_hidden_layers):
        hf, ours = f"{m}layers.{i}.", f"layers.{i}."
        for ours_name, hf_name in (("self_attn.qkv", "self_attn.qkv_proj"), ("self_attn.o_proj", "self_attn.o_proj"),
                                   ("mlp.gate_up", "mlp.gate_up_proj"), ("mlp.down_proj", "mlp.down_proj")):
            out[f"{ours}{ours_name}.weight"] = Source.of(f"{hf}{hf_name}.weight")  # Phi-3 has no linear biases
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{ours}{norm}.weight"] = Source.of(f"{hf}{norm}.weight")
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = Source.of("lm_head.weight")
    return out
