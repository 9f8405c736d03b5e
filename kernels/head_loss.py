"""What the cross-entropy ops share: the statistics of a vocab slice's softmax combined over the tensor-parallel group,
and the LM head walked chunk of tokens by chunk of tokens with its gradients taken in the forward.

    slice_stats(logits, local_target, outside, valid, label_smoothing, out=None, entropy=False)
                                                                                     -> (k, ...) fp32 statistics
    combine_stats(stats, group, vocab_size, label_smoothing, entropy=False)          -> (loss, log-sum-exp[, entropy])
    chunked_linear_loss(hidden, weight, bias, target, chunk_loss, chunk_size=None)   -> summed loss

A row's softmax over a vocabulary split across ranks needs only a few numbers from each rank: its sum of exps
relative to its own max, that max, the target's logit where the slice holds it, and for label smoothing the sum of
its logits, and for the entropy of the softmax (a metric) the sum of exps times the logits relative to the max.
They are packed in one (k, rows) tensor and all-gathered once.

`chunked_linear_loss` is the fused LM head + loss, as Liger-Kernel's fused linear cross entropy: each chunk's
logits are made, turned into their own gradient by `chunk_loss` (softmax - one-hot, the softmax combined over the
group; the torch or the Triton kernel) and multiplied at once into the gradients of the hidden states, the weight
and the bias. The backward only scales them by the incoming gradient: no chunk's logits are made twice, and no
(tokens, vocab) tensor outlives its chunk.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from colozoo.core.groups import all_gather

# Chunks as Liger sizes them: a chunk's logits about as large as the hidden states (tokens / ceil(vocab / hidden)
# rows, a power of two), but at least MIN_CHUNK_ROWS rows, because a chunk of r rows streams the whole head weight
# through three matmuls for about r flops per weight byte (bf16), which a GPU needs in the hundreds to stay
# compute-bound; and at most MAX_CHUNKS chunks, each costing launches and, under tensor parallelism, a collective.
MIN_CHUNK_ROWS = 512
MAX_CHUNKS = 64


def chunk_rows(tokens: int, local_vocab: int, hidden_size: int) -> int:
    """Rows per chunk of the fused head for `tokens` rows against a (local_vocab, hidden_size) head weight."""
    per_hidden = -(-local_vocab // max(hidden_size, 1))
    rows = max(_next_power_of_two(-(-tokens // per_hidden)), MIN_CHUNK_ROWS,
               _next_power_of_two(-(-tokens // MAX_CHUNKS)))
    return max(1, min(rows, tokens))


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def slice_stats(logits: torch.Tensor, local_target: torch.Tensor, outside: torch.Tensor, valid: int,
                label_smoothing: float, out: torch.Tensor | None = None,
                entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(stats, exps) of fp32 logits of this rank's vocab slice (columns past `valid` already -inf): stats stacks, per
    row, the sum of exps relative to the slice's max, that max (a slice of padding alone: the lowest finite number,
    so that its exps are 0, not nan), the target's logit (0 where `outside` the slice), with label smoothing the sum
    of the valid logits and, last, with `entropy` the sum of exps times the logits relative to the max;
    exps = exp(logits - max), written into `out` (which may be `logits`)."""
    local_max = logits.amax(dim=-1).clamp(min=torch.finfo(logits.dtype).min)
    target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    extra = [logits[..., :valid].sum(dim=-1)] if label_smoothing > 0 else []
    exps = torch.sub(logits, local_max.unsqueeze(-1), out=out).exp_()
    if entropy:  # e * (z - max) = e * log(e), and 0 where e is 0 (padding, underflow): no second tensor of z - max
        extra.append(row_sums(lambda e: torch.xlogy(e, e), exps))
    return torch.stack([exps.sum(dim=-1), local_max, target_logit, *extra]), exps


# The most elements a by-product's row sums (row_sums) make at once: a chunk of rows, not another whole vocab slice
ROW_SUM_ELEMENTS = 1 << 24


