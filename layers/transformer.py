"""The classic transformer layer, as modules: multi-head self-attention and a two-linear MLP, each added to the
residual stream, with a LayerNorm before each block (pre-norm) or after each residual add (post-norm).

    SelfAttention     x -> qkv (column-parallel, chunks q | k | v) -> (q/k norm, rotary) -> KV cache -> attention
                        over this rank's heads -> out_proj (row-parallel): every family's attention
    TransformerLayer  pre-norm:  h = x + drop(self_attn(self_attn_layer_norm(x)))
                                 out = h + drop(fc2(act(fc1(final_layer_norm(h)))))
                      post-norm: h = self_attn_layer_norm(x + drop(self_attn(x)))
                                 out = final_layer_norm(h + drop(fc2(act(fc1(h)))))

The attention is a child module (`attention_block`), which is what selective activation checkpointing recomputes.
Modules here take the model's batch context `batch` (colozoo.layers.batch): its masks, rotary angles, KV cache and
context-parallel sharding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from colozoo.kernels.rope import rotary_qkv, split_heads

from .attention import attention
from .comm import group_size
from .dropout import dropout
from .kv_cache import keys_values_mask
from .linear import ColumnParallelLinear, RowParallelLinear
from .norm import LayerNorm, ProjectionRMSNorm, RMSNorm
from .rope import apply_rope
from .shard import Split, shard


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(batch, heads, seq, head_dim) -> (batch, seq, heads * head_dim)."""
    b, _, s, _ = x.shape
    return x.transpose(1, 2).reshape(b, s, -1)


@dataclass(frozen=True)
class AttentionSpec:
    """What a family declares of its attention (SelfAttention adds where it sits: the layer and the mesh).

    `kv_heads`: grouped-query attention (None: one per head; a kv head is replicated over the layer's replica group
    when tp exceeds them); `causal`; the biases; the score `scale` (default head_dim ** -0.5) or `scale_query` (q
    scaled after its projection, attention at scale 1, as OPT: the same order gives the same rounding); GPT-2's
    `upcast` order; the sliding `window`; the score `softcap`; `qk_norm` (RMSNorm options of a per-head norm of q and
    k before the rotation; with "over": "projection" one norm over all heads of q and of k, as OLMo 2); `sinks` (a
    learned logit per head in every row's softmax, gpt-oss); `rotary` ("global" or "local": which of the batch's
    angles rotate q and k); `names`: its two projections as the family's checkpoints call them."""
    hidden_size: int
    num_heads: int
    kv_heads: int | None = None
    head_dim: int | None = None
    causal: bool = True
    qkv_bias: bool = True
    out_bias: bool = True
    dropout: float = 0.0
    scale: float | None = None
    scale_query: bool = False
    upcast: bool = False
    window: int | None = None
    softcap: float | None = None
    qk_norm: dict | None = None
    rotary: str | None = None
    sinks: bool = False
    names: tuple[str, str] = ("qkv", "out_proj")


