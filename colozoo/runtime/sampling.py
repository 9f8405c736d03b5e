"""Choosing the next token as transformers' generate does: its argument names, defaults and order of processing
(repetition penalty, temperature, top-k, top-p), greedy or sampled with a seeded generator; sequences that met an
end-of-sequence token continue with the pad token."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, fields

import torch


@dataclass
class GenerationOptions:
    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    seed: int | None = None

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be True or False, got {self.do_sample!r}")
        if self.do_sample and not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be None or an integer >= 1, got {self.top_k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be None or in (0, 1], got {self.top_p!r}")
        if self.repetition_penalty is not None and not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be None or > 0, got {self.repetition_penalty!r}")
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]
        if self.eos_token_id is not None and self.pad_token_id is None:
            warnings.warn(f"pad_token_id is not set: sequences that end pad with eos_token_id "
                          f"{self.eos_token_id[0]}, as transformers does", stacklevel=3)
            self.pad_token_id = self.eos_token_id[0]

    @classmethod
    def from_config(cls, config, **options) -> "GenerationOptions":
        """Options given, else the model config's eos/pad tokens (None given explicitly stays None)."""
        known = {f.name for f in fields(cls)}
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"unknown generate options {sorted(unknown)}; known: {sorted(known)}")
        for name in ("eos_token_id", "pad_token_id"):
            if name not in options:
                options[name] = getattr(config, name, None)
        return cls(**options)


def process(scores: torch.Tensor, generated: torch.Tensor, options: GenerationOptions) -> torch.Tensor:
    """The (batch, vocab) scores after transformers' processors for these options (fp32, a new tensor)."""
    scores = scores.float().clone()
    if options.repetition_penalty is not None and options.repetition_penalty != 1.0:
        seen = scores.gather(1, generated)
        seen = torch.where(seen < 0, seen * options.repetition_penalty, seen / options.repetition_penalty)
        scores.scatter_(1, generated, seen)
    if not options.do_sample:
        return scores
    if options.temperature != 1.0:
        scores = scores / options.temperature
    if options.top_k is not None and options.top_k < scores.shape[-1]:
        kth = torch.topk(scores, options.top_k).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if options.top_p is not None and options.top_p < 1.0:
        ascending, order = torch.sort(scores, descending=False)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - options.top_p
        drop[..., -1:] = False  # always keep the most likely token
        scores = scores.masked_fill(drop.scatter(1, order, drop), -float("inf"))
    return scores


def next_tokens(logits: torch.Tensor, generated: torch.Tensor, options: GenerationOptions,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """(batch,) token ids from the last position's logits (batch, vocab) and every token so far (batch, length)."""
    if not options.do_sample and options.repetition_penalty in (None, 1.0):  # nothing to process: no copy
        return logits.argmax(dim=-1)
    scores = process(logits, generated, options)
    if not options.do_sample:
        return scores.argmax(dim=-1)
    return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(1)


def finish(tokens: torch.Tensor, unfinished: torch.Tensor, options: GenerationOptions):
    """(tokens with pad_token_id where the sequence had already ended, which sequences go on)."""
    if options.eos_token_id is None:
        return tokens, unfinished
    tokens = torch.where(unfinished, tokens, torch.full_like(tokens, options.pad_token_id))
    ended = torch.isin(tokens, torch.tensor(options.eos_token_id, device=tokens.device))
    return tokens, unfinished & ~ended
