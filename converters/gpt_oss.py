"""gpt-oss names: attention (q/k/v fused, biases), norms and embeddings as LLaMA (converters/llama.py), plus

    model.layers.{i}.self_attn.sinks                      -> layers.{i}.self_attn.sinks
    model.layers.{i}.mlp.router.{weight,bias}             -> layers.{i}.mlp.gate.{weight,bias}
    model.layers.{i}.mlp.experts.{gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias}
                                                          -> layers.{i}.mlp.experts.{the same}

The experts keep transformers' layout (stacked, (experts, in, out), gate/up interleaved), one to one. The published
MXFP4 checkpoints hold `{gate_up,down}_proj_blocks` / `_scales` instead, which colozoo.checkpoint.mxfp4 presents
under these names, dequantised."""
from __future__ import annotations

from colozoo.models.gpt_oss import GptOssForCausalLM

from .llama import HF_PREFIX, attention_and_norms, per_layer
from .source import Source

CONVERTS = (GptOssForCausalLM,)
IGNORED_HF = ()
EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def hf_sources(config) -> dict[str, Source]:
    out = {**attention_and_norms(config), **per_layer(config)}
    for i in range(config.num_hidden_layers):
        hf, ours = f"{HF_PREFIX}layers.{i}.", f"layers.{i}."
        out[f"{ours}self_attn.sinks"] = Source.of(f"{hf}self_attn.sinks")
        for p in ("weight", "bias"):
            out[f"{ours}mlp.gate.{p}"] = Source.of(f"{hf}mlp.router.{p}")
        for name in EXPERT_TENSORS:
            out[f"{ours}mlp.experts.{name}"] = Source.of(f"{hf}mlp.experts.{name}")
    return out


module_sources = hf_sources  # transformers' in-memory names are its checkpoint's
