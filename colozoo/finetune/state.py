"""Checkpoints of the whole training state, written so that a crash at any moment leaves the last complete one.

    OUTPUT/checkpoints/step-00000020/   meta.json + rank-00000.pt ... (one per rank: model shard, optimizer,
                                        scheduler, RNG states); the step is the data position
    OUTPUT/checkpoints/.tmp-step-.../   a save in progress; renamed into place only once every rank has written

A directory named step-* is complete by construction (the rename is the commit), so resuming simply takes the
newest one. Optimizer state lives on the rank that owns the shard, so resuming needs the same mesh.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from colozoo.core.rng import get_rng_tracker

FORMAT = "colozoo-finetune-state/1"
PREFIX, TMP_PREFIX = "step-", ".tmp-step-"


class ResumeError(ValueError):
    """A checkpoint that cannot continue this run."""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier():
    if _world() > 1:
        dist.barrier()


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
             "tracker": get_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    get_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _fsync_write(path: Path, write):
    """Write via a temp file + fsync + rename, so `path` is either absent or whole."""
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def complete_checkpoints(root) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "meta.json").exists()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def save_training_state(root, step: int, model, optimizer, scheduler, mesh: dict, extra: dict | None = None,
                        keep_last: int = 2, scaler=None) -> Path:
    """Collective: every rank writes its file into a temp dir; rank 0 commits it by renaming, then prunes.
    `scaler`: an fp16 loss scaler (colozoo.runtime.amp), saved when enabled."""
    root = Path(root)
    final, tmp = root / f"{PREFIX}{step:08d}", root / f"{TMP_PREFIX}{step:08d}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(TMP_PREFIX + "*"):  # a save that a crash interrupted
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    payload = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
               "scheduler": scheduler.state_dict(), "rng": rng_state()}
    if scaler is not None and scaler.enabled:
        payload["scaler"] = scaler.state_dict()
    _fsync_write(tmp / f"rank-{_rank():05d}.pt", lambda f: torch.save(payload, f))
    _before_commit(tmp)
    _barrier()
    if _rank() == 0:
        meta = {"format": FORMAT, "step": step, "world_size": _world(), "mesh": mesh, "time": time.time(),
                **(extra or {})}
        _fsync_write(tmp / "meta.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))
        if final.exists():  # the same step saved before (e.g. an interrupted run re-saving): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        for old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _before_commit(tmp: Path):
    """Test hook: a point where every rank has written but nothing is committed yet."""


def load_training_state(path, model, optimizer, scheduler, mesh: dict, scaler=None) -> dict:
    """Restore this rank's state from a complete checkpoint; returns its meta (with the step). A loss `scaler`
    is restored when the checkpoint has one (a run that switches to fp16 starts from the initial scale)."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("format") != FORMAT:
        raise ResumeError(f"{path}: unknown checkpoint format {meta.get('format')!r}")
    if meta["world_size"] != _world() or meta["mesh"] != mesh:
        raise ResumeError(f"{path} was saved on {meta['world_size']} ranks with mesh {meta['mesh']}, this run has "
                          f"{_world()} ranks with mesh {mesh}; resume with the same degrees, or start a new run "
                          f"from its exported model (or pass --no-resume)")
    file = path / f"rank-{_rank():05d}.pt"
    if not file.exists():
        raise ResumeError(f"{path} is missing {file.name}")
    state = torch.load(file, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    if scaler is not None and scaler.enabled and "scaler" in state:
        scaler.load_state_dict(state["scaler"])
    return meta


def latest_checkpoint(root) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None
