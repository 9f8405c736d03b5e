"""Training state that reshards: a fine-tuning run stopped on one mesh resumes on another (tp, pp, dp, FSDP or DDP,
with or without offload) and continues as an uninterrupted run on the new mesh would; nothing is unpickled; a
training checkpoint exports to HF like the model itself; another model's state is refused."""
import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402
from parity import close  # noqa: E402

from colozoo.demo_finetune import make_tiny_gpt2  # noqa: E402
from colozoo.finetune import state  # noqa: E402
from colozoo.finetune.config import FinetuneConfig  # noqa: E402
from colozoo.finetune.loop import finetune  # noqa: E402
from colozoo.finetune.metrics import read_metrics  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
STORIES = REPO / "data" / "stories.jsonl"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer GPT-2 with dropout off (random draws depend on the mesh), saved by transformers."""
    return make_tiny_gpt2(tmp_path_factory.mktemp("gpt2"), n_layer=2, n_positions=32,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def small_run(model, output, **overrides) -> FinetuneConfig:
    options = dict(model=str(model), data=str(STORIES), output=str(output), seq_len=16, micro_batch_size=2,
                   global_batch_size=4, steps=6, lr=1e-2, warmup_steps=2, eval_interval=0, eval_batches=1,
                   samples=0, save_interval=2, progress=False, plot=False, export_hf=False)
    return FinetuneConfig(**{**options, **overrides})


def losses(output) -> list[float]:
    return [r["loss"] for r in read_metrics(Path(output) / "metrics.jsonl") if "loss" in r]


def resume_across(model, root, legs: list[dict], last: dict, export: bool = False):
    """(losses of an uninterrupted run on mesh `last`, losses of a run stopped on each of `legs` in turn, evenly
    spread over the 6 steps, and finished on `last`)."""
    straight, resumed = Path(root) / "straight", Path(root) / "resumed"
    finetune(small_run(model, straight, **last))
    for i, mesh in enumerate(legs):
        stop = 6 * (i + 1) // (len(legs) + 1)
        assert finetune(small_run(model, resumed, stop_after=stop, save_interval=stop, **mesh))["step"] == stop
    assert finetune(small_run(model, resumed, export_hf=export, **last))["step"] == 6
    return losses(straight), losses(resumed)


def check_continues(straight, resumed, what):
    assert len(straight) == len(resumed) == 6, what
    close(resumed, straight, 1e-5, f"{what}: losses of the resumed run and of an uninterrupted one on the last mesh")


def test_tp2_to_tp1_with_offload(tiny, tmp_path):
    run_distributed(finetune, 2, cfg=small_run(tiny, tmp_path / "resumed", tp=2, stop_after=3), timeout=240)
    straight = tmp_path / "straight"
    finetune(small_run(tiny, straight, offload="optimizer"))
    summary = finetune(small_run(tiny, tmp_path / "resumed", offload="optimizer"))
    assert summary["step"] == 6
    check_continues(losses(straight), losses(tmp_path / "resumed"), "tp2 -> tp1 (optimizer offload)")


def test_dp2_fsdp_to_dp2_ddp_to_tp2(tiny, tmp_path):
    straight, resumed = run_distributed(resume_across, 2, model=tiny, root=tmp_path,
                                        legs=[dict(dp=2, data_parallel="fsdp"),
                                                                           dict(dp=2, data_parallel="ddp")],
                                        last=dict(tp=2), timeout=300)[0]
    check_continues(straight, resumed, "dp2 FSDP -> dp2 DDP -> tp2")


def test_tp2_pp2_to_pp2_dp2_and_the_checkpoint_exports_like_the_model(tiny, tmp_path):
    straight, resumed = run_distributed(resume_across, 4, model=tiny, root=tmp_path, legs=[dict(tp=2, pp=2)],
                                        last=dict(pp=2, dp=2, micro_batch_size=1), export=True, timeout=400)[0]
    check_continues(straight, resumed, "tp2 x pp2 -> pp2 x dp2 FSDP")
    from colozoo.cli import main

    final = state.latest_checkpoint(tmp_path / "resumed" / "checkpoints")
    assert final.name == "step-00000006"
    assert main(["convert", str(final), str(tmp_path / "exported"), "--to-hf", "--quiet"]) == 0
    assert_same_hf_directory(tmp_path / "exported", tmp_path / "resumed" / "hf")


def assert_same_hf_directory(actual: Path, expected: Path):
    from safetensors.torch import load_file

    got, want = load_file(actual / "model.safetensors"), load_file(expected / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert json.loads((actual / "config.json").read_text()) == json.loads((expected / "config.json").read_text())


def test_fsdp_checkpoint_exports_like_the_model(tiny, tmp_path):
    """A checkpoint whose tensors FSDP split by rows (dp2) converts to the same HF directory the run exported."""
    from colozoo.checkpoint.convert import convert

    run_distributed(finetune, 2, cfg=small_run(tiny, tmp_path / "run", dp=2, steps=2, export_hf=True), timeout=240)
    final = state.latest_checkpoint(tmp_path / "run" / "checkpoints")
    index = json.loads((final / "colozoo_index.json").read_text())
    assert len(index["tensors"]["wte.weight"]["pieces"]) == 2  # each dp rank wrote its rows
    convert(final, tmp_path / "exported", to_hf=True)
    assert_same_hf_directory(tmp_path / "exported", tmp_path / "run" / "hf")


class RunsCode:
    """Unpickling this creates `marker`: what any code in a pickle could do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_in_a_checkpoint_is_never_unpickled(tiny, tmp_path):
    out, marker = tmp_path / "run", tmp_path / "code-ran"
    finetune(small_run(tiny, out, steps=4, stop_after=2))
    ckpt = state.latest_checkpoint(out / "checkpoints")
    payload = pickle.dumps(RunsCode(marker))
    for name in ("rank-00000.pt", "optimizer.pt", "rng.pkl"):
        (ckpt / name).write_bytes(payload)
    assert finetune(small_run(tiny, out, steps=4))["step"] == 4  # resumed, the pickles ignored
    assert not marker.exists()

    finetune(small_run(tiny, out, steps=4, resume=False, stop_after=2))
    ckpt = state.latest_checkpoint(out / "checkpoints")
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "format": state.PICKLED_FORMAT}))  # an older, pickled save
    (ckpt / "rank-00000.pt").write_bytes(payload)
    with pytest.raises(state.ResumeError, match="pickles, which resume never loads"):
        finetune(small_run(tiny, out, steps=4))
    assert not marker.exists()
    pickle.loads(payload)  # the file was live: unpickling it runs its code
    assert marker.exists()


