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
from colozoo.finetune.records import DataError, located_records

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
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: a 'messages' record needs a tokenizer with a chat template, and this one has none "
                        f"(set tokenizer.chat_template, or use prompt/completion records)")

    def render(part, generation_prompt=False):
        try:
            return tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # noqa: BLE001 - jinja raises anything the template says (raise_exception)
            raise DataError(f"{where}: the chat template fails on this conversation: {e}") from None

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


def tokenize_sample(record: dict, tokenizer, where: str = "", text_field: str = "text") -> tuple[list, list]:
    """(token ids, whether each is trained on) of one record."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if "messages" in record:
        segments = [(tokenizer(text, add_special_tokens=False)["input_ids"], trained)
                    for text, trained in chat_segments(record["messages"], tokenizer, where)]
    elif "prompt" in record:  # the prompt as the tokenizer encodes an inference prompt (with BOS where it adds one)
        segments = [(tokenizer(record["prompt"])["input_ids"], False),
                    (tokenizer(record["completion"], add_special_tokens=False)["input_ids"] + eos, True)]
    else:
        segments = [(tokenizer(record[text_field], add_special_tokens=False)["input_ids"] + eos, True)]
    ids = [t for seg, _ in segments for t in seg]
    trained = [flag for seg, flag in segments for _ in seg]
    return ids, trained


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


def sft_dataset(path, tokenizer, seq_len: int, pack_samples: bool = True, text_field: str = "text") -> TensorData:
    """Chat / prompt-completion / text records as training rows. A sample longer than `seq_len` is truncated (its
    end dropped: the continuation of a cut conversation would lack its prompt); one left with no trained token is
    skipped."""
    return collect(sft_blocks(path, tokenizer, seq_len, pack_samples, text_field))


def sft_blocks(path, tokenizer, seq_len: int, pack_samples: bool = True, text_field: str = "text"
               ) -> Iterator[dict[str, torch.Tensor]]:
    """sft_dataset's rows, CHUNK_RECORDS rows at a time (memory stays bounded by the chunk, not the dataset)."""
    skipped = [0]

    def samples():
        for where, record in located_records(path, lambda record, where: check_sft_record(record, where, text_field)):
            ids, trained = tokenize_sample(record, tokenizer, where, text_field)
            ids, trained = ids[:seq_len], trained[:seq_len]
            labels = sample_labels(ids, trained)
            if (labels == IGNORE_INDEX).all():
                skipped[0] += 1
                continue
            yield np.asarray(ids, dtype=np.int64), labels

    pad = pad_id(tokenizer)
    rows = packed_rows(samples(), seq_len) if pack_samples else samples()
    empty = True
    for chunk in chunks(rows, CHUNK_RECORDS):
        empty = False
        yield pack_rows(chunk, seq_len, pad) if pack_samples else pad_rows(chunk, seq_len, pad)
    if empty:
        raise DataError(f"dataset {path}: no sample keeps a trained token within --seq-len {seq_len} "
                        f"({skipped[0]} skipped)")
