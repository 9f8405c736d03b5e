"""Vocabulary-parallel embedding, LM head and cross entropy.

The vocabulary is padded to a multiple of tp and split into equal slices. Padded rows are zero, never
stored in checkpoints (the shard spec records the logical size), masked to -inf before every softmax and
stripped from gathered logits, so they never leak into outputs. The loss is computed on the local vocab
slice with one small all-gather (each rank's max, sum of exp, target logit); full-vocabulary logits are never
built.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from colozoo.core.groups import vocab_range
from colozoo.kernels.dispatch import use_triton

from .comm import (all_gather, gather_from_parallel, group_rank, group_size, reduce_from_parallel,
                   reduce_scatter_to_sequence)
from .linear import column_parallel_linear, enter_parallel
from .linear_cross_entropy import linear_cross_entropy_sum
from .shard import Split, shard

# On CUDA the chunked fused head + loss keeps only a chunk of logits but recomputes them in the backward: on an H100
# (bench/kernels.py) a plain head + the Triton loss was 1.6x faster at 8k tokens x 128k vocab for 0.4 GiB more. So
# 'auto' fuses only past this many bytes of logits, where their memory starts to matter.
FUSED_HEAD_ABOVE_BYTES = 4 * 2**30


class Embedding(nn.Embedding):
    """A replicated embedding (positions, token types): nn.Embedding, with no random init on the meta device
    (torch's meta normal_ imports torch._dynamo, seconds of start-up for every layout or meta build)."""

    def reset_parameters(self):
        if self.weight.device.type != "meta":
            super().reset_parameters()


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *, group=None,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_start, self.vocab_stop, local = vocab_range(num_embeddings, group)
        self.weight = shard(nn.Parameter(torch.empty(local, embedding_dim, device=device, dtype=dtype)),
                            Split("tp", 0, logical_size=num_embeddings))
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight)
            self.weight.data[self.vocab_stop - self.vocab_start:] = 0

    def forward(self, ids: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """(..., embedding_dim) rows of `ids`. `rows`: those rows already known on every rank (greedy decoding under
        tensor parallelism gathers them with the chosen tokens, vocab_parallel_argmax): returned as they are, with
        no all-reduce."""
        if rows is not None:
            if rows.shape != (*ids.shape, self.embedding_dim):
                raise ValueError(f"token rows {tuple(rows.shape)} do not match ids {tuple(ids.shape)}")
            return rows
        tp = group_size(self.group)
        local_pad = None
        if self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_stop:
            local_pad = self.padding_idx - self.vocab_start
        if tp == 1:
            out = F.embedding(ids, self.weight, local_pad)
            return out
        outside = (ids < self.vocab_start) | (ids >= self.vocab_stop)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, local_pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.group)
        return reduce_from_parallel(out, self.group, in_place=True)

    def extra_repr(self):
        return f"{self.num_embeddings} (local {self.weight.shape[0]}), {self.embedding_dim}"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, valid, group, ignore_index, label_smoothing, vocab_size):
        logits = logits.float()
        ignored = target == ignore_index
        local_target = target - vocab_start
        outside = (local_target < 0) | (local_target >= valid) | ignored
        local_target = local_target.masked_fill(outside, 0)
        ctx.valid, ctx.label_smoothing, ctx.vocab_size = valid, label_smoothing, vocab_size
        ctx.log_space = group_size(group) == 1
        if ctx.log_space:  # the whole vocabulary is here: torch's fused log_softmax is the fastest path
            log_probs = torch.log_softmax(logits, dim=-1)
            loss = -log_probs.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
            if label_smoothing > 0:
                loss = (1 - label_smoothing) * loss - label_smoothing * log_probs.mean(dim=-1)
            ctx.save_for_backward(log_probs, local_target, outside, ignored)
            return loss.masked_fill(ignored, 0.0)

        if valid < logits.shape[-1]:
            logits = logits.clone()
            logits[..., valid:] = float("-inf")
        # one collective, not three: each rank's max, sum of exps relative to it and target logit (and logit sum, for
        # label smoothing) are gathered. A rank holding only padding has max -inf: clamped, so its exps are 0, not nan
        local_max = logits.max(dim=-1, keepdim=True).values.clamp(min=torch.finfo(logits.dtype).min)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0)
        stats = [local_max.squeeze(-1), target_logit]
        if label_smoothing > 0:
            stats.append(logits[..., :valid].sum(dim=-1))
        exp = (logits - local_max).exp_()
        stats = all_gather(torch.stack([exp.sum(dim=-1), *stats])[None], 0, group)  # (tp, stat, ...)
        sums, maxes = stats[:, 0], stats[:, 1]
        global_max = maxes.max(dim=0).values
        rescale = (maxes - global_max).exp()  # each rank's exps relative to the global max
        sum_exp = (sums * rescale).sum(dim=0)
        log_sum_exp = sum_exp.log() + global_max
        loss = log_sum_exp - stats[:, 2].sum(dim=0)
        if label_smoothing > 0:
            mean_log_prob = stats[:, 3].sum(dim=0) / vocab_size - log_sum_exp
            loss = (1 - label_smoothing) * loss - label_smoothing * mean_log_prob
        loss = loss.masked_fill(ignored, 0.0)

        softmax = exp.mul_((rescale[group_rank(group)] / sum_exp).unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        probs, local_target, outside, ignored = ctx.saved_tensors
        grad = probs.exp_() if ctx.log_space else probs
        eps = ctx.label_smoothing
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(1 - eps) * hit.unsqueeze(-1))
        if eps > 0:
            grad[..., : ctx.valid] -= eps / ctx.vocab_size
        grad[..., ctx.valid:] = 0.0
        grad.mul_((grad_loss * (~ignored).to(grad.dtype)).unsqueeze(-1))
        return grad, None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits_local: torch.Tensor, target: torch.Tensor, vocab_size: int, group=None,
                                 ignore_index: int = -100, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss from this rank's vocab slice of the logits (0 where target == ignore_index)."""
    if use_triton(logits_local, target):
        from colozoo.kernels.cross_entropy import cross_entropy_triton

        return cross_entropy_triton(logits_local, target, vocab_size, group, ignore_index, label_smoothing)
    start, stop, _ = vocab_range(vocab_size, group)
    return _VocabParallelCrossEntropy.apply(logits_local, target, start, stop - start, group, ignore_index,
                                            label_smoothing, vocab_size)


