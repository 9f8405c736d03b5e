"""Vocabulary-parallel embedding, LM head and cross entropy.

The vocabulary is padded to a multiple of tp and split into equal slices. Padded rows are zero, never
stored in checkpoints (the shard spec records the logical size), masked to -inf before every softmax and
stripped from gathered logits, so they never leak into outputs. The loss is computed on the local vocab
slice (`kernels.cross_entropy`, re-exported here), or fused with the head (`kernels.linear_cross_entropy`);
full-vocabulary logits are never built.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from colozoo.core.groups import vocab_range
from colozoo.kernels.cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_and_entropy
from colozoo.kernels.linear_cross_entropy import linear_cross_entropy

from .comm import (all_gather, gather_from_parallel, group_size, reduce_from_parallel, reduce_scatter_to_sequence,
                   scatter_to_sequence)
from .linear import column_parallel_linear, enter_parallel
from .shard import Split, shard


class Embedding(nn.Embedding):
    """A replicated embedding (positions, token types): nn.Embedding, with no random init on the meta device
    (torch's meta normal_ imports torch._dynamo, seconds of start-up for every layout or meta build)."""

    def reset_parameters(self):
        if self.weight.device.type != "meta":
            super().reset_parameters()


def token_mean(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """A loss summed over `count` labelled tokens as their mean; NaN when there is none, as transformers' loss (a
    mean over nothing, with or without num_items_in_batch), so an all-masked batch never passes as a perfect one. The
    gradient is 0 then, as transformers' is."""
    return torch.where(count > 0, total / count.clamp(min=1), torch.nan)


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
            return scatter_to_sequence(rows, self.group) if self.sequence_parallel else rows
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


@torch.no_grad()
def vocab_parallel_entropy(logits_local: torch.Tensor, vocab_size: int, group=None) -> torch.Tensor:
    """The entropy of softmax over the full vocabulary at every position (fp32), from each rank's padded slice: the
    cross entropy's statistics of each rank's slice (its max, its sum of exps relative to it and their logit-weighted
    sum) gathered once, then rescaled to the global max (H = log S - E[z - max], S the sum of exp(z - max)); the
    log-softmax where one rank holds the whole vocabulary."""
    no_targets = torch.full(logits_local.shape[:-1], -100, dtype=torch.long, device=logits_local.device)
    return vocab_parallel_cross_entropy_and_entropy(logits_local, no_targets, vocab_size, group)[1]


LOGITS = ("full", "vocab_slice", "none")


@dataclass(frozen=True)
class LogitsRequest:
    """Which logits a forward returns. `gather`: "full" (the whole vocabulary on every rank), "vocab_slice" (this
    rank's padded vocab slice, ungathered: vocab_parallel_argmax takes it) or "none" (the loss alone, the head fused
    with it where it can be); `keep`: transformers' logits_to_keep, the last `keep` positions (0: all) or a tensor
    of positions (a (batch, k) tensor: each row's own)."""
    gather: str = "full"
    keep: int | torch.Tensor = 0

    def __post_init__(self):
        if self.gather not in LOGITS:
            raise ValueError(f"logits gather must be one of {LOGITS}, got {self.gather!r}")
        keep = self.keep
        if not isinstance(keep, torch.Tensor) and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 0):
            raise ValueError(f"logits_to_keep must be an integer >= 0 or a tensor of positions, got {keep!r}")


def keep_positions(x: torch.Tensor, keep) -> torch.Tensor:
    """x (batch, seq, ...) at transformers' logits_to_keep positions: the last `keep` (0: all), or those indexed
    (a (batch, k) index: each row's own)."""
    if isinstance(keep, torch.Tensor):
        keep = keep.to(x.device)
        if keep.dim() == 2:
            return x[torch.arange(x.shape[0], device=x.device)[:, None], keep]
        return x[:, keep]
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
        """Local-vocab logits (batch, seq, vocab/tp); hidden may be sequence-sharded. With `targets`: the summed loss
        of the head fused with the loss instead (kernels.linear_cross_entropy: the gradients taken chunk by chunk in
        the forward, no logits kept); computed here so that module hooks (the symbolic profiler's) see the head's
        weight and FLOPs as the head's."""
        if targets is not None:
            enter = functools.partial(enter_parallel, group=self.group, sequence_parallel=self.sequence_parallel)
            return linear_cross_entropy(hidden, self.head_weight(), targets, self.vocab_size, self.bias, self.group,
                                        ignore_index, label_smoothing, self.softcap, enter_parallel=enter)
        logits = column_parallel_linear(hidden, self.head_weight(), self.bias, self.group, self.sequence_parallel)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def loss_and_logits(self, hidden, labels=None, logits: "LogitsRequest" = None, cp=None, ignore_index=-100,
                        label_smoothing=0.0):
        """(loss or None, logits or None) from the final hidden states, the logits as `logits` asks. When only the loss
        is wanted the head matmul is fused into the loss (kernels.linear_cross_entropy: chunk by chunk, each chunk's
        logits turned into their gradient in the forward, on every path and at every tp)."""
        logits = logits if logits is not None else LogitsRequest()
        if labels is not None and logits.gather == "none":
            targets = self._next_tokens(labels, ignore_index, cp)
            total = self(hidden, targets, ignore_index, label_smoothing)
            return self._mean(total, targets, ignore_index, cp), None
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

        With `cp` (batch.cp) the logits are the rank's zigzag share of the sequence and `labels` the full sequence;
        the mean is taken over the whole sequence (sum and count summed over the cp ranks)."""
        targets = self._next_tokens(labels, ignore_index, cp)
        per_token = vocab_parallel_cross_entropy(logits_local, targets, self.vocab_size, self.group, ignore_index,
                                                 label_smoothing)
        return self._mean(per_token.sum(), targets, ignore_index, cp)

    def label_log_probs(self, logits_local, labels, ignore_index=-100, cp=None) -> torch.Tensor:
        """Per-token log-probabilities of `labels` (batch, seq) from this rank's vocab slice of the logits, never
        gathering the vocabulary: minus the vocab-parallel cross entropy. Laid out like `labels`: position t holds
        log p(labels[t] | tokens before t), 0 where labels is ignore_index and at t = 0. With `cp` the logits are
        this rank's zigzag share of the sequence; the result is the whole sequence on every cp rank (its backward
        keeps this rank's share)."""
        targets = self._next_tokens(labels, ignore_index, cp)
        logps = -vocab_parallel_cross_entropy(logits_local, targets, self.vocab_size, self.group, ignore_index)
        return self._laid_out(logps, cp)

    @torch.no_grad()
    def label_entropy(self, logits_local, labels, ignore_index=-100, cp=None) -> torch.Tensor:
        """The entropy of the next-token distribution at each labelled position, from this rank's vocab slice (one
        all-gather of three statistics per position, never the vocabulary), laid out like label_log_probs: position t
        holds the entropy of the distribution that predicts labels[t], 0 where labels is ignore_index and at t = 0.
        No gradient (a metric)."""
        entropy = vocab_parallel_entropy(logits_local, self.vocab_size, self.group)
        return self._laid_out(entropy, cp).masked_fill(labels == ignore_index, 0.0)

    def label_log_probs_and_entropy(self, logits_local, labels, ignore_index=-100,
                                    cp=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(label_log_probs, label_entropy) of the same arguments from one pass over the vocab slice: one set of
        softmax statistics per position and one all-gather of them over the tensor-parallel group. The log-probs and
        their gradients are label_log_probs'; the entropy has no gradient (a metric)."""
        targets = self._next_tokens(labels, ignore_index, cp)
        loss, entropy = vocab_parallel_cross_entropy_and_entropy(logits_local, targets, self.vocab_size, self.group,
                                                                 ignore_index)
        entropy = self._laid_out(entropy, cp).masked_fill(labels == ignore_index, 0.0)
        return self._laid_out(-loss, cp), entropy

    @staticmethod
    def _laid_out(per_position, cp):
        """A per-position value of the logits (this cp rank's share) laid out like the labels: the whole sequence,
        shifted one to the right (position t: the value of the distribution that predicts labels[t]; 0 at t = 0)."""
        if cp is not None:
            from .context_parallel import gather_sequence

            per_position = gather_sequence(per_position, cp.group)
        return F.pad(per_position[..., :-1], (1, 0))

    @staticmethod
    def _next_tokens(labels, ignore_index, cp):
        """The label each position predicts (this cp rank's share of them)."""
        targets = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        return cp.shard(targets) if cp is not None else targets

    @staticmethod
    def _mean(total, targets, ignore_index, cp):
        count = (targets != ignore_index).sum()
        if cp is not None:
            total, count = reduce_from_parallel(total, cp.group), reduce_from_parallel(count, cp.group)
        return token_mean(total, count)

    def full_logits(self, logits_local: torch.Tensor, cp=None) -> torch.Tensor:
        """All-gather the vocab slices and strip the padding (and with `cp`, gather the sequence too)."""
        logits = gather_from_parallel(logits_local, self.group)[..., : self.vocab_size]
        if cp is not None:
            from .context_parallel import gather_sequence

            logits = gather_sequence(logits, cp.group)
        return logits
