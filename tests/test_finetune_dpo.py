"""`colozoo finetune --method dpo` end to end: the shipped preference pairs train (rewards/accuracies and
rewards/margins rise over 30 steps), TRL's metric names reach metrics.jsonl, TensorBoard and the progress line, the
second step equals TRL's DPOTrainer through the loop (LoRA, with the PEFT and merged HF exports), and a run
stopped and resumed with precomputed reference log-probs continues exactly."""
import json
import math
import shutil
from pathlib import Path

import pytest
from chat_model import make_chat_llama
from parity import close
from preference_parity import METRICS, string_records, trl_dpo

from colozoo.checkpoint.checksums import write_checksums
from colozoo.finetune.config import FinetuneConfig
from colozoo.finetune.loop import finetune
from colozoo.finetune.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent
PREFERENCE = REPO / "data" / "preference.jsonl"


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matmuls: one thread is fastest, on a busy machine by far


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return make_chat_llama(tmp_path_factory.mktemp("dpo-llama"))


def dpo_run(model, output, data=PREFERENCE, **options) -> FinetuneConfig:
    settings = dict(method="dpo", max_length=64, micro_batch_size=4, lr=1e-3, warmup_steps=2, eval_interval=0,
                    samples=0, save_interval=0, progress=False, plot=False, export_hf=False, eval_fraction=0.0)
    return FinetuneConfig(model=str(model), data=str(data), output=str(output), **{**settings, **options})


def test_thirty_steps_raise_accuracies_and_margins_logged_under_trl_names(chat_model, tmp_path, capfd):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    finetune(dpo_run(chat_model, out, steps=30, tensorboard=str(out / "tb"), progress=True))
    records = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 31))
    first, last = records[:3], records[-10:]
    for key in ("rewards/accuracies", "rewards/margins"):
        before, after = (sum(r[key] for r in rs) / len(rs) for rs in (first, last))
        assert after > before + 0.3, (key, before, after)
    assert records[0]["rewards/margins"] == 0.0  # the first step's policy is its reference
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    for tag in ("loss", *METRICS):
        assert [e.step for e in events.Scalars(tag)] == list(range(1, 31)), tag
        assert events.Scalars(tag)[-1].value == pytest.approx(records[-1][tag], rel=1e-6, abs=1e-7), tag
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("step 30/30")]
    assert "rewards/accuracies" in lines[0] and "rewards/margins" in lines[0], lines


def test_second_step_equals_trl_with_lora_and_exports(chat_model, tmp_path):
    """At step 1 the adapters are zero (B = 0), the policy is its reference and every loss is ln 2: step 2 (the same
    batch, all pairs) is compared, with TRL's DPOTrainer on the policy the checkpoint of step 1 holds (the base and
    its PEFT adapters, merged by peft) against the base as reference."""
    import peft
    import transformers

    data = string_records(tmp_path / "strings.jsonl")
    out = tmp_path / "lora"
    finetune(dpo_run(chat_model, out, data=data, steps=2, save_interval=1, lora_r=4, lora_alpha=8, merge=True,
                     export_hf=True))
    base = transformers.AutoModelForCausalLM.from_pretrained(chat_model)
    stepped = peft.PeftModel.from_pretrained(base, str(out / "checkpoints" / "step-00000001" / "adapter"))
    stepped.merge_and_unload().save_pretrained(tmp_path / "policy")
    expected_loss, expected, _ = trl_dpo(chat_model, tmp_path / "policy", data, losses=("sigmoid",))["sigmoid"]
    second = read_metrics(out / "metrics.jsonl")[1]
    assert second["step"] == 2 and abs(expected_loss - math.log(2)) > 1e-4
    close(second["loss"], expected_loss, 1e-5, "loss")
    for key in METRICS:
        close(second[key], expected[key], 1e-5, key)
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["r"] == 4
    peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(chat_model),
                                   str(out / "adapter"))  # peft loads the final adapters
    transformers.AutoModelForCausalLM.from_pretrained(out / "hf")  # and transformers the merged model


