"""DeepSeek-V3 names: MLA's projections and norms one to one (ours are transformers' names), LLaMA's dense MLP in the
first first_k_dense_replace layers (gate/up fused into our gate_up), and in the others:

    model.layers.{i}.mlp.gate.weight, .e_score_correction_bias        -> layers.{i}.mlp.gate.{the same}
    model.layers.{i}.mlp.experts.{e}.gate_proj / up_proj .weight       -> layers.{i}.mlp.experts.gate_up_proj[e]
    model.layers.{i}.mlp.experts.{e}.down_proj.weight                  -> layers.{i}.mlp.experts.down_proj[e]
    model.layers.{i}.mlp.shared_experts.{gate,up}_proj.weight           -> layers.{i}.mlp.shared_expert.gate_up.weight
    model.layers.{i}.mlp.shared_experts.down_proj.weight                -> layers.{i}.mlp.shared_expert.down_proj.weight

Files hold one tensor per expert (as DeepSeek publishes them and transformers saves them); transformers' memory
stacks them (`module_sources`). The published checkpoints carry the multi-token-prediction layer as layer 61, which
transformers ignores on load; so does colozoo.
"""
from __future__ import annotations

from colozoo.models.deepseek_v3 import DeepseekV3ForCausalLM, is_sparse

from .llama import dense_mlp, params
from .qwen2_moe import experts as stacked_experts
from .source import Source

CONVERTS = (DeepseekV3ForCausalLM,)
HF_PREFIX = "model."
# PEFT (0.21, on transformers 5) turns LoRA targets named so into targets on the stacked routed experts (transformers'
# qwen2_moe conversion), the dense MLPs' and the shared expert's too: colozoo.runtime.lora refuses them
PEFT_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
IGNORED_HF = (r"^model\.layers\.61\.", r"\.rotary_emb\.inv_freq$")  # transformers' _keys_to_ignore_on_load_unexpected


def attention(config, hf: str, ours: str) -> dict[str, Source]:
    """One layer's MLA: the query's compression (or q_proj), the key/value compression, their norms, o_proj."""
    bias = params(config.attention_bias)
    names = [f"self_attn.kv_a_proj_with_mqa.{p}" for p in bias] + ["self_attn.kv_a_layernorm.weight",
                                                                   "self_attn.kv_b_proj.weight"]
    names += [f"self_attn.o_proj.{p}" for p in bias]
    if config.q_lora_rank is None:
        names.append("self_attn.q_proj.weight")
    else:
        names += [f"self_attn.q_a_proj.{p}" for p in bias]
        names += ["self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight"]
    return {f"{ours}{n}": Source.of(f"{hf}{n}") for n in names}


def _common(config) -> dict[str, Source]:
    out = {"embed_tokens.weight": Source.of(f"{HF_PREFIX}embed_tokens.weight"),
           "norm.weight": Source.of(f"{HF_PREFIX}norm.weight")}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = Source.of("lm_head.weight")
    for i in range(config.num_hidden_layers):
        hf, ours = f"{HF_PREFIX}layers.{i}.", f"layers.{i}."
        out.update(attention(config, hf, ours))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{ours}{norm}.weight"] = Source.of(f"{hf}{norm}.weight")
        if not is_sparse(config, i):
            out.update(dense_mlp(f"{hf}mlp.", f"{ours}mlp."))
            continue
        for name in ("weight", "e_score_correction_bias"):
            out[f"{ours}mlp.gate.{name}"] = Source.of(f"{hf}mlp.gate.{name}")
        out.update(dense_mlp(f"{hf}mlp.shared_experts.", f"{ours}mlp.shared_expert."))
    return out


def _experts(config, in_memory: bool) -> dict[str, Source]:
    layers = [i for i in range(config.num_hidden_layers) if is_sparse(config, i)]
    return stacked_experts(config, in_memory, layers=layers, count=config.n_routed_experts)


def hf_sources(config) -> dict[str, Source]:
    return {**_common(config), **_experts(config, in_memory=False)}


def module_sources(config) -> dict[str, Source]:
    return {**_common(config), **_experts(config, in_memory=True)}
