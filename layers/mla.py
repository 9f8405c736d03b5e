"""Multi-head latent attention (MLA, DeepSeek-V2 / V3): queries, keys and values come out of low-rank compressions of
the hidden states that every head shares, and each head's key has a decoupled rotary part shared by all heads.

    q:    x -> q_a_proj -> q_a_layernorm -> q_b_proj -> per head [q_nope | q_rot]       (or x -> q_proj when the
                                                                                         query is not compressed)
    kv:   x -> kv_a_proj_with_mqa -> [latent | k_rot]; latent -> kv_a_layernorm
          latent -> kv_b_proj -> per head [k_nope | v];  k_rot: one head, repeated for every head
    attend: q = [q_nope | rope(q_rot)], k = [k_nope | rope(k_rot)], v; softmax scale (qk_head_dim ** -0.5 times YaRN's
            mscale squared, given by the model) -> o_proj

Tensor parallelism splits heads after the shared compressions: q_a_proj, kv_a_proj_with_mqa and their norms are
replicated (layers.linear.ReplicatedLinear), q_b_proj and kv_b_proj are column-parallel by heads, o_proj
row-parallel. Without sequence parallelism every rank compresses every token, and the compressed tensors enter the
tensor-parallel region (q_b_proj's and kv_b_proj's own entry, a copy_to_parallel of k_rot): their gradients, each
rank's from its own heads, are summed there, so the compressions' weights get the same whole gradient on every
rank. Under sequence parallelism each rank compresses its share of the sequence and the compressed tensors are
gathered (kv_lora_rank + q_lora_rank + qk_rope_head_dim features a token, instead of hidden_size); the replicated
weights' gradients are then summed over tp.

The KV cache (layers.kv_cache) holds what every head shares: the normalised latent and the rotated k_rot, as a
"key" and a "value" of one head each (kv_lora_rank + qk_rope_head_dim numbers a position, on every tp rank, against
2 x heads x head_dim for a full cache). The prefill expands this rank's heads' keys and values from them, as
transformers does at every step; a decoding step attends over the latent itself (`_attend_latent`). A LoRA adapter
on kv_b_proj (W + s B A) joins the absorbed form on its rank: q_nope (W_uk + s B_uk A) = q_nope W_uk + s (q_nope B_uk) A
going in, and out (W_uv + s B_uv A)^T = out W_uv^T + s (out A^T) B_uv^T coming out, never a weight-sized product.
Only an adapter that draws dropout (training mode) makes a step expand the cached latent through kv_b_proj and its
adapter, as the prefill does: the absorbed form cannot draw the adapter's mask on the latent.
With `interleaved_rope` (DeepSeek's checkpoints, transformers' rope_interleave) the rotary features come in pairs
(x0, x1), (x2, x3), ...: they are reordered to (x0, x2, ... | x1, x3, ...) and rotated as every other family's,
which is transformers' order too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .attention import attention
from .comm import copy_to_parallel, gather_from_sequence, group_size
from .kv_cache import keys_values_mask
from .linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from .norm import RMSNorm
from .rope import apply_rope
from .transformer import merge_heads


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(..., 2n) features in rotated pairs (x0, x1), (x2, x3), ... -> (x0, x2, ..., x1, x3, ...)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


@dataclass(frozen=True)
class LatentAttentionSpec:
    """What a family declares of its multi-head latent attention (LatentAttention adds where it sits: the layer and
    the mesh). `q_lora_rank` None: the query is one column-parallel projection `q_proj`; `scale`: the softmax scale
    (qk_head_dim ** -0.5 times YaRN's mscale squared); `norm_eps`: the compressions' RMSNorms; `bias`: the
    compressions and o_proj have biases (transformers' attention_bias), q_b_proj and kv_b_proj never;
    `interleaved_rope`: the rotary features come in pairs (DeepSeek's checkpoints)."""
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scale: float
    norm_eps: float = 1e-6
    bias: bool = False
    interleaved_rope: bool = True
    dropout: float = 0.0


class LatentAttention(nn.Module):
    """MLA over this rank's heads: the family's `spec` (LatentAttentionSpec) says what kind; `layer_idx`, the
    tensor-parallel `group` and `sequence_parallel` say where it sits."""

    def __init__(self, spec: LatentAttentionSpec, *, layer_idx: int, group=None, sequence_parallel: bool = False,
                 device=None, dtype=None):
        super().__init__()
        tp, heads = group_size(group), spec.num_heads
        if heads % tp:
            raise ValueError(f"tp={tp} must divide the attention heads ({heads})")
        self.local_heads, self.layer_idx, self.scale, self.dropout_p = heads // tp, layer_idx, spec.scale, spec.dropout
        self.nope_dim, self.rope_dim, self.v_dim = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        self.kv_lora_rank, self.interleaved_rope = spec.kv_lora_rank, spec.interleaved_rope
        self.group, self.sequence_parallel = group, sequence_parallel
        h, qk_head_dim, latent = spec.hidden_size, self.nope_dim + self.rope_dim, spec.kv_lora_rank
        kw = dict(group=group, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        norm = dict(eps=spec.norm_eps, **kw)
        if spec.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, heads * qk_head_dim, bias=False, **kw)
        else:
            self.q_a_proj = ReplicatedLinear(h, spec.q_lora_rank, bias=spec.bias, **kw)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, **norm)
            self.q_b_proj = ColumnParallelLinear(spec.q_lora_rank, heads * qk_head_dim, bias=False, **kw)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, latent + self.rope_dim, bias=spec.bias, **kw)
        self.kv_a_layernorm = RMSNorm(latent, **norm)
        self.kv_b_proj = ColumnParallelLinear(latent, heads * (self.nope_dim + self.v_dim), bias=False, **kw)
        self.o_proj = RowParallelLinear(heads * self.v_dim, h, bias=spec.bias, **kw)

    def cache_width(self, tp: int = 1) -> int:
        """Numbers a position of one sequence this layer's cache holds on every rank, whatever `tp`: the normalised
        latent and the rotary key all heads share (layers.transformer.SelfAttention.cache_width's counterpart)."""
        return self.kv_lora_rank + self.rope_dim

    def _heads(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """(batch, seq, local heads * dim) -> (batch, local heads, seq, dim)."""
        return x.view(*x.shape[:2], self.local_heads, dim).transpose(1, 2)

    def _rotate(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        return apply_rope(deinterleave(x) if self.interleaved_rope else x, cos, sin)

    def forward(self, x, batch, norm=None):
        """`norm`: the norm before the block, applied to x first."""
        if norm is not None:
            x = norm(x)
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = self._heads(q, self.nope_dim + self.rope_dim).split((self.nope_dim, self.rope_dim), dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split((self.kv_lora_rank, self.rope_dim), dim=-1)
        latent = self.kv_a_layernorm(latent)
        # k_rot enters the tensor-parallel region here (the latent in kv_b_proj): its heads' gradients are summed
        k_rot = gather_from_sequence(k_rot, self.group) if self.sequence_parallel else copy_to_parallel(k_rot,
                                                                                                        self.group)
        cos, sin = batch.rope()
        q = torch.cat((q_nope, self._rotate(q_rot, cos, sin)), dim=-1)
        k_rot = self._rotate(k_rot.unsqueeze(1), cos, sin)
        latent, k_rot, mask, causal = keys_values_mask(batch, self.layer_idx, latent.unsqueeze(1), k_rot)
        if batch.cache is not None and q.shape[2] < latent.shape[2] and self._absorbable():
            return self.o_proj(merge_heads(self._attend_latent(q, latent, k_rot, mask)))
        k_nope, v = self._heads(self.kv_b_proj(latent.squeeze(1)), self.nope_dim + self.v_dim).split(
            (self.nope_dim, self.v_dim), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, self.local_heads, -1, -1)), dim=-1)
        out = attention(q, k, v, mask, causal=causal, scale=self.scale, cp=batch.cp,
                        dropout_p=self.dropout_p if self.training else 0.0, documents=batch.documents)
        return self.o_proj(merge_heads(out))

    def _absorbable(self) -> bool:
        """A decoding step can attend over the latent: unless kv_b_proj's adapter draws dropout (see the module)."""
        lora = self.kv_b_proj.lora
        return lora is None or not (self.training and lora.p > 0)

    def _up_projections(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's rows (or its adapter's B rows) per head: those that make k_nope, those that make v."""
        return weight.view(self.local_heads, self.nope_dim + self.v_dim, -1).split((self.nope_dim, self.v_dim), dim=1)

    def _attend_latent(self, q, latent, k_rot, mask):
        """Decoding over the cache without expanding it (the up-projections absorbed): each head's q_nope goes into
        the latent space through its rows of kv_b_proj that make k_nope (q_nope . W_uk c = (W_uk^T q_nope) . c), the
        heads attend as one multi-query group over [latent | k_rot] with the latent as values, and each head's result
        leaves the latent space through its rows that make v; kv_b_proj's LoRA adapter joins on its rank (see the
        module). A step reads the cache once, never every head's keys and values; the prefill, with as many queries
        as keys, expands them as transformers does."""
        w_uk, w_uv = self._up_projections(self.kv_b_proj.weight)
        q_nope, q_rot = q.split((self.nope_dim, self.rope_dim), dim=-1)
        q_latent = torch.matmul(q_nope, w_uk)
        lora = self.kv_b_proj.lora
        if lora is not None:  # in the adapter's dtype, added in the base's, as LoRA.forward does
            b_uk, b_uv = self._up_projections(lora.B)
            low_rank = torch.matmul(torch.matmul(q_nope.to(lora.A.dtype), b_uk), lora.A) * lora.scaling
            q_latent = q_latent + low_rank.to(q_latent.dtype)
        q = torch.cat((q_latent, q_rot), dim=-1)
        out = attention(q, torch.cat((latent, k_rot), dim=-1), latent, mask, causal=False, scale=self.scale)
        values = torch.matmul(out, w_uv.transpose(1, 2))
        if lora is not None:
            low_rank = torch.matmul(torch.matmul(out.to(lora.A.dtype), lora.A.t()), b_uv.transpose(1, 2)) * lora.scaling
            values = values + low_rank.to(values.dtype)
        return values
