"""Mixtral: the LLaMA/Mistral decoder (RoPE, RMSNorm, grouped-query attention, optional sliding window) with a
sparse mixture-of-experts MLP in every layer.

    embed_tokens -> [input_layernorm -> attn (models.llama) -> + post_attention_layernorm -> mlp (layers.moe: router
                    `gate`, stacked experts `gate_up_proj` / `down_proj`, expert parallel over ep) -> +] x n
                 -> norm -> lm_head; loss = LM loss + router_aux_loss_coef * load-balancing loss (all layers)

With `output_router_logits` in the config (or passed to forward) the load-balancing loss is returned as
`aux_loss` and added to the loss, as transformers does. Two options beyond Mixtral's config, read when set on
it: `router_z_loss_coef` adds a router z-loss, `capacity_factor` caps tokens per expert (dropless without).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from colozoo.layers.moe import MoE, router_losses, router_statistics
from colozoo.models.base import ModelOutput, UnsupportedConfig
from colozoo.core.mesh import single_process

from .llama import LlamaForCausalLM, RopeBatchContext


class RouterLogits:
    """One (tokens, experts) tensor per MoE layer, in order. Deliberately not a list: FSDP rebuilds the lists and
    dataclasses among a layer's inputs (to hook their tensors); every layer must append to the one the head reads."""

    def __init__(self):
        self.items: list = []

    def append(self, logits):
        self.items.append(logits)

    def __iter__(self):
        return iter(self.items)

    def __getitem__(self, index):
        return self.items[index]

    def __len__(self):
        return len(self.items)


@dataclass
class MoEBatchContext(RopeBatchContext):
    router_logits: RouterLogits = field(default_factory=RouterLogits)
    output_router_logits: bool = False                 # compute the load-balancing loss
    router_stats_in: torch.Tensor | None = None        # router statistics of earlier pipeline stages' layers


class MoECausalLM(LlamaForCausalLM):
    """A LLaMA-style decoder with MoE layers: router logits collected per batch, load-balancing (and z) loss."""

    num_experts_key = "num_local_experts"  # the config attribute holding the number of experts

    def __init__(self, config, pc=None, layer_ids=None, device=None, dtype=None):
        pc = pc or single_process()
        experts, ep = getattr(config, self.num_experts_key), pc.size("ep")
        if experts % ep:
            raise UnsupportedConfig(f"ep={ep} must divide the number of experts ({self.num_experts_key}={experts})")
        super().__init__(config, pc, layer_ids, device=device, dtype=dtype)
        self.num_experts, self.top_k = getattr(config, self.num_experts_key), config.num_experts_per_tok

    def router_stats_width(self) -> int:
        """Length of the router statistics vector a pipeline stage hands to the next (layers.moe)."""
        return 2 * self.num_experts + 2

    def router_statistics(self, ctx: MoEBatchContext, device) -> torch.Tensor:
        """The router statistics of this stage's MoE layers plus those of earlier pipeline stages."""
        token_mask = ctx.attention_mask
        if token_mask is not None and ctx.cp is not None:
            token_mask = ctx.cp.shard(token_mask)
        if ctx.router_logits.items:
            own = router_statistics(ctx.router_logits, self.num_experts, self.top_k, token_mask)
        else:  # no MoE layer on this stage (Qwen2-MoE's dense layers)
            own = torch.zeros(self.router_stats_width(), device=device, requires_grad=torch.is_grad_enabled())
        return own if ctx.router_stats_in is None else ctx.router_stats_in + own

    def batch_context(self, input_ids, attention_mask=None, position_ids=None,
                      output_router_logits: bool | None = None, rope_length: int | None = None) -> MoEBatchContext:
        """`output_router_logits` (a forward keyword, as in transformers) overrides the config's."""
        ctx = super().batch_context(input_ids, attention_mask, position_ids=position_ids, rope_length=rope_length)
        if output_router_logits is None:
            output_router_logits = getattr(self.config, "output_router_logits", False)
        return MoEBatchContext(**{f.name: getattr(ctx, f.name) for f in fields(ctx)},
                               output_router_logits=output_router_logits)

    def head(self, hidden, ctx: MoEBatchContext, labels=None, return_logits=False) -> ModelOutput:
        out = super().head(hidden, ctx, labels=labels, return_logits=return_logits)
        if not ctx.output_router_logits:
            return out
        c = self.config
        # the runtime sums over dp*cp (ctx.data_group), so the losses are those of the global batch
        group = ctx.data_group if ctx.data_group is not None else ctx.cp.group if ctx.cp is not None else None
        out.aux_loss, z_loss = router_losses(self.router_statistics(ctx, hidden.device), self.num_experts, group)
        if out.loss is not None:
            out.router_loss = c.router_aux_loss_coef * out.aux_loss
            z_coef = getattr(c, "router_z_loss_coef", 0.0) or 0.0
            if z_coef:
                out.router_loss = out.router_loss + z_coef * z_loss
            out.loss = out.loss + out.router_loss
        return out


class MixtralForCausalLM(MoECausalLM):
    family = "mixtral"

    def __init__(self, config, pc=None, layer_ids=None, device=None, dtype=None):
        if getattr(config, "router_jitter_noise", 0.0):
            raise UnsupportedConfig("router_jitter_noise is not supported (set it to 0.0)")
        super().__init__(config, pc, layer_ids, device=device, dtype=dtype)

    def build_mlp(self, layer_idx, config, pc, device=None, dtype=None):
        return MoE(config.hidden_size, config.intermediate_size, config.num_local_experts, config.num_experts_per_tok,
                   activation=config.hidden_act, capacity_factor=getattr(config, "capacity_factor", None),
                   ep_group=pc.group("ep"), tp_group=pc.tp_group, sequence_parallel=pc.sequence_parallel,
                   device=device, dtype=dtype)
