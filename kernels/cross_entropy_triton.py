"""The Triton kernels of `colozoo.kernels.cross_entropy` and `colozoo.kernels.linear_cross_entropy`: vocab-parallel
cross entropy that never builds fp32 logits, alone or fused with the LM-head matmul.

Each rank holds the logits of its own vocab slice (`colozoo.core.groups.vocab_range`; padded columns past
the logical vocabulary are ignored). A kernel reduces every row of the slice to four fp32 numbers (max,
sum of exp relative to that max, the target's logit if this slice holds it, and the sum of logits for label
smoothing); the ranks then combine them with three all-reduces (max, sum of exp, target logit; a fourth only
under label smoothing). The backward kernel writes softmax - one-hot straight in the logits' dtype.

`linear_cross_entropy_triton` goes further: it takes the hidden states and the (local) head weight and
walks the tokens in chunks, so only one chunk's logits exist at a time, in the activation dtype; the
backward pass recomputes each chunk's logits instead of keeping them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
import triton
import triton.language as tl

from colozoo.core.groups import all_reduce, group_size, vocab_range

BLOCK_V = 1024
CHUNK_BYTES = 512 * 2**20  # logits of one chunk in the fused path (smaller chunks make the matmuls and the
# fp32 weight-gradient sums slower: 64 MiB ran 2.3x slower than 512 on an H100)


@triton.jit
def _row_stats(LOGITS, TARGET, MAX, SUMEXP, PRED, SUMLOGITS, stride, row_offset, valid, vocab_start, ignore_index,
               SMOOTHING: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    LOGITS += row * stride
    # per-lane running max and sum of exp, reduced across lanes at the end (lanes that saw only
    # masked columns keep max -inf and contribute nothing)
    m_lane = tl.full((BLOCK_V,), float("-inf"), dtype=tl.float32)
    s_lane = tl.zeros((BLOCK_V,), dtype=tl.float32)
    t_lane = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for start in range(0, valid, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(LOGITS + cols, mask=cols < valid, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_lane, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_lane = s_lane * tl.exp(m_lane - m_safe) + tl.exp(x - m_safe)
        m_lane = m_new
        if SMOOTHING:
            t_lane += tl.where(cols < valid, x, 0.0)
    m = tl.max(m_lane, axis=0)
    sumexp = tl.sum(s_lane * tl.exp(m_lane - tl.where(m == float("-inf"), 0.0, m)), axis=0)
    total = tl.sum(t_lane, axis=0)
    target = tl.load(TARGET + row_offset + row)
    local = target - vocab_start
    hit = (target != ignore_index) & (local >= 0) & (local < valid)
    pred = tl.load(LOGITS + tl.where(hit, local, 0), mask=hit, other=0.0).to(tl.float32)
    out = row_offset + row
    tl.store(MAX + out, m)
    tl.store(SUMEXP + out, sumexp)
    tl.store(PRED + out, tl.where(hit, pred, 0.0))
    if SMOOTHING:
        tl.store(SUMLOGITS + out, total)


@triton.jit
def _row_grad(LOGITS, DLOGITS, TARGET, LSE, DLOSS, stride, dstride, row_offset, width, valid, vocab_start,
              ignore_index, smoothing, vocab_size, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    LOGITS += row * stride
    DLOGITS += row * dstride
    target = tl.load(TARGET + row_offset + row)
    lse = tl.load(LSE + row_offset + row)
    scale = tl.where(target == ignore_index, 0.0, tl.load(DLOSS + row_offset + row))
    local = target - vocab_start
    for start in range(0, width, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(LOGITS + cols, mask=cols < valid, other=float("-inf")).to(tl.float32)
        g = tl.exp(x - lse) - tl.where(cols == local, 1.0 - smoothing, 0.0) - tl.where(cols < valid, smoothing / vocab_size, 0.0)
        g = tl.where(cols < valid, g, 0.0)
        tl.store(DLOGITS + cols, (g * scale).to(DLOGITS.dtype.element_ty), mask=cols < width)


class _Stats:
    """Per-row fp32 partial statistics of the local vocab slice, combined over the tensor-parallel group."""

    def __init__(self, n: int, device, smoothing: bool):
        f32 = dict(device=device, dtype=torch.float32)
        self.max, self.sumexp, self.pred = torch.empty(n, **f32), torch.empty(n, **f32), torch.empty(n, **f32)
        self.sumlogits = torch.empty(n, **f32) if smoothing else None

    def fill(self, logits, target, row_offset, valid, vocab_start, ignore_index):
        if logits.shape[0]:
            _row_stats[(logits.shape[0],)](logits, target, self.max, self.sumexp, self.pred, self.sumlogits,
                                           logits.stride(0), row_offset, valid, vocab_start, ignore_index,
                                           SMOOTHING=self.sumlogits is not None, BLOCK_V=BLOCK_V, num_warps=4)

    def loss(self, target, group, ignore_index, smoothing, vocab_size):
        """(per-token loss, log-sum-exp) after the all-reduces."""
        global_max = self.max.clone()
        if group_size(group) > 1:
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        rescale = torch.exp(self.max - global_max).nan_to_num_(0.0)  # a slice with no valid column has max -inf
        sumexp = all_reduce(self.sumexp * rescale, group)
        pred = all_reduce(self.pred, group)
        lse = global_max + sumexp.log()
        loss = lse - pred
        if smoothing > 0:
            mean_log_prob = all_reduce(self.sumlogits, group) / vocab_size - lse
            loss = (1 - smoothing) * loss - smoothing * mean_log_prob
        return loss.masked_fill(target == ignore_index, 0.0), lse


def _grad(logits, dlogits, target, lse, dloss, row_offset, valid, vocab_start, ignore_index, smoothing, vocab_size):
    if logits.shape[0]:
        _row_grad[(logits.shape[0],)](logits, dlogits, target, lse, dloss, logits.stride(0), dlogits.stride(0),
                                      row_offset, logits.shape[1], valid, vocab_start, ignore_index, smoothing,
                                      vocab_size, BLOCK_V=BLOCK_V, num_warps=4)


def _slice(vocab_size, local_width, group):
    start, stop, per = vocab_range(vocab_size, group)
    if per != local_width:
        raise ValueError(f"local vocab width {local_width} does not match vocab_size={vocab_size} split over "
                         f"{group_size(group)} ranks (expected {per})")
    return start, max(stop - start, 0)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_size, group, ignore_index, smoothing):
        shape = target.shape
        logits = logits.reshape(-1, logits.shape[-1])
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        target = target.reshape(-1).contiguous()
        start, valid = _slice(vocab_size, logits.shape[1], group)
        stats = _Stats(logits.shape[0], logits.device, smoothing > 0)
        stats.fill(logits, target, 0, valid, start, ignore_index)
        loss, lse = stats.loss(target, group, ignore_index, smoothing, vocab_size)
        ctx.save_for_backward(logits, target, lse)
        ctx.args = (start, valid, ignore_index, smoothing, vocab_size)
        ctx.logits_shape = shape + (logits.shape[1],)
        return loss.view(shape)

    @staticmethod
    def backward(ctx, dloss):
        logits, target, lse = ctx.saved_tensors
        start, valid, ignore_index, smoothing, vocab_size = ctx.args
        dlogits = torch.empty_like(logits)
        _grad(logits, dlogits, target, lse, dloss.reshape(-1).float().contiguous(), 0, valid, start, ignore_index,
              smoothing, vocab_size)
        return dlogits.view(ctx.logits_shape), None, None, None, None, None


def _chunks(n: int, width: int, element_size: int, chunk_size: int | None):
    rows = chunk_size or max(1, CHUNK_BYTES // max(1, width * element_size))
    return [(lo, min(lo + rows, n)) for lo in range(0, n, rows)]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, vocab_size, group, ignore_index, smoothing, chunk_size):
        shape = target.shape
        hidden = hidden.reshape(-1, hidden.shape[-1])
        target = target.reshape(-1).contiguous()
        if hidden.shape[0] != target.shape[0]:
            raise ValueError(f"{hidden.shape[0]} hidden rows but {target.shape[0]} targets")
        start, valid = _slice(vocab_size, weight.shape[0], group)
        stats = _Stats(hidden.shape[0], hidden.device, smoothing > 0)
        chunks = _chunks(hidden.shape[0], weight.shape[0], hidden.element_size(), chunk_size)
        for lo, hi in chunks:
            stats.fill(F.linear(hidden[lo:hi], weight, bias), target, lo, valid, start, ignore_index)
        loss, lse = stats.loss(target, group, ignore_index, smoothing, vocab_size)
        ctx.save_for_backward(hidden, weight, bias, target, lse)
        ctx.args = (start, valid, ignore_index, smoothing, vocab_size)
        ctx.chunks, ctx.hidden_shape = chunks, shape + (hidden.shape[1],)
        return loss.view(shape)

    @staticmethod
    def backward(ctx, dloss):
        hidden, weight, bias, target, lse = ctx.saved_tensors
        start, valid, ignore_index, smoothing, vocab_size = ctx.args
        dloss = dloss.reshape(-1).float().contiguous()
        dhidden = torch.empty_like(hidden)
        dweight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
        dbias = torch.zeros(weight.shape[0], device=weight.device, dtype=torch.float32) if bias is not None else None
        for lo, hi in ctx.chunks:
            logits = F.linear(hidden[lo:hi], weight, bias)
            _grad(logits, logits, target, lse, dloss, lo, valid, start, ignore_index, smoothing, vocab_size)
            dhidden[lo:hi] = logits @ weight
            dweight += logits.t() @ hidden[lo:hi]
            if dbias is not None:
                dbias += logits.float().sum(0)
        return (dhidden.view(ctx.hidden_shape), dweight.to(weight.dtype),
                dbias.to(bias.dtype) if bias is not None else None, None, None, None, None, None, None)


def cross_entropy_triton(logits_local, target, vocab_size: int, group=None, ignore_index: int = -100,
                         label_smoothing: float = 0.0):
    """Per-token loss from this rank's vocab slice of the logits; same contract as
    `colozoo.kernels.cross_entropy.vocab_parallel_cross_entropy`."""
    return _CrossEntropy.apply(logits_local, target, vocab_size, group, ignore_index, float(label_smoothing))


def linear_cross_entropy_triton(hidden, weight, target, vocab_size: int, bias=None, group=None,
                                ignore_index: int = -100, label_smoothing: float = 0.0,
                                chunk_size: int | None = None):
    """Per-token loss of `hidden @ weight.T + bias` (weight = this rank's vocab slice of the LM head) without
    keeping the logits. `hidden` must already be in the tensor-parallel region (copy_to_parallel or gathered
    from the sequence), exactly as it would enter the head's `F.linear`."""
    return _LinearCrossEntropy.apply(hidden, weight, bias, target, vocab_size, group, ignore_index,
                                     float(label_smoothing), chunk_size)
