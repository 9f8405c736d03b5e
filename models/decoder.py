"""The shared decoder: the LLaMA-style causal LM that most families are, and its mixture-of-experts variant.

    embed_tokens (vocab-parallel) -> [input_layernorm -> self_attn (layers.SelfAttention: qkv column, fused q/k/v of
        different sizes, RoPE, o_proj row) -> + post_attention_layernorm -> mlp (gate_up column, act(gate) * up,
        down_proj row; or a mixture of experts) -> +] x n -> norm -> lm_head (tied or not)

A family subclasses DecoderModel and chooses per layer: `build_attention` (biases, sliding window, score scale and
cap, q/k norm, local RoPE: fields of its layers.AttentionSpec via `attention`), `build_mlp` (dense, experts, experts +
shared expert) and `build_layer` (Gemma's four norms). MoEDecoderModel collects the router logits of a batch and adds
the load-balancing (and z) loss, as transformers does with `output_router_logits` in the config or the forward.
"""
from __future__ import annotations

import torch
from torch import nn

from colozoo.layers import (AttentionSpec, GatedMLP, RMSNorm, SelfAttention, VocabParallelEmbedding,
                            VocabParallelLMHead)
from colozoo.layers.batch import BatchContext
from colozoo.layers.moe import MoE, MoESpec, router_losses, router_statistics
from colozoo.layers.rope import RotaryEmbedding, head_dim_of
from colozoo.layers.vocab import LogitsRequest
from colozoo.models.base import ModelOutput, ParallelModel, UnsupportedConfig, check_divisible, dropout


