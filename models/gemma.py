"""Gemma 2 and Gemma 3 (text) on the LLaMA-style decoder of models.llama:

    embed_tokens * sqrt(hidden) -> [input_layernorm -> attn -> post_attention_layernorm -> + ->
                                    pre_feedforward_layernorm -> mlp(GeGLU) -> post_feedforward_layernorm -> +] x n
                                -> norm -> lm_head (tied) -> final logit softcap

Every RMSNorm scales by (1 + weight) in fp32. Attention scales scores by query_pre_attn_scalar ** -0.5; layers
alternate sliding-window and full attention (`config.layer_types`). Gemma 2 caps the attention scores
(attn_logit_softcapping); Gemma 3 instead normalises q and k per head and rotates its sliding-window layers with
their own RoPE base (rope_parameters["sliding_attention"]).
"""
from __future__ import annotations

import torch
from torch import nn

from colozoo.layers import GatedMLP, RMSNorm
from colozoo.models.base import require

from .llama import LlamaAttention, LlamaForCausalLM, RopeBatchContext, RotaryEmbedding

SLIDING, FULL = "sliding_attention", "full_attention"


class _RopeView:
    """The config as RotaryEmbedding sees it for one layer type (Gemma 3 keeps RoPE parameters per type)."""

    def __init__(self, config, params: dict):
        self._config, self.rope_parameters = config, params

    def __getattr__(self, name):
        return getattr(self._config, name)


def rope_config(config, layer_type: str):
    params = getattr(config, "rope_parameters", None) or {}
    return _RopeView(config, params[layer_type]) if isinstance(params.get(layer_type), dict) else config


class GemmaDecoderLayer(nn.Module):
    """Gemma's sandwich: a norm before and after both attention and the MLP, the residual added after each."""

    attention_block = "self_attn"

    def __init__(self, config, pc, self_attn: nn.Module, mlp: nn.Module, device=None, dtype=None):
        super().__init__()
        norm = dict(eps=config.rms_norm_eps, offset=True, group=pc.tp_group, sequence_parallel=pc.sequence_parallel,
                    device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, **norm)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, **norm)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, **norm)
        self.mlp = mlp
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, **norm)

    def forward(self, x, ctx):
        attn_out = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), ctx))
        mlp_in, x = self.pre_feedforward_layernorm(attn_out, residual=x)  # x + attn_out, and that normalised
        return x + self.post_feedforward_layernorm(self.mlp(mlp_in))


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 (model_type gemma2) and Gemma 3's text model (gemma3_text, Gemma3ForCausalLM)."""

    norm_options = {"offset": True}

    def __init__(self, config, pc=None, layer_ids=None, device=None, dtype=None):
        require(not getattr(config, "use_bidirectional_attention", False),
                "use_bidirectional_attention=True (an encoder Gemma) is not supported")
        super().__init__(config, pc, layer_ids, device=device, dtype=dtype)
        self.family = config.model_type
        self.rotary = RotaryEmbedding(rope_config(config, FULL), device=device)
        local = rope_config(config, SLIDING)
        self.local_rotary = RotaryEmbedding(local, device=device) if local is not config else None

    def attention_window(self, config) -> int | None:
        return None  # per layer: see layer_window

    @staticmethod
    def layer_window(config, layer_idx: int) -> int | None:
        return config.sliding_window if config.layer_types[layer_idx] == SLIDING else None

    def build_layer(self, layer_idx: int, config, pc, **kw) -> GemmaDecoderLayer:
        return GemmaDecoderLayer(config, pc, self.build_attention(layer_idx, config, pc, **kw),
                                 self.build_mlp(layer_idx, config, pc, **kw), **kw)

    def build_attention(self, layer_idx: int, config, pc, **kw) -> nn.Module:
        window, gemma3 = self.layer_window(config, layer_idx), config.model_type == "gemma3_text"
        # transformers' Gemma 3 attention never passes attn_logit_softcapping on: neither do we
        softcap = None if gemma3 else config.attn_logit_softcapping
        return LlamaAttention(config, pc, window=window, scale=config.query_pre_attn_scalar ** -0.5,
                              softcap=softcap, qk_norm=self.norm_options if gemma3 else False,
                              local_rope=window is not None, **kw)

    def build_mlp(self, layer_idx: int, config, pc, **kw) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_activation, bias=False,
                        group=pc.tp_group, sequence_parallel=pc.sequence_parallel, **kw)

    def reset_buffers(self):
        super().reset_buffers()
        if self.local_rotary is not None:
            self.local_rotary.reset_buffers()

    def batch_context(self, input_ids, attention_mask=None, position_ids=None, rope_length=None) -> RopeBatchContext:
        """The full layers' causal mask; sliding layers build theirs on first use (RopeBatchContext.mask_for)."""
        ctx = super().batch_context(input_ids, attention_mask, position_ids, rope_length)
        if self.local_rotary is not None:
            ctx.local_inv_freq = self.local_rotary(ctx.position_ids, rope_length)
        return ctx

    def embed(self, input_ids, ctx):
        hidden = self.embed_tokens(input_ids, ctx.token_rows)
        # transformers rounds the normaliser to the activation dtype first (sqrt(3072) in bf16 is 55.5, not 55.4)
        return hidden * torch.tensor(self.config.hidden_size ** 0.5, dtype=hidden.dtype, device=hidden.device)
