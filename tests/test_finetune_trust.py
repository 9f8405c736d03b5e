"""Fine-tuning refuses what it should not trust (corrupted checkpoints, non-finite losses) and keeps what the
exported model needs (tokenizer, label names)."""
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_finetune import STORIES, small_run, tiny  # noqa: E402,F401  (fixtures)
from test_finetune_end_to_end import tiny_bert  # noqa: E402,F401 (a fixture)

import colozoo  # noqa: E402
from colozoo import cli  # noqa: E402
from colozoo.finetune import main  # noqa: E402


def _flip_a_weight_byte(checkpoint: Path):
    path = sorted(checkpoint.glob("*.safetensors"))[0]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # same size: only the checksum can tell
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("task", ["seqcls", "lm"])
def test_finetune_refuses_a_checkpoint_with_flipped_bytes(task, tiny, tiny_bert, tmp_path, capsys):
    source = tiny_bert if task == "seqcls" else tiny
    colozoo.convert(source, tmp_path / "ckpt")  # the tokenizer comes along
    _flip_a_weight_byte(tmp_path / "ckpt")
    data = source / "sentiment16.jsonl" if task == "seqcls" else STORIES
    args = ["--model", str(tmp_path / "ckpt"), "--data", str(data), "--output", str(tmp_path / "run"),
            "--steps", "1", "--seq-len", "16", "--micro-batch-size", "2", "--no-progress", "--no-plot"]
    if task == "seqcls":
        args += ["--num-labels", "2"]
    assert main(args, task=task) == 1
    assert "checksum mismatch" in capsys.readouterr().err
    assert not (tmp_path / "run" / "hf").exists()


@pytest.mark.parametrize("what", ["loss", "grad_norm"])
def test_a_non_finite_loss_or_gradient_stops_the_run_naming_the_step(what, tiny, tmp_path, monkeypatch, capsys):
    from colozoo.finetune import runtime

    calls = {"n": 0}
    forward_backward, clip = runtime.forward_backward, runtime.clip_grad_norm

    def poisoned(value, at_step=2):
        calls["n"] += 1
        return value * float("nan") if calls["n"] == at_step else value

    if what == "loss":
        monkeypatch.setattr(runtime, "forward_backward", lambda *a, **k: poisoned(forward_backward(*a, **k)))
    else:
        monkeypatch.setattr(runtime, "clip_grad_norm", lambda *a, **k: poisoned(clip(*a, **k)))
    args = ["--model", str(tiny), "--data", str(STORIES), "--output", str(tmp_path / "run"), "--steps", "4",
            "--seq-len", "16", "--save-interval", "1", "--eval-interval", "0", "--no-progress", "--no-plot"]
    assert main(args, task="lm") == 1
    err = capsys.readouterr().err
    assert "error: step 2:" in err and "not finite" in err
    assert not (tmp_path / "run" / "hf").exists()
    assert [p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*")] == ["step-00000001"]


def test_a_batch_without_a_labelled_token_is_counted_skipped_and_said_once(tiny, tmp_path, monkeypatch, capfd):
    """A global batch whose labels are all -100 is not a perfect step: it trains nothing (no update, the schedule
    waits), metrics.jsonl logs no loss for it and counts it (masked_batches, also in summary.json and the
    checkpoint), and the run says so once, with the count."""
    from colozoo.finetune import data as D
    from colozoo.finetune import loop
    from colozoo.finetune.metrics import read_metrics

    check_inputs = loop.check_inputs

    def second_batch_masked(cfg, checked=None):
        inputs = check_inputs(cfg, checked)
        rows = inputs.train.take(range(len(inputs.train)))
        sampler = D.BatchSampler(len(inputs.train), inputs.global_batch, 0, 1, cfg.seed)
        rows["labels"][sampler.global_indices(1)] = -100
        inputs.train = D.TensorData(rows, D.trained_tokens(rows["labels"]))
        return inputs

    monkeypatch.setattr(loop, "check_inputs", second_batch_masked)
    summary = loop.finetune(small_run(tiny, tmp_path / "run", steps=3, eval_fraction=0.0, save_interval=0))
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "lr" in r]
    assert [r["masked_batches"] for r in steps] == [0, 1, 1] and summary["masked_batches"] == 1
    assert steps[1]["loss"] is None and steps[1]["trained_tokens"] == 0 and steps[1]["grad_norm"] is None
    assert all(torch.isfinite(torch.tensor(steps[i]["loss"])) for i in (0, 2))
    assert steps[1]["lr"] == steps[2]["lr"]  # no optimizer step, and the schedule waited
    err = capfd.readouterr().err
    assert err.count("1 of 3 steps had a batch with no labelled token") == 1, err


def test_convert_carries_tokenizer_and_generation_files_both_ways(tiny, tmp_path):
    import transformers

    hf = tmp_path / "hf"
    hf.mkdir()
    for file in tiny.iterdir():
        (hf / file.name).write_bytes(file.read_bytes())
    transformers.GenerationConfig(max_new_tokens=7, eos_token_id=2).save_pretrained(str(hf))
    assert cli.main(["convert", str(hf), str(tmp_path / "ckpt"), "--tp", "2", "--quiet"]) == 0
    assert (tmp_path / "ckpt" / "tokenizer.json").is_file() and (tmp_path / "ckpt" / "generation_config.json").is_file()
    args = ["--model", str(tmp_path / "ckpt"), "--data", str(STORIES), "--output", str(tmp_path / "run"), "--steps",
            "1", "--seq-len", "16", "--no-export-hf", "--no-progress", "--no-plot"]
    assert main(args, task="lm") == 0  # HF -> colozoo -> finetune
    assert cli.main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "back"), "--to-hf", "--quiet"]) == 0
    original = transformers.AutoTokenizer.from_pretrained(str(hf))
    back = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "back"))
    text = "the cat sat on the mat"
    assert back(text)["input_ids"] == original(text)["input_ids"] and len(back) == len(original)
    assert transformers.GenerationConfig.from_pretrained(str(tmp_path / "back")).max_new_tokens == 7


