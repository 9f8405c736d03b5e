"""The Triton kernels of `colozoo.kernels.cross_entropy` and `colozoo.kernels.linear_cross_entropy`: vocab-parallel
cross entropy that never builds fp32 logits, alone or fused with the LM-head matmul.

Each rank holds the logits of its own vocab slice (`colozoo.core.groups.vocab_range`; padded columns past
the logical vocabulary are ignored). A kernel reduces every row of the slice to a few fp32 numbers (sum of exp
relative to the slice's max, that max, the target's logit if this slice holds it, the sum of logits for label
smoothing and, for the entropy, the sum of exps times the logits relative to the max), packed as
`head_loss.slice_stats` packs them; the ranks then combine them with one all-gather
(`head_loss.combine_stats`). The gradient kernel writes softmax - one-hot straight in the logits' dtype, over them
if asked. Both kernels can cap the logits first (Gemma's final soft-cap), the gradient then times the cap's slope.

`linear_cross_entropy_triton` goes further: it takes the hidden states and the (local) head weight and walks the
tokens in chunks (`head_loss.chunked_linear_loss`), each chunk's logits made once, in the matmul dtype, and turned
into their gradient in place in the forward.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from colozoo.core.groups import group_size, vocab_range

from .head_loss import chunked_linear_loss, combine_stats

BLOCK_V = 1024


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))  # never overflows
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _row_stats(LOGITS, TARGET, STATS, stride, n_rows, valid, vocab_start, ignore_index, cap,
               SMOOTHING: tl.constexpr, SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    LOGITS += row * stride
    # per-lane running max and sum of exp, reduced across lanes at the end (lanes that saw only
    # masked columns keep max -inf and contribute nothing)
    m_lane = tl.full((BLOCK_V,), float("-inf"), dtype=tl.float32)
    s_lane = tl.zeros((BLOCK_V,), dtype=tl.float32)
    t_lane = tl.zeros((BLOCK_V,), dtype=tl.float32)
    w_lane = tl.zeros((BLOCK_V,), dtype=tl.float32)  # sum of exp(x - m) * (x - m), for the entropy
    for start in range(0, valid, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(LOGITS + cols, mask=cols < valid, other=0.0).to(tl.float32)
        if SOFTCAP:
            x = cap * _tanh(x / cap)
        x = tl.where(cols < valid, x, float("-inf"))
        m_new = tl.maximum(m_lane, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        e = tl.exp(x - m_safe)
        if ENTROPY:  # w moved to the new max: exp(m - m') * (w + s * (m - m')); a lane that saw nothing adds 0
            w_lane = _rescaled(w_lane, s_lane, m_lane, m_safe) + tl.where(cols < valid, e * (x - m_safe), 0.0)
        s_lane = s_lane * tl.exp(m_lane - m_safe) + e
        m_lane = m_new
        if SMOOTHING:
            t_lane += tl.where(cols < valid, x, 0.0)
    m = tl.max(m_lane, axis=0)
    sumexp = tl.sum(s_lane * tl.exp(m_lane - tl.where(m == float("-inf"), 0.0, m)), axis=0)
    target = tl.load(TARGET + row)
    local = target - vocab_start
    hit = (target != ignore_index) & (local >= 0) & (local < valid)
    pred = tl.load(LOGITS + tl.where(hit, local, 0), mask=hit, other=0.0).to(tl.float32)
    if SOFTCAP:
        pred = cap * _tanh(pred / cap)
    tl.store(STATS + row, sumexp)
    tl.store(STATS + n_rows + row, m)
    tl.store(STATS + 2 * n_rows + row, tl.where(hit, pred, 0.0))
    if SMOOTHING:
        tl.store(STATS + 3 * n_rows + row, tl.sum(t_lane, axis=0))
    if ENTROPY:  # the last row of the statistics
        w = tl.sum(_rescaled(w_lane, s_lane, m_lane, tl.where(m == float("-inf"), 0.0, m)), axis=0)
        if SMOOTHING:
            tl.store(STATS + 4 * n_rows + row, w)
        else:
            tl.store(STATS + 3 * n_rows + row, w)


@triton.jit
def _rescaled(w, s, m, m_new):
    """w = sum exp(x - m) * (x - m) of a lane as the sum relative to m_new >= m (0 where the lane saw no column)."""
    return tl.where(m == float("-inf"), 0.0, tl.exp(m - m_new) * (w + s * (m - m_new)))


@triton.jit
def _row_grad(LOGITS, DLOGITS, TARGET, LSE, DLOSS, stride, dstride, width, valid, vocab_start, ignore_index,
              smoothing, vocab_size, cap, HAS_DLOSS: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    LOGITS += row * stride
    DLOGITS += row * dstride
    target = tl.load(TARGET + row)
    lse = tl.load(LSE + row)
    if HAS_DLOSS:
        scale = tl.load(DLOSS + row)
    else:
        scale = 1.0
    scale = tl.where(target == ignore_index, 0.0, scale)
    local = target - vocab_start
    for start in range(0, width, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(LOGITS + cols, mask=cols < valid, other=0.0).to(tl.float32)
        if SOFTCAP:
            t = _tanh(x / cap)
            x = cap * t
        g = tl.exp(x - lse) - tl.where(cols == local, 1.0 - smoothing, 0.0) - smoothing / vocab_size
        if SOFTCAP:
            g = g * (1.0 - t * t)
        g = tl.where(cols < valid, g, 0.0)
        tl.store(DLOGITS + cols, (g * scale).to(DLOGITS.dtype.element_ty), mask=cols < width)


def _stats(logits, target, valid, vocab_start, ignore_index, smoothing, softcap, entropy=False):
    """(k, rows) fp32 statistics of this rank's slice, packed as head_loss.slice_stats packs them."""
    rows = logits.shape[0]
    stats = torch.empty((3 + (smoothing > 0) + entropy, rows), device=logits.device, dtype=torch.float32)
    if rows:
        _row_stats[(rows,)](logits, target, stats, logits.stride(0), rows, valid, vocab_start, ignore_index,
                            softcap or 1.0, SMOOTHING=smoothing > 0, SOFTCAP=softcap is not None, ENTROPY=entropy,
                            BLOCK_V=BLOCK_V, num_warps=4)
    return stats


