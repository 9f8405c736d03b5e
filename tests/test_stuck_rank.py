"""A rank stuck outside a collective ends the whole job within the configured timeout, with a message that names
the collective, instead of hanging every other rank. Real processes under torchrun."""
import os
import subprocess
import sys
import time

SCRIPT = """
import os, time
import torch, torch.distributed as dist
import colozoo
pc = colozoo.init_parallel(dp=2)
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
