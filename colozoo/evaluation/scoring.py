"""The log-likelihood of continuations, from each tensor-parallel rank's slice of the vocabulary.

    score_spans(model, input_ids, [Span(row=0, end=12, tokens=(318, 257))]) -> [(-7.25, False)]

One forward of a right-padded batch through the pipeline stages keeps the logits at the positions that predict a
continuation token only, each row its own (a row with a long continuation costs the others nothing), each rank its
vocabulary slice (nothing gathers the whole vocabulary); the vocab-parallel
cross entropy gives each token's log-probability and `vocab_parallel_argmax` whether greedy decoding would choose it.
The last stage sends the sums to every pipeline rank, so every rank returns the same answers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from colozoo.kernels.cross_entropy import vocab_parallel_cross_entropy
from colozoo.layers.vocab import LogitsRequest, vocab_parallel_argmax
from colozoo.runtime.decode_steps import from_last_stage
from colozoo.runtime.pipeline import through_stages


@dataclass(frozen=True)
class Span:
    """Continuation `tokens` of batch row `row`, predicted at positions end - len(tokens) .. end - 1 (the logits at
    position p predict the token after it)."""
    row: int
    end: int
    tokens: tuple[int, ...]


@torch.no_grad()
def score_spans(model, input_ids: torch.Tensor, spans: list[Span]) -> list[tuple[float, bool]]:
    """(log-probability of each span's tokens, whether each is the greedy choice at its position) for the
    right-padded batch `input_ids` (batch, length), on every rank. Collective: every rank calls it alike."""
    parallel = model.parallel
    keep, rows, columns, targets, owner = _kept_positions(input_ids.shape[0], spans)
    input_ids = _padded_to_the_split(input_ids.to(parallel.device), parallel)
    extra = {"output_router_logits": False} if model.router_stats_width() else {}
    request = LogitsRequest("vocab_slice", keep.to(parallel.device))
    out = through_stages(model, input_ids, token_ids=input_ids, logits=request, **extra)
    sums = None
    if out is not None:  # the last stage's ranks
        picked = out.logits[torch.tensor(rows, device=parallel.device), torch.tensor(columns, device=parallel.device)]
        target = torch.tensor(targets, device=parallel.device)
        vocab = model.config.vocab_size
        log_probs = -vocab_parallel_cross_entropy(picked[None], target[None], vocab, parallel.tp_group)[0].double()
        greedy, _ = vocab_parallel_argmax(picked, vocab, parallel.tp_group)
        who = torch.tensor(owner, device=parallel.device)
        sums = torch.zeros(2, len(spans), dtype=torch.float64, device=parallel.device)
        sums[0].index_add_(0, who, log_probs)
        sums[1].index_add_(0, who, (greedy != target).double())  # tokens greedy decoding would not choose
    sums = from_last_stage(model, sums, (2, len(spans)), dtype=torch.float64)
    return [(log_prob, misses == 0) for log_prob, misses in sums.T.tolist()]


def _kept_positions(batch: int, spans: list[Span]):
    """(keep: (batch, k) the positions each row's logits are needed at, k the most any row needs, shorter rows
    repeating their last; and for every span token its row, its column in keep, its target, its span)."""
    needed = [[] for _ in range(batch)]
    rows, columns, targets, owner = [], [], [], []
    for i, span in enumerate(spans):
        n, row = len(span.tokens), needed[span.row]
        rows += [span.row] * n
        columns += range(len(row), len(row) + n)
        row += range(span.end - n, span.end)
        targets += span.tokens
        owner += [i] * n
    width = max(map(len, needed))
    keep = torch.tensor([row + [row[-1] if row else 0] * (width - len(row)) for row in needed])
    return keep, rows, columns, targets, owner


def _padded_to_the_split(input_ids: torch.Tensor, parallel) -> torch.Tensor:
    """Right padding to the multiple the mesh splits a sequence into (core.sequence) changes no logit before it (the
    model is causal)."""
    padding = -input_ids.shape[1] % parallel.config.sequence_multiple
    return F.pad(input_ids, (0, padding)) if padding else input_ids
