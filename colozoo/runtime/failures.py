"""Every rank's error reaches the user, once: the first rank of a job to fail records its one-line message in the
job's store (the TCPStore torchrun serves to every rank) before it exits; a rank whose collective then fails (gloo's
`Connection closed by peer`, NCCL's abort, a timeout) finds it there and says it stopped because of that rank, instead
of its own transport error. Every line also goes to torchelastic's error file (TORCHELASTIC_ERROR_FILE, which
torchrun sets), dated so that torchrun's summary names the first failure as the root cause.

    error: rank 1: cannot resume from .../step-00000008: checksum mismatch in .../state-rank-00001.safetensors ...
    rank 0: stopped because rank 1 failed (see above)
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch.distributed as dist

FIRST_FAILURE = "colozoo/first-failure"
PEER_WAIT_S = 5.0  # a peer's record is written before it exits; this bounds the wait for a slow store
TRANSPORT_WORDS = ("gloo", "NCCL", "Connection closed by peer", "Connection reset by peer", "Timed out waiting",
                   "Broken pipe")


class Terminated(Exception):
    """SIGTERM where nothing else handles it: torchrun stopping the other ranks of a failed job, or a scheduler."""


@contextmanager
def terminated_raises():
    """Within: SIGTERM raises Terminated in the main thread, so that the rank says why it stops."""
    def handler(signum, frame):
        raise Terminated(f"stopped by {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class Failure:
    rank: int
    message: str
    time: float


def job_store():
    """The store every rank of the process group reaches, or None outside a multi-process job."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except (ImportError, RuntimeError, ValueError):
        return None


def forget_failures(store):
    """A new job on a store that outlives jobs (a pool of test workers): earlier failures are not its own."""
    if store is not None:
        store.delete_key(FIRST_FAILURE)


def one_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


def is_transport_error(error: BaseException) -> bool:
    """A collective that failed because a peer went away or never came (not a fault of this rank's own), or the
    launcher stopping this rank."""
    if isinstance(error, (Terminated, getattr(dist, "DistError", ()))):
        return True
    return isinstance(error, RuntimeError) and any(word in str(error) for word in TRANSPORT_WORDS)


def claim_first(store, rank: int, message: str) -> Failure:
    """Record this rank's failure as the job's first unless another rank's is there already; returns the first."""
    mine = json.dumps(asdict(Failure(rank, message, time.time())))
    try:
        return Failure(**json.loads(store.compare_set(FIRST_FAILURE, "", mine)))
    except (RuntimeError, ValueError, TypeError):  # the store is gone with the job
        return Failure(**json.loads(mine))


def recorded_first(store, wait_s: float | None = None) -> Failure | None:
    """The job's first failure as recorded, waiting up to `wait_s` (PEER_WAIT_S) for it to appear; None if none
    does."""
    deadline = time.monotonic() + (PEER_WAIT_S if wait_s is None else wait_s)
    while True:
        try:
            if store.check([FIRST_FAILURE]):
                return Failure(**json.loads(store.get(FIRST_FAILURE)))
        except (RuntimeError, ValueError, TypeError):
            return None
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def line_for(error: BaseException, rank: int, store, expected: bool) -> tuple[str | None, Failure]:
    """(the line this rank prints for `error`, or None when another rank printed the same; the failure it records)."""
    if store is not None and is_transport_error(error):
        first = recorded_first(store)
        if first is not None and first.rank != rank:
            follows = f"rank {rank}: stopped because rank {first.rank} failed (see above)"
            return follows, Failure(rank, follows, first.time + 1)  # dated after it: torchrun's root cause stays
    message = one_line(error) if expected else f"{type(error).__name__}: {one_line(error)}"
    if store is None:
        return f"error: {message}", Failure(rank, message, time.time())
    first = claim_first(store, rank, message)
    if first.rank != rank and first.message == message:
        return None, Failure(rank, message, first.time + 1)  # every rank refused the same input: said once
    return f"error: rank {rank}: {message}", first if first.rank == rank else Failure(rank, message, first.time + 1)


def write_error_file(failure: Failure, error: BaseException | None = None):
    """torchelastic's error file of this worker (TORCHELASTIC_ERROR_FILE), if torchrun asked for one."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    stack = "".join(traceback.format_exception(error)) if error is not None else failure.message
    data = {"message": {"message": failure.message, "extraInfo": {"py_callstack": stack,
                                                                   "timestamp": str(int(failure.time))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass


def report_failure(error: BaseException, expected: bool, prefix: str = "") -> bool:
    """Print the one line this rank owes the job for `error` (stderr) and record it for the other ranks and
    torchrun. `expected`: an error meant for the user (bad input, a corrupted file), shown as its message.
    Returns False for an unexpected error of this rank's own: the caller shows its traceback."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    store, expected = job_store(), expected or isinstance(error, Terminated)
    if store is None and expected and os.environ.get("RANK", "0") != "0":
        return True  # under torchrun before any process group: every rank fails alike, rank 0 says it
    line, failure = line_for(error, rank, store, expected)
    follows = line is not None and not line.startswith("error:")
    write_error_file(failure, None if expected or follows else error)  # a traceback only where it tells something
    if line is not None and (expected or follows):
        print(f"{prefix}{line}", file=sys.stderr, flush=True)
    return expected or follows or line is None  # None: another rank's same failure, shown there
