"""Preference data as TRL's DPOTrainer takes it: records with `prompt`, `chosen` and `rejected`, either strings or
conversations (lists of {role, content} messages rendered with the tokenizer's chat template); conversations in
`chosen` / `rejected` alone share an implicit prompt (their common leading messages, TRL's `extract_prompt`).

Tokenized as DPOTrainer does: a string completion gets the EOS text appended (unless it ends with it), the prompt
and prompt + completion are tokenized whole (a conversation with the chat template, the prompt with the generation
prompt), and the completion starts where the tokenized prompt and prompt + completion first differ.
`--max-prompt-length` keeps the end of a longer prompt; `--max-length` then cuts prompt + completion at that many
tokens (TRL's truncation_mode "keep_start"); both are counted. A prompt that leaves no completion token within
--max-length is refused (DPOTrainer drops such pairs silently). A pair is stored as two rows, chosen then rejected,
right-padded to `--max-length`; the labels are the completion's tokens (-100 over the prompt and the padding). A step
packs each pair into one row (pack_pairs) or lays its two rows side by side (pair_rows).
"""
from __future__ import annotations

import json

import torch

from colozoo.finetune.data import IGNORE_INDEX, TensorData, pad_id
from colozoo.finetune.records import DataError, apply_chat_template, located_records

ROLES = ("system", "user", "assistant", "tool")
FITS = ("prompt_cut", "chosen_cut", "rejected_cut")  # what fitting did, counted per pair


def is_conversation(value) -> bool:
    """TRL's is_conversational: a list whose first item is a message (a dict with a role)."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def check_preference_record(record, where: str):
    """A JSON object with `chosen` and `rejected` (strings or conversations) and, unless the conversations share it,
    a `prompt` of the same kind; no completion empty, roles alternating."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a JSON {type(record).__name__}, not an object with 'prompt', 'chosen' and "
                        f"'rejected'")
    for name in ("chosen", "rejected"):
        if name not in record:
            raise DataError(f"{where}: no field {name!r}; a preference record has 'chosen' and 'rejected' (and "
                            f"'prompt', unless the conversations share it); the record's fields are {list(record)}")
        if not isinstance(record[name], (str, list)):
            raise DataError(f"{where}: field {name!r} is {record[name]!r}, not a string or a list of messages")
    if not isinstance(record.get("prompt", ""), (str, list, type(None))):
        raise DataError(f"{where}: field 'prompt' is {record['prompt']!r}, not a string or a list of messages")
    prompt, chosen, rejected = split_prompt(record)
    for name, completion in (("chosen", chosen), ("rejected", rejected)):
        if not completion or isinstance(completion, str) and not completion.strip():
            raise DataError(f"{where}: the {name} completion is empty: nothing to prefer")
    if is_conversation(record["chosen"]):
        for name, completion in (("chosen", chosen), ("rejected", rejected)):
            check_turns(list(prompt) + list(completion), len(prompt), f"{where}: {name!r}")
    elif not isinstance(prompt, str) or not all(isinstance(c, str) for c in (chosen, rejected)):
        raise DataError(f"{where}: 'prompt', 'chosen' and 'rejected' must all be strings or all conversations")


