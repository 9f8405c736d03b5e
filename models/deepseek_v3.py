"""DeepSeek-V3 / R1 (and Kimi-K2, the same architecture, registered under this family) on the shared decoder
(colozoo.models.decoder): multi-head latent attention (layers.mla) in every layer, a dense SwiGLU MLP in the first
`first_k_dense_replace` layers and DeepSeekMoE in the others: a shared expert every token goes through (ungated) beside
n_routed_experts routed ones, chosen by sigmoid scores plus a bias correction within the best topk_group of n_group
groups, weighted by the uncorrected scores (normalised) times routed_scaling_factor (layers.moe.GroupLimitedRouter).
transformers adds no load-balancing loss for it, and neither does colozoo.

    embed_tokens -> [input_layernorm -> self_attn (MLA: q_a_proj -> q_a_layernorm -> q_b_proj, kv_a_proj_with_mqa ->
                     kv_a_layernorm -> kv_b_proj, decoupled rotary key, o_proj) -> + post_attention_layernorm -> mlp
                     -> +] x n -> norm -> lm_head

The softmax scale is qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under YaRN: transformers applies
that factor for any rope type but "default" whose parameters name an mscale_all_dim (a quirk followed here), while
cos/sin carry YaRN's attention factor mscale / mscale_all_dim as for every family (layers.rope).
"""
from __future__ import annotations

import math

from torch import nn

from colozoo.layers.mla import LatentAttention, LatentAttentionSpec
from colozoo.layers.moe import GroupLimitedRouter
from colozoo.layers.rope import rope_parameters
from colozoo.layers.vocab import LogitsRequest
from colozoo.models.base import ModelOutput, UnsupportedConfig
from colozoo.models.decoder import DecoderModel, MoEDecoderModel
from colozoo.models.family import TINY, Family, Tiny


def softmax_scale(config) -> float:
    """transformers' DeepseekV3Attention.scaling: qk_head_dim ** -0.5, times mscale ** 2 where the rope parameters
    (of any type but "default") give an mscale_all_dim."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if params["rope_type"] != "default" and mscale_all_dim and params["factor"] > 1:
        mscale = 0.1 * mscale_all_dim * math.log(params["factor"]) + 1.0
        scale = scale * mscale * mscale
    return scale


def latent_attention_spec(config) -> LatentAttentionSpec:
    """What DeepSeek-V3's attention is, in transformers' config names."""
    return LatentAttentionSpec(config.hidden_size, config.num_attention_heads, q_lora_rank=config.q_lora_rank,
                               kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
                               qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
                               scale=softmax_scale(config), norm_eps=config.rms_norm_eps, bias=config.attention_bias,
                               interleaved_rope=config.rope_interleave, dropout=config.attention_dropout)


def is_sparse(config, layer_idx: int) -> bool:
    """transformers' rule: the first first_k_dense_replace layers are dense, every later one a MoE."""
    return layer_idx >= config.first_k_dense_replace


class DeepseekV3ForCausalLM(MoEDecoderModel):
    family = "deepseek_v3"
    num_experts_key = "n_routed_experts"
    expert_width_key = "moe_intermediate_size"
    sparse_layer_rule = staticmethod(is_sparse)

    def __init__(self, config, parallel=None, layer_ids=None, device=None, dtype=None):
        if config.num_key_value_heads != config.num_attention_heads:
            raise UnsupportedConfig(f"DeepSeek-V3 expands every head's key and value from the latent: "
                                    f"num_key_value_heads ({config.num_key_value_heads}) must equal "
                                    f"num_attention_heads ({config.num_attention_heads})")
        super().__init__(config, parallel, layer_ids, device=device, dtype=dtype)

    @classmethod
    def attention_size(cls, config) -> tuple[int, int]:
        """Multi-head latent attention: the query (compressed or not), the kv compression with the rotary key, the
        heads' key and value expansions and o_proj."""
        spec = latent_attention_spec(config)
        h, heads, latent, rope = spec.hidden_size, spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim
        qk, v = spec.qk_nope_head_dim + rope, spec.v_head_dim
        q = h * heads * qk if spec.q_lora_rank is None else spec.q_lora_rank * (h + heads * qk)
        kv = h * (latent + rope) + latent * heads * (spec.qk_nope_head_dim + v)
        return q + kv + heads * v * h, heads * (qk + v)

    @classmethod
    def shared_expert_width(cls, config) -> int:
        return config.moe_intermediate_size * (config.n_shared_experts or 0)

    def attention_window(self, config):
        return None

    def build_attention(self, layer_idx: int, config, parallel, **kw) -> nn.Module:
        return LatentAttention(latent_attention_spec(config), layer_idx=layer_idx, group=parallel.tp_group,
                               sequence_parallel=parallel.sequence_parallel, **kw)

    def moe_options(self, config, parallel, **kw) -> dict:
        router = GroupLimitedRouter(config.hidden_size, self.experts(config), config.num_experts_per_tok,
                                    groups=config.n_group, topk_group=config.topk_group,
                                    normalize=config.norm_topk_prob, scaling=config.routed_scaling_factor, **kw)
        return dict(router=router, normalize_top_k=config.norm_topk_prob, shared_expert_gate=False)

    def router_stats_width(self) -> int:
        return 0  # no router losses to carry between pipeline stages (see head)

    def head(self, hidden, batch, labels=None, logits: LogitsRequest = LogitsRequest()) -> ModelOutput:
        """transformers' DeepSeek-V3 adds no load-balancing loss, output_router_logits or not (its experts are
        balanced by the routing bias instead)."""
        return DecoderModel.head(self, hidden, batch, labels=labels, logits=logits)


# every feature of the published model: compressed queries (q_lora_rank) and keys/values (kv_lora_rank) with their
# norms, a decoupled rotary key in interleaved pairs, values narrower than queries and keys, YaRN with an
# mscale_all_dim; layer 0 dense, layers 1 and 2 DeepSeekMoE (8 experts in 4 groups, 2 groups chosen, a shared expert,
# routed scaling)
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8,
        "original_max_position_embeddings": 16, "rope_theta": 10000.0}
FAMILIES = (Family("deepseek_v3", ("deepseek_v3",), DeepseekV3ForCausalLM, gated_mlp=True,
                   title="DeepSeek-V3 / Kimi-K2",
                   features="causal LM with mixture-of-experts (multi-head latent attention: q and kv compressions "
                            "replicated over tp, heads split after them, a decoupled rotary key, YaRN softmax scale; a "
                            "KV cache of the compressed latent and the rotary key, 5.6% of full keys and values, "
                            "decoded with kv_b_proj absorbed; DeepSeekMoE: sigmoid scores with a routing bias, "
                            "group-limited top-k, a shared expert, the first layers dense; LoRA on the attention "
                            "projections, the MLPs refused since PEFT maps their names onto the routed experts)",
                   tiny=Tiny(dict(TINY, moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1,
                                  num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12,
                                  qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=8, n_group=4, topk_group=2,
                                  num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5,
                                  max_position_embeddings=64, rope_parameters=YARN, pad_token_id=0),
                             meshes=("tp2-sp", "ep2", "pp2-tp2", "cp2-ring"),
                             lora=("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))),)
