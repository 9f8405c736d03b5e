"""Fine-tuning: data, schedule, packing, bad input (one clear error before training), exact resume, kill mid-save,
and an end-to-end run whose HF export transformers loads with the same logits."""
import json
import os
import re
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402
from parity import close  # noqa: E402

from colozoo.demo_finetune import build_tokenizer, make_tiny_gpt2, texts  # noqa: E402
from colozoo.finetune import data as D  # noqa: E402
from colozoo.finetune import state  # noqa: E402
from colozoo.finetune.config import FinetuneConfig  # noqa: E402
from colozoo.finetune.loop import Interrupt, finetune  # noqa: E402
from colozoo.finetune.metrics import read_metrics  # noqa: E402
from colozoo.finetune.schedule import build_scheduler, warmup_cosine  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
STORIES = REPO / "data" / "stories.jsonl"
SENTIMENT = REPO / "data" / "sentiment.jsonl"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer GPT-2 (dropout on, so resuming must restore the RNG) saved by transformers, with its tokenizer."""
    return make_tiny_gpt2(tmp_path_factory.mktemp("gpt2"), n_layer=2, n_positions=32,
                          resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)


def small_run(model, output, **overrides) -> FinetuneConfig:
    options = dict(model=str(model), data=str(STORIES), output=str(output), seq_len=16, micro_batch_size=2,
                   steps=6, lr=1e-2, warmup_steps=2, eval_interval=3, eval_batches=2, save_interval=2,
                   progress=False, plot=False, export_hf=False)
    return FinetuneConfig(**{**options, **overrides})


def losses(output) -> list[float]:
    return [r["loss"] for r in read_metrics(Path(output) / "metrics.jsonl") if "loss" in r]


# ------------------------------------------------------------------------------------------- pieces


def test_warmup_cosine_schedule():
    lrs = [warmup_cosine(s, warmup_steps=4, total_steps=14, min_lr_ratio=0.1) for s in range(14)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4] == pytest.approx(1.0) and lrs[9] == pytest.approx(0.55)  # half way: the cosine's midpoint
    assert all(a > b for a, b in zip(lrs[4:], lrs[5:]))
    assert warmup_cosine(14, 4, 14, 0.1) == pytest.approx(0.1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = build_scheduler(opt, 4, 14, 0.1)
    seen = []
    for _ in range(14):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2.0 * x for x in lrs])


def test_lm_packing_and_padding(tiny, tmp_path):
    tok = D.load_tokenizer(tiny, 131)
    packed = D.lm_dataset(STORIES, tok, seq_len=16, pack=True)
    docs = [tok(t, add_special_tokens=False)["input_ids"] for t in texts()]
    stream = [t for d in docs for t in d + [tok.eos_token_id]]
    assert packed.tensors["input_ids"].flatten().tolist() == stream[: len(packed) * 16]
    assert bool(packed.tensors["attention_mask"].all()) and (packed.tokens == 15).all()
    (tmp_path / "stories.txt").write_text("\n\n".join(texts()[:5]) + "\n\n\n")
    as_text = D.lm_dataset(tmp_path / "stories.txt", tok, seq_len=16, pack=True)
    assert torch.equal(as_text.tensors["input_ids"], packed.tensors["input_ids"][: len(as_text)])
    padded = D.lm_dataset(STORIES, tok, seq_len=16, pack=False)
    first = docs[0]
    assert padded.tensors["input_ids"][0].tolist() == first[:16]
    row = next(i for i in range(len(padded)) if not padded.tensors["attention_mask"][i].all())
    mask = padded.tensors["attention_mask"][row]
    assert (padded.tensors["labels"][row][mask == 0] == -100).all()
    assert padded.tokens[row] == mask.sum() - 1


def test_sampler_splits_global_batches_over_dp():
    samplers = [D.BatchSampler(50, global_batch=8, dp_rank=r, dp_size=2, seed=3) for r in range(2)]
    assert samplers[0].steps_per_epoch == 6
    seen = []
    for step in range(6):
        a, b = (s.step_indices(step).tolist() for s in samplers)
        assert len(a) == len(b) == 4 and not set(a) & set(b)
        assert a + b == samplers[0].global_indices(step).tolist()
        seen += a + b
    assert len(set(seen)) == 48  # one epoch: no sample twice
    fresh = D.BatchSampler(50, 8, 1, 2, seed=3)
    assert fresh.step_indices(9).tolist() == samplers[1].step_indices(9).tolist()  # a pure function of the step
    assert samplers[0].global_indices(0).tolist() != samplers[0].global_indices(6).tolist()  # reshuffled per epoch


def test_classification_and_image_data(tiny, tmp_path):
    from transformers import BertConfig, ViTConfig

    config = BertConfig(num_labels=2, vocab_size=200)
    tok = D.load_tokenizer(tiny, 200)
    cls = D.classification_dataset(SENTIMENT, tok, 12, config)
    labels = [json.loads(line)["label"] for line in SENTIMENT.read_text().splitlines()]
    assert cls.tensors["labels"].tolist() == [int(v == "positive") for v in labels]  # sorted: negative=0
    assert cls.tensors["input_ids"].shape == (240, 12)
    vit = ViTConfig(image_size=8, num_labels=3)
    images = np.random.default_rng(0).integers(0, 256, (5, 8, 8, 3), dtype=np.uint8)
    np.savez(tmp_path / "img.npz", images=images, labels=np.array([0, 1, 2, 1, 0]))
    data = D.image_dataset(tmp_path / "img.npz", vit)
    expected = (torch.tensor(images).permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.5
    assert torch.equal(data.tensors["pixel_values"], expected)
    from PIL import Image

    for i, label in enumerate(["cat", "dog", "cat"]):
        (tmp_path / "folder" / label).mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[i]).save(tmp_path / "folder" / label / f"{i}.png")
    folder = D.image_dataset(tmp_path / "folder", vit)
    assert folder.tensors["labels"].tolist() == [0, 0, 1]  # class folders in sorted order, files sorted inside
    assert torch.equal(folder.tensors["pixel_values"], expected[[0, 2, 1]])
    with pytest.raises(D.DataError, match=r"outside the model's 3 classes"):
        np.savez(tmp_path / "bad.npz", images=images, labels=np.array([0, 1, 2, 3, 0]))
        D.image_dataset(tmp_path / "bad.npz", vit)


def test_interrupt_is_a_clean_stop_request():
    with Interrupt() as interrupt:
        os.kill(os.getpid(), signal.SIGINT)
        assert interrupt.requested and interrupt.agreed(torch.device("cpu"))
        os.kill(os.getpid(), signal.SIGINT)  # torchrun's forwarded copy of the same Ctrl-C: still a clean stop
        interrupt.requested_at -= 3.0
        with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C later on: stop at once
            os.kill(os.getpid(), signal.SIGINT)


# ------------------------------------------------------------------------------------------- bad input


def _config_changed(tiny, tmp_path, **changes):
    """A copy of the tiny model directory whose config.json differs by `changes`."""
    import shutil

    import transformers

    changed = tmp_path / "changed-config"
    shutil.copytree(tiny, changed)
    config = transformers.AutoConfig.from_pretrained(changed)
    for key, value in changes.items():
        setattr(config, key, value)
    config.save_pretrained(changed)
    return dict(model_dir=changed)


BAD_INPUT = {
    "missing": (lambda tiny, tmp: dict(data=str(tmp / "nope.jsonl")), r"nope\.jsonl does not exist"),
    "empty": (lambda tiny, tmp: (tmp / "empty.jsonl").write_text("\n") and dict(data=str(tmp / "empty.jsonl")),
              r"empty\.jsonl is empty"),
    "too_long": (lambda tiny, tmp: dict(seq_len=64), r"--seq-len 64 is longer than the model's maximum positions \(32\)"),
    "batch": (lambda tiny, tmp: dict(micro_batch_size=3, global_batch_size=8),
              r"global batch 8 is not divisible by micro batch x dp = 3 x 1"),
    "world": (lambda tiny, tmp: dict(tp=2), r"world size 3 is not divisible by tp\*pp\*cp = 2\*1\*1"),
    "vocab": (lambda tiny, tmp: _config_changed(tiny, tmp, vocab_size=50),
              r"tokenizer .* has 131 tokens but the model's vocabulary has 50"),
    "special_tokens": (lambda tiny, tmp: _config_changed(tiny, tmp, pad_token_id=7),
                       r"tokenizer .* has pad_token_id 1 but the model config says 7"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_fails_before_training(case, tiny, tmp_path, monkeypatch):
    make, message = BAD_INPUT[case]
    if case == "world":
        monkeypatch.setenv("WORLD_SIZE", "3")
    out = tmp_path / "run"
    overrides = make(tiny, tmp_path)
    with pytest.raises(ValueError, match=message):
        finetune(small_run(overrides.pop("model_dir", tiny), out, **overrides))
    assert not out.exists()  # nothing trained, nothing written


# ------------------------------------------------------------------------------------------- resume


@pytest.fixture(scope="module")
def straight(tiny, tmp_path_factory):
    """The uninterrupted run the interrupted ones must reproduce."""
    out = tmp_path_factory.mktemp("straight")
    finetune(small_run(tiny, out))
    return out


def test_resume_reproduces_the_uninterrupted_run(tiny, straight, tmp_path):
    resumed = tmp_path / "resumed"
    first = finetune(small_run(tiny, resumed, stop_after=3))
    assert first["stopped"] and first["step"] == 3
    assert [p.name for p in state.complete_checkpoints(resumed / "checkpoints")] == ["step-00000002", "step-00000003"]
    second = finetune(small_run(tiny, resumed))
    assert second["step"] == 6 and not second["stopped"]
    assert len(losses(straight)) == 6
    assert losses(resumed) == losses(straight)  # bit for bit: data position, optimizer, scheduler and RNG restored
    assert second["eval_loss"] == json.loads((straight / "summary.json").read_text())["eval_loss"]
    assert [p.name for p in state.complete_checkpoints(resumed / "checkpoints")] == ["step-00000004", "step-00000006"]


class Crash(RuntimeError):
    pass


def test_killed_mid_save_resumes_from_the_previous_checkpoint(tiny, straight, tmp_path, monkeypatch):
    crashed = tmp_path / "crashed"

    def crash(tmp):
        if tmp.name.endswith("00000004"):
            raise Crash("killed while saving step 4")

    monkeypatch.setattr(state, "_before_commit", crash)
    with pytest.raises(Crash):
        finetune(small_run(tiny, crashed))
    monkeypatch.undo()
    assert state.latest_checkpoint(crashed / "checkpoints").name == "step-00000002"
    assert (crashed / "checkpoints" / ".tmp-step-00000004").exists()  # the half-written save, never committed
    finetune(small_run(tiny, crashed))
    assert losses(crashed) == losses(straight)
    assert not list((crashed / "checkpoints").glob(".tmp-*"))


KILL_MID_SAVE = """
import json, os, signal, sys
from colozoo.finetune import state
from colozoo.finetune.config import FinetuneConfig
from colozoo.finetune.loop import finetune

