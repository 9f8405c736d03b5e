"""Fine-tuning end to end: runs on a mesh whose HF export transformers loads with the same logits, exact resume on a
mesh, other causal families, BERT and ViT classification, the options (mixed precision, checkpointing, offload,
epochs) and Ctrl-C through the command line."""
import json
import re
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from distributed import run_distributed
from parity import close
from test_finetune import REPO, SENTIMENT, STORIES, losses, small_run, tiny  # noqa: F401 (tiny: the fixture)

from colozoo.demo_finetune import build_tokenizer
from colozoo.finetune import data as D
from colozoo.finetune import state
from colozoo.finetune.loop import finetune
from colozoo.finetune.metrics import read_metrics


# ------------------------------------------------------------------------------------------- end to end


def _e2e(model, output, tp):
    summary = finetune(small_run(model, output, tp=tp, steps=8, export_hf=True, plot=True, lr=5e-3))
    return summary, losses(output)


def _check_export(output, auto_class="AutoModelForCausalLM"):
    """The exported HF directory's logits on the probe batch equal the fine-tuned model's; returns the difference."""
    import transformers

    probe = torch.load(Path(output) / "probe.pt")
    hf = getattr(transformers, auto_class).from_pretrained(str(Path(output) / "hf")).eval()
    with torch.no_grad():
        logits = hf(**probe["inputs"]).logits
    close(logits, probe["logits"], 1e-5, f"logits of the export in {output}")
    return (logits - probe["logits"]).abs().max().item()


def test_end_to_end_tp2_export_matches_transformers(tiny, tmp_path):
    out = tmp_path / "tp2"
    (summary, curve), _ = run_distributed(_e2e, 2, model=tiny, output=out, tp=2, timeout=240)
    assert summary["export"] and (out / "loss.png").exists() and summary["eval_ppl"] > 1
    assert curve[-1] < curve[0]
    _check_export(out)


def _resume_distributed(model, root, degrees):
    straight, resumed = Path(root) / "straight", Path(root) / "resumed"
    finetune(small_run(model, straight, **degrees))
    first = finetune(small_run(model, resumed, stop_after=3, **degrees))
    finetune(small_run(model, resumed, **degrees))
    return first["step"], losses(straight), losses(resumed)


@pytest.mark.parametrize("degrees", [dict(pp=2, global_batch_size=4), dict(dp=2, data_parallel="fsdp")],
                         ids=["pp2", "dp2_fsdp"])
def test_resume_is_exact_on_a_mesh(degrees, tiny, tmp_path):
    stopped_at, straight, resumed = run_distributed(_resume_distributed, 2, model=tiny, root=tmp_path, degrees=degrees,
                                                    timeout=240)[0]
    assert stopped_at == 3 and len(straight) == 6
    assert resumed == straight


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_other_causal_lm_families_fine_tune_and_export(family, tmp_path):
    from eval_model import EXTRAS

    from colozoo.demo_finetune import make_tiny_causal_lm

    model = make_tiny_causal_lm(tmp_path / family, family, layers=2, positions=32, **EXTRAS[family](64))
    out = tmp_path / "run"
    summary = finetune(small_run(model, out, steps=4, lr=5e-3, export_hf=True))
    curve = losses(out)
    assert summary["step"] == 4 and curve[-1] < curve[0]
    _check_export(out)


