"""`colozoo plan --validate --plot PNG`: each run's error against its measured step time, the misses named."""
import json

import pytest

from colozoo.cli import main
from colozoo.cost.published import _run
from colozoo.cost.validate import validate
from colozoo.cost.validate_plot import points

ROW = {"source": "a test", "hardware": "A100-80GB", "gpus": 8, "dtype": "bfloat16", "group": "tests",
       "model": {"family": "gpt2", "hidden": 1024, "layers": 4, "heads": 8, "vocab": 4096, "seq": 1024},
       "layout": {"dp": 8, "micro_batch": 4, "global_batch": 32}}


def _rows(tmp_path):
    """Two runs: one measured as predicted, one measured at half the prediction (predicted 100% slow)."""
    truth = validate([_run({**ROW, "id": "probe", "measured": {"unit": "step_seconds", "value": 1.0}}, {}, {})])
    seconds = truth[0].predicted_seconds
    rows = [{**ROW, "id": "on-time", "measured": {"unit": "step_seconds", "value": seconds}},
            {**ROW, "id": "twice-as-fast", "held_out": True, "measured": {"unit": "step_seconds", "value": seconds / 2}}]
    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"software": {}, "runs": rows}))
    return path, rows, seconds


def test_points_carry_each_runs_error_and_miss(tmp_path):
    _, rows, seconds = _rows(tmp_path)
    got = points(validate([_run(row, {}, {}) for row in rows]))
    assert [(p["id"], p["held_out"], p["miss"]) for p in got] == [("on-time", False, False),
                                                                   ("twice-as-fast", True, True)]
    assert [p["measured_seconds"] for p in got] == pytest.approx([seconds, seconds / 2])
    assert [p["error"] for p in got] == pytest.approx([0.0, 1.0], abs=1e-9)


def test_validate_plot_writes_a_png(tmp_path, capsys):
    path, _, _ = _rows(tmp_path)
    png = tmp_path / "validation.png"
    assert main(["plan", "--validate", "--runs", str(path), "--plot", str(png)]) == 1  # the miss still fails
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"plot: {png}" in capsys.readouterr().err
