"""Attention for the heads this rank owns: local (colozoo.layers.local_attention) or, under context
parallelism, across the cp ranks (colozoo.layers.context_parallel). Inputs are (batch, heads_local, seq,
head_dim)."""
from __future__ import annotations

import torch

from colozoo.kernels.attention import local_attention

from .context_parallel import context_parallel_attention


def build_attention_mask(attention_mask: torch.Tensor | None, seq_len: int, causal: bool,
                         device=None) -> torch.Tensor | None:
    """Boolean (batch, 1, q, k) mask, True = attend; None when plain causal (or no) masking suffices."""
    if attention_mask is None:
        return None
    keep = attention_mask.to(torch.bool)[:, None, None, :]
    if causal:
        causal_mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=keep.device).tril()
        keep = keep & causal_mask
    return keep


def attention(q, k, v, mask=None, *, causal: bool, scale: float | None = None, dropout_p: float = 0.0,
              upcast: bool = False, cp=None, window: int | None = None, softcap: float | None = None,
              documents: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v, grouped-query aware (k/v heads repeat to match q).

    With `cp` (a layers.context_parallel.ContextParallel, i.e. `ctx.cp`) q/k/v hold the rank's zigzag share of
    the sequence and attention runs across the cp ranks (ring or all-to-all); `mask` is then ignored: masks
    come from cp.attention_mask, `causal` and the sliding `window` (without cp, put the window in `mask`).
    `softcap` caps the scores to softcap * tanh(scores / softcap) before masking (Gemma 2), on every path.
    `documents` (batch, seq): the packed documents of a self-attention (`ctx.documents`, see layers.documents); a
    token attends only within its own. Under cp the ids come from cp.documents (the whole sequence's) instead.
    """
    if cp is not None and cp.size > 1:
        return context_parallel_attention(q, k, v, cp, causal=causal, scale=scale, dropout_p=dropout_p,
                                          upcast=upcast, window=window, softcap=softcap)
    return local_attention(q, k, v, mask, causal=causal, scale=scale, dropout_p=dropout_p, upcast=upcast,
                           softcap=softcap, documents=documents)
