"""A stuck rank named within --collective-timeout: each rank's watchdog thread stamps, every few seconds, a heartbeat
into the job's store: its step and phase (which the training loop reports), where its main thread is, and the
torch.distributed call it is in. A rank that has waited in one collective call for the timeout, its step and phase
unchanged, looks at its peers' heartbeats: a peer whose heartbeat stopped (SIGSTOP, a frozen host), one outside any
collective (a hang in its own code), or one behind it (a collective it never reached), is named with its last step,
phase and collective; the job then ends (exit 1), a frozen rank of this host killed so that the launcher need not
wait for it.

    error: rank 1 is stuck: no heartbeat (stopped or frozen); last seen at step 3 (forward/backward and optimizer
    step), last collective all_reduce, at all_reduce (groups.py:21) (rank 0 waited 14 s in all_reduce at step 4;
    --collective-timeout 10); ending the job
"""
from __future__ import annotations

import json
import linecache
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass

from colozoo.runtime.failures import Failure, claim_first, job_store, write_error_file

PREFIX = "colozoo/watchdog"
FROZEN_AFTER_S = 5.0  # no heartbeat for this long (and three intervals) is a frozen rank: a busy one beats within it


def process_group_timeout(timeout_s: float) -> float:
    """The process group's own timeout under a watchdog of `timeout_s`: late enough that the watchdog speaks first
    (after the timeout, a heartbeat and its look at the others), a backstop for a hang it cannot see."""
    return timeout_s + max(30.0, timeout_s / 2)


@dataclass
class Beat:
    rank: int
    n: int                               # counts heartbeats: unchanged means the rank is frozen
    progress: int                        # counts the loop's reports (steps and phases)
    step: int
    phase: str
    collective: str | None               # the torch.distributed call the main thread is in now
    last_collective: str | None          # the last one it was seen in
    where: str                           # the main thread's innermost colozoo frame: function (file:line)
    host: str
    pid: int


