"""OPT names: HF `model.decoder.layers.{i}.self_attn.{q,k,v}_proj` (separate) <-> our fused `layers.{i}.self_attn.qkv`."""
from __future__ import annotations

from colozoo.models.opt import OPTForCausalLM

from .source import Source

CONVERTS = (OPTForCausalLM,)
HF_PREFIX = "model.decoder."
IGNORED_HF = ()


def hf_sources(config) -> dict[str, Source]:
    d = HF_PREFIX
    out = {"embed_tokens.weight": Source.of(f"{d}embed_tokens.weight"),
           "embed_positions.weight": Source.of(f"{d}embed_positions.weight")}
    if config.word_embed_proj_dim != config.hidden_size:
        out["project_in.weight"] = Source.of(f"{d}project_in.weight")
        out["project_out.weight"] = Source.of(f"{d}project_out.weight")
    affine = config.layer_norm_elementwise_affine
    bias = config.enable_bias
    for i in range(config.num_hidden_layers):
        hf, ours = f"{d}layers.{i}.", f"layers.{i}."
        out[f"{ours}self_attn.qkv.weight"] = Source.of(*(f"{hf}self_attn.{p}_proj.weight" for p in "qkv"))
        if bias:
            out[f"{ours}self_attn.qkv.bias"] = Source.of(*(f"{hf}self_attn.{p}_proj.bias" for p in "qkv"))
        for linear, hf_linear in (("self_attn.out_proj", "self_attn.out_proj"), ("fc1", "fc1"), ("fc2", "fc2")):
            out[f"{ours}{linear}.weight"] = Source.of(f"{hf}{hf_linear}.weight")
            if bias:
                out[f"{ours}{linear}.bias"] = Source.of(f"{hf}{hf_linear}.bias")
        if affine:
            for norm in ("self_attn_layer_norm", "final_layer_norm"):
                out[f"{ours}{norm}.weight"] = Source.of(f"{hf}{norm}.weight")
                out[f"{ours}{norm}.bias"] = Source.of(f"{hf}{norm}.bias")
    if config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False) and affine:
        out["final_layer_norm.weight"] = Source.of(f"{d}final_layer_norm.weight")
        out["final_layer_norm.bias"] = Source.of(f"{d}final_layer_norm.bias")
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = Source.of("lm_head.weight")
    return out
