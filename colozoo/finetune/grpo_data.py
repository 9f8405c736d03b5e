"""Prompt data as TRL's GRPOTrainer takes it: records with a `prompt`, a string or a conversation (a list of
{role, content} messages, rendered with the tokenizer's chat template and its generation prompt); every other column
of a record goes to the reward functions (e.g. the reference answer). `.jsonl`, Parquet, Arrow and `datasets`
directories, as for the other methods; the prompts are held in memory.

Tokenized as GRPOTrainer does (a string with the tokenizer's special tokens, a conversation with
apply_chat_template(add_generation_prompt=True)); --max-prompt-length keeps the end of a longer prompt, counted. A
prompt that leaves no room for --max-completion-length new tokens within the model's positions is refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from colozoo.finetune.data import TensorData, holdout_cut, pad_id
from colozoo.finetune.preference_data import ROLES, is_conversation
from colozoo.finetune.records import DataError, apply_chat_template, located_records

NOT_COLUMNS = ("prompt", "completion", "completion_ids")  # what TRL does not pass on to the reward functions


def check_prompt_record(record, where: str):
    """A JSON object whose `prompt` is a non-empty string or a list of messages with a known role and string
    content."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a JSON {type(record).__name__}, not an object with a 'prompt'")
    if "prompt" not in record:
        raise DataError(f"{where}: no field 'prompt'; --method grpo samples completions of each record's 'prompt' "
                        f"(a string or a list of messages); the record's fields are {list(record)}")
    prompt = record["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: the prompt is empty")
        return
    if not isinstance(prompt, list) or not prompt:
        raise DataError(f"{where}: field 'prompt' is {prompt!r}, not a string or a non-empty list of messages")
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: prompt message {i} is {m!r}, not an object with a 'role' ({', '.join(ROLES)}) "
                            f"and a string 'content'")


def tokenize_prompt(prompt, tokenizer, where: str) -> list[int]:
    if not is_conversation(prompt):
        return tokenizer(text=prompt)["input_ids"]
    return apply_chat_template(tokenizer, prompt, where, "string prompts", add_generation_prompt=True, tokenize=True,
                               return_dict=True)["input_ids"]


@dataclass
class PromptData(TensorData):
    """Tokenized prompts (`input_ids` right-padded, `attention_mask`) with the records' prompts as given and their
    other columns, indexed together."""
    prompts: list = field(default_factory=list)
    columns: list[dict] = field(default_factory=list)

    def prompt_ids(self, index: int) -> list[int]:
        return self.tensors["input_ids"][index][self.tensors["attention_mask"][index].bool()].tolist()

    def split(self, fraction: float) -> tuple["PromptData", "PromptData"]:
        cut = holdout_cut(len(self), fraction)
        return self._part(slice(None, cut)), self._part(slice(cut, None))

    def _part(self, rows: slice) -> "PromptData":
        return PromptData({k: v[rows] for k, v in self.tensors.items()}, self.tokens[rows], stats=self.stats,
                          prompts=self.prompts[rows], columns=self.columns[rows])


def prompt_dataset(path, tokenizer, max_completion_length: int, max_prompt_length: int | None = None,
                   positions: int | None = None) -> PromptData:
    """Every record of `path` as a tokenized prompt; `positions`: the model's maximum positions, which prompt +
    --max-completion-length must fit."""
    stats = {"prompts": 0, "prompt_cut": 0}
    prompts, columns, tokenized = [], [], []
    for where, record in located_records(path, check_prompt_record):
        ids = tokenize_prompt(record["prompt"], tokenizer, where)
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            ids, stats["prompt_cut"] = ids[len(ids) - max_prompt_length:], stats["prompt_cut"] + 1
        if not ids:
            raise DataError(f"{where}: the prompt is empty once tokenized, so nothing predicts the first new token")
        if positions is not None and len(ids) + max_completion_length > positions:
            raise DataError(f"{where}: the prompt is {len(ids)} tokens; with --max-completion-length "
                            f"{max_completion_length} it passes the model's maximum positions ({positions}): lower "
                            f"--max-completion-length or pass --max-prompt-length")
        stats["prompts"] += 1
        prompts.append(record["prompt"])
        columns.append({k: v for k, v in record.items() if k not in NOT_COLUMNS})
        tokenized.append(ids)
    width = max(len(ids) for ids in tokenized)
    padded = torch.full((len(tokenized), width), pad_id(tokenizer), dtype=torch.long)
    mask = torch.zeros_like(padded)
    for i, ids in enumerate(tokenized):
        padded[i, :len(ids)], mask[i, :len(ids)] = torch.tensor(ids, dtype=torch.long), 1
    return PromptData({"input_ids": padded, "attention_mask": mask}, torch.zeros(len(tokenized), dtype=torch.long),
                      stats=stats, prompts=prompts, columns=columns)


def fit_note(stats: dict | None, path, max_prompt_length: int | None) -> str | None:
    if not stats or not stats.get("prompt_cut"):
        return None
    return (f"of {stats['prompts']} prompts in {path}: {stats['prompt_cut']} cut to their last --max-prompt-length "
            f"{max_prompt_length} tokens")


def reward_columns(data: PromptData, indices) -> dict[str, list]:
    """The other columns of the records at `indices`, each as a list over them (None where a record lacks it)."""
    keys = []
    for i in indices:
        keys += [k for k in data.columns[i] if k not in keys]
    return {k: [data.columns[i].get(k) for i in indices] for k in keys}
