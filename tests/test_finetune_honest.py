"""Fine-tuning without silent surprises: evaluation runs on any held-out set, its loss is the token-weighted mean on
every mesh, --chat keeps whole turns and counts what it drops, throughput counts tokens computed and trained (and MFU
what LoRA computes), a resume checks the weights, adapters and data it started from, and a run's checkpoints carry
what generating from them and merging them need."""
import itertools
import json
import os
import re
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from chat_model import CHAT, make_chat_llama  # noqa: E402
from distributed import run_distributed  # noqa: E402

from colozoo import cli  # noqa: E402
from colozoo.finetune import runtime, sft  # noqa: E402
from colozoo.finetune.config import FinetuneConfig  # noqa: E402
from colozoo.finetune.evaluation import evaluate  # noqa: E402
from colozoo.finetune.inputs import check_inputs  # noqa: E402
from colozoo.finetune.loop import finetune  # noqa: E402
from colozoo.finetune.metrics import read_metrics, training_flops_per_token  # noqa: E402


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return make_chat_llama(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def tok(chat):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(chat))


def chat_run(model, output, **overrides) -> FinetuneConfig:
    options = dict(model=str(model), data=str(CHAT), output=str(output), chat=True, seq_len=64, micro_batch_size=2,
                   steps=2, lr=1e-2, warmup_steps=1, eval_interval=1, eval_batches=4, save_interval=1, lora_r=4,
                   lora_alpha=8, samples=0, progress=False, plot=False, export_hf=False)
    return FinetuneConfig(**{**options, **overrides})


def evaluations(output) -> list[float]:
    return [r["eval_loss"] for r in read_metrics(Path(output) / "metrics.jsonl") if "eval_loss" in r]


# ------------------------------------------------------------------------------------------- evaluation


def test_evaluation_runs_on_a_held_out_set_smaller_than_a_micro_batch(chat, tmp_path):
    cfg = chat_run(chat, tmp_path / "run", eval_fraction=0.1, micro_batch_size=4)  # 1 held-out row, batches of 4
    summary = finetune(cfg)
    assert len(evaluations(tmp_path / "run")) == 3 and "eval_loss" in summary  # steps 0, 1 and the end


def first_rows(data, rows: int):
    """The first `rows` rows of in-memory data."""
    from colozoo.finetune.data import TensorData

    return TensorData({k: v[:rows] for k, v in data.tensors.items()}, data.tokens[:rows])


def eval_config(chat, micro: int, **mesh) -> FinetuneConfig:
    return FinetuneConfig(model=str(chat), data=str(CHAT), chat=True, seq_len=64, micro_batch_size=micro,
                          eval_batches=8, **mesh)


def _evaluate_on_meshes(chat, rows: int):
    """The held-out loss of the same weights at tp=2 and at dp=2 (FSDP), and what torch warned of."""
    import transformers

    import colozoo

    data = first_rows(sft.sft_dataset(CHAT, transformers.AutoTokenizer.from_pretrained(str(chat)), seq_len=64), rows)
    found = {"warnings": []}
    for name, mesh in {"tp2": {"tp": 2}, "dp2": {"dp": 2}}.items():
        model = colozoo.from_pretrained(str(chat), dtype=torch.float32, **mesh)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runtime.prepare_training(model, eval_config(chat, 2, **mesh))
            found[name] = evaluate(model, data, eval_config(chat, 2, **mesh))["eval_loss"]
        found["warnings"] += [str(w.message) for w in caught]
    return found


def test_eval_loss_is_the_token_weighted_mean_on_every_mesh(chat, tok):
    import colozoo

    rows = 5  # an odd count: at dp=2 one rank evaluates two micro-batches of 2, the other one of 2 and one of 1
    data = first_rows(sft.sft_dataset(CHAT, tok, seq_len=64), rows)
    assert len(set(data.tokens.tolist())) > 1  # rows with different numbers of trained tokens
    model = colozoo.from_pretrained(str(chat), dtype=torch.float32)
    with torch.no_grad():
        expected = float(model(**data.take(range(rows))).loss)  # one batch: the mean over all its trained tokens
    for micro in (1, 2, 3):
        assert evaluate(model, data, eval_config(chat, micro))["eval_loss"] == pytest.approx(expected, rel=1e-6)
    meshes = run_distributed(_evaluate_on_meshes, 2, chat=chat, rows=rows, timeout=240)[0]
    assert meshes["tp2"] == pytest.approx(expected, rel=1e-6) and meshes["dp2"] == pytest.approx(expected, rel=1e-6)
    assert not [w for w in meshes["warnings"] if "deprecat" in w.lower()], meshes["warnings"]


# ------------------------------------------------------------------------------------------- chat data


