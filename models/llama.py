"""LLaMA and Mistral: the shared decoder (colozoo.models.decoder) as it is: RoPE (every scaling transformers knows,
partial rotary), RMSNorm, SwiGLU, grouped-query attention, an optional sliding window (Mistral), a tied or untied
LM head.

    embed_tokens (vocab-parallel) -> [input_layernorm -> self_attn (qkv column, RoPE, o_proj row) -> +
                                      post_attention_layernorm -> mlp (gate_up column, silu(gate) * up, down_proj row)
                                      -> +] x n -> norm -> lm_head
"""
from __future__ import annotations

from colozoo.models.decoder import DecoderModel
from colozoo.models.family import Family


class LlamaForCausalLM(DecoderModel):
    family = "llama"


class MistralForCausalLM(LlamaForCausalLM):
    family = "mistral"


FAMILIES = (
    Family("llama", ("llama",), LlamaForCausalLM, converter="llama", gated_mlp=True),
    Family("mistral", ("mistral",), MistralForCausalLM, converter="llama", gated_mlp=True, registered=False),
)
