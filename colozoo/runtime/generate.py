"""`model.generate(...)` on any mesh, with transformers' arguments, generation config and results.

    ids = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)            # (batch, prompt + new)
    out = model.generate(input_ids, num_beams=4, return_dict_in_generate=True, output_scores=True)

One prefill of the (left-padded) prompts, then one token per step, on one of four paths (`decode_path`; the output of
return_dict_in_generate says which ran):

    "cuda_graph"  greedy / sampled on CUDA where the static step applies (colozoo.runtime.static_decode): the default
    "static"      the same step run eagerly: cache_implementation="static" on the CPU, or with disable_compile=True
    "compiled"    the same step torch.compile'd: a compile_config on a call that takes the static step
    "eager"       the cache growing a slice a step (colozoo.runtime.decode_steps): beam search
                  (colozoo.runtime.beam_search), pp > 1, MoE layers, dynamic / LongRoPE scaling, FSDP-sharded or
                  offloaded weights, training mode; the CPU by default; cache_implementation="dynamic";
                  disable_compile=True alone

Every path returns the same tokens, scores and logits. The options are resolved as transformers resolves them
(colozoo.runtime.generation_config: the call's, the model's `generation_config`, transformers' defaults). Token choice
(colozoo.runtime.sampling) runs on identical logits with the same seeded generator on every rank that chooses, so
every rank returns the same result. Nothing of a call is kept: timings and the cache size come back in the output.
"""
from __future__ import annotations

import time

import torch

from colozoo.layers.vocab import LogitsRequest, vocab_parallel_argmax
from colozoo.models import family_of
from colozoo.runtime.beam_search import beam_search
from colozoo.runtime.decode_steps import (DecodeSteps, from_last_stage, generate_output, shared_seed,
                                         steps_from_last_stage, token_embedding)
from colozoo.runtime.generation_config import Decoding, resolve
from colozoo.runtime.sampling import choose, eos_ids, finish, process
from colozoo.runtime.static_decode import decode_note, decode_path, static_sample


def check_inputs(model, input_ids, attention_mask, decoding: Decoding):
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a (batch, length) LongTensor, got {shape}"
                         f"{' ' + str(input_ids.dtype) if isinstance(input_ids, torch.Tensor) else ''} (a single "
                         f"prompt is a batch of one: input_ids[None])")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} hold no prompt: give at least one token per sequence")
    vocab = model.config.vocab_size
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
        raise ValueError(f"input_ids hold token ids outside the vocabulary [0, {vocab}): "
                         f"{int(input_ids.min())}..{int(input_ids.max())}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must have input_ids' shape "
                         f"{tuple(input_ids.shape)}")
    parallel = model.parallel
    if parallel.config.cp > 1 or parallel.sequence_parallel:
        raise ValueError("generate runs one token at a time: build the model with cp=1 and sequence_parallel=False")
    if not model.can_generate():
        raise ValueError(f"{type(model).__name__} has no language-model head to generate with")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and input_ids.shape[1] > limit:
        raise ValueError(f"the prompt ({input_ids.shape[1]} tokens) is longer than the model's maximum positions "
                         f"(max_position_embeddings={limit})")
    if limit is not None and family_of(model.family).learned_positions and decoding.max_length > limit:
        raise ValueError(f"prompt + new tokens = {decoding.max_length} exceeds {model.family}'s position table "
                         f"(max_position_embeddings={limit}); lower max_new_tokens")


def stop_string_criteria(decoding: Decoding, tokenizer):
    """transformers' own stop-string matcher (it needs the tokenizer's vocabulary), or None."""
    if decoding.stop_strings is None:
        return None
    if tokenizer is None:
        raise ValueError("stop_strings needs the tokenizer: generate(..., stop_strings=..., tokenizer=tokenizer)")
    from transformers.generation import StopStringCriteria

    return StopStringCriteria(tokenizer, list(decoding.stop_strings))