def test_command_line_parses_every_option_and_reports_bad_input_in_one_line(tiny, tmp_path, capsys):
    import argparse

    from colozoo.finetune import add_parser, main
    from colozoo.finetune.config import config_from_args

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["finetune", "--model", "m", "--data", "d.jsonl", "--tp", "2", "--no-pack",
                              "--dtype", "bfloat16", "--global-batch-size", "16", "--activation-checkpointing"])
    cfg = config_from_args(args)
    assert (cfg.tp, cfg.pack, cfg.dtype, cfg.global_batch_size, cfg.activation_checkpointing) == \
        (2, False, "bfloat16", 16, True)
    assert main(["--model", str(tiny), "--data", str(tmp_path / "none.jsonl"), "--seq-len", "16",
                 "--output", str(tmp_path / "o")],
                task="lm") == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: dataset") and "does not exist" in err


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A BertModel checkpoint (no classifier, like a sentence encoder; dropout off) and 16 labelled sentences."""
    import transformers

    base = tmp_path_factory.mktemp("bert")
    lines = SENTIMENT.read_text().splitlines(keepends=True)
    tok = build_tokenizer([json.loads(line)["text"] for line in lines], base)
    config = transformers.BertConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=32, pad_token_id=tok.pad_token_id,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(str(base))
    (base / "sentiment16.jsonl").write_text("".join(lines[:16]))
    return base


def _bert_run(base, output, degrees):
    subset = str(base / "sentiment16.jsonl")  # one global batch, seen every step: the loss must fall
    summary = finetune(small_run(base, output, task="seqcls", data=subset, eval_data=subset, micro_batch_size=8,
                                 global_batch_size=16, steps=6, lr=3e-3, eval_interval=0, export_hf=True, num_labels=2,
                                 **degrees))
    return summary, losses(output)


def test_bert_sequence_classification_from_a_base_checkpoint(tiny_bert, tmp_path):
    """The checkpoint has no classifier: the head starts fresh, learns the labels and is exported with the rest."""
    summary, curve = _bert_run(tiny_bert, tmp_path / "run", {})
    assert curve[-1] < curve[0] and summary["eval_acc"] > 0.5
    _check_export(tmp_path / "run", "AutoModelForSequenceClassification")


def _bert_on_meshes(base, root):
    return {name: _bert_run(base, Path(root) / name, degrees)[1]
            for name, degrees in {"tp2": dict(tp=2), "dp2": dict(dp=2)}.items()}


def test_bert_classification_on_tp2_and_dp2_matches_one_process(tiny_bert, tmp_path):
    _, single = _bert_run(tiny_bert, tmp_path / "single", {})
    curves = run_distributed(_bert_on_meshes, 2, base=tiny_bert, root=tmp_path, timeout=240)[0]
    for name, curve in curves.items():
        assert curve == pytest.approx(single, abs=2e-5), name
        _check_export(tmp_path / name, "AutoModelForSequenceClassification")


@pytest.fixture(scope="module")
def tiny_vit(tmp_path_factory):
    """A ViT classifier saved by transformers and 16 images whose class is their brightness: (model, npz)."""
    import transformers

    tmp_path = tmp_path_factory.mktemp("vit")
    base = tmp_path / "vit"
    config = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=128, num_labels=2,
                                    architectures=["ViTForImageClassification"])
    torch.manual_seed(0)
    transformers.ViTForImageClassification(config).save_pretrained(str(base))
    rng = np.random.default_rng(0)
    labels = np.arange(16) % 2
    images = rng.integers(0, 128, (16, 8, 8, 3)) + 127 * labels[:, None, None, None]  # class 1 is brighter
    np.savez(tmp_path / "images.npz", images=images.astype(np.uint8), labels=labels)
    return base, str(tmp_path / "images.npz")


def _vit_run(base, data, output, **overrides):
    options = dict(task="imgcls", data=data, eval_data=data, micro_batch_size=16, steps=6, lr=3e-3, eval_interval=0)
    return finetune(small_run(base, output, **{**options, **overrides}))


def test_vit_image_classification_from_npz(tiny_vit, tmp_path):
    base, data = tiny_vit
    out = tmp_path / "run"
    summary = _vit_run(base, data, out, export_hf=True)
    curve = losses(out)
    assert curve[-1] < curve[0] and summary["eval_acc"] > 0.5
    _check_export(out, "AutoModelForImageClassification")


# ------------------------------------------------------------------------------------------- options end to end


def _watch_training(monkeypatch) -> dict:
    """Record, during training, the trained model, the parameters' dtypes, the output dtype of the first layer's
    first matmul, and how often the first layer's first block runs (twice per micro-batch when recomputed)."""
    from colozoo.finetune import runtime

    seen = {"matmul_dtypes": set(), "block_calls": 0}
    prepare = runtime.prepare_training

    def count(*_):
        seen["block_calls"] += 1

    def watched(model, cfg):
        step_options = prepare(model, cfg)
        layer = next(iter(model.layers.values()))
        matmul = next(m for m in layer.modules() if getattr(m, "weight", None) is not None and m.weight.dim() == 2)
        matmul.register_forward_hook(lambda m, args, out: seen["matmul_dtypes"].add(out.dtype))
        next(iter(layer.children())).register_forward_hook(count)
        seen["model"], seen["param_dtypes"] = model, {p.dtype for p in model.parameters()}
        return step_options

    monkeypatch.setattr(runtime, "prepare_training", watched)
    return seen


