"""colozoo finetune with LoRA and chat data: the options, exact resume with adapters (the optimizer holds them only),
PEFT adapters with every checkpoint, TensorBoard scalars, and an end-to-end chat LoRA run at tp=2 whose adapter
(through peft) and merged export (through transformers) give the fine-tuned model's logits."""
import argparse
import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from chat_model import CHAT, make_chat_llama  # noqa: E402
from distributed import run_distributed  # noqa: E402
from parity import close  # noqa: E402

from colozoo.finetune import add_parser, state  # noqa: E402
from colozoo.finetune.config import FinetuneConfig, config_from_args  # noqa: E402
from colozoo.finetune.loop import finetune  # noqa: E402
from colozoo.finetune.metrics import read_metrics  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: resumes are compared bit for bit


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return make_chat_llama(tmp_path_factory.mktemp("chat-llama"))


def parse(argv: list[str]) -> FinetuneConfig:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return config_from_args(parser.parse_args(["finetune", *argv]))


def lora_run(model, output, *extra) -> FinetuneConfig:
    """The command line of a small chat LoRA run (dropout on, so resuming must restore the RNG)."""
    return parse(["--model", str(model), "--dataset", str(CHAT), "--output", str(output), "--chat", "--seq-len", "64",
                  "--micro-batch-size", "2", "--steps", "6", "--lr", "1e-2", "--warmup-steps", "2",
                  "--eval-interval", "3", "--eval-batches", "1", "--save-interval", "2", "--eval-fraction", "0.2",
                  "--lora-r", "4", "--lora-alpha", "8", "--lora-dropout", "0.1", "--no-progress", "--no-plot",
                  "--samples", "0", *extra])


def losses(output) -> list[float]:
    return [r["loss"] for r in read_metrics(Path(output) / "metrics.jsonl") if "loss" in r]


def test_command_line_lora_and_chat_options():
    cfg = parse(["--model", "m", "--dataset", "d.parquet", "--lora-r", "16", "--lora-alpha", "32", "--lora-targets",
                 "all-linear", "--lora-dropout", "0.05", "--lora-rslora", "--chat", "--merge", "--tensorboard", "tb"])
    assert (cfg.data, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_rslora, cfg.chat, cfg.merge,
            cfg.tensorboard) == ("d.parquet", 16, 32.0, 0.05, True, True, True, "tb")
    assert cfg.lora_target_modules() == "all-linear"
    assert parse(["--model", "m", "--data", "d", "--lora-r", "2", "--lora-targets", "q_proj, v_proj"]
                 ).lora_target_modules() == ("q_proj", "v_proj")
    with pytest.raises(ValueError, match="--merge needs LoRA: pass --lora-r"):
        parse(["--model", "m", "--data", "d", "--merge"])
    with pytest.raises(ValueError, match="--lora-r must be >= 1"):
        parse(["--model", "m", "--data", "d", "--lora-r", "0"])


