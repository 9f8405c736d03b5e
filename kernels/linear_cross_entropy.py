"""The LM head fused with its summed cross entropy: the gradients are taken in the forward, chunk by chunk, so that
no logits tensor is kept and none is made twice.

    linear_cross_entropy(hidden, weight, target, vocab_size, bias=None, group=None, ignore_index=-100,
                         label_smoothing=0.0, softcap=None, *, enter_parallel=None, chunk_size=None)   summed loss

As Liger-Kernel's fused linear cross entropy does, the tokens go through the head in chunks
(`head_loss.chunked_linear_loss`, sized by `head_loss.chunk_rows`: a chunk's logits about as large as the hidden
states). Each chunk's logits become their own gradient at once (softmax - one-hot, label smoothing and Gemma's
final soft-cap included; rows of ignored targets zero), which is multiplied straight into the gradients of the hidden
states, of the weight and of the bias; the backward only scales them by the loss's gradient. The step keeps at most
one chunk of logits besides those gradients, at every size, which is what made 'auto' fuse only past 4 GiB of logits
when the backward recomputed them. With a vocabulary split over tensor-parallel ranks each chunk's softmax
statistics (max, sum of exps, target logit, sum of logits) are all-gathered once (`head_loss.combine_stats`).

The Triton path (`cross_entropy_triton.linear_cross_entropy_triton`) reads each chunk's logits in the matmul dtype
and writes their gradient over them; the torch path (`linear_cross_entropy_reference`, the CPU path) takes them in
fp32. With no gradient wanted (evaluation under torch.no_grad) both compute the loss alone.
"""
from __future__ import annotations

import functools

import torch

from colozoo.core.groups import vocab_range

from .dispatch import use_triton
from .head_loss import chunked_linear_loss, combine_stats, slice_stats


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, vocab_size: int,
                         bias: torch.Tensor | None = None, group=None, ignore_index: int = -100,
                         label_smoothing: float = 0.0, softcap: float | None = None, *, enter_parallel=None,
                         chunk_size: int | None = None) -> torch.Tensor:
    """The sum over tokens of the cross entropy of `hidden @ weight.T + bias` (weight: this rank's vocab slice of the
    LM head; logits capped to softcap * tanh(logits / softcap) with `softcap`) against `target` (ignored targets add
    0). `enter_parallel(hidden)` brings the hidden states into the tensor-parallel region (copied, or gathered along
    the sequence) as the head's matmul would, so their gradient is summed (reduce-scattered) back the same way.
    `chunk_size`: rows per chunk (default `head_loss.chunk_rows`)."""
    if enter_parallel is not None:
        hidden = enter_parallel(hidden)
    if use_triton(hidden, weight):
        from .cross_entropy_triton import linear_cross_entropy_triton

        return linear_cross_entropy_triton(hidden, weight, target, vocab_size, bias, group, ignore_index,
                                           label_smoothing, softcap, chunk_size)
    return linear_cross_entropy_reference(hidden, weight, target, vocab_size, bias, group, ignore_index,
                                          label_smoothing, softcap, chunk_size)


def linear_cross_entropy_reference(hidden, weight, target, vocab_size: int, bias=None, group=None,
                                   ignore_index: int = -100, label_smoothing: float = 0.0,
                                   softcap: float | None = None, chunk_size: int | None = None) -> torch.Tensor:
    """The torch path of `linear_cross_entropy` (hidden already in the tensor-parallel region)."""
    start, stop, per = vocab_range(vocab_size, group)
    if weight.shape[0] != per:
        raise ValueError(f"LM head weight of {weight.shape[0]} rows does not match vocab_size={vocab_size} split "
                         f"as this rank's {per}")
    chunk_loss = functools.partial(_chunk_loss, vocab_start=start, valid=stop - start, vocab_size=vocab_size,
                                   group=group, ignore_index=ignore_index, smoothing=float(label_smoothing),
                                   softcap=softcap)
    return chunked_linear_loss(hidden, weight, bias, target, chunk_loss, chunk_size)


def _chunk_loss(logits, target, grad: bool, *, vocab_start, valid, vocab_size, group, ignore_index, smoothing,
                softcap):
    """(per-row loss, its gradient with respect to `logits` or None) of one chunk of this rank's logits, in fp32;
    the fp32 copy of the logits (the logits themselves when fp32) becomes the gradient in place."""
    z = logits.float()
    slope = None
    if softcap is not None:
        t = z.div_(softcap).tanh_()
        slope = t.square().neg_().add_(1) if grad else None  # d(capped) / d(logit), one chunk more
        z = t.mul_(softcap)
    z[:, valid:] = float("-inf")
    ignored = target == ignore_index
    local_target = target - vocab_start
    outside = (local_target < 0) | (local_target >= valid) | ignored
    local_target = local_target.masked_fill(outside, 0)
    stats, exps = slice_stats(z, local_target, outside, valid, smoothing, out=z)
    loss, log_sum_exp = combine_stats(stats, group, vocab_size, smoothing)
    loss = loss.masked_fill(ignored, 0.0)
    if not grad:
        return loss, None
    kept = (~ignored).float()
    dlogits = exps.mul_(((stats[1] - log_sum_exp).exp() * kept).unsqueeze(-1))  # softmax, 0 on ignored rows
    dlogits.scatter_add_(-1, local_target.unsqueeze(-1), (-(1 - smoothing) * (~outside).float()).unsqueeze(-1))
    if smoothing > 0:
        dlogits[:, :valid] -= (smoothing / vocab_size) * kept.unsqueeze(-1)
    if slope is not None:
        dlogits.mul_(slope)
    return loss, dlogits.to(logits.dtype)