@pytest.mark.parametrize("task", ["lm", "seqcls", "imgcls"])
def test_bfloat16_trains_in_mixed_precision(task, tiny, tiny_bert, tiny_vit, tmp_path, monkeypatch):
    """--dtype bfloat16 computes in bf16 over fp32 weights, for every task, and the loss still falls."""
    seen = _watch_training(monkeypatch)
    out = tmp_path / "run"
    options = dict(dtype="bfloat16", eval_fraction=0.0)
    if task == "lm":
        finetune(small_run(tiny, out, lr=5e-3, **options))
    elif task == "seqcls":
        subset = str(tiny_bert / "sentiment16.jsonl")
        finetune(small_run(tiny_bert, out, task="seqcls", data=subset, micro_batch_size=16, lr=3e-3, num_labels=2,
                           **options))
    else:
        _vit_run(*tiny_vit, out, eval_data=None, **options)
    assert seen["model"].run.setup.mixed_precision == "bf16"
    assert seen["matmul_dtypes"] == {torch.bfloat16} and seen["param_dtypes"] == {torch.float32}
    curve = losses(out)
    assert len(curve) == 6 and curve[-1] < curve[0]


def test_activation_checkpointing_recomputes_layers_and_keeps_the_loss_curve(tiny, tmp_path, monkeypatch):
    runs = {}
    for checkpointing in (True, False):
        seen = _watch_training(monkeypatch)
        out = tmp_path / f"checkpointing-{checkpointing}"
        finetune(small_run(tiny, out, activation_checkpointing=checkpointing, eval_interval=0))
        runs[checkpointing] = seen["block_calls"], losses(out)
        monkeypatch.undo()
    assert runs[True][0] - runs[False][0] == 6  # each of the 6 steps (one micro-batch) runs the layer again
    assert len(runs[True][1]) == 6
    assert runs[True][1] == pytest.approx(runs[False][1], abs=1e-6)  # dropout included: the same random draws


def test_optimizer_offload_keeps_the_loss_curve(tiny, tmp_path, monkeypatch):
    from colozoo.finetune import runtime

    built, build = [], runtime.build_optimizer
    monkeypatch.setattr(runtime, "build_optimizer", lambda *a: built.append(build(*a)) or built[-1])
    curves = {}
    for offload in ("optimizer", "none"):
        out = tmp_path / offload
        finetune(small_run(tiny, out, offload=offload, eval_interval=0, save_interval=3))
        curves[offload] = losses(out), [r["lr"] for r in read_metrics(out / "metrics.jsonl") if "lr" in r]
    assert [type(o).__name__ for o in built] == ["OffloadedAdamW", "AdamW"]
    assert curves["optimizer"][1] == curves["none"][1]  # the schedule drives the CPU AdamW's learning rate
    assert curves["optimizer"][0] == pytest.approx(curves["none"][0], abs=1e-5)
    resumed = tmp_path / "resumed"  # the offloaded optimizer's state round-trips through a checkpoint
    stopped = finetune(small_run(tiny, resumed, offload="optimizer", eval_interval=0, save_interval=3, stop_after=3))
    assert stopped["stopped"]
    finetune(small_run(tiny, resumed, offload="optimizer", eval_interval=0, save_interval=3))
    assert losses(resumed) == curves["optimizer"][0]


