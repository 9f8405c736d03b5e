"""OLMo 2 names: LLaMA's (converters/llama.py) without `input_layernorm`, plus `post_feedforward_layernorm` and the
whole-projection `self_attn.q_norm` / `self_attn.k_norm` (one weight of heads x head_dim each), one to one."""
from __future__ import annotations

from colozoo.models.olmo2 import Olmo2ForCausalLM

from .llama import HF_PREFIX, QK_NORMS, attention_and_norms, dense_mlp, per_layer
from .source import Source

CONVERTS = (Olmo2ForCausalLM,)
IGNORED_HF = ()


def hf_sources(config) -> dict[str, Source]:
    out = {name: source for name, source in attention_and_norms(config).items()
           if not name.endswith("input_layernorm.weight")}
    out.update(per_layer(config, "post_feedforward_layernorm", *QK_NORMS))
    for i in range(config.num_hidden_layers):
        out.update(dense_mlp(f"{HF_PREFIX}layers.{i}.mlp.", f"layers.{i}.mlp."))
    return out
