"""OLMo 2 on the shared decoder (colozoo.models.decoder): norms after attention and after the MLP instead of before
them, and q/k norms over the whole projection (every head at once, not per head).

    embed_tokens -> [x + post_attention_layernorm(self_attn(x)) -> x + post_feedforward_layernorm(mlp(x))] x n
                 -> norm -> lm_head

    self_attn: qkv -> q_norm(q), k_norm(k) over all heads (layers.norm.ProjectionRMSNorm: split by heads over tp,
               the statistic summed over the group) -> RoPE -> attention -> o_proj
"""
from __future__ import annotations

from torch import nn

from colozoo.layers import RMSNorm
from colozoo.models.decoder import DecoderModel
from colozoo.models.family import TINY, Family, Tiny


class Olmo2DecoderLayer(nn.Module):
    """x + post_attention_layernorm(self_attn(x)), then + post_feedforward_layernorm(mlp(...)): no norm before a
    block."""

    attention_block = "self_attn"

    def __init__(self, config, parallel, self_attn: nn.Module, mlp: nn.Module, device=None, dtype=None):
        super().__init__()
        norm = dict(eps=config.rms_norm_eps, group=parallel.tp_group, sequence_parallel=parallel.sequence_parallel,
                    device=device, dtype=dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, **norm)
        self.mlp = mlp
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, **norm)

    def forward(self, x, batch):
        x = x + self.post_attention_layernorm(self.self_attn(x, batch))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2ForCausalLM(DecoderModel):
    family = "olmo2"

    def attention_window(self, config):
        return None

    def build_layer(self, layer_idx: int, config, parallel, **kw) -> Olmo2DecoderLayer:
        return Olmo2DecoderLayer(config, parallel, self.build_attention(layer_idx, config, parallel, **kw),
                                 self.build_mlp(layer_idx, config, parallel, **kw), **kw)

    def build_attention(self, layer_idx: int, config, parallel, **kw) -> nn.Module:
        return self.attention(layer_idx, qk_norm={"eps": config.rms_norm_eps, "over": "projection"}, **kw)


FAMILIES = (Family("olmo2", ("olmo2",), Olmo2ForCausalLM, gated_mlp=True, title="OLMo 2",
                   features="causal LM (norms after attention and the MLP, q/k RMSNorm over the whole projection: "
                            "split by heads over tp, its statistic summed over the group)",
                   tiny=Tiny(dict(TINY, num_key_value_heads=2, max_position_embeddings=64,
                                  pad_token_id=0, rms_norm_eps=1e-6),
                             lora=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"))),)
