"""Supervised fine-tuning data (--chat): conversations rendered with the tokenizer's chat template and trained on
the assistant's tokens only, prompt/completion pairs trained on the completion, plain texts trained on everything;
packed several samples to a sequence with position_ids restarting at each sample, or padded one per row.

The assistant spans come from rendering prefixes of the conversation: the text up to assistant turn i with the
generation prompt, and up to the end of turn i, must both be prefixes of the whole rendering (a template that
renders earlier turns differently once later ones exist is refused). The text is tokenized segment by segment at
those cuts, so a span is exactly the tokens the model generates after the prompt it sees at inference.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from colozoo.finetune.data import CHUNK_RECORDS, IGNORE_INDEX, TensorData, chunks, collect, pad_id, pad_rows
from colozoo.finetune.records import DataError, apply_chat_template, located_records

ROLES = ("system", "user", "assistant", "tool")


def _check_messages(messages, where: str):
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: message {i} is {m!r}, not an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {i} has role {m['role']!r}; roles are {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise DataError(f"{where}: message {i} has content {m['content']!r}, not a string")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant turn, so nothing to train on")


def check_sft_record(record, where: str, text_field: str = "text"):
    """A JSON object with `messages`, or `prompt` and `completion` strings, or a `text_field` string."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a JSON {type(record).__name__}, not an object with 'messages', "
                        f"'prompt'/'completion' or {text_field!r}")
    if "messages" in record:
        return _check_messages(record["messages"], where)
    if "prompt" in record or "completion" in record:
        for name in ("prompt", "completion"):
            if not isinstance(record.get(name), str):
                raise DataError(f"{where}: field {name!r} is {record.get(name)!r}, not a string (a prompt/completion "
                                f"record needs both)")
        return
    if text_field not in record:
        raise DataError(f"{where}: no field 'messages', 'prompt'/'completion' or {text_field!r}; the record's fields "
                        f"are {list(record)}")
    if not isinstance(record[text_field], str):
        raise DataError(f"{where}: field {text_field!r} is {record[text_field]!r}, not a string")


def chat_segments(messages: list[dict], tokenizer, where: str = "") -> list[tuple[str, bool]]:
    """The rendered conversation cut into (text, trained) segments: trained are the assistant turns."""
    def render(part, generation_prompt=False):
        return apply_chat_template(tokenizer, part, where, "prompt/completion records", tokenize=False,
                                   add_generation_prompt=generation_prompt)

    full = render(messages)
    segments, done = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt, turn = render(messages[:i], generation_prompt=True), render(messages[: i + 1])
        if not (turn.startswith(prompt) and full.startswith(turn) and len(prompt) >= done):
            raise DataError(f"{where}: the chat template does not render the conversation up to assistant turn {i} "
                            f"as a prefix of the whole, so its tokens cannot be told apart from the prompt's")
        segments += [(full[done:len(prompt)], False), (full[len(prompt):len(turn)], True)]
        done = len(turn)
    segments.append((full[done:], False))
    return [(text, trained) for text, trained in segments if text]


