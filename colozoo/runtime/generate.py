"""Incremental decoding on any mesh: `model.generate(...)`, with transformers' arguments and result.

One prefill of the (left-padded) prompts, then one token per step. Each rank keeps the KV cache of its own heads
(layers.kv_cache). Under pipeline parallelism the batch is cut into micro-batches that follow each other through
the stages, so stages work on different micro-batches at once; the last stage chooses the next tokens and
broadcasts them over the pp group. Token choice (colozoo.runtime.sampling) runs on identical logits with the same
seeded generator on every rank that chooses, so every rank returns the same (batch, prompt + new) tensor.
A model whose position encoding changes with the sequence length names the length at which the whole sequence is
encoded again (`reencode_length`: Phi-3's LongRoPE switches to its long factors, as transformers' Phi-3 does).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from colozoo.layers.kv_cache import KVCache
from colozoo.layers.vocab import LogitsRequest, VocabParallelEmbedding, vocab_parallel_argmax
from colozoo.models import family_of
from colozoo.runtime.pipeline import through_stages
from colozoo.runtime.sampling import GenerationOptions, finish, next_tokens


def generation_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions as transformers' generate gives them: real tokens count from 0, left padding sits at 1."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def check_generation(model, input_ids, attention_mask, options: GenerationOptions):
    if input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(f"input_ids must be a (batch, length) LongTensor, got {tuple(input_ids.shape)} "
                         f"{input_ids.dtype}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must have input_ids' shape "
                         f"{tuple(input_ids.shape)}")
    pc = model.pc
    if pc.config.cp > 1 or pc.sequence_parallel:
        raise ValueError("generate runs one token at a time: build the model with cp=1 and sequence_parallel=False")
    if not model.can_generate():
        raise ValueError(f"{type(model).__name__} has no language-model head to generate with")
    limit = getattr(model.config, "max_position_embeddings", None)
    total = input_ids.shape[1] + options.max_new_tokens
    if limit is not None and input_ids.shape[1] > limit:
        raise ValueError(f"the prompt ({input_ids.shape[1]} tokens) is longer than the model's maximum positions "
                         f"(max_position_embeddings={limit})")
    if limit is not None and family_of(model.family).learned_positions and total > limit:
        raise ValueError(f"prompt + max_new_tokens = {total} exceeds {model.family}'s position table "
                         f"(max_position_embeddings={limit}); lower max_new_tokens")


@dataclass
class GenerateOutput:
    """What `generate(..., return_dict_in_generate=True)` returns: transformers' `sequences`, and how it went (the
    seconds of the prefill and of the decode steps, the elements this rank's KV cache held)."""
    sequences: torch.Tensor
    timings: dict = field(default_factory=dict)
    cache_elements: int = 0


