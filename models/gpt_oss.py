"""gpt-oss on the shared decoder (colozoo.models.decoder): attention with sinks (a learned logit per head in every
row's softmax) and biases, layers alternating a sliding window (config.layer_types, 128 tokens in the published
models) and full attention, YaRN RoPE, and a mixture of experts in every layer.

    embed_tokens -> [input_layernorm -> self_attn (qkv + bias, RoPE, sinks, window or full, o_proj + bias) -> +
                    post_attention_layernorm -> mlp (router `gate` with a bias: top-k of the logits, softmax over
                    them; experts in transformers' layout: gate_up_proj (experts, hidden, 2 x inner) with gate and up
                    interleaved, biases, clamped SwiGLU (up + 1) * gate * sigmoid(alpha * gate)) -> +] x n
                 -> norm -> lm_head; loss + router_aux_loss_coef * load-balancing loss with output_router_logits

The published weights are MXFP4 (colozoo.checkpoint.mxfp4 dequantises them on read); bf16 checkpoints load as
they are.
"""
from __future__ import annotations

from torch import nn

from colozoo.layers.activations import clamped_swiglu
from colozoo.models.decoder import MoEDecoderModel, layer_window
from colozoo.models.family import Family


class GptOssForCausalLM(MoEDecoderModel):
    family = "gpt_oss"

    def attention_window(self, config):
        return None  # per layer: full layers take the batch's causal mask, sliding layers build theirs

    def build_attention(self, layer_idx: int, config, pc, **kw) -> nn.Module:
        return self.attention(layer_idx, window=layer_window(config, layer_idx), sinks=True, **kw)

    def build_mlp(self, layer_idx: int, config, pc, **kw) -> nn.Module:
        return self.moe(config, pc, config.intermediate_size, router_bias=True, gpt_oss_layout=True,
                        activation=clamped_swiglu(config.swiglu_alpha, config.swiglu_limit), **kw)


FAMILIES = (Family("gpt_oss", ("gpt_oss",), GptOssForCausalLM, converter="gpt_oss", gated_mlp=True),)
