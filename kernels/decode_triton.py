"""The flash-decoding kernel of `colozoo.kernels.decode`: one new query token per sequence against a preallocated KV
cache (the shapes are described there).

The visible span of the cache is split into chunks of `chunk_size` positions. One program per
(batch, kv head, chunk) loads its K/V tiles once for all the query heads of the group and writes, per query head,
the chunk's normalized partial output and its base-2 log-sum-exp; a second kernel merges the chunks of each
(batch, q head) exactly, weighting each by 2**(lse_chunk - lse_max). All statistics are fp32. A sequence that sees
no key at all gets zeros, like the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_triton import _normalized, _online_softmax_step

LOG2E = 1.4426950408889634
CHUNK_SIZE = 256  # a 4k cache gives 16 programs per (batch, kv head); short caches stay one or two chunks


@triton.jit
def _decode_chunk(Q, K, V, Mask, O, LSE, qk_scale,
                  sqb, sqh, sqd, skb, skh, skn, skd, svb, svh, svn, svd, smb, smn,
                  HK, GROUP, START, LENGTH, CHUNK, NUM_CHUNKS, D,
                  HAS_MASK: tl.constexpr, PRECISION: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HK).to(tl.int64)
    hk = (bh % HK).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    heads = hk * GROUP + offs_g  # the query heads this kv head serves, as the rows of one tile
    row_mask = (offs_g[:, None] < GROUP) & (offs_d[None, :] < D)
    q = tl.load(Q + b * sqb + heads[:, None] * sqh + offs_d[None, :] * sqd, mask=row_mask, other=0.0)
    K += b * skb + hk * skh
    V += b * svb + hk * svh
    Mask += b * smb
    lo = START + chunk * CHUNK
    hi = tl.minimum(lo + CHUNK, LENGTH)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        keep = cols < hi
        kt = tl.load(K + cols[None, :] * skn + offs_d[:, None] * skd,
                     mask=keep[None, :] & (offs_d[:, None] < D), other=0.0)
        v = tl.load(V + cols[:, None] * svn + offs_d[None, :] * svd,
                    mask=keep[:, None] & (offs_d[None, :] < D), other=0.0)
        if HAS_MASK:
            keep &= tl.load(Mask + cols * smn, mask=keep, other=0) != 0
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        s = tl.where(keep[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, PRECISION)
    out, empty = _normalized(acc, l_i)
    # partials are (batch, heads_q, NUM_CHUNKS, D) and (batch, heads_q, NUM_CHUNKS), contiguous
    rows = (b * HK * GROUP + heads) * NUM_CHUNKS + chunk
    tl.store(O + rows[:, None] * D + offs_d[None, :], out, mask=row_mask)
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(LSE + rows, lse, mask=offs_g < GROUP)


@triton.jit
def _combine_chunks(O_PART, LSE, O, SINKS, NUM_CHUNKS, D, H, sob, soh, sod, HAS_SINKS: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one (batch, q head)
    offs_d = tl.arange(0, BLOCK_D)
    O_PART += row * NUM_CHUNKS * D
    LSE += row * NUM_CHUNKS
    m_i = float("-inf")
    l_i = 0.0
    if HAS_SINKS:  # the head's sink: one more chunk, of log-sum-exp `sink` and a zero output
        m_i = tl.load(SINKS + row % H).to(tl.float32) * 1.4426950408889634
        l_i = 1.0
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for c in range(0, NUM_CHUNKS):
        lse = tl.load(LSE + c)
        part = tl.load(O_PART + c * D + offs_d, mask=offs_d < D, other=0.0)
        m_new = tl.maximum(m_i, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        weight = tl.exp2(lse - m_safe)  # 0 for a chunk that saw no key
        l_i = l_i * alpha + weight
        acc = acc * alpha + weight * part
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(O + (row // H) * sob + (row % H) * soh + offs_d * sod, out.to(O.dtype.element_ty), mask=offs_d < D)


def decode_attention_triton(q, k_cache, v_cache, length: int, key_mask=None, scale: float | None = None,
                            window: int | None = None, sinks=None, *, chunk_size: int = CHUNK_SIZE):
    """softmax(q k^T * scale) v over the cache's first `length` positions (masked, windowed) by flash-decoding; the
    op (`decode.decode_attention`) has checked that the inputs fit together. `sinks` (heads_q,): a logit per head
    that joins each softmax without a value (merged as one more chunk)."""
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"decode attention runs in fp32, fp16 or bf16, got {q.dtype}")
    b, hq, _, d = q.shape
    hk = k_cache.shape[1]
    if d > 256:
        raise ValueError(f"decode attention supports head_dim up to 256, got {d}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    scale = d ** -0.5 if scale is None else scale
    start = 0 if window is None else max(0, length - window)  # chunks skip what the window hides
    num_chunks = triton.cdiv(length - start, chunk_size)
    group = hq // hk
    block_g = max(16, triton.next_power_of_2(group))  # tl.dot wants 16 rows at least
    block_d = max(16, triton.next_power_of_2(d))
    block_n = min(64 if block_d <= 64 else 32, max(16, triton.next_power_of_2(chunk_size)))
    parts = torch.empty(b, hq, num_chunks, d, device=q.device, dtype=torch.float32)
    lse = torch.empty(b, hq, num_chunks, device=q.device, dtype=torch.float32)
    out = torch.empty_like(q)
    if not out.numel():
        return out
    mask = q if key_mask is None else key_mask.view(torch.uint8)  # a dummy pointer when there is none
    mask_strides = (0, 0) if key_mask is None else mask.stride()
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _decode_chunk[(num_chunks, b * hk)](
        q, k_cache, v_cache, mask, parts, lse, float(scale) * LOG2E, q.stride(0), q.stride(1), q.stride(3),
        *k_cache.stride(), *v_cache.stride(), *mask_strides, hk, group, start, length, chunk_size, num_chunks, d,
        HAS_MASK=key_mask is not None, PRECISION=precision, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=4)
    sinks_arg = lse if sinks is None else sinks.contiguous()  # a dummy pointer when there are none
    _combine_chunks[(b * hq,)](parts, lse, out, sinks_arg, num_chunks, d, hq, out.stride(0), out.stride(1),
                               out.stride(3), HAS_SINKS=sinks is not None, BLOCK_D=block_d, num_warps=1)
    return out