def test_chat_keeps_whole_turns_and_counts_what_it_drops(chat, tok, tmp_path):
    eos = tok.eos_token_id
    whole = sft.sft_dataset(CHAT, tok, seq_len=128)
    short = sft.sft_dataset(CHAT, tok, seq_len=48)
    assert whole.stats == {"samples": 12, "whole": 12, "shortened": 0, "cut": 0, "dropped": 0}
    assert short.stats["samples"] == 12 and short.stats["shortened"] > 0 and short.stats["cut"] == 0
    labels, positions = short.tensors["labels"], short.tensors["position_ids"]
    for row, pos in zip(labels.tolist(), positions.tolist()):
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
        for a, b in zip(starts, starts[1:]):
            trained = [t for t in row[a:b] if t != -100]
            assert not trained or trained[-1] == eos  # every answer trained on ends with its end-of-turn token
    tight = sft.sft_dataset(CHAT, tok, seq_len=40, truncate="turns")
    assert tight.stats["dropped"] > 0 and tight.stats["whole"] + tight.stats["shortened"] + tight.stats["dropped"] == 12
    notes = check_inputs(chat_run(chat, tmp_path / "run", seq_len=48)).notes
    shortened = f"of 12 samples in {CHAT}, {short.stats['shortened']} shortened to the whole turns"
    assert [n for n in notes if shortened in n], notes


# ------------------------------------------------------------------------------------------- throughput


def test_throughput_counts_tokens_computed_and_trained_and_mfu_what_lora_computes(chat, tmp_path, capfd):
    assert training_flops_per_token(1000, 1000) == 6000 and training_flops_per_token(1000, 10) == 4020
    output = tmp_path / "run"
    finetune(chat_run(chat, output, steps=1, eval_interval=0, peak_tflops=1.0))
    err = capfd.readouterr().err
    step = [r for r in read_metrics(output / "metrics.jsonl") if "loss" in r][0]
    assert step["tokens"] == 2 * 64  # the global batch's positions, padding included: all of them are computed
    assert 0 < step["trained_tokens"] < step["tokens"]
    assert step["trained_tokens_per_s"] == pytest.approx(step["tokens_per_s"] * step["trained_tokens"] / step["tokens"])
    total, trained = (int(n.replace(",", "")) for n in re.search(r"([\d,]+) parameters \(([\d,]+) trained\)",
                                                                    err).groups())
    assert 0 < trained < total / 10
    assert step["mfu"] == pytest.approx((4 * total + 2 * trained) * step["tokens_per_s"] / 1e12)


def test_padding_multiple_is_what_the_layers_split(monkeypatch):
    """SFT's unpacked batches and DPO's pair rows are cut to widths that context parallelism (shard_sequence: 2 x cp
    zigzag chunks, each cp rank's share over tp under sequence parallelism) and, at cp=1, sequence parallelism (the
    model's check_sequence) both split; DPO's --max-length check asks for the smallest such length, no more."""
    from types import SimpleNamespace

    from colozoo.core.mesh import ParallelConfig
    from colozoo.core.sequence import sequence_multiple
    from colozoo.finetune import data as D
    from colozoo.layers import context_parallel
    from colozoo.layers.batch import BatchContext
    from colozoo.models.base import ParallelModel

    # shard_sequence on rank 0 of a stand-in cp group: the group is its size
    monkeypatch.setattr(context_parallel, "group_size", lambda group: group)
    monkeypatch.setattr(context_parallel, "group_rank", lambda group: 0)

    def layers_split(length, cp, tp):
        try:
            if cp > 1:
                BatchContext(None, torch.arange(length)[None], length).shard_sequence(cp, "ring", tp)
            else:
                model = SimpleNamespace(position_limit=lambda: None, sequence_parallel=True,
                                        parallel=SimpleNamespace(tp_size=tp))
                ParallelModel.check_sequence(model, length)
        except ValueError:
            return False
        return True

    for cp, tp in itertools.product((1, 2, 3, 4), (1, 2, 4, 8)):
        mesh = SimpleNamespace(config=ParallelConfig(cp=cp, tp=tp, sequence_parallel=True))
        width = D.padding_multiple(mesh)
        assert width % D.PAD_MULTIPLE == 0 and layers_split(width, cp, tp) and layers_split(3 * width, cp, tp)
        assert sequence_multiple(cp, tp) == next(n for n in itertools.count(1) if layers_split(n, cp, tp)), (cp, tp)


