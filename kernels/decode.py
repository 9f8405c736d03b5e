"""Decode attention: one new query token per sequence against a preallocated KV cache.

    decode_attention(q, k_cache, v_cache, length, key_mask=None, scale=None, window=None, sinks=None)

q is (batch, heads_q, 1, head_dim); k_cache and v_cache are (batch, heads_kv, max_len, head_dim) of which the
first `length` positions are valid (one length for the batch: batches are left-padded, and the optional
(batch, length) boolean key mask marks the padding False). heads_kv divides heads_q (GQA), and an optional
sliding `window` keeps only the last `window` positions. A sequence that sees no key at all gets zeros. `sinks`
(heads_q,): gpt-oss's per-head logit that joins every softmax without a value.

The op runs the flash-decoding kernel (`decode_triton`) where `dispatch.use_triton` says so, otherwise
`decode_attention_reference`. (`kernels.attention.local_attention` calls this op for a decode step on the Triton
path only; its torch path stays scaled_dot_product_attention.)
"""
from __future__ import annotations

import torch

from .dispatch import use_triton


def decode_attention(q, k_cache, v_cache, length: int, key_mask=None, scale: float | None = None,
                     window: int | None = None, sinks=None):
    """softmax(q k^T * scale) v over the caches' first `length` positions (masked, windowed)."""
    if use_triton(q, k_cache, v_cache):
        from .decode_triton import decode_attention_triton

        check_decode_inputs(q, k_cache, v_cache, length, key_mask, window)
        return decode_attention_triton(q, k_cache, v_cache, length, key_mask, scale, window, sinks)
    return decode_attention_reference(q, k_cache, v_cache, length, key_mask, scale, window, sinks)


def check_decode_inputs(q, k_cache, v_cache, length, key_mask, window):
    """What both paths check: each bad input is one ValueError saying what is wrong."""
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError("decode attention takes (batch, heads, seq, head_dim) tensors, got shapes "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if q.shape[2] != 1:
        raise ValueError(f"decode attention takes one new token per sequence, got q of shape {tuple(q.shape)}")
    b, hq, _, d = q.shape
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != b or k_cache.shape[3] != d:
        raise ValueError(f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} do not fit together")
    if hq % k_cache.shape[1]:
        raise ValueError(f"{k_cache.shape[1]} key/value heads do not divide {hq} query heads")
    if not 1 <= length <= k_cache.shape[2]:
        raise ValueError(f"length {length} must lie in [1, {k_cache.shape[2]}] (the cache's max_len)")
    if key_mask is not None and (key_mask.dtype != torch.bool or tuple(key_mask.shape) != (b, length)):
        raise ValueError(f"key_mask must be a boolean (batch, length) = ({b}, {length}) tensor, got "
                         f"{key_mask.dtype} of shape {tuple(key_mask.shape)}")
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive number of positions, got {window}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")


def decode_attention_reference(q, k_cache, v_cache, length: int, key_mask=None, scale: float | None = None,
                               window: int | None = None, sinks=None):
    """The same in plain torch: repeat the kv heads, masked softmax in fp32, matmul; zeros where nothing is seen."""
    check_decode_inputs(q, k_cache, v_cache, length, key_mask, window)
    group = q.shape[1] // k_cache.shape[1]
    k = k_cache[:, :, :length].float().repeat_interleave(group, dim=1)
    v = v_cache[:, :, :length].float().repeat_interleave(group, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q.float() @ k.transpose(-1, -2) * scale  # (batch, heads_q, 1, length)
    keep = torch.ones(1, length, dtype=torch.bool, device=q.device)
    if window is not None:
        keep = keep & (torch.arange(length, device=q.device) >= length - window)
    if key_mask is not None:
        keep = keep & key_mask
    scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return (probs @ v).to(q.dtype)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (probs @ v).to(q.dtype)
