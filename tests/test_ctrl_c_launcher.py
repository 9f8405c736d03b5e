"""Ctrl-C at a terminal sends SIGINT to the whole foreground process group: `colozoo finetune --nproc-per-node 2`
(torchrun's launcher in-process) and both its workers. The job saves, prints one line and exits 0 (plain torchrun
exits 1 with a long traceback); the same command resumes the loss curve of an uninterrupted run."""
import json
import os
import re
import signal
import subprocess
import sys

from interrupt import REPO, clean_env, finetune_argv, interrupted, losses
from parity import close

from colozoo.finetune import state

LINE = re.compile(r"^interrupted at step (\d+)/8, saved to (\S+); rerun the same command to resume$", re.M)


def _launch(model, output, *extra):
    return [sys.executable, "-m", "colozoo.cli", "finetune", "--nproc-per-node", "2",
            *finetune_argv(model, output, *extra)]


def _ctrl_c(proc):
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the whole foreground group


def test_ctrl_c_under_the_launcher_saves_exits_0_with_one_line_and_resumes(launched_model, straight_tp2,
                                                                            tmp_path):
    out = tmp_path / "run"
    code, log = interrupted(_launch(launched_model, out), "step 2/", _ctrl_c, group=True)
    assert code == 0, log[-3000:]
    assert "Traceback" not in log and "SignalException" not in log, log[-3000:]
    found = LINE.findall(log)
    assert len(found) == 1, log[-3000:]
    step, checkpoint = int(found[0][0]), found[0][1]
    assert 2 <= step < 8 and json.loads((out / "summary.json").read_text())["stopped"], log[-3000:]
    assert state.latest_checkpoint(out / "checkpoints") == state.latest_checkpoint(checkpoint.rsplit("/", 1)[0]) \
        and checkpoint.endswith(f"step-{step:08d}"), log[-3000:]

    again = subprocess.run(_launch(launched_model, out), cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr and "Traceback" not in again.stderr
    ours, theirs = losses(out), losses(straight_tp2)
    assert [s for s, _ in ours] == [s for s, _ in theirs] == list(range(1, 9))
    close([loss for _, loss in ours], [loss for _, loss in theirs], 1e-6, "loss curve after the resume")


def test_sigterm_to_the_launcher_alone_is_passed_on_to_the_workers(launched_model, tmp_path):
    """A scheduler may signal the launcher only: it passes SIGTERM on, the workers save and the job exits 0."""
    out = tmp_path / "run"
    code, log = interrupted(_launch(launched_model, out), "step 2/", lambda proc: proc.send_signal(signal.SIGTERM), group=True)
    assert code == 0 and "Traceback" not in log and len(LINE.findall(log)) == 1, log[-3000:]
    assert json.loads((out / "summary.json").read_text())["stopped"]
