"""What a user sees when jobs collide, files lie, disks fill or tokenizing takes a while: one job per run directory
(a dead job's lock taken over with a line), saves that fail or were cut short, checkpoints whose every file is checked
(tiny GPT-2, one process; several ranks: tests/test_rank_failures.py and tests/test_stuck_rank.py)."""
import errno
import json
import os
import re
import shutil
import socket
import subprocess
import time

import pytest
from test_finetune import STORIES, small_run, tiny  # noqa: F401 (tiny: the fixture)

import colozoo
from colozoo.checkpoint.format import INDEX_NAME
from colozoo.core.errors import CheckpointError
from colozoo.finetune import data as D
from colozoo.finetune import data_progress, main, state
from colozoo.finetune import token_cache as T
from colozoo.finetune.loop import finetune
from colozoo.finetune.run_lock import LOCK, STALE_S, Holder, RunDirectoryBusy, RunLock, process_start

pytestmark = pytest.mark.timeout(120)


def _argv(model, output, *extra) -> list[str]:
    return ["--model", str(model), "--data", str(STORIES), "--output", str(output), "--seq-len", "16", "--steps", "2",
            "--eval-interval", "0", "--samples", "0", "--no-export-hf", "--no-progress", "--no-plot", *extra]


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid  # free now: the pid of a job that died


def _lock_file(output, age_s: float = 0.0, text: str | None = None, **holder):
    output.mkdir(parents=True, exist_ok=True)
    fields = dict(host=socket.gethostname(), pid=os.getpid(), started=time.time() - 60, job="0ldj0b00",
                  pid_started=process_start(os.getpid()))
    (output / LOCK).write_text(text if text is not None else json.dumps({**fields, **holder}))
    then = time.time() - age_s
    os.utime(output / LOCK, (then, then))


# --- one job per run directory --------------------------------------------------------------------------------------

def test_a_second_job_is_refused_at_once_naming_the_first(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    first = RunLock(out).acquire()  # a live job of this host: this process
    try:
        started = time.monotonic()
        assert main(_argv(tiny, out), task="lm") == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and time.monotonic() - started < 30, err
        assert re.fullmatch(rf"error: {re.escape(str(out))} is in use by job {first.job} on host "
                            rf"{re.escape(socket.gethostname())}, pid {os.getpid()}, started [\d: -]+ \(.*\); wait "
                            rf"for it to end, or pass another --output", err[0]), err
        assert [p.name for p in out.iterdir()] == [LOCK]  # the refused job wrote nothing
    finally:
        first.release()
    assert not (out / LOCK).exists()


@pytest.mark.parametrize("case,lock,why", [
    ("dead pid", dict(pid=-1), r"its pid \d+ no longer runs"),
    ("reused pid", dict(pid_started="1"), rf"its pid {os.getpid()} now belongs to another process"),
    ("other host, silent", dict(host="elsewhere.example", age_s=STALE_S + 60),
     r"its heartbeat stopped \d+ s ago, more than \d+ s"),
    ("unreadable, old", dict(text="{half", age_s=120), r"the lock is unreadable"),
])
def test_a_dead_jobs_lock_is_taken_over_with_a_line(case, lock, why, tmp_path):
    if lock.get("pid") == -1:
        lock["pid"] = _dead_pid()
    _lock_file(tmp_path, **lock)
    taken = RunLock(tmp_path).acquire()
    try:
        assert re.fullmatch(rf"took over {re.escape(str(tmp_path))} from .*, which ended without releasing it "
                            rf"\({why}\)", taken.took_over), taken.took_over
        assert Holder(**json.loads((tmp_path / LOCK).read_text())).job == taken.job
    finally:
        taken.release()
    assert not (tmp_path / LOCK).exists()


def test_a_live_lock_of_another_host_holds(tmp_path):
    _lock_file(tmp_path, host="elsewhere.example", age_s=STALE_S / 2)  # its heartbeat is recent
    with pytest.raises(RunDirectoryBusy, match="in use by job 0ldj0b00 on host elsewhere.example"):
        RunLock(tmp_path).acquire()


def test_takeover_temp_names_and_a_finished_run_are_said_and_other_settings_refused(tiny, tmp_path, capsys,
                                                                                     monkeypatch):
    out = tmp_path / "run"
    _lock_file(out, pid=_dead_pid())  # a job killed before it could release the directory
    foreign = out / "checkpoints" / f"{state.TMP_PREFIX}0therj0b-00000001"

    def another_jobs_save_appears(tmp):  # a temp dir not of this job: no later save of this job removes it
        foreign.mkdir(exist_ok=True)

    monkeypatch.setattr(state, "_before_commit", another_jobs_save_appears)
    finetune(small_run(tiny, out, steps=2, save_interval=1, eval_interval=0, samples=0))
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert re.search(r"took over \S+ from job 0ldj0b00 .*\(its pid \d+ no longer runs\)", err), err
    assert foreign.is_dir() and not (out / LOCK).exists()

    finetune(small_run(tiny, out, steps=2, eval_interval=0, samples=0))  # the same command once more
    err = capsys.readouterr().err
    assert f"dropped {foreign}: a save of step 1 that never completed" in err and not foreign.exists()
    assert "step-00000002 ends the run (2 of 2 steps): nothing left to train" in err, err
    with pytest.raises(state.ResumeError, match=r"saved by a run with other settings \(--lr 0.01 there, 0.001 here\)"):
        finetune(small_run(tiny, out, steps=2, eval_interval=0, samples=0, lr=1e-3))


# --- saves that fail or were cut short -------------------------------------------------------------------------------

def test_a_full_disk_while_saving_is_one_line_and_leaves_no_partial_save(tiny, tmp_path, capsys, monkeypatch):
    from colozoo.checkpoint.safetensors_io import SafetensorsWriter

    write = SafetensorsWriter.write

    def full_at_step_4(self, key, tensor):
        if self.path.parent.name.endswith("00000004"):
            raise OSError(errno.ENOSPC, "No space left on device")  # as a write to a full disk: naming no file
        return write(self, key, tensor)

    monkeypatch.setattr(SafetensorsWriter, "write", full_at_step_4)
    out = tmp_path / "run"
    assert main(_argv(tiny, out, "--steps", "6", "--save-interval", "2"), task="lm") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if "error" in line or "Traceback" in line] == err[-1:], err
    checkpoints = re.escape(str(out / "checkpoints"))
    assert re.fullmatch(rf"error: step 4 not saved: no space left on device writing {checkpoints}/"
                        rf"\.tmp-step-\w+-00000004/state-rank-00000\.safetensors; the last good checkpoint is "
                        rf"{checkpoints}/step-00000002", err[-1]), err[-1]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000002"]  # the partial save removed


