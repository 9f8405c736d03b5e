"""Phi-3 names: LLaMA's, but the checkpoint stores `self_attn.qkv_proj` and `mlp.gate_up_proj` already fused in our
[q; k; v] and [gate; up] layouts (along the output dim), so each maps one to one onto our `self_attn.qkv` and
`mlp.gate_up`. No linear has a bias."""
from __future__ import annotations

from colozoo.models.phi3 import Phi3ForCausalLM

from .llama import HF_PREFIX, IGNORED_HF, attention_and_norms, dense_mlp  # noqa: F401 (the loader reads them here)
from .source import Source


CONVERTS = (Phi3ForCausalLM,)
def hf_sources(config) -> dict[str, Source]:
    out = attention_and_norms(config, qkv_bias=False, out_bias=False, fused_qkv=True)
    for i in range(config.num_hidden_layers):
        out.update(dense_mlp(f"{HF_PREFIX}layers.{i}.mlp.", f"layers.{i}.mlp.", fused=True))
    return out
