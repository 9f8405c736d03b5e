"""Rotary position embeddings of (batch, heads, seq, head_dim) tensors.

    apply_rotary(x, cos, sin)
    rotary_qkv(qkv, cos, sin, heads, kv_heads, head_dim)    a fused projection -> q, k, v heads, q and k rotated

`cos` and `sin` are what the models compute from their position ids: (batch, seq, rotary_dim) or (seq, rotary_dim),
fp32, their two halves equal, since feature i rotates with feature i + rotary_dim/2 (LLaMA / NeoX "rotate half").
Features past `rotary_dim` pass through (partial rotary, as in GPT-NeoX). The op runs the Triton kernel
(`rope_triton`, which takes one angle per rotated pair) where `dispatch.use_triton` says so for an elementwise op,
otherwise `apply_rotary_reference`. `rotary_qkv` on the Triton path rotates q and k in place inside the projection
(`rope_triton.rotate_qk_in_place_triton`: what the backward keeps is then the projection alone, q, k and v being
views of it, and the angles); otherwise it splits the heads and applies `apply_rotary` to q and k. Priced on meta
tensors (`priced.pricing_fusions`), the in-place rotation takes `priced`'s stand-in.
"""
from __future__ import annotations

import torch

from . import priced
from .dispatch import use_triton


def apply_rotary(x, cos, sin):
    if use_triton(x, elementwise=True):
        from .rope_triton import apply_rotary_triton

        half = cos.shape[-1] // 2
        return apply_rotary_triton(x, cos[..., :half], sin[..., :half])
    return apply_rotary_reference(x, cos, sin)


def split_heads(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int):
    """A fused (batch, seq, (heads + 2 kv_heads) * head_dim) projection -> q (batch, heads, seq, head_dim), k, v
    (batch, kv_heads, seq, head_dim): views, no copy."""
    b, s, _ = qkv.shape
    q, k, v = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    return tuple(t.view(b, s, -1, head_dim).transpose(1, 2) for t in (q, k, v))


def rotary_qkv(qkv, cos, sin, heads: int, kv_heads: int, head_dim: int):
    """q, k, v (as `split_heads`) of a fused projection, q and k rotated by cos/sin (as `apply_rotary`)."""
    if priced.on_fused_path(qkv) and qkv.is_contiguous():
        half = cos.shape[-1] // 2
        rotate_in_place = priced.fused(qkv, "rope_triton", "rotate_qk_in_place")
        qkv = rotate_in_place(qkv, cos[..., :half], sin[..., :half], heads, kv_heads)
        return split_heads(qkv, heads, kv_heads, head_dim)
    q, k, v = split_heads(qkv, heads, kv_heads, head_dim)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_reference(x, cos, sin):
    """x * cos + rotate_half(x) * sin in x's dtype (cos and sin cast to it first, as transformers does)."""
    rotary_dim = cos.shape[-1]
    if cos.dim() == 3:  # (batch, seq, rotary_dim): the same angles for every head
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if rotary_dim < x.shape[-1]:
        x, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat((x * cos + rotate_half(x) * sin, rest), dim=-1)
    return x * cos + rotate_half(x) * sin
