"""The colozoo checkpoint format, conversions, from_pretrained / save_pretrained, CLI and every bad input."""
from __future__ import annotations

import importlib
import json
import math
import os
import re
import struct
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from distributed import run_distributed
from parity import close

import colozoo
from colozoo import cli
from colozoo.checkpoint.convert import convert
from colozoo.checkpoint.format import INDEX_NAME, ColozooCheckpoint
from colozoo.core.errors import CheckpointError
from colozoo.models.base import UnsupportedConfig
from colozoo.models import families
from colozoo.registry import UnknownModelError

TIMEOUT = 120
LOGITS_ATOL = 1e-5

# family -> (model_type, tiny HF config); heads and ffn divisible by 4 so tp=4 works, vocab 101 so it never divides
FAMILIES = {
    "gpt2": ("gpt2", dict(vocab_size=101, n_positions=32, n_embd=64, n_layer=4, n_head=4)),
    "gpt2-untied": ("gpt2", dict(vocab_size=101, n_positions=32, n_embd=64, n_layer=4, n_head=4,
                                 tie_word_embeddings=False, n_inner=128)),
    "opt": ("opt", dict(vocab_size=101, hidden_size=64, num_hidden_layers=4, ffn_dim=128, num_attention_heads=4,
                        max_position_embeddings=32, word_embed_proj_dim=64, pad_token_id=1)),
    "opt-350m-style": ("opt", dict(vocab_size=101, hidden_size=64, num_hidden_layers=4, ffn_dim=128,
                                   num_attention_heads=4, max_position_embeddings=32, word_embed_proj_dim=32,
                                   do_layer_norm_before=False, pad_token_id=1)),
    "llama": ("llama", dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32,
                            tie_word_embeddings=False)),
    "mixtral": ("mixtral", dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                num_attention_heads=8, num_key_value_heads=4, num_local_experts=4,
                                num_experts_per_tok=2, max_position_embeddings=32, tie_word_embeddings=False)),
    "qwen2_moe": ("qwen2_moe", dict(vocab_size=101, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=64, num_hidden_layers=4, num_attention_heads=8,
                                    num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                                    max_position_embeddings=32)),
    "bert": ("bert", dict(vocab_size=101, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                          intermediate_size=128, max_position_embeddings=32, architectures=["BertForMaskedLM"])),
    "bert-classifier": ("bert", dict(vocab_size=101, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=32, num_labels=3,
                                     architectures=["BertForSequenceClassification"])),
    "vit": ("vit", dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=128, num_labels=3, architectures=["ViTForImageClassification"])),
}
FIRST_MESH = {"mixtral": dict(tp=2, pp=2, ep=2), "qwen2_moe": dict(tp=2, pp=2, ep=2)}  # experts sharded too
CAUSAL = {"gpt2", "opt", "llama", "mixtral", "qwen2_moe"}


def available(model_type: str) -> bool:
    try:
        importlib.import_module(f"colozoo.converters.{families()[model_type].converter}")
    except (ImportError, KeyError):
        return False
    return True


KNOWN_ISSUES: dict[str, str] = {}  # family -> reason, for an expected failure


def family_param(name):
    marks = [] if available(FAMILIES[name][0]) else [pytest.mark.skip(reason=f"{FAMILIES[name][0]} not available yet")]
    if name in KNOWN_ISSUES:
        marks.append(pytest.mark.xfail(reason=KNOWN_ISSUES[name], raises=CheckpointError, strict=False))
    return pytest.param(name, marks=marks)


def make_hf(directory: Path, family: str = "gpt2", dtype=torch.float32, seed: int = 0, **save_kwargs) -> Path:
    """A random HF checkpoint written by transformers itself, norms and biases perturbed so misplacing one shows."""
    model_type, kwargs = FAMILIES[family]
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    architecture = (kwargs.get("architectures") or [None])[0]
    auto = getattr(transformers, architecture) if architecture else transformers.AutoModelForCausalLM
    model = auto.from_config(config) if hasattr(auto, "from_config") else auto._from_config(config)
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.to(dtype).save_pretrained(directory, **save_kwargs)
    return directory


