"""Qwen3-MoE on the shared decoder (colozoo.models.decoder): Qwen3's attention (per-head q/k RMSNorm; one sliding
window for every layer when use_sliding_window), the Qwen2-MoE sparse / dense layer pattern (decoder_sparse_step,
mlp_only_layers), top-k routing renormalised when norm_topk_prob, no shared expert; load-balancing loss as Mixtral.
"""
from __future__ import annotations

from colozoo.models.decoder import MoEDecoderModel
from colozoo.models.family import TINY, Family, Tiny

from .qwen2_moe import is_sparse


class Qwen3MoeForCausalLM(MoEDecoderModel):
    family = "qwen3_moe"
    num_experts_key = "num_experts"
    expert_width_key = "moe_intermediate_size"
    sparse_layer_rule = staticmethod(is_sparse)

    def build_attention(self, layer_idx, config, parallel, **kw):
        return self.attention(layer_idx, qk_norm={"eps": config.rms_norm_eps}, **kw)

    def moe_options(self, config, parallel, **kw) -> dict:
        return dict(normalize_top_k=config.norm_topk_prob)


# layers 0 and 2 sparse (top-2 of 4 experts, renormalised), layer 1 dense (mlp_only_layers), no shared expert;
# head_dim 24 != hidden / heads
FAMILIES = (Family("qwen3_moe", ("qwen3_moe",), Qwen3MoeForCausalLM, gated_mlp=True, title="Qwen3-MoE",
                   features="causal LM with mixture-of-experts (normalised top-k, no shared expert, q/k norm)",
                   tiny=Tiny(dict(TINY, moe_intermediate_size=32, num_hidden_layers=3, num_key_value_heads=2,
                                  head_dim=24, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                  mlp_only_layers=[1], max_position_embeddings=64, output_router_logits=True,
                                  router_aux_loss_coef=0.05),
                             meshes=("tp2-sp", "ep2", "pp2-tp2"), lora=("q_proj", "v_proj", "o_proj"))),)
