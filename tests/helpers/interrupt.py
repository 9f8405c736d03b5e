"""Real fine-tuning processes interrupted as a terminal (Ctrl-C) or a scheduler (SIGTERM) would: shared by the tests
of clean stops and exact resumes."""
import os
import signal
import subprocess
from pathlib import Path

from colozoo.finetune.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]


def clean_env() -> dict:
    """This environment without a surrounding job's rank variables, one thread per process."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    return dict({k: v for k, v in os.environ.items() if k not in drop}, OMP_NUM_THREADS="1")


def interrupted(command, marker: str, interrupt, group: bool = False, timeout: float = 300) -> tuple[int, str]:
    """Run `command`, call `interrupt(process)` once a line starts with `marker`; (exit code, everything printed).
    `group`: its own process group, as a terminal's foreground job (Ctrl-C reaches the whole group)."""
    proc = subprocess.Popen(command, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=group)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(marker):
                interrupt(proc)
                break
        lines += proc.stdout.readlines()
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL) if group else proc.kill()
    return code, "".join(lines)


def losses(output) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(output / "metrics.jsonl") if "loss" in r]
