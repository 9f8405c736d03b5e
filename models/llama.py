"""LLaMA and Mistral: the shared decoder (colozoo.models.decoder) as it is: RoPE (every scaling transformers knows,
partial rotary), RMSNorm, SwiGLU, grouped-query attention, an optional sliding window (Mistral), a tied or untied
LM head.

    embed_tokens (vocab-parallel) -> [input_layernorm -> self_attn (qkv column, RoPE, o_proj row) -> +
                                      post_attention_layernorm -> mlp (gate_up column, silu(gate) * up, down_proj row)
                                      -> +] x n -> norm -> lm_head
"""
from __future__ import annotations

from colozoo.models.decoder import DecoderModel
from colozoo.models.family import TINY, Family, Tiny


class LlamaForCausalLM(DecoderModel):
    family = "llama"

    def mlp_bias(self, config) -> bool:
        return getattr(config, "mlp_bias", False)  # Mistral's config has none


class MistralForCausalLM(LlamaForCausalLM):
    family = "mistral"


# 4 query heads over 2 kv heads, an odd vocabulary; Mistral's window (4) shorter than the tests' sequences
LLAMA = dict(TINY, num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0)
FAMILIES = (
    Family("llama", ("llama",), LlamaForCausalLM, gated_mlp=True, tiny=Tiny(LLAMA), title="LLaMA",
           features="causal LM (RoPE incl. linear/dynamic/llama3/YaRN/LongRoPE scaling and partial rotary, GQA, "
                    "SwiGLU)"),
    Family("mistral", ("mistral",), MistralForCausalLM, gated_mlp=True, registered=False,
           tiny=Tiny({**LLAMA, "sliding_window": 4}), title="Mistral", features="causal LM (LLaMA's, with a sliding "
                                                                               "window on every layer)"),
)
