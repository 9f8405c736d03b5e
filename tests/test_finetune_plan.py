"""`colozoo finetune --plan auto`: the planner picks the mesh and micro-batching for the run's global batch, the
loop trains on it (a causal LM, and a BERT classifier with its fresh head), and explicit degrees alongside it are
refused in one line."""
import json
from pathlib import Path

import pytest

from distributed import run_distributed
from test_finetune import losses, small_run, tiny  # noqa: F401 (fixtures)
from test_finetune_end_to_end import tiny_bert  # noqa: F401 (a fixture)

from colozoo.finetune import main, state
from colozoo.finetune.config import FinetuneConfig
from colozoo.finetune.loop import finetune


def _planned_runs(lm, bert, root):
    root = Path(root)
    finetune(small_run(lm, root / "lm", plan="auto", global_batch_size=4, lr=5e-3, dtype="float16"))
    subset = str(bert / "sentiment16.jsonl")
    finetune(small_run(bert, root / "bert", plan="auto", task="seqcls", data=subset, eval_data=subset,
                       global_batch_size=16, lr=3e-3, eval_interval=0, num_labels=2))
    return {name: losses(root / name) for name in ("lm", "bert")}


def test_plan_auto_plans_the_mesh_and_trains(tiny, tiny_bert, tmp_path):  # noqa: F811
    curves = run_distributed(_planned_runs, 2, lm=tiny, bert=tiny_bert, root=tmp_path, timeout=240)[0]
    for name, global_batch in (("lm", 4), ("bert", 16)):
        curve = curves[name]
        assert len(curve) == 6 and curve[-1] < curve[0], name
        saved = json.loads((tmp_path / name / "config.json").read_text())
        plan = saved["planned"]
        assert saved["plan"] == "auto" and plan["tp"] * plan["pp"] * plan["dp"] == 2, plan
        assert plan["dp"] * plan["micro_batch_size"] * plan["num_microbatches"] == global_batch, plan
        meta = json.loads((state.latest_checkpoint(tmp_path / name / "checkpoints") / "meta.json").read_text())
        assert meta["mesh"] == {k: plan[k] for k in ("tp", "pp", "dp", "cp", "ep")}  # trained on the planned mesh


@pytest.mark.parametrize("flags", [dict(tp=2), dict(dp=1, data_parallel="ddp"), dict(activation_checkpointing=True)])
def test_plan_auto_with_explicit_degrees_is_refused(flags):
    with pytest.raises(ValueError, match=r"--plan auto chooses .* itself; drop --"):
        FinetuneConfig(model="m", data="d.jsonl", plan="auto", **flags)


def test_plan_auto_conflict_on_the_command_line_is_one_line(tiny, tmp_path, capsys):  # noqa: F811
    code = main(["--model", str(tiny), "--data", "d.jsonl", "--output", str(tmp_path / "o"), "--plan", "auto",
                 "--tp", "2", "--pp", "2"], task="lm")
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.count("\n") == 0 and "drop --tp, --pp" in err
    assert not (tmp_path / "o").exists()


def test_plan_auto_plans_for_lora(tiny, tmp_path, monkeypatch):  # noqa: F811
    """--plan auto --lora-r: the planner prices LoRA training (adapters only), and the run trains its adapters."""
    import colozoo.cost.planner as planner

    calls = []

    def recording_plan(model, hardware, workload, *args, **kwargs):
        calls.append(workload)
        return real_plan(model, hardware, workload, *args, **kwargs)

    real_plan = planner.plan
    monkeypatch.setattr(planner, "plan", recording_plan)
    summary = finetune(small_run(tiny, tmp_path / "lora", plan="auto", global_batch_size=2, lora_r=4,
                                 lora_targets="c_attn", eval_interval=0))
    assert len(calls) == 1 and (calls[0].lora.r, calls[0].lora.targets) == (4, ("c_attn",)), calls
    assert summary["step"] == 6 and Path(summary["adapter"], "adapter_config.json").exists()
