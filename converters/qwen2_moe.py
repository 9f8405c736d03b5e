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

from colozoo.models.qwen2_moe import Qwen2MoeForCausalLM, is_sparse

from .llama import attention_and_norms, dense_mlp
from .source import Source

CONVERTS = (Qwen2MoeForCausalLM,)
HF_PREFIX = "model."
IGNORED_HF = ()


def _common(config) -> dict[str, Source]:
    """Everything but the stacked experts (biases on q/k/v only, as models.qwen2_moe builds its attention)."""
    out = attention_and_norms(config, qkv_bias=config.qkv_bias, out_bias=False)
    for i in range(config.num_hidden_layers):
        mlp, ours = f"{HF_PREFIX}layers.{i}.mlp.", f"layers.{i}.mlp."
        if not is_sparse(config, i):
            out.update(dense_mlp(mlp, ours))
            continue
        out[f"{ours}gate.weight"] = Source.of(f"{mlp}gate.weight")
        if config.shared_expert_intermediate_size:
            out.update(dense_mlp(f"{mlp}shared_expert.", f"{ours}shared_expert."))
            out[f"{ours}shared_expert_gate.weight"] = Source.of(f"{mlp}shared_expert_gate.weight")
    return out


def hf_sources(config) -> dict[str, Source]:
    return {**_common(config), **experts(config)}


def module_sources(config) -> dict[str, Source]:
    return {**_common(config), **experts(config, in_memory=True)}


def experts(config, in_memory: bool = False, layers=None, count: int | None = None) -> dict[str, Source]:
    """The stacked experts of every sparse layer (`layers`, default Qwen's, of `count` experts, default
    config.num_experts): from one tensor per expert (checkpoint files) or, `in_memory`, from transformers' stacked
    parameters of the same names as ours (Qwen3-MoE and DeepSeek-V3 share this layout)."""
    out, n = {}, config.num_experts if count is None else count
    if layers is None:
        layers = [i for i in range(config.num_hidden_layers) if is_sparse(config, i)]
    for i in layers:
        hf, ours = f"{HF_PREFIX}layers.{i}.mlp.experts.", f"layers.{i}.mlp.experts."
        if in_memory:
            out.update({f"{ours}{w}": Source.of(f"{hf}{w}") for w in ("gate_up_proj", "down_proj")})
            continue
        out[f"{ours}gate_up_proj"] = Source.of(
            *(f"{hf}{e}.{w}.weight" for e in range(n) for w in ("gate_proj", "up_proj")), stack=n)
        out[f"{ours}down_proj"] = Source.of(*(f"{hf}{e}.down_proj.weight" for e in range(n)), stack=n)
    return out
