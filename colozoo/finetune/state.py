"""Checkpoints of the whole training state that any mesh resumes from, written so that a crash at any moment leaves
the last complete one, and read without unpickling anything.

    OUTPUT/checkpoints/step-00000020/   colozoo_index.json     the model: a colozoo checkpoint (convert, from_pretrained)
                                        training_index.json    optimizer states and master weights, by global name
                                        state-rank-*.safetensors  each rank's pieces of both
                                        rng-rank-*.json        each rank's RNG states
                                        meta.json              step, mesh, data position, optimizer hyperparameters
                                                               and steps, scheduler, loss scale
                                        checksums.json         sha256 and size of every file above; written last
    OUTPUT/checkpoints/.tmp-step-JOB-N/ a save in progress of job JOB; renamed into place only once every rank has
                                        written

Tensors are global (colozoo.checkpoint.training_state), so another tp / pp / dp, FSDP or DDP, with or without
offload reads them; everything else is JSON. A directory named step-* is complete by construction (the rename is
the commit), so resuming simply takes the newest one.
"""
from __future__ import annotations

import base64
import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from colozoo.checkpoint.checksums import CHECKSUMS, verify_checksums, write_checksums
from colozoo.checkpoint.collective import world
from colozoo.checkpoint.save import lora_of_every_stage
from colozoo.checkpoint.layout import ModelLayout
from colozoo.checkpoint.training_state import TrainingCheckpoint, own_pieces, write_indexes, write_rank_file
from colozoo.core.errors import CheckpointError, naming
from colozoo.core.files import fsync_write
from colozoo.core.rng import get_rng_tracker
from colozoo.finetune.optimizer_state import optimizer_tensors, restore_optimizer

FORMAT = "colozoo-finetune-state/2"
PICKLED_FORMAT = "colozoo-finetune-state/1"
PREFIX, TMP_PREFIX = "step-", ".tmp-step-"
IGNORED_CONFIG_KEYS = ("_name_or_path", "transformers_version", "torch_dtype", "dtype")
RESTORED_SETTINGS = ("lr", "weight_decay")  # options a resume takes from the checkpoint's optimizer, not the run


class ResumeError(ValueError):
    """A checkpoint that cannot continue this run."""


def _rank() -> int:
    return world()[0]


def _world() -> int:
    return world()[1]


def _barrier(group=None):
    if _world() > 1:
        dist.barrier(group=group)


def _all_gather(value, group=None) -> list:
    if _world() == 1:
        return [value]
    out = [None] * _world()
    dist.all_gather_object(out, value, group=group)
    return out


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.contiguous().view(torch.uint8).numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rng_state() -> dict:
    """Every generator this process draws from, as JSON."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {"torch": _b64(torch.get_rng_state()), "python": [version, list(internal), gauss],
             "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
             "tracker": [[name, device, _b64(t)] for (name, device), t in get_rng_tracker().get_states().items()]}
    if torch.cuda.is_available():
        state["cuda"] = _b64(torch.cuda.get_rng_state())
    return state


def set_rng_state(state: dict):
    torch.set_rng_state(_unb64(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    get_rng_tracker().set_states({(name, device): _unb64(s) for name, device, s in state["tracker"]})
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unb64(state["cuda"]))


def _write_json(path: Path, value):
    fsync_write(path, lambda f: f.write(json.dumps(value, indent=1).encode()))


def complete_checkpoints(root) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "meta.json").exists()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def _stage_layers(model) -> list[list[int]] | None:
    """Every pp rank's global layer indices (collective over pp): a model may be split other than by default."""
    pp = model.parallel.size("pp")
    if pp == 1:
        return None
    every_rank = [None] * pp
    dist.all_gather_object(every_rank, list(model.layer_ids), group=model.parallel.group("pp"))
    return every_rank


@dataclass
class Snapshot:
    """One rank's training state at a step, ready to write: its pieces of the global tensors, its RNG states and
    (for rank 0) the meta."""
    root: Path
    step: int
    layout: ModelLayout
    pieces: list
    rng: dict
    meta: dict
    keep_last: int
    side_files: tuple = ()               # the model's tokenizer, chat template and generation config, copied along
    job: str = ""                        # the job writing it: its temp directory is its own


