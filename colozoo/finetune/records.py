"""Reading training records one at a time: JSON lines, plain text, Parquet, Arrow files and Hugging Face `datasets`
directories (`save_to_disk`). Arrow and Parquet are read lazily, one record batch at a time from memory-mapped files,
so a dataset larger than memory streams through; every bad record is one error naming its file and line or row.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

ARROW_SUFFIXES = (".parquet", ".arrow")
BATCH_ROWS = 1024


class DataError(ValueError):
    """Data that cannot be trained on: missing, empty, malformed, or not matching the model."""


def existing(path) -> Path:
    path = Path(path)
    if not path.exists():
        raise DataError(f"dataset {path} does not exist")
    return path


HEAD_BYTES = 1 << 16  # what check_data_path reads of a text file to tell an empty one


def check_data_path(path, records: bool = True):
    """What needs no tokenizer and no model: `path` exists and, for a text file, holds more than whitespace (judged on
    its first HEAD_BYTES); `records`: a directory must be a datasets directory (else a folder of images)."""
    path = existing(path)
    if path.is_dir():
        if records:
            dataset_files(path)
        return
    size = path.stat().st_size
    if size == 0 or size <= HEAD_BYTES and path.suffix not in ARROW_SUFFIXES and not path.read_bytes().strip():
        raise DataError(f"dataset {path} is empty")


def iter_records(path, check) -> Iterator[dict]:
    """Every record of `path`, each passed to `check(record, where)` first."""
    return (record for _, record in located_records(path, check))


def located_records(path, check) -> Iterator[tuple[str, dict]]:
    """(where, record) for every record of `path` (where: "FILE:LINE" or "FILE: row N"), checked by `check`."""
    path = existing(path)
    if path.is_dir() or path.suffix in ARROW_SUFFIXES:
        rows = _arrow_records(path)
    else:
        rows = _text_records(path)
    empty = True
    for where, record in rows:
        check(record, where)
        empty = False
        yield where, record
    if empty:
        raise DataError(f"dataset {path} is empty")


def utf8_text(raw: bytes, path) -> str:
    """The text of a file's bytes, or one line naming the file, the line and the first byte that is not UTF-8 (a
    Latin-1 file's é is 0xE9); a line holding NUL bytes is called binary data."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line_start, line_end = raw.rfind(b"\n", 0, e.start) + 1, raw.find(b"\n", e.start)
        line = raw[:e.start].count(b"\n") + 1
        if b"\x00" in raw[line_start:line_end if line_end >= 0 else len(raw)]:
            raise DataError(f"{path}:{line}: binary data, not UTF-8 text") from None
        raise DataError(f"{path}:{line}: not UTF-8 (byte 0x{raw[e.start]:02X} at line {line}, column "
                        f"{e.start - line_start + 1}): save the file as UTF-8") from None


def _text_records(path: Path):
    text = utf8_text(path.read_bytes(), path)
    if "\x00" in text:
        line = text[:text.index("\x00")].count("\n") + 1
        raise DataError(f"{path}:{line}: binary data (a NUL byte), not text")
    if path.suffix == ".txt":
        for doc in text.split("\n\n"):
            if doc.strip():
                yield f"{path}", {"text": doc.strip()}
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{lineno}", json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None


def _pyarrow():
    try:
        import pyarrow  # noqa: F401
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DataError("reading Parquet / Arrow / datasets directories needs pyarrow: pip install pyarrow") from None
    return pyarrow


def dataset_files(path: Path) -> list[Path]:
    """The Arrow files of a `datasets` save_to_disk directory (a DatasetDict: its "train" split), in order."""
    if (path / "dataset_dict.json").exists():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        if "train" not in splits:
            raise DataError(f"{path} is a DatasetDict without a 'train' split (splits: {splits}); pass the "
                            f"directory of one split, e.g. {path / (splits[0] if splits else 'train')}")
        path = path / "train"
    state = path / "state.json"
    if state.exists():
        return [path / f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
    files = sorted(p for p in path.iterdir() if p.suffix in ARROW_SUFFIXES)
    if not files:
        raise DataError(f"dataset {path} is a directory without a datasets state.json or .parquet / .arrow files; "
                        f"expected a .jsonl / .txt / .parquet / .arrow file or a datasets save_to_disk directory")
    return files


def _batches(file: Path):
    pa = _pyarrow()
    try:
        if file.suffix == ".parquet":
            # one thread: parallel decoding reads row groups ahead, holding several at once
            yield from pa.parquet.ParquetFile(file, memory_map=True).iter_batches(batch_size=BATCH_ROWS,
                                                                                  use_threads=False)
            return
        source = pa.memory_map(str(file))
        try:
            reader = pa.ipc.open_file(source)  # the Arrow IPC file format (random access)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)
        except pa.ArrowInvalid:
            source.seek(0)
            yield from pa.ipc.open_stream(source)  # the streaming format, as datasets writes it
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{file}: not a readable {file.suffix[1:]} file ({e})") from None


def _arrow_records(path: Path):
    for file in dataset_files(path) if path.is_dir() else [path]:
        row = 0
        for batch in _batches(file):
            for record in batch.to_pylist():
                yield f"{file}: row {row}", record
                row += 1


def apply_chat_template(tokenizer, messages: list, where: str, instead: str, **options):
    """tokenizer.apply_chat_template(messages, **options); a tokenizer without a chat template, or a template that
    fails on the conversation, is a DataError naming `where` (`instead`: the records that need no template)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: a conversation needs a tokenizer with a chat template, and this one has none (set "
                        f"tokenizer.chat_template, or use {instead})")
    try:
        return tokenizer.apply_chat_template(messages, **options)
    except Exception as e:  # noqa: BLE001 - jinja raises anything the template says (raise_exception)
        raise DataError(f"{where}: the chat template fails on this conversation: {e}") from None
