"""Vocab-parallel cross entropy: the per-token loss from each rank's slice of the logits, without gathering them.

    vocab_parallel_cross_entropy(logits_local, target, vocab_size, group=None, ignore_index=-100,
                                 label_smoothing=0.0)
    vocab_parallel_cross_entropy_and_entropy(logits_local, target, vocab_size, group=None, ignore_index=-100)
                                                     -> (the same loss, the entropy of the softmax: no gradient)

The vocabulary is padded to a multiple of the group size and split into equal slices (`core.groups.vocab_range`);
padded columns never count. The op runs the Triton kernels (`cross_entropy_triton`) where `dispatch.use_triton`
says so, otherwise the torch reference below: the loss in fp32 from one all-gather of each rank's max, sum of exps
and target logit (`head_loss.slice_stats`, `combine_stats`; log-softmax alone when one rank holds the whole
vocabulary), the softmax written into the fp32 copy of half-precision logits rather than beside it. The entropy
comes out of the same pass and the same all-gather: one more statistic per row.
"""
from __future__ import annotations

import torch

from colozoo.core.groups import group_size, vocab_range

from .dispatch import use_triton
from .head_loss import combine_stats, row_sums, slice_stats


def vocab_parallel_cross_entropy(logits_local: torch.Tensor, target: torch.Tensor, vocab_size: int, group=None,
                                 ignore_index: int = -100, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss from this rank's vocab slice of the logits (0 where target == ignore_index)."""
    if use_triton(logits_local, target):
        from .cross_entropy_triton import cross_entropy_triton

        return cross_entropy_triton(logits_local, target, vocab_size, group, ignore_index, label_smoothing)
    return vocab_parallel_cross_entropy_reference(logits_local, target, vocab_size, group, ignore_index,
                                                  label_smoothing)


def vocab_parallel_cross_entropy_and_entropy(logits_local: torch.Tensor, target: torch.Tensor, vocab_size: int,
                                             group=None, ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss as vocab_parallel_cross_entropy, the fp32 entropy of the full vocabulary's softmax at every
    position) from one pass over this rank's vocab slice and one all-gather; the entropy has no gradient (a metric)
    and is not masked where the target is ignored."""
    if use_triton(logits_local, target):
        from .cross_entropy_triton import cross_entropy_triton

        return cross_entropy_triton(logits_local, target, vocab_size, group, ignore_index, entropy=True)
    return vocab_parallel_cross_entropy_reference(logits_local, target, vocab_size, group, ignore_index,
                                                  entropy=True)


def vocab_parallel_cross_entropy_reference(logits_local, target, vocab_size: int, group=None,
                                           ignore_index: int = -100, label_smoothing: float = 0.0,
                                           entropy: bool = False):
    """The torch path: the per-token loss, or with `entropy` (loss, entropy)."""
    start, stop, _ = vocab_range(vocab_size, group)
    return _VocabParallelCrossEntropy.apply(logits_local, target, start, stop - start, group, ignore_index,
                                            label_smoothing, vocab_size, entropy)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, valid, group, ignore_index, label_smoothing, vocab_size,
                entropy=False):
        owned = logits.dtype != torch.float32  # .float() copies: the softmax is written into the copy
        logits = logits.float()
        ignored = target == ignore_index
        local_target = target - vocab_start
        outside = (local_target < 0) | (local_target >= valid) | ignored
        local_target = local_target.masked_fill(outside, 0)
        ctx.valid, ctx.label_smoothing, ctx.vocab_size = valid, label_smoothing, vocab_size
        ctx.log_space = group_size(group) == 1
        if ctx.log_space:  # the whole vocabulary is here: torch's fused log_softmax is the fastest path
            log_probs = torch.log_softmax(logits, dim=-1, out=logits if owned else None)
            loss = -log_probs.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
            if label_smoothing > 0:
                loss = (1 - label_smoothing) * loss - label_smoothing * log_probs.mean(dim=-1)
            ctx.save_for_backward(log_probs, local_target, outside, ignored)
            by_product = [-row_sums(lambda lp: lp.exp().mul_(lp), log_probs)] if entropy else []
            return _outputs(ctx, loss.masked_fill(ignored, 0.0), by_product)

        if valid < logits.shape[-1]:
            logits = logits if owned else logits.clone()  # the padding's -inf goes into our own copy, never the input
            owned = True
            logits[..., valid:] = float("-inf")
        stats, exps = slice_stats(logits, local_target, outside, valid, label_smoothing, out=logits if owned else None,
                                  entropy=entropy)
        loss, log_sum_exp, *by_product = combine_stats(stats, group, vocab_size, label_smoothing, entropy=entropy)
        loss = loss.masked_fill(ignored, 0.0)
        softmax = exps.mul_((stats[1] - log_sum_exp).exp().unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside, ignored)
        return _outputs(ctx, loss, by_product)

    @staticmethod
    def backward(ctx, grad_loss, grad_entropy=None):  # the entropy is a metric: its gradient is not taken
        probs, local_target, outside, ignored = ctx.saved_tensors
        grad = probs.exp_() if ctx.log_space else probs
        eps = ctx.label_smoothing
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(1 - eps) * hit.unsqueeze(-1))
        if eps > 0:
            grad[..., : ctx.valid] -= eps / ctx.vocab_size
        grad[..., ctx.valid:] = 0.0
        grad.mul_((grad_loss * (~ignored).to(grad.dtype)).unsqueeze(-1))
        return grad, None, None, None, None, None, None, None, None


def _outputs(ctx, loss, by_product: list):
    """The forward's outputs: the loss alone, or (loss, entropy) with the entropy marked as having no gradient."""
    if not by_product:
        return loss
    ctx.mark_non_differentiable(*by_product)
    return loss, *by_product
