"""GPT-2: learned positions, pre-LayerNorm blocks, fused q/k/v, GELU MLP, LM head tied to the token embedding.

    wte (vocab-parallel) + wpe -> dropout -> [ln_1 -> attn(c_attn column, c_proj row) -> dropout -> +
                                             ln_2 -> mlp(c_fc column, act, c_proj row) -> dropout -> +] x n
                                          -> ln_f -> lm_head
"""
from __future__ import annotations

from torch import nn

from colozoo.layers import (AttentionSpec, ColumnParallelLinear, Embedding, LayerNorm, RowParallelLinear,
                            SelfAttention, VocabParallelEmbedding, VocabParallelLMHead, scatter_to_sequence)
from colozoo.layers.vocab import LogitsRequest
from colozoo.models.base import ModelOutput, ParallelModel, check_divisible, dropout, require
from colozoo.models.family import Family, Tiny


def gpt2_attention(config, layer_idx: int, parallel, device=None, dtype=None) -> SelfAttention:
    h = config.hidden_size
    scale = (h // config.num_attention_heads) ** -0.5 if config.scale_attn_weights else 1.0
    if config.scale_attn_by_inverse_layer_idx:
        scale /= float(layer_idx + 1)
    spec = AttentionSpec(h, config.num_attention_heads, scale=scale, upcast=config.reorder_and_upcast_attn,
                         dropout=config.attn_pdrop, names=("c_attn", "c_proj"))
    return SelfAttention(spec, layer_idx=layer_idx, group=parallel.tp_group,
                         sequence_parallel=parallel.sequence_parallel,
                         device=device, dtype=dtype)


class GPT2MLP(nn.Module):
    def __init__(self, config, parallel, device=None, dtype=None):
        super().__init__()
        h = config.hidden_size
        inner = GPT2ForCausalLM.mlp_width(config)
        check_divisible("the MLP width (n_inner)", inner, parallel.tp_size)
        kw = dict(group=parallel.tp_group, sequence_parallel=parallel.sequence_parallel, device=device, dtype=dtype)
        self.c_fc = ColumnParallelLinear(h, inner, activation=config.activation_function, **kw)
        self.c_proj = RowParallelLinear(inner, h, **kw)

    def forward(self, x):
        return self.c_proj(self.c_fc(x))


class GPT2Block(nn.Module):
    attention_block = "attn"  # what selective activation checkpointing recomputes

    def __init__(self, config, layer_idx, parallel, device=None, dtype=None):
        super().__init__()
        norm = dict(eps=config.layer_norm_epsilon, group=parallel.tp_group,
                    sequence_parallel=parallel.sequence_parallel,
                    device=device, dtype=dtype)
        self.resid_pdrop, self.sharded_resid = config.resid_pdrop, parallel.sequence_parallel
        self.ln_1 = LayerNorm(config.hidden_size, **norm)
        self.attn = gpt2_attention(config, layer_idx, parallel, device, dtype)
        self.ln_2 = LayerNorm(config.hidden_size, **norm)
        self.mlp = GPT2MLP(config, parallel, device, dtype)

    def _dropout(self, x):
        return dropout(x, self.resid_pdrop, self.training, sharded=self.sharded_resid)

    def forward(self, x, batch):
        attn_out = self._dropout(self.attn(self.ln_1(x), batch))
        mlp_in, x = self.ln_2(attn_out, residual=x)  # x + attn_out, and that normalised
        return x + self._dropout(self.mlp(mlp_in))


class GPT2ForCausalLM(ParallelModel):
    family = "gpt2"
    input_embedding, tied_embedding = "wte", "wte.weight"

    def __init__(self, config, parallel=None, layer_ids=None, device=None, dtype=None):
        super().__init__(config, parallel, layer_ids)
        parallel = self.parallel
        require(not getattr(config, "add_cross_attention", False), "GPT-2 cross-attention is not supported")
        check_divisible("the attention heads (n_head)", config.num_attention_heads, parallel.tp_size)
        h = config.hidden_size
        kw = dict(device=device, dtype=dtype)
        if self.is_first or (self.is_last and config.tie_word_embeddings):  # the last stage holds a tied copy
            self.wte = VocabParallelEmbedding(config.vocab_size, h, group=parallel.tp_group,
                                              sequence_parallel=parallel.sequence_parallel, **kw)
        if self.is_first:
            self.wpe = Embedding(config.max_position_embeddings, h, **kw)
        self.layers = nn.ModuleDict({str(i): GPT2Block(config, i, parallel, **kw) for i in self.layer_ids})
        if self.is_last:
            self.ln_f = LayerNorm(h, eps=config.layer_norm_epsilon, group=parallel.tp_group,
                                  sequence_parallel=parallel.sequence_parallel, **kw)
            tied = self.wte if config.tie_word_embeddings else None
            self.lm_head = VocabParallelLMHead(h, config.vocab_size, group=parallel.tp_group,
                                               sequence_parallel=parallel.sequence_parallel, tied_embedding=tied, **kw)

    @classmethod
    def mlp_width(cls, config) -> int:
        return config.n_inner if config.n_inner is not None else 4 * config.hidden_size

    @classmethod
    def config_from_sizes(cls, hidden: int, layers: int, heads: int, ffn: int, vocab: int, seq: int,
                          dropout: float = 0.0, tied: bool = True):
        """A GPT as Megatron-LM trains it (learned positions, LayerNorm, tanh GeLU, tied embeddings) from its sizes:
        the published runs the planner is checked against (colozoo.cost.published)."""
        import transformers

        return transformers.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_inner=ffn, vocab_size=vocab,
                                       n_positions=seq, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                       activation_function="gelu_pytorch_tanh", tie_word_embeddings=tied)

    def position_limit(self) -> int:
        return self.config.max_position_embeddings

    def embed(self, input_ids, batch):
        positions = self.wpe(batch.position_ids)
        if self.sequence_parallel:
            positions = scatter_to_sequence(positions, self.tp_group)
        hidden = self.wte(input_ids, batch.token_rows) + positions
        return dropout(hidden, self.config.embd_pdrop, self.training, sharded=self.sequence_parallel)

    def head(self, hidden, batch, labels=None, logits: LogitsRequest = LogitsRequest()) -> ModelOutput:
        return self.lm_output(self.ln_f(hidden), batch, labels, logits)


FAMILIES = (Family("gpt2", ("gpt2",), GPT2ForCausalLM, learned_positions=True, title="GPT-2",
                   features="causal LM (tied head, Conv1D checkpoints, reorder_and_upcast_attn)",
                   tiny=Tiny(dict(vocab_size=101, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0), lora=("c_attn", "c_proj", "c_fc"))),)
