"""`checksums.json`: the sha256 and size of every file of a checkpoint directory, written last, atomically, so that
what a checkpoint means (its indexes, meta.json, RNG states, config and tokenizer files) is checked as its tensors
are, not only the safetensors files.

    {"format": "colozoo-checksums/1", "files": {"colozoo_index.json": {"sha256": ..., "size": ...}, ...}}

The tensor files' digests are those their index records (computed as they were written): they are not read again
here, and reading a tensor file still checks it against its index, whose own digest is checked here. A directory
without checksums.json was written by an older colozoo: it loads, with a note that only its tensor files are checked.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from colozoo.core.errors import CheckpointError
from colozoo.core.files import fsync_write

CHECKSUMS = "checksums.json"
FORMAT = "colozoo-checksums/1"
INDEXES = ("colozoo_index.json", "training_index.json")  # their "files" hold the tensor files' digests
BLOCK = 1 << 20


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _tensor_digests(directory: Path) -> dict[str, str]:
    """{tensor file: sha256} as the directory's indexes record them."""
    known = {}
    for name in INDEXES:
        if (directory / name).is_file():
            for file, info in json.loads((directory / name).read_text()).get("files", {}).items():
                known[file] = info["sha256"]
    return known


def write_checksums(directory) -> Path:
    """checksums.json over every file of `directory` (not its subdirectories), written last and atomically."""
    directory = Path(directory)
    known = _tensor_digests(directory)
    files = {}
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.name != CHECKSUMS and not path.name.endswith(".partial"):
            files[path.name] = {"sha256": known.get(path.name) or file_sha256(path), "size": path.stat().st_size}
    target = directory / CHECKSUMS
    fsync_write(target, lambda f: f.write(json.dumps({"format": FORMAT, "files": files}, indent=1).encode()))
    return target


def read_checksums(directory: Path) -> dict | None:
    """{file: {"sha256", "size"}}, or None for a directory written before checksums were (an older colozoo)."""
    path = directory / CHECKSUMS
    if not path.is_file():
        return None
    try:
        table = json.loads(path.read_text())
        files = table["files"]
        if table.get("format") != FORMAT or not all(isinstance(v, dict) and isinstance(v.get("sha256"), str)
                                                     and type(v.get("size")) is int for v in files.values()):
            raise ValueError("not a colozoo checksums table")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path} is corrupted: {e}") from None
    return files


def verify_checksums(directory) -> str | None:
    """Check the files checksums.json lists: every one present with its size, and every one that is not a tensor
    file with its sha256 (the indexes first; tensor files are hashed when read, against their index). Raises
    CheckpointError naming the first file that differs; returns a note when there is no checksums.json."""
    directory = Path(directory)
    table = read_checksums(directory)
    if table is None:
        return (f"{directory} has no {CHECKSUMS} (saved by an older colozoo): its tensor files are checked, its "
                f"index and other files are not; saving it again adds the checksums")
    indexes = [name for name in INDEXES if name in table]
    for name in indexes:
        _check(directory / name, table[name], hash_it=True)
    tensor_files = {f for name in indexes for f in json.loads((directory / name).read_text()).get("files", {})}
    for name, expected in table.items():
        if name not in indexes:
            _check(directory / name, expected, hash_it=name not in tensor_files)
    return None


def _check(path: Path, expected: dict, hash_it: bool):
    if not path.is_file():
        raise CheckpointError(f"{path} is listed in {CHECKSUMS} but missing")
    if path.stat().st_size != expected["size"]:
        raise CheckpointError(f"checksum mismatch in {path}: {path.stat().st_size} bytes, {CHECKSUMS} says "
                              f"{expected['size']} (edited, truncated or corrupted since it was saved)")
    if hash_it and file_sha256(path) != expected["sha256"]:
        raise CheckpointError(f"checksum mismatch in {path}: its sha256 differs from the one {CHECKSUMS} recorded "
                              f"(edited or corrupted since it was saved)")