def test_no_pickle_loading_in_colozoo():
    sources = [p for d in ("colozoo", "layers", "models", "converters", "kernels") for p in (REPO / d).rglob("*.py")]
    offenders = [str(p.relative_to(REPO)) for p in sources
                 if "weights_only=False" in p.read_text() or "pickle.load" in p.read_text()]
    assert offenders == []


def test_another_model_or_data_position_is_refused(tiny, tmp_path):
    out = tmp_path / "run"
    finetune(small_run(tiny, out, steps=4, stop_after=2))
    other = make_tiny_gpt2(tmp_path / "three-layers", n_layer=3, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                           attn_pdrop=0.0)
    with pytest.raises(state.ResumeError, match=r"another model \(its config differs: n_layer: 2 in the checkpoint, "
                                                r"3 here\)"):
        finetune(small_run(other, out, steps=4))
    with pytest.raises(state.ResumeError, match=r"global_batch 4 in the checkpoint, 8 here"):
        finetune(small_run(tiny, out, steps=4, global_batch_size=8))


def test_async_save_lets_training_go_on_and_resumes_exactly(tiny, tmp_path, monkeypatch):
    """--async-save: a save's commit waits here until the next step has been logged, which only a save that runs
    beside training allows; the committed checkpoint then resumes the run exactly."""
    import time

    out, committed_after = tmp_path / "run", {}

    def commit_after_next_step(tmp):
        step = int(tmp.name.rpartition("-")[2])
        if step < 6:  # the last save is written at once: the run ends after it
            deadline = time.monotonic() + 60
            while len(losses(out)) <= step and time.monotonic() < deadline:
                time.sleep(0.05)
        committed_after[step] = len(losses(out))

    monkeypatch.setattr(state, "_before_commit", commit_after_next_step)
    finetune(small_run(tiny, out, async_save=True))
    monkeypatch.undo()
    assert committed_after[2] > 2 and committed_after[4] > 4, committed_after
    straight = losses(out)
    shutil.rmtree(out / "checkpoints" / "step-00000006")
    assert finetune(small_run(tiny, out, async_save=True))["step"] == 6  # from the asynchronously written step 4
    assert losses(out) == straight


@pytest.mark.parametrize("damage", ["state tensor", "meta", "rng"])
def test_a_corrupted_training_state_is_refused_in_one_line(damage, tiny, tmp_path):
    out = tmp_path / "run"
    finetune(small_run(tiny, out, steps=4, stop_after=2))
    ckpt = state.latest_checkpoint(out / "checkpoints")
    if damage == "state tensor":
        index = json.loads((ckpt / "training_index.json").read_text())
        target = ckpt / sorted(index["files"])[0]
        data = bytearray(target.read_bytes())
        data[-3] ^= 0xFF  # a bit rot in the last optimizer state's bytes: the header still parses
        target.write_bytes(bytes(data))
        expected = "checksum mismatch"
    else:
        target = ckpt / ("meta.json" if damage == "meta" else "rng-rank-00000.json")
        target.write_text(target.read_text()[: len(target.read_text()) // 2])
        expected = f"{target.name} is unreadable"
    with pytest.raises(state.ResumeError, match=expected) as refused:
        finetune(small_run(tiny, out, steps=4))
    assert "\n" not in str(refused.value) and str(ckpt) in str(refused.value)
