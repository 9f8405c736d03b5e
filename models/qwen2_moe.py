"""Qwen2-MoE: the shared decoder with biases on q/k/v (not on o_proj) and, in its sparse layers, a MoE MLP
with un-normalised top-k weights (unless norm_topk_prob) plus a shared expert gated per token by a sigmoid.

    layer i is sparse when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0, dense otherwise
    sparse mlp: router `gate`, experts `gate_up_proj` / `down_proj` (stacked, ep-split), `shared_expert`
                (gate_up column, down_proj row) scaled by sigmoid(`shared_expert_gate`(x))
"""
from __future__ import annotations

from colozoo.models.base import UnsupportedConfig
from colozoo.models.decoder import MoEDecoderModel
from colozoo.models.family import TINY, Family, Tiny


def is_sparse(config, layer_idx: int) -> bool:
    return (layer_idx not in (config.mlp_only_layers or []) and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0)


class Qwen2MoeForCausalLM(MoEDecoderModel):
    family = "qwen2_moe"
    num_experts_key = "num_experts"
    expert_width_key = "moe_intermediate_size"
    sparse_layer_rule = staticmethod(is_sparse)

    def __init__(self, config, parallel=None, layer_ids=None, device=None, dtype=None):
        if getattr(config, "use_sliding_window", False):
            raise UnsupportedConfig("Qwen2-MoE with use_sliding_window=True is not supported")
        super().__init__(config, parallel, layer_ids, device=device, dtype=dtype)

    @classmethod
    def shared_expert_width(cls, config) -> int:
        return config.shared_expert_intermediate_size or 0

    def attention_window(self, config):
        return None  # sliding layers are refused; the config's sliding_window (0 when unused) would mask everything

    def build_attention(self, layer_idx, config, parallel, **kw):
        return self.attention(layer_idx, qkv_bias=config.qkv_bias, out_bias=False, **kw)

    def moe_options(self, config, parallel, **kw) -> dict:
        return dict(normalize_top_k=config.norm_topk_prob)


# layer 0 sparse with a gated shared expert and un-normalised top-k weights, layer 1 dense
FAMILIES = (Family("qwen2_moe", ("qwen2_moe",), Qwen2MoeForCausalLM, gated_mlp=True, title="Qwen2-MoE",
                   features="causal LM with mixture-of-experts (a shared expert gated per token, dense layers by "
                            "mlp_only_layers and decoder_sparse_step)",
                   tiny=Tiny(dict(TINY, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                  num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                                  max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=0.05),
                             meshes=("tp2-sp", "ep2", "pp2-tp2"),
                             lora=("q_proj", "k_proj", "v_proj", "o_proj", "shared_expert.gate_proj",
                                   "shared_expert.down_proj"))),)
