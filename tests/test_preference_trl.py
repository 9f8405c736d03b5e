"""--method dpo against TRL: the first step's loss, every metric and the gradients equal those of TRL's DPOTrainer
(fp32) for each loss type, on strings and conversations, full fine-tuning and LoRA; SimPO equals CPOTrainer's; the
reference-free loss is DPO's with a reference of log-prob 0; and the same first step on tp=2, pp=2, dp=2 (DDP and
FSDP) and tp2 x pp2 meshes as on one process."""
import functools

import pytest
import torch
from chat_model import make_chat_llama
from distributed import run_distributed
from lora_parity import chunks_of, full_adapter
from parity import close
from preference_parity import (LOSSES, METRICS, conversation_records, moved_copy, our_config, our_step, string_records,
                               trl_dpo, trl_simpo)

from colozoo.checkpoint.readers import StateDictReader
from colozoo.runtime.clipping import global_grad_norm
from colozoo.runtime.lora import lora_modules

pytest.importorskip("trl")
ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matmuls: one thread is fastest, on a busy machine by far


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("preference")
    base = make_chat_llama(root / "base")
    return {"root": root, "base": base, "policy": moved_copy(base, root / "policy"),
            "strings": string_records(root / "strings.jsonl"),
            "conversations": conversation_records(root / "conversations.jsonl")}


@functools.lru_cache(maxsize=None)
def trl_results(root, fmt: str, lora: bool):
    """TRL's numbers for every loss type, one trainer per data format and fine-tuning kind (shared by the tests)."""
    adapter = root / f"adapter-{fmt}" if lora else None
    return trl_dpo(root / "base", root / "policy", root / f"{fmt}.jsonl", adapter), adapter


def check_metrics(ours: dict, theirs: dict, what: str):
    assert set(theirs) == set(METRICS), theirs
    for key in METRICS:
        close(ours[key], theirs[key], ATOL, f"{what}: {key}")


def check_full_gradients(model, base, grads: dict, what: str):
    """Every gradient of the policy equals TRL's, gathered to its HF name."""
    import transformers

    from parity import check_gradients

    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    check_gradients(model, model.parallel, StateDictReader(hf.state_dict()), StateDictReader(grads), ATOL)


def check_adapter_gradients(model, grads: dict, what: str):
    """Every adapter's A and B gradients equal peft's under TRL."""
    for lora in lora_modules(model).values():
        for hf_module, (a, b) in chunks_of(lora, *full_adapter(model, lora, grad=True)).items():
            close(a, grads[f"{hf_module}.lora_A.default.weight"], ATOL, f"{what}: gradient of {hf_module}'s A")
            close(b, grads[f"{hf_module}.lora_B.default.weight"], ATOL, f"{what}: gradient of {hf_module}'s B")


@pytest.mark.parametrize("fmt,lora,pack", [("strings", False, True), ("conversations", False, True),
                                           ("strings", True, True), ("conversations", True, True),
                                           ("strings", False, False)])
def test_first_step_equals_trl_for_every_loss(setup, fmt, lora, pack, tmp_path):
    """Each pair packed in one row (the default), or two rows (--no-pack)."""
    results, adapter = trl_results(setup["root"], fmt, lora)
    for name, (options, _) in LOSSES.items():
        what = f"{fmt}, {'LoRA' if lora else 'full'}, {'packed' if pack else 'two rows'}, {name}"
        cfg = our_config(setup["base"], setup[fmt], tmp_path, lora_r=4 if lora else None, pack=pack, **options)
        loss, metrics, model = our_step(cfg, setup["base"] if lora else setup["policy"], adapter)
        expected_loss, expected_metrics, grads = results[name]
        close(loss, expected_loss, ATOL, f"{what}: loss")
        check_metrics(metrics, expected_metrics, what)
        if lora:
            check_adapter_gradients(model, grads, what)
        else:
            check_full_gradients(model, setup["policy"], grads, what)


