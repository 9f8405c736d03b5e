"""A scheduler's SIGTERM to a torchrun job at tp=2: every rank finishes its step, saves and exits; the same command
then resumes, and the loss curve equals an uninterrupted run's on the same mesh (real processes throughout)."""
import json
import os
import signal
import socket
import subprocess
import sys

from parity import close
from test_finetune import REPO, STORIES, tiny  # noqa: F401 (tiny is a fixture)

from colozoo.finetune import state
from colozoo.finetune.metrics import read_metrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(model, output, *extra):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
            str(_free_port()), "-m", "colozoo.finetune", "--model", str(model), "--data", str(STORIES),
            "--output", str(output), "--seq-len", "16", "--steps", "8", "--lr", "1e-2", "--tp", "2",
            "--save-interval", "0", "--eval-fraction", "0", "--no-export-hf", "--no-plot", *extra]


def _losses(output):
    return [(r["step"], r["loss"]) for r in read_metrics(output / "metrics.jsonl") if "loss" in r]


def test_sigterm_at_tp2_saves_and_the_same_command_resumes_the_loss_curve(tiny, tmp_path):  # noqa: F811
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    straight = subprocess.run(_torchrun(tiny, tmp_path / "straight"), cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=400)
    assert straight.returncode == 0, straight.stderr[-3000:]

    out = tmp_path / "run"
    proc = subprocess.Popen(_torchrun(tiny, out), cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("step 3/"):
                proc.send_signal(signal.SIGTERM)  # what a scheduler sends torchrun; it forwards it to every rank
                break
        lines += proc.stderr.readlines()
        proc.wait(timeout=300)
    finally:
        proc.kill()
    log = "".join(lines)
    stopped = json.loads((out / "summary.json").read_text())
    assert stopped["stopped"] and 3 <= stopped["step"] < 8, log[-3000:]
    assert state.latest_checkpoint(out / "checkpoints").name == f"step-{stopped['step']:08d}", log[-3000:]

    again = subprocess.run(_torchrun(tiny, out), cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr
    ours, theirs = _losses(out), _losses(tmp_path / "straight")
    assert [s for s, _ in ours] == [s for s, _ in theirs] == list(range(1, 9))
    close([loss for _, loss in ours], [loss for _, loss in theirs], 1e-6, "loss curve after the resume")