def vocab_parallel_argmax(logits_local: torch.Tensor, vocab_size: int, group=None,
                          embedding: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """argmax over the last dim of the full-vocabulary logits, from each rank's (padded) slice: every rank
    exchanges its best (value, global index) per row instead of its whole slice. Ties go to the lowest index, as
    torch.argmax over the gathered logits decides them (the first rank holding the maximum, its first index).
    Returns (tokens, None), or with `embedding` (tokens, their embedding rows).

    With `embedding` (this rank's vocab slice of the token embedding's weight) each rank sends its candidate's
    embedding row too, so every rank gets the chosen rows: the next step's embedding then needs no all-reduce.
    The rows travel in fp64, which holds fp32, fp16 and bf16 values exactly."""
    start, stop, _ = vocab_range(vocab_size, group)
    if group_size(group) == 1:
        tokens = logits_local[..., :vocab_size].argmax(dim=-1)
        return tokens, None if embedding is None else embedding[tokens]
    if stop > start:
        index = logits_local[..., : stop - start].argmax(dim=-1, keepdim=True)
        value = logits_local.gather(-1, index).double()
    else:  # this rank holds only padding
        value = logits_local.new_full((*logits_local.shape[:-1], 1), float("-inf"), dtype=torch.float64)
        index = torch.zeros_like(value, dtype=torch.long)
    sent = [value, (index + start).double()]
    if embedding is not None:
        sent.append(embedding[index.squeeze(-1)].double())
    candidates = all_gather(torch.cat(sent, dim=-1)[None], 0, group)  # (tp, ..., 2 [+ embedding_dim])
    best = candidates[..., :1].argmax(dim=0, keepdim=True)
    tokens = candidates[..., 1].gather(0, best.squeeze(-1)).squeeze(0).long()
    if embedding is None:
        return tokens, None
    rows = candidates[..., 2:].gather(0, best.expand(*best.shape[:-1], embedding.shape[-1])).squeeze(0)
    return tokens, rows.to(embedding.dtype)


LOGITS = ("full", "vocab_slice", "none")


@dataclass(frozen=True)
class LogitsRequest:
    """Which logits a forward returns. `gather`: "full" (the whole vocabulary on every rank), "vocab_slice" (this
    rank's padded vocab slice, ungathered: vocab_parallel_argmax takes it) or "none" (the loss alone, the head fused
    with it where it can be); `keep`: transformers' logits_to_keep, the last `keep` positions (0: all) or a tensor
    of positions."""
    gather: str = "full"
    keep: int | torch.Tensor = 0

    def __post_init__(self):
        if self.gather not in LOGITS:
            raise ValueError(f"logits gather must be one of {LOGITS}, got {self.gather!r}")
        keep = self.keep
        if not isinstance(keep, torch.Tensor) and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 0):
            raise ValueError(f"logits_to_keep must be an integer >= 0 or a tensor of positions, got {keep!r}")


