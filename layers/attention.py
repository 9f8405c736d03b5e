"""Attention for the heads this rank owns: local (the attention op, colozoo.kernels.attention) or, under context
parallelism, across the cp ranks (colozoo.layers.context_parallel). Inputs are (batch, heads_local, seq,
head_dim)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from colozoo.kernels.attention import local_attention

from .context_parallel import context_parallel_attention


def dense_attention_mask(attention_mask: torch.Tensor | None, seq_len: int, causal: bool, window: int | None = None,
                         device=None) -> torch.Tensor | None:
    """Boolean mask, True = attend: (batch, 1, 1, seq) over the keys of a bidirectional batch, (batch|1, 1, seq, seq)
    of a causal one (a sliding `window` keeps the last `window` positions); None when plain causal attention (or
    none) suffices."""
    if not causal:
        return None if attention_mask is None else attention_mask.to(torch.bool)[:, None, None, :]
    windowed = window is not None and window < seq_len
    if attention_mask is None and not windowed:
        return None
    device = attention_mask.device if attention_mask is not None else device
    q = torch.arange(seq_len, device=device)[:, None]
    k = torch.arange(seq_len, device=device)[None, :]
    keep = k <= q
    if windowed:
        keep = keep & (k > q - window)
    keep = keep[None, None]
    if attention_mask is not None:
        keep = keep & attention_mask.to(torch.bool)[:, None, None, :]
    return keep


def attention(q, k, v, mask=None, *, causal: bool, scale: float | None = None, dropout_p: float = 0.0,
              upcast: bool = False, cp=None, window: int | None = None, softcap: float | None = None,
              documents: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
              unpadded: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v, grouped-query aware (k/v heads repeat to match q); v may be narrower than
    q and k (MLA's v_head_dim).

    With `cp` (a layers.context_parallel.ContextParallel, i.e. `batch.cp`) q/k/v hold the rank's zigzag share of
    the sequence and attention runs across the cp ranks (ring or all-to-all); `mask` is then ignored: masks
    come from cp.attention_mask, `causal` and the sliding `window` (without cp, put the window in `mask`).
    `softcap` caps the scores to softcap * tanh(scores / softcap) before masking (Gemma 2), on every path.
    `documents` (batch, seq): the packed documents of a self-attention (`batch.documents`, see layers.documents); a
    token attends only within its own. Under cp the ids come from cp.documents (the whole sequence's) instead.
    `sinks` (heads,): a learned logit per head joining every row's softmax (gpt-oss; under cp all-to-all only).
    `unpadded`: `mask` is only causal and a sliding window, no padding (Batch.unpadded).
    """
    if cp is not None and cp.size > 1 and cp.mode == "ring" and v.shape[-1] < q.shape[-1]:
        # the ring carries keys and values stacked: values narrower than the keys (MLA) travel zero-padded
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        padded = F.pad(v, (0, q.shape[-1] - v.shape[-1]))
        return attention(q, k, padded, mask, causal=causal, scale=scale, dropout_p=dropout_p, upcast=upcast, cp=cp,
                         window=window, softcap=softcap, documents=documents, sinks=sinks)[..., :v.shape[-1]]
    if cp is not None and cp.size > 1:
        return context_parallel_attention(q, k, v, cp, causal=causal, scale=scale, dropout_p=dropout_p,
                                          upcast=upcast, window=window, softcap=softcap, sinks=sinks)
    return local_attention(q, k, v, mask, causal=causal, scale=scale, dropout_p=dropout_p, upcast=upcast,
                           softcap=softcap, documents=documents, sinks=sinks, unpadded=unpadded)
