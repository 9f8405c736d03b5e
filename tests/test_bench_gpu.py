"""bench/gpu.py checked on the CPU, so that a lent GPU's minutes go to measuring: its dry run prints one JSON line
per case, every case of every kind run at tiny sizes with the same code the GPU runs; a case that would not fit in
the budget says so; Liger-Kernel's patches of transformers are undone after the models it trains are built."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu  # noqa: E402


def lines(capsys, *argv) -> list[dict]:
    assert gpu.main(list(argv)) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_the_dry_run_runs_every_case_once(capsys, tmp_path, monkeypatch):
    """Gemma 2: transformers' eager attention (it refuses sdpa), its window and caps; the hardware case first, then
    decoding, training steps and the compiled peer, in one loop; the device copy is measured once a run (the hardware
    case's copy serves the decode roofline)."""
    from colozoo.cost import measure

    copies, copy_bandwidth = [], measure.copy_bandwidth
    monkeypatch.setattr(measure, "copy_bandwidth", lambda *a, **k: copies.append(a) or copy_bandwidth(*a, **k))
    args = gpu.arguments(["--dry-run", "--models", "gemma2"])
    expected = ["gpu/hardware"] + [
        f"gpu/{kind}/gemma-2-2b/" + ("x".join(map(str, shape)) if kind == "train" else f"b{shape[0]}")
        for kind, _, shape in gpu.cases(args)]
    printed = lines(capsys, "--dry-run", "--models", "gemma2", "--hardware-out", str(tmp_path / "hw.json"))
    assert [line["bench"] for line in printed] == expected
    for line in printed:
        assert "error" not in line and "skipped" not in line, line
        assert line["config"]["device"] == "cpu (dry run)" and "ratio" in line
    assert len(copies) == 1
    decode = printed[1]["metrics"]
    assert decode["same_tokens"] and decode["roofline_tokens_per_s"] > 0
    assert decode["copy_gb_per_s"] == printed[0]["metrics"]["copy_gb_per_s"]
    assert {"colozoo_ms", "peer_ms", "loss_diff"} <= set(printed[3]["metrics"])


def test_cases_that_do_not_fit_the_budget_are_skipped_with_a_reason(capsys):
    printed = lines(capsys, "--dry-run", "--models", "llama", "--budget", "0")
    assert len(printed) == len(gpu.cases(gpu.arguments(["--dry-run", "--models", "llama"])))
    assert all(line["skipped"].startswith("out of time: a ") for line in printed)
    with pytest.raises(SystemExit):
        gpu.main(["--models", "llama,mistral"])


def test_kinds_and_shapes_choose_the_cases_of_a_short_rerun():
    args = gpu.arguments(["--models", "qwen3,gemma2", "--kinds", "train", "--train-shapes", "8x4096,1x16384"])
    assert gpu.cases(args) == [("train", "qwen3", (8, 4096)), ("train", "gemma2", (8, 4096)),
                               ("train", "qwen3", (1, 16384)), ("train", "gemma2", (1, 16384))]
    for bad in ("8by4096", "8x4096x2", "0x16", ""):
        with pytest.raises(SystemExit):
            gpu.arguments(["--train-shapes", bad])


def test_the_first_generated_token_where_the_sides_part():
    import torch

    ours = torch.tensor([[5, 5, 1, 2, 3], [5, 5, 1, 2, 4]])
    assert gpu.first_difference(ours, ours.clone(), prompt=2) is None
    peer = ours.clone()
    peer[1, 3:] = 9
    assert gpu.first_difference(ours, peer, prompt=2) == 1


def test_a_peer_out_of_memory_leaves_our_step_measured(capsys, monkeypatch):
    """On a GPU transformers + Liger runs out of memory first (Gemma 2 at 8 x 4096 tokens on an H200): the line keeps
    our step's time and says the peer did not fit, instead of an error that hides both."""
    import torch

    built = gpu.build_pair

    def peer_without_memory(*args, **kwargs):
        ours, hf = built(*args, **kwargs)
        hf.forward = lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory"))
        return ours, hf

    monkeypatch.setattr(gpu, "build_pair", peer_without_memory)
    line, = lines(capsys, "--dry-run", "--models", "llama", "--kinds", "train", "--train-shapes", "4x2048")[:1]
    assert "error" not in line and line["ratio"] is None, line
    assert line["metrics"]["peer_out_of_memory"] and line["metrics"]["colozoo_ms"] > 0


@pytest.mark.parametrize("family", sorted(gpu.MODELS))
def test_liger_patched_undoes_a_patch_of_the_modeling_module_and_the_forward(family, monkeypatch):
    """Without liger-kernel (the bench extra): a stand-in for its apply_liger_kernel_to_<family> that does what Liger
    does (replaces the modeling module's RMSNorm class and the LM class's forward) is undone on leaving."""
    import importlib
    import types

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    lm = getattr(module, gpu.CAUSAL_LM[family])
    norm_name = next(name for name in vars(module) if name.endswith("RMSNorm"))
    norm, forward = getattr(module, norm_name), lm.__dict__["forward"]

    def apply():
        setattr(module, norm_name, type("LigerRMSNorm", (norm,), {}))
        lm.forward = lambda self, *args, **kwargs: None

    fake = types.ModuleType("liger_kernel.transformers")
    setattr(fake, f"apply_liger_kernel_to_{family}", apply)
    monkeypatch.setitem(sys.modules, "liger_kernel", types.SimpleNamespace(transformers=fake))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    with gpu.liger_patched(family):
        assert getattr(module, norm_name).__name__ == "LigerRMSNorm" and lm.__dict__["forward"] is not forward
    assert getattr(module, norm_name) is norm and lm.__dict__["forward"] is forward


@pytest.mark.parametrize("family", sorted(gpu.MODELS))
def test_liger_patches_transformers_while_the_peer_is_built_only(family):
    pytest.importorskip("liger_kernel", reason="liger-kernel (the bench extra) is not installed")
    import torch

    args = gpu.arguments(["--dry-run", "--models", family])
    config = gpu.model_config(family, args)
    norms = lambda model: {type(m).__name__ for m in model.modules() if "RMSNorm" in type(m).__name__}  # noqa: E731
    plain = norms(gpu.transformers.AutoModelForCausalLM.from_config(config))
    with gpu.liger_patched(family):
        patched = gpu.transformers.AutoModelForCausalLM.from_config(config)
    assert all(name.startswith("Liger") for name in norms(patched)) and not any(n.startswith("Liger") for n in plain)
    assert norms(gpu.transformers.AutoModelForCausalLM.from_config(config)) == plain, "Liger's patch outlived the peer"
    assert torch.is_tensor(patched.lm_head.weight)