def test_epochs_set_the_number_of_steps(tiny, tmp_path):
    data = tmp_path / "stories12.jsonl"
    data.write_text("".join(STORIES.read_text().splitlines(keepends=True)[:12]))
    tok = D.load_tokenizer(tiny, 131)
    train, _ = D.lm_dataset(data, tok, seq_len=16).split(0.1)
    steps_per_epoch = len(train) // 4
    assert steps_per_epoch >= 2
    summary = finetune(small_run(tiny, tmp_path / "run", data=str(data), steps=None, epochs=1.5, micro_batch_size=4,
                                 eval_interval=0, save_interval=0))
    assert summary["total_steps"] == int(1.5 * steps_per_epoch) and summary["step"] == summary["total_steps"]
    assert len(losses(tmp_path / "run")) == summary["total_steps"]


def _command(model, output, *extra):
    return [sys.executable, "-m", "colozoo.finetune", "--model", str(model), "--data", str(STORIES),
            "--output", str(output), "--seq-len", "16", "--steps", "100000", "--save-interval", "0",
            "--eval-fraction", "0", "--no-export-hf", "--no-plot", *extra]


def test_ctrl_c_saves_exits_cleanly_and_the_same_command_resumes(tiny, tmp_path):
    """A real run (no terminal: plain progress lines) is sent SIGINT after its first logged step."""
    import subprocess

    from interrupt import clean_env, interrupted

    out = tmp_path / "run"
    code, log = interrupted(_command(tiny, out), "step 1/", lambda proc: proc.send_signal(signal.SIGINT), timeout=120)
    assert code == 0, log
    assert "running on CPU" in log
    assert re.search(r"^step 1/100000  loss \d+\.\d{4}  lr \S+  [\d,]+ tok/s \([\d,]+ trained\)  MFU \d+\.\d%  "
                     r"ETA \d+:\d\d:\d\d$",
                     log, re.M), log
    stopped = json.loads((out / "summary.json").read_text())
    assert stopped["stopped"] and stopped["step"] >= 1
    assert f"interrupted at step {stopped['step']}/100000, saved to {stopped['checkpoint']}; rerun the same command " \
           f"to resume" in log, log
    assert state.latest_checkpoint(out / "checkpoints").name == f"step-{stopped['step']:08d}"

    again = subprocess.run(_command(tiny, out, "--stop-after", str(stopped["step"] + 1)), cwd=REPO, env=clean_env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert f"at step {stopped['step']}" in again.stderr and "resumed from" in again.stderr
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, stopped["step"] + 2))


def _classifiers_on_pp2(bert, vit, images, root):
    bert_curve = _bert_run(bert, Path(root) / "bert", dict(pp=2))[1]
    _vit_run(vit, images, Path(root) / "vit", pp=2, micro_batch_size=8, global_batch_size=16, export_hf=True)
    return bert_curve, losses(Path(root) / "vit")


def test_classification_on_pp2_matches_one_process(tiny_bert, tiny_vit, tmp_path):
    _, bert_single = _bert_run(tiny_bert, tmp_path / "bert-single", {})
    _vit_run(*tiny_vit, tmp_path / "vit-single", micro_batch_size=8, global_batch_size=16)
    bert_pp2, vit_pp2 = run_distributed(_classifiers_on_pp2, 2, tiny_bert, *tiny_vit, tmp_path / "pp2", timeout=240)[0]
    assert bert_pp2 == pytest.approx(bert_single, abs=2e-5)
    assert vit_pp2 == pytest.approx(losses(tmp_path / "vit-single"), abs=2e-5)
    _check_export(tmp_path / "pp2" / "bert", "AutoModelForSequenceClassification")
    _check_export(tmp_path / "pp2" / "vit", "AutoModelForImageClassification")
