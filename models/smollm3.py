"""SmolLM3 on the shared decoder (colozoo.models.decoder): LLaMA's layer with no rotary embedding in some layers
(NoPE: config.no_rope_layers[i] == 0, by default every fourth layer), and with use_sliding_window a sliding window
in the layers config.layer_types marks (transformers makes exactly the NoPE layers sliding).

    embed_tokens -> [input_layernorm -> self_attn (qkv, RoPE unless NoPE, o_proj) -> + post_attention_layernorm
                    -> mlp -> +] x n -> norm -> lm_head (tied by default)
"""
from __future__ import annotations

from torch import nn

from colozoo.models.decoder import DecoderModel
from colozoo.models.family import TINY, Family, Tiny


def smollm3_window(config, layer_idx: int) -> int | None:
    """Layer `layer_idx`'s sliding window: only with use_sliding_window, in the layers layer_types marks sliding."""
    sliding = getattr(config, "use_sliding_window", False) and config.layer_types[layer_idx] == "sliding_attention"
    return config.sliding_window if sliding else None


class SmolLM3ForCausalLM(DecoderModel):
    family = "smollm3"

    def mlp_bias(self, config) -> bool:
        return config.mlp_bias

    def attention_window(self, config):
        """The window every layer shares (it goes into the batch's mask), else None: mixed layers build their own."""
        windows = {smollm3_window(config, i) for i in range(config.num_hidden_layers)}
        return windows.pop() if len(windows) == 1 else None

    def build_attention(self, layer_idx: int, config, parallel, **kw) -> nn.Module:
        rotary = "global" if config.no_rope_layers[layer_idx] else None
        return self.attention(layer_idx, window=smollm3_window(config, layer_idx), rotary=rotary, **kw)


# 4 layers: layer 3 is NoPE and (use_sliding_window) slides over 5 positions
FAMILIES = (Family("smollm3", ("smollm3",), SmolLM3ForCausalLM, gated_mlp=True, title="SmolLM3",
                   features="causal LM (no RoPE in every fourth layer, NoPE; sliding window only with "
                            "`use_sliding_window`)",
                   tiny=Tiny(dict(TINY, num_hidden_layers=4, num_key_value_heads=2, max_position_embeddings=64,
                                  pad_token_id=0, use_sliding_window=True, sliding_window=5))),)