def _grad(logits, dlogits, target, lse, dloss, valid, vocab_start, ignore_index, smoothing, vocab_size, softcap):
    """dlogits (may be logits) = the gradient of the rows' losses, times `dloss` per row (None: 1)."""
    if logits.shape[0]:
        _row_grad[(logits.shape[0],)](logits, dlogits, target, lse, dloss if dloss is not None else lse,
                                      logits.stride(0), dlogits.stride(0), logits.shape[1], valid, vocab_start,
                                      ignore_index, smoothing, vocab_size, softcap or 1.0,
                                      HAS_DLOSS=dloss is not None, SOFTCAP=softcap is not None, BLOCK_V=BLOCK_V,
                                      num_warps=4)


def _slice(vocab_size, local_width, group):
    start, stop, per = vocab_range(vocab_size, group)
    if per != local_width:
        raise ValueError(f"local vocab width {local_width} does not match vocab_size={vocab_size} split over "
                         f"{group_size(group)} ranks (expected {per})")
    return start, max(stop - start, 0)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_size, group, ignore_index, smoothing, entropy):
        shape = target.shape
        logits = logits.reshape(-1, logits.shape[-1])
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        target = target.reshape(-1).contiguous()
        start, valid = _slice(vocab_size, logits.shape[1], group)
        stats = _stats(logits, target, valid, start, ignore_index, smoothing, None, entropy)
        loss, lse, *by_product = combine_stats(stats, group, vocab_size, smoothing, entropy=entropy)
        ctx.save_for_backward(logits, target, lse)
        ctx.args = (valid, start, ignore_index, smoothing, vocab_size)
        ctx.logits_shape = shape + (logits.shape[1],)
        loss = loss.masked_fill(target == ignore_index, 0.0).view(shape)
        if not entropy:
            return loss
        entropy = by_product[0].view(shape)
        ctx.mark_non_differentiable(entropy)
        return loss, entropy

    @staticmethod
    def backward(ctx, dloss, dentropy=None):  # the entropy is a metric: its gradient is not taken
        logits, target, lse = ctx.saved_tensors
        dlogits = torch.empty_like(logits)
        _grad(logits, dlogits, target, lse, dloss.reshape(-1).float().contiguous(), *ctx.args, None)
        return dlogits.view(ctx.logits_shape), None, None, None, None, None, None


def _chunk_loss(logits, target, grad: bool, *, vocab_start, valid, vocab_size, group, ignore_index, smoothing,
                softcap):
    """(per-row loss, gradient or None) of one chunk of this rank's logits; the gradient is written over them."""
    target = target.contiguous()
    stats = _stats(logits, target, valid, vocab_start, ignore_index, smoothing, softcap)
    loss, lse = combine_stats(stats, group, vocab_size, smoothing)
    loss = loss.masked_fill(target == ignore_index, 0.0)
    if not grad:
        return loss, None
    _grad(logits, logits, target, lse, None, valid, vocab_start, ignore_index, smoothing, vocab_size, softcap)
    return loss, logits


def cross_entropy_triton(logits_local, target, vocab_size: int, group=None, ignore_index: int = -100,
                         label_smoothing: float = 0.0, entropy: bool = False):
    """Per-token loss from this rank's vocab slice of the logits; same contract as
    `colozoo.kernels.cross_entropy.vocab_parallel_cross_entropy` (with `entropy`: as
    `vocab_parallel_cross_entropy_and_entropy`, (loss, entropy))."""
    return _CrossEntropy.apply(logits_local, target, vocab_size, group, ignore_index, float(label_smoothing),
                               entropy)


def linear_cross_entropy_triton(hidden, weight, target, vocab_size: int, bias=None, group=None,
                                ignore_index: int = -100, label_smoothing: float = 0.0, softcap: float | None = None,
                                chunk_size: int | None = None) -> torch.Tensor:
    """The summed loss of `hidden @ weight.T + bias` (weight = this rank's vocab slice of the LM head), its gradients
    taken chunk by chunk in the forward; same contract as `colozoo.kernels.linear_cross_entropy` with `hidden`
    already in the tensor-parallel region (copied, or gathered from the sequence), as it enters the head's matmul."""
    start, valid = _slice(vocab_size, weight.shape[0], group)
    chunk_loss = functools.partial(_chunk_loss, vocab_start=start, valid=valid, vocab_size=vocab_size, group=group,
                                   ignore_index=ignore_index, smoothing=float(label_smoothing), softcap=softcap)
    return chunked_linear_loss(hidden, weight, bias, target, chunk_loss, chunk_size)
