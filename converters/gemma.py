"""Gemma 2 / Gemma 3 text names: LLaMA's (fused q/k/v and gate/up) plus the two feed-forward norms of every layer
and, in Gemma 3, the per-head `self_attn.{q,k}_norm`. Gemma 3 4b/12b/27b are published as
Gemma3ForConditionalGeneration: the text model's tensors under `language_model.model.`, beside a vision tower and a
projector that the text model leaves out."""
from __future__ import annotations

from colozoo.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM

from .llama import HF_PREFIX, IGNORED_HF as TEXT_IGNORED, QK_NORMS, attention_and_norms, dense_mlp, per_layer
from .source import Source

CONVERTS = (Gemma2ForCausalLM, Gemma3ForCausalLM)
IGNORED_HF = TEXT_IGNORED + (r"^vision_tower\.", r"^multi_modal_projector\.")
# another saved naming (the loader tries it), not transformers' in-memory names (NAME_ALIASES, which PEFT sees)
CHECKPOINT_ALIASES = ((r"^model\.", "language_model.model."),)  # a multimodal checkpoint's text model


def hf_sources(config) -> dict[str, Source]:
    out = attention_and_norms(config)
    for i in range(config.num_hidden_layers):
        out.update(dense_mlp(f"{HF_PREFIX}layers.{i}.mlp.", f"layers.{i}.mlp."))
    qk = QK_NORMS if config.model_type == "gemma3_text" else ()
    return {**out, **per_layer(config, "pre_feedforward_layernorm", "post_feedforward_layernorm", *qk)}
