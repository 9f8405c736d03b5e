"""Qwen2-MoE names. Attention (q/k/v fused, with biases), norms and embeddings as LLaMA; MLPs:

    sparse layers (checkpoint files, one tensor per expert):
        model.layers.{i}.mlp.gate.weight                                  -> layers.{i}.mlp.gate.weight
        model.layers.{i}.mlp.experts.{e}.gate_proj / up_proj .weight     -> layers.{i}.mlp.experts.gate_up_proj[e]
        model.layers.{i}.mlp.experts.{e}.down_proj.weight                -> layers.{i}.mlp.experts.down_proj[e]
        model.layers.{i}.mlp.shared_expert.{gate,up}_proj.weight          -> layers.{i}.mlp.shared_expert.gate_up.weight
        model.layers.{i}.mlp.shared_expert.down_proj.weight               -> layers.{i}.mlp.shared_expert.down_proj.weight
        model.layers.{i}.mlp.shared_expert_gate.weight                    -> layers.{i}.mlp.shared_expert_gate.weight
    dense layers: as LLaMA's MLP. `module_sources`: transformers' in-memory names (experts already stacked).
"""
from __future__ import annotations

from colozoo.models.qwen2_moe import is_sparse

from .source import Source

HF_PREFIX = "model."
IGNORED_HF = ()


def _common(config) -> dict[str, Source]:
    m = HF_PREFIX
    out = {"embed_tokens.weight": Source.of(f"{m}embed_tokens.weight"), "norm.weight": Source.of(f"{m}norm.weight")}
    for i in range(config.num_hidden_layers):
        hf, ours = f"{m}layers.{i}.", f"layers.{i}."
        out[f"{ours}self_attn.qkv.weight"] = Source.of(*(f"{hf}self_attn.{p}_proj.weight" for p in "qkv"))
        if config.qkv_bias:
            out[f"{ours}self_attn.qkv.bias"] = Source.of(*(f"{hf}self_attn.{p}_proj.bias" for p in "qkv"))
        out[f"{ours}self_attn.o_proj.weight"] = Source.of(f"{hf}self_attn.o_proj.weight")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{ours}{norm}.weight"] = Source.of(f"{hf}{norm}.weight")
        mlp = f"{hf}mlp."
        if is_sparse(config, i):
            out[f"{ours}mlp.gate.weight"] = Source.of(f"{mlp}gate.weight")
            if config.shared_expert_intermediate_size:
                out[f"{ours}mlp.shared_expert.gate_up.weight"] = Source.of(f"{mlp}shared_expert.gate_proj.weight",
                                                                           f"{mlp}shared_expert.up_proj.weight")
                out[f"{ours}mlp.shared_expert.down_proj.weight"] = Source.of(f"{mlp}shared_expert.down_proj.weight")
                out[f"{ours}mlp.shared_expert_gate.weight"] = Source.of(f"{mlp}shared_expert_gate.weight")
        else:
            out[f"{ours}mlp.gate_up.weight"] = Source.of(f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight")
            out[f"{ours}mlp.down_proj.weight"] = Source.of(f"{mlp}down_proj.weight")
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = Source.of("lm_head.weight")
    return out


def hf_sources(config) -> dict[str, Source]:
    out, n = _common(config), config.num_experts
    for i in range(config.num_hidden_layers):
        if is_sparse(config, i):
            experts, ours = f"{HF_PREFIX}layers.{i}.mlp.experts.", f"layers.{i}.mlp.experts."
            out[f"{ours}gate_up_proj"] = Source.of(
                *(f"{experts}{e}.{w}.weight" for e in range(n) for w in ("gate_proj", "up_proj")), stack=n)
            out[f"{ours}down_proj"] = Source.of(*(f"{experts}{e}.down_proj.weight" for e in range(n)), stack=n)
    return out


def module_sources(config) -> dict[str, Source]:
    out = _common(config)
    for i in range(config.num_hidden_layers):
        if is_sparse(config, i):
            for name in ("gate_up_proj", "down_proj"):
                out[f"layers.{i}.mlp.experts.{name}"] = Source.of(f"{HF_PREFIX}layers.{i}.mlp.experts.{name}")
    return out
