"""Choosing the next token as transformers' generate does: its processors in its order (repetition penalty, the
minimum length's suppressed end-of-sequence tokens, then for sampling temperature, top-k, top-p and min-p), greedy or
sampled with a seeded generator; sequences that met an end-of-sequence token continue with the pad token.

Nothing here waits for the device: no value goes to the host and no host list becomes a device index per token
(`eos`: the end-of-sequence ids as a device tensor, made once per generate call), so a decode loop runs ahead of
its GPU (colozoo.runtime.static_decode)."""
from __future__ import annotations

import torch

from colozoo.runtime.generation_config import Decoding


def eos_ids(options: Decoding, device) -> torch.Tensor | None:
    """The end-of-sequence ids as a device tensor (None without any)."""
    return None if options.eos_token_id is None else torch.tensor(options.eos_token_id, device=device)


def process(scores: torch.Tensor, generated: torch.Tensor, options: Decoding,
            padding: torch.Tensor | None = None, eos: torch.Tensor | None = None) -> torch.Tensor:
    """The (batch, vocab) scores after transformers' processors for these options (fp32, a new tensor). `generated`:
    every token so far, prompt included (batch, length); `padding`: each row's count of left-padding positions, whose
    tokens the repetition penalty leaves out (as transformers does); `eos`: eos_ids(options), made once."""
    scores = scores.float().clone()
    if options.repetition_penalty is not None and options.repetition_penalty != 1.0:
        vocab = scores.shape[-1]
        if padding is not None:  # padding positions point at a column past the vocabulary, dropped below
            positions = torch.arange(generated.shape[1], device=generated.device)
            generated = generated.masked_fill(positions[None, :] < padding[:, None].to(generated.device), vocab)
        seen = torch.zeros(scores.shape[0], vocab + 1, dtype=torch.bool, device=scores.device)
        seen.scatter_(1, generated.to(scores.device), True)
        penalised = torch.where(scores < 0, scores * options.repetition_penalty, scores / options.repetition_penalty)
        scores = torch.where(seen[:, :vocab], penalised, scores)
    if options.eos_token_id is not None and generated.shape[-1] < options.min_length:
        scores = scores.index_fill(1, eos_ids(options, scores.device) if eos is None else eos, -float("inf"))
    if not options.do_sample:
        return scores
    if options.temperature != 1.0:
        scores = scores / options.temperature
    if options.top_k and options.top_k < scores.shape[-1]:
        kth = torch.topk(scores, options.top_k).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if options.top_p is not None and options.top_p < 1.0:
        ascending, order = torch.sort(scores, descending=False)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - options.top_p
        drop[..., -1:] = False  # always keep the most likely token
        scores = scores.masked_fill(drop.scatter(1, order, drop), -float("inf"))
    if options.min_p is not None:  # below min_p times the best token's probability (min_p <= 1 keeps the best)
        probs = scores.softmax(dim=-1)
        scores = scores.masked_fill(probs < options.min_p * probs.amax(dim=-1, keepdim=True), -float("inf"))
    return scores


def choose(scores: torch.Tensor, options: Decoding, generator: torch.Generator | None = None) -> torch.Tensor:
    """(batch,) token ids from processed scores (batch, vocab): the best, or one drawn from their softmax."""
    if not options.do_sample:
        return scores.argmax(dim=-1)
    return draw(scores.softmax(dim=-1), generator)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """torch.multinomial(probs, 1, generator=generator).squeeze(1), bit for bit (its own algorithm for one sample:
    argmax of probs / Exp(1) noise, the generator advanced alike), without its check that reads the probabilities'
    range back to the host, a wait for the device at every token."""
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / noise).argmax(dim=-1)


def finish(tokens: torch.Tensor, unfinished: torch.Tensor, options: Decoding, eos: torch.Tensor | None = None):
    """(tokens with pad_token_id where the sequence had already ended, which sequences go on). `eos`:
    eos_ids(options), made once."""
    if options.eos_token_id is None:
        return tokens, unfinished
    tokens = torch.where(unfinished, tokens, options.pad_token_id)
    ended = torch.isin(tokens, eos_ids(options, tokens.device) if eos is None else eos)
    return tokens, unfinished & ~ended
