"""Saving checkpoints while training goes on (--async-save): at the step, each rank copies its state to CPU memory
(the only pause); a background thread then writes the files and commits them, with its collectives on a process
group of its own so that they never interleave with training's. The commit is still one rename after every rank
wrote. One save is in flight at a time: the next save, and the end of the run, wait for it."""
from __future__ import annotations

import threading
from pathlib import Path

import torch.distributed as dist

from colozoo.finetune import state


class CheckpointSaver:
    def __init__(self, asynchronous: bool = False):
        self.asynchronous = asynchronous
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.group = None

    def save(self, root, step: int, *args, final: bool = False, **kwargs) -> Path:
        """save_training_state's arguments; `final`: the run ends after it, so it is written at once."""
        self.wait()
        if not self.asynchronous or final:
            return state.save_training_state(root, step, *args, **kwargs)
        snapshot = state.snapshot_training_state(root, step, *args, copy=True, **kwargs)
        if self.group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.group = dist.new_group(backend="gloo")  # collective: every rank saves at the same steps
        self.thread = threading.Thread(target=self._write, args=(snapshot,), name=f"save-step-{step}", daemon=True)
        self.thread.start()
        return snapshot.root / f"{state.PREFIX}{step:08d}"

    def _write(self, snapshot):
        try:
            state.write_snapshot(snapshot, self.group)
        except BaseException as e:  # noqa: BLE001 - raised in the training thread by wait()
            self.error = e

    def wait(self, raise_error: bool = True):
        """Block until the save in flight is committed; re-raise its error here."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None and raise_error:
            error, self.error = self.error, None
            raise error