def test_no_pack_pads_each_batch_to_its_longest_sample_and_trains_as_full_padding(chat, tmp_path, monkeypatch):
    """--no-pack: each batch is padded to its longest sample rounded up to 8 (and to 2 x cp, and tp under sequence
    parallelism), not to --seq-len: the loss, the eval loss and the tokens trained on are those of full-length
    padding; the tokens computed are fewer."""
    from types import SimpleNamespace

    from colozoo.core.mesh import ParallelConfig
    from colozoo.finetune import data as D

    mesh = lambda cp=1, tp=1, sp=False: SimpleNamespace(config=ParallelConfig(cp=cp, tp=tp, sequence_parallel=sp))  # noqa
    assert [D.padding_multiple(mesh(**m)) for m in ({}, {"cp": 2}, {"cp": 8}, {"tp": 3, "sp": True})] == [8, 8, 16, 24]
    runs = {}
    for name in ("full", "longest"):
        with monkeypatch.context() as patch:
            if name == "full":
                patch.setattr(D, "trim_padding", lambda batch, multiple: batch)
            finetune(chat_run(chat, tmp_path / name, pack=False, seq_len=128, eval_interval=0, save_interval=0,
                              lora_r=None, lora_alpha=None))
        runs[name] = read_metrics(tmp_path / name / "metrics.jsonl")
    full, longest = ([r for r in runs[name] if "lr" in r] for name in ("full", "longest"))
    assert [r["trained_tokens"] for r in longest] == [r["trained_tokens"] for r in full]
    assert all(r["tokens"] == 2 * 128 for r in full) and all(r["tokens"] < 2 * 128 for r in longest)
    assert all(r["tokens"] % (2 * 8) == 0 for r in longest)
    for what in ("loss", "eval_loss"):
        torch.testing.assert_close(torch.tensor([r[what] for r in runs["longest"] if what in r]),
                                   torch.tensor([r[what] for r in runs["full"] if what in r]), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------- resume


def _other_weights(model: Path, copy: Path, scale: float) -> Path:
    """A copy of the model directory whose weights are all scaled: the same config, other weights."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, copy)
    weights = load_file(copy / "model.safetensors")
    save_file({k: v * scale for k, v in weights.items()}, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def test_resume_checks_the_weights_adapters_and_data_it_started_from(chat, tmp_path, capfd):
    output = tmp_path / "run"
    base = ["--model", str(chat), "--data", str(CHAT), "--output", str(output), "--chat", "--seq-len", "64",
            "--steps", "4", "--lora-r", "4", "--save-interval", "1", "--eval-interval", "0", "--samples", "0",
            "--no-progress", "--no-plot", "--no-export-hf"]
    assert cli.main(["finetune", *base, "--stop-after", "2"]) == 0
    capfd.readouterr()
    saved = sorted(p.name for p in (output / "checkpoints").iterdir())
    other = _other_weights(chat, tmp_path / "other", 1.01)
    refusals = {"other weights": ["--model", str(other)], "other LoRA adapters": ["--lora-alpha", "16"],
                "rows (tokens) differ": ["--truncate", "tokens", "--seq-len", "40"]}
    for message, change in refusals.items():
        assert cli.main(["finetune", *base, *change]) == 1, message
        err = capfd.readouterr().err.strip()
        assert err.count("\n") == 0 and message in err, err
        assert sorted(p.name for p in (output / "checkpoints").iterdir()) == saved  # nothing changed
    same = tmp_path / "same-weights-elsewhere"
    shutil.copytree(chat, same)
    assert cli.main(["finetune", *base, "--model", str(same)]) == 0  # the same weights, wherever they are
    assert "resumed from" in capfd.readouterr().err


# ------------------------------------------------------------------------------------------- checkpoints


def test_run_checkpoints_generate_on_their_own_and_convert_merges_their_adapters(chat, tmp_path, capfd):
    import transformers

    import colozoo

    output = tmp_path / "run"
    finetune(chat_run(chat, output, steps=2, eval_interval=0, merge=True, export_hf=True))
    checkpoint = output / "checkpoints" / "step-00000002"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (checkpoint / name).is_file(), name
    assert cli.main(["generate", str(checkpoint), "--chat", "--prompt", "What did the fox eat?",
                     "--max-new-tokens", "4"]) == 0
    capfd.readouterr()
    assert cli.main(["convert", str(checkpoint), str(tmp_path / "hf"), "--to-hf"]) == 1
    err = capfd.readouterr().err.strip()
    assert err.count("\n") == 0 and "--merge-lora" in err and not (tmp_path / "hf").exists()
    assert cli.main(["convert", str(checkpoint), str(tmp_path / "hf"), "--to-hf", "--merge-lora"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(output / "hf")).eval()
    for (name, a), (_, b) in zip(merged.state_dict().items(), exported.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)  # the run's own merged export, bit for bit
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf")).chat_template
    model = colozoo.from_pretrained(str(checkpoint))
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == \
        model.generation_config.eos_token_id