def layer_window(config, layer_idx: int) -> int | None:
    """Layer `layer_idx`'s sliding window: config.sliding_window for a "sliding_attention" layer of
    config.layer_types, else None (full attention)."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return config.sliding_window if layer_types[layer_idx] == "sliding_attention" else None


def dense_mlp(config, parallel, bias: bool = False, device=None, dtype=None) -> GatedMLP:
    """The dense SwiGLU MLP (gate_up column, silu(gate) * up, down_proj row)."""
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=bias, group=parallel.tp_group,
                    sequence_parallel=parallel.sequence_parallel, device=device, dtype=dtype)


class DecoderLayer(nn.Module):
    """input_layernorm -> self_attn -> + post_attention_layernorm -> mlp -> +, for every family on this decoder.

    The MLP is the family's: dense SwiGLU, a mixture of experts (Mixtral), or experts plus a shared expert
    (Qwen2-MoE). A MoE returns (output, router logits); the logits are appended to batch.router_logits for the
    load-balancing loss. `resid_dropout` drops out both block outputs before their residual adds (Phi-3)."""

    attention_block = "self_attn"  # what selective activation checkpointing recomputes

    def __init__(self, config, parallel, self_attn: nn.Module, mlp: nn.Module, device=None, dtype=None,
                 resid_dropout: float = 0.0):
        super().__init__()
        self.resid_dropout, self.sharded_resid = resid_dropout, parallel.sequence_parallel
        norm = dict(eps=config.rms_norm_eps, group=parallel.tp_group, sequence_parallel=parallel.sequence_parallel,
                    device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, **norm)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, **norm)
        self.mlp = mlp
        self.routed = isinstance(mlp, MoE)

    def _dropout(self, x):
        return dropout(x, self.resid_dropout, self.training, sharded=self.sharded_resid) if self.resid_dropout else x

    def forward(self, x, batch):
        # each norm goes to the projection after it, which fuses it where it can (nothing keeps the normed tensor)
        attn_out = self._dropout(self.self_attn(x, batch, norm=self.input_layernorm))
        if not self.routed:
            out, x = self.mlp(attn_out, norm=self.post_attention_layernorm, residual=x)  # x + attn_out
            return x + self._dropout(out)
        mlp_in, x = self.post_attention_layernorm(attn_out, residual=x)  # x + attn_out, and that normalised
        out, router_logits = self.mlp(mlp_in)
        batch.router_logits.append(router_logits)
        return x + self._dropout(out)


class DecoderModel(ParallelModel):
    """The LLaMA-style causal LM: grouped-query attention with RoPE, RMSNorm, a gated MLP, an optional sliding window
    (in the batch's mask) and a tied or untied LM head."""

    input_embedding, tied_embedding = "embed_tokens", "embed_tokens.weight"
    norm_options: dict = {}  # of every RMSNorm (Gemma: offset=True)

    def __init__(self, config, parallel=None, layer_ids=None, device=None, dtype=None):
        super().__init__(config, parallel, layer_ids)
        parallel = self.parallel
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if heads % kv_heads:
            raise UnsupportedConfig(f"num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads})")
        check_divisible("the attention heads (num_attention_heads)", heads, parallel.tp_size)
        if kv_heads % parallel.tp_size and parallel.tp_size % kv_heads:
            raise UnsupportedConfig(f"tp={parallel.tp_size} must divide the key/value heads (num_key_value_heads="
                                    f"{kv_heads}) or be a multiple of them (each kv head then replicated over "
                                    f"tp / num_key_value_heads ranks)")
        # the tp ranks holding one kv head (tp > kv heads replicates each); collective: built here, where every rank
        # of every stage passes
        self.kv_replica_group = parallel.tp_subgroup(max(parallel.tp_size // kv_heads, 1))
        check_divisible("the MLP width (intermediate_size)", config.intermediate_size, parallel.tp_size)
        self.sliding_window = self.attention_window(config)
        h = config.hidden_size
        kw = dict(device=device, dtype=dtype)
        sp = dict(group=parallel.tp_group, sequence_parallel=parallel.sequence_parallel)
        if self.is_first or (self.is_last and config.tie_word_embeddings):  # the last stage holds a tied copy
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h, padding_idx=config.pad_token_id, **sp, **kw)
        self.layers = nn.ModuleDict({str(i): self.build_layer(i, config, parallel, **kw) for i in self.layer_ids})
        if self.is_last:
            self.norm = RMSNorm(h, eps=config.rms_norm_eps, **self.norm_options, **sp, **kw)
            tied = self.embed_tokens if config.tie_word_embeddings else None
            self.lm_head = VocabParallelLMHead(h, config.vocab_size, **sp, tied_embedding=tied,
                                               softcap=self.logit_softcap(config), **kw)
        self.rotary = RotaryEmbedding(config, device=device)

    def logit_softcap(self, config) -> float | None:
        """The cap of the LM head's logits (Gemma's final soft-capping), None for none."""
        return None

    def mlp_bias(self, config) -> bool:
        """Biases on the dense MLP's projections."""
        return False

    def attention_window(self, config) -> int | None:
        """The sliding attention window most layers share (None: full causal attention), in the batch's mask."""
        return getattr(config, "sliding_window", None)

    def build_layer(self, layer_idx: int, config, parallel, **kw) -> nn.Module:
        return DecoderLayer(config, parallel, self.build_attention(layer_idx, config, parallel, **kw),
                            self.build_mlp(layer_idx, config, parallel, **kw), **kw)

    def attention(self, layer_idx: int, device=None, dtype=None, **options) -> SelfAttention:
        """Layer `layer_idx`'s attention with this decoder's defaults (biases from config.attention_bias, the model's
        window, global RoPE), `options` (fields of layers.AttentionSpec) overriding them."""
        c, parallel = self.config, self.parallel
        bias = getattr(c, "attention_bias", False)
        settings = dict(qkv_bias=bias, out_bias=bias, window=self.sliding_window, rotary="global",
                        dropout=c.attention_dropout, names=("qkv", "o_proj"))
        settings.update(options)
        spec = AttentionSpec(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, head_dim_of(c), **settings)
        return SelfAttention(spec, layer_idx=layer_idx, group=parallel.tp_group,
                             sequence_parallel=parallel.sequence_parallel,
                             replica_group=self.kv_replica_group,
                             device=device, dtype=dtype)

    def build_attention(self, layer_idx: int, config, parallel, **kw) -> nn.Module:
        return self.attention(layer_idx, **kw)

    def build_mlp(self, layer_idx: int, config, parallel, **kw) -> nn.Module:
        """Layer `layer_idx`'s MLP: dense here, a mixture of experts in the MoE families."""
        return dense_mlp(config, parallel, bias=self.mlp_bias(config), **kw)

    def embed(self, input_ids, batch):
        return self.embed_tokens(input_ids, batch.token_rows)

    def head(self, hidden, batch, labels=None, logits: LogitsRequest = LogitsRequest()) -> ModelOutput:
        return self.lm_output(self.norm(hidden), batch, labels, logits)


class MoEDecoderModel(DecoderModel):
    """The decoder with MoE layers: router logits collected per batch, load-balancing (and z) loss. Options beyond
    the configs, read when set on them: `router_z_loss_coef` adds a router z-loss, `capacity_factor` caps tokens per
    expert (dropless without)."""

    num_experts_key = ""  # the config attribute holding the number of experts (each MoE family names its own)
    expert_width_key = ""  # the config attribute holding one routed expert's width ("": the dense MLP's)
    sparse_layer_rule = None  # (config, layer index) -> whether the layer holds experts (None: every layer does)

    def __init__(self, config, parallel=None, layer_ids=None, device=None, dtype=None):
        from colozoo.core.mesh import single_process

        experts, ep = self.experts(config), (parallel or single_process()).size("ep")
        if experts % ep:
            raise UnsupportedConfig(f"ep={ep} must divide the number of experts ({self.num_experts_key}={experts})")
        super().__init__(config, parallel, layer_ids, device=device, dtype=dtype)
        self.num_experts, self.top_k = experts, config.num_experts_per_tok

    @classmethod
    def expert_width(cls, config) -> int:
        return getattr(config, cls.expert_width_key) if cls.expert_width_key else cls.mlp_width(config)

    @classmethod
    def is_sparse_layer(cls, config, layer_idx: int) -> bool:
        return cls.sparse_layer_rule is None or cls.sparse_layer_rule(config, layer_idx)

    @classmethod
    def sparse_layers(cls, config) -> int:
        return sum(cls.is_sparse_layer(config, i) for i in range(cls.num_layers(config)))

    def build_mlp(self, layer_idx: int, config, parallel, **kw) -> nn.Module:
        """A MoE layer (moe, with the family's moe_options), or the dense MLP where the family's rule says so."""
        if not self.is_sparse_layer(config, layer_idx):
            return dense_mlp(config, parallel, **kw)
        return self.moe(config, parallel, **self.moe_options(config, parallel, **kw), **kw)

    def moe_options(self, config, parallel, **kw) -> dict:
        """What the family's MoE layers set beyond moe's defaults: fields of layers.MoESpec, and `router` / `experts`
        modules (built with `kw`, the device and dtype) replacing the default ones."""
        return {}

    def moe(self, config, parallel, router=None, experts=None, device=None, dtype=None, **options) -> MoE:
        """A MoE layer of this family: its sizes from the family's hooks (experts, expert_width, shared_expert_width),
        top-k, activation and capacity_factor (if set) from the config, `options` (fields of layers.MoESpec)
        overriding them; `router` and `experts`: modules replacing the default ones (see layers.MoE)."""
        settings = dict(activation=config.hidden_act, shared_expert_size=self.shared_expert_width(config) or None,
                        capacity_factor=getattr(config, "capacity_factor", None))
        settings.update(options)
        spec = MoESpec(config.hidden_size, self.expert_width(config), self.experts(config), config.num_experts_per_tok,
                       **settings)
        return MoE(spec, router=router, experts=experts, ep_group=parallel.group("ep"), tp_group=parallel.tp_group,
                   sequence_parallel=parallel.sequence_parallel, device=device, dtype=dtype)

    @classmethod
    def experts(cls, config) -> int:
        return getattr(config, cls.num_experts_key)

    def router_stats_width(self) -> int:
        return 2 * self.num_experts + 2

    def router_statistics(self, batch: BatchContext, device) -> torch.Tensor:
        """The router statistics of this stage's MoE layers plus those of earlier pipeline stages."""
        token_mask = batch.attention_mask
        if token_mask is not None and batch.cp is not None:
            token_mask = batch.cp.shard(token_mask)
        if batch.router_logits.items:
            own = router_statistics(batch.router_logits, self.num_experts, self.top_k, token_mask)
        else:  # no MoE layer on this stage (Qwen2-MoE's dense layers)
            own = torch.zeros(self.router_stats_width(), device=device, requires_grad=torch.is_grad_enabled())
        return own if batch.router_stats_in is None else batch.router_stats_in + own

    def batch_context(self, input_ids, attention_mask=None, position_ids=None, rope_length: int | None = None,
                      output_router_logits: bool | None = None) -> BatchContext:
        """`output_router_logits` (a forward keyword, as in transformers) overrides the config's."""
        batch = super().batch_context(input_ids, attention_mask, position_ids, rope_length)
        if output_router_logits is None:
            output_router_logits = getattr(self.config, "output_router_logits", False)
        batch.output_router_logits = output_router_logits
        return batch

    def head(self, hidden, batch, labels=None, logits: LogitsRequest = LogitsRequest()) -> ModelOutput:
        out = super().head(hidden, batch, labels=labels, logits=logits)
        if not batch.output_router_logits:
            return out
        c = self.config
        # the runtime sums over dp*cp (batch.data_group), so the losses are those of the global batch
        group = batch.data_group if batch.data_group is not None else batch.cp.group if batch.cp is not None else None
        out.aux_loss, z_loss = router_losses(self.router_statistics(batch, hidden.device), self.num_experts, group)
        if out.loss is not None:
            out.router_loss = c.router_aux_loss_coef * out.aux_loss
            z_coef = getattr(c, "router_z_loss_coef", 0.0) or 0.0
            if z_coef:
                out.router_loss = out.router_loss + z_coef * z_loss
            out.loss = out.loss + out.router_loss
        return out
