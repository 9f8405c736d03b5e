"""Real fine-tuning processes interrupted as a terminal (Ctrl-C) or a scheduler (SIGTERM) would: shared by the tests
of clean stops and exact resumes."""
import os
import signal
import subprocess
from pathlib import Path

import pytest
from distributed import run_distributed

from colozoo.finetune.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
STORIES = REPO / "data" / "stories.jsonl"


def finetune_argv(model, output, *extra) -> list[str]:
    """The options of an 8-step tp=2 run on the stories, after `finetune` (whatever launches it)."""
    return ["--model", str(model), "--data", str(STORIES), "--output", str(output), "--seq-len", "16", "--steps", "8",
            "--lr", "1e-2", "--tp", "2", "--save-interval", "0", "--eval-fraction", "0", "--no-export-hf",
            "--no-plot", *extra]


@pytest.fixture(scope="session")
def launched_model(tmp_path_factory):
    """The tiny GPT-2 (dropout on, so a resume must restore the RNG) every launcher test trains."""
    from colozoo.demo_finetune import make_tiny_gpt2

    return make_tiny_gpt2(tmp_path_factory.mktemp("gpt2"), n_layer=2, n_positions=32,
                          resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)


def _finetune_from_argv(argv):
    import argparse

    from colozoo.finetune import add_parser
    from colozoo.finetune.config import config_from_args
    from colozoo.finetune.loop import finetune

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    finetune(config_from_args(parser.parse_args(["finetune", *argv])))


@pytest.fixture(scope="session")
def straight_tp2(launched_model, tmp_path_factory):
    """The uninterrupted run interrupted launches must reproduce: the same options on two gloo ranks of this test
    process's pool (a launch of its own would cost the start of three more interpreters)."""
    out = tmp_path_factory.mktemp("straight-tp2")
    run_distributed(_finetune_from_argv, 2, argv=finetune_argv(launched_model, out), timeout=240)
    return out


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
