"""Ctrl-C at a terminal sends SIGINT to the whole foreground process group: `colozoo finetune --nproc-per-node 2`
(torchrun's launcher in-process) and both its workers. The job saves, prints one line and exits 0 (plain torchrun
exits 1 with a long traceback); the same command resumes the loss curve of an uninterrupted run."""
import json
import os
import re
import signal
import subprocess
import sys

from parity import close
from test_finetune import REPO, STORIES, tiny  # noqa: F401 (tiny is a fixture)

from colozoo.finetune import state
from colozoo.finetune.metrics import read_metrics

LINE = re.compile(r"^interrupted at step (\d+)/8, saved to (\S+); rerun the same command to resume$", re.M)


def _launch(model, output, *extra):
    return [sys.executable, "-m", "colozoo.cli", "finetune", "--nproc-per-node", "2", "--model", str(model),
            "--data", str(STORIES), "--output", str(output), "--seq-len", "16", "--steps", "8", "--lr", "1e-2",
            "--tp", "2", "--save-interval", "0", "--eval-fraction", "0", "--no-export-hf", "--no-plot", *extra]


def _losses(output):
    return [(r["step"], r["loss"]) for r in read_metrics(output / "metrics.jsonl") if "loss" in r]


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    return dict(env, OMP_NUM_THREADS="1")


def _interrupted(model, output, interrupt) -> tuple[int, str]:
    """Start the launcher in its own process group (a terminal's foreground job), call `interrupt(process)` once
    step 2 is logged; the exit code and everything it printed."""
    proc = subprocess.Popen(_launch(model, output), cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step 2/"):
                interrupt(proc)
                break
        lines += proc.stdout.readlines()
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return code, "".join(lines)


def test_ctrl_c_under_the_launcher_saves_exits_0_with_one_line_and_resumes(tiny, tmp_path):  # noqa: F811
    straight = subprocess.run(_launch(tiny, tmp_path / "straight"), cwd=REPO, env=_env(), capture_output=True,
                              text=True, timeout=400)
    assert straight.returncode == 0, straight.stderr[-3000:]

    out = tmp_path / "run"
    code, log = _interrupted(tiny, out, lambda proc: os.killpg(proc.pid, signal.SIGINT))  # as Ctrl-C: the group
    assert code == 0, log[-3000:]
    assert "Traceback" not in log and "SignalException" not in log, log[-3000:]
    found = LINE.findall(log)
    assert len(found) == 1, log[-3000:]
    step, checkpoint = int(found[0][0]), found[0][1]
    assert 2 <= step < 8 and json.loads((out / "summary.json").read_text())["stopped"], log[-3000:]
    assert state.latest_checkpoint(out / "checkpoints") == state.latest_checkpoint(checkpoint.rsplit("/", 1)[0]) \
        and checkpoint.endswith(f"step-{step:08d}"), log[-3000:]

    again = subprocess.run(_launch(tiny, out), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr and "Traceback" not in again.stderr
    ours, theirs = _losses(out), _losses(tmp_path / "straight")
    assert [s for s, _ in ours] == [s for s, _ in theirs] == list(range(1, 9))
    close([loss for _, loss in ours], [loss for _, loss in theirs], 1e-6, "loss curve after the resume")


def test_sigterm_to_the_launcher_alone_is_passed_on_to_the_workers(tiny, tmp_path):  # noqa: F811
    """A scheduler may signal the launcher only: it passes SIGTERM on, the workers save and the job exits 0."""
    out = tmp_path / "run"
    code, log = _interrupted(tiny, out, lambda proc: proc.send_signal(signal.SIGTERM))  # the launcher's pid only
    assert code == 0 and "Traceback" not in log and len(LINE.findall(log)) == 1, log[-3000:]
    assert json.loads((out / "summary.json").read_text())["stopped"]
