"""OPT: learned positions (offset 2, counted over the attention mask), pre- or post-LayerNorm blocks, fused q/k/v,
ReLU MLP, optional word-embedding projections, LM head tied to the token embedding.

    embed_tokens (vocab-parallel) -> [project_in] + embed_positions ->
        [self_attn (qkv column, out_proj row) -> + -> fc1 (column) -> act -> fc2 (row) -> +] x n
        (LayerNorms before each sub-block, or after each residual add for post-LN models like opt-350m)
    -> [final_layer_norm] -> [project_out] -> lm_head
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from colozoo.layers import (AttentionSpec, Embedding, LayerNorm, SelfAttention, TransformerLayer,
                            VocabParallelEmbedding, VocabParallelLMHead, copy_to_parallel, scatter_to_sequence)
from colozoo.layers.vocab import LogitsRequest
from colozoo.models.base import ModelOutput, ParallelModel, UnsupportedConfig, check_divisible, default_positions
from colozoo.models.family import Family, Tiny

POSITION_OFFSET = 2  # OPT's learned position table reserves its first two rows


class ReplicatedLinear(nn.Module):
    """A linear layer replicated over tp (the embedding projections). Under sequence parallelism each rank sees
    only its share of the sequence, so the weight gradient is partial and is summed over the tp group."""

    def __init__(self, in_features: int, out_features: int, *, group=None, sequence_parallel=False,
                 device=None, dtype=None):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        weight = copy_to_parallel(self.weight, self.group) if self.sequence_parallel else self.weight
        return F.linear(x, weight)


def opt_attention(config, layer_idx: int, parallel, device=None, dtype=None) -> SelfAttention:
    h = config.hidden_size
    if h % config.num_attention_heads:
        raise UnsupportedConfig(f"hidden_size ({h}) must be divisible by num_attention_heads "
                                f"({config.num_attention_heads})")
    # OPT scales q after the projection (bias included) and attends with scale 1; same order, same rounding
    spec = AttentionSpec(h, config.num_attention_heads, qkv_bias=config.enable_bias, out_bias=config.enable_bias,
                         dropout=config.attention_dropout, scale_query=True)
    return SelfAttention(spec, layer_idx=layer_idx, group=parallel.tp_group,
                         sequence_parallel=parallel.sequence_parallel,
                         device=device, dtype=dtype)


class OPTDecoderLayer(TransformerLayer):
    """Pre-LayerNorm, or post-LayerNorm (each norm after its residual add) for models like opt-350m."""

    def __init__(self, config, layer_idx: int, parallel, device=None, dtype=None):
        check_divisible("the MLP width (ffn_dim)", config.ffn_dim, parallel.tp_size)
        super().__init__(opt_attention(config, layer_idx, parallel, device, dtype), config.hidden_size, config.ffn_dim,
                         activation=config.activation_function, pre_norm=config.do_layer_norm_before,
                         dropout=config.dropout, bias=config.enable_bias,
                         norm_affine=config.layer_norm_elementwise_affine, group=parallel.tp_group,
                         sequence_parallel=parallel.sequence_parallel, device=device, dtype=dtype)


class OPTForCausalLM(ParallelModel):
    family = "opt"
    input_embedding, tied_embedding = "embed_tokens", "embed_tokens.weight"

    def __init__(self, config, parallel=None, layer_ids=None, device=None, dtype=None):
        super().__init__(config, parallel, layer_ids)
        parallel = self.parallel
        check_divisible("the attention heads (num_attention_heads)", config.num_attention_heads, parallel.tp_size)
        h, proj_dim = config.hidden_size, config.word_embed_proj_dim
        kw = dict(device=device, dtype=dtype)
        sp = dict(group=parallel.tp_group, sequence_parallel=parallel.sequence_parallel)
        projected = proj_dim != h
        if self.is_first or (self.is_last and config.tie_word_embeddings):  # the last stage holds a tied copy
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, proj_dim, config.pad_token_id, **sp, **kw)
        if self.is_first:
            self.embed_positions = Embedding(config.max_position_embeddings + POSITION_OFFSET, h, **kw)
            if projected:
                self.project_in = ReplicatedLinear(proj_dim, h, **sp, **kw)
        self.layers = nn.ModuleDict({str(i): OPTDecoderLayer(config, i, parallel, **kw) for i in self.layer_ids})
        if self.is_last:
            if config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False):
                self.final_layer_norm = LayerNorm(h, elementwise_affine=config.layer_norm_elementwise_affine,
                                                  **sp, **kw)
            if projected:
                self.project_out = ReplicatedLinear(h, proj_dim, **sp, **kw)
            tied = self.embed_tokens if config.tie_word_embeddings else None
            self.lm_head = VocabParallelLMHead(proj_dim, config.vocab_size, tied_embedding=tied, **sp, **kw)

    @classmethod
    def mlp_width(cls, config) -> int:
        return config.ffn_dim

    def position_limit(self) -> int:
        return self.config.max_position_embeddings

    def check_sequence(self, seq_len: int):
        super().check_sequence(seq_len)
        if self.training and self.config.layerdrop > 0:
            raise UnsupportedConfig(f"OPT layerdrop={self.config.layerdrop} in training is not supported "
                                    f"(set config.layerdrop = 0)")

    def positions(self, input_ids, attention_mask=None, position_ids=None):
        if position_ids is None and attention_mask is not None:
            # positions count real tokens only; padding gets -1 (row 1 of the table), as in OPT
            mask = attention_mask.long()
            position_ids = mask.cumsum(dim=1) * mask - 1
        return default_positions(input_ids, position_ids)

    def embed(self, input_ids, batch):
        positions = self.embed_positions(batch.position_ids + POSITION_OFFSET)
        if self.sequence_parallel:
            positions = scatter_to_sequence(positions, self.tp_group)
        tokens = self.embed_tokens(input_ids, batch.token_rows)
        if hasattr(self, "project_in"):
            tokens = self.project_in(tokens)
        return tokens + positions

    def head(self, hidden, batch, labels=None, logits: LogitsRequest = LogitsRequest()) -> ModelOutput:
        if hasattr(self, "final_layer_norm"):
            hidden = self.final_layer_norm(hidden)
        if hasattr(self, "project_out"):
            hidden = self.project_out(hidden)
        return self.lm_output(hidden, batch, labels, logits)


FAMILIES = (Family("opt", ("opt",), OPTForCausalLM, learned_positions=True, title="OPT",
                   features="causal LM (pre/post-LN, embedding projections, positions counted over the attention "
                            "mask)",
                   tiny=Tiny(dict(vocab_size=101, hidden_size=64, num_hidden_layers=2, ffn_dim=96,
                                  num_attention_heads=4, max_position_embeddings=32, dropout=0.0,
                                  attention_dropout=0.0, pad_token_id=1),
                             lora=("q_proj", "v_proj", "out_proj", "fc2"))),)
