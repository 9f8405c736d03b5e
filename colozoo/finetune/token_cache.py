"""Token rows on disk: a causal LM's training rows tokenized once, streaming (a chunk of records at a time), into
memory-mapped files under OUTPUT/data-cache/, and read back by index one batch at a time, so a dataset larger
than memory trains.

A cache directory is named by a hash of what the rows depend on: the dataset files (path, size, modification
time), the tokenizer, --seq-len, packing, chat mode and the text field. A resumed run finds it and skips the
tokenizing; a changed dataset gets a new one (the stale one of the same role is removed). It is written to a
temporary directory and renamed, so an interrupted build leaves no half cache. Rows keep exactly the values and
order of the in-memory datasets (colozoo.finetune.data.lm_dataset, colozoo.finetune.sft.sft_dataset): labels are
stored as a trained-token mask, since a label is either its input token or -100.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from colozoo.finetune import sft
from colozoo.finetune.data import IGNORE_INDEX, holdout_cut, lm_blocks, trained_tokens
from colozoo.finetune.data_progress import TokenizingProgress
from colozoo.finetune.records import DataError, dataset_files, existing

FORMAT = 2  # 2: counts of what --chat fitting did, and a digest of the rows
STORED = {"input_ids": np.uint32, "attention_mask": np.uint8, "position_ids": np.uint32, "trained": np.uint8}


class RowValues:
    """One number per row (the trained tokens), read from disk: `values[indices]` is a tensor, as TensorData.tokens."""

    def __init__(self, values: np.ndarray, rows: range):
        self.values, self.rows = values, rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, indices) -> torch.Tensor:
        index = torch.as_tensor(indices, dtype=torch.long).numpy() + self.rows.start
        return torch.from_numpy(self.values[index].astype(np.int64))


class TokenCache:
    """The rows of a cache directory (or the `rows` range of them): TensorData's interface, read from disk."""

    def __init__(self, directory, rows: range | None = None):
        self.directory = Path(directory)
        meta = json.loads((self.directory / "meta.json").read_text())
        shape = (meta["rows"], meta["seq_len"])
        self.fields = meta["fields"]
        self.arrays = {name: np.memmap(self.directory / f"{name}.bin", dtype=STORED[name], mode="r", shape=shape)
                       for name in (*self.fields, "trained")}
        self.rows = rows if rows is not None else range(meta["rows"])
        self.tokens = RowValues(np.memmap(self.directory / "tokens.bin", dtype=np.int32, mode="r"), self.rows)
        self.label_names = None
        self.stats = meta.get("stats") or {}
        self.sha256 = meta.get("sha256")  # of every stored row, in order: what the rows are, not where they came from

    def __len__(self):
        return len(self.rows)

    def take(self, indices) -> dict[str, torch.Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long).numpy() + self.rows.start
        out = {name: torch.from_numpy(self.arrays[name][index].astype(np.int64)) for name in self.fields}
        trained = torch.from_numpy(self.arrays["trained"][index].astype(bool))
        out["labels"] = out["input_ids"].masked_fill(~trained, IGNORE_INDEX)
        return out

    def split(self, fraction: float) -> tuple["TokenCache", "TokenCache"]:
        """(head, tail) with the tail holding `fraction` of the rows, as TensorData.split."""
        cut, first = holdout_cut(len(self), fraction), self.rows.start
        return (TokenCache(self.directory, range(first, first + cut)),
                TokenCache(self.directory, range(first + cut, self.rows.stop)))