def keep_positions(x: torch.Tensor, keep) -> torch.Tensor:
    """x (batch, seq, ...) at transformers' logits_to_keep positions: the last `keep` (0: all), or those indexed."""
    if isinstance(keep, torch.Tensor):
        return x[:, keep.to(x.device)]
    return x[:, -keep:] if keep else x


class VocabParallelLMHead(nn.Module):
    """Projects hidden states onto this rank's vocab slice. `weight` may be tied to the embedding's. `softcap`
    (Gemma's final_logit_softcapping) caps every logit to softcap * tanh(logit / softcap), for the loss too."""

    def __init__(self, hidden_size: int, vocab_size: int, bias: bool = False, *, group=None,
                 sequence_parallel: bool = False, tied_embedding: VocabParallelEmbedding | None = None,
                 softcap: float | None = None, device=None, dtype=None):
        super().__init__()
        self.vocab_size, self.group, self.sequence_parallel = vocab_size, group, sequence_parallel
        self.softcap = softcap
        self.vocab_start, self.vocab_stop, local = vocab_range(vocab_size, group)
        self.tied = tied_embedding is not None
        if self.tied:
            self._tied = [tied_embedding]  # not a submodule: the weight belongs to the embedding
        else:
            self.weight = shard(nn.Parameter(torch.empty(local, hidden_size, device=device, dtype=dtype)),
                                Split("tp", 0, logical_size=vocab_size))
            if self.weight.device.type != "meta":
                nn.init.normal_(self.weight, std=0.02)
                self.weight.data[self.vocab_stop - self.vocab_start:] = 0
        self.bias = (shard(nn.Parameter(torch.zeros(local, device=device, dtype=dtype)),
                           Split("tp", 0, logical_size=vocab_size)) if bias else None)

    def head_weight(self) -> torch.Tensor:
        return self._tied[0].weight if self.tied else self.weight

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None, ignore_index: int = -100,
                label_smoothing: float = 0.0) -> torch.Tensor:
        """Local-vocab logits (batch, seq, vocab/tp); hidden may be sequence-sharded. With `targets` (the whole
        vocabulary on this rank, no softcap): the summed loss of the fused head and loss instead, computed here so
        that module hooks (the symbolic profiler's) see the head's weight and FLOPs as the head's."""
        if targets is not None:
            return linear_cross_entropy_sum(hidden, self.head_weight(), targets, self.bias, ignore_index,
                                            label_smoothing)
        logits = column_parallel_linear(hidden, self.head_weight(), self.bias, self.group, self.sequence_parallel)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def loss_and_logits(self, hidden, labels=None, logits: "LogitsRequest" = None, cp=None, ignore_index=-100,
                        label_smoothing=0.0):
        """(loss or None, logits or None) from the final hidden states, the logits as `logits` asks. When only the loss
        is wanted (and no softcap applies) the head matmul is fused into the loss: on CUDA in chunks with no logits
        tensor, once the logits would pass FUSED_HEAD_ABOVE_BYTES (below it the head and the Triton loss run apart,
        faster); on the torch path with the whole vocabulary on this rank, the logits become their gradient in the
        forward (layers.linear_cross_entropy)."""
        logits = logits if logits is not None else LogitsRequest()
        weight = self.head_weight()
        if labels is not None and logits.gather == "none" and self.softcap is None:
            targets = self._next_tokens(labels, ignore_index, cp)
            large = targets.numel() * weight.shape[0] * hidden.element_size() > FUSED_HEAD_ABOVE_BYTES
            if use_triton(hidden, weight, auto=large):
                from colozoo.kernels.cross_entropy import linear_cross_entropy_triton as linear_cross_entropy

                hidden = enter_parallel(hidden, self.group, self.sequence_parallel)
                per_token = linear_cross_entropy(hidden, weight, targets, self.vocab_size, self.bias, self.group,
                                                 ignore_index, label_smoothing)
                return self._mean(per_token.sum(), targets, ignore_index, cp), None
            if group_size(self.group) == 1 and not use_triton(hidden, weight):  # the torch path fuses the head too
                return self._mean(self(hidden, targets, ignore_index, label_smoothing), targets, ignore_index, cp), None
        if labels is None and logits.gather == "none":
            return None, None
        kept_early = labels is None and not self.sequence_parallel and cp is None  # fewer positions to project
        if kept_early:
            hidden = keep_positions(hidden, logits.keep)
        logits_local = self(hidden)
        loss = self.loss(logits_local, labels, ignore_index, label_smoothing, cp) if labels is not None else None
        if logits.gather == "none":
            return loss, None
        out = logits_local if logits.gather == "vocab_slice" else self.full_logits(logits_local, cp=cp)
        return loss, out if kept_early else keep_positions(out, logits.keep)

    def loss(self, logits_local, labels, ignore_index=-100, label_smoothing=0.0, cp=None) -> torch.Tensor:
        """Mean causal-LM loss over non-ignored tokens: logits at t predict labels at t+1.

        With `cp` (ctx.cp) the logits are the rank's zigzag share of the sequence and `labels` the full sequence;
        the mean is taken over the whole sequence (sum and count summed over the cp ranks)."""
        targets = self._next_tokens(labels, ignore_index, cp)
        per_token = vocab_parallel_cross_entropy(logits_local, targets, self.vocab_size, self.group, ignore_index,
                                                 label_smoothing)
        return self._mean(per_token.sum(), targets, ignore_index, cp)

    @staticmethod
    def _next_tokens(labels, ignore_index, cp):
        """The label each position predicts (this cp rank's share of them)."""
        targets = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        return cp.shard(targets) if cp is not None else targets

    @staticmethod
    def _mean(total, targets, ignore_index, cp):
        count = (targets != ignore_index).sum()
        if cp is not None:
            return reduce_from_parallel(total, cp.group) / reduce_from_parallel(count, cp.group).clamp(min=1)
        return total / count.clamp(min=1)

    def full_logits(self, logits_local: torch.Tensor, cp=None) -> torch.Tensor:
        """All-gather the vocab slices and strip the padding (and with `cp`, gather the sequence too)."""
        logits = gather_from_parallel(logits_local, self.group)[..., : self.vocab_size]
        if cp is not None:
            from .context_parallel import gather_sequence

            logits = gather_sequence(logits, cp.group)
        return logits
