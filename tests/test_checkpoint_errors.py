"""Checkpoints from the user's side: registry names and the local Hugging Face cache, every bad input (one clear
error naming the tensor or file, nothing half-written), the CLI, corrupted files through the API and the CLI."""
from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from distributed import run_distributed
from parity import close
from test_checkpoint import (FAMILIES, LOGITS_ATOL, TIMEOUT, _logits_vs_transformers, batch, hf_state,
                             leftovers, make_hf)

import colozoo
from colozoo import cli
from colozoo.checkpoint.checksums import write_checksums
from colozoo.checkpoint.convert import convert
from colozoo.checkpoint.format import INDEX_NAME
from colozoo.core.errors import CheckpointError
from colozoo.models.base import UnsupportedConfig
from colozoo.registry import UnknownModelError


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
    ("llama", {"hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 3}, 4,
     r"tp=4 must divide the key/value heads"),  # 2 kv heads would be replicated over pairs of ranks
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
    with pytest.raises(CheckpointError, match=rf"checksum mismatch in \S*{INDEX_NAME}"):  # a hand edit
        colozoo.from_pretrained(tmp_path / "ckpt")
    write_checksums(tmp_path / "ckpt")  # as a tool that rewrites indexes would: the index itself must say it
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint.*layers\.2\.ln_2\.bias"):
        convert(tmp_path / "ckpt", tmp_path / "out", tp=2)
    with pytest.raises(CheckpointError, match=r"layers\.2\.ln_2\.bias"):
        colozoo.from_pretrained(tmp_path / "ckpt")


# --- CLI -----------------------------------------------------------------------------------------------------

def test_cli_convert_and_models(tmp_path, capsys):
    hf = make_hf(tmp_path / "hf")
    assert cli.main(["convert", str(hf), str(tmp_path / "ckpt"), "--tp", "2", "--pp", "2", "--dtype", "bfloat16"]) == 0
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
    degrees = asdict(model.run.plan.degrees)
    assert degrees["tp"] * degrees["pp"] * degrees["dp"] * degrees["cp"] == 2
    assert (model.parallel.config.tp, model.parallel.config.pp) == (degrees["tp"], degrees["pp"])
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


def edit_json(edit, reseal: bool = True):
    """Edit a JSON file; `reseal`: and its checksum, as a tool rewriting it would (else only checksums.json can
    tell)."""
    def apply(path: Path):
        index = json.loads(path.read_text())
        edit(index)
        path.write_text(json.dumps(index))
        if reseal:
            write_checksums(path.parent)
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


def _pieces_swapped(index):
    """Two pieces of one tensor trade places: still a consistent index, the weights silently wrong."""
    first, second = next(e["pieces"][:2] for e in index["tensors"].values()
                         if len(e["pieces"]) > 1 and e["pieces"][0]["shape"] == e["pieces"][1]["shape"])
    first["offsets"], second["offsets"] = second["offsets"], first["offsets"]


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
    "colozoo_index_swapped": ("colozoo", INDEX_NAME, edit_json(_pieces_swapped, reseal=False),
                              rf"checksum mismatch in \S*{INDEX_NAME}"),
    "colozoo_side_file": ("colozoo", "generation_config.json", edit_json(lambda c: c.update(max_length=7),
                                                                         reseal=False),
                          r"checksum mismatch in \S*generation_config\.json"),
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


# --- what colozoo never does: run remote code, or answer a legacy pickle with torch's mmap message -------------

def test_an_unknown_model_type_with_remote_code_is_one_line_that_never_suggests_running_it(tmp_path, capsys):
    model = tmp_path / "custom"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "my_model", "architectures": ["MyModelForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_my.MyConfig", "AutoModelForCausalLM": "modeling_my.MyModel"}}))
    (model / "configuration_my.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(UnknownModelError) as refused:
        colozoo.from_pretrained(model)
    message = str(refused.value)
    assert re.fullmatch(r"\S+config\.json: model type 'my_model' \(MyModelForCausalLM\) is not one colozoo builds "
                        r"\(its config\.json points at custom code in auto_map: colozoo never runs code from a model "
                        r"directory\); colozoo builds .*\bllama\b.*", message), message
    assert "trust_remote_code" not in message
    assert cli.main(["convert", str(model), str(tmp_path / "out"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "never runs code" in err and "trust_remote_code" not in err and len(err.strip().splitlines()) == 1


def test_a_legacy_pickle_loads_under_allow_bin(tmp_path):
    """torch's pre-1.6 format (not a zip) cannot be memory-mapped: it is read whole, still weights_only."""
    make_hf(tmp_path / "hf")
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    torch.save(hf_state(tmp_path / "hf"), legacy / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    (legacy / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    model = colozoo.from_pretrained(legacy, allow_bin=True)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids, mask = batch(reference.config.vocab_size)
    with torch.no_grad():
        ours = model(ids, attention_mask=mask, return_logits=True).logits
        theirs = reference(ids, attention_mask=mask).logits
    close(ours[mask.bool()], theirs[mask.bool()], LOGITS_ATOL, "logits from a legacy pickle")
