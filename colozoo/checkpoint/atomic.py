"""Atomic directory writes: everything goes to a temp dir beside the destination, is fsynced, and is renamed into
place only when complete, so a crash at any moment leaves either the old state or the new one.

A save over an existing model directory replaces it as transformers' save_pretrained does: the new weights, config
and side files, plus every other file the directory held (a user's notes, an adapter directory), never a stale shard
of the old weights."""
from __future__ import annotations

import glob
import os
import re
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path

# what a model save writes: files of these names are replaced, never carried over from the directory it overwrites
WEIGHT_FILES = re.compile(r"^(model|pytorch_model|adapter_model)(-\d+-of-\d+|-pp\d+-tp\d+-ep\d+)?\.(safetensors|bin)"
                          r"(\.index\.json)?$|^(config|generation_config|adapter_config|colozoo_index)\.json$")


def check_destination(dst: Path):
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"destination {dst} already exists and is not empty; choose a new path or remove it")


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host runs (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temp_dirs(dst: Path):
    """Remove temp dirs of writers to `dst` that died without cleaning up (SIGKILL, power loss): only those made on
    this host whose process is gone. A live writer's dir, or another host's (on a shared disk), is left alone."""
    host = socket.gethostname()
    for sibling in dst.parent.glob(f".{glob.escape(dst.name)}.tmp-*"):
        owner, _, pid = sibling.name.removeprefix(f".{dst.name}.tmp-").rpartition("-")
        if owner == host and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(sibling, ignore_errors=True)


@contextmanager
def atomic_directory(dst, replace: bool = False):
    """Yield a temp dir beside `dst`; on success it is fsynced and renamed to `dst`, on failure removed. `replace`:
    an existing `dst` is replaced as a model save replaces it (see `carry_over`) instead of refused."""
    dst = Path(dst)
    if not replace:
        check_destination(dst)
    elif dst.exists() and not dst.is_dir():
        raise FileExistsError(f"destination {dst} exists and is not a directory")
    if dst.parent.is_dir():
        remove_stale_temp_dirs(dst)
    tmp = dst.parent / f".{dst.name}.tmp-{socket.gethostname()}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        publish(tmp, dst, replace=replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def carry_over(old: Path, new: Path):
    """Into `new`, what `old` holds that `new` lacks, but for an old save's weights and configs (hard links where
    the disk allows, copies elsewhere)."""
    for entry in old.iterdir():
        target = new / entry.name
        if target.exists() or WEIGHT_FILES.match(entry.name):
            continue
        if entry.is_dir():
            shutil.copytree(entry, target, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, target)


def _link_or_copy(src, dst):
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def fsync_dir(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, dst: Path, replace: bool = False):
    """`tmp` renamed to `dst`. With `replace`, a non-empty `dst` gives way: what it holds besides an old save is
    carried into `tmp`, it is renamed aside, `tmp` takes its name, and only then is it removed."""
    if replace and dst.is_dir() and any(dst.iterdir()):
        carry_over(dst, tmp)
        fsync_dir(tmp)
        old = dst.parent / f".{dst.name}.old-{socket.gethostname()}-{os.getpid()}"
        os.rename(dst, old)
        os.rename(tmp, dst)
        fsync_dir(dst.parent)
        shutil.rmtree(old, ignore_errors=True)
        return
    fsync_dir(tmp)
    check_destination(dst)
    if dst.exists():
        dst.rmdir()
    os.rename(tmp, dst)
    fsync_dir(dst.parent)
