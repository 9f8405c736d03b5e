"""colozoo finetune shows what the model writes: greedy continuations of held-out prompts at every evaluation,
printed and in samples.jsonl; the last ones are what transformers generates from the exported model."""
import json

import torch
import transformers

from test_finetune import small_run, tiny  # noqa: F401 (a fixture)

from colozoo.finetune import finetune


def test_samples_at_every_evaluation_match_the_exported_model(tiny, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    summary = finetune(small_run(tiny, out, export_hf=True, samples=2, sample_tokens=4, eval_interval=3))
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 0, 3, 3, 6, 6]
    assert records[0]["prompt"] == records[2]["prompt"] and records[0]["prompt"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(summary["export"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(summary["export"]).eval()
    for record in records[-2:]:
        ids = tokenizer(record["prompt"], return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            expected = hf.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        assert tokenizer.decode(expected[0, ids["input_ids"].shape[1]:], skip_special_tokens=True) == \
            record["completion"]


def test_no_samples_when_asked_for_none(tiny, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    finetune(small_run(tiny, out, samples=0))
    assert not (out / "samples.jsonl").exists()