def hf_state(directory: Path) -> dict[str, torch.Tensor]:
    index = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    out = {}
    for f in files:
        out.update(load_file(directory / f))
    return out


def assert_bit_identical(a: dict, b: dict):
    assert sorted(a) == sorted(b), set(a) ^ set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, (name, a[name].dtype, b[name].dtype)
        assert torch.equal(a[name], b[name]), name


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp" in p.name or "staging" in p.name)


def batch(vocab: int, seq: int = 12):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, seq), generator=g)
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[0, :3] = 0
    return ids, mask


# --- round trips -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", [family_param(f) for f in FAMILIES])
def test_round_trip_bit_identical(tmp_path, family, dtype):
    hf = make_hf(tmp_path / "hf", family, dtype)
    mesh = FIRST_MESH.get(family, dict(tp=2, pp=2))
    first = convert(hf, tmp_path / "tp2pp2", **mesh)
    assert first["files"] == math.prod(mesh.values())  # one file per (pp, tp, ep) owner
    second = convert(tmp_path / "tp2pp2", tmp_path / "tp4", tp=4, pp=1)
    assert second["files"] == 4 and second["bytes"] == first["bytes"]
    ckpt = ColozooCheckpoint(tmp_path / "tp4")
    assert ckpt.mesh["tp"] == 4 and ckpt.index["family"] == FAMILIES[family][0]
    convert(tmp_path / "tp4", tmp_path / "back", to_hf=True)
    assert_bit_identical(hf_state(hf), hf_state(tmp_path / "back"))
    assert not leftovers(tmp_path)
    if dtype == torch.float32 and FAMILIES[family][0] in CAUSAL:  # transformers loads it: same logits
        original = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
        exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
        ids, mask = batch(original.config.vocab_size)
        assert torch.equal(original(ids, attention_mask=mask).logits, exported(ids, attention_mask=mask).logits)


def test_checkpoint_stores_global_unpadded_fused_tensors(tmp_path):
    make_hf(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "ckpt", tp=2, pp=2)
    index = json.loads((tmp_path / "ckpt" / INDEX_NAME).read_text())
    assert index["format_version"] == 1 and index["mesh"] == {"tp": 2, "pp": 2, "ep": 1, "dp": 1, "cp": 1}
    assert index["tied"] == {"lm_head.weight": "wte.weight"} and "lm_head.weight" not in index["tensors"]
    wte = index["tensors"]["wte.weight"]
    assert wte["shape"] == [101, 64] and wte["spec"] == [{"mesh_dim": "tp", "dim": 0, "logical_size": 101}]
    assert [p["shape"] for p in wte["pieces"]] == [[51, 64], [50, 64]]  # padding never stored
    qkv = index["tensors"]["layers.3.attn.c_attn.weight"]  # global layer index, on the second stage
    assert qkv["spec"][0]["chunks"] == [64, 64, 64]
    assert {p["file"] for p in qkv["pieces"]} == {"model-pp01-tp00-ep00.safetensors", "model-pp01-tp01-ep00.safetensors"}
    assert sorted(p["offsets"][0] for p in qkv["pieces"]) == [0, 32, 64, 96, 128, 160]
    ln = index["tensors"]["layers.0.ln_1.weight"]  # replicated: saved once
    assert [p["file"] for p in ln["pieces"]] == ["model-pp00-tp00-ep00.safetensors"]
    for name, info in index["files"].items():
        assert len(info["sha256"]) == 64 and (tmp_path / "ckpt" / name).stat().st_size == info["size"]
    original = hf_state(tmp_path / "hf")
    qkv_global = ColozooCheckpoint(tmp_path / "ckpt").tensor("layers.3.attn.c_attn.weight").read()
    assert torch.equal(qkv_global, original["transformer.h.3.attn.c_attn.weight"].t())