def tokenize_segments(record: dict, tokenizer, where: str = "", text_field: str = "text") -> list[tuple[list, bool]]:
    """One record's (token ids, trained) segments: a conversation's prompts and assistant turns in order, a prompt
    and its completion, or one text."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if "messages" in record:
        return [(tokenizer(text, add_special_tokens=False)["input_ids"], trained)
                for text, trained in chat_segments(record["messages"], tokenizer, where)]
    if "prompt" in record:  # the prompt as the tokenizer encodes an inference prompt (with BOS where it adds one)
        return [(tokenizer(record["prompt"])["input_ids"], False),
                (tokenizer(record["completion"], add_special_tokens=False)["input_ids"] + eos, True)]
    return [(tokenizer(record[text_field], add_special_tokens=False)["input_ids"] + eos, True)]


def tokenize_sample(record: dict, tokenizer, where: str = "", text_field: str = "text") -> tuple[list, list]:
    """(token ids, whether each is trained on) of one record."""
    return _flatten(tokenize_segments(record, tokenizer, where, text_field))


def _flatten(segments) -> tuple[list, list]:
    return [t for seg, _ in segments for t in seg], [flag for seg, flag in segments for _ in seg]


TRUNCATION = ("turns", "tokens")
FITS = ("whole", "shortened", "cut", "dropped")  # what fit_sample did to a sample


def fit_sample(segments, seq_len: int, truncate: str = "turns") -> tuple[list, list, str]:
    """(ids, trained, how) of a sample within `seq_len` tokens. A longer sample keeps, under "turns", the whole
    segments up to the last answer that ends within seq_len ("shortened"; "dropped" when not even the first one
    does), so every answer it trains on ends with its end-of-turn token; a sample with no prompt (a plain text) is
    cut at seq_len ("cut"). Under "tokens" every longer sample is cut at seq_len ("cut"; "dropped" when no trained
    token is left)."""
    ids, trained = _flatten(segments)
    if len(ids) <= seq_len:
        return ids, trained, "whole"
    if truncate == "turns" and not all(flag for _, flag in segments):
        kept, used = 0, 0
        for i, (seg, flag) in enumerate(segments):
            used += len(seg)
            if used > seq_len:
                break
            kept = i + 1 if flag else kept
        if kept == 0:
            return [], [], "dropped"
        return (*_flatten(segments[:kept]), "shortened")
    ids, trained = ids[:seq_len], trained[:seq_len]
    return ids, trained, "cut" if any(trained[1:]) else "dropped"


def fit_note(stats: dict | None, path, seq_len: int) -> str | None:
    """A line on what fitting the samples of `path` into --seq-len did, when it did anything."""
    if not stats or not any(stats.get(k) for k in FITS[1:]):
        return None
    what = {"dropped": "dropped (not even the first answer fits)", "shortened": "shortened to the whole turns that fit",
            "cut": f"cut at {seq_len} tokens (their end left out)"}
    done = ", ".join(f"{stats[k]} {text}" for k, text in what.items() if stats.get(k))
    return f"--seq-len {seq_len}: of {stats['samples']} samples in {path}, {done}; a longer --seq-len keeps them"


def sample_labels(ids: list, trained: list) -> np.ndarray:
    """Labels of one sample: its trained tokens, -100 elsewhere and on its first token (which nothing in the
    sample predicts: packed, the previous sample's last token would)."""
    labels = np.where(np.asarray(trained, dtype=bool), np.asarray(ids, dtype=np.int64), IGNORE_INDEX)
    labels[:1] = IGNORE_INDEX
    return labels


def packed_rows(samples, seq_len: int) -> Iterator[list]:
    """Samples, each at most seq_len, grouped in order into rows: a sample that does not fit in what is left of a
    row starts the next."""
    row, used = [], 0
    for sample in samples:
        if used + len(sample[0]) > seq_len:
            yield row
            row, used = [], 0
        row.append(sample)
        used += len(sample[0])
    if row:
        yield row


def pack(samples: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad: int) -> dict[str, torch.Tensor]:
    """Samples (ids, labels), each at most seq_len, laid into rows of seq_len (packed_rows). position_ids restart
    at 0 for each sample; a row's padded tail is a document of its own (its positions restart too) with labels
    -100."""
    return pack_rows(list(packed_rows(samples, seq_len)), seq_len, pad)


def pack_rows(rows: list[list], seq_len: int, pad: int) -> dict[str, torch.Tensor]:
    input_ids = torch.full((len(rows), seq_len), pad, dtype=torch.long)
    labels = torch.full((len(rows), seq_len), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((len(rows), seq_len), dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for ids, lab in row:
            input_ids[r, at: at + len(ids)] = torch.from_numpy(ids)
            labels[r, at: at + len(ids)] = torch.from_numpy(lab)
            position_ids[r, at: at + len(ids)] = torch.arange(len(ids))
            at += len(ids)
        position_ids[r, at:] = torch.arange(seq_len - at)
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}


def sft_dataset(path, tokenizer, seq_len: int, pack_samples: bool = True, text_field: str = "text",
                truncate: str = "turns") -> TensorData:
    """Chat / prompt-completion / text records as training rows, each sample fitted into `seq_len` (fit_sample);
    `stats` counts the samples and what fitting did to them."""
    stats = {}
    data = collect(sft_blocks(path, tokenizer, seq_len, pack_samples, text_field, truncate, stats))
    data.stats = stats
    return data


def sft_blocks(path, tokenizer, seq_len: int, pack_samples: bool = True, text_field: str = "text",
               truncate: str = "turns", stats: dict | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """sft_dataset's rows, CHUNK_RECORDS rows at a time (memory stays bounded by the chunk, not the dataset);
    `stats`, once they are all read: {"samples": records read, and how many fit_sample left whole, shortened, cut
    or dropped}."""
    stats = stats if stats is not None else {}
    stats.update({"samples": 0, **{k: 0 for k in FITS}})

    def samples():
        for where, record in located_records(path, lambda record, where: check_sft_record(record, where, text_field)):
            ids, trained, how = fit_sample(tokenize_segments(record, tokenizer, where, text_field), seq_len, truncate)
            stats["samples"] += 1
            labels = sample_labels(ids, trained) if how != "dropped" else None
            if labels is None or (labels == IGNORE_INDEX).all():
                stats["dropped"] += 1
                continue
            stats[how] += 1
            yield np.asarray(ids, dtype=np.int64), labels

    pad = pad_id(tokenizer)
    rows = packed_rows(samples(), seq_len) if pack_samples else samples()
    empty = True
    for chunk in chunks(rows, CHUNK_RECORDS):
        empty = False
        yield pack_rows(chunk, seq_len, pad) if pack_samples else pad_rows(chunk, seq_len, pad)
    if empty:
        raise DataError(f"dataset {path}: none of its {stats['samples']} samples keeps a trained token within "
                        f"--seq-len {seq_len} (not even the first answer fits); raise --seq-len")