class SelfAttention(nn.Module):
    """The one attention block of every family: project -> split heads -> (q/k norm) -> (rotary) -> KV cache ->
    attend over this rank's heads -> merge heads -> project back (tensor parallel by heads). The family's `spec`
    (AttentionSpec) says what kind; `layer_idx`, the tensor-parallel `group` (and the `replica_group` of a replicated
    kv head) and `sequence_parallel` say where it sits."""

    def __init__(self, spec: AttentionSpec, *, layer_idx: int, group=None, replica_group=None,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        tp, heads, kv_heads = group_size(group), spec.num_heads, spec.kv_heads or spec.num_heads
        self.head_dim = spec.head_dim or spec.hidden_size // heads
        self.local_heads, self.local_kv_heads = heads // tp, max(kv_heads // tp, 1)
        self.layer_idx, self.causal, self.dropout_p = layer_idx, spec.causal, spec.dropout
        self.scale = spec.scale if spec.scale is not None else self.head_dim ** -0.5
        self.scale_query, self.upcast = spec.scale_query, spec.upcast
        self.window, self.softcap = spec.window, spec.softcap
        self.rotary, self.names = spec.rotary, spec.names
        width, kv_width = heads * self.head_dim, kv_heads * self.head_dim
        kw = dict(group=group, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        qkv = ColumnParallelLinear(spec.hidden_size, width + 2 * kv_width, bias=spec.qkv_bias,
                                   chunks=(width, kv_width, kv_width), parts=(heads, kv_heads, kv_heads),
                                   replica_group=replica_group, **kw)
        self.add_module(spec.names[0], qkv)
        self.add_module(spec.names[1], RowParallelLinear(width, spec.hidden_size, bias=spec.out_bias, **kw))
        self.q_norm = self.k_norm = self.sinks = None
        if spec.sinks:
            self.sinks = shard(nn.Parameter(torch.zeros(self.local_heads, device=device, dtype=dtype)), Split("tp", 0))
        qk_norm = dict(spec.qk_norm) if spec.qk_norm is not None else None
        if qk_norm is not None and qk_norm.pop("over", "head") == "projection":  # split by heads like q and k
            norm = dict(group=group, device=device, dtype=dtype, **qk_norm)
            self.q_norm = ProjectionRMSNorm(heads, self.head_dim, **norm)
            self.k_norm = ProjectionRMSNorm(kv_heads, self.head_dim, replica_group=replica_group, **norm)
        elif qk_norm is not None:  # replicated, but each tp rank sees only its heads: the gradient is summed over tp
            norm = dict(group=group, sequence_parallel=tp > 1, device=device, dtype=dtype, **qk_norm)
            self.q_norm, self.k_norm = RMSNorm(self.head_dim, **norm), RMSNorm(self.head_dim, **norm)

    def cache_width(self, tp: int = 1) -> int:
        """Numbers a position of one sequence this layer's KV cache holds on a rank when its heads are split over `tp`
        more ranks (the cost model asks a module built whole): keys and values of the rank's kv heads, one replicated
        kv head a rank when tp is a multiple of them."""
        return 2 * max(self.local_kv_heads // tp, 1) * self.head_dim

    def forward(self, x, batch, norm=None):
        """`norm`: the norm before the block, applied to x by the qkv projection (which may fuse it)."""
        qkv_proj, out_proj = (self._modules[name] for name in self.names)
        q, k, v = self._heads(qkv_proj(x, norm=norm), batch)
        scale = self.scale
        if self.scale_query:
            q, scale = q * self.scale, 1.0
        k, v, mask, causal = keys_values_mask(batch, self.layer_idx, k, v, causal=self.causal, window=self.window)
        out = attention(q, k, v, mask, causal=causal, scale=scale, cp=batch.cp, window=self.window,
                        dropout_p=self.dropout_p if self.training else 0.0, upcast=self.upcast, softcap=self.softcap,
                        documents=batch.documents, sinks=self.sinks, unpadded=batch.unpadded)
        return out_proj(merge_heads(out))


    def _heads(self, qkv, batch):
        """q, k, v of the projection, normalised and rotated as the options say (without a q/k norm, rotated in place
        where the rotary op can: rope.rotary_qkv)."""
        heads = (self.local_heads, self.local_kv_heads, self.head_dim)
        if self.rotary is not None and self.q_norm is None:
            return rotary_qkv(qkv, *batch.rope(local=self.rotary == "local"), *heads)
        q, k, v = split_heads(qkv, *heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            cos, sin = batch.rope(local=self.rotary == "local")
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v


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

    def forward(self, x, batch):
        if self.pre_norm:
            attn_out = self._dropout(self.self_attn(self.self_attn_layer_norm(x), batch))
            mlp_in, x = self.final_layer_norm(attn_out, residual=x)  # x + attn_out, and that normalised
            return x + self._dropout(self.fc2(self.fc1(mlp_in)))
        x, _ = self.self_attn_layer_norm(self._dropout(self.self_attn(x, batch)), residual=x)
        x, _ = self.final_layer_norm(self._dropout(self.fc2(self.fc1(x))), residual=x)
        return x