def test_dtype_conversion_and_sharded_hf(tmp_path):
    hf = make_hf(tmp_path / "hf", max_shard_size="100KB")  # sharded input with an index
    assert (hf / "model.safetensors.index.json").exists()
    convert(hf, tmp_path / "bf16", tp=2, dtype="bf16")
    convert(tmp_path / "bf16", tmp_path / "out", to_hf=True, max_shard_bytes=100_000)
    out = tmp_path / "out"
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("model-*.safetensors"))) > 1
    expected = {k: v.to(torch.bfloat16) for k, v in hf_state(hf).items()}
    assert_bit_identical(expected, hf_state(out))
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    colozoo.convert(hf, tmp_path / "fp16", to_hf=True, dtype=torch.float16)  # HF -> HF, dtype on the fly
    assert_bit_identical({k: v.to(torch.float16) for k, v in hf_state(hf).items()}, hf_state(tmp_path / "fp16"))


def test_bin_weights_only_behind_flag(tmp_path):
    make_hf(tmp_path / "hf")
    (tmp_path / "bin").mkdir()
    state = hf_state(tmp_path / "hf")
    torch.save(state, tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="allow_bin"):
        convert(tmp_path / "bin", tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    convert(tmp_path / "bin", tmp_path / "ckpt", tp=2, allow_bin=True)
    convert(tmp_path / "ckpt", tmp_path / "back", to_hf=True)
    assert_bit_identical(state, hf_state(tmp_path / "back"))


# --- from_pretrained / save_pretrained on a mesh --------------------------------------------------------------

def _logits_vs_transformers(path, reference, tp, pp=1, dtype=None, ep=1):
    model = colozoo.from_pretrained(path, tp=tp, pp=pp, dtype=dtype, ep=ep)
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference).eval()
    ids, mask = batch(hf.config.vocab_size)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, return_logits=True).logits
        ref = hf(ids, attention_mask=mask).logits
    keep = mask.bool()
    close(out[keep], ref[keep], LOGITS_ATOL, "logits")
    return (out - ref)[keep].abs().max().item()


def _save_then_check(path, out_colozoo, out_hf, tp, pp=1, ep=1, layers_per_stage=None):
    model = colozoo.from_pretrained(path, tp=tp, pp=pp, ep=ep, layers_per_stage=layers_per_stage)
    model.save_pretrained(out_colozoo, format="colozoo")
    model.save_pretrained(out_hf, format="hf")
    return True


@pytest.mark.parametrize("family", [family_param("gpt2"), family_param("opt")])
def test_from_pretrained_matches_transformers(tmp_path, family):
    hf = make_hf(tmp_path / "hf", family)
    _logits_vs_transformers(hf, hf, tp=1)
    convert(hf, tmp_path / "tp4pp2", tp=4, pp=2)  # a colozoo checkpoint saved on another mesh
    run_distributed(_logits_vs_transformers, 2, path=hf, reference=hf, tp=2, timeout=TIMEOUT)
    run_distributed(_logits_vs_transformers, 2, path=tmp_path / "tp4pp2", reference=hf, tp=2, timeout=TIMEOUT)


def test_from_pretrained_tp2_pp2(tmp_path):
    hf = make_hf(tmp_path / "hf", "gpt2")
    convert(hf, tmp_path / "tp1", tp=1)
    run_distributed(_logits_vs_transformers, 4, path=tmp_path / "tp1", reference=hf, tp=2, pp=2, timeout=TIMEOUT)
    run_distributed(_logits_vs_transformers, 4, path=hf, reference=hf, tp=2, pp=2,
                    timeout=TIMEOUT)  # the tied head on the last stage


def test_from_pretrained_dtype(tmp_path):
    hf = make_hf(tmp_path / "hf", "gpt2")
    model = colozoo.from_pretrained(hf, dtype="bf16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert torch.equal(model.wte.weight, hf_state(hf)["transformer.wte.weight"].to(torch.bfloat16))


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)])
def test_save_pretrained_collectively_then_reload(tmp_path, tp, pp):
    hf = make_hf(tmp_path / "hf", "gpt2")
    run_distributed(_save_then_check, tp * pp, path=hf, out_colozoo=tmp_path / "saved", out_hf=tmp_path / "saved_hf",
                    tp=tp, pp=pp, timeout=TIMEOUT)
    index = json.loads((tmp_path / "saved" / INDEX_NAME).read_text())
    assert index["mesh"]["tp"] == tp and index["mesh"]["pp"] == pp and len(index["files"]) == tp * pp
    assert_bit_identical(hf_state(hf), hf_state(tmp_path / "saved_hf"))
    assert not leftovers(tmp_path)
    _logits_vs_transformers(tmp_path / "saved", hf, tp=1)  # reloaded at another mesh
    convert(tmp_path / "saved", tmp_path / "back", to_hf=True)
    assert_bit_identical(hf_state(hf), hf_state(tmp_path / "back"))


