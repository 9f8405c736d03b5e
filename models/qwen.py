"""Qwen2 / Qwen2.5, Qwen3 and Qwen3-MoE: the LLaMA-style decoder (models.llama) with the Qwen options.

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

from colozoo.layers.moe import MoE

from .llama import LlamaAttention, LlamaForCausalLM, dense_mlp
from .mixtral import MoECausalLM
from .qwen2_moe import is_sparse


def layer_window(config, layer_idx: int) -> int | None:
    """Layer `layer_idx`'s sliding window: config.sliding_window for a "sliding_attention" layer, else None."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return config.sliding_window if layer_types[layer_idx] == "sliding_attention" else None


class Qwen2ForCausalLM(LlamaForCausalLM):
    family = "qwen2"

    def attention_window(self, config):
        """The window every layer shares (it goes into the batch's mask), else None: mixed layers build their own."""
        windows = {layer_window(config, i) for i in range(config.num_hidden_layers)}
        return windows.pop() if len(windows) == 1 else None

    def build_attention(self, layer_idx, config, pc, **kw):
        return LlamaAttention(config, pc, qkv_bias=True, out_bias=False, window=layer_window(config, layer_idx), **kw)


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    family = "qwen3"

    def build_attention(self, layer_idx, config, pc, **kw):
        return LlamaAttention(config, pc, window=layer_window(config, layer_idx), qk_norm=True, **kw)


class Qwen3MoeForCausalLM(MoECausalLM):
    family = "qwen3_moe"
    num_experts_key = "num_experts"

    def build_attention(self, layer_idx, config, pc, **kw):
        return LlamaAttention(config, pc, window=self.sliding_window, qk_norm=True, **kw)

    def build_mlp(self, layer_idx, config, pc, device=None, dtype=None):
        if not is_sparse(config, layer_idx):
            return dense_mlp(config, pc, device, dtype)
        return MoE(config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok,
                   activation=config.hidden_act, normalize_top_k=config.norm_topk_prob, ep_group=pc.group("ep"),
                   tp_group=pc.tp_group, sequence_parallel=pc.sequence_parallel, device=device, dtype=dtype)
