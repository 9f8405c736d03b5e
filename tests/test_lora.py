"""LoRA against PEFT on transformers (tests/lora_parity.py): loss, logits and every adapter gradient at tp 1, 2
and 4, tp2 x pp2 and dp2 with FSDP; the PEFT format both ways; the colozoo format with adapters; the merged export;
bad input."""
import pytest
from distributed import run_distributed
from lora_parity import FAMILIES, lora_parity

TIMEOUT = 240


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_matches_peft_single_process(family):
    assert lora_parity(family) > 0


def test_lora_rslora_scaling_matches_peft():
    assert lora_parity("opt", use_rslora=True) > 0


def _every_family(**mesh):
    return {family: lora_parity(family, **mesh) for family in FAMILIES}


def test_lora_matches_peft_tp2():
    results = run_distributed(_every_family, 2, tp=2, timeout=TIMEOUT)
    assert all(n > 0 for result in results for n in result.values())


def _pipelined():
    return {family: lora_parity(family, tp=2, pp=2) for family in ("gpt2", "opt", "llama")}


def test_lora_matches_peft_tp2_pp2():
    results = run_distributed(_pipelined, 4, timeout=TIMEOUT)
    assert all(n > 0 for result in results for n in result.values())


def test_lora_matches_peft_dp2_fsdp():
    results = run_distributed(_every_family, 2, dp=2, data_parallel="fsdp", timeout=TIMEOUT)
    assert all(n > 0 for result in results for n in result.values())


# --- the PEFT format: colozoo (tp2) -> PEFT directory -> transformers + peft, and -> colozoo at tp 1 and 4 ------

# Conv1D (fan_in_fan_out), GQA with every linear adapted, a classifier trained whole (PEFT's modules_to_save) and
# GPT-NeoX's per-head query_key_value (B's rows regrouped)
ROUND_TRIP = ("gpt2", "llama", "bert", "gpt_neox")
SAVED_WHOLE = {"bert": ["base_model.model.classifier.bias", "base_model.model.classifier.weight"]}


def _auto_class(family):
    import transformers

    return (transformers.AutoModelForSequenceClassification if family == "bert"
            else transformers.AutoModelForCausalLM)


def _save_adapters(directory: str):
    import torch.distributed as dist

    import torch

    import colozoo
    from lora_parity import ALPHA, CASES, R, hf_and_batch, randomize_b

    from colozoo.runtime.lora import apply_lora, trained_modules

    logits = {}
    for family in ROUND_TRIP:
        _, hf, inputs, _ = hf_and_batch(family)
        base = f"{directory}/{family}-base"
        if dist.get_rank() == 0:
            hf.save_pretrained(base)
        dist.barrier()
        model = colozoo.from_pretrained(base, tp=2)
        apply_lora(model, r=R, alpha=ALPHA, targets=CASES[family][2])
        randomize_b(model)
        params = dict(model.named_parameters())
        with torch.no_grad():  # as if trained: the adapter's classifier differs from the base's
            for name in trained_modules(model):
                params[name].add_(torch.randn(params[name].shape, generator=torch.Generator().manual_seed(3)))
        model.save_pretrained(f"{directory}/{family}-adapter", format="peft")
        model.save_pretrained(f"{directory}/{family}-merged", format="hf", merge_lora=True)
        model.save_pretrained(f"{directory}/{family}-colozoo", format="colozoo")  # it keeps the adapters too
        logits[family] = model(**inputs, return_logits=True).logits.detach()
    return logits


def _gathered_adapters(directory: str):
    import colozoo
    from colozoo.checkpoint.peft import gather_adapters

    out = {}
    for family in ROUND_TRIP:
        out[family] = gather_adapters(colozoo.from_pretrained(f"{directory}/{family}-base", tp=4,
                                                              adapter=f"{directory}/{family}-adapter"))
        out[f"{family}-colozoo"] = gather_adapters(colozoo.from_pretrained(f"{directory}/{family}-colozoo", tp=4))
    return out


