"""Conversion at disk speed: each stage's meta model is built once (and that checks the mesh), the layout is the
same at every degree, memory in flight is bounded, and a converting process stays near its largest tensor."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
import torch
import transformers

import colozoo.models
from colozoo.checkpoint.convert import convert
from colozoo.checkpoint.layout import ModelLayout
from colozoo.checkpoint.safetensors_io import SafetensorsWriter
from colozoo.checkpoint.streaming import ByteBudget, compact

from test_checkpoint import FAMILIES, make_hf

MB = 2**20


def config_of(family: str):
    model_type, kwargs = FAMILIES[family]
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def test_conversion_builds_each_stage_once(tmp_path, monkeypatch):
    hf = make_hf(tmp_path / "hf", "gpt2")
    built = []
    original = colozoo.models.build_shard

    def counting(config, parallel=None, **kwargs):
        built.append((parallel.config.tp, parallel.rank("pp")))
        return original(config, parallel=parallel, **kwargs)

    monkeypatch.setattr(colozoo.models, "build_shard", counting)
    convert(hf, tmp_path / "out", tp=2, pp=2)
    assert sorted(built) == [(2, 0), (2, 1)]  # at the target tp: the mesh is checked by the same builds


@pytest.mark.parametrize("family,degrees", [("gpt2", dict(tp=4)), ("gpt2-untied", dict(tp=2)),
                                            ("opt-350m-style", dict(tp=2)), ("llama", dict(tp=4)),
                                            ("mixtral", dict(tp=2, ep=2)), ("qwen2_moe", dict(tp=4, ep=4))])
def test_layout_is_the_same_at_every_degree(family, degrees):
    config = config_of(family)
    whole = ModelLayout(config)
    for pp in (1, 2):
        layout = ModelLayout(config, pp, **degrees)
        assert layout.aliases == whole.aliases
        assert list(layout.tensors) == list(whole.tensors)  # model order
        assert {n: (i.shape, i.spec) for n, i in layout.tensors.items()} == \
               {n: (i.shape, i.spec) for n, i in whole.tensors.items()}
    staged = ModelLayout(config, 2, **degrees)
    assert {i.stage for i in staged.tensors.values()} == {0, 1}
    assert staged.tensors[next(iter(staged.tensors))].stage == 0  # the embedding, tied or not, on the first stage


def test_byte_budget_bounds_what_is_in_flight():
    budget, order = ByteBudget(100), []
    budget.take(60)
    waiter = threading.Thread(target=lambda: (budget.take(50), order.append("second")))
    waiter.start()
    time.sleep(0.2)
    assert order == []  # 60 + 50 > 100: waits
    budget.give(60)
    waiter.join(5)
    assert order == ["second"]
    budget.give(50)
    budget.take(500)  # larger than the limit: goes alone
    budget.give(500)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compact_copies_transposed_slices_exactly(dtype):
    hf_conv1d = torch.randn(48, 150)  # GPT-2 stores [in, out]; ours is its transpose, cut along our rows
    ours = hf_conv1d.t()
    for piece in (ours[24:150], ours[:1], ours, ours[:, 8:16], hf_conv1d[3:9]):  # bands of 64 rows, and a rest
        out = compact(piece, dtype)
        assert out.is_contiguous() and out.dtype == dtype
        assert torch.equal(out, piece.to(dtype).contiguous())


CONVERT_AND_REPORT = """
import json, sys
import torch, transformers
from colozoo.checkpoint.convert import convert, peak_rss_mb
transformers.AutoConfig.for_model("gpt2")
baseline = peak_rss_mb()
summary = convert(sys.argv[1], sys.argv[2], tp=2, pp=2)
print(json.dumps({**summary, "baseline_mb": baseline}))
"""


def test_conversion_memory_stays_near_the_largest_tensor(tmp_path):
    """A checkpoint of ~680 MiB whose largest tensor is 100 MiB: the converting process (a fresh one, so its peak
    is its own) stays within the largest tensor + 300 MB of its memory after imports."""
    config = transformers.GPT2Config(vocab_size=25600, n_embd=1024, n_layer=12, n_head=8, n_positions=64,
                                     architectures=["GPT2LMHeadModel"])
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in transformers.GPT2LMHeadModel(config).named_parameters()}
    (tmp_path / "hf").mkdir()
    writer = SafetensorsWriter(tmp_path / "hf" / "model.safetensors",
                               [(n, torch.float32, s) for n, s in shapes.items()], metadata={"format": "pt"})
    for name, shape in shapes.items():
        writer.write(name, torch.full(shape, 0.02))
    writer.close()
    config.save_pretrained(tmp_path / "hf")
    total = sum(torch.Size(s).numel() * 4 for s in shapes.values())
    largest = max(torch.Size(s).numel() * 4 for s in shapes.values())
    assert total > largest + 300 * MB + 150 * MB  # holding much more than one tensor would fail the bound below
    proc = subprocess.run([sys.executable, "-c", CONVERT_AND_REPORT, str(tmp_path / "hf"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["largest_tensor_bytes"] == largest and summary["bytes"] == total
    over = summary["peak_rss_mb"] - summary["baseline_mb"]
    assert over < largest / MB + 300, f"peak {over:.0f} MB over the baseline; largest tensor {largest / MB:.0f} MB"
