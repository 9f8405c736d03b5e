"""Attention core on torch's scaled_dot_product_attention, for the heads this rank owns.

Inputs are (batch, heads_local, seq, head_dim). Dropout inside attention runs on the tracked
tensor-parallel RNG, since each rank holds different heads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from colozoo.kernels.dispatch import use_triton
from colozoo.rng import get_rng_tracker


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
              upcast: bool = False, cp=None, window: int | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v, grouped-query aware (k/v heads repeat to match q).

    With `cp` (a layers.context_parallel.ContextParallel, i.e. `ctx.cp`) q/k/v hold the rank's zigzag share of
    the sequence and attention runs across the cp ranks (ring or all-to-all); `mask` is then ignored: masks
    come from cp.attention_mask, `causal` and the sliding `window` (without cp, put the window in `mask`).
    """
    if cp is not None and cp.size > 1:
        from .context_parallel import context_parallel_attention

        return context_parallel_attention(q, k, v, cp, causal=causal, scale=scale, dropout_p=dropout_p,
                                          upcast=upcast, window=window)
    if (dropout_p == 0.0 and (mask is None or mask.dtype == torch.bool) and q.shape[-1] <= 256
            and use_triton(q, k, v)):
        from colozoo.kernels.flash_attention import flash_attention_triton

        return flash_attention_triton(q, k, v, mask, causal=causal and mask is None, scale=scale)
    if k.shape[1] != q.shape[1]:
        repeat = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    is_causal = causal and mask is None
    with get_rng_tracker().fork(device_type=q.device.type):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                             scale=scale)
    return out.to(dtype)
