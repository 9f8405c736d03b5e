"""Fine-tuning's pieces: data, schedule, packing, bad input (one clear error before training), exact resume, kill
mid-save (end-to-end runs and their exports: tests/test_finetune_end_to_end.py)."""
import json
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402

from colozoo.demo_finetune import make_tiny_gpt2, texts  # noqa: E402
from colozoo.finetune import data as D  # noqa: E402
from colozoo.finetune import state  # noqa: E402
from colozoo.finetune.config import FinetuneConfig  # noqa: E402
from colozoo.finetune.loop import finetune  # noqa: E402
from colozoo.finetune.stopping import Interrupt  # noqa: E402
from colozoo.finetune.metrics import read_metrics  # noqa: E402
from colozoo.finetune.schedule import build_scheduler, warmup_cosine  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
STORIES = REPO / "data" / "stories.jsonl"
SENTIMENT = REPO / "data" / "sentiment.jsonl"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: resumes are compared bit for bit


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


def partial_save(checkpoints: Path, step: int) -> Path:
    """The temp directory of a save of `step` that never committed (named by the job that wrote it)."""
    found = list(checkpoints.glob(f".tmp-step-*{step:08d}"))
    assert len(found) == 1, found
    return found[0]


def test_killed_mid_save_resumes_from_the_previous_checkpoint(tiny, straight, tmp_path, monkeypatch, capsys):
    crashed = tmp_path / "crashed"

    def crash(tmp):
        if tmp.name.endswith("00000004"):
            raise Crash("killed while saving step 4")

    monkeypatch.setattr(state, "_before_commit", crash)
    with pytest.raises(Crash):
        finetune(small_run(tiny, crashed))
    monkeypatch.undo()
    assert state.latest_checkpoint(crashed / "checkpoints").name == "step-00000002"
    partial = partial_save(crashed / "checkpoints", 4)  # the half-written save, never committed
    capsys.readouterr()
    finetune(small_run(tiny, crashed))
    assert f"dropped {partial}: a save of step 4 that never completed" in capsys.readouterr().err
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
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    killed = subprocess.run([sys.executable, "-c", KILL_MID_SAVE, config], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert state.latest_checkpoint(crashed / "checkpoints").name == "step-00000002"
    assert any(partial_save(crashed / "checkpoints", 4).iterdir())  # written, never committed
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
    partial = sorted(p.name for p in partial_save(crashed / "checkpoints", 4).iterdir())
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
        ["checksums.json", "colozoo_index.json", "meta.json", "rng-rank-00000.json", "state-rank-00000.safetensors",
         "training_index.json", *carried])
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["optimizer"]["scalars"]["wte.weight"]["step"] == [2.0, "float32"]
    tensors = json.loads((ckpt / "training_index.json").read_text())["tensors"]
    assert {"exp_avg:wte.weight", "exp_avg_sq:wte.weight"} <= set(tensors)
