"""Rotary position embeddings of (batch, heads, seq, head_dim) tensors.

    apply_rotary(x, cos, sin)

`cos` and `sin` are what the models compute from their position ids: (batch, seq, rotary_dim) or (seq, rotary_dim),
fp32, their two halves equal, since feature i rotates with feature i + rotary_dim/2 (LLaMA / NeoX "rotate half").
Features past `rotary_dim` pass through (partial rotary, as in GPT-NeoX). The op runs the Triton kernel
(`rope_triton`, which takes one angle per rotated pair) where `dispatch.use_triton` says so for an elementwise op,
otherwise `apply_rotary_reference`.
"""
from __future__ import annotations

import torch

from .dispatch import use_triton


def apply_rotary(x, cos, sin):
    if use_triton(x, elementwise=True):
        from .rope_triton import apply_rotary_triton

        half = cos.shape[-1] // 2
        return apply_rotary_triton(x, cos[..., :half], sin[..., :half])
    return apply_rotary_reference(x, cos, sin)


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
