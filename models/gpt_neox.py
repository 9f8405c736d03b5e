"""GPT-NeoX / Pythia: rotary attention on part of each head, LayerNorms with biases, a GELU MLP, and a parallel
residual by default.

    embed_in (vocab-parallel) -> dropout
        -> [parallel:   x + attn(input_layernorm(x)) + mlp(post_attention_layernorm(x))
            sequential: h = x + attn(input_layernorm(x)); h + mlp(post_attention_layernorm(h))] x n
        -> final_layer_norm -> lm_head (the checkpoint's embed_out; untied unless tie_word_embeddings)

attention (layers.SelfAttention): qkv (column-parallel, chunks q | k | v; the checkpoint's query_key_value is stored
per head and reordered by the converter), RoPE on the first rotary_dim = head_dim * partial_rotary_factor
(rotary_pct) features of each head, dense (row-parallel). mlp: dense_h_to_4h (column-parallel, with its activation),
dense_4h_to_h (row-parallel). Every linear has a bias unless attention_bias is off (attention only).
"""
from __future__ import annotations

from torch import nn

from colozoo.layers import (AttentionSpec, ColumnParallelLinear, LayerNorm, RowParallelLinear, SelfAttention,
                            VocabParallelEmbedding, VocabParallelLMHead)
from colozoo.layers.rope import RotaryEmbedding
from colozoo.layers.vocab import LogitsRequest
from colozoo.models.base import ModelOutput, ParallelModel, check_divisible, dropout
from colozoo.models.family import TINY, Family, Tiny


class GPTNeoXMLP(nn.Module):
    def __init__(self, config, parallel, device=None, dtype=None):
        super().__init__()
        h, inner = config.hidden_size, config.intermediate_size
        kw = dict(group=parallel.tp_group, sequence_parallel=parallel.sequence_parallel, device=device, dtype=dtype)
        self.dense_h_to_4h = ColumnParallelLinear(h, inner, activation=config.hidden_act, **kw)
        self.dense_4h_to_h = RowParallelLinear(inner, h, **kw)

    def forward(self, x):
        return self.dense_4h_to_h(self.dense_h_to_4h(x))


class GPTNeoXLayer(nn.Module):
    attention_block = "attention"  # what selective activation checkpointing recomputes

    def __init__(self, config, layer_idx: int, parallel, device=None, dtype=None):
        super().__init__()
        norm = dict(eps=config.layer_norm_eps, group=parallel.tp_group, sequence_parallel=parallel.sequence_parallel,
                    device=device, dtype=dtype)
        self.parallel_residual = config.use_parallel_residual
        self.dropout_p, self.sharded_resid = config.hidden_dropout, parallel.sequence_parallel
        self.input_layernorm = LayerNorm(config.hidden_size, **norm)
        spec = AttentionSpec(config.hidden_size, config.num_attention_heads, qkv_bias=config.attention_bias,
                             out_bias=config.attention_bias, dropout=config.attention_dropout, rotary="global",
                             names=("qkv", "dense"))
        self.attention = SelfAttention(spec, layer_idx=layer_idx, group=parallel.tp_group,
                                       sequence_parallel=parallel.sequence_parallel, device=device, dtype=dtype)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, **norm)
        self.mlp = GPTNeoXMLP(config, parallel, device, dtype)

    def _dropout(self, x):
        return dropout(x, self.dropout_p, self.training, sharded=self.sharded_resid)

    def forward(self, x, batch):
        attn_out = self._dropout(self.attention(self.input_layernorm(x), batch))
        if self.parallel_residual:  # both blocks read the layer's input
            return self._dropout(self.mlp(self.post_attention_layernorm(x))) + attn_out + x
        mlp_in, x = self.post_attention_layernorm(attn_out, residual=x)  # x + attn_out, and that normalised
        return self._dropout(self.mlp(mlp_in)) + x


class GPTNeoXForCausalLM(ParallelModel):
    family = "gpt_neox"
    input_embedding, tied_embedding = "embed_in", "embed_in.weight"

    def __init__(self, config, parallel=None, layer_ids=None, device=None, dtype=None):
        super().__init__(config, parallel, layer_ids)
        parallel = self.parallel
        check_divisible("the attention heads (num_attention_heads)", config.num_attention_heads, parallel.tp_size)
        check_divisible("the MLP width (intermediate_size)", config.intermediate_size, parallel.tp_size)
        h = config.hidden_size
        kw = dict(device=device, dtype=dtype)
        sp = dict(group=parallel.tp_group, sequence_parallel=parallel.sequence_parallel)
        if self.is_first or (self.is_last and config.tie_word_embeddings):  # the last stage holds a tied copy
            self.embed_in = VocabParallelEmbedding(config.vocab_size, h, **sp, **kw)
        self.layers = nn.ModuleDict({str(i): GPTNeoXLayer(config, i, parallel, **kw) for i in self.layer_ids})
        if self.is_last:
            self.final_layer_norm = LayerNorm(h, eps=config.layer_norm_eps, **sp, **kw)
            tied = self.embed_in if config.tie_word_embeddings else None
            self.lm_head = VocabParallelLMHead(h, config.vocab_size, **sp, tied_embedding=tied, **kw)
        self.rotary = RotaryEmbedding(config, device=device)

    def embed(self, input_ids, batch):
        return dropout(self.embed_in(input_ids, batch.token_rows), self.config.hidden_dropout, self.training,
                       sharded=self.sequence_parallel)

    def head(self, hidden, batch, labels=None, logits: LogitsRequest = LogitsRequest()) -> ModelOutput:
        return self.lm_output(self.final_layer_norm(hidden), batch, labels, logits)


# the default rotary_pct (0.25): a quarter of each head's features rotate; weights large enough that a wrong rotation
# or residual changes the greedy tokens
FAMILIES = (Family("gpt_neox", ("gpt_neox",), GPTNeoXForCausalLM, title="GPT-NeoX / Pythia",
                   features="causal LM (parallel or sequential residual, partial rotary, per-head fused "
                            "query_key_value reordered to [q; k; v] by the converter)",
                   tiny=Tiny(dict(TINY, max_position_embeddings=32, bos_token_id=1, eos_token_id=2,
                                  initializer_range=0.2),
                             lora=("query_key_value", "dense", "dense_4h_to_h"))),)