def row_sums(elementwise, x: torch.Tensor) -> torch.Tensor:
    """elementwise(x) summed over the last dim, a chunk of rows at a time: its temporaries at most ROW_SUM_ELEMENTS
    elements, whatever the size of x."""
    flat = x.reshape(-1, x.shape[-1])
    rows = max(1, ROW_SUM_ELEMENTS // max(x.shape[-1], 1))
    return torch.cat([elementwise(chunk).sum(dim=-1) for chunk in flat.split(rows)]).view(x.shape[:-1])


def combine_stats(stats: torch.Tensor, group, vocab_size: int, label_smoothing: float, entropy: bool = False):
    """(per-row loss, log-sum-exp) over the whole vocabulary from every rank's `slice_stats` (one all-gather), and with
    `entropy` (stats made with entropy=True) the entropy of the softmax too: (loss, log-sum-exp, entropy). The loss
    is not yet masked where the target is ignored."""
    gathered = all_gather(stats.unsqueeze(0), 0, group)  # (tp, k, ...)
    sums, maxes = gathered[:, 0], gathered[:, 1]
    global_max = maxes.amax(dim=0)
    log_sum_exp = (sums * (maxes - global_max).exp()).sum(dim=0).log() + global_max
    loss = log_sum_exp - gathered[:, 2].sum(dim=0)
    if label_smoothing > 0:
        mean_log_prob = gathered[:, 3].sum(dim=0) / vocab_size - log_sum_exp
        loss = (1 - label_smoothing) * loss - label_smoothing * mean_log_prob
    if entropy:
        return loss, log_sum_exp, _entropy(sums, maxes, gathered[:, -1], global_max)
    return loss, log_sum_exp


def _entropy(sums, maxes, weighted, global_max):
    """H = log S - E[z - global max] from each rank's sum of exps, max (-inf or the lowest number: padding alone) and
    sum of exps times (z - its max), S the sum of exp(z - global max)."""
    offset = maxes.clamp(min=torch.finfo(maxes.dtype).min) - global_max
    rescale = offset.exp()
    total = (sums * rescale).sum(dim=0)
    expected = (rescale * (weighted + sums * offset)).sum(dim=0) / total
    return total.log() - expected


def chunked_linear_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                        chunk_loss, chunk_size: int | None = None) -> torch.Tensor:
    """The summed loss of `hidden @ weight.T + bias` (weight: this rank's vocab slice of the head) against `target`,
    chunk by chunk. `chunk_loss(logits, target, grad)` returns a chunk's per-row loss (0 where ignored) and, with
    `grad`, the gradient of its sum with respect to the logits, in their dtype (it may overwrite the logits with
    it). With no gradient wanted (torch.no_grad, or nothing requiring it) only the loss is computed."""
    hidden_rows = hidden.reshape(-1, hidden.shape[-1])
    if hidden_rows.shape[0] != target.numel():
        raise ValueError(f"{hidden_rows.shape[0]} hidden rows but {target.numel()} targets")
    rows = chunk_size or chunk_rows(hidden_rows.shape[0], weight.shape[0], weight.shape[1])
    wants = [torch.is_grad_enabled() and t is not None and t.requires_grad for t in (hidden, weight, bias)]
    with torch.no_grad():
        total, grads = _head_pass(hidden, weight, bias, target, chunk_loss, rows, wants)
    # The hidden states' gradient and the head's hang on two nodes beside each other, not one: zero-bubble pipeline
    # schedules take the first in one backward pass and the second in a later one, so each node runs once
    if wants[0]:
        total = total + _KeptGradients.apply(grads[0], hidden)
    if wants[1] or wants[2]:
        total = total + _KeptGradients.apply(*grads[1:], weight, bias)
    return total


class _KeptGradients(torch.autograd.Function):
    """A zero whose gradient with respect to the inputs after the gradients is those gradients (taken in the forward)
    times the incoming one, scaled in place: no copy of them is made."""

    @staticmethod
    def forward(ctx, *grads_then_inputs):
        count = len(grads_then_inputs) // 2
        ctx.save_for_backward(*grads_then_inputs[:count])
        return grads_then_inputs[count].new_zeros((), dtype=torch.float32)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total):
        try:
            grads = ctx.saved_tensors
        except RuntimeError as e:  # the in-place scaling of an earlier backward through this graph
            raise RuntimeError("a second backward through the fused LM head and loss: its gradients were taken in "
                               "the forward and handed to the first; ask for the logits (return_logits=True) to "
                               "backward twice (retain_graph=True)") from e
        scaled = [g.mul_(grad_total) if g is not None else None for g in grads]
        return (None,) * len(grads) + tuple(scaled)


def _matmul_operands(hidden, weight, bias):
    """(the head's operands in the dtype its matmul runs in, autocast's where it is on, as F.linear would take them;
    a context switching autocast off, so that the pass multiplies in exactly these dtypes)."""
    device = hidden.device.type
    if not torch.amp.is_autocast_available(device):  # the meta device of symbolic runs
        return (hidden, weight, bias), contextlib.nullcontext()
    operands = (hidden, weight, bias)
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        operands = tuple(t.to(dtype) if t is not None else None for t in operands)
    return operands, torch.autocast(device, enabled=False)


def _head_pass(hidden, weight, bias, target, chunk_loss, rows: int, needs):
    """(summed loss, [grad hidden, grad weight, grad bias] for those `needs` asks, else None), unscaled."""
    (x, w, b), no_autocast = _matmul_operands(hidden.reshape(-1, hidden.shape[-1]), weight, bias)
    target = target.reshape(-1)
    # the gradients as autograd expects them back (the inputs' dtypes), written by the first chunk, summed over the
    # next ones in place (Liger's zeros_like(weight), without the zeros)
    tokens = x.shape[0]
    grad_hidden = torch.empty(x.shape, dtype=hidden.dtype, device=x.device) if needs[0] else None
    grad_weight = (torch.empty_like if tokens else torch.zeros_like)(weight) if needs[1] else None
    grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=x.device) if needs[2] else None
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    with no_autocast:
        for lo in range(0, tokens, rows):
            chunk = x[lo:lo + rows]
            loss, dlogits = chunk_loss(F.linear(chunk, w, b), target[lo:lo + rows], any(needs))
            total += loss.sum()
            if grad_hidden is not None:
                _add_product(grad_hidden[lo:lo + rows], dlogits, w, first=True)
            if grad_weight is not None:
                _add_product(grad_weight, dlogits.t(), chunk, first=lo == 0)
            if grad_bias is not None:
                grad_bias += dlogits.sum(dim=0, dtype=torch.float32)
            del loss, dlogits  # before the next chunk's logits exist
    if grad_hidden is not None:
        grad_hidden = grad_hidden.view(hidden.shape)
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return total, [grad_hidden, grad_weight, grad_bias]


def _add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool):
    """out = a @ b (`first`: out's values are ignored, it may be uninitialised), else out += a @ b; in place where out
    has the product's dtype, through one product otherwise."""
    if out.dtype == a.dtype:
        torch.addmm(out, a, b, beta=0 if first else 1, out=out)
    elif first:
        out.copy_(a @ b)
    else:
        out += a @ b