def main_thread_place() -> tuple[str | None, str, tuple | None]:
    """(the torch.distributed function the main thread is in, or None; its innermost colozoo frame, else its
    innermost frame outside torch: "function (file:line)"; the identity of the collective call, or None)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    collective, outside_torch, call = None, None, None
    while frame is not None:
        module, name = frame.f_globals.get("__name__", ""), frame.f_code.co_name
        place = f"{name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})"
        if module == __name__:  # a beat the main thread stamps itself (the first)
            pass
        elif module.startswith("torch.distributed"):
            if collective is None and name not in ("wrapper", "<module>"):
                collective, call = name, (id(frame), frame.f_lasti)
        elif module.startswith("colozoo"):
            if collective is None and ".wait()" in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
                collective = "the wait of an asynchronous collective"  # e.g. tensor parallelism's overlapped reduce
                call = (id(frame), frame.f_lasti)
            return collective, place, call
        elif outside_torch is None and not module.startswith("torch"):
            outside_torch = place
        frame = frame.f_back
    return collective, outside_torch or "?", call


def find_stuck(me: Beat, before: dict[int, Beat | None], after: dict[int, Beat | None]) -> list[tuple[int, str]]:
    """[(rank, why)] of the peers that keep `me` waiting, from two looks at their heartbeats some beats apart."""
    frozen = [(r, "no heartbeat (stopped or frozen)") for r, b in after.items()
              if b is None or (before.get(r) is not None and before[r].n == b.n)]
    if frozen:
        return frozen
    outside = [(r, f"outside any collective, in {b.where}") for r, b in after.items() if b.collective is None]
    if outside:
        return outside
    return [(r, f"behind, in {b.collective} at {b.where}") for r, b in after.items() if b.progress < me.progress]


def describe(rank: int, why: str, beat: Beat | None, me: Beat, waited: float, timeout: float) -> str:
    last = "it never started its watchdog" if beat is None else (
        f"last seen at step {beat.step} ({beat.phase}), last collective "
        f"{beat.collective or beat.last_collective or 'none'}, at {beat.where}")
    return (f"rank {rank} is stuck: {why}; {last} (rank {me.rank} waited {waited:.0f} s in "
            f"{me.collective or me.where} at step {me.step}; --collective-timeout {timeout:g}); ending the job")


class Watchdog:
    """Started by the training loop on every rank (a no-op in a one-process run); `at(step, phase)` reports
    progress."""

    def __init__(self, timeout_s: float, job: str = "", rank: int | None = None, world: int | None = None,
                 store=None, interval_s: float | None = None):
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        self.world = world if world is not None else (dist.get_world_size() if initialized else 1)
        store = store if store is not None else job_store()
        self.reports = store if self.world > 1 else None  # the main thread's connection: its steps and phases
        self.store = store.clone() if store is not None else None  # a connection of its own: the thread's
        self.timeout, self.key = timeout_s, f"{PREFIX}/{job}"
        self.interval = interval_s or min(max(timeout_s / 10, 0.2), 5.0)
        self.progress, self.step, self.phase, self.advanced = 0, 0, "starting", time.monotonic()
        self.beats, self.last_collective = 0, None
        self.call, self.call_since = None, time.monotonic()  # the collective call the main thread waits in, since
        self._stop = threading.Event()
        self._thread = None

    def at(self, step: int, phase: str):
        """The main thread's progress: published at once (heartbeats may lag behind a busy main thread)."""
        self.progress, self.step, self.phase, self.advanced = self.progress + 1, step, phase, time.monotonic()
        if self.reports is not None:
            self.reports.set(f"{self.key}/{self.rank}/at", json.dumps([self.progress, step, phase]))

    def __enter__(self):
        if self.store is not None and self.world > 1:
            self.beat()  # every rank is known (host, pid) before any waits
            self._thread = threading.Thread(target=self._run, name="colozoo-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def beat(self) -> Beat:
        collective, where, call = main_thread_place()
        if call is None or call != self.call:  # a long step's every new collective is progress too
            self.call, self.call_since = call, time.monotonic()
        self.last_collective = collective or self.last_collective
        self.beats += 1
        mine = Beat(self.rank, self.beats, self.progress, self.step, self.phase, collective, self.last_collective,
                    where, socket.gethostname(), os.getpid())
        self.store.set(f"{self.key}/{self.rank}", json.dumps(asdict(mine)))
        return mine

    def peers(self) -> dict[int, Beat | None]:
        """Every other rank's last heartbeat, with the progress its main thread last reported."""
        found = {}
        for r in (r for r in range(self.world) if r != self.rank):
            beat, reported = self._read(f"{self.key}/{r}"), self._read(f"{self.key}/{r}/at")
            if beat is not None and reported is not None:
                beat["progress"], beat["step"], beat["phase"] = reported
            found[r] = Beat(**beat) if beat is not None else None
        return found

    def _read(self, key: str):
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def _run(self):
        try:
            while not self._stop.wait(self.interval):
                me = self.beat()
                waited = time.monotonic() - (max(self.advanced, self.call_since) if self.call else self.advanced)
                if waited > self.timeout:
                    self._look_for_the_stuck(me, waited)
        except (RuntimeError, ValueError):  # the store went away with the job: nothing left to watch
            return

    def _look_for_the_stuck(self, me: Beat, waited: float):
        before, looked = self.peers(), time.monotonic()
        while time.monotonic() - looked < max(3 * self.interval, FROZEN_AFTER_S):  # a peer that beat since is alive
            if self._stop.wait(self.interval):
                return
            me = self.beat()
        after = self.peers()
        stuck = find_stuck(me, before, after)
        if not stuck or (me.collective is None and not any("heartbeat" in why for _, why in stuck)):
            return  # nothing to name, or this rank is no victim of a collective: keep watching
        rank, why = stuck[0]
        message = describe(rank, why, after.get(rank), me, waited + time.monotonic() - looked, self.timeout)
        first = claim_first(self.store, rank, message)
        if first.message == message:
            self._end_job(first, after.get(rank) if "heartbeat" in why else None)

    def _end_job(self, failure: Failure, frozen: Beat | None):
        print(f"error: {failure.message}", file=sys.stderr, flush=True)
        write_error_file(failure)
        if frozen is not None and frozen.host == socket.gethostname():
            try:
                os.kill(frozen.pid, signal.SIGKILL)  # stopped, it cannot take the launcher's SIGTERM
            except OSError:
                pass
        os._exit(1)
