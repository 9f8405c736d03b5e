"""Qwen2 / Qwen2.5 and Qwen3: the shared decoder (colozoo.models.decoder) with the Qwen options.

    Qwen2      biases on q/k/v (not on o_proj); a layer is sliding-window or full by config.layer_types
               (transformers derives it from use_sliding_window and max_window_layers: layers >= max_window_layers
               slide when use_sliding_window)
    Qwen3      no q/k/v bias (attention_bias sets q/k/v and o_proj together), q_norm / k_norm: RMSNorm over head_dim
               of every query / key head before RoPE; layer_types as Qwen2
"""
from __future__ import annotations

from colozoo.models.decoder import DecoderModel, layer_window
from colozoo.models.family import TINY, Family, Tiny


class Qwen2ForCausalLM(DecoderModel):
    family = "qwen2"

    def attention_window(self, config):
        """The window every layer shares (it goes into the batch's mask), else None: mixed layers build their own."""
        windows = {layer_window(config, i) for i in range(config.num_hidden_layers)}
        return windows.pop() if len(windows) == 1 else None

    def build_attention(self, layer_idx, config, parallel, **kw):
        return self.attention(layer_idx, qkv_bias=True, out_bias=False, window=layer_window(config, layer_idx), **kw)


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    family = "qwen3"

    def build_attention(self, layer_idx, config, parallel, **kw):
        return self.attention(layer_idx, window=layer_window(config, layer_idx), qk_norm={"eps": config.rms_norm_eps},
                              **kw)


# odd vocabulary, 4 query heads over 2 kv heads; Qwen2: layers 0 and 1 full, 2 sliding over 4 positions
# (transformers: layers >= max_window_layers slide); Qwen3: head_dim != hidden / heads, so the q/k norms are over
# head_dim
QWEN = dict(TINY, num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0)
FAMILIES = (
    Family("qwen2", ("qwen2",), Qwen2ForCausalLM, gated_mlp=True, title="Qwen2 / Qwen2.5",
           features="causal LM (q/k/v bias, tied or untied head, per-layer sliding window from `layer_types`)",
           tiny=Tiny({**QWEN, "num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 4,
                      "max_window_layers": 2})),
    Family("qwen3", ("qwen3",), Qwen3ForCausalLM, gated_mlp=True, title="Qwen3",
           features="causal LM (per-head q/k RMSNorm before RoPE, replicated over tp)",
           tiny=Tiny({**QWEN, "head_dim": 32}, lora=("q_proj", "k_proj", "o_proj", "up_proj", "down_proj"))),
)
