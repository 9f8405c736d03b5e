"""The colozoo checkpoint format, conversions, from_pretrained / save_pretrained on every mesh (names, the HF cache,
the CLI and every bad input: tests/test_checkpoint_errors.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from distributed import run_distributed
from family_cases import CAUSAL, MOE, NAMES, model_type, tiny_kwargs
from parity import close

import colozoo
from colozoo.checkpoint.convert import convert
from colozoo.checkpoint.format import INDEX_NAME, ColozooCheckpoint
from colozoo.core.errors import CheckpointError

TIMEOUT = 120
LOGITS_ATOL = 1e-5

# name -> (model_type, tiny HF config): every family of the table (its declared config; GPT-2 with 4 layers, for the
# uneven stage splits below), and variants whose checkpoint layouts differ
FAMILIES = {name: (model_type(name), tiny_kwargs(name)) for name in NAMES}
FAMILIES.update({
    "gpt2": ("gpt2", tiny_kwargs("gpt2", n_layer=4)),
    "gpt2-untied": ("gpt2", tiny_kwargs("gpt2", tie_word_embeddings=False, n_inner=128)),
    "opt-350m-style": ("opt", tiny_kwargs("opt", word_embed_proj_dim=32, do_layer_norm_before=False)),
    "bert-classifier": ("bert", tiny_kwargs("bert", architectures=["BertForSequenceClassification"])),
})
FIRST_MESH = {name: dict(tp=2, pp=2, ep=2) for name in MOE}  # experts sharded too
# stages of FIRST_MESH without an expert layer: DeepSeek-V3's first layer is dense (first_k_dense_replace=1) and
# alone on stage 0; Qwen2-MoE's second (mlp_only_layers=[1]) alone on stage 1
DENSE_STAGES = {"deepseek_v3": 1, "qwen2_moe": 1}
CAUSAL = set(CAUSAL)
KNOWN_ISSUES: dict[str, str] = {}  # family -> reason, for an expected failure


def family_param(name):
    marks = []
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
    # one file per (pp, tp, ep) owner; the ep ranks of a stage without experts (dense layers only) hold none of their own
    ep, dense = mesh.get("ep", 1), DENSE_STAGES.get(family, 0)
    assert first["files"] == mesh["tp"] * (mesh["pp"] * ep - dense * (ep - 1))
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
    convert(hf, tmp_path / "bf16", tp=2, dtype="bfloat16")
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
    model = colozoo.from_pretrained(hf, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert torch.equal(model.wte.weight, hf_state(hf)["transformer.wte.weight"].to(torch.bfloat16))
    assert colozoo.from_pretrained(hf, torch_dtype="auto").dtype == torch.float32  # the checkpoint's, as saved


@pytest.mark.parametrize("name,write", [("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32"), ("int8", None),
                                        ("bfloat", None)])
def test_dtype_names_are_transformers_and_nothing_else_passes(name, write, tmp_path):
    """The names transformers accepts are torch's; the others are refused in one line, before anything is read."""
    from colozoo.core.dtypes import NAMES, parse_dtype

    assert all(getattr(torch, n) is dtype for n, dtype in NAMES.items())  # what transformers' getattr(torch, n) gives
    hint = rf"; for '{name}' write '{write}'$" if write else r"'half'$"
    for argument in ("dtype", "torch_dtype"):
        with pytest.raises(ValueError, match=rf"^{argument}='{name}' is not a dtype transformers accepts: give a "
                                             rf"torch.dtype, 'auto' .*'float32', .*'bfloat16'.*{hint}"):
            colozoo.from_pretrained(tmp_path / "never-read", **{argument: name})
    with pytest.raises(ValueError, match="torch.int8 is not a floating-point dtype"):
        parse_dtype(torch.int8)


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