def test_save_pretrained_from_an_uneven_stage_split(tmp_path):
    # stages of 1 and 3 layers (not the default split); the tied embedding's copy on the last stage is not saved
    hf = make_hf(tmp_path / "hf", "gpt2")
    run_distributed(_save_then_check, 2, path=hf, out_colozoo=tmp_path / "saved", out_hf=tmp_path / "saved_hf", tp=1,
                    pp=2, ep=1, layers_per_stage=[1, 3],
                    timeout=TIMEOUT)
    index = json.loads((tmp_path / "saved" / INDEX_NAME).read_text())
    pieces = index["tensors"]["layers.1.attn.c_attn.weight"]["pieces"]
    assert {p["file"] for p in pieces} == {"model-pp01-tp00-ep00.safetensors"}  # layer 1 is on the second stage
    assert_bit_identical(hf_state(hf), hf_state(tmp_path / "saved_hf"))
    convert(tmp_path / "saved", tmp_path / "back", to_hf=True)
    assert_bit_identical(hf_state(hf), hf_state(tmp_path / "back"))


@pytest.mark.skipif(not available("mixtral"), reason="mixtral not available yet")
def test_experts_load_and_save_at_ep2(tmp_path):
    hf = make_hf(tmp_path / "hf", "mixtral")
    convert(hf, tmp_path / "tp2ep2", tp=2, ep=2)
    run_distributed(_logits_vs_transformers, 2, path=tmp_path / "tp2ep2", reference=hf, tp=1, pp=1, dtype=None, ep=2,
                    timeout=TIMEOUT)
    run_distributed(_save_then_check, 2, path=hf, out_colozoo=tmp_path / "saved", out_hf=tmp_path / "saved_hf", tp=1,
                    pp=1, ep=2, timeout=TIMEOUT)
    experts = json.loads((tmp_path / "saved" / INDEX_NAME).read_text())["tensors"]["layers.0.mlp.experts.gate_up_proj"]
    assert sorted(p["offsets"][0] for p in experts["pieces"]) == [0, 0, 2, 2]  # global expert index x (gate, up)
    assert_bit_identical(hf_state(hf), hf_state(tmp_path / "saved_hf"))


def _save_after_fsdp(path, out_colozoo, out_hf):
    from colozoo.runtime.training import parallelize

    model = colozoo.from_pretrained(path, tp=2, dp=2).train()
    parallelize(model, data_parallel="fsdp")
    assert any(hasattr(p, "full_tensor") for p in model.parameters())  # FSDP shards over dp
    model.save_pretrained(out_colozoo, format="colozoo")
    model.save_pretrained(out_hf, format="hf")
    return True


def test_save_pretrained_of_an_fsdp_model(tmp_path):
    # dp=2 x tp=2: FSDP splits each tp shard over the data ranks; saving gathers them tensor by tensor
    hf = make_hf(tmp_path / "hf", "gpt2")
    run_distributed(_save_after_fsdp, 4, path=hf, out_colozoo=tmp_path / "saved", out_hf=tmp_path / "saved_hf",
                    timeout=TIMEOUT)
    assert_bit_identical(hf_state(hf), hf_state(tmp_path / "saved_hf"))
    convert(tmp_path / "saved", tmp_path / "back", to_hf=True)
    assert_bit_identical(hf_state(hf), hf_state(tmp_path / "back"))


def _save_fsdp_counting_whole_parameters(path, out):
    """The most whole (gathered) parameters alive at once on this rank while save_pretrained runs."""
    import weakref

    from torch.distributed.tensor import DTensor

    from colozoo.runtime.training import parallelize

    model = colozoo.from_pretrained(path, dp=2).train()
    parallelize(model, data_parallel="fsdp")
    original, alive, most = DTensor.full_tensor, [], [0]

    def counting(self, *args, **kwargs):
        whole = original(self, *args, **kwargs)
        alive[:] = [ref for ref in alive if ref() is not None] + [weakref.ref(whole)]
        most[0] = max(most[0], len(alive))
        return whole
    DTensor.full_tensor = counting
    try:
        model.save_pretrained(out, format="colozoo")
    finally:
        DTensor.full_tensor = original
    return most[0]


