"""Qwen2 / Qwen2.5 and Qwen3 names: LLaMA's (converters/llama.py), with Qwen2's q/k/v biases (none on o_proj) and
Qwen3's per-head norms

    model.layers.{i}.self_attn.q_norm.weight / k_norm.weight   -> layers.{i}.self_attn.q_norm.weight / k_norm.weight
"""
from __future__ import annotations

from colozoo.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

from .llama import QK_NORMS, attention_and_norms, dense_mlp, per_layer
from .source import Source

CONVERTS = (Qwen2ForCausalLM, Qwen3ForCausalLM)
HF_PREFIX = "model."
IGNORED_HF = (r"\.rotary_emb\.inv_freq$",)


def hf_sources(config) -> dict[str, Source]:
    if config.model_type == "qwen2":
        out = attention_and_norms(config, qkv_bias=True, out_bias=False)
    else:
        out = {**attention_and_norms(config), **per_layer(config, *QK_NORMS)}
    for i in range(config.num_hidden_layers):
        out.update(dense_mlp(f"{HF_PREFIX}layers.{i}.mlp.", f"layers.{i}.mlp."))
    return out