def test_peft_round_trip(tmp_path):
    import json

    import peft
    import torch
    from lora_parity import hf_and_batch
    from parity import close
    from safetensors.torch import load_file

    import colozoo
    from colozoo.checkpoint.peft import gather_adapters

    logits = run_distributed(_save_adapters, 2, directory=str(tmp_path), timeout=TIMEOUT)[0]
    at_tp4 = run_distributed(_gathered_adapters, 4, directory=str(tmp_path), timeout=TIMEOUT)[0]
    for family in ROUND_TRIP:
        adapter, base = tmp_path / f"{family}-adapter", tmp_path / f"{family}-base"
        saved = load_file(adapter / "adapter_model.safetensors")
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["fan_in_fan_out"] == (family == "gpt2") and config["r"] == 4
        assert config["task_type"] == ("SEQ_CLS" if family == "bert" else "CAUSAL_LM")
        assert all(k.startswith("base_model.model.") for k in saved)
        assert sorted(k for k in saved if ".lora_" not in k) == SAVED_WHOLE.get(family, [])
        assert config["modules_to_save"] == (["classifier"] if family == "bert" else None)

        reference = peft.PeftModel.from_pretrained(_auto_class(family).from_pretrained(base), adapter)
        _, _, inputs, _ = hf_and_batch(family)
        with torch.no_grad():
            expected = reference(**inputs).logits
        close(logits[family], expected, 1e-5, f"{family} logits through peft")

        single = gather_adapters(colozoo.from_pretrained(base, adapter=adapter))
        for name, tensors in (("tp1", single), ("tp4", at_tp4[family]), ("colozoo tp4", at_tp4[f"{family}-colozoo"])):
            assert tensors.keys() == saved.keys(), name
            assert all(torch.equal(tensors[k], saved[k]) for k in saved), f"{family} adapters at {name} differ"

        merged = _auto_class(family).from_pretrained(tmp_path / f"{family}-merged").state_dict()
        unloaded = reference.merge_and_unload().state_dict()
        assert merged.keys() == unloaded.keys()
        for k in merged:
            close(merged[k], unloaded[k], 1e-6, f"{family} merged {k}")


# --- bad input -------------------------------------------------------------------------------------------------

def _small_model(family="opt"):
    from lora_parity import hf_and_batch

    from colozoo.api import build_model
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.readers import StateDictReader

    config, hf, _, _ = hf_and_batch(family)
    model = build_model(config, device="meta")
    return load_hf_weights(model, StateDictReader(hf.state_dict()), device="cpu"), hf


def test_lora_bad_input(tmp_path):
    import json

    from colozoo.checkpoint.peft import load_peft
    from colozoo.core.errors import CheckpointError
    from colozoo.runtime.lora import apply_lora

    model, _ = _small_model()
    with pytest.raises(ValueError, match=r"unknown LoRA target module\(s\) \['c_attn'\].*q_proj"):
        apply_lora(model, r=4, targets=("q_proj", "c_attn"))
    for r in (0, -2, 1.5):
        with pytest.raises(ValueError, match="rank r must be a positive integer"):
            apply_lora(model, r=r)
    with pytest.raises(ValueError, match="matches no module"):
        apply_lora(model, r=4, targets=r".*\.nothing")
    assert all(p.requires_grad for p in model.parameters()), "a refused apply_lora must leave the model as it was"
    apply_lora(model, r=4)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(model, r=4)
    other, _ = _small_model()
    from colozoo.runtime.training import parallelize

    parallelize(other)
    with pytest.raises(ValueError, match="before parallelize"):
        apply_lora(other, r=4)
    with pytest.raises(ValueError, match="format='peft'"):
        model.save_pretrained(tmp_path / "hf", format="hf")
    assert not (tmp_path / "hf").exists()

    with pytest.raises(CheckpointError, match="not a PEFT adapter directory"):
        load_peft(_small_model()[0], tmp_path)
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "use_dora": True}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="use_dora=True is not supported"):
        load_peft(_small_model()[0], tmp_path)

    import peft

    bert, hf = _small_model("bert")  # PEFT's "dense" takes BERT's pooler too, a plain linear in colozoo
    peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules=["dense"])).save_pretrained(tmp_path / "bert")
    with pytest.warns(UserWarning, match="pooler.dense"), pytest.raises(CheckpointError, match="pooler.dense"):
        load_peft(bert, tmp_path / "bert")


def test_lora_regex_targets_and_bf16_base():
    """A regex target picks modules as PEFT's would; adapters stay fp32 over a bf16 base and train in step with it."""
    import torch

    from colozoo.runtime.lora import apply_lora, lora_modules

    model, _ = _small_model()
    model.to(torch.bfloat16)
    apply_lora(model, r=2, targets=r".*layers\.1\.self_attn\.(k|v)_proj")
    adapters = lora_modules(model)
    assert {h for a in adapters.values() for h in a.hf_modules} == {
        "model.decoder.layers.1.self_attn.k_proj", "model.decoder.layers.1.self_attn.v_proj"}
    assert all(a.A.dtype == a.B.dtype == torch.float32 for a in adapters.values())
    ids = torch.randint(0, 101, (2, 8))
    out = model(ids, labels=ids)
    out.loss.backward()
    assert all(a.A.grad is not None and a.B.grad.abs().sum() > 0 for a in adapters.values())
