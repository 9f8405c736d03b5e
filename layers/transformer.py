"""The classic transformer layer, as modules: multi-head self-attention and a two-linear MLP, each added to the
residual stream, with a LayerNorm before each block (pre-norm) or after each residual add (post-norm).

    SelfAttention     x -> qkv (column-parallel, chunks q | k | v) -> attention over this rank's heads
                        -> out_proj (row-parallel)
    TransformerLayer  pre-norm:  h = x + drop(self_attn(self_attn_layer_norm(x)))
                                 out = h + drop(fc2(act(fc1(final_layer_norm(h)))))
                      post-norm: h = self_attn_layer_norm(x + drop(self_attn(x)))
                                 out = final_layer_norm(h + drop(fc2(act(fc1(h)))))

The attention is a child module (`attention_block`), which is what selective activation checkpointing recomputes.
Modules here take the model's batch context `ctx` and read `ctx.mask` (the dense mask, None for none or plain
causal) and `ctx.cp` (context parallelism, or None).
"""
from __future__ import annotations

import torch
from torch import nn

from .attention import attention
from .comm import group_size
from .dropout import dropout
from .kv_cache import keys_values_mask
from .linear import ColumnParallelLinear, RowParallelLinear
from .norm import LayerNorm


def split_heads(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int):
    """A fused (batch, seq, (heads + 2 kv_heads) * head_dim) projection -> q (batch, heads, seq, head_dim), k, v
    (batch, kv_heads, seq, head_dim): views, no copy."""
    b, s, _ = qkv.shape
    q, k, v = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    return tuple(t.view(b, s, -1, head_dim).transpose(1, 2) for t in (q, k, v))


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(batch, heads, seq, head_dim) -> (batch, seq, heads * head_dim)."""
    b, _, s, _ = x.shape
    return x.transpose(1, 2).reshape(b, s, -1)


class SelfAttention(nn.Module):
    """Multi-head self-attention over the heads this rank owns (tensor parallel by heads).

    `scale_query` scales q after its projection (bias included) and attends with scale 1, as OPT does: the same
    order gives the same rounding."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int | None = None, *, causal: bool,
                 qkv_bias: bool = True, out_bias: bool = True, dropout: float = 0.0, scale_query: bool = False,
                 group=None, sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        self.head_dim = head_dim or hidden_size // num_heads
        self.local_heads = num_heads // group_size(group)
        self.causal, self.dropout_p, self.scale_query = causal, dropout, scale_query
        self.scale = self.head_dim ** -0.5
        width = num_heads * self.head_dim
        kw = dict(group=group, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.qkv = ColumnParallelLinear(hidden_size, 3 * width, bias=qkv_bias, chunks=(width, width, width), **kw)
        self.out_proj = RowParallelLinear(width, hidden_size, bias=out_bias, **kw)

    def forward(self, x, ctx):
        q, k, v = split_heads(self.qkv(x), self.local_heads, self.local_heads, self.head_dim)
        scale = self.scale
        if self.scale_query:
            q, scale = q * self.scale, 1.0
        k, v, mask, causal = keys_values_mask(ctx, self, k, v, causal=self.causal)
        out = attention(q, k, v, mask, causal=causal, scale=scale, cp=ctx.cp,
                        dropout_p=self.dropout_p if self.training else 0.0,
                        documents=ctx.documents if self.causal else None)  # packing: transformers' causal masks only
        return self.out_proj(merge_heads(out))


class TransformerLayer(nn.Module):
    """`self_attn`, then an MLP (fc1 column-parallel with its activation, fc2 row-parallel), each added to the
    residual, with dropout on both block outputs; LayerNorms before the blocks (`pre_norm`: ViT, OPT) or after
    each residual add (BERT, opt-350m)."""

    attention_block = "self_attn"  # what selective activation checkpointing recomputes

    def __init__(self, self_attn: nn.Module, hidden_size: int, inner_size: int, *, activation: str, pre_norm: bool,
                 dropout: float = 0.0, bias: bool = True, norm_eps: float = 1e-5, norm_affine: bool = True,
                 group=None, sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        kw = dict(group=group, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        norm = dict(eps=norm_eps, elementwise_affine=norm_affine, **kw)
        self.pre_norm, self.dropout_p, self.sharded_resid = pre_norm, dropout, sequence_parallel
        self.self_attn_layer_norm = LayerNorm(hidden_size, **norm)
        self.self_attn = self_attn
        self.final_layer_norm = LayerNorm(hidden_size, **norm)
        self.fc1 = ColumnParallelLinear(hidden_size, inner_size, bias=bias, activation=activation, **kw)
        self.fc2 = RowParallelLinear(inner_size, hidden_size, bias=bias, **kw)

    def _dropout(self, x):
        return dropout(x, self.dropout_p, self.training, sharded=self.sharded_resid)

    def forward(self, x, ctx):
        if self.pre_norm:
            attn_out = self._dropout(self.self_attn(self.self_attn_layer_norm(x), ctx))
            mlp_in, x = self.final_layer_norm(attn_out, residual=x)  # x + attn_out, and that normalised
            return x + self._dropout(self.fc2(self.fc1(mlp_in)))
        x, _ = self.self_attn_layer_norm(self._dropout(self.self_attn(x, ctx)), residual=x)
        x, _ = self.final_layer_norm(self._dropout(self.fc2(self.fc1(x))), residual=x)
        return x
