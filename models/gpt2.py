"""GPT-2: learned positions, pre-LayerNorm blocks, fused q/k/v, GELU MLP, LM head tied to the token embedding.

    wte (vocab-parallel) + wpe -> dropout -> [ln_1 -> attn(c_attn column, c_proj row) -> +
                                             ln_2 -> mlp(c_fc column, act, c_proj row) -> +] x n -> ln_f -> lm_head
"""
from __future__ import annotations

import functools

from torch import nn

from colozoo.layers import (ColumnParallelLinear, Embedding, LayerNorm, RowParallelLinear, VocabParallelEmbedding,
                            VocabParallelLMHead, attention, build_attention_mask, merge_heads, scatter_to_sequence,
                            split_heads)
from colozoo.layers.kv_cache import keys_values_mask
from colozoo.models.base import (BatchContext, ModelOutput, ParallelModel, check_divisible, default_positions,
                                 dropout, require)


class GPT2Attention(nn.Module):
    def __init__(self, config, layer_idx: int, pc, device=None, dtype=None):
        super().__init__()
        h, tp = config.hidden_size, pc.tp_size
        self.head_dim = h // config.num_attention_heads
        self.local_heads = config.num_attention_heads // tp
        self.scale = (self.head_dim ** -0.5 if config.scale_attn_weights else 1.0)
        if config.scale_attn_by_inverse_layer_idx:
            self.scale /= float(layer_idx + 1)
        self.upcast = config.reorder_and_upcast_attn
        self.attn_pdrop, self.resid_pdrop = config.attn_pdrop, config.resid_pdrop
        self.sharded_resid = pc.sequence_parallel
        kw = dict(group=pc.tp_group, sequence_parallel=pc.sequence_parallel, device=device, dtype=dtype)
        self.c_attn = ColumnParallelLinear(h, 3 * h, chunks=(h, h, h), **kw)
        self.c_proj = RowParallelLinear(h, h, **kw)

    def forward(self, x, ctx: BatchContext):
        q, k, v = split_heads(self.c_attn(x), self.local_heads, self.local_heads, self.head_dim)
        k, v, mask, causal = keys_values_mask(ctx, self, k, v)
        out = attention(q, k, v, mask, causal=causal, scale=self.scale, upcast=self.upcast, cp=ctx.cp,
                        dropout_p=self.attn_pdrop if self.training else 0.0, documents=ctx.documents)
        out = self.c_proj(merge_heads(out))
        return dropout(out, self.resid_pdrop, self.training, sharded=self.sharded_resid)


class GPT2MLP(nn.Module):
    def __init__(self, config, pc, device=None, dtype=None):
        super().__init__()
        h = config.hidden_size
        inner = config.n_inner if config.n_inner is not None else 4 * h
        check_divisible("the MLP width (n_inner)", inner, pc.tp_size)
        kw = dict(group=pc.tp_group, sequence_parallel=pc.sequence_parallel, device=device, dtype=dtype)
        self.c_fc = ColumnParallelLinear(h, inner, activation=config.activation_function, **kw)
        self.c_proj = RowParallelLinear(inner, h, **kw)
        self.resid_pdrop, self.sharded_resid = config.resid_pdrop, pc.sequence_parallel

    def forward(self, x):
        out = self.c_proj(self.c_fc(x))
        return dropout(out, self.resid_pdrop, self.training, sharded=self.sharded_resid)


class GPT2Block(nn.Module):
    attention_block = "attn"  # what selective activation checkpointing recomputes

    def __init__(self, config, layer_idx, pc, device=None, dtype=None):
        super().__init__()
        norm = dict(eps=config.layer_norm_epsilon, group=pc.tp_group, sequence_parallel=pc.sequence_parallel,
                    device=device, dtype=dtype)
        self.ln_1 = LayerNorm(config.hidden_size, **norm)
        self.attn = GPT2Attention(config, layer_idx, pc, device, dtype)
        self.ln_2 = LayerNorm(config.hidden_size, **norm)
        self.mlp = GPT2MLP(config, pc, device, dtype)

    def forward(self, x, ctx):
        attn_out = self.attn(self.ln_1(x), ctx)
        mlp_in, x = self.ln_2(attn_out, residual=x)  # x + attn_out, and that normalised
        return x + self.mlp(mlp_in)


class GPT2ForCausalLM(ParallelModel):
    family = "gpt2"
    tied_embedding = "wte.weight"

    def __init__(self, config, pc=None, layer_ids=None, device=None, dtype=None):
        super().__init__(config, pc, layer_ids)
        pc = self.pc
        require(not getattr(config, "add_cross_attention", False), "GPT-2 cross-attention is not supported")
        check_divisible("the attention heads (n_head)", config.num_attention_heads, pc.tp_size)
        h = config.hidden_size
        kw = dict(device=device, dtype=dtype)
        if self.is_first or (self.is_last and config.tie_word_embeddings):  # the last stage holds a tied copy
            self.wte = VocabParallelEmbedding(config.vocab_size, h, group=pc.tp_group,
                                              sequence_parallel=pc.sequence_parallel, **kw)
        if self.is_first:
            self.wpe = Embedding(config.max_position_embeddings, h, **kw)
        self.layers = nn.ModuleDict({str(i): GPT2Block(config, i, pc, **kw) for i in self.layer_ids})
        if self.is_last:
            self.ln_f = LayerNorm(h, eps=config.layer_norm_epsilon, group=pc.tp_group,
                                  sequence_parallel=pc.sequence_parallel, **kw)
            tied = self.wte if config.tie_word_embeddings else None
            self.lm_head = VocabParallelLMHead(h, config.vocab_size, group=pc.tp_group,
                                               sequence_parallel=pc.sequence_parallel, tied_embedding=tied, **kw)

    def batch_context(self, input_ids, attention_mask=None, position_ids=None) -> BatchContext:
        s = input_ids.shape[1]
        self.check_sequence(s, self.config.max_position_embeddings)
        position_ids = default_positions(input_ids, position_ids)
        dense_mask = functools.partial(build_attention_mask, attention_mask, s, causal=True)
        return BatchContext(attention_mask, dense_mask, position_ids, s)

    def embed(self, input_ids, ctx):
        positions = self.wpe(ctx.position_ids)
        if self.sequence_parallel:
            positions = scatter_to_sequence(positions, self.tp_group)
        hidden = self.wte(input_ids, ctx.token_rows) + positions
        return dropout(hidden, self.config.embd_pdrop, self.training, sharded=self.sequence_parallel)

    def head(self, hidden, ctx, labels=None, return_logits=False) -> ModelOutput:
        hidden = self.ln_f(hidden)
        loss, logits = self.lm_head.loss_and_logits(hidden, labels, return_logits, cp=ctx.cp)
        return ModelOutput(loss=loss, logits=logits, hidden_states=self.output_hidden_states(ctx, last=hidden))