def check_turns(messages: list, prompt_turns: int, where: str):
    """Messages with a role and string content; a system message only first; roles alternating (no two turns of one
    role in a row); the completion made of assistant turns after a prompt that does not end with one."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: message {i} is {m!r}, not an object with a 'role' and a string 'content'")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {i} has role {m['role']!r}; roles are {', '.join(ROLES)}")
        if m["role"] == "system" and i > 0:
            raise DataError(f"{where}: message {i} is a system message after the first")
        if i and m["role"] == messages[i - 1]["role"]:
            raise DataError(f"{where}: the roles do not alternate: messages {i - 1} and {i} are both "
                            f"{m['role']!r} turns")
    if prompt_turns == 0 or messages[prompt_turns]["role"] != "assistant":
        raise DataError(f"{where}: the completion must be the assistant's answer to a prompt, but it starts with a "
                        f"{messages[prompt_turns]['role']!r} message{' and has no prompt' if not prompt_turns else ''}")


def split_prompt(record: dict):
    """(prompt, chosen, rejected): the record's prompt when it is of the completions' kind, else the completions'
    common beginning (TRL's maybe_extract_prompt / extract_prompt)."""
    chosen, rejected = record["chosen"], record["rejected"]
    prompt = record.get("prompt")  # None: absent (a Parquet / Arrow column fills a missing field with null)
    if prompt is not None and is_conversation(prompt) == is_conversation(chosen):
        return prompt, chosen, rejected
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":  # the space before a string completion stays with it
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def common_prefix_length(ids: list, other: list) -> int:
    n = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        n += 1
    return n


def tokenize_pair(record: dict, tokenizer, where: str = "") -> tuple[list, list, list]:
    """(prompt ids, chosen ids, rejected ids) as DPOTrainer tokenizes the record."""
    prompt, chosen, rejected = split_prompt(record)
    if is_conversation(chosen):
        tools = record.get("tools")
        options = {"tools": json.loads(tools) if isinstance(tools, str) else tools,
                   **(record.get("chat_template_kwargs") or {})}

        def encode(messages, **extra):
            return apply_chat_template(tokenizer, messages, where, "string records", tokenize=True, return_dict=True,
                                       **options, **extra)["input_ids"]

        prompt_ids = encode(list(prompt), add_generation_prompt=True)
        with_chosen, with_rejected = encode(list(prompt) + list(chosen)), encode(list(prompt) + list(rejected))
    else:
        eos = tokenizer.eos_token or ""
        chosen, rejected = (c if c.endswith(eos) else c + eos for c in (chosen, rejected))
        prompt_ids = tokenizer(text=prompt)["input_ids"]
        with_chosen, with_rejected = (tokenizer(text=prompt + c)["input_ids"] for c in (chosen, rejected))
    cut = min(common_prefix_length(prompt_ids, with_chosen), common_prefix_length(prompt_ids, with_rejected))
    return prompt_ids[:cut], with_chosen[cut:], with_rejected[cut:]


def fit_pair(prompt: list, chosen: list, rejected: list, max_length: int, max_prompt_length: int | None,
             where: str) -> tuple[list, list, list, set]:
    """The pair within the lengths, and which of FITS happened: the prompt keeps its last `max_prompt_length`
    tokens, then each prompt + completion its first `max_length` (DPOTrainer's keep_start)."""
    done = set()
    if max_prompt_length is not None and len(prompt) > max_prompt_length:
        prompt, done = prompt[len(prompt) - max_prompt_length:], {"prompt_cut"}
    if not prompt:
        raise DataError(f"{where}: the prompt is empty once tokenized, so nothing predicts the completion's first "
                        f"token")
    if len(prompt) >= max_length:
        raise DataError(f"{where}: the prompt is {len(prompt)} tokens, not shorter than --max-length {max_length}, "
                        f"so no completion token is left (raise --max-length or pass --max-prompt-length)")
    room = max_length - len(prompt)
    for name, completion in (("chosen", chosen), ("rejected", rejected)):
        if len(completion) > room:
            done.add(f"{name}_cut")
    return prompt, chosen[:room], rejected[:room], done


def preference_dataset(path, tokenizer, max_length: int, max_prompt_length: int | None = None) -> TensorData:
    """Every record of `path` as a pair of rows (chosen, rejected) of `max_length` tokens: tensors `input_ids`,
    `attention_mask` and `labels` of shape (pairs, 2, max_length); `tokens` counts each pair's completion tokens;
    `stats` how many pairs there are and how many had their prompt or a completion cut."""
    stats = {"pairs": 0, **{k: 0 for k in FITS}}
    pairs = []
    for where, record in located_records(path, check_preference_record):
        prompt, *completions, done = fit_pair(*tokenize_pair(record, tokenizer, where), max_length,
                                              max_prompt_length, where)
        pairs.append((prompt, *completions))
        stats["pairs"] += 1
        for k in done:
            stats[k] += 1
    n, pad = len(pairs), pad_id(tokenizer)
    input_ids = torch.full((n, 2, max_length), pad, dtype=torch.long)
    labels = torch.full((n, 2, max_length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((n, 2, max_length), dtype=torch.long)
    for i, (prompt, *completions) in enumerate(pairs):
        for j, completion in enumerate(completions):
            ids = torch.tensor(prompt + completion, dtype=torch.long)
            input_ids[i, j, :len(ids)], mask[i, j, :len(ids)] = ids, 1
            labels[i, j, len(prompt):len(ids)] = ids[len(prompt):]
    data = TensorData({"input_ids": input_ids, "attention_mask": mask, "labels": labels},
                      (labels != IGNORE_INDEX).sum((1, 2)))
    data.stats = stats
    return data


def fit_note(stats: dict | None, path, max_length: int, max_prompt_length: int | None) -> str | None:
    """A line on what fitting the pairs of `path` into the lengths did, when it did anything."""
    if not stats or not any(stats.get(k) for k in FITS):
        return None
    what = {"prompt_cut": f"prompts cut to their last --max-prompt-length {max_prompt_length} tokens",
            "chosen_cut": f"chosen completions cut at --max-length {max_length}",
            "rejected_cut": f"rejected completions cut at --max-length {max_length}"}
    done = ", ".join(f"{stats[k]} {text}" for k, text in what.items() if stats.get(k))
    return f"of {stats['pairs']} pairs in {path}: {done}"


def pair_rows(batch: dict) -> dict:
    """A batch of pairs (pairs, 2, ...) as rows (2 * pairs, ...): the chosen sequence of each pair, then its rejected
    one, side by side, so that any split of the rows into equal even parts keeps every pair whole."""
    return {k: v.flatten(0, 1) for k, v in batch.items()}


def trim_to_longest(rows: dict, multiple: int = 8) -> dict:
    """Rows cut to their longest real sequence, rounded up to `multiple` (never past their width): the padding
    DPOTrainer's collator leaves (it pads to the batch's longest)."""
    width = rows["attention_mask"].shape[1]
    longest = int(rows["attention_mask"].sum(1).max())
    keep = min(width, -(-longest // multiple) * multiple)
    return {k: v[:, :keep] if v.dim() == 2 and v.shape[1] == width else v for k, v in rows.items()}


def pack_pairs(batch: dict, multiple: int = 8) -> dict:
    """A batch of pairs (pairs, 2, L) packed one pair per row without padding between them: prompt + chosen, then
    prompt + rejected, `position_ids` restarting at 0 at each (so neither attends to the other, transformers'
    packed-sequence convention), then padding (a document of its own, unlabelled) up to the longest pair rounded up to
    `multiple`; `split` is where each row's rejected sequence starts. Per-row values of the pairs ((pairs, 2): the
    reference log-probs) stay as they are."""
    lengths = batch["attention_mask"].sum(-1)  # (pairs, 2)
    longest = int(lengths.sum(1).max())
    width = min(2 * batch["input_ids"].shape[-1], -(-longest // multiple) * multiple)
    pairs = lengths.shape[0]
    input_ids = torch.zeros((pairs, width), dtype=torch.long, device=lengths.device)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    positions = torch.zeros_like(input_ids)
    for i, (chosen, rejected) in enumerate(lengths.tolist()):
        for j, (start, n) in enumerate(((0, chosen), (chosen, rejected))):
            input_ids[i, start:start + n] = batch["input_ids"][i, j, :n]
            labels[i, start:start + n] = batch["labels"][i, j, :n]
            positions[i, start:start + n] = torch.arange(n)
        positions[i, chosen + rejected:] = torch.arange(width - chosen - rejected)
    packed = {"input_ids": input_ids, "position_ids": positions, "labels": labels, "split": lengths[:, 0]}
    return {**packed, **{k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "labels")}}


def sequence_sums(values: torch.Tensor, rows: dict) -> torch.Tensor:
    """Per-token `values` (rows, L) summed over each sequence, in pair order (chosen, rejected, chosen, ...): a row's
    sum where each row is one sequence, its two parts either side of `split` where a row packs a pair."""
    if "split" not in rows:
        return values.sum(1)
    chosen = torch.arange(values.shape[1], device=values.device) < rows["split"][:, None]
    return torch.stack([(values * chosen).sum(1), (values * ~chosen).sum(1)], 1).flatten()