def die(tmp):
    if tmp.name.endswith("00000004"):  # every file of step 4 written, not yet renamed into place
        os.kill(os.getpid(), signal.SIGKILL)  # no exception, no cleanup: the process is simply gone

state._before_commit = die
finetune(FinetuneConfig(**json.loads(sys.argv[1])))
"""


def test_a_process_killed_mid_save_resumes_from_the_previous_checkpoint(tiny, straight, tmp_path):
    import dataclasses
    import subprocess

    crashed = tmp_path / "crashed"
    config = json.dumps(dataclasses.asdict(small_run(tiny, crashed)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    killed = subprocess.run([sys.executable, "-c", KILL_MID_SAVE, config], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert state.latest_checkpoint(crashed / "checkpoints").name == "step-00000002"
    assert any((crashed / "checkpoints" / ".tmp-step-00000004").iterdir())  # written, never committed
    finetune(small_run(tiny, crashed))
    assert losses(crashed) == losses(straight)
    assert not list((crashed / "checkpoints").glob(".tmp-*"))


def _killed_mid_save_on_two_ranks(model, root):
    import torch.distributed as dist

    rank, degrees = dist.get_rank(), dict(dp=2, data_parallel="fsdp")
    finetune(small_run(model, Path(root) / "straight", **degrees))
    crashed = Path(root) / "crashed"

    def killed(tmp):
        if tmp.name.endswith("00000004"):
            if rank == 1:  # rank 1 dies before its shard lands; torchrun then takes the whole job down
                for file in tmp.glob("*-rank-00001.*"):
                    file.unlink()
            raise Crash(f"rank {rank}: killed while saving step 4")

    original, state._before_commit = state._before_commit, killed
    try:
        with pytest.raises(Crash):
            finetune(small_run(model, crashed, **degrees))
    finally:
        state._before_commit = original
    dist.barrier()
    latest = state.latest_checkpoint(crashed / "checkpoints").name
    partial = sorted(p.name for p in (crashed / "checkpoints" / ".tmp-step-00000004").iterdir())
    dist.barrier()
    resumed = finetune(small_run(model, crashed, **degrees))
    return latest, partial, resumed["step"], losses(Path(root) / "straight"), losses(crashed)


def test_killed_mid_save_on_two_ranks_resumes_from_the_previous_checkpoint(tiny, tmp_path):
    latest, partial, step, straight, resumed = run_distributed(_killed_mid_save_on_two_ranks, 2, model=tiny,
                                                               root=tmp_path,
                                                               timeout=240)[0]
    assert latest == "step-00000002" and partial == ["rng-rank-00000.json", "state-rank-00000.safetensors"]
    assert step == 6 and len(straight) == 6
    assert resumed == straight
    assert not list((tmp_path / "crashed" / "checkpoints").glob(".tmp-*"))


def test_a_checkpoint_is_json_and_safetensors_only(tiny, tmp_path):
    """No pickles: tensors in safetensors (the model part is a colozoo checkpoint), everything else JSON."""
    out = tmp_path / "run"
    finetune(small_run(tiny, out, steps=2))
    ckpt = state.latest_checkpoint(out / "checkpoints")
    from colozoo.checkpoint.convert import side_files

    carried = sorted(f.name for f in side_files(tiny))  # the tokenizer and generation files travel along
    assert carried and sorted(p.name for p in ckpt.iterdir()) == sorted(
        ["colozoo_index.json", "meta.json", "rng-rank-00000.json", "state-rank-00000.safetensors",
         "training_index.json", *carried])
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["optimizer"]["scalars"]["wte.weight"]["step"] == [2.0, "float32"]
    tensors = json.loads((ckpt / "training_index.json").read_text())["tensors"]
    assert {"exp_avg:wte.weight", "exp_avg_sq:wte.weight"} <= set(tensors)


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
    from colozoo.demo_finetune import make_tiny_causal_lm

    model = make_tiny_causal_lm(tmp_path / family, family, layers=2, positions=32)
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
