"""Every rank's error reaches the user: the first failing rank's one line (with its rank) is what the job prints, and
the ranks whose collectives then fail say they follow it, instead of gloo's `Connection closed by peer`."""
import json
import re
import shutil
import subprocess
import sys

import pytest
from interrupt import REPO, clean_env, finetune_argv

from colozoo.runtime import failures

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def store():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def test_the_first_failure_is_said_once_and_the_others_follow_it(store, tmp_path, monkeypatch):
    mismatch = ValueError("checksum mismatch in run/state-rank-00001.safetensors\n(more detail)")
    line, first = failures.line_for(mismatch, 1, store, expected=True)
    assert line == "error: rank 1: checksum mismatch in run/state-rank-00001.safetensors" and first.rank == 1
    closed = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:32664")
    line, follower = failures.line_for(closed, 0, store, expected=False)
    assert line == "rank 0: stopped because rank 1 failed (see above)" and follower.time > first.time
    same, _ = failures.line_for(ValueError(str(mismatch)), 2, store, expected=True)
    assert same is None  # every rank refused the same: said once
    other, _ = failures.line_for(ValueError("dataset x does not exist"), 3, store, expected=True)
    assert other == "error: rank 3: dataset x does not exist"

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    failures.write_error_file(follower)
    written = json.loads((tmp_path / "error.json").read_text())["message"]
    assert written["message"] == "rank 0: stopped because rank 1 failed (see above)"
    assert int(written["extraInfo"]["timestamp"]) >= int(first.time)  # torchrun's root cause stays rank 1's


def test_torchrun_stopping_a_rank_after_another_failed_is_said_as_following_it(store):
    import os
    import signal

    failures.claim_first(store, 1, "checksum mismatch in run/state-rank-00001.safetensors")
    with pytest.raises(failures.Terminated) as stopped, failures.terminated_raises():
        os.kill(os.getpid(), signal.SIGTERM)  # what torchrun sends the other ranks once one failed
        signal.pause()
    assert failures.line_for(stopped.value, 0, store, expected=True)[0] == \
        "rank 0: stopped because rank 1 failed (see above)"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_alone_a_transport_error_is_its_own(store, monkeypatch):
    monkeypatch.setattr(failures, "PEER_WAIT_S", 0.2)
    closed = RuntimeError("Connection reset by peer")
    assert failures.line_for(closed, 0, None, expected=False)[0] == "error: RuntimeError: Connection reset by peer"
    line, first = failures.line_for(closed, 0, store, expected=False)  # no earlier failure recorded anywhere
    assert line == "error: rank 0: RuntimeError: Connection reset by peer" and first.rank == 0


def test_a_corrupted_shard_of_rank_1_is_the_line_the_launched_job_prints(launched_model, straight_tp2, tmp_path):
    run = shutil.copytree(straight_tp2, tmp_path / "run")  # a run of 8 steps at tp=2: each rank's pieces in its file
    shard = run / "checkpoints" / "step-00000008" / "state-rank-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # same size: only its checksum can tell, and only rank 1 reads it
    shard.write_bytes(bytes(data))
    command = [sys.executable, "-m", "colozoo.cli", "finetune", "--nproc-per-node", "2",
               *finetune_argv(launched_model, run, "--no-progress")]
    done = subprocess.run(command, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=240)
    log = done.stdout + done.stderr
    assert done.returncode == 1, log[-3000:]
    errors = [line for line in log.splitlines() if "error:" in line]
    assert len(errors) == 1 and re.fullmatch(
        rf"error: rank 1: cannot resume from \S+: checksum mismatch in {re.escape(str(shard))}: .*", errors[0]), \
        log[-3000:]
    assert "\nrank 0: stopped because rank 1 failed (see above)\n" in log, log[-3000:]
    assert "Connection closed by peer" not in log and "Traceback" not in log, log[-3000:]
    assert log.rstrip().endswith("colozoo finetune: 2 of 2 processes failed (first exit code 1); the first error is "
                                 "above"), log[-3000:]
