"""Qwen2 / Qwen2.5, Qwen3 and Qwen3-MoE: the shared decoder (colozoo.models.decoder) with the Qwen options.

    Qwen2      biases on q/k/v (not on o_proj); a layer is sliding-window or full by config.layer_types
               (transformers derives it from use_sliding_window and max_window_layers: layers >= max_window_layers
               slide when use_sliding_window)
    Qwen3      no q/k/v bias (attention_bias sets q/k/v and o_proj together), q_norm / k_norm: RMSNorm over head_dim
               of every query / key head before RoPE; layer_types as Qwen2
    Qwen3-MoE  Qwen3's attention (one sliding window for every layer when use_sliding_window), the Qwen2-MoE
               sparse / dense layer pattern (decoder_sparse_step, mlp_only_layers), top-k routing renormalised when
               norm_topk_prob, no shared expert; load-balancing loss as Mixtral
"""
from __future__ import annotations

from colozoo.models.decoder import DecoderModel, MoEDecoderModel, dense_mlp, layer_window
from colozoo.models.family import Family

from .qwen2_moe import is_sparse


class Qwen2ForCausalLM(DecoderModel):
    family = "qwen2"

    def attention_window(self, config):
        """The window every layer shares (it goes into the batch's mask), else None: mixed layers build their own."""
        windows = {layer_window(config, i) for i in range(config.num_hidden_layers)}
        return windows.pop() if len(windows) == 1 else None

    def build_attention(self, layer_idx, config, pc, **kw):
        return self.attention(layer_idx, qkv_bias=True, out_bias=False, window=layer_window(config, layer_idx), **kw)


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    family = "qwen3"

    def build_attention(self, layer_idx, config, pc, **kw):
        return self.attention(layer_idx, window=layer_window(config, layer_idx), qk_norm={"eps": config.rms_norm_eps},
                              **kw)


class Qwen3MoeForCausalLM(MoEDecoderModel):
    family = "qwen3_moe"
    num_experts_key = "num_experts"

    def build_attention(self, layer_idx, config, pc, **kw):
        return self.attention(layer_idx, qk_norm={"eps": config.rms_norm_eps}, **kw)

    def build_mlp(self, layer_idx, config, pc, **kw):
        if not is_sparse(config, layer_idx):
            return dense_mlp(config, pc, **kw)
        return self.moe(config, pc, config.moe_intermediate_size, normalize_top_k=config.norm_topk_prob, **kw)


FAMILIES = (
    Family("qwen2", ("qwen2",), Qwen2ForCausalLM, converter="qwen", gated_mlp=True),
    Family("qwen3", ("qwen3",), Qwen3ForCausalLM, converter="qwen", gated_mlp=True),
    Family("qwen3_moe", ("qwen3_moe",), Qwen3MoeForCausalLM, converter="qwen3_moe", gated_mlp=True),
)
