"""`make demo` as a user runs it: a GPT-2 converted to tp2 x pp2, fine-tuned by 4 processes under torchrun's
launcher, exported to HF, and the export's logits checked against the colozoo model's."""
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_demo_fine_tunes_on_tp2_pp2_and_its_export_matches(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-m", "colozoo.demo_finetune", "--workdir", str(tmp_path / "demo"),
                           "--steps", "12"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "sharded tp=2 x pp=2" in out and "4 processes (--nproc-per-node 4), tp=2 pp=2 dp=1" in out
    first, last = map(float, re.search(r"train loss (\d+\.\d+) -> (\d+\.\d+)", out).groups())
    assert last < first
    assert re.search(r"max \|logits difference\| = \S+  \(match\)", out), out
    assert (tmp_path / "demo" / "run" / "hf" / "config.json").exists()