def test_stopped_run_resumes_exactly_with_precomputed_reference(chat_model, tmp_path):
    """--stop-after (what Ctrl-C does at the end of a step) saves; the resumed run reads the reference log-probs the
    checkpoint carries (the weights they came from are trained away) and logs what an uninterrupted run logs, its
    evaluations (TRL's metrics with eval_ in front) included."""
    options = dict(steps=4, precompute_ref_logps=True, save_interval=2, eval_fraction=0.1, eval_interval=2)
    finetune(dpo_run(chat_model, tmp_path / "straight", **options))
    finetune(dpo_run(chat_model, tmp_path / "stopped", stop_after=2, **options))
    assert (tmp_path / "stopped" / "checkpoints" / "step-00000002" / "reference_logps.safetensors").exists()
    (tmp_path / "stopped" / "reference_logps.safetensors").unlink()  # the checkpoint's copy is what resumes
    finetune(dpo_run(chat_model, tmp_path / "stopped", **options))
    straight, resumed = (read_metrics(tmp_path / run / "metrics.jsonl") for run in ("straight", "stopped"))
    assert [r["step"] for r in resumed] == [0, 1, 2, 2, 3, 4, 4]  # evaluations at 0, 2 and 4
    for a, b in zip(straight, resumed):
        keys = [f"eval_{k}" for k in ("loss", *METRICS)] if "eval_loss" in a else ["loss", *METRICS]
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (a["step"], key)
    shutil.rmtree(tmp_path / "stopped" / "checkpoints" / "step-00000004")  # resume from step 2 again, but
    step_2 = tmp_path / "stopped" / "checkpoints" / "step-00000002"
    (step_2 / "reference_logps.safetensors").unlink()  # without them
    with pytest.raises(ValueError, match="reference_logps.safetensors is listed in checksums.json but missing"):
        finetune(dpo_run(chat_model, tmp_path / "stopped", **options))
    write_checksums(step_2)  # as a checkpoint saved without the option says it
    with pytest.raises(ValueError, match="saved without --precompute-ref-logps"):
        finetune(dpo_run(chat_model, tmp_path / "stopped", **options))


def test_truncation_is_counted_and_an_implicit_prompt_extracted_from_jsonl_and_parquet(chat_model, tmp_path):
    from colozoo.finetune.data import load_tokenizer
    from colozoo.finetune.preference_data import fit_note, pack_pairs, preference_dataset

    tokenizer = load_tokenizer(chat_model, 10_000)
    records = [{"prompt": "the fox ate some berries on Monday", "chosen": " the cat ate some apples on Friday",
                "rejected": " no"},
               {"chosen": "the dog ate some cheese", "rejected": "the dog ate some honey"}]  # prompt implicit
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = preference_dataset(path, tokenizer, max_length=8, max_prompt_length=4)
    assert data.stats == {"pairs": 2, "prompt_cut": 1, "chosen_cut": 1, "rejected_cut": 0}
    ids, labels = data.tensors["input_ids"], data.tensors["labels"]
    words = lambda text: tokenizer(text=text)["input_ids"]  # noqa: E731
    assert ids[0, 0].tolist() == words("some berries on Monday the cat ate some")  # the prompt's end, the start
    assert labels[0, 1].tolist() == [-100] * 4 + words(" no") + [tokenizer.eos_token_id] + [-100] * 2
    assert ids[1, 1, :6].tolist() == words("the dog ate some honey") + [tokenizer.eos_token_id]
    assert labels[1, 1, :6].tolist() == [-100] * 4 + words(" honey") + [tokenizer.eos_token_id]
    import pyarrow as pa
    import pyarrow.parquet

    pa.parquet.write_table(pa.Table.from_pylist(records), tmp_path / "pairs.parquet")  # the missing prompt: null
    same = preference_dataset(tmp_path / "pairs.parquet", tokenizer, max_length=8, max_prompt_length=4)
    assert all((same.tensors[k] == data.tensors[k]).all() for k in data.tensors)
    packed = pack_pairs(data.take([0, 1]))  # a pair in one row: chosen, then rejected from position 0 again
    lengths = data.tensors["attention_mask"][:2].sum(-1)
    assert packed["split"].tolist() == lengths[:, 0].tolist() and "attention_mask" not in packed
    row, split = packed["input_ids"][1], int(packed["split"][1])
    assert row[:split].tolist() == ids[1, 0, :split].tolist()
    assert row[split:split + int(lengths[1, 1])].tolist() == ids[1, 1, :int(lengths[1, 1])].tolist()
    assert packed["position_ids"][1, split] == 0 and packed["labels"][1, split] == -100
    note = fit_note(data.stats, path, 8, 4)
    assert note == (f"of 2 pairs in {path}: 1 prompts cut to their last --max-prompt-length 4 tokens, 1 chosen "
                    f"completions cut at --max-length 8")


def test_adapters_disabled_for_one_forward_leaves_nothing_behind(chat_model):
    """The LoRA reference: inside adapters_disabled the model is its base; after it (an exception included) every
    adapter is back."""
    import torch

    from colozoo.api import from_pretrained
    from colozoo.runtime.lora import adapters_disabled, apply_lora, lora_modules

    base = from_pretrained(str(chat_model), dtype=torch.float32)
    model = apply_lora(from_pretrained(str(chat_model), dtype=torch.float32), r=4, targets="all-linear")
    with torch.no_grad():
        for lora in lora_modules(model).values():
            lora.B.normal_(std=0.1)
    ids = torch.arange(3, 13)[None]
    adapted = model(ids).logits
    with adapters_disabled(model):
        torch.testing.assert_close(model(ids).logits, base(ids).logits, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="inside"):
        with adapters_disabled(model):
            raise RuntimeError("inside")
    assert (model(ids).logits - base(ids).logits).abs().max() > 1e-3
    torch.testing.assert_close(model(ids).logits, adapted, rtol=0, atol=0)
