"""One job at a time in a run directory: OUTPUT/run.lock, created by rank 0 (O_EXCL) before the run writes anything,
holding the job's host, pid, start time and id, its modification time refreshed every HEARTBEAT_S while the job
lives, and removed when it ends.

A second job on the same --output is refused at once, naming the holder. A lock whose job is gone does not hold
forever: on the same host, a pid that no longer runs (or runs another program: its start time differs); from another
host, a heartbeat older than STALE_S. Such a lock is taken over with a line saying whose it was.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Iterator

from colozoo.checkpoint.atomic import pid_alive
from colozoo.runtime.failures import forget_failures, job_store

LOCK = "run.lock"
HEARTBEAT_S = 30.0
STALE_S = 300.0  # a lock of another host not refreshed for this long belongs to a job that is gone


class RunDirectoryBusy(ValueError):
    """Another live job owns the run directory."""


@dataclass
class Holder:
    host: str
    pid: int
    started: float
    job: str
    pid_started: str | None = None       # the process's start time (Linux /proc): a reused pid is another process

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"job {self.job} on host {self.host}, pid {self.pid}, started {when}"


def process_start(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (Linux), None elsewhere or if it is gone."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def gone_because(holder: Holder | None, age_s: float) -> str | None:
    """Why the lock's job is gone ("its pid 123 no longer runs"), or None while it may live."""
    if holder is None:
        return "the lock is unreadable" if age_s > HEARTBEAT_S else None  # else: being written this moment
    if holder.host == socket.gethostname():
        if not pid_alive(holder.pid):
            return f"its pid {holder.pid} no longer runs"
        if holder.pid_started and process_start(holder.pid) not in (None, holder.pid_started):
            return f"its pid {holder.pid} now belongs to another process"
        return None
    if age_s > STALE_S:
        return f"its heartbeat stopped {age_s:.0f} s ago, more than {STALE_S:.0f} s"
    return None


def _read(path: Path) -> tuple[Holder | None, float]:
    """(the holder, or None if unreadable; seconds since its last heartbeat)."""
    age = time.time() - path.stat().st_mtime
    try:
        value = json.loads(path.read_text())
        return Holder(**{f.name: value[f.name] for f in fields(Holder) if f.name in value}), age
    except (OSError, ValueError, TypeError):
        return None, age


class RunLock:
    """The lock of one run directory, held by this process (rank 0) from `acquire` to `release`."""

    def __init__(self, output):
        self.path = Path(output) / LOCK
        pid = os.getpid()
        self.holder = Holder(socket.gethostname(), pid, time.time(), uuid.uuid4().hex[:8], process_start(pid))
        self.took_over: str | None = None  # a line on the dead job's lock this one replaced
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    @property
    def job(self) -> str:
        return self.holder.job

    def acquire(self) -> "RunLock":
        """Take the lock (creating the directory), or raise RunDirectoryBusy naming the live job holding it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a lock removed or taken over between our reads: look again
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_gone()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(self.holder), f)
                f.flush()
                os.fsync(f.fileno())
            self._beat = threading.Thread(target=self._heartbeat, name="run-lock-heartbeat", daemon=True)
            self._beat.start()
            return self
        raise RunDirectoryBusy(f"{self.path.parent} is in use by another job that keeps replacing {LOCK}")

    def _take_over_if_gone(self):
        try:
            holder, age = _read(self.path)
        except FileNotFoundError:
            return  # released meanwhile
        reason = gone_because(holder, age)
        if reason is None:
            who = holder.describe() if holder else "a job starting this moment"
            raise RunDirectoryBusy(f"{self.path.parent} is in use by {who} ({self.path}); wait for it to end, or "
                                   f"pass another --output")
        aside = self.path.with_name(f"{LOCK}.stale-{self.holder.job}")
        try:
            os.rename(self.path, aside)  # one taker wins; the others find the new lock
        except FileNotFoundError:
            return
        seen, _ = _read(aside)
        if seen != holder:  # a live job's lock replaced the dead one between our reads: give it back
            os.replace(aside, self.path)
            return
        aside.unlink()
        self.took_over = (f"took over {self.path.parent} from {holder.describe() if holder else 'an unreadable lock'}"
                          f", which ended without releasing it ({reason})")

    def _heartbeat(self):
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:  # the directory was removed (a refused run cleans up): nothing left to hold
                return

    def release(self):
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
        try:
            holder, _ = _read(self.path)
            if holder is not None and holder.job == self.job:
                self.path.unlink()
        except FileNotFoundError:
            pass


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _from_rank0(value):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextmanager
def run_directory(output) -> Iterator[str]:
    """Rank 0 holds OUTPUT/run.lock for as long as the block runs; yields the job's id on every rank (collective).
    A directory held by a live job is refused (RunDirectoryBusy) on every rank, before anything is written."""
    lock = RunLock(output) if _is_rank0() else None
    outcome = None
    if lock is not None:
        forget_failures(job_store())  # before any rank can fail in this job (the broadcast below orders it)
        try:
            outcome = (lock.acquire().job, None, None)
        except RunDirectoryBusy as e:
            outcome = (None, str(e), None)
        except OSError as e:
            outcome = (None, None, f"cannot write to the output directory {output}: {e.strerror or e}")
    job, busy, unwritable = _from_rank0(outcome)
    if busy or unwritable:
        raise RunDirectoryBusy(busy) if busy else ValueError(unwritable)
    if lock is not None and lock.took_over:
        print(lock.took_over, file=sys.stderr, flush=True)
    try:
        yield job
    finally:
        if lock is not None:
            lock.release()
