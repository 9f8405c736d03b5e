"""A scheduler's SIGTERM to a torchrun job at tp=2: every rank finishes its step, saves and exits; the same command
then resumes, and the loss curve equals an uninterrupted run's on the same mesh (real processes for the interrupted
run and its resume)."""
import json
import signal
import socket
import subprocess
import sys

from interrupt import REPO, clean_env, finetune_argv, interrupted, losses
from parity import close

from colozoo.finetune import state


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(model, output, *extra):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
            str(_free_port()), "-m", "colozoo.finetune", *finetune_argv(model, output, *extra)]


def test_sigterm_at_tp2_saves_and_the_same_command_resumes_the_loss_curve(launched_model, straight_tp2,
                                                                           tmp_path):
    out = tmp_path / "run"
    # what a scheduler sends torchrun; it forwards it to every rank
    _, log = interrupted(_torchrun(launched_model, out), "step 3/", lambda proc: proc.send_signal(signal.SIGTERM))
    stopped = json.loads((out / "summary.json").read_text())
    assert stopped["stopped"] and 3 <= stopped["step"] < 8, log[-3000:]
    assert state.latest_checkpoint(out / "checkpoints").name == f"step-{stopped['step']:08d}", log[-3000:]

    again = subprocess.run(_torchrun(launched_model, out), cwd=REPO, env=clean_env(), capture_output=True, text=True,
                           timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr
    ours, theirs = losses(out), losses(straight_tp2)
    assert [s for s, _ in ours] == [s for s, _ in theirs] == list(range(1, 9))
    close([loss for _, loss in ours], [loss for _, loss in theirs], 1e-6, "loss curve after the resume")