@torch.no_grad()
def generate(model, input_ids, attention_mask=None, generation_config=None, streamer=None, tokenizer=None,
             num_microbatches: int | None = None, **options):
    """(batch * num_return_sequences, prompt + new tokens) on every rank, or with return_dict_in_generate
    transformers' GenerateDecoderOnlyOutput / GenerateBeamDecoderOnlyOutput (decode_steps.generate_output); sequences
    that finished early are padded with pad_token_id. `options`: transformers' GenerationConfig fields, and `seed`
    (sampling draws from a generator seeded with it, the same on every rank). On CUDA greedy and sampled decoding
    replay a CUDA graph of the decode step where it applies (the module docstring says which calls take which path);
    cache_implementation="static" takes that step anywhere, "dynamic" or disable_compile=True the eager loop."""
    decoding = resolve(model, input_ids.shape[-1] if isinstance(input_ids, torch.Tensor) else 0, generation_config,
                       **options)
    check_inputs(model, input_ids, attention_mask, decoding)
    parallel = model.parallel
    input_ids = input_ids.to(parallel.device)
    mask = (torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(parallel.device)).long()
    stop = stop_string_criteria(decoding, tokenizer)
    path, why = decode_path(model, decoding, num_microbatches)  # refuses a static cache it cannot take, asked by name
    if decoding.num_beams > 1:
        if streamer is not None:
            raise ValueError("a streamer shows one sequence as it grows; beam search changes its sequences, so it "
                             "cannot stream (as in transformers)")
        out = beam_search(model, input_ids, mask, decoding, stop, num_microbatches)
    elif path != "eager":
        out = static_sample(model, *_copies(input_ids, mask, decoding), decoding, stop, streamer, path)
    else:
        out = _sample(model, *_copies(input_ids, mask, decoding), decoding, stop, streamer, num_microbatches)
    if decoding.return_dict_in_generate:
        out.decode_note = decode_note(model, path, why)
    return out


def _copies(input_ids, mask, decoding: Decoding):
    """Each prompt num_return_sequences times (sampling: each copy draws its own tokens)."""
    n = decoding.num_return_sequences
    return (input_ids, mask) if n == 1 else (input_ids.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0))


def _sample(model, input_ids, mask, decoding: Decoding, stop, streamer, num_microbatches):
    """Greedy or sampled decoding, one token per step, until every sequence ended or max_length."""
    parallel = model.parallel
    batch, prompt = input_ids.shape
    steps = DecodeSteps(model, mask, decoding.max_length, num_microbatches, decoding.use_cache)
    generator = None
    if decoding.do_sample:  # greedy decoding draws nothing: training's random state stays as it was
        generator = torch.Generator(device=parallel.device)
        generator.manual_seed(decoding.seed if decoding.seed is not None else shared_seed(parallel))
    keep_scores = decoding.return_dict_in_generate and decoding.output_scores
    keep_logits = decoding.return_dict_in_generate and decoding.output_logits
    # greedy and nothing else wanted: each vocab slice's best logit is enough, not the gathered logits
    sharded_argmax = parallel.tp_size > 1 and not decoding.processes_scores and not (keep_scores or keep_logits)
    wanted = LogitsRequest("vocab_slice" if sharded_argmax else "full", keep=1)
    embedding = token_embedding(model) if sharded_argmax else None
    sequences, unfinished = input_ids, torch.ones(batch, dtype=torch.bool, device=parallel.device)
    padding = (mask != 0).int().argmax(dim=1)  # left padding, which the repetition penalty leaves out
    eos = eos_ids(decoding, parallel.device)
    rows = None  # the embedding rows of the newest tokens, gathered with them: the step's embedding needs no all-reduce
    scores, raw_logits = [], []
    timings = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0}
    if streamer is not None:
        streamer.put(input_ids.cpu())
    while sequences.shape[1] < decoding.max_length:
        started = time.perf_counter()
        logits = steps.logits(sequences, wanted, token_rows=rows)
        tokens, rows = None, None
        if parallel.is_last_stage and sharded_argmax:
            tokens, rows = vocab_parallel_argmax(logits, model.config.vocab_size, parallel.tp_group, embedding)
        elif parallel.is_last_stage:
            processed = process(logits, sequences, decoding, padding, eos)
            tokens = choose(processed, decoding, generator)
            scores += [processed] if keep_scores else []
            raw_logits += [logits.float()] if keep_logits else []
        tokens = from_last_stage(model, tokens, (batch,))
        if rows is not None and decoding.eos_token_id is not None and not bool(unfinished.all()):
            rows = None  # a finished row continues with the pad token, not the token chosen for it
        tokens, unfinished = finish(tokens, unfinished, decoding, eos)
        sequences = torch.cat([sequences, tokens[:, None]], dim=1)
        steps.extend()
        if stop is not None:
            unfinished = unfinished & ~stop(sequences, None).to(unfinished.device)
        first = steps.steps == 1
        timings["prefill_s" if first else "decode_s"] += time.perf_counter() - started
        timings["decode_steps"] += not first
        if streamer is not None:
            streamer.put(tokens.cpu())
        if (decoding.eos_token_id is not None or stop is not None) and not unfinished.any():  # a sync only then
            break
    if streamer is not None:
        streamer.end()
    if not decoding.return_dict_in_generate:
        return sequences
    vocab = model.config.vocab_size
    return generate_output(sequences=sequences, scores=steps_from_last_stage(model, scores, keep_scores, batch, vocab),
                           logits=steps_from_last_stage(model, raw_logits, keep_logits, batch, vocab),
                           timings=dict(timings, batch=batch, prompt_tokens=prompt,
                                        new_tokens=sequences.shape[1] - prompt),
                           cache_elements=steps.cache.numel())