# --- checkpoints whose every file is checked -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stopped(tiny, tmp_path_factory):
    """A run of 4 steps stopped (and saved) at step 2."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    finetune(small_run(tiny, out, steps=4, stop_after=2, eval_interval=0, samples=0))
    return out


def _swap_two_tensors(index):
    """Consistent, and the weights silently wrong: two tensors of one shape trade their pieces."""
    tensors = index["tensors"]
    tensors["layers.0.ln_1.weight"], tensors["layers.0.ln_2.weight"] = \
        tensors["layers.0.ln_2.weight"], tensors["layers.0.ln_1.weight"]


EDITS = {
    INDEX_NAME: _swap_two_tensors,
    "meta.json": lambda meta: meta["scheduler"].update(base_lrs=[0.5]),
    "rng-rank-00000.json": lambda rng: rng["python"][1].__setitem__(0, rng["python"][1][0] ^ 1),
}


@pytest.mark.parametrize("file", sorted(EDITS))
def test_an_edited_checkpoint_file_is_refused_on_resume_and_in_from_pretrained(file, stopped, tiny, tmp_path):
    run = shutil.copytree(stopped, tmp_path / "run")
    checkpoint = state.latest_checkpoint(run / "checkpoints")
    value = json.loads((checkpoint / file).read_text())
    EDITS[file](value)
    (checkpoint / file).write_text(json.dumps(value, indent=1))
    with pytest.raises(state.ResumeError, match=rf"checksum mismatch in {re.escape(str(checkpoint / file))}") as e:
        finetune(small_run(tiny, run, steps=4, eval_interval=0, samples=0))
    assert "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match=rf"checksum mismatch in \S+/{re.escape(file)}"):
        colozoo.from_pretrained(checkpoint)


def test_a_checkpoint_saved_before_checksums_resumes_with_a_note(stopped, tiny, tmp_path):
    run = shutil.copytree(stopped, tmp_path / "run")
    (state.latest_checkpoint(run / "checkpoints") / "checksums.json").unlink()
    with pytest.warns(UserWarning, match=r"has no checksums\.json \(saved by an older colozoo\)"):
        assert finetune(small_run(tiny, run, steps=4, eval_interval=0, samples=0))["step"] == 4


# --- tokenizing shows progress --------------------------------------------------------------------------------------

def test_tokenizing_a_dataset_shows_progress_and_what_it_made(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(data_progress, "PLAIN_EVERY_S", 0.0)  # a line per block (output is not a terminal here)
    path = tmp_path / "many.jsonl"
    lines = STORIES.read_text().splitlines()
    path.write_text("\n".join(lines * (2100 // len(lines) + 1)) + "\n")
    records = data_progress.record_count(path)
    tokenizer, stats = D.load_tokenizer(tiny, 131), {}
    rows, built = T.cached_rows(tmp_path / "cache", "train", path, tokenizer,
                                lambda: D.lm_blocks(path, tokenizer, 16, True, "text", stats), stats=stats,
                                progress=True, seq_len=16)
    err = capsys.readouterr().err
    assert built and records > 2048 and stats["samples"] == records
    assert f"tokenizing {path}: {100 * 1024 / records:.0f}% (1,024 of {records:,} records)" in err, err
    assert f"tokenized {records:,} records of {path} into {len(rows):,} rows of 16 tokens in" in err, err