@torch.no_grad()
def generate(model, input_ids, attention_mask=None, streamer=None, num_microbatches: int | None = None,
             return_dict_in_generate: bool = False, **options) -> torch.Tensor | GenerateOutput:
    """(batch, prompt + new tokens) on every rank (a GenerateOutput with `return_dict_in_generate`); sequences that
    finished are padded with pad_token_id."""
    options = GenerationOptions.from_config(model.config, **options)
    check_generation(model, input_ids, attention_mask, options)
    pc = model.pc
    input_ids = input_ids.to(pc.device)
    mask = (torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(pc.device)).long()
    batch = input_ids.shape[0]
    micro = num_microbatches or (min(batch, pc.config.pp) if pc.config.pp > 1 else 1)
    micro_rows = [slice(r[0].item(), r[-1].item() + 1) for r in torch.arange(batch).tensor_split(micro) if len(r)]
    cache = KVCache(mask, max_len=input_ids.shape[1] + options.max_new_tokens)
    generator = None
    if options.do_sample:  # greedy decoding draws nothing: training's random state stays as it was
        generator = torch.Generator(device=pc.device)
        generator.manual_seed(options.seed if options.seed is not None else _shared_seed(pc))
    extra = {"output_router_logits": False} if model.router_stats_width() else {}
    sequences, unfinished = input_ids, torch.ones(batch, dtype=torch.bool, device=pc.device)
    new = input_ids
    reencode = getattr(model, "reencode_length", None)
    # greedy without a repetition penalty needs only each vocab slice's best logit, not the gathered logits
    sharded_argmax = pc.tp_size > 1 and not options.do_sample and options.repetition_penalty in (None, 1.0)
    logits_wanted = LogitsRequest("vocab_slice" if sharded_argmax else "full", keep=1)
    embedding = _token_embedding(model) if sharded_argmax else None
    rows = None  # the embedding rows of `new`, gathered with the tokens: the step's embedding needs no all-reduce
    timings = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0}
    if streamer is not None:
        streamer.put(input_ids.cpu())
    for step in range(options.max_new_tokens):
        started = time.perf_counter()
        if step and sequences.shape[1] == reencode:  # drop the cache, encode everything again
            cache.restart()
            new, rows = sequences, None
        positions = generation_positions(mask)[:, -new.shape[1]:]
        if len(micro_rows) > 1 and model.rotary is not None:  # dynamic / LongRoPE choose by the whole batch's length
            extra["rope_length"] = int(positions.max()) + 1
        logits = [_last_logits(model, new[r], positions[r], cache.micro_batch(r),
                               extra if rows is None else dict(extra, token_rows=rows[r, None]), logits_wanted)
                  for r in micro_rows]
        cache.advance(new.shape[1])
        tokens, rows = None, None
        if pc.is_last_stage and sharded_argmax:
            tokens, rows = vocab_parallel_argmax(torch.cat(logits), model.config.vocab_size, pc.tp_group, embedding)
        elif pc.is_last_stage:
            tokens = next_tokens(torch.cat(logits).float(), sequences, options, generator)
        tokens = _from_last_stage(model, tokens, batch)
        if rows is not None and options.eos_token_id is not None and not bool(unfinished.all()):
            rows = None  # a finished row continues with the pad token, not the token chosen for it
        tokens, unfinished = finish(tokens, unfinished, options)
        sequences = torch.cat([sequences, tokens[:, None]], dim=1)
        mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
        new = tokens[:, None]
        timings["prefill_s" if step == 0 else "decode_s"] += time.perf_counter() - started
        timings["decode_steps"] += step > 0
        if streamer is not None:
            streamer.put(tokens.cpu())
        if options.eos_token_id is not None and not unfinished.any():  # a sync per step only when it can end
            break
    if streamer is not None:
        streamer.end()
    if not return_dict_in_generate:
        return sequences
    return GenerateOutput(sequences=sequences, timings=dict(timings, batch=batch, prompt_tokens=input_ids.shape[1],
                                                            new_tokens=sequences.shape[1] - input_ids.shape[1]),
                          cache_elements=cache.numel())


def _token_embedding(model) -> torch.Tensor | None:
    """This rank's slice of the token embedding's weight when the ranks choosing tokens also embed them (pp == 1),
    as a plain tensor (not sharded further by FSDP); None otherwise."""
    name = getattr(model, "tied_embedding", None)
    if model.pc.config.pp > 1 or name is None:
        return None
    module = model.get_submodule(name.rsplit(".", 1)[0])
    if not isinstance(module, VocabParallelEmbedding) or type(module.weight.data) is not torch.Tensor:
        return None
    return module.weight.detach()


def _shared_seed(pc) -> int:
    """Without a seed, sampling draws from torch's global generator as transformers' does: one draw on every rank
    (so generators that agree across ranks keep agreeing, as dropout under tensor parallelism needs), and rank 0's
    value for all, so every rank samples the same tokens."""
    seed = torch.randint(2 ** 62, (1,))
    if dist.is_available() and dist.is_initialized():
        seed = seed.to(pc.device)
        dist.broadcast(seed, src=0)
    return int(seed.item())


def _last_logits(model, ids, positions, cache, extra, logits: LogitsRequest):
    """Logits (rows, vocab) of the last position of `ids` on the last stage's ranks, None elsewhere (this rank's
    padded vocab slice when `logits` asks for it)."""
    out = through_stages(model, ids, token_ids=ids, position_ids=positions, cache=cache, logits=logits, **extra)
    return None if out is None else out.logits[:, -1]


def _from_last_stage(model, tokens, batch: int) -> torch.Tensor:
    if model.pc.config.pp == 1:
        return tokens
    buffer = tokens if tokens is not None else torch.empty(batch, dtype=torch.long, device=model.pc.device)
    group = model.pc.group("pp")
    dist.broadcast(buffer, src=dist.get_global_rank(group, model.pc.config.pp - 1), group=group)
    return buffer