def test_save_pretrained_under_fsdp_gathers_one_parameter_at_a_time(tmp_path):
    hf = make_hf(tmp_path / "hf", "gpt2")
    most = run_distributed(_save_fsdp_counting_whole_parameters, 2, path=hf, out=tmp_path / "saved", timeout=TIMEOUT)
    assert most == [1, 1], f"whole parameters held at once per rank: {most}"
    convert(tmp_path / "saved", tmp_path / "back", to_hf=True)
    assert_bit_identical(hf_state(hf), hf_state(tmp_path / "back"))


def _save_with_a_failing_rank(path, out):
    import torch.distributed as dist

    from colozoo.checkpoint import safetensors_io

    model = colozoo.from_pretrained(path, tp=2)
    original = safetensors_io.SafetensorsWriter.write
    if dist.get_rank() == 1:
        def disk_full(self, key, tensor):
            raise OSError("No space left on device")
        safetensors_io.SafetensorsWriter.write = disk_full
    try:
        model.save_pretrained(out, format="colozoo")
    except (OSError, CheckpointError) as e:
        return str(e)
    finally:
        safetensors_io.SafetensorsWriter.write = original
    return "saved"


def test_save_pretrained_failing_rank_leaves_nothing(tmp_path):
    hf = make_hf(tmp_path / "hf", "gpt2")
    messages = run_distributed(_save_with_a_failing_rank, 2, path=hf, out=tmp_path / "out", timeout=TIMEOUT)
    assert "failed on rank 1" in messages[0] and "No space left" in messages[0]
    assert "No space left" in messages[1]
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_save_pretrained_refuses_a_directory_that_is_no_checkpoint_of_its_format(tmp_path):
    """The colozoo format replaces only a colozoo checkpoint; the HF format replaces as transformers does (see
    tests/test_transformers_script.py)."""
    hf = make_hf(tmp_path / "hf", "gpt2")
    model = colozoo.from_pretrained(hf)
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        model.save_pretrained(tmp_path / "dst", format="colozoo")
    assert [p.name for p in (tmp_path / "dst").iterdir()] == ["keep.txt"] and not leftovers(tmp_path)


# --- registry names and the HF cache ---------------------------------------------------------------------

def test_registry_name_resolves_from_hf_cache(tmp_path, monkeypatch):
    snapshot = tmp_path / "home" / "hub" / "models--openai-community--gpt2" / "snapshots" / "abc123"
    make_hf(snapshot, "gpt2")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc123")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    for name in ("gpt2", "openai-community/gpt2"):
        _logits_vs_transformers(name, snapshot, tp=1)


def test_any_repo_id_in_the_hf_cache_resolves(tmp_path, monkeypatch):
    """Not only registered names: any repo id the local cache holds, as transformers' from_pretrained finds it."""
    snapshot = tmp_path / "hub" / "models--SomeOrg--tiny-gpt2" / "snapshots" / "abc123"
    make_hf(snapshot, "gpt2")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    _logits_vs_transformers("SomeOrg/tiny-gpt2", snapshot, tp=1)
    with pytest.raises(FileNotFoundError, match="huggingface-cli download SomeOrg/other"):
        colozoo.from_pretrained("SomeOrg/other")


def test_registry_name_missing_from_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        colozoo.from_pretrained("opt-125m")
    message = str(e.value)
    assert "huggingface-cli download facebook/opt-125m" in message
    assert str(tmp_path / "cache" / "models--facebook--opt-125m") in message


def test_unknown_model_name():
    with pytest.raises(UnknownModelError, match="unknown model 'gpt2-tiny'.*gpt2"):
        colozoo.from_pretrained("gpt2-tiny")


# --- bad input: one clear error naming the tensor or file, nothing half-written --------------------------

