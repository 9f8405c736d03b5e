"""Atomic directory writes: everything goes to a temp dir beside the destination, is fsynced, and is renamed into
place only when complete, so a crash at any moment leaves either the old state or the new one."""
from __future__ import annotations

import glob
import os
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path


def check_destination(dst: Path):
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"destination {dst} already exists and is not empty; choose a new path or remove it")


def _pid_alive(pid: int) -> bool:
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
        if owner == host and pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(sibling, ignore_errors=True)


@contextmanager
def atomic_directory(dst):
    """Yield a temp dir beside `dst`; on success it is fsynced and renamed to `dst`, on failure removed."""
    dst = Path(dst)
    check_destination(dst)
    if dst.parent.is_dir():
        remove_stale_temp_dirs(dst)
    tmp = dst.parent / f".{dst.name}.tmp-{socket.gethostname()}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        publish(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def fsync_dir(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, dst: Path):
    fsync_dir(tmp)
    check_destination(dst)
    if dst.exists():
        dst.rmdir()
    os.rename(tmp, dst)
    fsync_dir(dst.parent)
