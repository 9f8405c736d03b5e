"""Beam search as transformers' generate does it (num_beams > 1, do_sample=False), on any mesh.

Each prompt keeps `num_beams` running sequences scored by their summed log-probabilities. Every step takes the best
K = max(2, 1 + number of eos tokens) * num_beams continuations of all beams; those that end (an eos token, max_length,
a stop string) compete, normalised by length ** length_penalty, for the `num_beams` finished places, and the best
num_beams that go on are the next running beams, whose KV caches are gathered to them. Generation ends when no
running beam can beat the finished ones (early_stopping: False is transformers' heuristic from the current length,
"never" the exact bound, True as soon as every prompt has num_beams finished), when every continuation ended, or at
max_length. The last pipeline stage decides; the other pp ranks follow its tokens and cache reorders.
"""
from __future__ import annotations

import torch

from colozoo.layers.vocab import LogitsRequest
from colozoo.runtime.decode_steps import DecodeSteps, from_last_stage, generate_output, steps_from_last_stage
from colozoo.runtime.generation_config import Decoding
from colozoo.runtime.sampling import process

FAR = -1.0e9  # the score of what may no longer be chosen


class BeamState:
    """The beams of every prompt: running (batch, beams, max_length) sequences with their scores and the beam each step
    came from, and the finished ones, as transformers keeps them."""

    def __init__(self, input_ids: torch.Tensor, decoding: Decoding):
        beams = decoding.num_beams
        self.batch, self.prompt = input_ids.shape[0] // beams, input_ids.shape[1]
        self.beams, self.decoding = beams, decoding
        pad, eos = decoding.pad_token_id, decoding.eos_token_id
        fill = pad if pad else (eos[0] if eos is not None else -1)  # transformers' `pad or eos[0]`: pad 0 takes eos
        device = input_ids.device
        self.running = torch.full((self.batch, beams, decoding.max_length), fill, dtype=torch.long, device=device)
        self.running[:, :, :self.prompt] = input_ids.view(self.batch, beams, -1)
        self.finished = self.running.clone()
        self.running_scores = torch.zeros(self.batch, beams, device=device)
        self.running_scores[:, 1:] = FAR  # the beams start equal: only the first one's continuations count
        self.finished_scores = torch.full((self.batch, beams), FAR, device=device)
        self.is_finished = torch.zeros(self.batch, beams, dtype=torch.bool, device=device)
        self.improvable = torch.ones(self.batch, 1, dtype=torch.bool, device=device)
        self.running_origins = torch.full((self.batch, beams, decoding.max_length - self.prompt), -1,
                                          dtype=torch.int32, device=device)
        self.finished_origins = self.running_origins.clone()
        self.keep = max(2, 1 + len(eos or ())) * beams
        self.top_beams = torch.arange(self.keep, device=device) < beams

    def step(self, log_probs: torch.Tensor, length: int, stop) -> tuple[torch.Tensor, bool]:
        """Take one step from the processed log-probabilities (batch * beams, vocab) of sequences `length` long; return
        the rows (batch * beams) each running beam now continues, and whether to go on."""
        vocab = log_probs.shape[-1]
        total = (log_probs.view(self.batch, self.beams, vocab) + self.running_scores[:, :, None]).view(self.batch, -1)
        top_scores, top = torch.topk(total, self.keep)
        source, tokens = top // vocab, top % vocab
        candidates = _take(self.running, source)
        candidates[:, :, length] = tokens
        origins = _take(self.running_origins, source)
        origins[:, :, length - self.prompt] = source + torch.arange(self.batch, device=source.device)[:, None] * self.beams
        ended = self._ended(candidates[:, :, :length + 1], length + 1, stop)
        going_on = torch.topk(top_scores + ended.float() * FAR, self.beams).indices
        self.running = _take(candidates, going_on)
        self.running_scores = _take(top_scores + ended.float() * FAR, going_on)
        self.running_origins = _take(origins, going_on)
        self._finish(candidates, top_scores, origins, ended, length)
        self._update_improvable(length + 1)
        improvement_possible = bool(self.improvable.any())
        open_beams = not (bool(self.is_finished.all()) and self.decoding.early_stopping is True)
        go_on = improvement_possible and open_beams and not bool(ended.all())
        rows = self.running_origins[..., length - self.prompt].reshape(-1).long()
        return rows, go_on

    def _ended(self, sequences: torch.Tensor, length: int, stop) -> torch.Tensor:
        last = sequences[:, :, -1]
        ended = torch.full_like(last, length >= self.decoding.max_length, dtype=torch.bool)
        if self.decoding.eos_token_id is not None:
            ended |= torch.isin(last, torch.tensor(self.decoding.eos_token_id, device=last.device))
        if stop is not None:
            ended |= stop(sequences.reshape(-1, length), None).view_as(last).to(ended.device)
        return ended

    def _finish(self, candidates, top_scores, origins, ended, length: int):
        """Candidates among the top `beams` that just ended replace worse finished beams."""
        just_finished = ended & self.top_beams[None, :]
        scores = top_scores / ((length + 1 - self.prompt) ** self.decoding.length_penalty)
        full = self.is_finished.all(dim=-1, keepdim=True) & (self.decoding.early_stopping is True)
        scores = scores + full.float() * FAR + (~self.improvable).float() * FAR + (~just_finished).float() * FAR
        merged_scores = torch.cat([self.finished_scores, scores], dim=1)
        best = torch.topk(merged_scores, self.beams).indices
        self.finished = _take(torch.cat([self.finished, candidates], dim=1), best)
        self.finished_scores = _take(merged_scores, best)
        self.finished_origins = _take(torch.cat([self.finished_origins, origins], dim=1), best)
        self.is_finished = _take(torch.cat([self.is_finished, just_finished], dim=1), best)

    def _update_improvable(self, length: int):
        """Can a running beam still beat the worst finished one (transformers' early-stopping heuristic)?"""
        penalty = self.decoding.length_penalty
        if self.decoding.early_stopping == "never" and penalty > 0.0:
            best_length = self.decoding.max_length - self.prompt
        else:
            best_length = length - self.prompt
        best_running = self.running_scores[:, :1] / (best_length ** penalty)
        worst_finished = torch.where(self.is_finished, self.finished_scores.min(dim=1, keepdim=True).values, FAR)
        self.improvable = self.improvable & (best_running > worst_finished).any(dim=-1, keepdim=True)

    def result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sequences, their scores, the beam each token came from) of the best num_return_sequences per prompt."""
        n = self.decoding.num_return_sequences
        sequences = self.finished[:, :n].reshape(self.batch * n, -1)
        scores = self.finished_scores[:, :n].reshape(-1)
        origins = self.finished_origins[:, :n].reshape(self.batch * n, -1)
        generated = int((origins + 1).bool().sum(dim=1).max())
        return sequences[:, :self.prompt + generated], scores, origins[:, :generated]


def _take(tensor: torch.Tensor, beams: torch.Tensor) -> torch.Tensor:
    """tensor (batch, beams, ...) at the beams indexed per prompt (batch, k)."""
    index = beams.view(*beams.shape, *([1] * (tensor.dim() - 2))).expand(*beams.shape, *tensor.shape[2:])
    return tensor.gather(1, index)


def beam_search(model, input_ids, mask, decoding: Decoding, stop, num_microbatches):
    parallel, beams = model.parallel, decoding.num_beams
    input_ids = input_ids.repeat_interleave(beams, dim=0)
    steps = DecodeSteps(model, mask.repeat_interleave(beams, dim=0), decoding.max_length, num_microbatches,
                        decoding.use_cache)
    state = BeamState(input_ids, decoding) if parallel.is_last_stage else None
    keep_scores = decoding.return_dict_in_generate and decoding.output_scores
    keep_logits = decoding.return_dict_in_generate and decoding.output_logits
    scores, raw_logits = [], []
    sequences, length, go_on = input_ids, input_ids.shape[1], True
    padding = (steps.mask != 0).int().argmax(dim=1)  # left padding, which the repetition penalty leaves out
    while go_on:
        logits = steps.logits(sequences, LogitsRequest("full", keep=1))
        rows = None
        if state is not None:
            log_probs = process(torch.log_softmax(logits.float(), dim=-1), sequences, decoding, padding)
            scores += [log_probs] if keep_scores else []
            raw_logits += [logits.float()] if keep_logits else []
            rows, go_on = state.step(log_probs, length, stop)
            rows = torch.cat([rows, torch.tensor([int(go_on)], device=rows.device)])
        rows = from_last_stage(model, rows, (input_ids.shape[0] + 1,))
        rows, go_on = rows[:-1], bool(rows[-1])
        length += 1
        running = state.running[:, :, :length].reshape(-1, length) if state is not None else None
        sequences = from_last_stage(model, running, (input_ids.shape[0], length))
        steps.extend()
        steps.reorder(rows)
    found = state.result() if state is not None else None
    shape = from_last_stage(model, torch.tensor(found[0].shape, device=parallel.device) if found else None, (2,))
    n = decoding.num_return_sequences * (input_ids.shape[0] // beams)
    out = from_last_stage(model, found[0] if found else None, tuple(shape.tolist()))
    if not decoding.return_dict_in_generate:
        return out
    sequences_scores = from_last_stage(model, found[1] if found else None, (n,), dtype=torch.float32)
    origins = from_last_stage(model, found[2].long() if found else None, (n, int(shape[1]) - input_ids.shape[1]))
    vocab = model.config.vocab_size
    return generate_output(True, sequences=out, sequences_scores=sequences_scores if keep_scores else None,
                           beam_indices=origins,
                           scores=steps_from_last_stage(model, scores, keep_scores, input_ids.shape[0], vocab),
                           logits=steps_from_last_stage(model, raw_logits, keep_logits, input_ids.shape[0], vocab),
                           cache_elements=steps.cache.numel())