def fingerprint(path) -> list:
    """(name, size, modification time) of every file the dataset reads."""
    path = existing(path).resolve()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    if path.is_dir():
        dataset_files(path)  # a directory that is no dataset fails here, before anything is written
    return [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    specials = {k: getattr(tokenizer, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    text = json.dumps([type(tokenizer).__name__, vocab, getattr(tokenizer, "chat_template", None), specials],
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def cache_key(path, tokenizer, **options) -> str:
    text = json.dumps({"format": FORMAT, "files": fingerprint(path), "tokenizer": tokenizer_fingerprint(tokenizer),
                       **options}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def lm_rows(cfg, tokenizer, path, role: str) -> TokenCache:
    """A causal LM's rows (plain text or --chat) for the fine-tuning config `cfg`, from OUTPUT/data-cache."""
    from colozoo.core.mesh import init_distributed

    init_distributed()  # collective from here: one rank per machine tokenizes, the others wait for it
    stats = {}  # the records read; --chat: what fitting the samples into --seq-len did, kept with the rows
    if cfg.chat:
        blocks = lambda: sft.sft_blocks(path, tokenizer, cfg.seq_len, cfg.pack, cfg.text_field,  # noqa: E731
                                        cfg.truncate, stats)
        options = dict(truncate=cfg.truncate)
    else:
        blocks = lambda: lm_blocks(path, tokenizer, cfg.seq_len, cfg.pack, cfg.text_field, stats)  # noqa: E731
        options = {}
    data, _ = cached_rows(Path(cfg.output) / "data-cache", role, path, tokenizer, blocks, stats=stats,
                          progress=cfg.progress, seq_len=cfg.seq_len, pack=cfg.pack, chat=cfg.chat,
                          text_field=cfg.text_field, **options)
    return data


def cached_rows(root, role: str, path, tokenizer, blocks, stats: dict | None = None, progress: bool = False,
                **options) -> tuple[TokenCache, bool]:
    """(the cached rows of `path`, whether this call tokenized them). `blocks()` yields the rows (dicts of
    tensors, a chunk at a time) and fills `stats` (counts kept with them, TokenCache.stats: "samples", the records
    read so far, shown as `progress`); `options` are what else the rows depend on. Collective under
    torch.distributed: the first rank of each machine builds while the others wait, then every rank maps the files."""
    root, stats = Path(root), stats if stats is not None else {}
    target = root / f"{role}-{cache_key(path, tokenizer, **options)}"
    built, error = False, None
    if _local_rank() == 0 and not (target / "meta.json").exists():
        shown = TokenizingProgress(path, progress)
        try:
            rows, seq_len = _build(root, target, blocks(), stats, lambda: shown.update(stats.get("samples", 0)))
            shown.close(stats.get("samples"), rows, seq_len)
            built = True
        except DataError as e:
            error = str(e)
        except OSError as e:  # the cache lives in the output directory
            error = f"cannot write to the output directory {root.parent}: {e.strerror or e}"
        finally:
            shown.close()
    if dist.is_available() and dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)  # also the barrier the other ranks wait on
        error = next((e for e in errors if e), None)
    if error:
        raise DataError(error)
    return TokenCache(target), built


def _local_rank() -> int:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return int(os.environ.get("LOCAL_RANK", rank))


def _build(root: Path, target: Path, blocks, stats: dict | None = None, on_block=lambda: None) -> tuple[int, int]:
    """Tokenize into `target` (through a temp directory); returns (rows, seq_len). `on_block()` after each block."""
    created = [p for p in (root.parent, root) if not p.exists()]
    tmp = root / f".{target.name}.tmp-{os.getpid()}"
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        rows, fields, seq_len, digest = _write(tmp, blocks, on_block)
        (tmp / "meta.json").write_text(json.dumps({"format": FORMAT, "rows": rows, "seq_len": seq_len,
                                                   "fields": fields, "stats": stats or {}, "sha256": digest}))
        for stale in root.glob(f"{target.name.split('-')[0]}-*"):  # an earlier dataset's rows for this role
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:  # another machine's builder (shared output directory) got there first
            shutil.rmtree(tmp, ignore_errors=True)
        return rows, seq_len
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for directory in reversed(created):  # bad data leaves nothing behind
            if directory.exists() and not any(directory.iterdir()):
                directory.rmdir()
        raise


def _write(directory: Path, blocks, on_block=lambda: None) -> tuple[int, list[str], int, str]:
    """Writes the rows' files; returns (rows, fields, seq_len, the sha256 of everything written, in order)."""
    files, rows, fields, seq_len, digest = {}, 0, None, None, hashlib.sha256()
    try:
        for block in blocks:
            ids, labels = block["input_ids"], block["labels"]
            if fields is None:
                fields = [k for k in block if k != "labels"]
                seq_len = ids.shape[1]
                files = {name: open(directory / f"{name}.bin", "wb") for name in (*fields, "trained", "tokens")}
            trained = labels != IGNORE_INDEX
            if not bool((labels[trained] == ids[trained]).all()):
                raise AssertionError("a trained label differs from its input token: labels cannot be stored as a mask")
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= 2 ** 32):
                raise DataError(f"token ids outside 0 .. 2**32 - 1 ({int(ids.min())} .. {int(ids.max())})")
            for name in fields:
                stored = block[name].numpy().astype(STORED[name])
                stored.tofile(files[name])
                digest.update(stored.tobytes())
            mask = trained.numpy().astype(np.uint8)
            mask.tofile(files["trained"])
            digest.update(mask.tobytes())
            trained_tokens(labels).numpy().astype(np.int32).tofile(files["tokens"])
            rows += len(ids)
            on_block()
    finally:
        for f in files.values():
            f.close()
    return rows, fields, seq_len, digest.hexdigest()
