"""A rank stuck outside a collective ends the whole job within the configured timeout, with a message that names
the collective, instead of hanging every other rank. Real processes under torchrun."""
import os
import re
import subprocess
import sys
import time

SCRIPT = """
import os, time
import torch, torch.distributed as dist
import colozoo
parallel = colozoo.init_parallel(dp=2)
if dist.get_rank() == 1:
    time.sleep(120)          # stuck: never joins the all-reduce
dist.all_reduce(torch.ones(4))
print("finished", flush=True)
"""


def test_a_rank_stuck_outside_a_collective_ends_the_job_within_the_timeout(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, COLOZOO_COLLECTIVE_TIMEOUT="4", OMP_NUM_THREADS="1")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], env=env, capture_output=True, text=True, timeout=100)
    elapsed = time.monotonic() - started
    assert done.returncode != 0 and "finished" not in done.stdout
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end with a 4 s collective timeout"
    assert "Timed out" in done.stderr and "all_reduce" in done.stderr, done.stderr[-2000:]


def test_a_bad_timeout_setting_is_one_clear_error(monkeypatch):
    import pytest

    from colozoo.core.mesh import ParallelConfigError, collective_timeout

    monkeypatch.setenv("COLOZOO_COLLECTIVE_TIMEOUT", "soon")
    with pytest.raises(ParallelConfigError, match="COLOZOO_COLLECTIVE_TIMEOUT must be a number of seconds"):
        collective_timeout()
    monkeypatch.setenv("COLOZOO_COLLECTIVE_TIMEOUT", "2.5")
    assert collective_timeout().total_seconds() == 2.5


# --- the fine-tuning watchdog: which rank, its last step and collective ------------------------------------------

WATCHED = """
import os, signal, sys, time
import torch, torch.distributed as dist
from colozoo.core.mesh import init_distributed
from colozoo.finetune.watchdog import Watchdog, process_group_timeout

init_distributed(process_group_timeout(3.0))
with Watchdog(3.0, job="test") as watchdog:
    for step in range(1, 1000):
        watchdog.at(step, "training")
        if dist.get_rank() == 0:
            time.sleep(0.05)  # rank 1 waits for it in the all-reduce, where its heartbeats see it
        dist.all_reduce(torch.ones(4))
        if dist.get_rank() == 1 and step == 20:
            print("stopping", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen: no heartbeat, no signal handled, no exit
print("finished", flush=True)
"""


def test_a_stopped_rank_is_named_with_its_last_step_and_collective_within_the_timeout(tmp_path):
    script = tmp_path / "watched.py"
    script.write_text(WATCHED)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(script)], env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    log, stopped = [], None
    try:
        for line in proc.stdout:
            log.append(line)
            if line.startswith("stopping"):
                stopped = time.monotonic()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(log)
    assert stopped is not None and proc.returncode != 0 and "finished" not in text, text[-3000:]
    waited = time.monotonic() - stopped
    assert waited < 20, f"the job took {waited:.0f} s to end after rank 1 stopped, with a 3 s timeout: {text[-3000:]}"
    assert re.search(r"error: rank 1 is stuck: no heartbeat \(stopped or frozen\); last seen at step \d+ "
                     r"\(training\), last collective all_reduce, .*\(rank 0 waited \d+ s in all_reduce at step 21; "
                     r"--collective-timeout 3\); ending the job", text), text[-3000:]


def test_the_stuck_rank_is_the_frozen_one_else_the_one_outside_a_collective_else_the_one_behind():
    from colozoo.finetune.watchdog import Beat, find_stuck

    def beat(rank, n, progress=5, collective="all_reduce"):
        return Beat(rank, n, progress, 3, "training", collective, "all_reduce", "step (loop.py:1)", "host", 1)

    me = beat(0, 9)
    assert find_stuck(me, {1: beat(1, 4), 2: beat(2, 4)}, {1: beat(1, 4), 2: beat(2, 7)}) == \
        [(1, "no heartbeat (stopped or frozen)")]
    assert find_stuck(me, {1: None}, {1: None}) == [(1, "no heartbeat (stopped or frozen)")]
    assert find_stuck(me, {1: beat(1, 4), 2: beat(2, 4)}, {1: beat(1, 6), 2: beat(2, 7, collective=None)}) == \
        [(2, "outside any collective, in step (loop.py:1)")]
    assert find_stuck(me, {1: beat(1, 4)}, {1: beat(1, 6, progress=4, collective="barrier")}) == \
        [(1, "behind, in barrier at step (loop.py:1)")]
    assert find_stuck(me, {1: beat(1, 4)}, {1: beat(1, 6)}) == []  # every rank waits alike: nothing to name


def test_the_collective_timeout_is_a_finetune_option_defaulting_to_the_environment(monkeypatch, capsys):
    import pytest

    from colozoo import cli
    from colozoo.finetune import FinetuneConfig
    from colozoo.finetune.watchdog import process_group_timeout

    with pytest.raises(ValueError, match="--collective-timeout must be > 0 seconds, got 0"):
        FinetuneConfig(model="m", data="d", collective_timeout=0)
    with pytest.raises(SystemExit):
        cli.main(["finetune", "--help"])
    assert "--collective-timeout" in capsys.readouterr().out
    assert process_group_timeout(600) > 600 + 4 * 5  # the watchdog (timeout and four 5 s heartbeats) speaks first