def test_simpo_equals_cpo_trainer(setup, tmp_path):
    expected_loss, expected_metrics = trl_simpo(setup["policy"], setup["strings"], gamma=0.5, beta=2.0)
    cfg = our_config(setup["policy"], setup["strings"], tmp_path, loss_type="simpo", beta=2.0, simpo_gamma=0.5)
    loss, metrics, _ = our_step(cfg, setup["policy"])
    close(loss, expected_loss, ATOL, "SimPO loss")
    check_metrics(metrics, expected_metrics, "SimPO")


def test_reference_free_is_dpo_against_log_prob_zero(setup, tmp_path):
    """The loss of --reference-free is DPO's sigmoid loss of the policy's log-probs alone (TRL's metrics give them)."""
    _, expected_metrics, _ = trl_results(setup["root"], "strings", False)[0]["sigmoid"]
    cfg = our_config(setup["base"], setup["strings"], tmp_path, reference_free=True)
    loss, metrics, model = our_step(cfg, setup["policy"])
    for side in ("chosen", "rejected"):
        close(metrics[f"logps/{side}"], expected_metrics[f"logps/{side}"], ATOL, f"logps/{side}")
        close(metrics[f"rewards/{side}"], 0.1 * metrics[f"logps/{side}"], ATOL, f"rewards/{side}")
    from colozoo.finetune.preference_data import pair_rows, preference_dataset
    from colozoo.finetune.data import load_tokenizer
    from colozoo.runtime.logprobs import forward_logps

    data = preference_dataset(cfg.data, load_tokenizer(setup["base"], 10_000), 64)
    rows = pair_rows(data.take(range(len(data))))
    logps = forward_logps(model, rows["input_ids"], rows["labels"], attention_mask=rows["attention_mask"])["logps"]
    summed = logps.sum(1)
    expected = -torch.nn.functional.logsigmoid(0.1 * (summed[0::2] - summed[1::2])).mean()
    close(loss, expected, ATOL, "reference-free loss")


# --- the same first step on every mesh --------------------------------------------------------------------------

MESHES = {  # name: (world size, degrees, data parallelism, micro-batches); pairs packed in one row, but "pp2"
    "tp2": (2, dict(tp=2), "fsdp", 1),
    "pp2": (2, dict(pp=2), "fsdp", 2),  # two rows per pair: micro-batches must keep them together
    "dp2 ddp": (2, dict(dp=2), "ddp", 1),
    "dp2 fsdp": (2, dict(dp=2), "fsdp", 2),
    "tp2xpp2": (4, dict(tp=2, pp=2), "fsdp", 2),
    "cp2": (2, dict(cp=2), "fsdp", 1),
    "tp2 sequence parallel": (2, dict(tp=2, sequence_parallel=True), "fsdp", 1),
}


def mesh_step(base, policy, data, output, adapter, degrees, data_parallel, micro, pack=True):
    cfg = our_config(base, data, output, lora_r=4 if adapter else None, pack=pack)
    loss, metrics, model = our_step(cfg, base if adapter else policy, adapter, data_parallel, micro, **degrees)
    return loss, metrics, float(global_grad_norm(model))


@pytest.mark.parametrize("mesh", list(MESHES))
def test_first_step_is_the_same_on_every_mesh(setup, mesh, tmp_path):
    world, degrees, data_parallel, micro = MESHES[mesh]
    lora = mesh in ("tp2", "tp2xpp2")  # the adapters' reference (switched off) on the meshes that split them
    adapter = trl_results(setup["root"], "strings", True)[1] if lora else None
    args = (setup["base"], setup["policy"], setup["strings"], tmp_path, adapter)
    expected = mesh_step(*args, {}, "fsdp", 1)
    got = run_distributed(mesh_step, world, *args, degrees, data_parallel, micro, pack=mesh != "pp2", timeout=120)
    for loss, metrics, norm in got:
        close(loss, expected[0], ATOL, f"{mesh}: loss")
        check_metrics(metrics, expected[1], mesh)
        close(norm, expected[2], ATOL, f"{mesh}: gradient norm")
