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

import torch
from torch import nn

from colozoo.layers.activations import clamped_swiglu
from colozoo.layers.moe import GroupedExperts
from colozoo.layers.shard import Split
from colozoo.models.decoder import MoEDecoderModel, layer_window
from colozoo.models.family import TINY, Family, Tiny


class GptOssExperts(GroupedExperts):
    """gpt-oss's experts as transformers holds them: weights stored (experts, in, out), gate and up interleaved in
    gate_up_proj's columns (so a tp rank's contiguous columns hold whole (gate, up) pairs), and biases
    `gate_up_proj_bias` (split like the columns) and `down_proj_bias` (added once the tp partial sums are reduced)."""

    def build_weights(self, hidden_size: int, inner_size: int, tp: int, **kw):
        local_inner = inner_size // tp
        self.gate_up_proj = self.expert_parameter(hidden_size, 2 * local_inner, splits=(Split("tp", 2),), **kw)
        self.gate_up_proj_bias = self.expert_parameter(2 * local_inner, splits=(Split("tp", 1),), **kw)
        self.down_proj = self.expert_parameter(local_inner, hidden_size, splits=(Split("tp", 1),), **kw)
        self.down_proj_bias = self.expert_parameter(hidden_size, splits=(), **kw)

    def weights(self):
        return self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2)

    def gate_and_up(self, gate_up, counts):
        gate_up = gate_up + self._per_row(self.gate_up_proj_bias, counts)
        return gate_up[:, 0::2], gate_up[:, 1::2]

    def output(self, out, counts):
        return out + self._per_row(self.down_proj_bias, counts)

    @staticmethod
    def _per_row(bias: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each local expert's bias repeated for its rows."""
        repeats = torch.tensor(counts, device=bias.device)
        return bias.repeat_interleave(repeats, dim=0, output_size=sum(counts))


class GptOssForCausalLM(MoEDecoderModel):
    family = "gpt_oss"
    num_experts_key = "num_local_experts"

    def attention_window(self, config):
        return None  # per layer: full layers take the batch's causal mask, sliding layers build theirs

    def build_attention(self, layer_idx: int, config, parallel, **kw) -> nn.Module:
        return self.attention(layer_idx, window=layer_window(config, layer_idx), sinks=True, **kw)

    def moe_options(self, config, parallel, **kw) -> dict:
        activation = clamped_swiglu(config.swiglu_alpha, config.swiglu_limit)
        experts = GptOssExperts(self.experts(config), config.hidden_size, self.expert_width(config), activation,
                                ep_group=parallel.group("ep"), tp_group=parallel.tp_group, **kw)
        return dict(router_bias=True, experts=experts, activation=activation)


# sinks, YaRN scaling 16 original positions by 4, biases on attention, router and experts, the clamped SwiGLU, and
# layers alternating a window of 5 and full attention; transformers has no SDPA path for sinks: eager reference
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 16, "rope_theta": 150000.0}
FAMILIES = (Family("gpt_oss", ("gpt_oss",), GptOssForCausalLM, gated_mlp=True, title="gpt-oss",
                   features="causal LM with mixture-of-experts (attention sinks on the torch path, the flash and the "
                            "decoding kernels; alternating 128-token sliding / full layers, YaRN, biased router and "
                            "experts, clamped SwiGLU; the published MXFP4 checkpoints dequantised on read, bf16 ones "
                            "as they are; context parallel in all-to-all mode only)",
                   tiny=Tiny(dict(TINY, intermediate_size=32, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                  num_experts_per_tok=2, max_position_embeddings=64, sliding_window=5,
                                  rope_parameters=YARN, output_router_logits=True, router_aux_loss_coef=0.05,
                                  pad_token_id=0),
                             attention="eager", meshes=("tp2-sp", "ep2", "pp2-tp2", "cp2-all_to_all"),
                             lora=("q_proj", "k_proj", "v_proj", "o_proj"))),)
