"""Run a test function on N gloo ranks with a hard timeout and clear failure reports.

Workers are spawned once per world size and reused across tests (importing torch and transformers is the
slow part). A task is a top-level function `fn(*args)` run on every rank after the process group is up;
each rank returns a picklable value. A failing rank's traceback is re-raised in the test; a hang past the
timeout kills the pool (it is rebuilt for the next test).
"""
from __future__ import annotations

import atexit
import os
import queue
import traceback

import torch.multiprocessing as mp
from torch.distributed import TCPStore

DEFAULT_TIMEOUT = 180


def _worker(rank, world_size, store_port, tasks, results):
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=DEFAULT_TIMEOUT)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    import mutations

    mutations.apply_from_environment()  # the mutation the test process runs under, if any
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent:  # the test process died: do not linger
                break
            continue
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class DistributedPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        # a TCP store served from the test process: a file store slows down with every key ever written
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, self.store.port, self.tasks[r], self.results),
                                  daemon=False) for r in range(world_size)]  # ranks may spawn helpers
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs):
        for q in self.tasks:
            q.put((fn, args, kwargs))
        outcomes, failures = {}, {}
        try:
            while len(outcomes) + len(failures) < self.world_size:
                wait = timeout if not failures else 10  # once one rank failed, the rest may hang in a collective
                rank, ok, value = self.results.get(timeout=wait)
                (outcomes if ok else failures)[rank] = value
        except queue.Empty:
            self.close(force=True)
            if failures:
                raise AssertionError(self._report(fn, failures)) from None
            missing = sorted(set(range(self.world_size)) - set(outcomes))
            raise TimeoutError(f"{fn.__name__} on {self.world_size} ranks: ranks {missing} did not finish "
                               f"within {timeout}s") from None
        if failures:
            raise AssertionError(self._report(fn, failures))
        return [outcomes[r] for r in range(self.world_size)]

    @staticmethod
    def _report(fn, failures):
        return "\n".join(f"--- rank {r} failed in {fn.__name__} ---\n{tb}" for r, tb in sorted(failures.items()))

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, force: bool = False):
        for p, q in zip(self.procs, self.tasks):
            if not force and p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if force else 5)
            if p.is_alive():
                p.kill()
                p.join()


_POOLS: dict[int, DistributedPool] = {}


def run_distributed(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs):
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; returns the list of per-rank results. Prefer keyword
    arguments: `run_distributed(check, 2, family="gpt2", tp=2, timeout=60)` reads as what it runs."""
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive():
        pool = _POOLS[world_size] = DistributedPool(world_size)
    try:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
    except BaseException:
        _POOLS.pop(world_size, None)
        pool.close(force=True)
        raise


@atexit.register
def _shutdown():
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
