"""GRPO's rollouts on the training mesh: the completions of a batch of prompts sampled with colozoo's own `generate`
on the same shards the update trains (no second copy of the weights), then scored by the reward functions.

Each data-parallel replica samples its rows of the global batch (each prompt repeated --num-generations times) in one
`generate` call through the sharded KV cache, with a seed drawn from the run's seed, the step and the replica, so its
tensor- and pipeline-parallel ranks draw the same tokens and a resumed run draws what the uninterrupted one drew.
Under dp > 1 every replica decodes the full --max-completion-length (generate's end-of-sequence stop is off, its
draws unchanged), so the replicas run as many forwards, which FSDP's collectives need. A completion ends at its first
end-of-sequence token (kept, as TRL keeps it); a completion without one reached the length and is "clipped".

The reward functions run once per replica (on its first tensor- and pipeline-parallel rank, on its rows), and every
rank gets every row's rewards, so a function that is not deterministic cannot make the ranks disagree.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from colozoo.finetune.data import IGNORE_INDEX
from colozoo.finetune.grpo_data import PromptData, reward_columns
from colozoo.finetune.preference_data import is_conversation
from colozoo.finetune.rewards import RewardError, RewardFunctions
from colozoo.runtime.decode_steps import generation_positions
from colozoo.runtime.step import dp_rows


def end_of_sequence_ids(tokenizer, model) -> list[int]:
    """TRL's eos_token_ids: the tokenizer's EOS, then the model's generation config's."""
    config = getattr(model, "generation_config", None)
    ids = getattr(config, "eos_token_id", None) if config is not None else None
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids = [tokenizer.eos_token_id, *ids]
    return ids


def rollout_seed(seed: int, step: int, replica: int, stream: int = 0) -> int:
    """The sampler's seed of `step` on data-parallel `replica` (stream 1: evaluations), a function of the run's
    seed alone: nothing to save, the same after a resume."""
    return ((seed * 1_000_003 + step) * 1_009 + replica) * 2 + stream


@dataclass
class Completions:
    """A global batch of sampled completions: the prompt (dataset index) and token ids of each row."""
    indices: torch.Tensor                # (rows,) the prompt of each row
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]      # up to and including the first end-of-sequence token
    truncated: torch.Tensor              # (rows,) bool: reached the length without one

    @property
    def lengths(self) -> torch.Tensor:
        return torch.tensor([len(c) for c in self.completion_ids])


def left_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r, dtype=torch.long), 1
    return ids, mask


def cut_at_end(tokens: list[int], eos: list[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


def decodes_whole_length(parallel) -> bool:
    """Whether generation must run the whole --max-completion-length: under dp > 1 every replica must run as many
    forwards (FSDP gathers the weights in each, DDP syncs its buffers), whatever its sequences sampled."""
    return parallel.size("dp") > 1


def sample(model, data: PromptData, indices: torch.Tensor, cfg, eos: list[int], pad: int, seed: int) -> Completions:
    """Every replica samples --num-generations completions of each of its prompts; every rank gets all of them."""
    parallel = model.parallel
    rows = indices.repeat_interleave(cfg.num_generations)
    prompts = [data.prompt_ids(int(i)) for i in rows]
    mine = dp_rows(model, len(prompts))
    ids, mask = left_padded(prompts[mine], pad)
    whole = decodes_whole_length(parallel) or not eos
    out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p,
                         top_k=0, repetition_penalty=1.0, min_length=0, max_new_tokens=cfg.max_completion_length,
                         eos_token_id=None if whole else list(eos), pad_token_id=pad, seed=seed)
    local = [cut_at_end(row[ids.shape[1]:].tolist(), eos) for row in out.cpu()]
    completions = _all_rows(model, local)
    finished = set(eos) | {pad}
    truncated = torch.tensor([c[-1] not in finished for c in completions])
    return Completions(rows, prompts, completions, truncated)


def _all_rows(model, local: list) -> list:
    """The rows of every replica in global order (each replica holds its contiguous block)."""
    parallel = model.parallel
    if parallel.size("dp") == 1:
        return local
    parts = [None] * parallel.size("dp")
    dist.all_gather_object(parts, local, group=parallel.group("dp"))
    return [row for part in parts for row in part]


def decoded(data: PromptData, completions: Completions, tokenizer) -> tuple[list, list]:
    """(the rows' prompts as the records give them, the completions as text, or as an assistant message where the
    prompt is a conversation), as TRL hands them to the reward functions."""
    prompts = [data.prompts[int(i)] for i in completions.indices]
    texts = tokenizer.batch_decode(completions.completion_ids, skip_special_tokens=True)
    conversational = is_conversation(prompts[0])
    return prompts, [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts


def score(model, data: PromptData, completions: Completions, tokenizer, rewards: RewardFunctions, step: int,
          total_steps: int) -> tuple[torch.Tensor, dict, dict]:
    """(rewards (rows, functions), the metrics the functions logged, the columns they added) of every row on every
    rank: each replica's first rank scores the replica's rows, every rank gets them all."""
    parallel = model.parallel
    prompts, texts = decoded(data, completions, tokenizer)
    mine = dp_rows(model, len(texts))
    leader = parallel.rank("tp") == 0 and parallel.rank("pp") == 0
    outcome = None
    if leader:
        rows = completions.indices[mine].tolist()
        try:
            outcome = rewards(prompts[mine], texts[mine], completions.completion_ids[mine],
                              reward_columns(data, rows), step, total_steps)
        except RewardError as e:
            outcome = str(e)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (parallel.rank("dp"), outcome) if leader else None)
        parts = dict(item for item in every if item is not None)
        outcomes = [parts[r] for r in range(parallel.size("dp"))]
    else:
        outcomes = [outcome]
    failed = next((o for o in outcomes if isinstance(o, str)), None)
    if failed is not None:
        raise RewardError(failed)
    values = torch.cat([o[0] for o in outcomes])
    metrics = {k: sum(o[1][k] for o in outcomes if k in o[1]) / sum(k in o[1] for o in outcomes)
               for o in outcomes for k in o[1]}
    columns = {k: [v for o in outcomes for v in o[2].get(k, [None] * len(o[0]))] for o in outcomes for k in o[2]}
    return values, metrics, columns


def training_rows(completions: Completions, pad: int, mask_truncated: bool) -> dict[str, torch.Tensor]:
    """The rows the update trains on: each prompt left-padded to the batch's longest, then its completion
    right-padded, with generate's positions (left padding at 1) and labels on the completion tokens (none for a
    clipped completion under --mask-truncated-completions)."""
    prompt_ids, prompt_mask = left_padded(completions.prompt_ids, pad)
    width = max(len(c) for c in completions.completion_ids)
    ids = torch.full((len(completions.completion_ids), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, c in enumerate(completions.completion_ids):
        ids[i, :len(c)], mask[i, :len(c)] = torch.tensor(c, dtype=torch.long), 1
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    if mask_truncated:
        labels[completions.truncated] = IGNORE_INDEX
    attention = torch.cat([prompt_mask, mask], dim=1)
    return {"input_ids": torch.cat([prompt_ids, ids], dim=1), "attention_mask": attention,
            "position_ids": generation_positions(attention),
            "labels": torch.cat([torch.full_like(prompt_ids, IGNORE_INDEX), labels], dim=1)}
