"""Mixtral: the shared decoder (RoPE, RMSNorm, grouped-query attention, optional sliding window) with a sparse
mixture-of-experts MLP in every layer.

    embed_tokens -> [input_layernorm -> self_attn -> + post_attention_layernorm -> mlp (layers.moe: router `gate`,
                    stacked experts `gate_up_proj` / `down_proj`, expert parallel over ep) -> +] x n
                 -> norm -> lm_head; loss = LM loss + router_aux_loss_coef * load-balancing loss (all layers)

With `output_router_logits` in the config (or passed to forward) the load-balancing loss is returned as
`aux_loss` and added to the loss, as transformers does (colozoo.models.decoder.MoEDecoderModel).
"""
from __future__ import annotations

from colozoo.models.base import UnsupportedConfig
from colozoo.models.decoder import MoEDecoderModel
from colozoo.models.family import TINY, Family, Tiny


class MixtralForCausalLM(MoEDecoderModel):
    family = "mixtral"
    num_experts_key = "num_local_experts"

    def __init__(self, config, parallel=None, layer_ids=None, device=None, dtype=None):
        if getattr(config, "router_jitter_noise", 0.0):
            raise UnsupportedConfig("router_jitter_noise is not supported (set it to 0.0)")
        super().__init__(config, parallel, layer_ids, device=device, dtype=dtype)


FAMILIES = (Family("mixtral", ("mixtral",), MixtralForCausalLM, gated_mlp=True, title="Mixtral",
                   features="causal LM with mixture-of-experts (top-k softmax routing, load-balancing and z losses, "
                            "expert parallel)",
                   tiny=Tiny(dict(TINY, intermediate_size=32, num_key_value_heads=2, num_local_experts=4,
                                  num_experts_per_tok=2, max_position_embeddings=64, output_router_logits=True,
                                  router_aux_loss_coef=0.05),
                             meshes=("tp2-sp", "ep2", "pp2-tp2"), lora=("q_proj", "k_proj", "v_proj", "o_proj"))),)
