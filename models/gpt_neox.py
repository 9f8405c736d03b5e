"""GPT-NeoX / Pythia: rotary attention on part of each head, LayerNorms with biases, a GELU MLP, and a parallel
residual by default.

    embed_in (vocab-parallel) -> dropout
        -> [parallel:   x + attn(input_layernorm(x)) + mlp(post_attention_layernorm(x))
            sequential: h = x + attn(input_layernorm(x)); h + mlp(post_attention_layernorm(h))] x n
        -> final_layer_norm -> lm_head (the checkpoint's embed_out; untied unless tie_word_embeddings)

attention: qkv (column-parallel, chunks q | k | v; the checkpoint's query_key_value is stored per head and reordered by
the converter), RoPE on the first rotary_dim = head_dim * partial_rotary_factor (rotary_pct) features of each head
(models.llama's RoPE code), dense (row-parallel). mlp: dense_h_to_4h (column-parallel, with its activation),
dense_4h_to_h (row-parallel). Every linear has a bias unless attention_bias is off (attention only).
"""
from __future__ import annotations

from torch import nn

from colozoo.layers import (ColumnParallelLinear, LayerNorm, RowParallelLinear, VocabParallelEmbedding,
                            VocabParallelLMHead, attention, merge_heads, split_heads)
from colozoo.layers.kv_cache import keys_values_mask
from colozoo.models.base import ModelOutput, check_divisible, dropout

from .llama import RopeBatchContext, RotaryEmbedding, RotaryModel, apply_rope


class GPTNeoXAttention(nn.Module):
    def __init__(self, config, pc, device=None, dtype=None):
        super().__init__()
        h, heads = config.hidden_size, config.num_attention_heads
        self.head_dim, self.local_heads = h // heads, heads // pc.tp_size
        self.dropout_p = config.attention_dropout
        kw = dict(bias=config.attention_bias, group=pc.tp_group, sequence_parallel=pc.sequence_parallel,
                  device=device, dtype=dtype)
        self.qkv = ColumnParallelLinear(h, 3 * h, chunks=(h, h, h), **kw)
        self.dense = RowParallelLinear(h, h, **kw)

    def forward(self, x, ctx: RopeBatchContext):
        q, k, v = split_heads(self.qkv(x), self.local_heads, self.local_heads, self.head_dim)
        cos, sin = ctx.rope()
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v, mask, causal = keys_values_mask(ctx, self, k, v)
        out = attention(q, k, v, mask, causal=causal, scale=self.head_dim ** -0.5, cp=ctx.cp,
                        dropout_p=self.dropout_p if self.training else 0.0, documents=ctx.documents)
        return self.dense(merge_heads(out))


class GPTNeoXMLP(nn.Module):
    def __init__(self, config, pc, device=None, dtype=None):
        super().__init__()
        h, inner = config.hidden_size, config.intermediate_size
        kw = dict(group=pc.tp_group, sequence_parallel=pc.sequence_parallel, device=device, dtype=dtype)
        self.dense_h_to_4h = ColumnParallelLinear(h, inner, activation=config.hidden_act, **kw)
        self.dense_4h_to_h = RowParallelLinear(inner, h, **kw)

    def forward(self, x):
        return self.dense_4h_to_h(self.dense_h_to_4h(x))


class GPTNeoXLayer(nn.Module):
    attention_block = "attention"  # what selective activation checkpointing recomputes

    def __init__(self, config, pc, device=None, dtype=None):
        super().__init__()
        norm = dict(eps=config.layer_norm_eps, group=pc.tp_group, sequence_parallel=pc.sequence_parallel,
                    device=device, dtype=dtype)
        self.parallel_residual = config.use_parallel_residual
        self.dropout_p, self.sharded_resid = config.hidden_dropout, pc.sequence_parallel
        self.input_layernorm = LayerNorm(config.hidden_size, **norm)
        self.attention = GPTNeoXAttention(config, pc, device, dtype)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, **norm)
        self.mlp = GPTNeoXMLP(config, pc, device, dtype)

    def _dropout(self, x):
        return dropout(x, self.dropout_p, self.training, sharded=self.sharded_resid)

    def forward(self, x, ctx):
        attn_out = self._dropout(self.attention(self.input_layernorm(x), ctx))
        if self.parallel_residual:  # both blocks read the layer's input
            return self._dropout(self.mlp(self.post_attention_layernorm(x))) + attn_out + x
        mlp_in, x = self.post_attention_layernorm(attn_out, residual=x)  # x + attn_out, and that normalised
        return self._dropout(self.mlp(mlp_in)) + x


class GPTNeoXForCausalLM(RotaryModel):
    family = "gpt_neox"
    tied_embedding = "embed_in.weight"

    def __init__(self, config, pc=None, layer_ids=None, device=None, dtype=None):
        super().__init__(config, pc, layer_ids)
        pc = self.pc
        check_divisible("the attention heads (num_attention_heads)", config.num_attention_heads, pc.tp_size)
        check_divisible("the MLP width (intermediate_size)", config.intermediate_size, pc.tp_size)
        h = config.hidden_size
        kw = dict(device=device, dtype=dtype)
        sp = dict(group=pc.tp_group, sequence_parallel=pc.sequence_parallel)
        if self.is_first or (self.is_last and config.tie_word_embeddings):  # the last stage holds a tied copy
            self.embed_in = VocabParallelEmbedding(config.vocab_size, h, **sp, **kw)
        self.layers = nn.ModuleDict({str(i): GPTNeoXLayer(config, pc, **kw) for i in self.layer_ids})
        if self.is_last:
            self.final_layer_norm = LayerNorm(h, eps=config.layer_norm_eps, **sp, **kw)
            tied = self.embed_in if config.tie_word_embeddings else None
            self.lm_head = VocabParallelLMHead(h, config.vocab_size, **sp, tied_embedding=tied, **kw)
        self.rotary = RotaryEmbedding(config, device=device)

    def embed(self, input_ids, ctx):
        return dropout(self.embed_in(input_ids, ctx.token_rows), self.config.hidden_dropout, self.training,
                       sharded=self.sequence_parallel)

    def head(self, hidden, ctx, labels=None, return_logits=False) -> ModelOutput:
        hidden = self.final_layer_norm(hidden)
        loss, logits = self.lm_head.loss_and_logits(hidden, labels, return_logits, cp=ctx.cp)
        return ModelOutput(loss=loss, logits=logits, hidden_states=self.output_hidden_states(ctx, last=hidden))
