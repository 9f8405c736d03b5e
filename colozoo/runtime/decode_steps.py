"""One decoding step on any mesh: the new tokens of every sequence through the pipeline stages against the KV cache,
and the last position's logits on the ranks of the last stage; the rest of generation (colozoo.runtime.generate,
colozoo.runtime.beam_search) decides what to do with them.

Each rank keeps the KV cache of its own heads (layers.kv_cache). Under pipeline parallelism the batch is cut into
micro-batches that follow each other through the stages, so stages work on different micro-batches at once; the
last stage decides and `from_last_stage` hands its decision to every pp rank. A model whose position encoding changes
with the sequence length names the length at which the whole sequence is encoded again (`reencode_length`: Phi-3's
LongRoPE switches to its long factors, as transformers' Phi-3 does).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from colozoo.layers.kv_cache import KVCache
from colozoo.layers.vocab import LogitsRequest, VocabParallelEmbedding
from colozoo.runtime.pipeline import through_stages


def generate_output(beam_search: bool = False, timings: dict | None = None, cache_elements: int = 0,
                    decode_path: str = "eager", **fields):
    """What `generate(..., return_dict_in_generate=True)` returns: transformers' own GenerateDecoderOnlyOutput
    (GenerateBeamDecoderOnlyOutput under beam search) of `fields` (`scores`: each step's processed scores, with
    output_scores; `logits`: each step's raw logits, with output_logits; beam search adds `sequences_scores` and
    `beam_indices`), so it is what transformers' is: a ModelOutput whose keys are the fields that are set (`out[0]`,
    `out["scores"]`, `keys()`, `to_tuple()`, `in`). How it went is in attributes that are no fields, so no keys:
    `timings` (the seconds of the prefill and of the decode steps), `cache_elements` (what this rank's KV cache
    held), `decode_path` ("cuda_graph", "compiled", "static" or "eager": colozoo.runtime.generate) and `decode_note`
    (why that path, None when it is the default that applies: generate sets it). The cache itself is not returned:
    each rank's holds its own heads only."""
    from transformers.generation.utils import GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput

    out = (GenerateBeamDecoderOnlyOutput if beam_search else GenerateDecoderOnlyOutput)(**fields)
    out.timings, out.cache_elements, out.decode_path = dict(timings or {}), cache_elements, decode_path
    out.decode_note = None
    return out


def generation_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions as transformers' generate gives them: real tokens count from 0, left padding sits at 1."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


class DecodeSteps:
    """The forwards of one generate call: the cache, the micro-batches, the growing attention mask."""

    def __init__(self, model, attention_mask: torch.Tensor, max_length: int, num_microbatches: int | None = None,
                 use_cache: bool = True):
        parallel = model.parallel
        self.model, self.mask, self.use_cache = model, attention_mask, use_cache
        batch = attention_mask.shape[0]
        micro = num_microbatches or (min(batch, parallel.config.pp) if parallel.config.pp > 1 else 1)
        self.micro_rows = [slice(int(r[0]), int(r[-1]) + 1) for r in torch.arange(batch).tensor_split(micro) if len(r)]
        self.cache = KVCache(attention_mask, max_len=max_length)
        self.extra = {"output_router_logits": False} if model.router_stats_width() else {}
        self.steps = 0

    def logits(self, sequences: torch.Tensor, logits: LogitsRequest, token_rows=None) -> torch.Tensor | None:
        """The next-token logits (batch, vocab) of `sequences` (batch, length: the prompt and every token chosen so far)
        on the last stage's ranks, None elsewhere; the cache takes the positions it has not seen. `token_rows`: the
        embedding rows of the newest tokens, known already (greedy decoding under tp)."""
        model = self.model
        reencode = model.reencode_length
        if self.steps and (not self.use_cache or sequences.shape[1] == reencode):
            self.cache.restart()  # drop the cache, encode everything again
            token_rows = None
        new = sequences[:, self.cache.length:]
        positions = generation_positions(self.mask)[:, -new.shape[1]:]
        extra = dict(self.extra)
        if len(self.micro_rows) > 1 and model.rotary is not None:  # dynamic / LongRoPE choose by the whole batch
            extra["rope_length"] = int(positions.max()) + 1
        outs = []
        for rows in self.micro_rows:
            step_extra = extra if token_rows is None else dict(extra, token_rows=token_rows[rows, None])
            out = through_stages(model, new[rows], token_ids=new[rows], position_ids=positions[rows],
                                 cache=self.cache.micro_batch(rows), logits=logits, **step_extra)
            outs.append(None if out is None else out.logits[:, -1])
        self.cache.advance(new.shape[1])
        self.steps += 1
        return None if outs[0] is None else torch.cat(outs)

    def extend(self, new_tokens: int = 1):
        """The attention mask of the sequences after `new_tokens` more tokens each."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], new_tokens)], dim=1)

    def reorder(self, rows: torch.Tensor):
        """Every cached sequence replaced by the one at `rows` (beam search keeps its best continuations)."""
        self.cache.reorder(rows)
        self.mask = self.mask.index_select(0, rows.to(self.mask.device))


def from_last_stage(model, value: torch.Tensor | None, shape, dtype=torch.long) -> torch.Tensor:
    """The tensor the last pipeline stage computed (`shape`, `dtype`), on every pp rank."""
    if model.parallel.config.pp == 1:
        return value
    buffer = value.contiguous() if value is not None else torch.empty(shape, dtype=dtype, device=model.parallel.device)
    group = model.parallel.group("pp")
    dist.broadcast(buffer, src=dist.get_global_rank(group, model.parallel.config.pp - 1), group=group)
    return buffer


def token_embedding(model) -> torch.Tensor | None:
    """This rank's slice of the token embedding's weight when the ranks choosing tokens also embed them (pp == 1),
    as a plain tensor (not sharded further by FSDP); None otherwise."""
    name = model.tied_embedding
    if model.parallel.config.pp > 1 or name is None:
        return None
    module = model.get_submodule(name.rsplit(".", 1)[0])
    if not isinstance(module, VocabParallelEmbedding) or type(module.weight.data) is not torch.Tensor:
        return None
    return module.weight.detach()


def shared_seed(parallel) -> int:
    """Without a seed, sampling draws from torch's global generator as transformers' does: one draw on every rank
    (so generators that agree across ranks keep agreeing, as dropout under tensor parallelism needs), and rank 0's
    value for all, so every rank samples the same tokens."""
    seed = torch.randint(2 ** 62, (1,))
    if dist.is_available() and dist.is_initialized():
        seed = seed.to(parallel.device)
        dist.broadcast(seed, src=0)
    return int(seed.item())


def steps_from_last_stage(model, per_step: list, kept: bool, batch: int, vocab: int) -> tuple | None:
    """Each step's (batch, vocab) scores, on every pp rank; None when they were not asked for."""
    if not kept:
        return None
    count = from_last_stage(model, torch.tensor(len(per_step), device=model.parallel.device) if per_step else None, ())
    stacked = torch.stack(per_step) if per_step else None
    stacked = from_last_stage(model, stacked, (int(count), batch, vocab), dtype=torch.float32)
    return tuple(stacked.unbind(0))