@pytest.fixture(scope="module")
def straight(chat_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-straight")
    finetune(lora_run(chat_model, out, "--lora-targets", "q_proj,v_proj"))
    return out


def test_lora_resume_reproduces_the_uninterrupted_run(chat_model, straight, tmp_path):
    resumed = tmp_path / "resumed"
    first = finetune(lora_run(chat_model, resumed, "--lora-targets", "q_proj,v_proj", "--stop-after", "3"))
    assert first["stopped"] and first["step"] == 3
    checkpoint = state.latest_checkpoint(resumed / "checkpoints")
    optimizer_states = [n for n in json.loads((checkpoint / "training_index.json").read_text())["tensors"]]
    assert optimizer_states and all(".lora_" in n or ".lora." in n for n in optimizer_states), optimizer_states
    adapter = json.loads((checkpoint / "adapter" / "adapter_config.json").read_text())
    assert {n.rsplit(".", 1)[-1] for n in adapter["target_modules"]} == {"q_proj", "v_proj"} and adapter["r"] == 4
    second = finetune(lora_run(chat_model, resumed, "--lora-targets", "q_proj,v_proj"))
    assert second["step"] == 6 and len(losses(straight)) == 6
    assert losses(resumed) == losses(straight)  # bit for bit: adapters, their optimizer states and the RNG restored
    assert losses(straight)[-1] < losses(straight)[0]
    assert (resumed / "adapter" / "adapter_model.safetensors").exists() and not (resumed / "hf").exists()


def test_resume_without_the_adapters_is_refused(chat_model, straight, tmp_path):
    import shutil

    shutil.copytree(straight, tmp_path / "copy")
    cfg = lora_run(chat_model, tmp_path / "copy", "--steps", "8")
    cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout = None, None, 0.0
    with pytest.raises(ValueError, match="holds the training state of another model"):
        finetune(cfg)


def test_tensorboard_logs_the_metrics_scalars(chat_model, tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb-run"
    finetune(lora_run(chat_model, out, "--steps", "3", "--tensorboard", str(out / "tb")))
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    records = read_metrics(out / "metrics.jsonl")
    for tag in ("loss", "lr", "grad_norm", "tokens_per_s", "eval_loss"):
        expected = [(r["step"], r[tag]) for r in records if r.get(tag) is not None]
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        assert len(logged) == len(expected) > 0, tag
        for (step, value), (s, v) in zip(expected, logged):
            assert s == step and v == pytest.approx(value, rel=1e-6), tag  # TensorBoard stores float32
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    with pytest.raises(ValueError, match=r"^--tensorboard needs the tensorboard package: pip install tensorboard$"):
        finetune(lora_run(chat_model, tmp_path / "no-tb", "--tensorboard", str(tmp_path / "tb2")))
    assert not (tmp_path / "no-tb" / "checkpoints").exists()


def _e2e(model, output):
    cfg = lora_run(model, output, "--tp", "2", "--lora-r", "4", "--lora-dropout", "0", "--merge")
    summary = finetune(cfg)
    return summary, [r["eval_loss"] for r in read_metrics(Path(output) / "metrics.jsonl") if "eval_loss" in r]


def test_end_to_end_chat_lora_tp2_adapter_and_merged_export_match(chat_model, tmp_path):
    import peft
    import transformers

    out = tmp_path / "tp2"
    (summary, evals), _ = run_distributed(_e2e, 2, model=chat_model, output=out, timeout=300)
    assert summary["adapter"] and summary["export"] and evals[-1] < evals[0]
    probe = torch.load(out / "probe.pt")
    inputs, expected = probe["inputs"], probe["logits"]
    assert "position_ids" in inputs and "attention_mask" not in inputs  # packed rows, as trained
    inputs = dict(inputs, use_cache=False)  # transformers packs by position_ids only without a cache
    base = transformers.AutoModelForCausalLM.from_pretrained(str(chat_model)).eval()
    with torch.no_grad():
        untrained = base(**inputs).logits
        tuned = peft.PeftModel.from_pretrained(base, str(out / "adapter")).eval()
        with_adapter = tuned(**inputs).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(out / "hf")).eval()(**inputs).logits
    assert (untrained - expected).abs().max() > 1e-3  # the adapters changed the model
    close(with_adapter, expected, 1e-5, "peft with the exported adapter")  # packed rows: every position is a token
    close(merged, expected, 1e-5, "the merged export")
    assert transformers.AutoTokenizer.from_pretrained(str(out / "hf")).chat_template  # travels with the export


def _resume_on_mesh(model, root, mesh):
    straight, resumed = Path(root) / "straight", Path(root) / "resumed"
    finetune(lora_run(model, straight, *mesh))
    first = finetune(lora_run(model, resumed, *mesh, "--stop-after", "3"))
    finetune(lora_run(model, resumed, *mesh))
    return first["step"], losses(straight), losses(resumed), (resumed / "adapter" / "adapter_config.json").exists()


@pytest.mark.parametrize("mesh", [("--tp", "2"), ("--pp", "2", "--global-batch-size", "4")], ids=["tp2", "pp2"])
def test_lora_resume_is_exact_on_a_mesh(mesh, chat_model, tmp_path):
    stopped_at, straight, resumed, adapter = run_distributed(_resume_on_mesh, 2, model=chat_model, root=tmp_path,
                                                             mesh=mesh, timeout=300)[0]
    assert stopped_at == 3 and len(straight) == 6 and adapter
    assert resumed == straight
