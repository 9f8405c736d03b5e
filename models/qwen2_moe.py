"""Qwen2-MoE: the LLaMA-style decoder with biases on q/k/v (not on o_proj) and, in its sparse layers, a MoE MLP
with un-normalised top-k weights (unless norm_topk_prob) plus a shared expert gated per token by a sigmoid.

    layer i is sparse when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0, dense otherwise
    sparse mlp: router `gate`, experts `gate_up_proj` / `down_proj` (stacked, ep-split), `shared_expert`
                (gate_up column, down_proj row) scaled by sigmoid(`shared_expert_gate`(x))
"""
from __future__ import annotations

from torch import nn

from colozoo.layers import ColumnParallelLinear, RMSNorm
from colozoo.layers.moe import MoE
from colozoo.models.base import UnsupportedConfig

from .llama import LlamaAttention, LlamaMLP
from .mixtral import MoECausalLM


def is_sparse(config, layer_idx: int) -> bool:
    return (layer_idx not in (config.mlp_only_layers or []) and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0)


class Qwen2MoeAttention(LlamaAttention):
    def __init__(self, config, pc, device=None, dtype=None):
        super().__init__(config, pc, device, dtype)
        self.window = None  # the config's sliding_window is 0 when unused; sliding layers are refused
        h, hd = config.hidden_size, self.head_dim
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.qkv = ColumnParallelLinear(h, (heads + 2 * kv_heads) * hd, bias=config.qkv_bias,
                                        chunks=(heads * hd, kv_heads * hd, kv_heads * hd), group=pc.tp_group,
                                        sequence_parallel=pc.sequence_parallel, device=device, dtype=dtype)


class Qwen2MoeDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, pc, device=None, dtype=None):
        super().__init__()
        norm = dict(eps=config.rms_norm_eps, group=pc.tp_group, sequence_parallel=pc.sequence_parallel,
                    device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, **norm)
        self.self_attn = Qwen2MoeAttention(config, pc, device, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, **norm)
        self.sparse = is_sparse(config, layer_idx)
        if self.sparse:
            self.mlp = MoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                           config.num_experts_per_tok, activation=config.hidden_act,
                           normalize_top_k=config.norm_topk_prob,
                           shared_expert_size=config.shared_expert_intermediate_size or None,
                           ep_group=pc.group("ep"), tp_group=pc.tp_group, sequence_parallel=pc.sequence_parallel,
                           device=device, dtype=dtype)
        else:
            self.mlp = LlamaMLP(config, pc, device, dtype)

    def forward(self, x, ctx):
        attn_out = self.self_attn(self.input_layernorm(x), ctx)
        mlp_in, x = self.post_attention_layernorm(attn_out, residual=x)  # x + attn_out, and that normalised
        if not self.sparse:
            return x + self.mlp(mlp_in)
        out, router_logits = self.mlp(mlp_in)
        ctx.router_logits.append(router_logits)
        return x + out


class Qwen2MoeForCausalLM(MoECausalLM):
    family = "qwen2_moe"
    num_experts_key = "num_experts"

    def __init__(self, config, pc=None, layer_ids=None, device=None, dtype=None):
        if getattr(config, "use_sliding_window", False):
            raise UnsupportedConfig("Qwen2-MoE with use_sliding_window=True is not supported")
        super().__init__(config, pc, layer_ids, device=device, dtype=dtype)
        self.sliding_window = None  # 0 in the config when unused, which would mask everything

    def build_layer(self, layer_idx, config, pc, **kw):
        return Qwen2MoeDecoderLayer(config, layer_idx, pc, **kw)