def test_exported_classifier_keeps_the_label_names_of_the_data(tiny_bert, tmp_path):
    import transformers

    from colozoo.finetune import finetune

    subset = str(tiny_bert / "sentiment16.jsonl")  # labels "negative" / "positive"
    finetune(small_run(tiny_bert, tmp_path / "run", task="seqcls", data=subset, eval_data=subset, steps=1, num_labels=2,
                       eval_interval=0, save_interval=0, export_hf=True))
    config = transformers.AutoConfig.from_pretrained(str(tmp_path / "run" / "hf"))
    assert config.id2label == {0: "negative", 1: "positive"}
    assert config.label2id == {"negative": 0, "positive": 1}


def test_finetune_saves_and_evaluates_periodically_by_default_and_help_shows_defaults(capsys):
    from colozoo.finetune import FinetuneConfig

    cfg = FinetuneConfig(model="m", data="d")
    assert 0 < cfg.save_interval <= 500 and 0 < cfg.eval_interval <= 500
    with pytest.raises(SystemExit):
        cli.main(["finetune", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"only at the end) (default: {cfg.save_interval})" in text and "(default: 0.0001)" in text
    assert "(default: None)" not in text


@pytest.mark.parametrize("command", [["profile", "--seq-len", "16"], ["plan", "--gpus", "2", "--seq-len", "16"]])
def test_profile_and_plan_take_a_local_hf_or_colozoo_directory(command, tiny, tmp_path, capsys):
    colozoo.convert(tiny, tmp_path / "ckpt")
    outputs = []
    for path in (tiny, tmp_path / "ckpt"):
        assert cli.main([command[0], str(path), *command[1:], "--json"]) == 0
        out = capsys.readouterr().out.replace(str(path), "MODEL")
        outputs.append(re.sub(r'"\w*seconds\w*": [-+.\deE]+', "", out))  # the profiler's own run time
    assert outputs[0] == outputs[1] and outputs[0].strip().startswith("{")
    assert cli.main([command[0], str(tmp_path), *command[1:]]) == 1
    assert "is not a model directory" in capsys.readouterr().err


BAD_DATA = {
    "binary": (b'{"text": "fine"}\n\x89PNG\x00\xff\xfe\n', r"data\.jsonl:2: binary data"),
    "nul": (b'{"text": "fine"}\n{"text": "a\x00b"}\n', r"data\.jsonl:2: binary data"),
    "missing field": (b'{"text": "fine"}\n{"body": "x", "id": 3}\n',
                      r"data\.jsonl:2: no field 'text'; the record's fields are \['body', 'id'\]"),
    "number as text": (b'{"text": 123}\n', r"data\.jsonl:1: field 'text' is 123, not a string"),
    "not an object": (b'["text"]\n', r"data\.jsonl:1: a JSON list, not an object"),
}


@pytest.mark.parametrize("case", BAD_DATA)
def test_bad_data_is_one_line_naming_file_and_line(case, tiny, tmp_path, capsys):
    content, message = BAD_DATA[case]
    (tmp_path / "data.jsonl").write_bytes(content)
    args = ["--model", str(tiny), "--data", str(tmp_path / "data.jsonl"), "--output", str(tmp_path / "run"),
            "--seq-len", "16"]
    assert main(args, task="lm") == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err


def test_unwritable_output_is_one_line_before_loading(tiny, tmp_path, capsys):
    (tmp_path / "file").write_text("x")  # a path under a file: unwritable even for root, unlike chmod
    args = ["--model", str(tiny), "--data", str(STORIES), "--output", str(tmp_path / "file" / "run"), "--seq-len",
            "16"]
    assert main(args, task="lm") == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write to the output directory") and len(err.strip().splitlines()) == 1


def test_warns_on_mostly_unknown_tokens_and_an_eos_other_than_the_config(tiny, tmp_path, capfd):
    import json

    model = tmp_path / "model"
    model.mkdir()
    for file in tiny.iterdir():
        (model / file.name).write_bytes(file.read_bytes())
    config = json.loads((model / "config.json").read_text())
    config["eos_token_id"] = 7
    (model / "config.json").write_text(json.dumps(config))
    (tmp_path / "data.jsonl").write_text("".join(f'{{"text": "zq{i} vvx{i} kkr{i} the"}}\n' for i in range(64)))
    args = ["--model", str(model), "--data", str(tmp_path / "data.jsonl"), "--output", str(tmp_path / "run"),
            "--steps", "1", "--seq-len", "16", "--no-export-hf", "--no-progress", "--no-plot", "--samples", "0"]
    assert main(args, task="lm") == 0
    out = " ".join(capfd.readouterr().err.split())  # the run's log goes to stderr
    assert re.search(r"warning: \d+% of the tokens are the tokenizer's unknown token", out)
    assert "warning: the tokenizer's EOS is" in out and "eos_token_id is 7" in out


def test_models_counts_parameters_as_transformers_does():
    import transformers

    from colozoo.registry import count_parameters, get_config

    config = get_config("gpt2")  # a vocabulary of 50257: padding it would add rows
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(config)
    assert count_parameters(config) == sum(p.numel() for p in reference.parameters())
