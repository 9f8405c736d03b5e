"""Mixtral names. Attention, norms and embeddings as LLaMA (converters/llama.py). Experts:

    checkpoint files (what Mixtral releases and transformers' save_pretrained write), one tensor per expert:
        model.layers.{i}.block_sparse_moe.gate.weight                  -> layers.{i}.mlp.gate.weight
        model.layers.{i}.block_sparse_moe.experts.{e}.w1 / w3 .weight  -> layers.{i}.mlp.experts.gate_up_proj[e]
        model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight        -> layers.{i}.mlp.experts.down_proj[e]
    transformers' in-memory modules (`module_sources`): already stacked, same names as ours under `model.`

Ours are stacked with the global expert index first (Source stack mode): a rank reading its ep slice of
experts opens only the tensors of the experts it owns.
"""
from __future__ import annotations

from colozoo.models.mixtral import MixtralForCausalLM

from .llama import attention_and_norms
from .source import Source

CONVERTS = (MixtralForCausalLM,)
HF_PREFIX = "model."
IGNORED_HF = (r"\.rotary_emb\.inv_freq$",)


def hf_sources(config) -> dict[str, Source]:
    out = attention_and_norms(config)
    experts = range(config.num_local_experts)
    for i in range(config.num_hidden_layers):
        hf, ours = f"{HF_PREFIX}layers.{i}.block_sparse_moe.", f"layers.{i}.mlp."
        out[f"{ours}gate.weight"] = Source.of(f"{hf}gate.weight")
        out[f"{ours}experts.gate_up_proj"] = Source.of(
            *(f"{hf}experts.{e}.{w}.weight" for e in experts for w in ("w1", "w3")), stack=config.num_local_experts)
        out[f"{ours}experts.down_proj"] = Source.of(*(f"{hf}experts.{e}.w2.weight" for e in experts),
                                                    stack=config.num_local_experts)
    return out


def module_sources(config) -> dict[str, Source]:
    """Our names -> the parameter names of a transformers MixtralForCausalLM in memory (e.g. its gradients)."""
    out = attention_and_norms(config)
    for i in range(config.num_hidden_layers):
        for name in ("gate.weight", "experts.gate_up_proj", "experts.down_proj"):
            out[f"layers.{i}.mlp.{name}"] = Source.of(f"{HF_PREFIX}layers.{i}.mlp.{name}")
    return out
