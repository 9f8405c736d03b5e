"""Gemma 2 and Gemma 3 (text) on the shared decoder (colozoo.models.decoder):

    embed_tokens * sqrt(hidden) -> [input_layernorm -> attn -> post_attention_layernorm -> + ->
                                    pre_feedforward_layernorm -> mlp(GeGLU) -> post_feedforward_layernorm -> +] x n
                                -> norm -> lm_head (tied) -> final logit softcap

Every RMSNorm scales by (1 + weight) in fp32. Attention scales scores by query_pre_attn_scalar ** -0.5; layers
alternate sliding-window and full attention (`config.layer_types`). Gemma 2 caps the attention scores
(attn_logit_softcapping); Gemma 3 instead normalises q and k per head and rotates its sliding-window layers with
their own RoPE base (rope_parameters["sliding_attention"]).
"""
from __future__ import annotations

from torch import nn

from colozoo.layers import GatedMLP, RMSNorm
from colozoo.layers.rope import RotaryEmbedding, rope_config
from colozoo.models.base import require
from colozoo.models.decoder import DecoderModel, layer_window
from colozoo.models.family import TINY, Family, Tiny

SLIDING, FULL = "sliding_attention", "full_attention"


class GemmaDecoderLayer(nn.Module):
    """Gemma's sandwich: a norm before and after both attention and the MLP, the residual added after each."""

    attention_block = "self_attn"

    def __init__(self, config, parallel, self_attn: nn.Module, mlp: nn.Module, device=None, dtype=None):
        super().__init__()
        norm = dict(eps=config.rms_norm_eps, offset=True, group=parallel.tp_group,
                    sequence_parallel=parallel.sequence_parallel,
                    device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, **norm)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, **norm)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, **norm)
        self.mlp = mlp
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, **norm)

    def forward(self, x, batch):
        # the norms before attention and the MLP go to the projections after them, which fuse them where they can
        attn_out = self.post_attention_layernorm(self.self_attn(x, batch, norm=self.input_layernorm))
        out, x = self.mlp(attn_out, norm=self.pre_feedforward_layernorm, residual=x)  # x + attn_out
        return x + self.post_feedforward_layernorm(out)


class Gemma2ForCausalLM(DecoderModel):
    """Gemma 2 (model_type gemma2): attention scores capped."""

    family = "gemma2"
    norm_options = {"offset": True}

    def __init__(self, config, parallel=None, layer_ids=None, device=None, dtype=None):
        require(not getattr(config, "use_bidirectional_attention", False),
                "use_bidirectional_attention=True (an encoder Gemma) is not supported")
        super().__init__(config, parallel, layer_ids, device=device, dtype=dtype)
        self.rotary = RotaryEmbedding(rope_config(config, FULL), device=device)
        local = rope_config(config, SLIDING)
        self.local_rotary = RotaryEmbedding(local, device=device) if local is not config else None

    def logit_softcap(self, config) -> float | None:
        return config.final_logit_softcapping

    def attention_window(self, config) -> int | None:
        return None  # per layer: the full layers' causal mask is the batch's, sliding layers build theirs

    def build_layer(self, layer_idx: int, config, parallel, **kw) -> GemmaDecoderLayer:
        return GemmaDecoderLayer(config, parallel, self.build_attention(layer_idx, config, parallel, **kw),
                                 self.build_mlp(layer_idx, config, parallel, **kw), **kw)

    def attention_options(self, config, window) -> dict:
        return {"softcap": config.attn_logit_softcapping}

    def build_attention(self, layer_idx: int, config, parallel, **kw) -> nn.Module:
        window = layer_window(config, layer_idx)
        return self.attention(layer_idx, window=window, scale=config.query_pre_attn_scalar ** -0.5,
                              rotary="local" if window is not None else "global",
                              **self.attention_options(config, window), **kw)

    def build_mlp(self, layer_idx: int, config, parallel, **kw) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_activation, bias=False,
                        group=parallel.tp_group, sequence_parallel=parallel.sequence_parallel, **kw)

    def embed(self, input_ids, batch):
        hidden = self.embed_tokens(input_ids, batch.token_rows)
        # transformers rounds the normaliser to the activation dtype first (sqrt(3072) in bf16 is 55.5, not 55.4);
        # filled on the device, not copied from the host (a decode step replayed from a CUDA graph copies nothing)
        return hidden * hidden.new_full((), self.config.hidden_size ** 0.5)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text model (model_type gemma3_text, Gemma3ForCausalLM): q and k normalised per head, no score cap
    (transformers' Gemma 3 attention never passes attn_logit_softcapping on: neither do we)."""

    family = "gemma3_text"

    def attention_options(self, config, window) -> dict:
        return {"qk_norm": {"eps": config.rms_norm_eps, **self.norm_options}}


# windows of 4 positions; weights drawn large enough (initializer_range) that the embedding scale and the caps move
# the logits
GEMMA2 = dict(TINY, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0, sliding_window=4,
              query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=2.0, initializer_range=0.2)
# two sliding layers (the local RoPE base) around a full one with linear RoPE scaling; q/k norms; a final cap
GEMMA3 = dict(TINY, num_hidden_layers=3, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0,
              sliding_window=4, query_pre_attn_scalar=24, final_logit_softcapping=2.0,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                               "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}})
FEATURES = ("(1 + w) RMSNorm in fp32, four norms per layer, GeGLU, scaled embedding, alternating sliding / global "
            "layers")
FAMILIES = (
    # transformers' SDPA cannot cap attention scores: its reference runs eager attention
    Family("gemma2", ("gemma2",), Gemma2ForCausalLM, gated_mlp=True, title="Gemma 2",
           features=f"causal LM ({FEATURES}, attention and final logit soft-capping)",
           tiny=Tiny(GEMMA2, attention="eager", lora=("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"))),
    Family("gemma3_text", ("gemma3_text",), Gemma3ForCausalLM, gated_mlp=True, title="Gemma 3 text",
           features=f"causal LM ({FEATURES}, q/k norm, a local RoPE base, final logit soft-capping); the published "
                    f"Gemma3ForConditionalGeneration checkpoints load as their text model, the vision tower skipped "
                    f"with a note",
           text_model_of=(("gemma3", "Gemma3ForCausalLM", "the vision tower and multimodal projector"),),
           tiny=Tiny(GEMMA3)),
)
