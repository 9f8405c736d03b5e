"""The LM head fused with its summed cross entropy, so that no logits tensor is kept.

    linear_cross_entropy(hidden, weight, target, vocab_size, bias=None, group=None, ignore_index=-100,
                         label_smoothing=0.0, *, enter_parallel=None)     summed loss, or None: not fused here

On the Triton path (`cross_entropy_triton.linear_cross_entropy_triton`) the tokens go through the head in chunks and
the backward recomputes each chunk's logits; 'auto' fuses there only once the logits would pass
FUSED_HEAD_ABOVE_BYTES. The torch path fuses when one rank holds the whole vocabulary: `linear_cross_entropy_sum`.

That torch reference knows the logits' gradient in the forward: softmax - one-hot, times the gradient of the summed
loss, one number. So the forward turns the logits into that gradient in place (max, exp, sum, divide; no
log-softmax tensor of its own) and keeps it; the backward is the linear's two matmuls, scaled. Against the log-softmax
path this saves one (tokens, vocab) tensor and two passes over it. Blocks of rows would keep the softmax in cache,
but they cost the matmul more than that saves (it streams the weight once per block).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from colozoo.core.groups import group_size

from .dispatch import use_triton

# On CUDA the chunked fused head + loss keeps only a chunk of logits but recomputes them in the backward: on an H100
# (bench/kernels.py) a plain head + the Triton loss was 1.6x faster at 8k tokens x 128k vocab for 0.4 GiB more. So
# 'auto' fuses only past this many bytes of logits, where their memory starts to matter.
FUSED_HEAD_ABOVE_BYTES = 4 * 2**30


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, vocab_size: int,
                         bias: torch.Tensor | None = None, group=None, ignore_index: int = -100,
                         label_smoothing: float = 0.0, *, enter_parallel=None) -> torch.Tensor | None:
    """The sum over tokens of the cross entropy of `hidden @ weight.T + bias` (weight: this rank's vocab slice of the
    LM head) against `target` (ignored targets add 0), or None where the head and the loss run apart faster or the
    torch path has no fused form (a vocabulary split over ranks): then take the logits and
    `kernels.cross_entropy.vocab_parallel_cross_entropy`. `enter_parallel(hidden)` brings the hidden states into the
    tensor-parallel region (copied, or gathered along the sequence) as the head's matmul would."""
    large = target.numel() * weight.shape[0] * hidden.element_size() > FUSED_HEAD_ABOVE_BYTES
    if use_triton(hidden, weight, auto=large):
        from .cross_entropy_triton import linear_cross_entropy_triton

        if enter_parallel is not None:
            hidden = enter_parallel(hidden)
        return linear_cross_entropy_triton(hidden, weight, target, vocab_size, bias, group, ignore_index,
                                           label_smoothing).sum()
    if group_size(group) == 1 and not use_triton(hidden, weight):
        return linear_cross_entropy_sum(hidden, weight, target, bias, ignore_index, label_smoothing)
    return None


class _LinearCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ignore_index, label_smoothing):
        logits = F.linear(hidden, weight, bias)
        ctx.matmul_dtype = logits.dtype  # under autocast, lower than the inputs': the backward's matmuls take it too
        logits = logits.float()  # the loss is taken in fp32, as on the log-softmax path
        vocab, eps = logits.shape[-1], label_smoothing
        ignored = target == ignore_index
        target = target.masked_fill(ignored, 0).unsqueeze(-1)
        shift = logits.amax(dim=-1, keepdim=True)
        logits.sub_(shift)
        loss = -logits.gather(-1, target).squeeze(-1)
        if eps > 0:
            mean_logit = logits.mean(dim=-1)
        grad = logits.exp_()
        sum_exp = grad.sum(dim=-1, keepdim=True)
        log_sum_exp = sum_exp.squeeze(-1).log()
        loss += log_sum_exp
        if eps > 0:
            loss = (1 - eps) * loss + eps * (log_sum_exp - mean_logit)
        grad.div_(sum_exp).scatter_add_(-1, target, grad.new_full(target.shape, -(1 - eps)))
        if eps > 0:
            grad.sub_(eps / vocab)
        ctx.save_for_backward(hidden, weight, grad, ignored)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return loss.masked_fill(ignored, 0.0).sum()

    @staticmethod
    def backward(ctx, grad_sum):
        hidden, weight, grad, ignored = ctx.saved_tensors
        dtype = ctx.matmul_dtype
        grad, x, w = grad.to(dtype), hidden.to(dtype), weight.to(dtype)
        # the rows of ignored tokens are dropped from the small operands, not zeroed in the (tokens, vocab) one
        row_scale = (~ignored).to(dtype) * grad_sum.to(dtype)
        grad_hidden = ((grad @ w) * row_scale.unsqueeze(-1)).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = (grad.t() @ (x * row_scale.unsqueeze(-1))).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = None
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = (row_scale @ grad).to(ctx.bias_dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                             bias: torch.Tensor | None = None, ignore_index: int = -100,
                             label_smoothing: float = 0.0) -> torch.Tensor:
    """The sum over tokens of cross_entropy(hidden @ weight.T + bias, target) (ignored targets add 0), one scalar;
    `weight` holds the whole vocabulary (no padding rows)."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    return _LinearCrossEntropySum.apply(hidden, weight, bias, target.reshape(-1), ignore_index,
                                        float(label_smoothing))
