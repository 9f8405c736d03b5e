"""LLaMA / Mistral names: HF `model.layers.{i}.self_attn.{q,k,v}_proj` and `mlp.{gate,up}_proj` (separate) <-> our
fused `layers.{i}.self_attn.qkv` and `layers.{i}.mlp.gate_up` (concatenated along the output dim; the shard spec's
chunks cut each part separately, so grouped-query attention keeps whole kv heads per rank)."""
from __future__ import annotations

from .source import Source

HF_PREFIX = "model."
IGNORED_HF = (r"\.rotary_emb\.inv_freq$",)  # a buffer some old checkpoints carry


def hf_sources(config) -> dict[str, Source]:
    m = HF_PREFIX
    out = {"embed_tokens.weight": Source.of(f"{m}embed_tokens.weight"), "norm.weight": Source.of(f"{m}norm.weight")}
    attention_bias = getattr(config, "attention_bias", False)
    mlp_bias = getattr(config, "mlp_bias", False)
    for i in range(config.num_hidden_layers):
        hf, ours = f"{m}layers.{i}.", f"layers.{i}."
        fused = {"self_attn.qkv": [f"self_attn.{p}_proj" for p in "qkv"], "mlp.gate_up": ["mlp.gate_proj", "mlp.up_proj"]}
        for name, parts in fused.items():
            out[f"{ours}{name}.weight"] = Source.of(*(f"{hf}{p}.weight" for p in parts))
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            out[f"{ours}{name}.weight"] = Source.of(f"{hf}{name}.weight")
        biased = (["self_attn.qkv", "self_attn.o_proj"] if attention_bias else []) + \
                 (["mlp.gate_up", "mlp.down_proj"] if mlp_bias else [])
        for name in biased:
            parts = fused.get(name, [name])
            out[f"{ours}{name}.bias"] = Source.of(*(f"{hf}{p}.bias" for p in parts))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{ours}{norm}.weight"] = Source.of(f"{hf}{norm}.weight")
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = Source.of("lm_head.weight")
    return out