def _rewrite_weights(hf: Path, edit):
    state = load_file(hf / "model.safetensors")
    edit(state)
    save_file(state, hf / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("case,edit,message", [
    ("missing", lambda s: s.pop("transformer.h.1.mlp.c_fc.weight"), r"missing tensor 'transformer\.h\.1\.mlp\.c_fc\.weight'"),
    ("unexpected", lambda s: s.update({"transformer.h.9.extra": torch.zeros(2)}), r"unexpected tensors.*transformer\.h\.9\.extra"),
    ("shape", lambda s: s.update({"transformer.ln_f.weight": torch.zeros(63)}), r"'ln_f\.weight'.*\(63,\).*\(64,\)"),
])
def test_bad_hf_tensors(tmp_path, case, edit, message):
    hf = make_hf(tmp_path / "hf")
    _rewrite_weights(hf, edit)
    with pytest.raises(CheckpointError, match=message):
        convert(hf, tmp_path / "out", tp=2)
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)
    with pytest.raises(CheckpointError, match=message):
        colozoo.from_pretrained(hf)


def test_config_disagreeing_with_weights(tmp_path):
    hf = make_hf(tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "n_inner": 128}))
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.c_fc\.weight.*\(256, 64\).*\(128, 64\)"):
        convert(hf, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family,overrides,tp,message", [
    ("gpt2", {}, 3, r"tp=3 must divide the attention heads \(n_head\) \(4\)"),
    ("gpt2", {"n_inner": 98}, 4, r"tp=4 must divide the MLP width \(n_inner\) \(98\)"),
    pytest.param("llama", {"hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 3}, 4,
                 r"tp=4 must divide the key/value heads",  # 2 kv heads would be replicated over pairs of ranks
                 marks=pytest.mark.skipif(not available("llama"), reason="llama not available yet")),
])
def test_tp_not_dividing_heads_or_ffn(tmp_path, monkeypatch, family, overrides, tp, message):
    model_type, kwargs = FAMILIES[family]
    monkeypatch.setitem(FAMILIES, family, (model_type, {**kwargs, **overrides}))
    hf = make_hf(tmp_path / "hf", family)
    with pytest.raises(UnsupportedConfig, match=message):
        convert(hf, tmp_path / "out", tp=tp)
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_truncated_safetensors(tmp_path):
    hf = make_hf(tmp_path / "hf")
    convert(hf, tmp_path / "ckpt", tp=2)
    for path in (hf / "model.safetensors", tmp_path / "ckpt" / "model-pp00-tp01-ep00.safetensors"):
        data = path.read_bytes()
        path.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        convert(hf, tmp_path / "out")
    with pytest.raises(CheckpointError, match=r"model-pp00-tp01-ep00\.safetensors.*truncated"):
        convert(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_checksum_mismatch(tmp_path):
    hf = make_hf(tmp_path / "hf")
    convert(hf, tmp_path / "ckpt", tp=2)
    path = tmp_path / "ckpt" / "model-pp00-tp01-ep00.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # same size, one byte of a weight flipped
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"checksum mismatch in .*model-pp00-tp01-ep00\.safetensors"):
        convert(tmp_path / "ckpt", tmp_path / "out", to_hf=True)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        colozoo.from_pretrained(tmp_path / "ckpt")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match=r"junk is not a checkpoint"):
        convert(tmp_path / "junk", tmp_path / "out")
    with pytest.raises(CheckpointError, match=r"junk is not a checkpoint"):
        colozoo.from_pretrained(tmp_path / "junk")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert(tmp_path / "nowhere", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_non_empty_destination(tmp_path):
    hf = make_hf(tmp_path / "hf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"out already exists and is not empty"):
        convert(hf, tmp_path / "out", tp=2)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
    convert(hf, tmp_path / "empty_ok")  # an existing empty directory is fine
    (tmp_path / "empty").mkdir()
    convert(hf, tmp_path / "empty")
    assert (tmp_path / "empty" / INDEX_NAME).exists()


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    from colozoo.checkpoint import safetensors_io

    hf = make_hf(tmp_path / "hf")
    calls = {"n": 0}
    original = safetensors_io.SafetensorsWriter.write

    def failing_write(self, key, tensor):
        calls["n"] += 1
        if calls["n"] == 10:
            raise KeyboardInterrupt
        return original(self, key, tensor)

    monkeypatch.setattr(safetensors_io.SafetensorsWriter, "write", failing_write)
    with pytest.raises(KeyboardInterrupt):
        convert(hf, tmp_path / "out", tp=2)
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_missing_tensor_in_colozoo_checkpoint(tmp_path):
    hf = make_hf(tmp_path / "hf")
    convert(hf, tmp_path / "ckpt")
    index_path = tmp_path / "ckpt" / INDEX_NAME
    index = json.loads(index_path.read_text())
    del index["tensors"]["layers.2.ln_2.bias"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint.*layers\.2\.ln_2\.bias"):
        convert(tmp_path / "ckpt", tmp_path / "out", tp=2)
    with pytest.raises(CheckpointError, match=r"layers\.2\.ln_2\.bias"):
        colozoo.from_pretrained(tmp_path / "ckpt")


# --- CLI -----------------------------------------------------------------------------------------------------

def test_cli_convert_and_models(tmp_path, capsys):
    hf = make_hf(tmp_path / "hf")
    assert cli.main(["convert", str(hf), str(tmp_path / "ckpt"), "--tp", "2", "--pp", "2", "--dtype", "bf16"]) == 0
    out = capsys.readouterr()
    assert "52 tensors" in out.out and "peak RSS" in out.out and "B/s" in out.err, out  # summary and byte progress bar
    assert cli.main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf2"), "--to-hf", "--quiet"]) == 0
    assert hf_state(tmp_path / "hf2")["transformer.wte.weight"].dtype == torch.bfloat16
    assert cli.main(["convert", str(hf), str(tmp_path / "ckpt"), "--quiet"]) == 1
    assert "already exists and is not empty" in capsys.readouterr().err
    assert cli.main(["convert", str(hf), str(tmp_path / "x"), "--tp", "3", "--quiet"]) == 1
    assert "tp=3 must divide" in capsys.readouterr().err
    assert cli.main(["models"]) == 0
    table = capsys.readouterr().out
    assert "opt-66b" in table and "facebook/opt-66b" in table and "gpt2-xl" in table


def _auto_plan_logits(path, gpu_memory):
    model = colozoo.from_pretrained(path, plan="auto", gpu_memory=gpu_memory)
    degrees = model.run.plan.degrees()
    assert degrees["tp"] * degrees["pp"] * degrees["dp"] * degrees["cp"] == 2
    assert (model.pc.config.tp, model.pc.config.pp) == (degrees["tp"], degrees["pp"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids, mask = batch(hf.config.vocab_size)
    with torch.no_grad():
        ours, theirs = model(ids, attention_mask=mask, return_logits=True).logits, hf(ids, attention_mask=mask).logits
    close(ours[mask.bool()], theirs[mask.bool()], LOGITS_ATOL, "logits")
    return degrees


def test_from_pretrained_auto_plan(tmp_path):
    """plan="auto" takes the planner's degrees for the world it runs in, and the model still matches transformers."""
    hf = make_hf(tmp_path / "hf", "gpt2")
    plans = run_distributed(_auto_plan_logits, 2, path=hf, gpu_memory="8GB", timeout=TIMEOUT)
    assert all(p == plans[0] for p in plans), "every rank must get the same plan"
    with pytest.raises(ValueError, match="plan must be"):
        colozoo.from_pretrained(hf, plan="fastest")


# --- corrupted files (same size, so only their content can tell), through the API and the CLI ----------------

SHARD = "model-pp00-tp01-ep00.safetensors"


def edit_bytes(edit):
    def apply(path: Path):
        data = bytearray(path.read_bytes())
        edit(data)
        path.write_bytes(bytes(data))
    return apply


def edit_json(edit):
    def apply(path: Path):
        index = json.loads(path.read_text())
        edit(index)
        path.write_text(json.dumps(index))
    return apply


def _garbage_header_length(data):
    data[:8] = struct.pack("<Q", 0x7A3F_0000_1234_5678)


def _garbage_header_json(data):
    data[9:25] = b"\xff" * 16


def _unknown_dtype(data):
    start = data.index(b'"dtype":"F32"', 8)
    data[start:start + 13] = b'"dtype":"Q32"'


def _piece_outside(index):
    index["tensors"]["wte.weight"]["pieces"][1]["offsets"] = [90, 0]


def _extra_tensor(index):
    index["tensors"]["layers.9.mlp.extra"] = index["tensors"]["ln_f.bias"]


CORRUPTIONS = {  # name -> (source kind, file damaged, how, the error it must give)
    "hf_header_length": ("hf", "model.safetensors", edit_bytes(_garbage_header_length),
                         r"model\.safetensors is not a valid safetensors file.*header length"),
    "hf_header_json": ("hf", "model.safetensors", edit_bytes(_garbage_header_json),
                       r"model\.safetensors is not a valid safetensors file"),
    "hf_header_entry": ("hf", "model.safetensors", edit_bytes(_unknown_dtype),
                        r"model\.safetensors: malformed header entry for tensor '[\w.]+'"),
    "hf_index_json": ("hf_sharded", "model.safetensors.index.json", edit_bytes(lambda d: d.__setitem__(0, ord("["))),
                      r"model\.safetensors\.index\.json is corrupted"),
    "colozoo_header_length": ("colozoo", SHARD, edit_bytes(_garbage_header_length),
                              rf"{SHARD} is not a valid safetensors file.*header length"),
    "colozoo_header_entry": ("colozoo", SHARD, edit_bytes(_unknown_dtype),
                             rf"{SHARD}: malformed header entry for tensor '[\w.:]+'"),
    "colozoo_index_json": ("colozoo", INDEX_NAME, edit_bytes(lambda d: d.__delitem__(slice(len(d) // 2, None))),
                           rf"{INDEX_NAME} is corrupted"),
    "colozoo_index_piece": ("colozoo", INDEX_NAME, edit_json(_piece_outside),
                            rf"{INDEX_NAME} is corrupted: a piece of tensor 'wte\.weight' .*outside"),
    "colozoo_index_extra": ("colozoo", INDEX_NAME, edit_json(_extra_tensor),
                            r"unexpected tensors in the checkpoint .*layers\.9\.mlp\.extra"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupted_input_one_clear_error(tmp_path, capsys, case):
    """Through the API and the CLI: one error naming the file or tensor (exit code 1, one stderr line), nothing
    written beside the destination."""
    kind, file, damage, message = CORRUPTIONS[case]
    src = make_hf(tmp_path / "hf", **({"max_shard_size": "100KB"} if kind == "hf_sharded" else {}))
    if kind == "colozoo":
        convert(src, tmp_path / "ckpt", tp=2)
        src = tmp_path / "ckpt"
    damage(src / file)
    parent = tmp_path / "parent"
    parent.mkdir()
    with pytest.raises(CheckpointError, match=message):
        convert(src, parent / "out", tp=2)
    capsys.readouterr()
    assert cli.main(["convert", str(src), str(parent / "out"), "--tp", "2", "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("colozoo convert: error:") and re.search(message, err[0]), err
    assert list(parent.iterdir()) == []


def test_stale_temp_dirs_of_dead_writers_are_removed(tmp_path):
    """A writer killed with SIGKILL leaves its temp dir; the next write to that destination removes it, but never the
    dir of a writer that is still alive, nor one another host made on a shared disk."""
    import socket
    import subprocess

    hf = make_hf(tmp_path / "hf")
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is free now: a writer that died
    host = socket.gethostname()
    parent = tmp_path / "parent"
    names = {"dead": f".out.tmp-{host}-{dead.pid}", "alive": f".out.tmp-{host}-{os.getppid()}",
             "other_host": f".out.tmp-elsewhere.example-{dead.pid}",
             "other_destination": f".out2.tmp-{host}-{dead.pid}"}
    for name in names.values():
        (parent / name).mkdir(parents=True)
        (parent / name / "model-pp00-tp00-ep00.safetensors").write_bytes(b"half written")
    convert(hf, parent / "out")
    assert sorted(p.name for p in parent.iterdir()) == sorted(["out", *(names[k] for k in names if k != "dead")])