def snapshot_training_state(root, step: int, model, optimizer, scheduler, mesh: dict, extra: dict | None = None,
                            keep_last: int = 2, scaler=None, copy: bool = False, side_files=(), job: str = ""
                            ) -> Snapshot:
    """Collective over pp. `copy`: the tensors are copied to CPU memory, so training may go on while they are
    written (an asynchronous save); otherwise they are views of the live state. `side_files`: files the checkpoint
    carries beside the model (colozoo.checkpoint.convert.SIDE_FILES of the model directory), so that it loads and
    generates on its own. `job`: the id of the job saving (its temp directory is named by it)."""
    layout = ModelLayout(model.config, model.parallel.size("pp"), _stage_layers(model), lora=lora_of_every_stage(model))
    states, hyper = optimizer_tensors(model, optimizer, layout.canonical)
    pieces = own_pieces(model, layout, states)
    if copy:
        pieces = [(name, g, data.to("cpu", copy=True)) for name, g, data in pieces]
    meta = {"format": FORMAT, "step": step, "world_size": _world(), "mesh": mesh, "time": time.time(),
            "optimizer": hyper, "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None and scaler.enabled else None, **(extra or {})}
    return Snapshot(Path(root), step, layout, pieces, rng_state(), json.loads(json.dumps(meta)), keep_last,
                    tuple(side_files), job)


class SaveError(CheckpointError):
    """A save that could not be written (a full disk, a lost mount): nothing of it is left."""


def temp_dir(root: Path, step: int, job: str) -> Path:
    return root / f"{TMP_PREFIX}{job + '-' if job else ''}{step:08d}"


def write_snapshot(snapshot: Snapshot, group=None) -> Path:
    """Collective over `group` (all ranks): every rank writes its files into the job's temp dir; rank 0 writes the
    indexes, meta.json and checksums.json, commits by renaming, then prunes to the newest `keep_last`. A write that
    fails on any rank (a full disk) makes every rank raise one SaveError, the partial save removed."""
    root, step = snapshot.root, snapshot.step
    final, tmp = root / f"{PREFIX}{step:08d}", temp_dir(snapshot.root, step, snapshot.job)

    def start():
        if _rank() == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # this job's own earlier try at this step
            tmp.mkdir()

    def write_own_files():
        name = f"state-rank-{_rank():05d}.safetensors"
        try:
            shard = write_rank_file(tmp, name, snapshot.pieces)
        except OSError as e:
            raise naming(e, tmp / name) from None
        _write_json(tmp / f"rng-rank-{_rank():05d}.json", snapshot.rng)
        return shard, snapshot.meta["optimizer"]["scalars"]

    _agreed(snapshot, tmp, start, group)
    shards = _agreed(snapshot, tmp, write_own_files, group)
    _before_commit(tmp)
    _barrier(group)
    _agreed(snapshot, tmp, lambda: _commit(snapshot, tmp, final, shards) if _rank() == 0 else None, group)
    return final


def _commit(snapshot: Snapshot, tmp: Path, final: Path, shards: list):
    """Rank 0: the indexes, side files, meta.json and checksums.json (last), then the rename that commits."""
    try:
        write_indexes(tmp, snapshot.layout, snapshot.meta["mesh"], [s for s, _ in shards])
        for file in snapshot.side_files:
            shutil.copy2(file, tmp / Path(file).name)
    except OSError as e:
        raise naming(e, tmp) from None
    meta = snapshot.meta
    meta["optimizer"]["scalars"] = {name: value for _, scalars in shards for name, value in scalars.items()}
    _write_json(tmp / "meta.json", meta)
    try:
        write_checksums(tmp)
    except OSError as e:
        raise naming(e, tmp / CHECKSUMS) from None
    if final.exists():  # the same step saved before (e.g. an interrupted run re-saving): replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    for old in complete_checkpoints(snapshot.root)[:-snapshot.keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def _agreed(snapshot: Snapshot, tmp: Path, part, group) -> list:
    """Run this rank's `part` of a save (collective: every rank's results, in rank order). An OSError on any rank
    makes every rank raise the same SaveError, once rank 0 has removed the partial save."""
    try:
        mine = (part(), None)
    except OSError as e:
        mine = (None, not_saved(snapshot.root, snapshot.step, e))
    gathered = _all_gather(mine, group)
    failed = next((error for _, error in gathered if error), None)
    if failed:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise SaveError(failed)
    return [result for result, _ in gathered]


def not_saved(root: Path, step: int, error: OSError) -> str:
    """`step 20 not saved: no space left on device writing PATH; the last good checkpoint is ...step-00000010`."""
    what = error.strerror or str(error)
    where = f" writing {error.filename}" if error.filename else ""
    on_rank = f" on rank {_rank()}" if _world() > 1 else ""
    done = complete_checkpoints(root)
    last = f"the last good checkpoint is {done[-1]}" if done else "no earlier checkpoint was saved"
    return f"step {step} not saved: {what[:1].lower()}{what[1:]}{where}{on_rank}; {last}"


def save_training_state(root, step: int, model, optimizer, scheduler, mesh: dict, extra: dict | None = None,
                        keep_last: int = 2, scaler=None, side_files=(), job: str = "") -> Path:
    """Collective: save the whole training state at `step` under `root` and return its directory. `scaler`: an
    fp16 loss scaler (colozoo.runtime.amp), kept when enabled. `extra` goes into meta.json (the data position,
    total steps)."""
    return write_snapshot(snapshot_training_state(root, step, model, optimizer, scheduler, mesh, extra, keep_last,
                                                  scaler, side_files=side_files, job=job))


def _before_commit(tmp: Path):
    """Test hook: a point where every rank has written but nothing is committed yet."""


def _config_differences(saved: dict, config) -> list[str]:
    mine = json.loads(json.dumps(config.to_dict(), default=str))  # as the index stores it (string keys)
    keys = sorted((set(saved) | set(mine)) - set(IGNORED_CONFIG_KEYS))
    return [f"{k}: {saved.get(k, '(unset)')!r} in the checkpoint, {mine.get(k, '(unset)')!r} here"
            for k in keys if saved.get(k) != mine.get(k)]


def check_same_model(path: Path, model, checkpoint: TrainingCheckpoint):
    """One clear error when the checkpoint holds another model's training state."""
    index = checkpoint.model.index
    family = index.get("family")
    if family != model.config.model_type:
        raise ResumeError(f"{path} holds the training state of a {family} model, this run trains a "
                          f"{model.config.model_type}; use another --output or --no-resume")
    differs = _config_differences(index["config"], model.config)
    if differs:
        raise ResumeError(f"{path} holds the training state of another model (its config differs: "
                          f"{'; '.join(differs[:4])}{' ...' if len(differs) > 4 else ''}); use another --output "
                          f"or --no-resume")
    try:
        checkpoint.model.check_against(checkpoint.layout)
    except CheckpointError as e:
        raise ResumeError(f"{path} holds the training state of another model: {e}") from None


def check_data_position(path: Path, meta: dict, data: dict | None):
    """The step is a data position only for the same data rows, global batch and shuffling seed."""
    saved = meta.get("data") or {}
    differs = [k for k, v in (data or {}).items() if k in saved and saved[k] != v]
    if differs:
        what = "; ".join("its rows (tokens) differ" if k == "rows" else f"{k} {saved[k]} in the checkpoint, "
                         f"{data[k]} here" for k in differs)
        raise ResumeError(f"{path} cannot continue this run's data: {what}; resume with the same data, --seq-len, "
                          f"--global-batch-size and --seed (or pass --no-resume)")


def check_started_from(path: Path, meta: dict, started_from: dict | None):
    """The run continues only from the base weights and with the LoRA settings it started with (checked where the
    checkpoint records them)."""
    saved, mine = meta.get("started_from") or {}, started_from or {}
    if "base" in saved and "base" in mine and saved["base"] != mine["base"]:
        raise ResumeError(f"{path} continues a run that started from other weights (from {saved.get('model')!r}, "
                          f"weights fingerprint {saved['base']}; --model {mine.get('model')!r} has {mine['base']}): "
                          f"resume with the model it started from, or pass another --output or --no-resume")
    if "adapters" in saved and "adapters" in mine and saved["adapters"] != mine["adapters"]:
        def shown(settings):
            return "none" if not settings else ", ".join(f"{k}={v}" for k, v in settings.items())
        raise ResumeError(f"{path} trains other LoRA adapters ({shown(saved['adapters'])}) than this run "
                          f"({shown(mine['adapters'])}): resume with the same --lora-* options, or pass another "
                          f"--output or --no-resume")


def check_settings(path: Path, meta: dict, settings: dict | None):
    """The options a resume would take from the checkpoint (the optimizer's learning rate and weight decay), not
    from this run, must agree: else the run's would be silently ignored."""
    saved = meta.get("settings") or {}
    differs = [f"--{k.replace('_', '-')} {saved[k]} there, {v} here" for k, v in (settings or {}).items()
               if k in saved and saved[k] != v]
    if differs:
        raise ResumeError(f"{path} was saved by a run with other settings ({'; '.join(differs)}): resume with the "
                          f"same options, or pass --no-resume (start over) or another --output")


def drop_partial_saves(root) -> list[str]:
    """Remove the temp directories of saves that never committed (a job killed while saving; the run directory's
    lock says no other job is writing) and say so, one line each."""
    root = Path(root)
    lines = []
    for partial in sorted(root.glob(TMP_PREFIX + "*")) if root.is_dir() else []:
        shutil.rmtree(partial, ignore_errors=True)
        step = partial.name.rpartition("-")[2]
        lines.append(f"dropped {partial}: a save of step {int(step) if step.isdigit() else step} that never "
                     f"completed (its job was killed while saving)")
    return lines


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ResumeError(f"cannot resume from {path.parent}: {path.name} is unreadable ({e}); start over with "
                          f"--no-resume or remove that checkpoint") from None
    if not isinstance(value, dict):
        raise ResumeError(f"cannot resume from {path.parent}: {path.name} is not a JSON object")
    return value


def read_meta(path) -> dict:
    path = Path(path)
    meta = _read_json(path / "meta.json")
    if meta.get("format") == PICKLED_FORMAT:
        raise ResumeError(f"{path} was written by an older colozoo as pickles, which resume never loads "
                          f"(unpickling can run code); start over with --no-resume")
    if meta.get("format") != FORMAT:
        raise ResumeError(f"{path}: unknown checkpoint format {meta.get('format')!r}")
    return meta


def load_training_state(path, model, optimizer, scheduler, mesh: dict, scaler=None, data: dict | None = None,
                        started_from: dict | None = None, settings: dict | None = None) -> dict:
    """Restore the training state from a complete checkpoint saved on any mesh; returns its meta (with the step,
    and "rng_restored": RNG states come back only on the mesh that saved them, elsewhere the run's seed stands).
    `data`: this run's data position keys (global_batch, seed, samples, rows) the checkpoint must agree with;
    `started_from`: its base weights' fingerprint and LoRA settings (and the model's name, for messages), likewise;
    `settings`: the options the optimizer's state would override (RESTORED_SETTINGS), likewise.
    A loss `scaler` is restored when the checkpoint has one."""
    path = Path(path)
    meta = read_meta(path)
    same_mesh = meta["world_size"] == _world() and meta["mesh"] == mesh
    rng_file = path / f"rng-rank-{_rank():05d}.json"
    rng = _read_json(rng_file) if same_mesh and rng_file.exists() else None
    try:
        verify_checksums(path)  # meta.json, RNG states, indexes and side files as saved (a missing table: warned below)
    except CheckpointError as e:
        raise ResumeError(f"cannot resume from {path}: {e}") from None
    check_data_position(path, meta, data)
    check_settings(path, meta, settings)
    try:
        checkpoint = TrainingCheckpoint(path, ModelLayout(model.config, lora=lora_of_every_stage(model)))
    except CheckpointError as e:
        raise ResumeError(f"cannot resume from {path}: {e}") from None
    check_same_model(path, model, checkpoint)
    check_started_from(path, meta, started_from)  # the same model, config and tensors: from the same weights?
    try:
        for name, param in model.named_parameters():
            checkpoint.read_into(model, name, param)
        restore_optimizer(model, optimizer, checkpoint, meta["optimizer"])
    except CheckpointError as e:
        raise ResumeError(f"cannot resume from {path}: {e}") from None
    scheduler.load_state_dict(meta["scheduler"])
    if scaler is not None and scaler.enabled and meta.get("scaler"):
        scaler.load_state_dict(meta["scaler"])
    if rng is not None:
        set_rng_state(rng)
    return {**meta, "rng_restored": same_mesh}


def latest_checkpoint(root) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None
